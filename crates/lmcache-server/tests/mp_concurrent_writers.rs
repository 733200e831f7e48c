//! Several writers of the same chunks at once, over real ZMQ: a store is acknowledged only
//! for chunks that are visible. A store that finds its chunks staged by another writer (an
//! engine-driven client copying its blocks itself, slowly, or dead) writes its own copy
//! instead of counting on that writer; the first commit makes the chunks visible and the
//! later one succeeds without changing them. In every case, a lookup right after an
//! acknowledged store hits.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use lmcache_client::{CacheKey, Client, EngineGroupInfo};
use lmcache_core::{Dtype, ModelName};
use lmcache_memory::shm::ShmSegment;
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_protocol::Op;
use lmcache_protocol::types::EngineDrivenRegistration;
use lmcache_server::{Server, ServerConfig};
use rmpv::Value;

const CHUNK: usize = 16;
const BS: u64 = 4;
const NB: u64 = 16;
const CHUNKS: usize = 2;

fn server(tag: &str, write_ttl: Duration) -> Server {
    Server::start(ServerConfig {
        chunk_size: CHUNK,
        max_gpu_workers: 2,
        l1: lmcache_l1::L1Config {
            write_ttl,
            maintenance_interval: Duration::from_millis(20),
            ..lmcache_l1::L1Config::default()
        },
        ..ServerConfig::local(ArenaConfig {
            size: 32 << 20,
            backing: ArenaBacking::SharedMemory {
                name: format!("lmrs_cw_l1_{tag}_{}", std::process::id()),
            },
            mlock: false,
        })
    })
    .unwrap()
}

fn client(s: &Server) -> Client {
    Client::connect(s.endpoint(), Duration::from_secs(30)).unwrap()
}

fn model() -> ModelName {
    ModelName::new("m").unwrap()
}

fn key(request: &str) -> CacheKey {
    let tokens: Vec<u32> = (0..(CHUNK * CHUNKS) as u32).map(|t| t * 13 + 5).collect();
    CacheKey::whole(model(), request, tokens, CHUNK)
}

/// An lmcache-driven worker (instance 1): one fp16 layer `[2, NB, BS, 2, 4]` in a segment of
/// its own, filled with `fill`.
fn lmcache_driven(c: &mut Client, tag: &str, fill: u8) -> (ShmSegment, ForeignSegment) {
    let name = format!("lmrs_cw_kv_{tag}_{}", std::process::id());
    let (owner, seg, desc) = common::cpu_shm_layer(&name, vec![2, NB, BS, 2, 4]);
    seg.write(0, &vec![fill; seg.len() as usize]).unwrap();
    c.register_kv_cache(1, &[desc], "m", 1, &[EngineGroupInfo::full(0, vec![0], BS)]).unwrap();
    (owner, seg)
}

/// The lmcache-driven `store` of `k` from blocks 0..8: the reply's success flag.
fn store_lmcache_driven(c: &mut Client, k: &CacheKey) -> bool {
    let blocks = Value::Array(vec![Value::Array(
        (0..(CHUNK * CHUNKS) as u64 / BS).map(Value::from).collect(),
    )]);
    let params = [k.for_worker(0).encode(), Value::from(1u64), blocks, Value::Binary(vec![])];
    let r = c.call(Op::Store, &params).unwrap().unwrap();
    r.as_array().unwrap()[1].as_bool().unwrap()
}

/// Registers engine-driven instance 7 (model `m`, objects the lmcache-driven ones' size) and
/// maps its pool.
fn register_engine_driven(c: &mut Client) -> ForeignSegment {
    let reg = EngineDrivenRegistration {
        instance_id: 7,
        model_name: model(),
        world_size: 1,
        block_size: 16,
        num_layers: 1,
        hidden_dim_size: 8,
        dtype: Dtype::Float16,
        use_mla: false,
        num_physical_slots: None,
    };
    let pool = c.register_engine_driven(&reg).unwrap();
    ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap()
}

/// An engine-driven writer on its own client and thread: it prepares the store of `k` (so
/// its chunks are staged), reports, then after `hold` writes and commits them, unless `die`
/// (then it walks away, its reservations left to expire). Returns its commit's answer.
fn engine_writer(
    s: &Server,
    k: CacheKey,
    hold: Duration,
    die: bool,
    prepared: mpsc::Sender<usize>,
) -> std::thread::JoinHandle<Option<bool>> {
    let endpoint = s.endpoint().to_owned();
    std::thread::spawn(move || {
        let mut c = Client::connect(&endpoint, Duration::from_secs(30)).unwrap();
        let pool = register_engine_driven(&mut c);
        let slots = c.prepare_store(&k.for_worker(0), 7).unwrap();
        prepared.send(slots.len()).unwrap();
        std::thread::sleep(hold);
        if die {
            return None;
        }
        for (_, slot) in &slots {
            pool.write(slot.offset, &vec![0xEE; slot.length as usize]).unwrap();
        }
        Some(c.commit_store(&k.for_worker(0), 7).unwrap())
    })
}

/// Every resident object's bytes are all `byte`.
fn resident_bytes_are(s: &Server, byte: u8) {
    let l1 = s.state().l1();
    let keys: Vec<_> = l1.resident_keys().into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys.len(), CHUNKS);
    for lease in l1.read_lock(&keys, 1) {
        assert!(lease.unwrap().bytes().iter().all(|&b| b == byte), "not the expected copy");
    }
}

