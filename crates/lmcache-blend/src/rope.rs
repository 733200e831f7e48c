//! Re-rotating K: a stored chunk's keys carry the rotary embedding of the positions they were
//! computed at; reused elsewhere in a prompt they must carry the new positions' instead.
//! V and every element outside the rotary window are left as they are.
//!
//! The rotation by the old position is undone and the new one applied in one step per pair of
//! elements: with `(c₀, s₀)` and `(c₁, s₁)` the cache's cos and sin at the old and new
//! positions, `C = c₀c₁ + s₀s₁` and `S = c₀s₁ − s₀c₁`, a pair `(x, y)` becomes
//! `(Cx − Sy, Sx + Cy)`: LMCache's `rotary_embedding_k_fused` (undo, then redo) in exact
//! arithmetic. Pairs are the window's two halves (NeoX) or its adjacent elements (GPT-J).
//! Arithmetic is in `f32` whatever the KV's type.

/// How a head's rotary elements pair up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Element `i` with `i + rot_dim/2` (vLLM's `is_neox_style`).
    Neox,
    /// Element `2i` with `2i + 1`.
    GptJ,
}

/// Why a rotation was refused (nothing was written).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RopeError {
    /// The cache's shape does not hold.
    #[error("cos/sin cache: {0}")]
    Cache(String),
    /// A position past the cache's last row.
    #[error("position {position} is past the cos/sin cache's {positions} rows")]
    Position {
        /// The position asked for.
        position: usize,
        /// Rows the cache has.
        positions: usize,
    },
    /// The rows, heads or window do not fit the buffer.
    #[error("K geometry: {0}")]
    Geometry(String),
}

/// A rotary cos/sin cache, vLLM's layout: one row per position of `rot_dim` values, the
/// `rot_dim/2` cosines first, then the sines.
#[derive(Debug, Clone, PartialEq)]
pub struct CosSinCache {
    rot_dim: usize,
    table: Vec<f32>,
}

/// A magnitude this far from 1 is a scale baked into the cache (YaRN, longrope), removed by
/// [`CosSinCache::normalized`]; LMCache's threshold.
pub const MSCALE_TOLERANCE: f32 = 1e-3;

impl CosSinCache {
    /// A cache of `table.len() / rot_dim` rows. `rot_dim` must be even and divide the table.
    pub fn new(rot_dim: usize, table: Vec<f32>) -> Result<Self, RopeError> {
        if rot_dim == 0 || rot_dim % 2 != 0 {
            return Err(RopeError::Cache(format!(
                "rotary dim {rot_dim} is not a positive even number"
            )));
        }
        if table.is_empty() || table.len() % rot_dim != 0 {
            return Err(RopeError::Cache(format!(
                "{} values are not whole rows of {rot_dim}",
                table.len()
            )));
        }
        if let Some(bad) = table.iter().position(|v| !v.is_finite()) {
            return Err(RopeError::Cache(format!("value {bad} is not finite")));
        }
        Ok(Self { rot_dim, table })
    }

    /// Elements rotated per head.
    pub fn rot_dim(&self) -> usize {
        self.rot_dim
    }

    /// Rows (positions).
    pub fn positions(&self) -> usize {
        self.table.len() / self.rot_dim
    }

    /// `sqrt(mean(cos² + sin²))` over every row: 1 for a pure rotation.
    pub fn mscale(&self) -> f32 {
        let half = self.rot_dim / 2;
        let mut sum = 0f64;
        for row in self.table.chunks_exact(self.rot_dim) {
            for i in 0..half {
                let (c, s) = (f64::from(row[i]), f64::from(row[half + i]));
                sum += c * c + s * s;
            }
        }
        (sum / (self.positions() * half) as f64).sqrt() as f32
    }

    /// The cache with a baked-in magnitude removed (divided by [`Self::mscale`] when it is at
    /// least [`MSCALE_TOLERANCE`] from 1, as LMCache does at registration), and that scale.
    pub fn normalized(mut self) -> (Self, Option<f32>) {
        let m = self.mscale();
        if (m - 1.0).abs() < MSCALE_TOLERANCE || m == 0.0 {
            return (self, None);
        }
        self.table.iter_mut().for_each(|v| *v /= m);
        (self, Some(m))
    }

    fn row(&self, position: usize) -> Result<(&[f32], &[f32]), RopeError> {
        let row = self
            .table
            .get(position * self.rot_dim..(position + 1) * self.rot_dim)
            .ok_or(RopeError::Position { position, positions: self.positions() })?;
        Ok(row.split_at(self.rot_dim / 2))
    }

