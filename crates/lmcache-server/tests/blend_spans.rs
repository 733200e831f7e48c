//! CacheBlend's spans, over real ZMQ, heard by a process-wide subscriber (this binary holds
//! one test): a request's spans form LMCache's tree (`cb.request` over `cb.lookup` over its
//! legs, `cb.retrieve` over `cb.scatter` and `cb.retrieve.noop`), and close with it.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use std::time::Duration;

use lmcache_client::{CacheKey, Client, EngineGroupInfo, IpcDescriptor, TensorMeta};
use lmcache_core::{Dtype, ModelName};
use lmcache_memory::shm::ShmSegment;
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_protocol::Op;
use lmcache_protocol::request::{CbRegisterRope, CbRetrievePreComputed, CbUnifiedLookup, Command};
use lmcache_protocol::types::blend::CbUnifiedLookupResult;
use lmcache_server::blend::BlendOptions;
use lmcache_server::{Server, ServerConfig};
use rmpv::Value;
use tracing_subscriber::layer::{Context, SubscriberExt};

const CHUNK: usize = 16;
const BS: u64 = 4;
const NB: u64 = 32;

/// A span heard: its name, its parent's name, and whether it has closed.
type Heard = (String, Option<String>, bool);

/// Every span opened, by id.
#[derive(Default)]
struct Spans {
    open: Mutex<HashMap<u64, Heard>>,
}

struct Recorder(Arc<Spans>);

impl<S> tracing_subscriber::Layer<S> for Recorder
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(&self, a: &tracing::span::Attributes<'_>, id: &tracing::Id, cx: Context<'_, S>) {
        let parent = cx.span(id).and_then(|s| s.parent()).map(|p| p.name().to_owned());
        let _ = a;
        let name = cx.span(id).map(|s| s.name().to_owned()).unwrap_or_default();
        self.0.open.lock().insert(id.into_u64(), (name, parent, false));
    }

    fn on_close(&self, id: tracing::Id, _: Context<'_, S>) {
        if let Some(e) = self.0.open.lock().get_mut(&id.into_u64()) {
            e.2 = true;
        }
    }
}

fn spans() -> Arc<Spans> {
    static S: OnceLock<Arc<Spans>> = OnceLock::new();
    S.get_or_init(|| {
        let s = Arc::new(Spans::default());
        let sub = tracing_subscriber::registry().with(Recorder(Arc::clone(&s)));
        tracing::subscriber::set_global_default(sub).unwrap();
        s
    })
    .clone()
}

fn server(tag: &str, l2: Option<&std::path::Path>) -> Server {
    Server::start(ServerConfig {
        chunk_size: CHUNK,
        blend: Some(BlendOptions::default()),
        l2_adapters: l2
            .map(|d| vec![serde_json::json!({"type": "fs", "base_path": d})])
            .unwrap_or_default(),
        ..ServerConfig::local(ArenaConfig {
            size: 32 << 20,
            backing: ArenaBacking::SharedMemory {
                name: format!("lmrs_blegs_{tag}_{}", std::process::id()),
            },
            mlock: false,
        })
    })
    .unwrap()
}

fn seq(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|t| seed * 1000 + t).collect()
}

fn key(request: &str, tokens: &[u32]) -> CacheKey {
    CacheKey::whole(ModelName::new("m").unwrap(), request, tokens.to_vec(), CHUNK)
}

/// Registers worker 1 (one f32 layer `[2, NB, BS, 1, 4]`, a pattern in it) with a NeoX rope
/// of 64 positions; returns the segments to keep alive.
fn worker(c: &mut Client, tag: &str) -> (ShmSegment, ShmSegment) {
    let pid = std::process::id();
    let shape = vec![2, NB, BS, 1, 4];
    let n = shape.iter().product::<u64>();
    let bytes: Vec<u8> = (0..n).flat_map(|i| ((i % 97) as f32 / 10.0).to_le_bytes()).collect();
    let name = format!("lmrs_blegs_kv_{tag}_{pid}");
    let owner = ShmSegment::create(&name, bytes.len() as u64).unwrap();
    ForeignSegment::open(&name, bytes.len() as u64).unwrap().write(0, &bytes).unwrap();
    let meta = TensorMeta {
        dtype: Dtype::Float32,
        shape: shape.clone(),
        stride: vec![NB * BS * 4, BS * 4, 4, 4, 1],
        storage_offset: 0,
        device_uuid: "cpu".into(),
    };
    let kv = IpcDescriptor::CpuShm { shm_name: name, nbytes: bytes.len() as u64, meta };
    c.register_kv_cache(1, &[kv], "m", 1, &[EngineGroupInfo::full(0, vec![0], BS)]).unwrap();
    let cs: Vec<u8> = (0..64 * 4)
        .flat_map(|i| {
            let (p, j) = (i / 4, i % 4);
            let ang = p as f32 * 10_000f32.powf(-((j % 2) as f32));
            (if j < 2 { ang.cos() } else { ang.sin() }).to_le_bytes()
        })
        .collect();
    let cs_name = format!("lmrs_blegs_cs_{tag}_{pid}");
    let cs_owner = ShmSegment::create(&cs_name, cs.len() as u64).unwrap();
    ForeignSegment::open(&cs_name, cs.len() as u64).unwrap().write(0, &cs).unwrap();
    let meta = TensorMeta {
        dtype: Dtype::Float32,
        shape: vec![64, 4],
        stride: vec![4, 1],
        storage_offset: 0,
        device_uuid: "cpu".into(),
    };
    let cache = IpcDescriptor::CpuShm { shm_name: cs_name, nbytes: cs.len() as u64, meta };
    c.send(&Command::CbRegisterRope(CbRegisterRope {
        instance_id: 1,
        cos_sin_caches: vec![cache],
        head_size: 4,
        is_neox_style: true,
        group_to_cache: vec![],
        group_rot: vec![],
        group_head_size: vec![],
        kv_quant: String::new(),
    }))
    .unwrap();
    (owner, cs_owner)
}

