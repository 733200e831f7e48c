//! The CacheBlend engine's first operations over real ZMQ: the handshake, the rope
//! registration (LMCache's checks, the cos/sin cache read out of the worker's shared memory
//! with its YaRN scale removed) and the fingerprints an lmcache-driven store leaves.

use std::time::Duration;

use lmcache_blend::RopeStyle;
use lmcache_client::{CacheKey, Client, EngineGroupInfo, IpcDescriptor, TensorMeta};
use lmcache_core::{Dtype, ModelName};
use lmcache_memory::shm::ShmSegment;
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_protocol::Op;
use lmcache_protocol::request::{CbRegisterRope, Command};
use lmcache_server::blend::{BlendOptions, KvQuant, namespace};
use lmcache_server::{Server, ServerConfig};
use rmpv::Value;

const CHUNK: usize = 16;
const BS: u64 = 4;
const NB: u64 = 16;

fn server(tag: &str, blend: bool) -> Server {
    server_with(tag, blend.then(BlendOptions::default))
}

fn server_with(tag: &str, blend: Option<BlendOptions>) -> Server {
    Server::start(ServerConfig {
        chunk_size: CHUNK,
        blend,
        ..ServerConfig::local(ArenaConfig {
            size: 32 << 20,
            backing: ArenaBacking::SharedMemory {
                name: format!("lmrs_blend_l1_{tag}_{}", std::process::id()),
            },
            mlock: false,
        })
    })
    .unwrap()
}

fn client(s: &Server) -> Client {
    Client::connect(s.endpoint(), Duration::from_secs(30)).unwrap()
}

fn contiguous(shape: &[u64]) -> Vec<u64> {
    let mut stride = vec![1u64; shape.len()];
    for d in (0..shape.len() - 1).rev() {
        stride[d] = stride[d + 1] * shape[d + 1];
    }
    stride
}

/// A segment of the test's own holding `bytes`, and its descriptor as `dtype` `shape`.
fn tensor(name: &str, bytes: &[u8], dtype: Dtype, shape: Vec<u64>) -> (ShmSegment, IpcDescriptor) {
    let owner = ShmSegment::create(name, bytes.len() as u64).unwrap();
    ForeignSegment::open(name, bytes.len() as u64).unwrap().write(0, bytes).unwrap();
    let stride = contiguous(&shape);
    let meta = TensorMeta { dtype, shape, stride, storage_offset: 0, device_uuid: "cpu".into() };
    (owner, IpcDescriptor::CpuShm { shm_name: name.into(), nbytes: bytes.len() as u64, meta })
}

/// A `[positions, rot]` fp32 cos/sin cache, scaled by `m` (a YaRN-style baked-in scale).
fn cos_sin(name: &str, positions: usize, rot: usize, m: f32) -> (ShmSegment, IpcDescriptor) {
    let mut v = Vec::new();
    for p in 0..positions {
        let ang = |i: usize| p as f32 * 10_000f32.powf(-2.0 * i as f32 / rot as f32);
        v.extend((0..rot / 2).map(|i| ang(i).cos() * m));
        v.extend((0..rot / 2).map(|i| ang(i).sin() * m));
    }
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    tensor(name, &bytes, Dtype::Float32, vec![positions as u64, rot as u64])
}

fn rope(id: u64, caches: Vec<IpcDescriptor>) -> CbRegisterRope {
    CbRegisterRope {
        instance_id: id,
        cos_sin_caches: caches,
        head_size: 4,
        is_neox_style: true,
        group_to_cache: Vec::new(),
        group_rot: Vec::new(),
        group_head_size: Vec::new(),
        kv_quant: String::new(),
    }
}

fn send(c: &mut Client, cmd: Command) -> Option<Value> {
    c.send(&cmd).unwrap()
}