    /// The combined rotation from `old` to `new`: `rot_dim/2` pairs `(C, S)`.
    pub fn delta(&self, old: usize, new: usize) -> Result<Delta, RopeError> {
        let (c0, s0) = self.row(old)?;
        let (c1, s1) = self.row(new)?;
        let cos = (0..c0.len()).map(|i| c0[i] * c1[i] + s0[i] * s1[i]).collect();
        let sin = (0..c0.len()).map(|i| c0[i] * s1[i] - s0[i] * c1[i]).collect();
        Ok(Delta { cos, sin })
    }
}

/// One token's rotation from its old position to its new one (see the module doc), the same
/// for every head and layer.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    /// `C` per pair.
    cos: Vec<f32>,
    /// `S` per pair.
    sin: Vec<f32>,
}

/// Where the rotary elements sit in one token's K row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KRow {
    /// Heads in the row.
    pub heads: usize,
    /// Elements from one head to the next.
    pub head_stride: usize,
    /// First rotated element of each head (0, or the rope part of an MLA latent).
    pub rot_offset: usize,
}

impl Delta {
    /// `C` per pair.
    pub(crate) fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// `S` per pair.
    pub(crate) fn sin(&self) -> &[f32] {
        &self.sin
    }

    /// Elements rotated per head.
    pub fn rot_dim(&self) -> usize {
        self.cos.len() * 2
    }

    /// Rotates the window of every head of one token's `f32` K row in place ([`rotate_rows`]
    /// does runs of rows of any format). The whole geometry is checked before anything is
    /// written.
    pub fn apply(&self, k: &mut [f32], row: KRow, style: RopeStyle) -> Result<(), RopeError> {
        let need = self.check(k.len(), row)?;
        self.rotate_row(&mut k[..need], row, style);
        Ok(())
    }

    /// The elements `heads` heads need, after checking the window fits a head and the heads
    /// fit `len`.
    fn check(&self, len: usize, row: KRow) -> Result<usize, RopeError> {
        let rot = self.rot_dim();
        if row.rot_offset + rot > row.head_stride {
            return Err(RopeError::Geometry(format!(
                "a window of {rot} at {} does not fit a head of {}",
                row.rot_offset, row.head_stride
            )));
        }
        let need = row.heads * row.head_stride;
        if need > len {
            return Err(RopeError::Geometry(format!(
                "{} heads of {} need {need} elements, the row has {len}",
                row.heads, row.head_stride
            )));
        }
        Ok(need)
    }

    /// Every head's window of a row in `f32`, rotated in place in plain loops the compiler
    /// vectorises. (The row's other elements make a lossless round trip through `f32`.)
    fn rotate_row(&self, buf: &mut [f32], row: KRow, style: RopeStyle) {
        let (half, rot) = (self.cos.len(), self.rot_dim());
        for head in buf.chunks_exact_mut(row.head_stride) {
            let w = &mut head[row.rot_offset..row.rot_offset + rot];
            match style {
                RopeStyle::Neox => {
                    let (xs, ys) = w.split_at_mut(half);
                    for (((x, y), &c), &s) in
                        xs.iter_mut().zip(ys.iter_mut()).zip(&self.cos).zip(&self.sin)
                    {
                        let (a, b) = (*x, *y);
                        *x = c * a - s * b;
                        *y = s * a + c * b;
                    }
                }
                RopeStyle::GptJ => {
                    for ((xy, &c), &s) in w.chunks_exact_mut(2).zip(&self.cos).zip(&self.sin) {
                        let (a, b) = (xy[0], xy[1]);
                        xy[0] = c * a - s * b;
                        xy[1] = s * a + c * b;
                    }
                }
            }
        }
    }
}