fn store(c: &mut Client, request: &str, tokens: &[u32]) {
    let nblocks = (tokens.len() as u64).div_ceil(BS);
    let blocks = Value::Array(vec![Value::Array((0..nblocks).map(Value::from).collect())]);
    let params = [
        key(request, tokens).for_worker(0).encode(),
        Value::from(1u64),
        blocks,
        Value::Binary(vec![]),
    ];
    let r = c.call(Op::Store, &params).unwrap().unwrap();
    assert_eq!(r.as_array().unwrap()[1], Value::Boolean(true), "store {request}");
    c.end_session(request).unwrap();
}

/// The answer, and how many polls answered nothing before it.
fn unified(c: &mut Client, request: &str, tokens: &[u32]) -> (CbUnifiedLookupResult, usize) {
    let cmd = Command::CbUnifiedLookup(CbUnifiedLookup { key: key(request, tokens), tp_size: 1 });
    for i in 0..500 {
        if let Some(v) = c.send(&cmd).unwrap() {
            return (CbUnifiedLookupResult::decode("r", &v).unwrap(), i);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("cb_unified_lookup never answered");
}

fn retrieve(
    c: &mut Client,
    request: &str,
    tokens: &[u32],
    r: &CbUnifiedLookupResult,
    table: Vec<u64>,
) -> bool {
    let cmd = Command::CbRetrievePreComputed(CbRetrievePreComputed {
        key: key(request, tokens).for_worker(0),
        match_results: r.non_prefix_segments.clone(),
        block_ids: vec![table],
        instance_id: 1,
        event_ipc_handle: Vec::new(),
    });
    c.send(&cmd).unwrap().expect("a reply").as_array().unwrap()[1].as_bool().unwrap()
}

#[test]
fn a_requests_spans_form_lmcaches_tree_and_close_with_it() {
    let rec = spans();
    let s = server("spans", None);
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(30)).unwrap();
    let _segs = worker(&mut c, "spans");
    let d = seq(4, CHUNK);
    store(&mut c, "sp1", &[seq(1, CHUNK), d.clone()].concat());
    let p2: Vec<u32> = [seq(2, CHUNK), seq(9, 4), d, seq(8, 12)].concat();
    let (r, _) = unified(&mut c, "sq", &p2);
    assert_eq!(r.non_prefix_segments.len(), 1);
    // A table short of the match (beyond: a no-op), then the whole one.
    assert!(retrieve(&mut c, "sq", &p2, &r, (20..24).collect()));
    assert!(retrieve(&mut c, "sq", &p2, &r, (20..32).collect()));
    c.end_session("sq").unwrap();
    let all = rec.open.lock();
    let find = |name: &str| -> Vec<(Option<String>, bool)> {
        all.values().filter(|(n, _, _)| n == name).map(|(_, p, c)| (p.clone(), *c)).collect()
    };
    let parent_of = |name: &str| find(name).first().and_then(|(p, _)| p.clone());
    assert_eq!(find("cb.request").len(), 1, "one root per request");
    assert_eq!(parent_of("cb.request"), None, "cb.request is a root");
    assert_eq!(parent_of("cb.lookup").as_deref(), Some("cb.request"));
    for leg in ["cb.prefix_lookup", "cb.fingerprint_match"] {
        assert_eq!(parent_of(leg).as_deref(), Some("cb.lookup"), "{leg}");
    }
    assert_eq!(find("cb.retrieve").len(), 2);
    assert!(find("cb.retrieve").iter().all(|(p, _)| p.as_deref() == Some("cb.request")));
    assert_eq!(parent_of("cb.scatter").as_deref(), Some("cb.retrieve"));
    assert_eq!(parent_of("cb.retrieve.noop").as_deref(), Some("cb.retrieve"));
    assert_eq!(find("cb.fingerprints.registered").len(), 1);
    for (name, spans) in all.values().map(|(n, _, _)| (n.clone(), find(n))) {
        if name.starts_with("cb.") {
            assert!(spans.iter().all(|(_, closed)| *closed), "{name} left open");
        }
    }
}
