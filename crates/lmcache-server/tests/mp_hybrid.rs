//! Hybrid models over real ZMQ and shared memory: one registration with several KV groups
//! (fp16 K/V, an fp8-as-uint8 MLA group, a bf16 sliding-window group smaller than a chunk,
//! and a recurrent-state group), stored from some blocks and retrieved into others. Every
//! group must come back byte for byte where it is restored, and nothing outside may change:
//! not the blocks a sliding window does not keep, not the tokens `skip_first_n_tokens`
//! protects, not the chunks a windowed object group does not need.

use std::time::Duration;

use lmcache_client::{CacheKey, Client, EngineGroupInfo, IpcDescriptor, TensorMeta};
use lmcache_core::{Dtype, ModelName};
use lmcache_memory::ForeignSegment;
use lmcache_memory::shm::ShmSegment;
use lmcache_memory::{ArenaBacking, ArenaConfig};
use lmcache_protocol::Op;
use lmcache_server::{Server, ServerConfig};
use rmpv::Value;

mod common;

const CHUNK: u64 = 16;
const BS: u64 = 4;
const NB: u64 = 40;
const CHUNKS: u64 = 3;

/// One layer: its descriptor, and a handle to read and write its bytes.
struct Layer {
    desc: IpcDescriptor,
    seg: ForeignSegment,
    _owner: ShmSegment,
    /// Bytes of one block of one plane.
    block: u64,
    planes: u64,
}

fn layer(tag: &str, i: usize, shape: Vec<u64>, dtype: Dtype) -> Layer {
    let name = format!("lmrs_hyb_{tag}_{i}_{}", std::process::id());
    let mut stride = vec![1u64; shape.len()];
    for d in (0..shape.len() - 1).rev() {
        stride[d] = stride[d + 1] * shape[d + 1];
    }
    let elems: u64 = shape.iter().product();
    let bytes = elems * dtype.itemsize();
    let owner = ShmSegment::create(&name, bytes).unwrap();
    let seg = ForeignSegment::open(&name, bytes).unwrap();
    // Distinct, non-periodic bytes in every layer.
    let data: Vec<u8> = (0..bytes)
        .map(|x| ((x.wrapping_mul(2_654_435_761) >> 9) as u8) ^ (i as u8).wrapping_mul(37))
        .collect();
    seg.write(0, &data).unwrap();
    let planes = if shape.len() == 5 { shape[0] } else { 1 };
    let block = stride[if shape.len() == 5 { 1 } else { 0 }] * dtype.itemsize();
    Layer {
        desc: IpcDescriptor::CpuShm {
            shm_name: name,
            nbytes: bytes,
            meta: TensorMeta { dtype, shape, stride, storage_offset: 0, device_uuid: "cpu".into() },
        },
        seg,
        _owner: owner,
        block,
        planes,
    }
}

impl Layer {
    /// The bytes of block `b` (every plane).
    fn block_bytes(&self, b: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for p in 0..self.planes {
            let mut buf = vec![0u8; self.block as usize];
            self.seg.read((p * NB + b) * self.block, &mut buf).unwrap();
            out.extend(buf);
        }
        out
    }
}

/// Layers 0 and 2: fp16 K/V (engine group 0); 1: uint8 MLA (group 1); 3: bf16 K/V with a
/// 4-token sliding window (group 2); 4: fp16 recurrent state, window one block (group 3).
fn model(tag: &str) -> (Vec<Layer>, Vec<EngineGroupInfo>) {
    let layers = vec![
        layer(tag, 0, vec![2, NB, BS, 2, 4], Dtype::Float16),
        layer(tag, 1, vec![NB, BS, 24], Dtype::UInt8),
        layer(tag, 2, vec![2, NB, BS, 2, 4], Dtype::Float16),
        layer(tag, 3, vec![2, NB, BS, 1, 8], Dtype::BFloat16),
        layer(tag, 4, vec![2, NB, BS, 1, 4], Dtype::Float16),
    ];
    let mut sw = EngineGroupInfo::full(2, vec![3], BS);
    sw.sw_size_tokens = 4;
    let mut rec = EngineGroupInfo::full(3, vec![4], BS);
    rec.sw_size_tokens = BS as i64;
    rec.recurrent_state = true;
    let infos = vec![
        EngineGroupInfo::full(0, vec![0, 2], BS),
        EngineGroupInfo::full(1, vec![1], BS),
        sw,
        rec,
    ];
    (layers, infos)
}

