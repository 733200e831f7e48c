//! "Why was this a miss?": each reason a lookup can miss for, driven over real ZMQ (an engine
//! registered through LMCache's protocol, stores and lookups as an engine sends them), read back
//! from `GET /cache/requests/{id}/explain` and counted in `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use lmcache_client::{CacheKey, Client};
use lmcache_core::{CacheSalt, Dtype, ModelName, ObjectKey, TokenHasher};
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_server::{Server, ServerConfig};
use lmcache_storage::{PeerDone, PeerFetch, PeerSource, PrefetchOutcome, PrefetchTrouble};
use serde_json::{Value, json};

mod common;

const CHUNK: usize = 16;
const ID: u64 = 7;
/// One chunk's object: `[2, 2 layers, 16 slots, 32]` float16.
const OBJECT: u64 = 2 * 2 * 16 * 32 * 2;

struct Rig {
    s: Server,
    c: Client,
    pool: ForeignSegment,
}

fn rig(tag: &str, objects: u64, l2: Vec<Value>, tweak: impl FnOnce(&mut ServerConfig)) -> Rig {
    let arena = ArenaConfig {
        size: objects * OBJECT,
        backing: ArenaBacking::SharedMemory {
            name: format!("lmcache_rs_explain_{tag}_{}", std::process::id()),
        },
        mlock: false,
    };
    let mut config = ServerConfig {
        chunk_size: CHUNK,
        http_port: Some(0),
        l2_adapters: l2,
        ..ServerConfig::local(arena)
    };
    tweak(&mut config);
    let s = Server::start(config).unwrap();
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(10)).unwrap();
    let reg = common::small_registration(ID, "m", Dtype::Float16);
    let pool = c.register_engine_driven(&reg).unwrap();
    let pool = ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap();
    Rig { s, c, pool }
}

/// `chunks` whole chunks of tokens, distinct per `seed`.
fn tokens(seed: u32, chunks: usize) -> Vec<u32> {
    (0..(chunks * CHUNK) as u32).map(|i| seed * 100_000 + i).collect()
}

fn key(seed: u32, chunks: usize, salt: &str, request: &str) -> CacheKey {
    let mut k = CacheKey::whole(ModelName::new("m").unwrap(), request, tokens(seed, chunks), CHUNK);
    k.cache_salt = CacheSalt::new(salt).unwrap();
    k
}

/// The object key of chunk `i` of `seed`'s tokens (salt empty, one shard).
fn object_key(seed: u32, chunks: usize, i: usize) -> ObjectKey {
    let h = TokenHasher::new(CHUNK).unwrap().hash_tokens(&tokens(seed, chunks))[i];
    ObjectKey::new(h.0, "m", 1, 0, 0, "").unwrap()
}

impl Rig {
    /// Stores what L1 accepts of `k`; returns the chunks it accepted.
    fn store(&mut self, k: &CacheKey) -> usize {
        let k = k.for_worker(0);
        let slots = self.c.prepare_store(&k, ID).unwrap();
        for (_, s) in &slots {
            self.pool.write(s.offset, &vec![0x5a; s.length as usize]).unwrap();
        }
        self.c.commit_store(&k, ID).unwrap();
        self.c.end_session(&k.request_id).unwrap();
        slots.len()
    }

    /// A lookup as a scheduler sends it; the session ends (its locks go) unless `hold`.
    fn lookup(&mut self, k: &CacheKey, hold: bool) -> u64 {
        let hits = self.c.lookup(k).unwrap();
        if !hold {
            self.c.end_session(&k.request_id).unwrap();
        }
        hits
    }

    fn explain(&self, request: &str) -> Value {
        let (code, text) = common::http_raw(
            &self.s,
            "GET",
            &format!("/cache/requests/{request}/explain"),
            None,
            Duration::from_secs(10),
        );
        assert_eq!(code, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    /// `(first chunk, chunks, reason or "hit")` of each run of `request`'s explanation.
    fn runs(&self, request: &str) -> Vec<(u64, u64, String)> {
        let v = self.explain(request);
        v["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let what = if r["outcome"] == "hit" {
                    "hit".to_owned()
                } else {
                    r["reason"].as_str().unwrap().to_owned()
                };
                (r["first_chunk"].as_u64().unwrap(), r["chunks"].as_u64().unwrap(), what)
            })
            .collect()
    }

    fn first_miss(&self, request: &str) -> Value {
        let v = self.explain(request);
        let chunk = v["first_miss"]["chunk"].as_u64().unwrap();
        v["runs"].as_array().unwrap().iter().find(|r| r["first_chunk"] == chunk).unwrap().clone()
    }

