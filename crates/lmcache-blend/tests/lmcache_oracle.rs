//! The K re-rotation against LMCache 0.5.6's own CPU re-rotation,
//! `lmcache.v1.platform.torch_ops.pos_kernels.rotary_embedding_k_fused`, run by the Python of
//! LMCache's virtualenv (`LMCACHE_RS_TEST_NIXL_PYTHON`, set by scripts/test; required there
//! through `LMCACHE_RS_REQUIRE_SERVICES=1`). Both rotate the same K of 256 tokens from
//! positions 256.. to 300.. (4 heads of 128, a rotary window of 64: partial rotary), NeoX and
//! GPT-J, in f32; the answers must agree to float rounding.

use std::io::Write;
use std::process::Command;

use lmcache_blend::{CosSinCache, KRow, RopeStyle};

const TOKENS: usize = 256;
const HEADS: usize = 4;
const HEAD: usize = 128;
const ROT: usize = 64;
const POSITIONS: usize = 1024;

fn python() -> Option<String> {
    match std::env::var("LMCACHE_RS_TEST_NIXL_PYTHON") {
        Ok(p) => Some(p),
        Err(_) if std::env::var("LMCACHE_RS_REQUIRE_SERVICES").is_ok_and(|v| v == "1") => {
            panic!("LMCACHE_RS_TEST_NIXL_PYTHON is not set, but LMCACHE_RS_REQUIRE_SERVICES=1")
        }
        Err(_) => {
            eprintln!("LMCACHE_RS_TEST_NIXL_PYTHON not set: LMCache's oracle not run");
            None
        }
    }
}

const ORACLE: &str = r#"
import sys, torch
from lmcache.v1.platform.torch_ops.pos_kernels import rotary_embedding_k_fused
d, T, H, HS, R, P, neox = sys.argv[1], *map(int, sys.argv[2:8])
cache = torch.frombuffer(bytearray(open(f"{d}/cache", "rb").read()), dtype=torch.float32).reshape(P, R)
key = torch.frombuffer(bytearray(open(f"{d}/key", "rb").read()), dtype=torch.float32).reshape(T, H, HS).clone()
old = torch.arange(256, 256 + T)
new = torch.arange(300, 300 + T)
rotary_embedding_k_fused(old, new, key, HS, cache, bool(neox))
open(f"{d}/out", "wb").write(key.contiguous().numpy().tobytes())
"#;

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn k_rerotation_equals_lmcaches_own() {
    let Some(python) = python() else { return };
    let mut table = Vec::with_capacity(POSITIONS * ROT);
    for p in 0..POSITIONS {
        let ang = |i: usize| p as f64 * 10_000f64.powf(-2.0 * i as f64 / ROT as f64);
        table.extend((0..ROT / 2).map(|i| ang(i).cos() as f32));
        table.extend((0..ROT / 2).map(|i| ang(i).sin() as f32));
    }
    let cache = CosSinCache::new(ROT, table.clone()).unwrap();
    let key: Vec<f32> =
        (0..TOKENS * HEADS * HEAD).map(|i| ((i * 7919 % 2003) as f32 / 1001.5) - 1.0).collect();
    let dir = std::env::temp_dir().join(format!("lmcache_rs_rope_oracle_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::File::create(dir.join("cache")).unwrap().write_all(&bytes(&table)).unwrap();
    std::fs::File::create(dir.join("key")).unwrap().write_all(&bytes(&key)).unwrap();
    let row = KRow { heads: HEADS, head_stride: HEAD, rot_offset: 0 };
    for (style, neox) in [(RopeStyle::Neox, 1), (RopeStyle::GptJ, 0)] {
        let out = Command::new(&python)
            .arg("-c")
            .arg(ORACLE)
            .arg(&dir)
            .args([TOKENS, HEADS, HEAD, ROT, POSITIONS, neox].map(|v| v.to_string()))
            .env("LMCACHE_TRACK_USAGE", "false")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "the oracle failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let theirs: Vec<f32> = std::fs::read(dir.join("out"))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let mut ours = key.clone();
        for (t, k) in ours.chunks_exact_mut(HEADS * HEAD).enumerate() {
            cache.delta(256 + t, 300 + t).unwrap().apply(k, row, style).unwrap();
        }
        assert_eq!(theirs.len(), ours.len());
        let err = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 2e-6, "{style:?}: max difference from LMCache's {err}");
        // Past the window, both left K as it was.
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            if i % HEAD >= ROT {
                assert_eq!((*a, *b), (key[i], key[i]), "element {i} outside the window");
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