/// Kernel group of each layer (kernel groups are ordered by first layer).
const GROUP_OF: [usize; 5] = [0, 1, 0, 2, 3];

fn server(tag: &str, separate: bool) -> Server {
    server_with(tag, separate, Vec::new())
}

fn server_with(tag: &str, separate: bool, l2_adapters: Vec<serde_json::Value>) -> Server {
    Server::start(ServerConfig {
        chunk_size: CHUNK as usize,
        http_port: Some(0),
        separate_object_groups: separate,
        l2_adapters,
        ..ServerConfig::local(ArenaConfig {
            size: 32 << 20,
            backing: ArenaBacking::SharedMemory {
                name: format!("lmrs_hyb_l1_{tag}_{}", std::process::id()),
            },
            mlock: false,
        })
    })
    .unwrap()
}

fn tokens(seed: u32) -> Vec<u32> {
    (0..(CHUNK * CHUNKS) as u32).map(|t| t * 7 + 3 + seed * 100_000).collect()
}

fn key(request: &str) -> CacheKey {
    key_of(request, 0, CHUNKS)
}

/// A key over the first `chunks` chunks of prompt `seed`.
fn key_of(request: &str, seed: u32, chunks: u64) -> CacheKey {
    let mut k =
        CacheKey::whole(ModelName::new("hybrid").unwrap(), request, tokens(seed), CHUNK as usize);
    k.end = (chunks * CHUNK) as usize;
    k
}

fn blocks(lists: &[Vec<u64>]) -> Value {
    Value::Array(
        lists.iter().map(|l| Value::Array(l.iter().map(|&b| Value::from(b)).collect())).collect(),
    )
}

fn store(c: &mut Client, lists: &[Vec<u64>]) -> bool {
    store_key(c, &key("s"), lists)
}

fn store_key(c: &mut Client, k: &CacheKey, lists: &[Vec<u64>]) -> bool {
    let params =
        [k.for_worker(0).encode(), Value::from(1u64), blocks(lists), Value::Binary(vec![])];
    let r = c.call(Op::Store, &params).unwrap().unwrap();
    r.as_array().unwrap()[1].as_bool().unwrap()
}

fn retrieve(c: &mut Client, request: &str, lists: &[Vec<u64>], skip: u64) -> bool {
    retrieve_key(c, &key(request), lists, skip)
}

fn retrieve_key(c: &mut Client, k: &CacheKey, lists: &[Vec<u64>], skip: u64) -> bool {
    let params = [
        k.for_worker(0).encode(),
        Value::from(1u64),
        blocks(lists),
        Value::Binary(vec![]),
        Value::from(skip),
    ];
    let r = c.call(Op::Retrieve, &params).unwrap().unwrap();
    r.as_array().unwrap()[1].as_bool().unwrap()
}

/// Blocks `from..from+12` for every kernel group.
fn range(from: u64) -> Vec<Vec<u64>> {
    (0..4).map(|_| (from..from + CHUNK / BS * CHUNKS).collect()).collect()
}

/// Which blocks of the 12 per group a retrieve writes: `want(layer, chunk, block in chunk)`.
fn check(
    layers: &[Layer],
    src: u64,
    dst: u64,
    before: &[Vec<Vec<u8>>],
    want: impl Fn(usize, u64, u64) -> bool,
) {
    for (l, layer) in layers.iter().enumerate() {
        for j in 0..CHUNK / BS * CHUNKS {
            let (chunk, in_chunk) = (j / (CHUNK / BS), j % (CHUNK / BS));
            let got = layer.block_bytes(dst + j);
            if want(l, chunk, in_chunk) {
                assert_eq!(got, layer.block_bytes(src + j), "layer {l} block {j}: not restored");
            } else {
                assert_eq!(
                    got, before[l][j as usize],
                    "layer {l} block {j}: written outside what was promised"
                );
            }
        }
    }
}