/// Rotating copies of consecutive K rows, as a scatter writes a run of tokens: `src` and
/// `dst` hold `deltas.len()` rows of `hidden` elements stored as `format`; row `t` is copied
/// with every head's window rotated by `deltas[t]` (every other element as it was). Half
/// precision rows go through the CPU's vector instructions where it has them (the same
/// bits as the portable path); the rest widen a run into `scratch`, rotate and narrow it.
/// Everything is checked before anything is written.
#[expect(clippy::too_many_arguments, reason = "a run's buffers, geometry and rotation")]
pub fn rotate_rows(
    format: crate::KFormat,
    src: &[u8],
    dst: &mut [u8],
    hidden: usize,
    deltas: &[Delta],
    row: KRow,
    style: RopeStyle,
    scratch: &mut Vec<f32>,
) -> Result<(), RopeError> {
    let bytes = deltas.len() * hidden * format.itemsize();
    if src.len() != bytes || dst.len() != bytes {
        return Err(RopeError::Geometry(format!(
            "{} rows of {hidden} need {bytes} bytes, got {} and {}",
            deltas.len(),
            src.len(),
            dst.len()
        )));
    }
    let rot = deltas.first().map_or(0, Delta::rot_dim);
    for d in deltas {
        if d.rot_dim() != rot {
            return Err(RopeError::Geometry("rows rotated over different windows".into()));
        }
        d.check(hidden, row)?;
    }
    if format == crate::KFormat::F16
        && let (Ok(s), Ok(d)) = (
            bytemuck::try_cast_slice::<u8, half::f16>(src),
            bytemuck::try_cast_slice_mut::<u8, half::f16>(dst),
        )
        && crate::simd::rotate_f16_rows(s, d, hidden, deltas, row, style)
    {
        return Ok(());
    }
    portable_rows(format, src, dst, hidden, deltas, row, style, scratch);
    Ok(())
}

