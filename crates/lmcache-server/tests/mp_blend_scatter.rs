//! CacheBlend's scatter over the layouts LMCache's blend engine serves, over real ZMQ:
//! several engine groups in one registration (each with its own block table, cache and head
//! size), an MLA latent whose rope part alone is rotated (`group_rot`), a sliding-window group
//! that keeps only a chunk's last tokens, a NoPE group (`group_to_cache` -1) copied as stored,
//! fp8 K (`kv_quant`) dequantized, rotated and requantized, and the registrations a scatter
//! must refuse without writing anything.
//!
//! Every check of K is against RoPE applied from scratch to the raw K at the new position,
//! nothing shared with the server's rotation.
// The checks walk one element index across several tensors and references.
#![allow(clippy::needless_range_loop)]

use std::time::Duration;

use lmcache_client::{CacheKey, Client, EngineGroupInfo, IpcDescriptor, TensorMeta};
use lmcache_core::{Dtype, ModelName};
use lmcache_memory::shm::ShmSegment;
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_protocol::Op;
use lmcache_protocol::request::{CbRegisterRope, CbRetrievePreComputed, CbUnifiedLookup, Command};
use lmcache_protocol::types::blend::{CbMatch, CbUnifiedLookupResult};
use lmcache_server::blend::BlendOptions;
use lmcache_server::{Server, ServerConfig};
use rmpv::Value;

const CHUNK: usize = 16;
const BS: u64 = 4;
const NB: u64 = 32;
const HS: usize = 4;
const NH: usize = 2;
/// The MLA latent: 2 content elements, then the 4 rope elements.
const LATENT: usize = 6;

fn server(tag: &str) -> Server {
    Server::start(ServerConfig {
        chunk_size: CHUNK,
        blend: Some(BlendOptions::default()),
        ..ServerConfig::local(ArenaConfig {
            size: 32 << 20,
            backing: ArenaBacking::SharedMemory {
                name: format!("lmrs_bsc_l1_{tag}_{}", std::process::id()),
            },
            mlock: false,
        })
    })
    .unwrap()
}

fn contiguous(shape: &[u64]) -> Vec<u64> {
    let mut stride = vec![1u64; shape.len()];
    for d in (0..shape.len() - 1).rev() {
        stride[d] = stride[d + 1] * shape[d + 1];
    }
    stride
}

/// A zeroed tensor in a segment of the test's own, its view, and its descriptor.
struct Tensor {
    _owner: ShmSegment,
    seg: ForeignSegment,
    desc: IpcDescriptor,
    dtype: Dtype,
    bytes: u64,
}

fn tensor(name: &str, dtype: Dtype, shape: Vec<u64>) -> Tensor {
    let bytes = shape.iter().product::<u64>() * dtype.itemsize();
    let owner = ShmSegment::create(name, bytes).unwrap();
    let seg = ForeignSegment::open(name, bytes).unwrap();
    seg.write(0, &vec![0u8; bytes as usize]).unwrap();
    let stride = contiguous(&shape);
    let meta = TensorMeta { dtype, shape, stride, storage_offset: 0, device_uuid: "cpu".into() };
    let desc = IpcDescriptor::CpuShm { shm_name: name.into(), nbytes: bytes, meta };
    Tensor { _owner: owner, seg, desc, dtype, bytes }
}

impl Tensor {
    fn put(&self, elem: u64, v: f32) {
        let b: Vec<u8> = match self.dtype {
            Dtype::Float32 => v.to_le_bytes().to_vec(),
            Dtype::Float16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
            Dtype::UInt8 => vec![float8::F8E4M3::from_f32(v).to_bits()],
            other => panic!("{other:?}"),
        };
        self.seg.write(elem * self.dtype.itemsize(), &b).unwrap();
    }

    fn get(&self, elem: u64) -> f32 {
        let mut b = vec![0u8; self.dtype.itemsize() as usize];
        self.seg.read(elem * self.dtype.itemsize(), &mut b).unwrap();
        match self.dtype {
            Dtype::Float32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            Dtype::Float16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            Dtype::UInt8 => float8::F8E4M3::from_bits(b[0]).to_f32(),
            other => panic!("{other:?}"),
        }
    }

    fn raw(&self, elem: u64) -> Vec<u8> {
        let mut b = vec![0u8; self.dtype.itemsize() as usize];
        self.seg.read(elem * self.dtype.itemsize(), &mut b).unwrap();
        b
    }