fn snapshot(layers: &[Layer], dst: u64) -> Vec<Vec<Vec<u8>>> {
    layers
        .iter()
        .map(|l| (0..CHUNK / BS * CHUNKS).map(|j| l.block_bytes(dst + j)).collect())
        .collect()
}

#[test]
fn every_group_round_trips_into_other_blocks_and_nothing_else_is_written() {
    let s = server("one", false);
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(5)).unwrap();
    let (layers, infos) = model("one");
    let descs: Vec<IpcDescriptor> = layers.iter().map(|l| l.desc.clone()).collect();
    c.register_kv_cache(1, &descs, "hybrid", 1, &infos).unwrap();
    let (code, body) = common::http_raw(&s, "GET", "/status", None, Duration::from_secs(5));
    assert_eq!(code, 200);
    let st: serde_json::Value = serde_json::from_str(&body).unwrap();
    let layout = &st["cache_context_meta"]["1"]["kv_cache_layout"];
    assert_eq!(layout["kernel_groups"].as_array().unwrap().len(), 4, "{layout}");
    assert_eq!(layout["object_groups"].as_array().unwrap().len(), 1, "{layout}");
    assert!(st["refused_instances"].as_array().unwrap().is_empty(), "{st}");

    assert!(store(&mut c, &range(1)));
    assert_eq!(c.lookup(&key("l")).unwrap(), CHUNKS, "the whole prompt is a hit");
    let before = snapshot(&layers, 20);
    assert!(retrieve(&mut c, "l", &range(20), 0));
    // The sliding-window group (layer 3, a 4-token window: one block) and the recurrent group
    // (layer 4, one block) keep each chunk's last block only.
    check(&layers, 1, 20, &before, |l, _, b| match GROUP_OF[l] {
        2 | 3 => b == CHUNK / BS - 1,
        _ => true,
    });

    // Retrieve again into fresh blocks, leaving the first 6 tokens to the engine: block 0
    // (and the first token of block 1, whose block is then skipped as a whole, as LMCache
    // does: whole blocks only).
    assert_eq!(c.lookup(&key("k")).unwrap(), CHUNKS);
    let before = snapshot(&layers, 28);
    let dst: Vec<Vec<u64>> = (0..4).map(|_| (28..40).collect()).collect();
    assert!(retrieve(&mut c, "k", &dst, 6));
    check(&layers, 1, 28, &before, |l, chunk, b| {
        let skipped = chunk == 0 && b < 1;
        !skipped
            && match GROUP_OF[l] {
                2 | 3 => b == CHUNK / BS - 1,
                _ => true,
            }
    });
}

#[test]
fn separate_object_groups_restore_each_window_and_skip_null_chunks() {
    let s = server("sep", true);
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(5)).unwrap();
    let (layers, infos) = model("sep");
    let descs: Vec<IpcDescriptor> = layers.iter().map(|l| l.desc.clone()).collect();
    c.register_kv_cache(1, &descs, "hybrid", 1, &infos).unwrap();
    let (_, body) = common::http_raw(&s, "GET", "/status", None, Duration::from_secs(5));
    let st: serde_json::Value = serde_json::from_str(&body).unwrap();
    let ogs = st["cache_context_meta"]["1"]["kv_cache_layout"]["object_groups"].clone();
    let windows: Vec<serde_json::Value> =
        ogs.as_array().unwrap().iter().map(|o| o["window_chunks"].clone()).collect();
    assert_eq!(windows, vec![serde_json::Value::Null, 1.into(), 1.into()], "{ogs}");

    // The recurrent group's first two chunks are all null blocks (align mode): not stored.
    let mut src = range(1);
    for b in &mut src[3][..8] {
        *b = 0;
    }
    assert!(store(&mut c, &src));
    let objects = s.state().l1().usage().resident_objects as u64;
    assert_eq!(objects, 3 + 3 + 1, "full group 3 chunks, window group 3, recurrent 1");
    assert_eq!(c.lookup(&key("l")).unwrap(), CHUNKS);
    let before = snapshot(&layers, 20);
    assert!(retrieve(&mut c, "l", &range(20), 0));
    // Windowed groups restore only the last chunk, and of it only the last block.
    check(&layers, 1, 20, &before, |l, chunk, b| match GROUP_OF[l] {
        2 | 3 => chunk == CHUNKS - 1 && b == CHUNK / BS - 1,
        _ => true,
    });
}