    fn metrics(&self) -> String {
        common::http_raw(&self.s, "GET", "/metrics", None, Duration::from_secs(10)).1
    }
}

fn run(first: u64, n: u64, what: &str) -> (u64, u64, String) {
    (first, n, what.to_owned())
}

#[test]
fn l1_reasons_never_stored_other_salt_locked_deleted_behind_a_miss_unregistered() {
    let mut r = rig("l1", 16, Vec::new(), |_| {});

    // Nothing stored: every chunk never_stored.
    assert_eq!(r.lookup(&key(1, 3, "", "cold"), false), 0);
    assert_eq!(r.runs("cold"), vec![run(0, 3, "never_stored")]);

    // Stored under salt A, looked up under salt B: the explanation names what holds it.
    assert_eq!(r.store(&key(2, 3, "tenant-a", "store-a")), 3);
    assert_eq!(r.lookup(&key(2, 3, "tenant-b", "as-b"), false), 0);
    assert_eq!(r.runs("as-b"), vec![run(0, 3, "other_variant")]);
    let m = r.first_miss("as-b");
    assert_eq!(m["stored_as"]["cache_salt"], "tenant-a", "{m}");
    assert_eq!(m["stored_as"]["model"], "m");
    assert_eq!(r.lookup(&key(2, 3, "tenant-a", "as-a"), false), 3);
    assert_eq!(r.runs("as-a"), vec![run(0, 3, "hit")]);

    // A store in flight: its chunks are write-locked.
    let writer = key(3, 2, "", "writer").for_worker(0);
    let slots = r.c.prepare_store(&writer, ID).unwrap();
    assert_eq!(slots.len(), 2);
    assert_eq!(r.lookup(&key(3, 2, "", "reader"), false), 0);
    assert_eq!(r.runs("reader"), vec![run(0, 2, "locked")]);
    r.c.commit_store(&writer, ID).unwrap();
    r.c.end_session("writer").unwrap();

    // Chunk 1 of 3 deleted: chunk 0 hits, 1 is deleted, 2 sits behind the miss.
    assert_eq!(r.store(&key(4, 3, "", "store-d")), 3);
    r.s.state().l1().delete(&[object_key(4, 3, 1)], false).pop().unwrap().unwrap();
    assert_eq!(r.lookup(&key(4, 3, "", "gap"), false), 1);
    assert_eq!(
        r.runs("gap"),
        vec![run(0, 1, "hit"), run(1, 1, "deleted"), run(2, 1, "behind_miss")]
    );
    let m = r.first_miss("gap");
    assert_eq!((m["tier"].as_str(), m["how"].as_str()), (Some("L1"), Some("deleted")), "{m}");
    assert!(m["seconds_ago"].as_f64().unwrap() < 60.0);

    // A clear: every chunk cleared.
    r.s.state().l1().clear(false);
    assert_eq!(r.lookup(&key(4, 3, "", "after-clear"), false), 0);
    // Chunk 1 was deleted before the clear and never stored again: its own run.
    assert_eq!(
        r.runs("after-clear"),
        vec![run(0, 1, "deleted"), run(1, 1, "deleted"), run(2, 1, "deleted")]
    );
    let hows: Vec<Value> = r.explain("after-clear")["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["how"].clone())
        .collect();
    assert_eq!(hows, vec![json!("cleared"), json!("deleted"), json!("cleared")]);

    // A model no engine registered: nothing was looked up.
    let mut other = key(5, 2, "", "unregistered");
    other.model_name = ModelName::new("other-model").unwrap();
    assert_eq!(r.lookup(&other, false), 0);
    assert_eq!(r.runs("unregistered"), vec![run(0, 2, "not_registered")]);

    // Counted by reason; an unknown request is a 404 that says why.
    let m = r.metrics();
    for (reason, n) in [("never_stored", 3), ("other_variant", 3), ("locked", 2), ("deleted", 4)] {
        let line = format!("lmcache_rs_lookup_miss_chunks_total{{reason=\"{reason}\"}} {n}");
        assert!(m.contains(&line), "metrics lack {line}");
    }
    let (code, text) = common::http_raw(
        &r.s,
        "GET",
        "/cache/requests/nobody/explain",
        None,
        Duration::from_secs(10),
    );
    assert_eq!(code, 404);
    assert!(text.contains("nobody"), "{text}");
}

#[test]
fn evicted_for_memory_and_for_quota_and_refused_by_quota() {
    // Eight objects of room.
    let mut r = rig("evict", 8, Vec::new(), |_| {});
    assert_eq!(r.store(&key(1, 4, "", "e1")), 4);
    assert_eq!(r.store(&key(2, 4, "", "e2")), 4);
    assert_eq!(r.store(&key(3, 4, "", "e3")), 4, "room is made by evicting e1");
    assert_eq!(r.lookup(&key(1, 4, "", "e1-again"), false), 0);
    let m = r.first_miss("e1-again");
    assert_eq!(m["reason"], "evicted", "{m}");
    assert_eq!((m["tier"].as_str(), m["policy"].as_str()), (Some("L1"), Some("LRU")));
    assert_eq!(m["trigger"], "memory");

    // A tenant with room for two objects: a store of three is refused (a batch is all or
    // nothing per tenant)...
    r.s.state().l1().clear(true);
    let q = CacheSalt::new("tenant-q").unwrap();
    r.s.state().l1().set_quota(&q, Some(2 * OBJECT));
    assert_eq!(r.store(&key(4, 3, "tenant-q", "q1")), 0);
    assert_eq!(r.lookup(&key(4, 3, "tenant-q", "q1-again"), false), 0);
    assert_eq!(r.runs("q1-again"), vec![run(0, 3, "quota_refused")]);
    // ...and a later store of the tenant evicts its own older objects for the quota.
    assert_eq!(r.store(&key(5, 2, "tenant-q", "q2")), 2);
    assert_eq!(r.store(&key(6, 2, "tenant-q", "q3")), 2);
    assert_eq!(r.lookup(&key(5, 2, "tenant-q", "q2-again"), false), 0);
    let m = r.first_miss("q2-again");
    assert_eq!(
        (m["reason"].as_str(), m["trigger"].as_str()),
        (Some("evicted"), Some("quota")),
        "{m}"
    );
    let metrics = r.metrics();
    assert!(metrics.contains("lmcache_rs_lookup_miss_chunks_total{reason=\"quota_refused\"} 3"));
}

#[test]
fn a_store_refused_for_memory_is_no_memory() {
    // Four objects of room, all read-locked by a lookup that holds them.
    let mut r = rig("oom", 4, Vec::new(), |_| {});
    assert_eq!(r.store(&key(1, 4, "", "fill")), 4);
    assert_eq!(r.lookup(&key(1, 4, "", "holder"), true), 4);
    assert_eq!(r.store(&key(2, 1, "", "refused")), 0, "nothing can be evicted");
    assert_eq!(r.lookup(&key(2, 1, "", "refused-again"), false), 0);
    assert_eq!(r.runs("refused-again"), vec![run(0, 1, "no_memory")]);
    r.c.end_session("holder").unwrap();
}

fn fs(dir: &std::path::Path) -> Value {
    json!({"type": "fs", "base_path": dir})
}

/// A server with one L2 adapter: stores `seed`'s 3 chunks, waits until L2 has them, clears L1
/// and looks them up again as request `again` (every hit must come from L2).
fn from_l2(tag: &str, adapter: Value, tweak: impl FnOnce(&mut ServerConfig)) -> Rig {
    let mut r = rig(tag, 16, vec![adapter], tweak);
    assert_eq!(r.store(&key(1, 3, "", "stored")), 3);
    assert_eq!(r.s.state().storage.flush(Duration::from_secs(10)), 0);
    r.s.state().l1().clear(true);
    r.lookup(&key(1, 3, "", "again"), false);
    r
}

#[test]
fn l2_reasons_error_timeout_corrupt_blob_and_capacity_eviction() {
    let dir = tempfile::tempdir().unwrap();
    // Sanity: a plain fs L2 serves the chunks back.
    let r = from_l2("l2ok", fs(&dir.path().join("ok")), |_| {});
    assert_eq!(r.runs("again"), vec![run(0, 3, "hit")]);
    assert_eq!(r.explain("again")["loaded_chunks"], 3);

    let faulty = |sub: &str, ops: &str, mode: &str| {
        json!({"type": "fault_inject", "inner": fs(&dir.path().join(sub)), "rate": 1.0,
               "ops": [ops], "mode": mode, "delay_ms": 3000})
    };
    let r = from_l2("l2err", faulty("err", "lookup", "fail"), |_| {});
    assert_eq!(r.runs("again"), vec![run(0, 3, "l2_error")]);
    let m = r.first_miss("again");
    assert_eq!(m["adapter"], "fault_inject#0", "{m}");
    assert!(!m["error"].as_str().unwrap().is_empty());

    let r = from_l2("l2slow", faulty("slow", "lookup", "delay"), |c| {
        c.l2.prefetch_deadline = Duration::from_millis(200);
    });
    assert_eq!(r.runs("again"), vec![run(0, 3, "l2_timeout")]);

    let r = from_l2("l2bad", faulty("bad", "load", "corrupt"), |_| {});
    assert_eq!(r.runs("again"), vec![run(0, 3, "l2_corrupt")]);

    // An fs L2 with room for about five blobs: storing more evicts the first ones from it.
    let small = json!({"type": "fs", "base_path": dir.path().join("small"),
                       "max_capacity_gb": 5.5 * (OBJECT + 512) as f64 / (1u64 << 30) as f64});
    let mut r = from_l2("l2evict", small, |_| {});
    assert_eq!(r.store(&key(2, 3, "", "more")), 3);
    assert_eq!(r.s.state().storage.flush(Duration::from_secs(10)), 0);
    r.s.state().l1().clear(true);
    // The prefix's last chunks are the first to go (a lookup touches a prefix last to first).
    let hits = r.lookup(&key(1, 3, "", "evicted"), false);
    assert!(hits < 3, "nothing was evicted from the small L2");
    let m = r.first_miss("evicted");
    assert_eq!(m["first_chunk"].as_u64(), Some(hits));
    assert_eq!((m["reason"].as_str(), m["tier"].as_str()), (Some("evicted"), Some("fs#0")), "{m}");
    assert_eq!(m["trigger"], "capacity");
}

/// A fleet whose every peer fails, as the P2P reader reports an unreachable peer.
#[derive(Debug)]
struct DeadPeers;

impl PeerSource for DeadPeers {
    fn has_peers(&self) -> bool {
        true
    }
    fn start(&self, _req: PeerFetch, done: PeerDone) {
        done.complete(PrefetchOutcome {
            trouble: Some(PrefetchTrouble::Peer {
                peer: "server-b".into(),
                error: "unreachable: connection refused".into(),
            }),
            ..PrefetchOutcome::default()
        });
    }
}

#[test]
fn a_peer_that_does_not_answer_is_named() {
    let mut r = rig("peer", 16, Vec::new(), |_| {});
    assert!(r.s.state().storage.set_peer_source(Arc::new(DeadPeers)));
    assert_eq!(r.lookup(&key(1, 2, "", "via-peer"), false), 0);
    assert_eq!(r.runs("via-peer"), vec![run(0, 2, "peer_failed")]);
    let m = r.first_miss("via-peer");
    assert_eq!(m["peer"], "server-b", "{m}");
}

#[test]
fn concurrent_clients_on_the_same_keys_each_get_their_own_lookups_explanation() {
    let r = rig("conc", 64, Vec::new(), |_| {});
    let endpoint = r.s.endpoint().to_owned();
    let pool_name = {
        let mut c = Client::connect(&endpoint, Duration::from_secs(10)).unwrap();
        c.register_engine_driven(&common::small_registration(ID + 1, "m", Dtype::Float16)).unwrap()
    };
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let endpoint = endpoint.clone();
            let (name, size) = (pool_name.shm_name.clone(), pool_name.pool_size);
            std::thread::spawn(move || {
                let mut c = Client::connect(&endpoint, Duration::from_secs(10)).unwrap();
                let pool = ForeignSegment::open(&name, size).unwrap();
                let mut seen = Vec::new();
                for i in 0..20u32 {
                    let seed = i % 5; // every thread works the same five prompts
                    let id = format!("t{t}-{i}");
                    let hits = c.lookup(&key(seed, 3, "", &id)).unwrap();
                    c.end_session(&id).unwrap();
                    seen.push((id, hits));
                    if hits < 3 {
                        let k = key(seed, 3, "", &format!("s{t}-{i}")).for_worker(0);
                        for (_, s) in c.prepare_store(&k, ID + 1).unwrap() {
                            pool.write(s.offset, &vec![1; s.length as usize]).unwrap();
                        }
                        c.commit_store(&k, ID + 1).unwrap();
                        c.end_session(&k.request_id).unwrap();
                    }
                }
                seen
            })
        })
        .collect();
    for t in threads {
        for (id, hits) in t.join().unwrap() {
            let v = r.explain(&id);
            assert_eq!(v["hit_chunks"].as_u64(), Some(hits), "{v}");
            let runs = r.runs(&id);
            let covered: u64 = runs.iter().map(|(_, n, _)| n).sum();
            assert_eq!(covered, 3, "{v}");
            for (_, _, what) in &runs {
                assert!(
                    ["hit", "never_stored", "locked", "behind_miss"].contains(&what.as_str()),
                    "{v}"
                );
            }
        }
    }
}
