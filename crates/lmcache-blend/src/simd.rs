//! The re-rotation of half-precision K rows with the CPU's half-float and AVX2 instructions,
//! chosen at run time: each head's window is loaded 8 elements at a time, widened, rotated
//! and narrowed back in registers, the rest of the row copied. The arithmetic is the portable
//! path's, operation for operation (products rounded, then the sum; no fused multiply-add;
//! round-to-nearest-even conversions), so both give the same bits; the tests hold them to it.
//!
//! The kernel itself is safe code (the intrinsics are safe inside a function compiled for
//! their features, and loads and stores go through `bytemuck` casts of arrays); the one
//! `unsafe` is the call into it, made only after the CPU was seen to have the features.

use half::f16;

use crate::rope::{Delta, KRow, RopeStyle};

/// Rotates `deltas.len()` rows of `hidden` f16 elements from `src` into `dst` (same lengths,
/// checked by the caller, as is every window against `hidden`) with the CPU's vector
/// instructions; `false` (nothing written) when this CPU has no such path.
pub(crate) fn rotate_f16_rows(
    src: &[f16],
    dst: &mut [f16],
    hidden: usize,
    deltas: &[Delta],
    row: KRow,
    style: RopeStyle,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c") {
        // SAFETY: the only requirement of calling a function compiled with
        // `#[target_feature(enable = "avx2,f16c")]` is that the CPU has both, checked just
        // above; the function takes slices and does no unchecked memory access.
        unsafe { x86::rotate_rows(src, dst, hidden, deltas, row, style) };
        return true;
    }
    let _ = (src, dst, hidden, deltas, row, style);
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256, _mm256_add_ps, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_mul_ps,
        _mm256_permute_ps, _mm256_sub_ps,
    };

    use half::f16;

    use crate::rope::{Delta, KRow, RopeStyle};

    // The helpers take the 8-element chunks of `chunks_exact(8)`: their length is known, so
    // the conversions to arrays compile to plain vector loads and stores.

    /// Eight halves, widened.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn load8(s: &[u16]) -> __m256 {
        let a = s.first_chunk::<8>().copied().unwrap_or_default();
        _mm256_cvtph_ps(bytemuck::cast::<[u16; 8], __m128i>(a))
    }

    /// `v` narrowed (round to nearest even: imm 0, as `half`'s conversions).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn store8(d: &mut [u16], v: __m256) {
        if let Some(o) = d.first_chunk_mut::<8>() {
            *o = bytemuck::cast(_mm256_cvtps_ph::<0>(v));
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn f32x8(s: &[f32]) -> __m256 {
        bytemuck::cast(s.first_chunk::<8>().copied().unwrap_or_default())
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) fn rotate_rows(
        src: &[f16],
        dst: &mut [f16],
        hidden: usize,
        deltas: &[Delta],
        row: KRow,
        style: RopeStyle,
    ) {
        let src: &[u16] = bytemuck::cast_slice(src);
        let dst: &mut [u16] = bytemuck::cast_slice_mut(dst);
        let h2f = |b: u16| f16::from_bits(b).to_f32();
        let f2h = |v: f32| f16::from_f32(v).to_bits();
        let half = deltas.first().map_or(0, |d| d.cos().len());
        let rot = 2 * half;
        let heads_end = row.heads * row.head_stride;
        // GPT-J's pairs interleaved: cos and signed sin per element.
        let mut cc = vec![0f32; rot];
        let mut ss = vec![0f32; rot];
        for ((s_row, d_row), delta) in
            src.chunks_exact(hidden).zip(dst.chunks_exact_mut(hidden)).zip(deltas)
        {
            // What no window covers is copied: each head's elements around its window, and
            // the row past the heads.
            for h in 0..row.heads {
                let (head, w) = (h * row.head_stride, h * row.head_stride + row.rot_offset);
                d_row[head..w].copy_from_slice(&s_row[head..w]);
                d_row[w + rot..head + row.head_stride]
                    .copy_from_slice(&s_row[w + rot..head + row.head_stride]);
            }
            d_row[heads_end..].copy_from_slice(&s_row[heads_end..]);
            let (cos, sin) = (delta.cos(), delta.sin());
            if style == RopeStyle::GptJ {
                for i in 0..half {
                    cc[2 * i] = cos[i];
                    cc[2 * i + 1] = cos[i];
                    ss[2 * i] = -sin[i];
                    ss[2 * i + 1] = sin[i];
                }
            }
            for h in 0..row.heads {
                let base = h * row.head_stride + row.rot_offset;
                let s = &s_row[base..base + rot];
                let d = &mut d_row[base..base + rot];
                match style {
                    RopeStyle::Neox => {
                        let (sx, sy) = s.split_at(half);
                        let (dx, dy) = d.split_at_mut(half);
                        let vectors = half / 8;
                        for ((((x, y), (c, sn)), ox), oy) in sx
                            .chunks_exact(8)
                            .zip(sy.chunks_exact(8))
                            .zip(cos.chunks_exact(8).zip(sin.chunks_exact(8)))
                            .zip(dx.chunks_exact_mut(8))
                            .zip(dy.chunks_exact_mut(8))
                        {
                            let (x, y) = (load8(x), load8(y));
                            let (c, sn) = (f32x8(c), f32x8(sn));
                            // x' = c x - s y; y' = s x + c y (products rounded, then summed).
                            store8(ox, _mm256_sub_ps(_mm256_mul_ps(c, x), _mm256_mul_ps(sn, y)));
                            store8(oy, _mm256_add_ps(_mm256_mul_ps(sn, x), _mm256_mul_ps(c, y)));
                        }
                        for j in vectors * 8..half {
                            let (a, b) = (h2f(s[j]), h2f(s[half + j]));
                            d[j] = f2h(cos[j] * a - sin[j] * b);
                            d[half + j] = f2h(sin[j] * a + cos[j] * b);
                        }
                    }
                    RopeStyle::GptJ => {
                        let vectors = rot / 8;
                        for (((v, c), sn), o) in s
                            .chunks_exact(8)
                            .zip(cc.chunks_exact(8))
                            .zip(ss.chunks_exact(8))
                            .zip(d.chunks_exact_mut(8))
                        {
                            let v = load8(v);
                            // [y0, x0, y1, x1, ...]: each element's partner.
                            let sw = _mm256_permute_ps::<0xB1>(v);
                            let out = _mm256_add_ps(
                                _mm256_mul_ps(f32x8(c), v),
                                _mm256_mul_ps(f32x8(sn), sw),
                            );
                            store8(o, out);
                        }
                        for p in vectors * 4..half {
                            let (a, b) = (h2f(s[2 * p]), h2f(s[2 * p + 1]));
                            d[2 * p] = f2h(cos[p] * a - sin[p] * b);
                            d[2 * p + 1] = f2h(sin[p] * a + cos[p] * b);
                        }
                    }
                }
            }
        }
    }
}