    fn zero(&self) {
        self.seg.write(0, &vec![0u8; self.bytes as usize]).unwrap();
    }

    fn all_zero_but(&self, keep: impl Fn(u64) -> bool) -> Option<u64> {
        let n = self.bytes / self.dtype.itemsize();
        (0..n).find(|&e| !keep(e) && self.raw(e).iter().any(|&x| x != 0))
    }
}

/// `[positions, HS]` fp32 cos/sin (NeoX halves: cos then sin).
fn cos_sin(name: &str) -> Tensor {
    let t = tensor(name, Dtype::Float32, vec![256, HS as u64]);
    for p in 0..256u64 {
        for i in 0..HS / 2 {
            let ang = p as f32 * 10_000f32.powf(-2.0 * i as f32 / HS as f32);
            t.put(p * HS as u64 + i as u64, ang.cos());
            t.put(p * HS as u64 + (HS / 2 + i) as u64, ang.sin());
        }
    }
    t
}

/// NeoX RoPE of a 4-element window at `pos`, from scratch, in f64.
fn rope(raw: &[f32], pos: usize) -> Vec<f32> {
    let mut out = raw.to_vec();
    for i in 0..HS / 2 {
        let ang = f64::from(pos as f32 * 10_000f32.powf(-2.0 * i as f32 / HS as f32));
        let (c, s) = (f64::from(ang.cos() as f32), f64::from(ang.sin() as f32));
        let (x, y) = (f64::from(raw[i]), f64::from(raw[HS / 2 + i]));
        out[i] = (x * c - y * s) as f32;
        out[HS / 2 + i] = (x * s + y * c) as f32;
    }
    out
}

fn raw_k(layer: usize, pos: usize, h: usize) -> Vec<f32> {
    (0..HS).map(|d| ((pos * 31 + h * 7 + d * 3 + layer * 5) % 17) as f32 / 8.0 - 1.0).collect()
}

fn v_of(layer: usize, pos: usize, e: usize) -> f32 {
    ((pos * 13 + e * 3 + layer * 7) % 29) as f32 / 4.0 - 3.0
}

fn seq(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|t| seed * 1000 + t).collect()
}

fn info(g: i64, sw: i64) -> EngineGroupInfo {
    EngineGroupInfo { sw_size_tokens: sw, ..EngineGroupInfo::full(g, vec![g as u64], BS) }
}

fn send(c: &mut Client, cmd: Command) -> Option<Value> {
    c.send(&cmd).unwrap()
}

fn key(request: &str, tokens: &[u32]) -> CacheKey {
    CacheKey::whole(ModelName::new("m").unwrap(), request, tokens.to_vec(), CHUNK)
}

