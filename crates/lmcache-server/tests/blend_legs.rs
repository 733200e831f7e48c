//! CacheBlend's sparse leg beyond L1, over real ZMQ: a matched chunk L1 lost is loaded back
//! from L2 (and scattered, and never struck); a chunk found nowhere is struck out.

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

const CHUNK: usize = 16;
const BS: u64 = 4;
const NB: u64 = 64;

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

fn metric(s: &Server, name: &str) -> f64 {
    let text = s.state().metrics.encode();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn a_match_l1_lost_is_loaded_back_from_l2_scattered_and_never_struck() {
    let dir = tempfile::tempdir().unwrap();
    let s = server("l2", Some(dir.path()));
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(30)).unwrap();
    let _segs = worker(&mut c, "l2");
    let d = seq(4, CHUNK);
    store(&mut c, "p1", &[seq(1, CHUNK), d.clone()].concat());
    assert_eq!(s.state().storage.flush(Duration::from_secs(10)), 0, "write-behind unfinished");
    let engine = s.state().blend().unwrap();
    let fingerprints = engine.status()["fingerprinted_chunks"].as_u64().unwrap();
    let p2: Vec<u32> = [seq(2, CHUNK), seq(9, 4), d, seq(8, 12)].concat();
    // Twice with L1 emptied each time: D comes back from L2 both times, and is never struck.
    for round in 0..2 {
        s.state().l1().clear(true);
        let id = format!("q{round}");
        let (r, _) = unified(&mut c, &id, &p2);
        let got: Vec<_> = r.non_prefix_segments.iter().map(|m| (m.old_st, m.cur_st)).collect();
        assert_eq!(got, vec![(16, 20)], "round {round}: D not found past L1");
        assert_eq!(s.state().l1().usage().locked_objects, 1, "its object is locked");
        assert!(retrieve(&mut c, &id, &p2, &r, (20..32).collect()), "the scatter ran");
        c.end_session(&id).unwrap();
        assert_eq!(s.state().l1().usage().locked_objects, 0);
    }
    assert_eq!(engine.status()["fingerprinted_chunks"].as_u64().unwrap(), fingerprints);
    assert_eq!(metric(&s, "lmcache_blend_sparse_prefetch_l2_keys_total"), 2.0);
    assert_eq!(metric(&s, "lmcache_blend_sparse_prefetch_found_keys_total"), 2.0);
    assert_eq!(metric(&s, "lmcache_blend_sparse_prefetch_duration_milliseconds_count"), 2.0);
    assert_eq!(metric(&s, "lmcache_blend_lookup_stale_chunks_total"), 0.0);

    // Gone from L2 as well: a strike each lookup, the fingerprint removed at the second.
    s.state().l1().clear(true);
    for e in std::fs::read_dir(dir.path()).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            std::fs::remove_dir_all(p).unwrap()
        } else {
            std::fs::remove_file(p).unwrap()
        }
    }
    for round in 0..2 {
        let id = format!("gone{round}");
        let (r, _) = unified(&mut c, &id, &p2);
        assert!(r.non_prefix_segments.is_empty(), "{r:?}");
        c.end_session(&id).unwrap();
    }
    assert!(engine.status()["fingerprinted_chunks"].as_u64().unwrap() < fingerprints);
    assert_eq!(metric(&s, "lmcache_blend_lookup_stale_chunks_total"), 2.0);
    assert_eq!(metric(&s, "lmcache_blend_chunks_evicted_total"), 1.0);
}

#[test]
fn several_clients_reuse_the_same_chunk_at_once_and_leave_no_lock() {
    let s = server("conc", None);
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(30)).unwrap();
    let _segs = worker(&mut c, "conc");
    let d = seq(4, CHUNK);
    store(&mut c, "p1", &[seq(1, CHUNK), d.clone()].concat());
    let p2: Vec<u32> = [seq(2, CHUNK), seq(9, 4), d, seq(8, 12)].concat();
    let endpoint = s.endpoint().to_owned();
    // Four clients, each its own requests, the same chunk, disjoint destination blocks; and a
    // fifth storing the same prompt again meanwhile (a no-op store of resident chunks).
    let handles: Vec<_> = (0..4u64)
        .map(|w| {
            let (endpoint, p2) = (endpoint.clone(), p2.clone());
            std::thread::spawn(move || {
                let mut c = Client::connect(&endpoint, Duration::from_secs(30)).unwrap();
                let mut got = Vec::new();
                for i in 0..10 {
                    let id = format!("c{w}-{i}");
                    let (r, _) = unified(&mut c, &id, &p2);
                    let table: Vec<u64> = (0..9).map(|b| 10 + w * 9 + b).collect();
                    let ok =
                        !r.non_prefix_segments.is_empty() && retrieve(&mut c, &id, &p2, &r, table);
                    got.push((r.non_prefix_segments.len(), ok));
                    c.end_session(&id).unwrap();
                }
                got
            })
        })
        .collect();
    for i in 0..5 {
        store(&mut c, &format!("again{i}"), &[seq(1, CHUNK), seq(4, CHUNK)].concat());
    }
    for h in handles {
        let got = h.join().unwrap();
        assert!(got.iter().all(|&g| g == (1, true)), "a lookup or scatter failed: {got:?}");
    }
    assert_eq!(s.state().l1().usage().locked_objects, 0, "a lock was left behind");
    assert_eq!(s.state().metrics.handler_panics.get(), 0);
    assert_eq!(metric(&s, "lmcache_blend_retrieve_requests_total"), 40.0);
    assert_eq!(metric(&s, "lmcache_blend_retrieve_failures_total"), 0.0);
}
