//! The fp8 L2 codec through the server: its element type comes from the registered layout
//! (a worker of another type is refused), float16 and bfloat16 models round-trip through L2
//! within e4m3's precision, NaN stays NaN, and an object holding an infinity is not stored
//! in L2 at all (rather than coming back finite).

use std::time::Duration;

use half::{bf16, f16};
use lmcache_client::{CacheKey, Client};
use lmcache_core::{Dtype, ModelName};
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_server::{Server, ServerConfig};
use serde_json::{Value, json};

mod common;

const CHUNK: usize = 16;
/// `[2, 2 layers, 16 slots, 32]`: 2048 elements per object.
const ELEMS: usize = 2 * 2 * 16 * 32;

fn server(tag: &str, serde: Value) -> Server {
    Server::start(ServerConfig {
        chunk_size: CHUNK,
        http_port: Some(0),
        l2_adapters: vec![json!({"type": "mock", "max_size_gb": 1, "serde": serde})],
        ..ServerConfig::local(ArenaConfig {
            size: 16 << 20,
            backing: ArenaBacking::SharedMemory {
                name: format!("lmcache_rs_codecs_{tag}_{}", std::process::id()),
            },
            mlock: false,
        })
    })
    .unwrap()
}

fn register(c: &mut Client, id: u64, model: &str, dtype: Dtype) -> Option<ForeignSegment> {
    let reg = common::small_registration(id, model, dtype);
    let pool = c.register_engine_driven(&reg).unwrap();
    (pool.pool_size > 0).then(|| ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap())
}

fn refusal(s: &Server, id: u64) -> Option<String> {
    let (_, body) = common::http_raw(s, "GET", "/status", None, Duration::from_secs(5));
    let v: Value = serde_json::from_str(&body).unwrap();
    v["refused_instances"]
        .as_array()?
        .iter()
        .find(|r| r["instance_id"] == id)
        .map(|r| r["reason"].as_str().unwrap_or("").to_owned())
}

fn values(seed: f32) -> Vec<f32> {
    (0..ELEMS).map(|i| ((i as f32 + seed) * 0.37).sin() * 3.0).collect()
}

fn encode(dtype: Dtype, v: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::Float16 => v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
        _ => v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
    }
}

fn decode(dtype: Dtype, b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|p| match dtype {
            Dtype::Float16 => f16::from_le_bytes([p[0], p[1]]).to_f32(),
            _ => bf16::from_le_bytes([p[0], p[1]]).to_f32(),
        })
        .collect()
}

/// Stores one chunk of `vals` under `model`, then (with L1 cleared, so it must come from L2)
/// reads it back; `None` when the lookup misses.
fn through_l2(
    s: &Server,
    c: &mut Client,
    pool: &ForeignSegment,
    (id, model, dtype): (u64, &str, Dtype),
    tokens: Vec<u32>,
    vals: &[f32],
) -> Option<Vec<f32>> {
    let m = ModelName::new(model).unwrap();
    let k = CacheKey::whole(m.clone(), "w", tokens.clone(), CHUNK).for_worker(0);
    let slots = c.prepare_store(&k, id).unwrap();
    assert_eq!(slots.len(), 1);
    pool.write(slots[0].1.offset, &encode(dtype, vals)).unwrap();
    assert!(c.commit_store(&k, id).unwrap());
    c.end_session("w").unwrap();
    assert_eq!(s.state().storage.flush(Duration::from_secs(10)), 0);
    s.state().l1().clear(true);
    let r = CacheKey::whole(m, "r", tokens, CHUNK);
    let hits = c.lookup(&r).unwrap();
    let out = if hits == 1 {
        let slots = c.prepare_retrieve(&r.for_worker(0), id).unwrap().unwrap();
        let mut buf = vec![0u8; slots[0].length as usize];
        pool.read(slots[0].offset, &mut buf).unwrap();
        Some(decode(dtype, &buf))
    } else {
        None
    };
    c.commit_retrieve(&r.for_worker(0), id).unwrap();
    c.end_session("r").unwrap();
    out
}

fn assert_close(dtype: Dtype, want: &[f32], got: &[f32]) {
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{dtype:?} [{i}]: NaN came back as {g}");
        } else {
            // e4m3: 3 mantissa bits (relative step 1/16), scaled per block of 128 by amax 3.
            assert!(
                (w - g).abs() <= w.abs() / 14.0 + 3.0 / 448.0 / 64.0,
                "{dtype:?} [{i}]: {w} -> {g}"
            );
        }
    }
}

#[test]
fn fp8_takes_the_layouts_dtype_and_round_trips_fp16_and_bf16_models() {
    for (first, other) in [(Dtype::Float16, Dtype::BFloat16), (Dtype::BFloat16, Dtype::Float16)] {
        let s = server(&format!("{first}"), json!({"type": "fp8"}));
        let mut c = Client::connect(s.endpoint(), Duration::from_secs(5)).unwrap();
        let pool = register(&mut c, 1, "m", first).expect("first registration");
        // The codec now quantizes `first`: a worker of the other type is refused loudly.
        assert!(register(&mut c, 2, "m2", other).is_none());
        let why = refusal(&s, 2).expect("refused");
        assert!(why.contains("fp8") && why.contains(&format!("{first}")), "{why}");

        let mut vals = values(1.0);
        vals[5] = f32::NAN;
        let tokens: Vec<u32> = (0..CHUNK as u32).collect();
        let back = through_l2(&s, &mut c, &pool, (1, "m", first), tokens, &vals).expect("miss");
        assert_close(first, &vals, &back);

        // An infinity: the L2 refuses the object, so it misses instead of coming back finite.
        let mut vals = values(2.0);
        vals[9] = f32::INFINITY;
        let tokens: Vec<u32> = (100..100 + CHUNK as u32).collect();
        assert_eq!(through_l2(&s, &mut c, &pool, (1, "m", first), tokens, &vals), None);
    }
    // A codec configured for bfloat16 refuses a float16 worker from the start.
    let s = server("pre", json!({"type": "fp8", "dtype": "bfloat16"}));
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(5)).unwrap();
    assert!(register(&mut c, 3, "m", Dtype::Float16).is_none());
    assert!(refusal(&s, 3).unwrap().contains("bfloat16"));
    assert!(register(&mut c, 4, "m", Dtype::BFloat16).is_some());
}