#[test]
fn a_store_that_finds_its_chunks_being_written_is_visible_when_acknowledged() {
    let s = server("late", Duration::from_secs(600));
    let mut c = client(&s);
    let (_owner, _seg) = lmcache_driven(&mut c, "late", 0x11);
    let (tx, rx) = mpsc::channel();
    let writer = engine_writer(&s, key("eng"), Duration::from_millis(500), false, tx);
    assert_eq!(rx.recv().unwrap(), CHUNKS, "the engine-driven writer staged every chunk");
    let t = Instant::now();
    assert!(store_lmcache_driven(&mut c, &key("lmc")), "store refused");
    // The very next lookup sees what the reply acknowledged, without waiting for the slow
    // writer.
    assert_eq!(c.lookup(&key("q")).unwrap(), CHUNKS as u64, "acknowledged but not visible");
    assert!(t.elapsed() < Duration::from_millis(400), "the store waited for the other writer");
    // The slow writer's commit succeeds (its chunks are visible) and changes nothing.
    assert_eq!(writer.join().unwrap(), Some(true));
    resident_bytes_are(&s, 0x11);
    assert_eq!(s.state().l1().usage().stats.superseded, CHUNKS as u64);
    assert_eq!(s.state().l1().usage().staged_objects, 0);
}

#[test]
fn a_writer_that_dies_leaves_no_acknowledged_chunk_missing() {
    let s = server("dies", Duration::from_millis(300));
    let mut c = client(&s);
    let (_owner, _seg) = lmcache_driven(&mut c, "dies", 0x22);
    let (tx, rx) = mpsc::channel();
    let writer = engine_writer(&s, key("eng"), Duration::ZERO, true, tx);
    assert_eq!(rx.recv().unwrap(), CHUNKS);
    assert_eq!(writer.join().unwrap(), None);
    assert!(store_lmcache_driven(&mut c, &key("lmc")), "store refused");
    assert_eq!(c.lookup(&key("q")).unwrap(), CHUNKS as u64, "acknowledged but not visible");
    // The dead writer's reservations expire; this store's copy stays.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(s.state().l1().usage().staged_objects, 0, "the dead writer's reservation stayed");
    assert_eq!(c.lookup(&key("q2")).unwrap(), CHUNKS as u64);
    resident_bytes_are(&s, 0x22);
}

/// The measurement of the issue, as a test: two lmcache-driven clients and an engine-driven
/// one store the same 8 prompts at once, each looking up right after each acknowledged store.
#[test]
fn three_clients_storing_the_same_prompts_always_find_what_they_stored() {
    let s = server("three", Duration::from_secs(600));
    let mut c = client(&s);
    let (_owner, _seg) = lmcache_driven(&mut c, "three", 0x44);
    let prompt = |p: u32| {
        let tokens: Vec<u32> = (0..(CHUNK * CHUNKS) as u32).map(|t| t * 7 + p * 100_000).collect();
        CacheKey::whole(model(), &format!("p{p}"), tokens, CHUNK)
    };
    let endpoint = s.endpoint().to_owned();
    let lmc = |who: u32| {
        let endpoint = endpoint.clone();
        std::thread::spawn(move || {
            let mut c = Client::connect(&endpoint, Duration::from_secs(30)).unwrap();
            let mut hits = 0;
            for p in 0..8 {
                if store_lmcache_driven(&mut c, &prompt(p)) {
                    let mut q = prompt(p);
                    q.request_id = format!("q{who}-{p}");
                    hits += u64::from(c.lookup(&q).unwrap() == CHUNKS as u64);
                    c.end_session(&q.request_id).unwrap();
                }
            }
            hits
        })
    };
    let (tx, rx) = mpsc::channel();
    let eng = {
        let endpoint = endpoint.clone();
        std::thread::spawn(move || {
            let mut c = Client::connect(&endpoint, Duration::from_secs(30)).unwrap();
            let pool = register_engine_driven(&mut c);
            tx.send(()).unwrap();
            let mut hits = 0;
            for p in 0..8 {
                let k = prompt(p).for_worker(0);
                let slots = c.prepare_store(&k, 7).unwrap();
                // A slow copy.
                std::thread::sleep(Duration::from_millis(20));
                for (_, slot) in &slots {
                    pool.write(slot.offset, &vec![0x44; slot.length as usize]).unwrap();
                }
                // No slots: every chunk was visible already.
                if slots.is_empty() || c.commit_store(&k, 7).unwrap() {
                    let mut q = prompt(p);
                    q.request_id = format!("qe-{p}");
                    hits += u64::from(c.lookup(&q).unwrap() == CHUNKS as u64);
                    c.end_session(&q.request_id).unwrap();
                } else {
                    panic!("engine-driven store of prompt {p} refused");
                }
            }
            hits
        })
    };
    rx.recv().unwrap();
    let (a, b) = (lmc(1), lmc(2));
    let hits = [a.join().unwrap(), b.join().unwrap(), eng.join().unwrap()];
    assert_eq!(hits, [8, 8, 8], "a lookup right after an acknowledged store missed");
    assert_eq!(s.state().l1().usage().staged_objects, 0);
    assert_eq!(s.state().l1().usage().resident_objects, 8 * CHUNKS);
}