#[test]
fn the_handshake_says_blend_only_with_the_engine() {
    let on = server("hs_on", true);
    let off = server("hs_off", false);
    let hs = |s: &Server, v: i64| send(&mut client(s), Command::CbProtocolHandshake(v));
    let pair = |a: i64, b: bool| Some(Value::Array(vec![Value::from(a), Value::Boolean(b)]));
    // LMCache's answers: [1, true] for version 1, [1, false] otherwise.
    assert_eq!(hs(&on, 1), pair(1, true));
    assert_eq!(hs(&on, 2), pair(1, false));
    // Without the engine: "incompatible", so no client blends here.
    assert_eq!(hs(&off, 1), pair(0, false));
    // No reorder planner (--enable-blend-reorder off): "keep the prompt", not a refusal.
    let key = CacheKey::whole(ModelName::new("m").unwrap(), "r", (0..32).collect(), CHUNK);
    let plan = lmcache_protocol::request::CbReorderPlan { key, keep_prefix: 0, budget_ms: 10 };
    assert_eq!(send(&mut client(&on), Command::CbReorderPlan(plan)), Some(Value::Array(vec![])));
    let m = on.state().metrics.encode();
    let refusals: Vec<&str> =
        m.lines().filter(|l| l.contains("errors") && l.contains("cb_reorder_plan")).collect();
    assert!(refusals.is_empty(), "counted as a refusal: {refusals:?}");
}

#[test]
fn rope_state_is_registered_as_lmcache_checks_it_with_yarn_scales_removed() {
    let s = server("rope", true);
    let mut c = client(&s);
    let pid = std::process::id();
    let (_cs, cache) = cos_sin(&format!("lmrs_blend_cs_{pid}"), 64, 4, 1.2);
    let engine = s.state().blend().expect("blend engine");
    // Before register_kv_cache: refused (LMCache raises), nothing recorded.
    send(&mut c, Command::CbRegisterRope(rope(1, vec![cache.clone()])));
    assert!(engine.rope(1).is_none(), "rope state without a KV registration");

    let shape = vec![2, NB, BS, 1, 4];
    let bytes = vec![0u8; (shape.iter().product::<u64>() * 2) as usize];
    let (_kv, kv) = tensor(&format!("lmrs_blend_kv_{pid}"), &bytes, Dtype::Float16, shape);
    c.register_kv_cache(1, &[kv], "m", 1, &[EngineGroupInfo::full(0, vec![0], BS)]).unwrap();

    // LMCache's checks, each refused with nothing recorded.
    let mut bad_map = rope(1, vec![cache.clone()]);
    bad_map.group_to_cache = vec![1];
    let mut bad_quant = rope(1, vec![cache.clone()]);
    bad_quant.kv_quant = "int4".into();
    let mut bad_rot = rope(1, vec![cache.clone()]);
    bad_rot.group_rot = vec![vec![0, 0]];
    let mut short_map = rope(1, vec![cache.clone()]);
    short_map.group_to_cache = vec![];
    short_map.group_rot = vec![vec![0]];
    for bad in [bad_map, bad_quant, bad_rot, short_map] {
        send(&mut c, Command::CbRegisterRope(bad));
        assert!(engine.rope(1).is_none(), "a bad registration was recorded");
    }
    // A cache past its segment's end is refused before any read.
    let IpcDescriptor::CpuShm { shm_name, nbytes, meta } = cache.clone() else { panic!() };
    let (mut past_meta, mut strided) = (meta.clone(), meta);
    past_meta.shape = vec![65, 4];
    let past = IpcDescriptor::CpuShm { shm_name: shm_name.clone(), nbytes, meta: past_meta };
    // Rows that are not contiguous (a column stride of 2) are refused too.
    (strided.shape, strided.stride) = (vec![64, 2], vec![4, 2]);
    let strided = IpcDescriptor::CpuShm { shm_name, nbytes, meta: strided };
    for bad in [past, strided] {
        send(&mut c, Command::CbRegisterRope(rope(1, vec![bad])));
        assert!(engine.rope(1).is_none());
    }

    // A good one: the scale is found and removed, the map and quant kept.
    let mut good = rope(1, vec![cache]);
    good.group_to_cache = vec![0];
    good.group_rot = vec![vec![0, 4]];
    good.kv_quant = "fp8_e5m2".into();
    good.is_neox_style = false;
    send(&mut c, Command::CbRegisterRope(good));
    let r = engine.rope(1).expect("registered");
    let m = r.mscales[0].expect("a YaRN-like scale");
    assert!((m - 1.2).abs() < 1e-3, "{m}");
    assert!((r.caches[0].mscale() - 1.0).abs() < 1e-3);
    assert_eq!(
        (r.style, r.kv_quant, r.group_rot.clone(), r.caches[0].positions()),
        (RopeStyle::GptJ, KvQuant::E5m2, vec![Some((0, 4))], 64)
    );
    // NoPE: no caches at all is legal.
    send(&mut c, Command::CbRegisterRope(rope(1, vec![])));
    assert!(engine.rope(1).expect("NoPE registered").caches.is_empty());
    send(&mut c, Command::CbUnregisterRope(1));
    assert!(engine.rope(1).is_none());
    assert!(engine.status()["registered_cb_rope_instances"].as_array().unwrap().is_empty());
}

