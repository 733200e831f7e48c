//! CacheBlend's scatter through the server, against a plain copy of the same bytes: one chunk
//! of LMCache's default shape (fp16, 32 layers, 8 heads x 128, blocks of 16: a 32 MiB object)
//! stored from an lmcache-driven worker, then written back into the worker's blocks three ways,
//! over ZMQ from an in-process server, alternating, medians of 20:
//! - `memcpy`: `copy_from_slice` of 32 MiB (the ceiling);
//! - `retrieve`: the server's ordinary lmcache-driven retrieve of the chunk (block-aligned);
//! - `blend`: `cb_retrieve_pre_computed` of the same chunk moved from 256 to 300 (not
//!   block-aligned), V as stored and K re-rotated (NeoX, 128-element window);
//! - `blend, NoPE`: the same scatter with no rope cache (K copied as stored): the scatter's
//!   own cost without the rotation.
//!
//! Run: `cargo bench -p lmcache-server --bench blend_scatter`.
#![expect(clippy::expect_used, reason = "a benchmark binary: any failure should abort it")]

use std::time::{Duration, Instant};

use lmcache_client::{CacheKey, Client, EngineGroupInfo, IpcDescriptor, TensorMeta};
use lmcache_core::{Dtype, ModelName};
use lmcache_memory::shm::ShmSegment;
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_protocol::Op;
use lmcache_protocol::request::{CbRegisterRope, CbRetrievePreComputed, Command, Retrieve};
use lmcache_protocol::types::blend::CbMatch;
use lmcache_server::blend::BlendOptions;
use lmcache_server::{Server, ServerConfig};
use rmpv::Value;