/// Stores `tokens` from blocks `0..` of every one of `groups` kernel groups.
fn store(c: &mut Client, request: &str, tokens: &[u32], groups: usize) {
    let nblocks = (tokens.len() as u64).div_ceil(BS);
    let table = Value::Array((0..nblocks).map(Value::from).collect());
    let blocks = Value::Array(vec![table; groups]);
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

fn unified(c: &mut Client, request: &str, tokens: &[u32]) -> CbUnifiedLookupResult {
    let cmd = Command::CbUnifiedLookup(CbUnifiedLookup { key: key(request, tokens), tp_size: 1 });
    for _ in 0..200 {
        if let Some(v) = send(c, cmd.clone()) {
            return CbUnifiedLookupResult::decode("r", &v).unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("cb_unified_lookup never answered");
}

fn retrieve(
    c: &mut Client,
    request: &str,
    tokens: &[u32],
    m: &[CbMatch],
    tables: Vec<Vec<u64>>,
) -> bool {
    let cmd = Command::CbRetrievePreComputed(CbRetrievePreComputed {
        key: key(request, tokens).for_worker(0),
        match_results: m.to_vec(),
        block_ids: tables,
        instance_id: 1,
        event_ipc_handle: Vec::new(),
    });
    send(c, cmd).expect("a reply").as_array().unwrap()[1].as_bool().unwrap()
}

fn rope_registration(caches: Vec<IpcDescriptor>) -> CbRegisterRope {
    CbRegisterRope {
        instance_id: 1,
        cos_sin_caches: caches,
        head_size: HS as u32,
        is_neox_style: true,
        group_to_cache: Vec::new(),
        group_rot: Vec::new(),
        group_head_size: Vec::new(),
        kv_quant: String::new(),
    }
}

/// P1 = [A | D] stored; P2 = [B | 4 filler | D | 12 tail] finds D (stored at 16) at 20.
fn prompts() -> (Vec<u32>, Vec<u32>) {
    let d = seq(4, CHUNK);
    let p1 = [seq(1, CHUNK), d.clone()].concat();
    let p2 = [seq(2, CHUNK), seq(9, 4), d, seq(8, 12)].concat();
    (p1, p2)
}

/// The blocks P2's request scatters into (48 tokens), and the slot of position `pos`.
const TABLE: std::ops::Range<u64> = 20..32;
fn slot(pos: usize) -> (u64, u64) {
    (TABLE.start + pos as u64 / BS, pos as u64 % BS)
}

#[test]
fn attention_an_mla_latent_a_window_and_nope_groups_scatter_as_each_should() {
    let s = server("multi");
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(30)).unwrap();
    let pid = std::process::id();
    // eg0: attention, f16 [2, NB, BS, NH, HS]; eg1: an MLA latent, f32 [NB, BS, 6] (rope in
    // its last 4); eg2: a window of 8 tokens (half a chunk), f32 [2, NB, BS, 1, HS], NoPE.
    let attn =
        tensor(&format!("lmrs_bsc_a_{pid}"), Dtype::Float16, vec![2, NB, BS, NH as u64, HS as u64]);
    let mla = tensor(&format!("lmrs_bsc_m_{pid}"), Dtype::Float32, vec![NB, BS, LATENT as u64]);
    let win = tensor(&format!("lmrs_bsc_w_{pid}"), Dtype::Float32, vec![2, NB, BS, 1, HS as u64]);
    let infos = [info(0, -1), info(1, -1), info(2, 8)];
    c.register_kv_cache(
        1,
        &[attn.desc.clone(), mla.desc.clone(), win.desc.clone()],
        "m",
        1,
        &infos,
    )
    .unwrap();
    let cache = cos_sin(&format!("lmrs_bsc_cs_{pid}"));
    let mut reg = rope_registration(vec![cache.desc.clone()]);
    reg.group_to_cache = vec![0, 0, -1];
    reg.group_rot = vec![vec![0, HS as i64], vec![2, HS as i64], vec![]];
    reg.group_head_size = vec![HS as u64, LATENT as u64, HS as u64];
    send(&mut c, Command::CbRegisterRope(reg));
    assert!(s.state().blend().unwrap().rope(1).is_some(), "rope registered");

    // The engine's KV of P1 in blocks 0..8: K = RoPE(raw, pos), V a pattern.
    let (p1, p2) = prompts();
    let a_at = |plane: u64, b: u64, sl: u64, h: usize, d: usize| {
        (((plane * NB + b) * BS + sl) * NH as u64 + h as u64) * HS as u64 + d as u64
    };
    let m_at = |b: u64, sl: u64, e: usize| (b * BS + sl) * LATENT as u64 + e as u64;
    let w_at =
        |plane: u64, b: u64, sl: u64, d: usize| ((plane * NB + b) * BS + sl) * HS as u64 + d as u64;
    for pos in 0..2 * CHUNK {
        let (b, sl) = (pos as u64 / BS, pos as u64 % BS);
        for h in 0..NH {
            for (d, k) in rope(&raw_k(0, pos, h), pos).iter().enumerate() {
                attn.put(a_at(0, b, sl, h, d), *k);
                attn.put(a_at(1, b, sl, h, d), v_of(0, pos, h * HS + d));
            }
        }
        for e in 0..2 {
            mla.put(m_at(b, sl, e), v_of(1, pos, e));
        }
        for (d, k) in rope(&raw_k(1, pos, 0), pos).iter().enumerate() {
            mla.put(m_at(b, sl, 2 + d), *k);
        }
        for d in 0..HS {
            win.put(w_at(0, b, sl, d), raw_k(2, pos, 0)[d]);
            win.put(w_at(1, b, sl, d), v_of(2, pos, d));
        }
    }
    store(&mut c, "p1", &p1, 3);
    for t in [&attn, &mla, &win] {
        t.zero();
    }

    let r = unified(&mut c, "q", &p2);
    assert_eq!(r.non_prefix_segments.len(), 1, "{r:?}");
    assert_eq!((r.non_prefix_segments[0].old_st, r.non_prefix_segments[0].cur_st), (16, 20));
    let tables = vec![TABLE.collect::<Vec<u64>>(); 3];
    assert!(retrieve(&mut c, "q", &p2, &r.non_prefix_segments, tables), "the scatter ran");

    let news: Vec<usize> = (20..36).collect();
    for t in 0..CHUNK {
        let (old, new) = (16 + t, 20 + t);
        let (b, sl) = slot(new);
        // Attention: V as stored (f16 bits), K rotated to the new position.
        for h in 0..NH {
            let want = rope(&raw_k(0, old, h), new);
            for d in 0..HS {
                let got = attn.get(a_at(0, b, sl, h, d));
                assert!((got - want[d]).abs() < 4e-3, "attention K at {new}: {got} vs {}", want[d]);
                let v = half::f16::from_f32(v_of(0, old, h * HS + d)).to_f32();
                assert_eq!(attn.get(a_at(1, b, sl, h, d)), v, "attention V at {new}");
            }
        }
        // MLA: the content as stored, the rope part rotated.
        for e in 0..2 {
            assert_eq!(mla.get(m_at(b, sl, e)), v_of(1, old, e), "latent content at {new}");
        }
        let want = rope(&raw_k(1, old, 0), new);
        for d in 0..HS {
            let got = mla.get(m_at(b, sl, 2 + d));
            assert!((got - want[d]).abs() < 1e-5, "latent rope at {new}: {got} vs {}", want[d]);
        }
        // The window kept the chunk's last 8 tokens: those land, as stored (NoPE).
        for d in 0..HS {
            let (k, v) = (win.get(w_at(0, b, sl, d)), win.get(w_at(1, b, sl, d)));
            if t >= 8 {
                assert_eq!((k, v), (raw_k(2, old, 0)[d], v_of(2, old, d)), "window at {new}");
            } else {
                assert_eq!((k, v), (0.0, 0.0), "a token outside the window was written at {new}");
            }
        }
    }
    // Nothing outside the match's slots.
    let hit = |b: u64, sl: u64| news.iter().any(|&p| slot(p) == (b, sl));
    let per_slot_attn = (NH * HS) as u64;
    let outside = attn.all_zero_but(|e| {
        let sl_idx = e / per_slot_attn;
        let (b, sl) = ((sl_idx / BS) % NB, sl_idx % BS);
        hit(b, sl)
    });
    assert_eq!(outside, None, "attention written outside the match");
    assert_eq!(mla.all_zero_but(|e| hit((e / LATENT as u64) / BS, (e / LATENT as u64) % BS)), None);
    let outside = win.all_zero_but(|e| {
        let sl_idx = e / HS as u64;
        hit((sl_idx / BS) % NB, sl_idx % BS)
    });
    assert_eq!(outside, None, "window group written outside the match");
    c.end_session("q").unwrap();
    assert_eq!(s.state().l1().usage().locked_objects, 0);
    let m = s.state().metrics.encode();
    assert!(m.contains("lmcache_blend_scatter_shifted_chunks_total 1"), "{m}");
}

#[test]
fn fp8_k_is_dequantized_rotated_and_requantized_and_refused_without_its_flavour() {
    let s = server("fp8");
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(30)).unwrap();
    let pid = std::process::id();
    // vLLM's fp8 KV: uint8 tensors, e4m3 bytes.
    let kv =
        tensor(&format!("lmrs_bsc_f8_{pid}"), Dtype::UInt8, vec![2, NB, BS, NH as u64, HS as u64]);
    c.register_kv_cache(1, std::slice::from_ref(&kv.desc), "m", 1, &[info(0, -1)]).unwrap();
    let cache = cos_sin(&format!("lmrs_bsc_f8cs_{pid}"));
    let at = |plane: u64, b: u64, sl: u64, h: usize, d: usize| {
        (((plane * NB + b) * BS + sl) * NH as u64 + h as u64) * HS as u64 + d as u64
    };
    let (p1, p2) = prompts();
    let write_p1 = || {
        for pos in 0..2 * CHUNK {
            let (b, sl) = (pos as u64 / BS, pos as u64 % BS);
            for h in 0..NH {
                for (d, k) in rope(&raw_k(0, pos, h), pos).iter().enumerate() {
                    kv.put(at(0, b, sl, h, d), *k);
                    kv.put(at(1, b, sl, h, d), v_of(0, pos, h * HS + d) / 4.0);
                }
            }
        }
    };
    write_p1();
    store(&mut c, "p1", &p1, 1);
    kv.zero();
    let tables = vec![TABLE.collect::<Vec<u64>>()];

    // Without a kv_quant flavour uint8 K cannot be rotated: refused, nothing written.
    send(&mut c, Command::CbRegisterRope(rope_registration(vec![cache.desc.clone()])));
    let r = unified(&mut c, "q0", &p2);
    assert_eq!(r.non_prefix_segments.len(), 1);
    assert!(!retrieve(&mut c, "q0", &p2, &r.non_prefix_segments, tables.clone()));
    assert_eq!(kv.all_zero_but(|_| false), None, "a refused scatter wrote");
    c.end_session("q0").unwrap();

    let mut reg = rope_registration(vec![cache.desc.clone()]);
    reg.kv_quant = "fp8_e4m3".into();
    send(&mut c, Command::CbRegisterRope(reg));
    let r = unified(&mut c, "q", &p2);
    assert!(retrieve(&mut c, "q", &p2, &r.non_prefix_segments, tables), "the fp8 scatter ran");
    let mut moved = 0f32;
    for t in 0..CHUNK {
        let (old, new) = (16 + t, 20 + t);
        let (b, sl) = slot(new);
        for h in 0..NH {
            let want = rope(&raw_k(0, old, h), new);
            let stored = rope(&raw_k(0, old, h), old);
            for d in 0..HS {
                let got = kv.get(at(0, b, sl, h, d));
                // Two e4m3 roundings (the store's and the scatter's): within 2 * 2^-3 of 1.
                assert!((got - want[d]).abs() <= 0.13, "fp8 K at {new}: {got} vs {}", want[d]);
                moved = moved.max((stored[d] - want[d]).abs());
                let v = float8::F8E4M3::from_f32(v_of(0, old, h * HS + d) / 4.0).to_bits();
                assert_eq!(kv.raw(at(1, b, sl, h, d)), vec![v], "fp8 V bytes at {new}");
            }
        }
    }
    assert!(moved > 0.5, "the check cannot tell a rotation from a copy ({moved})");
    c.end_session("q").unwrap();
}

#[test]
fn a_scatter_the_rope_state_cannot_serve_is_refused_before_any_write() {
    let s = server("refuse");
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(30)).unwrap();
    let pid = std::process::id();
    let mla = tensor(&format!("lmrs_bsc_rm_{pid}"), Dtype::Float32, vec![NB, BS, LATENT as u64]);
    c.register_kv_cache(1, std::slice::from_ref(&mla.desc), "m", 1, &[info(0, -1)]).unwrap();
    let cache = cos_sin(&format!("lmrs_bsc_rcs_{pid}"));
    for pos in 0..2 * CHUNK {
        for e in 0..LATENT {
            mla.put((pos as u64) * LATENT as u64 + e as u64, v_of(0, pos, e) + 0.5);
        }
    }
    let (p1, p2) = prompts();
    store(&mut c, "p1", &p1, 1);
    mla.zero();
    let tables = vec![TABLE.collect::<Vec<u64>>()];
    // A single-plane latent with no declared window (its content would be rotated), and an
    // MLA window whose width is not the cache's rotary width: refused, nothing written.
    let legacy = rope_registration(vec![cache.desc.clone()]);
    let mut narrow = rope_registration(vec![cache.desc.clone()]);
    narrow.group_rot = vec![vec![4, 2]];
    for (i, reg) in [legacy, narrow].into_iter().enumerate() {
        send(&mut c, Command::CbRegisterRope(reg));
        assert!(s.state().blend().unwrap().rope(1).is_some());
        let id = format!("q{i}");
        let r = unified(&mut c, &id, &p2);
        assert_eq!(r.non_prefix_segments.len(), 1);
        assert!(!retrieve(&mut c, &id, &p2, &r.non_prefix_segments, tables.clone()), "case {i}");
        assert_eq!(mla.all_zero_but(|_| false), None, "case {i}: a refused scatter wrote");
        c.end_session(&id).unwrap();
    }
    // A block table missing for the group's engine group: refused too.
    let mut ok = rope_registration(vec![cache.desc.clone()]);
    ok.group_rot = vec![vec![2, HS as i64]];
    send(&mut c, Command::CbRegisterRope(ok));
    let r = unified(&mut c, "q2", &p2);
    assert!(!retrieve(&mut c, "q2", &p2, &r.non_prefix_segments, vec![]));
    assert_eq!(mla.all_zero_but(|_| false), None);
    // With the right window it runs.
    assert!(retrieve(&mut c, "q2", &p2, &r.non_prefix_segments, tables));
    assert!(mla.all_zero_but(|_| false).is_some());
    c.end_session("q2").unwrap();
    assert_eq!(s.state().metrics.handler_panics.get(), 0);
    assert_eq!(s.state().l1().usage().locked_objects, 0);
}