#[test]
fn an_lmcache_driven_store_fingerprints_its_chunks_but_the_first() {
    let s = server("fp", true);
    let mut c = client(&s);
    let pid = std::process::id();
    let shape = vec![2, NB, BS, 1, 4];
    let bytes = vec![3u8; (shape.iter().product::<u64>() * 2) as usize];
    let (_kv, kv) = tensor(&format!("lmrs_blend_fpkv_{pid}"), &bytes, Dtype::Float16, shape);
    c.register_kv_cache(1, &[kv], "m", 1, &[EngineGroupInfo::full(0, vec![0], BS)]).unwrap();
    let tokens: Vec<u32> = (0..(CHUNK * 3) as u32).map(|t| t * 7 + 1).collect();
    let key = CacheKey::whole(ModelName::new("m").unwrap(), "r", tokens.clone(), CHUNK);
    let blocks = Value::Array(vec![Value::Array((0..12u64).map(Value::from).collect())]);
    let params = [key.for_worker(0).encode(), Value::from(1u64), blocks, Value::Binary(vec![])];
    let r = c.call(Op::Store, &params).unwrap().unwrap();
    assert_eq!(r.as_array().unwrap()[1], Value::Boolean(true));
    let engine = s.state().blend().unwrap();
    // Chunk 0 (the prefix leg's) is not fingerprinted; chunks 1 and 2 are, at 16 and 32.
    assert_eq!(engine.status()["fingerprinted_chunks"], 2);
    let hashes = lmcache_core::TokenHasher::new(CHUNK).unwrap().hash_tokens(&tokens);
    // A prompt with chunk 2's tokens at 5 and chunk 1's at 30.
    let mut q = vec![9u32; 5];
    q.extend_from_slice(&tokens[32..48]);
    q.extend(std::iter::repeat_n(9u32, 9));
    q.extend_from_slice(&tokens[16..32]);
    let ns = namespace(&key.for_worker(0));
    let found = engine.matcher().lock().find(&ns, &q);
    let got: Vec<_> = found.iter().map(|f| (f.hash, f.old_st, f.cur_st)).collect();
    assert_eq!(got, vec![(hashes[2].0, 32, 5), (hashes[1].0, 16, 30)]);
    // Chunk 0's tokens match nothing.
    assert!(engine.matcher().lock().find(&ns, &tokens[..16]).is_empty());
}

/// Registers worker 1 (one fp16 layer `[2, NB, BS, 1, 4]`) and returns its segment.
fn kv_worker(c: &mut Client, tag: &str) -> ShmSegment {
    let shape = vec![2, NB, BS, 1, 4];
    let bytes = vec![3u8; (shape.iter().product::<u64>() * 2) as usize];
    let name = format!("lmrs_blend_{tag}_{}", std::process::id());
    let (seg, kv) = tensor(&name, &bytes, Dtype::Float16, shape);
    c.register_kv_cache(1, &[kv], "m", 1, &[EngineGroupInfo::full(0, vec![0], BS)]).unwrap();
    seg
}

fn store_tokens(c: &mut Client, request: &str, tokens: &[u32]) {
    let key = CacheKey::whole(ModelName::new("m").unwrap(), request, tokens.to_vec(), CHUNK);
    let nblocks = (tokens.len() as u64).div_ceil(BS);
    let blocks = Value::Array(vec![Value::Array((0..nblocks).map(Value::from).collect())]);
    let params = [key.for_worker(0).encode(), Value::from(1u64), blocks, Value::Binary(vec![])];
    let r = c.call(Op::Store, &params).unwrap().unwrap();
    assert_eq!(r.as_array().unwrap()[1], Value::Boolean(true), "store {request}");
    c.end_session(request).unwrap();
}