#[test]
fn a_hit_is_the_longest_prefix_every_group_serves_under_its_window() {
    let s = server("fold", true);
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(5)).unwrap();
    let (layers, infos) = model("fold");
    let descs: Vec<IpcDescriptor> = layers.iter().map(|l| l.desc.clone()).collect();
    c.register_kv_cache(1, &descs, "hybrid", 1, &infos).unwrap();
    // Prompt 1: the sliding-window group has nothing in chunk 2 (null blocks), so a 3-chunk
    // prefix cannot be served (its window is chunk 2); 2 chunks can (window: chunk 1; the
    // recurrent group's chunk 1 is there too).
    let mut src = range(1);
    for b in &mut src[2][8..] {
        *b = 0;
    }
    assert!(store_key(&mut c, &key_of("s1", 1, CHUNKS), &src));
    let locked_before = s.state().l1().usage().locked_objects;
    assert_eq!(c.lookup(&key_of("l1", 1, CHUNKS)).unwrap(), 2, "the window's chunk is missing");
    // Locked: the full group's 2 chunks and each windowed group's one chunk, nothing else.
    assert_eq!(s.state().l1().usage().locked_objects - locked_before, 2 + 1 + 1);
    let before = snapshot(&layers, 20);
    assert!(retrieve_key(&mut c, &key_of("l1", 1, 2), &range(20), 0));
    check(&layers, 1, 20, &before, |l, chunk, b| match GROUP_OF[l] {
        _ if chunk >= 2 => false,
        2 | 3 => chunk == 1 && b == CHUNK / BS - 1,
        _ => true,
    });
    c.end_session("l1").unwrap();
    assert_eq!(s.state().l1().usage().locked_objects, locked_before, "locks released");
    // Prompt 2: the recurrent group holds only its last chunk (align mode): still a full hit.
    let mut src = range(1);
    for b in &mut src[3][..8] {
        *b = 0;
    }
    assert!(store_key(&mut c, &key_of("s2", 2, CHUNKS), &src));
    assert_eq!(c.lookup(&key_of("l2", 2, CHUNKS)).unwrap(), CHUNKS);
    // A prompt nobody stored: no hit, no locks.
    assert_eq!(c.lookup(&key_of("l3", 3, CHUNKS)).unwrap(), 0);
}

#[test]
fn separate_groups_come_back_from_l2_when_l1_lost_them() {
    let dir = tempfile::tempdir().unwrap();
    let s =
        server_with("l2", true, vec![serde_json::json!({"type": "fs", "base_path": dir.path()})]);
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(5)).unwrap();
    let (layers, infos) = model("l2");
    let descs: Vec<IpcDescriptor> = layers.iter().map(|l| l.desc.clone()).collect();
    c.register_kv_cache(1, &descs, "hybrid", 1, &infos).unwrap();
    assert!(store(&mut c, &range(1)));
    // Every object group's objects reach L2 (3 chunks x 3 groups), then L1 is emptied.
    let t0 = std::time::Instant::now();
    while s.state().storage.describe_l2()[0].counters.stored_keys < 9 {
        assert!(t0.elapsed() < Duration::from_secs(10), "write-behind did not store every group");
        std::thread::sleep(Duration::from_millis(10));
    }
    s.state().l1().clear(true);
    assert_eq!(s.state().l1().usage().resident_objects, 0);
    assert_eq!(c.lookup(&key("l")).unwrap(), CHUNKS, "the whole prompt, from L2");
    let before = snapshot(&layers, 20);
    assert!(retrieve(&mut c, "l", &range(20), 0));
    check(&layers, 1, 20, &before, |l, chunk, b| match GROUP_OF[l] {
        2 | 3 => chunk == CHUNKS - 1 && b == CHUNK / BS - 1,
        _ => true,
    });
}
