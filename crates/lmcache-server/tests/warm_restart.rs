//! What a server that restarts warm takes back besides its L1, over real ZMQ:
//! - its workers' registrations: an lmcache-driven worker (LMCache's bench client registers
//!   once, never again) and an engine-driven one (vLLM's adapter) keep storing and retrieving
//!   without registering again. A registration that no longer applies (the client's segment
//!   is gone) is dropped and the worker is told by its next ping; a cold start forgets them;
//! - the tokens behind its chunks: the KV event stream announces the adopted chunks as
//!   `stored`, with their tokens and parents, as the process that stored them did.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use lmcache_client::{CacheKey, Client, EngineGroupInfo, Retrieve, Store};
use lmcache_core::{Dtype, ModelName};
use lmcache_memory::shm::ShmSegment;
use lmcache_memory::{ArenaBacking, ArenaConfig, FileBacking, ForeignSegment};
use lmcache_protocol::types::EngineDrivenRegistration;
use lmcache_protocol::{Op, value};
use lmcache_server::{Server, ServerConfig};
use rmpv::Value;

const CHUNK: usize = 16;
const BS: u64 = 4;
const NB: u64 = 16;
const CHUNKS: usize = 2;

fn server(path: &Path, adopt: bool) -> Server {
    server_tweaked(path, adopt, |_| {})
}

fn server_tweaked(path: &Path, adopt: bool, tweak: impl FnOnce(&mut ServerConfig)) -> Server {
    let mut config = ServerConfig {
        chunk_size: CHUNK,
        max_gpu_workers: 2,
        ..ServerConfig::local(ArenaConfig {
            size: 32 << 20,
            backing: ArenaBacking::File(FileBacking {
                path: path.to_path_buf(),
                format: false,
                adopt,
            }),
            mlock: false,
        })
    };
    tweak(&mut config);
    Server::start(config).unwrap()
}

/// A log sink for a test's tracing subscriber.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn client(s: &Server) -> Client {
    Client::connect(s.endpoint(), Duration::from_secs(30)).unwrap()
}

fn key(request: &str, seed: u32) -> CacheKey {
    let tokens: Vec<u32> = (0..(CHUNK * CHUNKS) as u32).map(|t| t * 13 + seed).collect();
    CacheKey::whole(ModelName::new("m").unwrap(), request, tokens, CHUNK)
}

/// Lmcache-driven instance 1: one fp16 layer `[2, NB, BS, 2, 4]` in a segment of its own.
fn register_lmcache_driven(c: &mut Client, name: &str) -> (ShmSegment, ForeignSegment) {
    let (owner, seg, desc) = common::cpu_shm_layer(name, vec![2, NB, BS, 2, 4]);
    c.register_kv_cache(1, &[desc], "m", 1, &[EngineGroupInfo::full(0, vec![0], BS)]).unwrap();
    (owner, seg)
}

/// The lmcache-driven store or retrieve of `k` over blocks 0..8: the reply's success flag.
fn transfer(c: &mut Client, op: Op, k: &CacheKey) -> bool {
    let (key, instance_id, event_ipc_handle) = (k.for_worker(0), 1, Vec::new());
    let block_ids = vec![(0..(CHUNK * CHUNKS) as u64 / BS).collect()];
    match op {
        Op::Store => c.store(Store { key, instance_id, block_ids, event_ipc_handle }),
        _ => c.retrieve(Retrieve {
            key,
            instance_id,
            block_ids,
            event_ipc_handle,
            skip_first_n_tokens: 0,
        }),
    }
    .unwrap()
}

fn register_engine_driven(c: &mut Client) -> String {
    let reg = EngineDrivenRegistration {
        instance_id: 7,
        model_name: ModelName::new("m").unwrap(),
        world_size: 1,
        block_size: 16,
        num_layers: 1,
        hidden_dim_size: 8,
        dtype: Dtype::Float16,
        use_mla: false,
        num_physical_slots: None,
    };
    c.register_engine_driven(&reg).unwrap().shm_name
}