/// `cb_unified_lookup`, asked again while it answers nothing (as LMCache's clients do).
fn unified(
    c: &mut Client,
    request: &str,
    tokens: &[u32],
) -> lmcache_protocol::types::blend::CbUnifiedLookupResult {
    let key = CacheKey::whole(ModelName::new("m").unwrap(), request, tokens.to_vec(), CHUNK);
    let cmd =
        Command::CbUnifiedLookup(lmcache_protocol::request::CbUnifiedLookup { key, tp_size: 1 });
    for _ in 0..100 {
        if let Some(v) = send(c, cmd.clone()) {
            return lmcache_protocol::types::blend::CbUnifiedLookupResult::decode("r", &v).unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("cb_unified_lookup never answered");
}

fn seq(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|t| seed * 1000 + t).collect()
}

#[test]
fn the_unified_lookup_finds_stored_chunks_past_the_prefix_and_locks_them() {
    let s = server("ul", true);
    let mut c = client(&s);
    let _kv = kv_worker(&mut c, "ulkv");
    let (a, d) = (seq(1, CHUNK), seq(4, CHUNK));
    let p1: Vec<u32> = [a.clone(), d.clone()].concat();
    store_tokens(&mut c, "p1", &p1);
    let h1 = lmcache_core::TokenHasher::new(CHUNK).unwrap().hash_tokens(&p1)[1].0.to_vec();
    let l1 = s.state().l1();

    // [B | 4 filler | D | tail]: no prefix, D found at 20, stored at 16 (LMCache's example).
    let p2: Vec<u32> = [seq(2, CHUNK), seq(9, 4), d.clone(), seq(8, 12)].concat();
    let r = unified(&mut c, "q2", &p2);
    assert_eq!(r.prefix_coverage_tokens, 0);
    let seg = |m: &lmcache_protocol::types::blend::CbMatch| {
        (m.old_st, m.old_ed, m.cur_st, m.cur_ed, m.hash.clone())
    };
    assert_eq!(
        r.non_prefix_segments.iter().map(seg).collect::<Vec<_>>(),
        vec![(16, 32, 20, 36, h1.clone())]
    );
    assert!(r.segmented_prefix_segments.is_empty());
    assert_eq!(l1.usage().locked_objects, 1, "the match's object is locked for the retrieve");
    c.end_session("q2").unwrap();
    assert_eq!(l1.usage().locked_objects, 0, "end_session releases the match's locks");

    // [A | X | D]: A is the prefix (16 tokens), D is found past it at 32.
    let p3: Vec<u32> = [a.clone(), seq(5, CHUNK), d.clone()].concat();
    let r = unified(&mut c, "q3", &p3);
    assert_eq!(r.prefix_coverage_tokens, 16);
    assert_eq!(
        r.non_prefix_segments.iter().map(seg).collect::<Vec<_>>(),
        vec![(16, 32, 32, 48, h1.clone())]
    );
    c.end_session("q3").unwrap();

    // A stored chunk F overlapping D's range in the query: the earlier match (D) wins.
    let f: Vec<u32> = p2[24..40].to_vec();
    store_tokens(&mut c, "p4", &[seq(6, CHUNK), f].concat());
    let r = unified(&mut c, "q2b", &p2);
    assert_eq!(r.non_prefix_segments.iter().map(|m| m.cur_st).collect::<Vec<_>>(), vec![20]);
    c.end_session("q2b").unwrap();

    // Another salt sees none of it.
    let mut other = CacheKey::whole(ModelName::new("m").unwrap(), "q5", p2.clone(), CHUNK);
    other.cache_salt = lmcache_core::CacheSalt::new("tenant-b").unwrap();
    let cmd = Command::CbUnifiedLookup(lmcache_protocol::request::CbUnifiedLookup {
        key: other,
        tp_size: 1,
    });
    let v = send(&mut c, cmd).expect("answered");
    let r = lmcache_protocol::types::blend::CbUnifiedLookupResult::decode("r", &v).unwrap();
    assert!(r.non_prefix_segments.is_empty(), "{r:?}");
    c.end_session("q5").unwrap();

    // D's KV gone from L1 (no L2): stale twice, then its fingerprint is removed.
    let engine = s.state().blend().unwrap();
    let before = engine.status()["fingerprinted_chunks"].as_u64().unwrap();
    l1.clear(true);
    for i in 0..2 {
        assert!(unified(&mut c, &format!("st{i}"), &p2).non_prefix_segments.is_empty());
        c.end_session(&format!("st{i}")).unwrap();
    }
    let after = engine.status()["fingerprinted_chunks"].as_u64().unwrap();
    assert!(after < before, "stale fingerprints stay: {before} -> {after}");
    assert!(
        engine
            .matcher()
            .lock()
            .find(
                &namespace(&CacheKey::whole(ModelName::new("m").unwrap(), "x", p2.clone(), CHUNK)),
                &p2
            )
            .iter()
            .all(|m| m.cur_st != 20)
    );
}

#[test]
fn a_unified_lookup_with_no_reader_is_answered_empty_not_left_pending() {
    let s = server("ul0", true);
    let mut c = client(&s);
    let _kv = kv_worker(&mut c, "ul0kv");
    let mut key = CacheKey::whole(ModelName::new("m").unwrap(), "z", seq(1, 2 * CHUNK), CHUNK);
    key.num_kv_readers = 0;
    let cmd =
        Command::CbUnifiedLookup(lmcache_protocol::request::CbUnifiedLookup { key, tp_size: 1 });
    // LMCache raises and never replies; a void reply would read as "still loading" forever.
    let v = send(&mut c, cmd).expect("a typed answer");
    let r = lmcache_protocol::types::blend::CbUnifiedLookupResult::decode("r", &v).unwrap();
    assert_eq!(r, Default::default());
}

const NH: usize = 2;
const HS: usize = 4;
const NB32: u64 = 32;

/// RoPE at `pos` (NeoX, over the whole head) applied to one head's raw K, from scratch.
fn rope_at(raw: &[f32], pos: usize) -> Vec<f32> {
    let half = HS / 2;
    let mut out = raw.to_vec();
    for i in 0..half {
        let ang = pos as f64 * 10_000f64.powf(-2.0 * i as f64 / HS as f64);
        let (c, s) = ((ang.cos() as f32) as f64, (ang.sin() as f32) as f64);
        let (x, y) = (f64::from(raw[i]), f64::from(raw[half + i]));
        out[i] = (x * c - y * s) as f32;
        out[half + i] = (x * s + y * c) as f32;
    }
    out
}

/// Element offset of `[plane, block, slot, head, d]` in a contiguous f32 `[2, NB32, BS, NH, HS]`.
fn at(plane: u64, block: u64, slot: u64, head: usize, d: usize) -> u64 {
    (((plane * NB32 + block) * BS + slot) * (NH * HS) as u64 + (head * HS + d) as u64) * 4
}

#[test]
fn the_scatter_writes_v_as_stored_and_k_rotated_to_the_new_positions_and_nothing_else() {
    let s = server("sc", true);
    let mut c = client(&s);
    let pid = std::process::id();
    // The worker's KV: f32 [2, 32 blocks, 4 slots, 2 heads, 4]; registration and rope.
    let shape = vec![2, NB32, BS, NH as u64, HS as u64];
    let bytes = vec![0u8; (shape.iter().product::<u64>() * 4) as usize];
    let name = format!("lmrs_blend_sckv_{pid}");
    let (_owner, kv) = tensor(&name, &bytes, Dtype::Float32, shape);
    let seg = ForeignSegment::open(&name, bytes.len() as u64).unwrap();
    c.register_kv_cache(1, &[kv], "m", 1, &[EngineGroupInfo::full(0, vec![0], BS)]).unwrap();
    let (_cs, cache) = cos_sin(&format!("lmrs_blend_sccs_{pid}"), 256, HS, 1.0);
    send(&mut c, Command::CbRegisterRope(rope(1, vec![cache])));
    assert!(s.state().blend().unwrap().rope(1).is_some());

    // P1 = [A | D] in blocks 0..8: K = RoPE(raw, position), V = a pattern.
    let raw = |pos: usize, h: usize| -> Vec<f32> {
        (0..HS).map(|d| ((pos * 31 + h * 7 + d * 3) % 17) as f32 / 8.0 - 1.0).collect()
    };
    let v_of = |pos: usize, h: usize, d: usize| (pos * 100 + h * 10 + d) as f32;
    for pos in 0..2 * CHUNK {
        let (b, slot) = ((pos as u64) / BS, (pos as u64) % BS);
        for h in 0..NH {
            let k = rope_at(&raw(pos, h), pos);
            for (d, kd) in k.iter().enumerate() {
                seg.write(at(0, b, slot, h, d), &kd.to_le_bytes()).unwrap();
                seg.write(at(1, b, slot, h, d), &v_of(pos, h, d).to_le_bytes()).unwrap();
            }
        }
    }
    let (a, d) = (seq(1, CHUNK), seq(4, CHUNK));
    store_tokens(&mut c, "p1", &[a, d.clone()].concat());
    // Blocks 0..8 are the engine's again: clear them so nothing but the scatter can match.
    seg.write(0, &vec![0u8; bytes.len()]).unwrap();

    let p2: Vec<u32> = [seq(2, CHUNK), seq(9, 4), d, seq(8, 12)].concat();
    let r = unified(&mut c, "q", &p2);
    assert_eq!(r.non_prefix_segments.len(), 1);
    // The request's blocks: 20..32 (48 tokens).
    let table: Vec<u64> = (20..32).collect();
    let retrieve = |c: &mut Client, table: &[u64]| {
        let cmd =
            Command::CbRetrievePreComputed(lmcache_protocol::request::CbRetrievePreComputed {
                key: CacheKey::whole(ModelName::new("m").unwrap(), "q", p2.clone(), CHUNK)
                    .for_worker(0),
                match_results: r.non_prefix_segments.clone(),
                block_ids: vec![table.to_vec()],
                instance_id: 1,
                event_ipc_handle: Vec::new(),
            });
        let v = send(c, cmd).expect("a reply");
        v.as_array().unwrap()[1].as_bool().unwrap()
    };
    // Early outcomes first: a table ending before 20 (beyond: true, nothing written) and one
    // ending inside [20, 36) (straddling: false).
    assert!(retrieve(&mut c, &table[..4]));
    assert!(!retrieve(&mut c, &table[..7]));
    let read = |off: u64| {
        let mut b = [0u8; 4];
        seg.read(off, &mut b).unwrap();
        f32::from_le_bytes(b)
    };
    let all_zero = || (0..bytes.len() as u64 / 4).all(|i| read(i * 4) == 0.0);
    assert!(all_zero(), "an early outcome wrote");

    assert!(retrieve(&mut c, &table), "the scatter ran");
    for t in 0..CHUNK {
        let (old, new) = (CHUNK + t, 20 + t);
        let (b, slot) = (table[new / BS as usize], (new as u64) % BS);
        for h in 0..NH {
            let want_k = rope_at(&raw(old, h), new);
            for (dd, want) in want_k.iter().enumerate() {
                assert_eq!(read(at(1, b, slot, h, dd)), v_of(old, h, dd), "V at {new}");
                let got = read(at(0, b, slot, h, dd));
                assert!((got - want).abs() < 1e-5, "K at {new} head {h}: {got} vs {want}");
            }
        }
    }
    // Nothing outside slots 20..36 of the request's blocks was touched.
    let written: std::collections::HashSet<(u64, u64)> =
        (20..36).map(|p: u64| (table[(p / BS) as usize], p % BS)).collect();
    for plane in 0..2 {
        for b in 0..NB32 {
            for slot in 0..BS {
                if written.contains(&(b, slot)) {
                    continue;
                }
                for h in 0..NH {
                    for dd in 0..HS {
                        assert_eq!(read(at(plane, b, slot, h, dd)), 0.0, "block {b} slot {slot}");
                    }
                }
            }
        }
    }
    // A repeat is "already applied": answered true, nothing written again.
    seg.write(0, &vec![0u8; bytes.len()]).unwrap();
    assert!(retrieve(&mut c, &table));
    assert!(all_zero(), "an applied match was written again");
    // Positions that are not one chunk (ends before starts, past u32) are refused, not
    // computed with: a typed failure, no panic.
    for (old_st, old_ed) in [(100, 0), (u64::MAX - 4, u64::MAX)] {
        let mut bad = r.non_prefix_segments[0].clone();
        (bad.old_st, bad.old_ed) = (old_st, old_ed);
        let cmd =
            Command::CbRetrievePreComputed(lmcache_protocol::request::CbRetrievePreComputed {
                key: CacheKey::whole(ModelName::new("m").unwrap(), "q", p2.clone(), CHUNK)
                    .for_worker(0),
                match_results: vec![bad],
                block_ids: vec![table.clone()],
                instance_id: 1,
                event_ipc_handle: Vec::new(),
            });
        let v = send(&mut c, cmd).expect("a reply");
        assert_eq!(v.as_array().unwrap()[1], Value::Boolean(false));
    }
    assert_eq!(s.state().metrics.handler_panics.get(), 0);
    c.end_session("q").unwrap();
    assert_eq!(s.state().l1().usage().locked_objects, 0, "no lock left behind");
}

#[test]
fn a_segmented_prefix_serves_chunks_past_a_gap_at_their_own_positions() {
    let opts = BlendOptions { segmented_prefix: true, ..BlendOptions::default() };
    let s = server_with("seg", Some(opts));
    let mut c = client(&s);
    let _kv = kv_worker(&mut c, "segkv");
    // P = [A | B | C | D] stored; B then leaves L1: the prefix hit is A alone.
    let p: Vec<u32> = [seq(1, CHUNK), seq(2, CHUNK), seq(3, CHUNK), seq(4, CHUNK)].concat();
    store_tokens(&mut c, "p", &p);
    let hashes = lmcache_core::TokenHasher::new(CHUNK).unwrap().hash_tokens(&p);
    let l1 = s.state().l1();
    let gap: Vec<_> = l1
        .resident_keys()
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| k.chunk_hash == hashes[1])
        .collect();
    assert_eq!(gap.len(), 1);
    assert!(l1.delete(&gap, true).iter().all(Result::is_ok));
    let r = unified(&mut c, "q", &p);
    assert_eq!(r.prefix_coverage_tokens, CHUNK as u64);
    let tail: Vec<_> = r
        .segmented_prefix_segments
        .iter()
        .map(|m| (m.old_st, m.old_ed, m.cur_st, m.cur_ed, m.hash.clone()))
        .collect();
    let at = |i: usize| {
        let st = (i * CHUNK) as u64;
        (st, st + CHUNK as u64, st, st + CHUNK as u64, hashes[i].0.to_vec())
    };
    assert_eq!(tail, vec![at(2), at(3)], "C and D at their own positions");
    // C and D are fingerprinted at their own positions too: not answered twice.
    assert!(r.non_prefix_segments.is_empty(), "{:?}", r.non_prefix_segments);
    // The lookup's prefix lock (A) plus C's and D's for the retrieve.
    assert_eq!(l1.usage().locked_objects, 3);
    c.end_session("q").unwrap();
    assert_eq!(l1.usage().locked_objects, 0);

    // Without the flag the hit ends at the gap, and C and D come back as ordinary matches.
    let plain = server("segoff", true);
    let mut c2 = client(&plain);
    let _kv2 = kv_worker(&mut c2, "segoffkv");
    store_tokens(&mut c2, "p", &p);
    let l1 = plain.state().l1();
    let gap: Vec<_> = l1
        .resident_keys()
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| k.chunk_hash == hashes[1])
        .collect();
    l1.delete(&gap, true);
    let r = unified(&mut c2, "q", &p);
    assert!(r.segmented_prefix_segments.is_empty());
    let starts: Vec<_> = r.non_prefix_segments.iter().map(|m| (m.old_st, m.cur_st)).collect();
    assert_eq!(starts, vec![(32, 32), (48, 48)]);
}

