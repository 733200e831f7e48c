//! Salt isolation: a client using cache_salt A never reads what was stored under salt B,
//! through lookup, retrieve, HTTP listing, HTTP prefetch or the L2 key space (an fs L2 that
//! two salts share, with L1 cleared so every hit must come from L2).

use std::time::{Duration, Instant};

use lmcache_client::{CacheKey, Client};
use lmcache_core::{CacheSalt, Dtype, ModelName};
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_server::{Server, ServerConfig};
use serde_json::{Value, json};

mod common;

const CHUNK: usize = 16;
const ID: u64 = 11;

fn http(s: &Server, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    let (status, text) = common::http_raw(s, method, path, body, Duration::from_secs(10));
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

fn model() -> ModelName {
    ModelName::new("m").unwrap()
}

fn tokens() -> Vec<u32> {
    (0..3 * CHUNK as u32).map(|i| i * 7 + 1).collect()
}

fn key(salt: &str, request: &str) -> CacheKey {
    let mut k = CacheKey::whole(model(), request, tokens(), CHUNK);
    k.cache_salt = CacheSalt::new(salt).unwrap();
    k
}

/// Stores every chunk of `salt`'s key, chunk `i` filled with `fill + i`.
fn store(c: &mut Client, pool: &ForeignSegment, salt: &str, fill: u8) {
    let k = key(salt, &format!("store-{salt}")).for_worker(0);
    let slots = c.prepare_store(&k, ID).unwrap();
    assert_eq!(slots.len(), 3, "salt {salt}: every chunk is new to it");
    for (i, s) in &slots {
        pool.write(s.offset, &vec![fill + *i as u8; s.length as usize]).unwrap();
    }
    assert!(c.commit_store(&k, ID).unwrap());
    c.end_session(&k.request_id).unwrap();
}

/// Lookup then retrieve under `salt`: the hit count, and the chunks' first bytes.
fn read(c: &mut Client, pool: &ForeignSegment, salt: &str, request: &str) -> (u64, Vec<u8>) {
    let k = key(salt, request);
    let hits = c.lookup(&k).unwrap();
    let mut firsts = Vec::new();
    if let Some(slots) = c.prepare_retrieve(&k.for_worker(0), ID).unwrap() {
        for s in &slots {
            let mut buf = vec![0u8; s.length as usize];
            pool.read(s.offset, &mut buf).unwrap();
            assert!(buf.iter().all(|&b| b == buf[0]), "a torn chunk");
            firsts.push(buf[0]);
        }
    }
    c.commit_retrieve(&k.for_worker(0), ID).unwrap();
    c.end_session(request).unwrap();
    (hits, firsts)
}

fn listing(s: &Server, query: &str) -> Vec<Value> {
    let (code, v) = http(s, "GET", &format!("/cache/objects?{query}"), None);
    assert_eq!(code, 200, "{v}");
    v["entries"].as_array().unwrap().clone()
}

fn prefetch_found(s: &Server, salt: &str) -> u64 {
    let body = json!({"model_name": "m", "token_ids": tokens(), "cache_salt": salt});
    let (code, r) = http(s, "POST", "/cache/prefetches", Some(&body.to_string()));
    assert_eq!(code, 202, "{r}");
    let id = r["request_id"].as_str().unwrap().to_owned();
    let t0 = Instant::now();
    loop {
        let (_, st) = http(s, "GET", &format!("/cache/prefetches/{id}"), None);
        if st["status"] == "completed" {
            return st["found_keys"].as_u64().unwrap();
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "prefetch never completed");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn one_salt_never_reads_another_salts_objects() {
    let dir = tempfile::tempdir().unwrap();
    let arena = ArenaConfig {
        size: 32 << 20,
        backing: ArenaBacking::SharedMemory {
            name: format!("lmcache_rs_tenants_{}", std::process::id()),
        },
        mlock: false,
    };
    let s = Server::start(ServerConfig {
        chunk_size: CHUNK,
        http_port: Some(0),
        l2_adapters: vec![json!({"type": "fs", "base_path": dir.path()})],
        ..ServerConfig::local(arena)
    })
    .unwrap();
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(5)).unwrap();
    let reg = common::small_registration(ID, "m", Dtype::Float16);
    let pool = c.register_engine_driven(&reg).unwrap();
    let pool = ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap();

    // Salt A stores; salt B (and the unsalted) see nothing of it, in L1.
    store(&mut c, &pool, "tenant-a", 0xa0);
    assert_eq!(read(&mut c, &pool, "tenant-b", "b1"), (0, vec![]), "salt B read A's chunks");
    assert_eq!(read(&mut c, &pool, "", "u1"), (0, vec![]), "no salt read A's chunks");
    assert_eq!(read(&mut c, &pool, "tenant-a", "a1"), (3, vec![0xa0, 0xa1, 0xa2]));
    // A retrieve without a lookup, under B: nothing to hand out.
    let kb = key("tenant-b", "b2").for_worker(0);
    assert!(c.prepare_retrieve(&kb, ID).unwrap().is_none(), "prepare_retrieve under B");
    assert!(!c.commit_retrieve(&kb, ID).unwrap());

    // HTTP listing, filtered by salt, in L1 and L2.
    assert_eq!(s.state().storage.flush(Duration::from_secs(10)), 0);
    assert!(listing(&s, "cache_salt=tenant-b").is_empty());
    assert!(listing(&s, "cache_salt=_default").is_empty());
    let a = listing(&s, "cache_salt=tenant-a");
    assert_eq!(a.len(), 3);
    assert!(a.iter().all(|e| e["cache_salt"] == "tenant-a"), "{a:?}");
    assert!(listing(&s, "tier=l2&cache_salt=tenant-b").is_empty());
    assert_eq!(listing(&s, "tier=l2&cache_salt=tenant-a").len(), 3);

    // B stores the same tokens with other bytes: two objects per chunk in the shared L2.
    store(&mut c, &pool, "tenant-b", 0xb0);
    assert_eq!(s.state().storage.flush(Duration::from_secs(10)), 0);
    assert_eq!(listing(&s, "tier=l2").len(), 6, "one object per chunk and salt in L2");

    // With L1 cleared every hit comes from L2: each salt gets its own bytes back.
    s.state().l1().clear(true);
    assert_eq!(read(&mut c, &pool, "tenant-b", "b3"), (3, vec![0xb0, 0xb1, 0xb2]));
    s.state().l1().clear(true);
    assert_eq!(read(&mut c, &pool, "tenant-a", "a3"), (3, vec![0xa0, 0xa1, 0xa2]));
    s.state().l1().clear(true);
    assert_eq!(read(&mut c, &pool, "tenant-c", "c3"), (0, vec![]), "salt C read from L2");

    // HTTP prefetch finds only the named salt's objects.
    s.state().l1().clear(true);
    assert_eq!(prefetch_found(&s, "tenant-c"), 0);
    assert!(listing(&s, "").is_empty(), "a prefetch for C loaded something");
    assert_eq!(prefetch_found(&s, "tenant-a"), 3);
    let l1 = listing(&s, "");
    assert_eq!(l1.len(), 3);
    assert!(l1.iter().all(|e| e["cache_salt"] == "tenant-a"), "{l1:?}");
}