/// LMCache's default model shape: a 256-token chunk of 32 layers of 8 fp16 heads of 128 is a
/// 32 MiB object, whose scatter spreads its slabs over threads.
#[test]
fn a_32_mib_chunk_of_lmcaches_default_shape_scatters_whole() {
    const CH: usize = 256;
    const L: usize = 32;
    const H: usize = 8;
    const D: usize = 128;
    const B: u64 = 16;
    const NBLK: u64 = 72;
    let pid = std::process::id();
    let s = Server::start(ServerConfig {
        chunk_size: CH,
        blend: Some(BlendOptions::default()),
        ..ServerConfig::local(ArenaConfig {
            size: 160 << 20,
            backing: ArenaBacking::SharedMemory { name: format!("lmrs_bsc_big_{pid}") },
            mlock: false,
        })
    })
    .unwrap();
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(60)).unwrap();
    let row = H * D;
    let slot_elems = |plane: u64, b: u64, sl: u64| ((plane * NBLK + b) * B + sl) * row as u64;
    // NeoX RoPE over a 128 head at `pos` (theta 10000), from scratch.
    let inv: Vec<f64> = (0..D / 2).map(|i| 10_000f64.powf(-2.0 * i as f64 / D as f64)).collect();
    let rope128 = |raw: &[f32], pos: usize| -> Vec<f32> {
        let mut out = raw.to_vec();
        for i in 0..D / 2 {
            let ang = (pos as f64 * inv[i]) as f32;
            let (c, s) = (f64::from(ang.cos()), f64::from(ang.sin()));
            let (x, y) = (f64::from(raw[i]), f64::from(raw[D / 2 + i]));
            out[i] = (x * c - y * s) as f32;
            out[D / 2 + i] = (x * s + y * c) as f32;
        }
        out
    };
    let raw = |l: usize, pos: usize, h: usize| -> Vec<f32> {
        (0..D).map(|d| ((l * 7 + pos * 13 + h * 5 + d * 3) % 41) as f32 / 20.0 - 1.0).collect()
    };
    let v = |l: usize, pos: usize, e: usize| ((l * 3 + pos * 11 + e * 7) % 53) as f32 / 8.0 - 3.0;
    let shape = vec![2, NBLK, B, H as u64, D as u64];
    let mut layers = Vec::new();
    for l in 0..L {
        let t = tensor(&format!("lmrs_bsc_big{l}_{pid}"), Dtype::Float16, shape.clone());
        let mut bytes = vec![0u8; t.bytes as usize];
        let mut put = |elem: u64, x: f32| {
            let at = elem as usize * 2;
            bytes[at..at + 2].copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
        };
        for pos in 0..2 * CH {
            let (b, sl) = (pos as u64 / B, pos as u64 % B);
            for h in 0..H {
                for (d, k) in rope128(&raw(l, pos, h), pos).iter().enumerate() {
                    put(slot_elems(0, b, sl) + (h * D + d) as u64, *k);
                    put(slot_elems(1, b, sl) + (h * D + d) as u64, v(l, pos, h * D + d));
                }
            }
        }
        t.seg.write(0, &bytes).unwrap();
        layers.push(t);
    }
    let descs: Vec<IpcDescriptor> = layers.iter().map(|t| t.desc.clone()).collect();
    let info = EngineGroupInfo::full(0, (0..L as u64).collect(), B);
    c.register_kv_cache(1, &descs, "m", 1, &[info]).unwrap();
    // vLLM's cos/sin cache for 1024 positions of a 128 head.
    let cs = tensor(&format!("lmrs_bsc_bigcs_{pid}"), Dtype::Float32, vec![1024, D as u64]);
    let mut bytes = Vec::with_capacity(1024 * D * 4);
    for p in 0..1024 {
        for j in 0..D {
            let ang = (p as f64 * inv[j % (D / 2)]) as f32;
            bytes.extend_from_slice(&(if j < D / 2 { ang.cos() } else { ang.sin() }).to_le_bytes());
        }
    }
    cs.seg.write(0, &bytes).unwrap();
    let mut reg = rope_registration(vec![cs.desc.clone()]);
    reg.head_size = D as u32;
    send(&mut c, Command::CbRegisterRope(reg));

    let tokens: Vec<u32> = (0..2 * CH as u32).collect();
    let key =
        |id: &str, t: &[u32]| CacheKey::whole(ModelName::new("m").unwrap(), id, t.to_vec(), CH);
    let blocks = Value::Array(vec![Value::Array((0..32u64).map(Value::from).collect())]);
    let params = [
        key("p", &tokens).for_worker(0).encode(),
        Value::from(1u64),
        blocks,
        Value::Binary(vec![]),
    ];
    assert_eq!(
        c.call(Op::Store, &params).unwrap().unwrap().as_array().unwrap()[1],
        Value::Boolean(true)
    );
    c.end_session("p").unwrap();
    for t in &layers {
        t.zero();
    }
    // The second chunk reused at 300 (not block-aligned) of a new prompt.
    let p2: Vec<u32> =
        [(5000..5300).collect::<Vec<u32>>(), tokens[CH..].to_vec(), vec![7; 20]].concat();
    let cmd = Command::CbUnifiedLookup(CbUnifiedLookup { key: key("q", &p2), tp_size: 1 });
    let r = (0..200)
        .find_map(|_| {
            let v = send(&mut c, cmd.clone());
            if v.is_none() {
                std::thread::sleep(Duration::from_millis(10));
            }
            v
        })
        .map(|v| CbUnifiedLookupResult::decode("r", &v).unwrap())
        .expect("answered");
    assert_eq!((r.non_prefix_segments[0].old_st, r.non_prefix_segments[0].cur_st), (256, 300));
    let table: Vec<u64> = (32..NBLK).collect();
    let cmd = Command::CbRetrievePreComputed(CbRetrievePreComputed {
        key: key("q", &p2).for_worker(0),
        match_results: r.non_prefix_segments.clone(),
        block_ids: vec![table.clone()],
        instance_id: 1,
        event_ipc_handle: Vec::new(),
    });
    assert_eq!(send(&mut c, cmd).unwrap().as_array().unwrap()[1], Value::Boolean(true));
    for (l, t) in layers.iter().enumerate() {
        for tok in 0..CH {
            let (old, new) = (CH + tok, 300 + tok);
            let (b, sl) = (table[new / B as usize], new as u64 % B);
            // V: every element of every token, exactly.
            let mut got = vec![0u8; row * 2];
            t.seg.read(slot_elems(1, b, sl) * 2, &mut got).unwrap();
            let want: Vec<u8> =
                (0..row).flat_map(|e| half::f16::from_f32(v(l, old, e)).to_le_bytes()).collect();
            assert_eq!(got, want, "layer {l} V at {new}");
            // K: every 7th token, every head, against RoPE at the new position from raw K.
            if tok % 7 == 0 {
                t.seg.read(slot_elems(0, b, sl) * 2, &mut got).unwrap();
                for h in 0..H {
                    let want = rope128(&raw(l, old, h), new);
                    for d in 0..D {
                        let at = (h * D + d) * 2;
                        let k = half::f16::from_le_bytes([got[at], got[at + 1]]).to_f32();
                        assert!(
                            (k - want[d]).abs() < 6e-3,
                            "layer {l} K at {new} head {h}: {k} vs {}",
                            want[d]
                        );
                    }
                }
            }
        }
    }
    // Only the match's 256 slots were written: the block before 300 and after 556 are zero.
    let (first_b, first_sl) = (table[300 / B as usize], 300 % B);
    let mut before = vec![0u8; row * 2];
    layers[0].seg.read(slot_elems(0, first_b, first_sl - 1) * 2, &mut before).unwrap();
    assert!(before.iter().all(|&x| x == 0), "the slot before the match was written");
    c.end_session("q").unwrap();
    assert_eq!(s.state().l1().usage().locked_objects, 0);
}
