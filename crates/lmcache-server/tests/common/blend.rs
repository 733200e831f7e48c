//! A CacheBlend test worker over real ZMQ: a server with the blend engine (and an fs L2 when
//! asked), one lmcache-driven f32 worker with a NeoX rope, and the calls its tests make.

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

pub const CHUNK: usize = 16;
pub const BS: u64 = 4;
pub const NB: u64 = 64;

pub fn server(tag: &str, l2: Option<&std::path::Path>) -> Server {
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

pub fn seq(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|t| seed * 1000 + t).collect()
}

pub fn key(request: &str, tokens: &[u32]) -> CacheKey {
    CacheKey::whole(ModelName::new("m").unwrap(), request, tokens.to_vec(), CHUNK)
}

/// Registers worker 1 (one f32 layer `[2, NB, BS, 1, 4]`, a pattern in it) with a NeoX rope
/// of 64 positions; returns the segments to keep alive.
pub fn worker(c: &mut Client, tag: &str) -> (ShmSegment, ShmSegment) {
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

pub fn store(c: &mut Client, request: &str, tokens: &[u32]) {
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
pub fn unified(c: &mut Client, request: &str, tokens: &[u32]) -> (CbUnifiedLookupResult, usize) {
    let cmd = Command::CbUnifiedLookup(CbUnifiedLookup { key: key(request, tokens), tp_size: 1 });
    for i in 0..500 {
        if let Some(v) = c.send(&cmd).unwrap() {
            return (CbUnifiedLookupResult::decode("r", &v).unwrap(), i);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("cb_unified_lookup never answered");
}

pub fn retrieve(
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

pub fn metric(s: &Server, name: &str) -> f64 {
    let text = s.state().metrics.encode();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
