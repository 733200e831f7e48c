//! LMCache's default chunk over real ZMQ, as an engine in lmcache-driven mode moves it: one
//! fp16 layer `[2, NB, BS, 32, 1024]` in a client segment, 2 MiB per block of 16 tokens,
//! 32 MiB per 256-token chunk, requests of 4 chunks.

use std::time::Duration;

use lmcache_client::{CacheKey, Client, EngineGroupInfo, Retrieve, Store};
use lmcache_core::ModelName;
use lmcache_memory::ForeignSegment;
use lmcache_server::Server;

pub const CHUNK: usize = 256;
pub const BS: u64 = 16;
/// Chunks per request: 4 x 32 MiB.
pub const CHUNKS: usize = 4;
pub const NB: u64 = (CHUNK * CHUNKS) as u64 / BS;
pub const SHAPE: [u64; 5] = [2, NB, BS, 32, 1024];

/// Request `request`'s key: its own tokens, four chunks.
pub fn key(request: u32) -> CacheKey {
    let tokens: Vec<u32> =
        (0..(CHUNK * CHUNKS) as u32).map(|t| t * 7 + request * 100_003).collect();
    CacheKey::whole(ModelName::new("m").unwrap(), &format!("r{request}"), tokens, CHUNK)
}

/// The request's KV as the engine holds it: every 8 bytes their offset and the request.
pub fn pattern(len: u64, request: u32) -> Vec<u8> {
    (0..len / 8).flat_map(|i| (i << 8 | u64::from(request)).to_le_bytes()).collect()
}

/// Stores or retrieves request `k` through the segment of engine `instance_id`.
pub fn transfer(c: &mut Client, instance_id: u64, store: bool, k: &CacheKey) -> bool {
    let (key, event_ipc_handle) = (k.for_worker(0), Vec::new());
    let block_ids = vec![(0..NB).collect()];
    if store {
        c.store(Store { key, instance_id, block_ids, event_ipc_handle }).unwrap()
    } else {
        let r = Retrieve { key, instance_id, block_ids, event_ipc_handle, skip_first_n_tokens: 0 };
        c.retrieve(r).unwrap()
    }
}

/// A client registered as engine `id` over a new segment `seg_name` (one engine per client:
/// an engine's segment is its own).
pub fn connect(
    s: &Server,
    id: u64,
    seg_name: &str,
) -> (Client, lmcache_memory::shm::ShmSegment, ForeignSegment) {
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(60)).unwrap();
    let (owner, seg, desc) = super::cpu_shm_layer(seg_name, SHAPE.to_vec());
    c.register_kv_cache(id, &[desc], "m", 1, &[EngineGroupInfo::full(0, vec![0], BS)]).unwrap();
    (c, owner, seg)
}

/// Whether `seg` holds request `request`'s KV.
pub fn holds(seg: &ForeignSegment, request: u32) -> bool {
    let mut got = vec![0u8; seg.len() as usize];
    seg.read(0, &mut got).unwrap();
    got == pattern(seg.len(), request)
}