const CHUNK: usize = 256;
const LAYERS: usize = 32;
const BS: u64 = 16;
const NB: u64 = 128;
const NH: u64 = 8;
const HS: u64 = 128;
const ROUNDS: usize = 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let pid = std::process::id();
    let server = Server::start(ServerConfig {
        chunk_size: CHUNK,
        blend: Some(BlendOptions::default()),
        ..ServerConfig::local(ArenaConfig {
            size: 256 << 20,
            backing: ArenaBacking::SharedMemory { name: format!("lmrs_bench_blend_{pid}") },
            mlock: false,
        })
    })
    .expect("server");
    let mut c = Client::connect(server.endpoint(), Duration::from_secs(60)).expect("client");
    // 32 layer tensors [2, NB, BS, NH, HS] fp16, with a pattern.
    let shape = vec![2, NB, BS, NH, HS];
    let bytes = (shape.iter().product::<u64>() * 2) as usize;
    let pattern: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8 & 0x3b).collect();
    let mut owners = Vec::new();
    let mut layers = Vec::new();
    for l in 0..LAYERS {
        let name = format!("lmrs_bench_blend_kv{l}_{pid}");
        let owner = ShmSegment::create(&name, bytes as u64).expect("segment");
        ForeignSegment::open(&name, bytes as u64).expect("open").write(0, &pattern).expect("fill");
        let meta = TensorMeta {
            dtype: Dtype::Float16,
            shape: shape.clone(),
            stride: vec![NB * BS * NH * HS, BS * NH * HS, NH * HS, HS, 1],
            storage_offset: 0,
            device_uuid: "cpu".into(),
        };
        layers.push(IpcDescriptor::CpuShm { shm_name: name, nbytes: bytes as u64, meta });
        owners.push(owner);
    }
    let info = EngineGroupInfo::full(0, (0..LAYERS as u64).collect(), BS);
    c.register_kv_cache(1, &layers, "m", 1, &[info]).expect("register");
    // A vLLM-style cos/sin cache of 4096 positions.
    let cs: Vec<u8> = (0..4096 * HS as usize)
        .flat_map(|i| {
            let (p, j) = (i / HS as usize, i % HS as usize);
            let k = j % (HS as usize / 2);
            let ang = p as f64 * 10_000f64.powf(-2.0 * k as f64 / HS as f64);
            (if j < HS as usize / 2 { ang.cos() } else { ang.sin() } as f32).to_le_bytes()
        })
        .collect();
    let cs_name = format!("lmrs_bench_blend_cs_{pid}");
    let _cs_owner = ShmSegment::create(&cs_name, cs.len() as u64).expect("segment");
    ForeignSegment::open(&cs_name, cs.len() as u64).expect("open").write(0, &cs).expect("fill");
    let cache = IpcDescriptor::CpuShm {
        shm_name: cs_name,
        nbytes: cs.len() as u64,
        meta: TensorMeta {
            dtype: Dtype::Float32,
            shape: vec![4096, HS],
            stride: vec![HS, 1],
            storage_offset: 0,
            device_uuid: "cpu".into(),
        },
    };
    let rope = |caches: Vec<IpcDescriptor>| {
        Command::CbRegisterRope(CbRegisterRope {
            instance_id: 1,
            cos_sin_caches: caches,
            head_size: HS as u32,
            is_neox_style: true,
            group_to_cache: vec![],
            group_rot: vec![],
            group_head_size: vec![],
            kv_quant: String::new(),
        })
    };
    c.send(&rope(vec![cache.clone()])).expect("rope");

    // Store [A | D] from blocks 0..32.
    let tokens: Vec<u32> = (0..2 * CHUNK as u32).collect();
    let key = CacheKey::whole(ModelName::new("m").expect("model"), "p", tokens.clone(), CHUNK);
    let blocks = Value::Array(vec![Value::Array((0..32u64).map(Value::from).collect())]);
    let params = [key.for_worker(0).encode(), Value::from(1u64), blocks, Value::Binary(vec![])];
    let r = c.call(Op::Store, &params).expect("store").expect("reply");
    assert_eq!(r.as_array().expect("pair")[1], Value::Boolean(true));
    c.end_session("p").expect("end");
    let hash = lmcache_core::TokenHasher::new(CHUNK).expect("hasher").hash_tokens(&tokens)[1].0;

    let object = 2 * LAYERS * CHUNK * (NH * HS) as usize * 2;
    let src = vec![7u8; object];
    let mut dst = vec![0u8; object];
    let retrieve_d = |c: &mut Client, i: usize| {
        let mut k = key.for_worker(0);
        k.request_id = format!("r{i}");
        k.start = CHUNK;
        let ok = c
            .retrieve(Retrieve {
                key: k,
                instance_id: 1,
                block_ids: vec![(64..80).collect()],
                event_ipc_handle: vec![],
                skip_first_n_tokens: 0,
            })
            .expect("retrieve");
        assert!(ok, "retrieve");
    };
    let blend = |c: &mut Client, i: usize| {
        let m = CbMatch { old_st: 256, old_ed: 512, cur_st: 300, cur_ed: 556, hash: hash.to_vec() };
        let mut k = key.for_worker(0);
        k.request_id = format!("b{i}");
        let cmd = Command::CbRetrievePreComputed(CbRetrievePreComputed {
            key: k,
            match_results: vec![m],
            block_ids: vec![(64..100).collect()],
            instance_id: 1,
            event_ipc_handle: vec![],
        });
        let v = c.send(&cmd).expect("cb_retrieve").expect("reply");
        assert_eq!(v.as_array().expect("pair")[1], Value::Boolean(true), "scatter");
    };
    let (mut t_copy, mut t_ret, mut t_blend, mut t_nope) = (vec![], vec![], vec![], vec![]);
    for i in 0..=ROUNDS {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        t_copy.push(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
        let t = Instant::now();
        retrieve_d(&mut c, i);
        t_ret.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        blend(&mut c, 2 * i);
        t_blend.push(t.elapsed().as_secs_f64());
        c.send(&rope(vec![])).expect("NoPE rope");
        let t = Instant::now();
        blend(&mut c, 2 * i + 1);
        t_nope.push(t.elapsed().as_secs_f64());
        c.send(&rope(vec![cache.clone()])).expect("rope");
    }
    let (copy, ret, bl, nope) = (median(t_copy), median(t_ret), median(t_blend), median(t_nope));
    let gbs = |s: f64| object as f64 / s / 1e9;
    println!(
        "one 32 MiB fp16 chunk (32 layers, 256 tokens, 8x128, blocks of 16), median of {ROUNDS}:"
    );
    println!("  memcpy                          {:7.2} ms  {:5.2} GB/s", copy * 1e3, gbs(copy));
    println!(
        "  retrieve (aligned, no rotation) {:7.2} ms  {:5.2} GB/s  {:.2}x memcpy",
        ret * 1e3,
        gbs(ret),
        ret / copy
    );
    println!(
        "  blend scatter, NoPE             {:7.2} ms  {:5.2} GB/s  {:.2}x memcpy",
        nope * 1e3,
        gbs(nope),
        nope / copy
    );
    println!(
        "  blend scatter, K re-rotated     {:7.2} ms  {:5.2} GB/s  {:.2}x memcpy  {:.2}x retrieve",
        bl * 1e3,
        gbs(bl),
        bl / copy,
        bl / ret
    );
}