#[test]
fn the_reorder_plan_serves_a_stored_prompts_documents_in_its_order() {
    let opts = BlendOptions { reorder: true, ..BlendOptions::default() };
    let s = server_with("ro", Some(opts));
    let mut c = client(&s);
    let _kv = kv_worker(&mut c, "rokv");
    let (a, b, q1, q2) = (seq(1, 24), seq(2, 24), seq(8, 16), seq(9, 20));
    let stored: Vec<u32> = [&a[..], &b, &q1].concat();
    store_tokens(&mut c, "p", &stored);
    let plan = |c: &mut Client, salt: &str, tokens: Vec<u32>, keep: u64| {
        let mut key = CacheKey::whole(ModelName::new("m").unwrap(), "q", tokens, CHUNK);
        key.cache_salt = lmcache_core::CacheSalt::new(salt).unwrap();
        let req =
            lmcache_protocol::request::CbReorderPlan { key, keep_prefix: keep, budget_ms: 1000 };
        let v = send(c, Command::CbReorderPlan(req)).expect("a reply");
        v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect::<Vec<_>>()
    };
    let prompt: Vec<u32> = [&b[..], &a, &q2].concat();
    assert_eq!(plan(&mut c, "", prompt.clone(), 0), [&a[..], &b, &q2].concat());
    // Already in the stored order, another tenant, a prefix kept that the store lacks: keep.
    assert!(plan(&mut c, "", [&a[..], &b, &q2].concat(), 0).is_empty());
    assert!(plan(&mut c, "other", prompt.clone(), 0).is_empty());
    assert!(plan(&mut c, "", prompt, 4).is_empty());
    assert_eq!(s.state().blend().unwrap().status()["reorder_prompts"], 1);
}