/// [`rotate_rows`] through `f32` in `scratch`, on any CPU (geometry checked by the caller).
#[expect(clippy::too_many_arguments, reason = "rotate_rows's arguments, passed on")]
fn portable_rows(
    format: crate::KFormat,
    src: &[u8],
    dst: &mut [u8],
    hidden: usize,
    deltas: &[Delta],
    row: KRow,
    style: RopeStyle,
    scratch: &mut Vec<f32>,
) {
    scratch.resize(deltas.len() * hidden, 0.0);
    format.widen(src, scratch);
    for (k, d) in scratch.chunks_exact_mut(hidden).zip(deltas) {
        d.rotate_row(&mut k[..row.heads * row.head_stride], row, style);
    }
    format.narrow(scratch, dst);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vLLM-style cache: inv_freq = base^(-2i/rot_dim), angle = pos * inv_freq.
    fn cache(rot_dim: usize, positions: usize, scale: f32) -> CosSinCache {
        let half = rot_dim / 2;
        let mut t = Vec::with_capacity(rot_dim * positions);
        for p in 0..positions {
            let ang = |i: usize| p as f64 * 10_000f64.powf(-2.0 * i as f64 / rot_dim as f64);
            t.extend((0..half).map(|i| (ang(i).cos() as f32) * scale));
            t.extend((0..half).map(|i| (ang(i).sin() as f32) * scale));
        }
        CosSinCache::new(rot_dim, t).unwrap()
    }

    /// RoPE applied from scratch (the forward rotation, nothing shared with `Delta`).
    fn rope(raw: &[f32], c: &CosSinCache, pos: usize, row: KRow, style: RopeStyle) -> Vec<f32> {
        let (cos, sin) = c.row(pos).unwrap();
        let half = cos.len();
        let mut out = raw.to_vec();
        for h in 0..row.heads {
            let base = h * row.head_stride + row.rot_offset;
            for i in 0..half {
                let (xi, yi) = match style {
                    RopeStyle::Neox => (base + i, base + half + i),
                    RopeStyle::GptJ => (base + 2 * i, base + 2 * i + 1),
                };
                let (x, y) = (f64::from(raw[xi]), f64::from(raw[yi]));
                let (c, s) = (f64::from(cos[i]), f64::from(sin[i]));
                out[xi] = (x * c - y * s) as f32;
                out[yi] = (x * s + y * c) as f32;
            }
        }
        out
    }

    fn raw(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect()
    }

    #[test]
    fn rerotated_k_is_rope_at_the_new_position_and_the_rest_untouched() {
        let c = cache(64, 2048, 1.0);
        for style in [RopeStyle::Neox, RopeStyle::GptJ] {
            // Partial rotary: 64 of 128 elements per head, and an MLA-like window at 32.
            for row in [
                KRow { heads: 4, head_stride: 64, rot_offset: 0 },
                KRow { heads: 2, head_stride: 128, rot_offset: 0 },
                KRow { heads: 1, head_stride: 96, rot_offset: 32 },
            ] {
                let raw = raw(row.heads * row.head_stride + 5);
                let mut k = rope(&raw, &c, 256, row, style);
                let tail = k[row.heads * row.head_stride..].to_vec();
                c.delta(256, 1500).unwrap().apply(&mut k, row, style).unwrap();
                let want = rope(&raw, &c, 1500, row, style);
                let err = k.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(err < 1e-5, "{style:?} {row:?}: max error {err}");
                assert_eq!(&k[row.heads * row.head_stride..], &tail[..], "past the heads");
                for h in 0..row.heads {
                    let head = h * row.head_stride;
                    let outside = (0..row.head_stride)
                        .filter(|&e| e < row.rot_offset || e >= row.rot_offset + 64);
                    for e in outside {
                        assert_eq!(k[head + e], raw[head + e], "element {e} outside the window");
                    }
                }
            }
        }
    }

    #[test]
    fn a_run_of_f32_rows_is_each_row_rotated_in_place_and_the_rest_copied() {
        let c = cache(32, 700, 1.0);
        let row = KRow { heads: 3, head_stride: 48, rot_offset: 8 };
        let hidden = 3 * 48 + 4;
        let deltas: Vec<Delta> = (0..5).map(|t| c.delta(7 + t, 650 - t).unwrap()).collect();
        let src = raw(5 * hidden);
        for style in [RopeStyle::Neox, RopeStyle::GptJ] {
            let mut want = src.clone();
            for (k, d) in want.chunks_exact_mut(hidden).zip(&deltas) {
                d.apply(k, row, style).unwrap();
            }
            let mut got = vec![0f32; src.len()];
            let src_b: &[u8] = bytemuck::cast_slice(&src);
            let got_b: &mut [u8] = bytemuck::cast_slice_mut(&mut got);
            rotate_rows(
                crate::KFormat::F32,
                src_b,
                got_b,
                hidden,
                &deltas,
                row,
                style,
                &mut Vec::new(),
            )
            .unwrap();
            assert_eq!(got, want, "{style:?}");
            // Past the heads, each row as it was.
            for t in 0..5 {
                assert_eq!(
                    got[t * hidden + 144..(t + 1) * hidden],
                    src[t * hidden + 144..(t + 1) * hidden]
                );
            }
        }
    }

    #[test]
    fn the_vector_path_gives_the_portable_paths_bits() {
        #[cfg(target_arch = "x86_64")]
        assert!(
            !std::is_x86_feature_detected!("avx2") || !std::is_x86_feature_detected!("f16c") || {
                let mut d = vec![half::f16::ZERO; 8];
                let c = cache(8, 4, 1.0);
                let ds = [c.delta(1, 2).unwrap()];
                let row = KRow { heads: 1, head_stride: 8, rot_offset: 0 };
                crate::simd::rotate_f16_rows(
                    &[half::f16::ONE; 8],
                    &mut d,
                    8,
                    &ds,
                    row,
                    RopeStyle::Neox,
                )
            },
            "this CPU has AVX2 and F16C but the vector path was not taken"
        );
        // Full heads, partial windows, an offset window, windows whose halves are not a
        // multiple of 8 (the scalar tails), one head or many.
        let shapes = [
            (128, KRow { heads: 8, head_stride: 128, rot_offset: 0 }),
            (64, KRow { heads: 4, head_stride: 128, rot_offset: 0 }),
            (64, KRow { heads: 1, head_stride: 576, rot_offset: 512 }),
            (20, KRow { heads: 3, head_stride: 24, rot_offset: 2 }),
            (12, KRow { heads: 2, head_stride: 16, rot_offset: 4 }),
        ];
        for (rot, row) in shapes {
            let c = cache(rot, 700, 1.0);
            let hidden = row.heads * row.head_stride + 3;
            let rows = 17;
            let deltas: Vec<Delta> =
                (0..rows).map(|t| c.delta(10 + t, 300 + 7 * t).unwrap()).collect();
            let src: Vec<half::f16> =
                raw(rows * hidden).iter().map(|&v| half::f16::from_f32(v * 3.0)).collect();
            let src_b: &[u8] = bytemuck::cast_slice(&src);
            for style in [RopeStyle::Neox, RopeStyle::GptJ] {
                let mut fast = vec![half::f16::ZERO; src.len()];
                let mut slow = vec![0u8; src_b.len()];
                let mut scratch = Vec::new();
                rotate_rows(
                    crate::KFormat::F16,
                    src_b,
                    bytemuck::cast_slice_mut(&mut fast),
                    hidden,
                    &deltas,
                    row,
                    style,
                    &mut scratch,
                )
                .unwrap();
                portable_rows(
                    crate::KFormat::F16,
                    src_b,
                    &mut slow,
                    hidden,
                    &deltas,
                    row,
                    style,
                    &mut scratch,
                );
                assert_eq!(
                    bytemuck::cast_slice::<half::f16, u8>(&fast),
                    &slow[..],
                    "{style:?} rot {rot} {row:?}"
                );
                // And it did rotate: not a copy.
                assert_ne!(fast, src, "{style:?} rot {rot}");
            }
        }
        // Bad lengths and windows are refused before anything is written.
        let c = cache(16, 64, 1.0);
        let d = [c.delta(0, 1).unwrap()];
        let mut out = vec![0u8; 32];
        let mut scratch = Vec::new();
        let row = KRow { heads: 1, head_stride: 16, rot_offset: 0 };
        assert!(
            rotate_rows(
                crate::KFormat::F16,
                &[1u8; 30],
                &mut out,
                16,
                &d,
                row,
                RopeStyle::Neox,
                &mut scratch
            )
            .is_err()
        );
        let wide = KRow { heads: 1, head_stride: 16, rot_offset: 4 };
        assert!(
            rotate_rows(
                crate::KFormat::F16,
                &[1u8; 32],
                &mut out,
                16,
                &d,
                wide,
                RopeStyle::Neox,
                &mut scratch
            )
            .is_err()
        );
        assert!(out.iter().all(|&b| b == 0));
    }

    #[test]
    fn half_precision_k_rotates_within_its_rounding() {
        let c = cache(128, 600, 1.0);
        let row = KRow { heads: 8, head_stride: 128, rot_offset: 0 };
        let raw = raw(8 * 128);
        let at_old = rope(&raw, &c, 10, row, RopeStyle::Neox);
        let want = rope(&raw, &c, 555, row, RopeStyle::Neox);
        let d = [c.delta(10, 555).unwrap()];
        for (f, tol) in [(crate::KFormat::F16, 4e-3), (crate::KFormat::Bf16, 3e-2)] {
            let mut src = vec![0u8; 1024 * 2];
            f.narrow(&at_old, &mut src);
            let mut dst = vec![0u8; src.len()];
            rotate_rows(f, &src, &mut dst, 1024, &d, row, RopeStyle::Neox, &mut Vec::new())
                .unwrap();
            let mut got = vec![0f32; 1024];
            f.widen(&dst, &mut got);
            for i in 0..want.len() {
                assert!(
                    (got[i] - want[i]).abs() < tol,
                    "{f:?} element {i}: {} vs {}",
                    got[i],
                    want[i]
                );
            }
        }
    }

    #[test]
    fn a_baked_in_scale_is_removed_and_a_unit_cache_kept() {
        let (unit, m) = cache(32, 100, 1.0).normalized();
        assert_eq!(m, None);
        assert_eq!(unit, cache(32, 100, 1.0));
        let (scaled, m) = cache(32, 100, 1.2).normalized();
        let m = m.expect("a YaRN-like scale is found");
        assert!((m - 1.2).abs() < 1e-4, "{m}");
        assert!((scaled.mscale() - 1.0).abs() < 1e-4);
        // Under the tolerance: left alone, as LMCache does.
        assert_eq!(cache(32, 100, 1.0005).normalized().1, None);
    }

    #[test]
    fn bad_geometry_and_positions_are_refused_before_any_write() {
        let c = cache(16, 8, 1.0);
        assert!(matches!(c.delta(8, 0), Err(RopeError::Position { position: 8, positions: 8 })));
        let d = c.delta(1, 2).unwrap();
        let mut k = vec![1f32; 31];
        let before = k.clone();
        let e = d.apply(&mut k, KRow { heads: 2, head_stride: 16, rot_offset: 0 }, RopeStyle::Neox);
        assert!(matches!(e, Err(RopeError::Geometry(_))), "{e:?}");
        let e = d.apply(&mut k, KRow { heads: 1, head_stride: 20, rot_offset: 8 }, RopeStyle::GptJ);
        assert!(matches!(e, Err(RopeError::Geometry(_))), "{e:?}");
        assert_eq!(k, before);
        assert!(CosSinCache::new(3, vec![0.0; 6]).is_err());
        assert!(CosSinCache::new(4, vec![0.0; 6]).is_err());
        assert!(CosSinCache::new(2, vec![f32::NAN, 0.0]).is_err());
    }
}
