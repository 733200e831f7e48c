//! The K re-rotation of one reused chunk against a plain copy of the same bytes, on one
//! thread: LMCache's default chunk object (fp16, `[2, 32 layers, 256 tokens, 8 heads x 128]`:
//! 32 MiB, K first), copied out with V as stored and K re-rotated from positions 256.. to
//! 300.. (NeoX, a full 128-element window) in runs of 16 rows, as a scatter writes blocks of
//! 16, with `rotate_rows` (the vector path where the CPU has one), against `copy_from_slice`
//! of the 32 MiB. Medians of 20 rounds. The server's whole scatter is
//! `cargo bench -p lmcache-server --bench blend_scatter`.
//! Run: `cargo bench -p lmcache-blend --bench rope`.
#![expect(clippy::expect_used, reason = "a benchmark binary: any failure should abort it")]

use std::time::Instant;

use half::f16;
use lmcache_blend::{CosSinCache, KFormat, KRow, RopeStyle, rotate_rows};

const LAYERS: usize = 32;
const TOKENS: usize = 256;
const HIDDEN: usize = 8 * 128;
const ROUNDS: usize = 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rot = 128;
    let mut table = Vec::new();
    for p in 0..4096 {
        let ang = |i: usize| p as f64 * 10_000f64.powf(-2.0 * i as f64 / rot as f64);
        table.extend((0..rot / 2).map(|i| ang(i).cos() as f32));
        table.extend((0..rot / 2).map(|i| ang(i).sin() as f32));
    }
    let cache = CosSinCache::new(rot, table).expect("cache");
    let plane = LAYERS * TOKENS * HIDDEN;
    let src: Vec<f16> = (0..2 * plane).map(|i| f16::from_f32((i % 1000) as f32 / 1000.0)).collect();
    let mut dst = vec![f16::ZERO; 2 * plane];
    let row = KRow { heads: 8, head_stride: 128, rot_offset: 0 };

    let (mut copy, mut blend) = (Vec::new(), Vec::new());
    for _ in 0..=ROUNDS {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        copy.push(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);

        let t = Instant::now();
        let deltas: Vec<_> =
            (0..TOKENS).map(|t| cache.delta(256 + t, 300 + t).expect("delta")).collect();
        let mut scratch = Vec::new();
        // V as stored; K rotated on its way into the destination, 16 rows at a time.
        dst[plane..].copy_from_slice(&src[plane..]);
        let src_k: &[u8] = bytemuck::cast_slice(&src[..plane]);
        let dst_k: &mut [u8] = bytemuck::cast_slice_mut(&mut dst[..plane]);
        let run = 16 * HIDDEN * 2;
        for (layer_src, layer_dst) in
            src_k.chunks_exact(TOKENS * HIDDEN * 2).zip(dst_k.chunks_exact_mut(TOKENS * HIDDEN * 2))
        {
            for ((s, d), ds) in layer_src
                .chunks_exact(run)
                .zip(layer_dst.chunks_exact_mut(run))
                .zip(deltas.chunks(16))
            {
                rotate_rows(KFormat::F16, s, d, HIDDEN, ds, row, RopeStyle::Neox, &mut scratch)
                    .expect("rotate");
            }
        }
        blend.push(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    let (copy, blend) = (median(copy), median(blend));
    let gbs = |s: f64| (2 * plane * 2) as f64 / s / 1e9;
    println!("one 32 MiB fp16 chunk (32 layers, 256 tokens, 8x128), median of {ROUNDS}:");
    println!("  plain copy                 {:7.2} ms  {:5.2} GB/s", copy * 1e3, gbs(copy));
    println!("  copy + K re-rotation       {:7.2} ms  {:5.2} GB/s", blend * 1e3, gbs(blend));
    println!("  ratio                      {:7.2}x", blend / copy);
}