struct Cleanup(Vec<PathBuf>);

impl Cleanup {
    /// The L1 file `l1` and the files the server keeps beside it.
    fn l1_and_sidecars(l1: &Path) -> Self {
        let files = ["", ".lmcache-rs-workers", ".lmcache-rs-tokens"];
        Self(files.iter().map(|x| PathBuf::from(format!("{}{x}", l1.display()))).collect())
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[test]
fn a_warm_restart_takes_back_its_workers_registrations() {
    let pid = std::process::id();
    let l1 = PathBuf::from(format!("/dev/shm/lmrs_warmreg_l1_{pid}"));
    let saved = PathBuf::from(format!("/dev/shm/lmrs_warmreg_l1_{pid}.lmcache-rs-workers"));
    let _cleanup = Cleanup::l1_and_sidecars(&l1);
    let kv_name = format!("lmrs_warmreg_kv_{pid}");

    // The first process: both workers register; the lmcache-driven one stores 0x5a.
    let s = server(&l1, true);
    let mut c = client(&s);
    let (kv_owner, kv) = register_lmcache_driven(&mut c, &kv_name);
    let pool_name = register_engine_driven(&mut c);
    kv.write(0, &vec![0x5a; kv.len() as usize]).unwrap();
    let stored = key("a", 5);
    assert!(transfer(&mut c, Op::Store, &stored));
    assert!(saved.exists(), "no registrations file beside the L1 file");
    drop(c);
    s.shutdown();

    // Warm: neither worker registers again, and both are served.
    let s = server(&l1, true);
    let mut c = client(&s);
    assert!(
        c.ping(Some(1)).unwrap() && c.ping(Some(7)).unwrap(),
        "a taken-back worker was told to register"
    );
    assert_eq!(c.lookup(&stored).unwrap(), CHUNKS as u64, "the adopted chunks are not served");
    kv.write(0, &vec![0; kv.len() as usize]).unwrap();
    assert!(transfer(&mut c, Op::Retrieve, &stored), "the lmcache-driven retrieve failed");
    let mut back = vec![0u8; kv.len() as usize];
    kv.read(0, &mut back).unwrap();
    // Blocks 0..8 of both planes (a block is BS x 2 heads x 4 x 2 bytes).
    let (block, plane) = (BS as usize * 16, NB as usize * BS as usize * 16);
    for range in [0..8 * block, plane..plane + 8 * block] {
        assert!(back[range].iter().all(|&b| b == 0x5a), "the retrieve did not land in the blocks");
    }
    kv.write(0, &vec![0x3c; kv.len() as usize]).unwrap();
    assert!(transfer(&mut c, Op::Store, &key("b", 9)), "the lmcache-driven store failed");
    let slots = c.prepare_store(&key("c", 11).for_worker(0), 7).unwrap();
    assert_eq!(slots.len(), CHUNKS, "the engine-driven worker got no slots");
    assert!(c.commit_store(&key("c", 11).for_worker(0), 7).unwrap());
    drop(c);
    s.shutdown();

    // The lmcache-driven client went away: its registration is dropped, and its worker told
    // once; the engine-driven one still maps the same pool, so it stays.
    drop((kv, kv_owner));
    // (The start's log, captured: a dropped registration is a warning, not a refusal.)
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer({
            let logs = logs.clone();
            move || logs.clone()
        })
        .finish();
    let s = tracing::subscriber::with_default(subscriber, || server(&l1, true));
    let log = logs.text();
    assert!(log.contains("dropped a registration of the previous process"), "{log}");
    assert!(!log.contains("registration refused"), "the replay refused loudly: {log}");
    let mut c = client(&s);
    assert!(!c.ping(Some(1)).unwrap(), "a worker whose segment is gone was not told");
    assert!(c.ping(Some(1)).unwrap());
    assert!(!transfer(&mut c, Op::Store, &key("d", 13)));
    assert!(c.ping(Some(7)).unwrap());
    assert_eq!(s.state().l1().memory().arena().engine_segment().unwrap().name, pool_name);
    drop(c);
    s.shutdown();

    // Cold: the registrations go with the L1.
    let s = server(&l1, false);
    assert!(!saved.exists(), "a cold start kept the registrations file");
    let mut c = client(&s);
    assert!(!c.ping(Some(7)).unwrap(), "a cold start kept a registration");
    drop(c);
    s.shutdown();
}

/// A worker that registers again under the same instance id (a new process: LMCache's bench
/// always uses 1000 + rank) is served from its new tensors, also when a warm restart took
/// back the previous process's registration and that process's segment is still there.
#[test]
fn a_worker_registering_again_is_served_from_its_new_tensors() {
    let pid = std::process::id();
    let l1 = PathBuf::from(format!("/dev/shm/lmrs_warmreg2_l1_{pid}"));
    let _cleanup = Cleanup::l1_and_sidecars(&l1);
    let s = server(&l1, true);
    let mut c = client(&s);
    let (_old_owner, old) = register_lmcache_driven(&mut c, &format!("lmrs_warmreg2_a_{pid}"));
    old.write(0, &vec![0x11; old.len() as usize]).unwrap();
    drop(c);
    s.shutdown();
    let s = server(&l1, true);
    let mut c = client(&s);
    assert!(c.ping(Some(1)).unwrap(), "the registration was not taken back");
    // The new process registers its own segment under the same id, and stores from it.
    let (_new_owner, new) = register_lmcache_driven(&mut c, &format!("lmrs_warmreg2_b_{pid}"));
    new.write(0, &vec![0x22; new.len() as usize]).unwrap();
    let k = key("n", 3);
    assert!(transfer(&mut c, Op::Store, &k));
    new.write(0, &vec![0; new.len() as usize]).unwrap();
    assert_eq!(c.lookup(&k).unwrap(), CHUNKS as u64);
    assert!(transfer(&mut c, Op::Retrieve, &k));
    let mut back = vec![0u8; new.len() as usize];
    new.read(0, &mut back).unwrap();
    assert_eq!(back[0], 0x22, "stored from, or retrieved into, the old process's segment");
    let mut untouched = vec![0u8; old.len() as usize];
    old.read(0, &mut untouched).unwrap();
    assert!(untouched.iter().all(|&b| b == 0x11), "the old segment was written");
    drop(c);
    s.shutdown();
}

/// Reads the KV event stream of instance 1, model `m`, from cursor 0, acknowledging each
/// batch, until `want` records came or 5 s passed.
fn kv_events(s: &Server, want: usize) -> Vec<Value> {
    let sub = client(s);
    let enc = |v: Value| value::encode(&v);
    let uid = enc(Value::from(77));
    let op = enc(Value::from("subscribe_kv_events"));
    let params = [Value::from(1), Value::from("m"), Value::from(0), Value::from(64)];
    let mut frames = vec![uid.clone(), op];
    frames.extend(params.iter().map(|v| enc(v.clone())));
    sub.send_frames(&frames).unwrap();
    let mut events = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while events.len() < want && std::time::Instant::now() < deadline {
        let Some(got) = sub.recv_frames_within(Duration::from_millis(500)).unwrap() else {
            continue;
        };
        let v = value::decode(2, &got[2]).unwrap();
        let f = value::Fields::of("batch", &v).unwrap();
        events.extend(value::array("events", f.req("events").unwrap()).unwrap().iter().cloned());
        sub.send_frames(&[uid.clone(), Vec::new(), b"ack".to_vec()]).unwrap();
    }
    sub.send_frames(&[uid, Vec::new(), b"cancel".to_vec()]).unwrap();
    events
}

/// A restarted server announces the chunks it adopted on the KV event stream, with the
/// tokens and parents the storing process announced (kept in `<L1 file>.lmcache-rs-tokens`).
#[test]
fn a_warm_restart_announces_the_adopted_chunks_with_their_tokens() {
    let pid = std::process::id();
    let l1 = PathBuf::from(format!("/dev/shm/lmrs_warmtok_l1_{pid}"));
    let base = l1.display().to_string();
    let _cleanup = Cleanup::l1_and_sidecars(&l1);
    let s = server(&l1, true);
    let mut c = client(&s);
    let (_owner, kv) = register_lmcache_driven(&mut c, &format!("lmrs_warmtok_kv_{pid}"));
    kv.write(0, &vec![0x42; kv.len() as usize]).unwrap();
    let k = key("t", 21);
    assert!(transfer(&mut c, Op::Store, &k));
    let before = kv_events(&s, CHUNKS);
    assert_eq!(before.len(), CHUNKS, "the storing server's own records");
    drop(c);
    s.shutdown();

    let s = server(&l1, true);
    let after = kv_events(&s, CHUNKS);
    assert_eq!(after.len(), CHUNKS, "the adopted chunks were not announced: {after:?}");
    let fields = |e: &Value, k: &str| value::Fields::of("e", e).unwrap().req(k).unwrap().clone();
    for (a, b) in after.iter().zip(&before) {
        assert_eq!(fields(a, "kind"), Value::from("stored"));
        for f in ["block_hashes", "parent_block_hash", "token_ids", "model_name"] {
            assert_eq!(fields(a, f), fields(b, f), "{f} differs from the storing server's");
        }
    }
    s.shutdown();

    // A cold start forgets the tokens with the L1.
    let s = server(&l1, false);
    assert!(!PathBuf::from(format!("{base}.lmcache-rs-tokens")).exists());
    s.shutdown();
}

/// The coordinator's feed of a restarted server (recorded as it is sent, by an events-level
/// trace) reports the adopted chunks as stored in L1 with their tokens and offsets, as the
/// storing server reported them.
#[test]
fn the_coordinator_hears_the_adopted_chunks_with_their_tokens() {
    let pid = std::process::id();
    let dir = tempfile::tempdir().unwrap();
    let l1 = PathBuf::from(format!("/dev/shm/lmrs_warmfeed_l1_{pid}"));
    let _cleanup = Cleanup::l1_and_sidecars(&l1);
    let s = server(&l1, true);
    let mut c = client(&s);
    let (_owner, _kv) = register_lmcache_driven(&mut c, &format!("lmrs_warmfeed_kv_{pid}"));
    let k = key("f", 31);
    assert!(transfer(&mut c, Op::Store, &k));
    drop(c);
    s.shutdown();

    let trace = dir.path().join("events.lct");
    let s = server_tweaked(&l1, true, |c| {
        c.trace = Some(lmcache_server::trace_record::TraceConfig {
            level: lmcache_workload::trace::Level::Events,
            path: trace.clone(),
        });
    });
    s.shutdown(); // the stop flushes the reporter's queue
    let file = std::fs::File::open(&trace).unwrap();
    let records = lmcache_workload::trace::TraceReader::new(file).unwrap().read_all().unwrap();
    let mut heard: Vec<(i64, Vec<u32>)> = Vec::new();
    for r in records.iter().filter(|r| r.qualname == lmcache_workload::trace::codec::EVENTS_BATCH) {
        let b = lmcache_workload::trace::codec::to_json(&r.args);
        if b["event_type"] == "store" && b["tier"].to_string().to_lowercase().contains("l1") {
            for e in b["entries"].as_array().unwrap() {
                let tokens = e["token_ids"].as_array().unwrap();
                let tokens = tokens.iter().map(|t| t.as_u64().unwrap() as u32).collect();
                heard.push((e["token_offset"].as_i64().unwrap(), tokens));
            }
        }
    }
    heard.sort();
    let want: Vec<(i64, Vec<u32>)> = (0..CHUNKS)
        .map(|j| ((j * CHUNK) as i64, k.token_ids[j * CHUNK..(j + 1) * CHUNK].to_vec()))
        .collect();
    assert_eq!(heard, want, "the adopted chunks' stores, with tokens and offsets");
}
