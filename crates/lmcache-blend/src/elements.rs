//! The element formats a re-rotated K row can be stored in, read into `f32` and written back
//! from it: `f32`, `f16`, `bf16` and the two fp8 flavours vLLM keeps quantized KV in
//! (`fp8_e4m3`, the finite-only e4m3fn, and `fp8_e5m2`).
//!
//! fp8 rows are dequantized, rotated and requantized without their scale: a rotation is
//! linear, so it commutes with the per-tensor scale (LMCache's kernel does the same).
//! Requantization rounds to nearest even and saturates at the largest finite value, as CUDA's
//! `__nv_fp8` conversions with `__NV_SATFINITE` do (the `float8` crate's conversion).

use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};

/// How one K element is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KFormat {
    /// IEEE single.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// fp8 e4m3 (finite only: vLLM's `fp8_e4m3`).
    Fp8E4m3,
    /// fp8 e5m2.
    Fp8E5m2,
}

/// Every fp8 byte's value, per flavour (decoding by table: exact, and the hot loop's cost).
struct Fp8Tables {
    e4m3: [f32; 256],
    e5m2: [f32; 256],
}

fn tables() -> &'static Fp8Tables {
    static T: std::sync::OnceLock<Fp8Tables> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut t = Fp8Tables { e4m3: [0.0; 256], e5m2: [0.0; 256] };
        for b in 0..=255u8 {
            t.e4m3[b as usize] = F8E4M3::from_bits(b).to_f32();
            t.e5m2[b as usize] = F8E5M2::from_bits(b).to_f32();
        }
        t
    })
}

impl KFormat {
    /// Bytes per element.
    pub fn itemsize(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Fp8E4m3 | Self::Fp8E5m2 => 1,
        }
    }

    /// `bytes` (little-endian elements) into `out`, one `f32` per element. Panics never:
    /// `out` gets `min(out.len(), bytes.len() / itemsize)` elements; returns how many.
    pub fn widen(self, bytes: &[u8], out: &mut [f32]) -> usize {
        let n = out.len().min(bytes.len() / self.itemsize());
        let (bytes, out) = (&bytes[..n * self.itemsize()], &mut out[..n]);
        match self {
            Self::F32 => match bytemuck::try_cast_slice::<u8, f32>(bytes) {
                Ok(v) => out.copy_from_slice(v),
                Err(_) => out
                    .iter_mut()
                    .zip(bytes.chunks_exact(4))
                    .for_each(|(o, b)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            },
            Self::F16 => match bytemuck::try_cast_slice::<u8, f16>(bytes) {
                Ok(v) => half::slice::HalfFloatSliceExt::convert_to_f32_slice(v, out),
                Err(_) => out
                    .iter_mut()
                    .zip(bytes.chunks_exact(2))
                    .for_each(|(o, b)| *o = f16::from_le_bytes([b[0], b[1]]).to_f32()),
            },
            Self::Bf16 => match bytemuck::try_cast_slice::<u8, bf16>(bytes) {
                Ok(v) => half::slice::HalfFloatSliceExt::convert_to_f32_slice(v, out),
                Err(_) => out
                    .iter_mut()
                    .zip(bytes.chunks_exact(2))
                    .for_each(|(o, b)| *o = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            },
            Self::Fp8E4m3 => {
                let t = &tables().e4m3;
                out.iter_mut().zip(bytes).for_each(|(o, &b)| *o = t[b as usize]);
            }
            Self::Fp8E5m2 => {
                let t = &tables().e5m2;
                out.iter_mut().zip(bytes).for_each(|(o, &b)| *o = t[b as usize]);
            }
        }
        n
    }

    /// `values` into `out` as little-endian elements (rounded to nearest even; fp8
    /// saturating). Writes `min(values.len(), out.len() / itemsize)` elements; returns how
    /// many.
    pub fn narrow(self, values: &[f32], out: &mut [u8]) -> usize {
        let n = values.len().min(out.len() / self.itemsize());
        let (values, out) = (&values[..n], &mut out[..n * self.itemsize()]);
        match self {
            Self::F32 => match bytemuck::try_cast_slice_mut::<u8, f32>(out) {
                Ok(o) => o.copy_from_slice(values),
                Err(_) => out
                    .chunks_exact_mut(4)
                    .zip(values)
                    .for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes())),
            },
            Self::F16 => match bytemuck::try_cast_slice_mut::<u8, f16>(out) {
                Ok(o) => half::slice::HalfFloatSliceExt::convert_from_f32_slice(o, values),
                Err(_) => out
                    .chunks_exact_mut(2)
                    .zip(values)
                    .for_each(|(o, v)| o.copy_from_slice(&f16::from_f32(*v).to_le_bytes())),
            },
            Self::Bf16 => match bytemuck::try_cast_slice_mut::<u8, bf16>(out) {
                Ok(o) => half::slice::HalfFloatSliceExt::convert_from_f32_slice(o, values),
                Err(_) => out
                    .chunks_exact_mut(2)
                    .zip(values)
                    .for_each(|(o, v)| o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes())),
            },
            Self::Fp8E4m3 => {
                out.iter_mut().zip(values).for_each(|(o, &v)| *o = F8E4M3::from_f32(v).to_bits());
            }
            Self::Fp8E5m2 => {
                out.iter_mut().zip(values).for_each(|(o, &v)| *o = F8E5M2::from_f32(v).to_bits());
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fp8_value_survives_a_round_trip_and_rounding_saturates() {
        for f in [KFormat::Fp8E4m3, KFormat::Fp8E5m2] {
            let all: Vec<u8> = (0..=255).collect();
            let mut wide = vec![0f32; 256];
            assert_eq!(f.widen(&all, &mut wide), 256);
            let mut back = vec![0u8; 256];
            f.narrow(&wide, &mut back);
            for b in 0..256 {
                if wide[b].is_finite() {
                    // -0.0 and 0.0 both encode; every finite value comes back bit for bit.
                    assert_eq!(back[b], all[b], "{f:?} byte {b:#04x} = {}", wide[b]);
                }
            }
        }
        // e4m3fn: 448 is the largest finite value; beyond it saturates, never NaN.
        let mut out = [0u8; 3];
        KFormat::Fp8E4m3.narrow(&[448.0, 1000.0, -1e9], &mut out);
        let mut wide = [0f32; 3];
        KFormat::Fp8E4m3.widen(&out, &mut wide);
        assert_eq!(wide, [448.0, 448.0, -448.0]);
        KFormat::Fp8E5m2.narrow(&[1e9, 0.3, -57344.0], &mut out);
        KFormat::Fp8E5m2.widen(&out, &mut wide);
        assert_eq!(wide[0], 57344.0);
        assert_eq!(wide[2], -57344.0);
        assert!((wide[1] - 0.3).abs() < 0.04, "{}", wide[1]);
    }

    #[test]
    fn half_and_single_rows_round_trip_aligned_or_not() {
        let vals: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) / 7.0).collect();
        for f in [KFormat::F32, KFormat::F16, KFormat::Bf16] {
            // One byte of offset makes the buffer unaligned for the element type.
            for pad in [0usize, 1] {
                let mut bytes = vec![0u8; pad + vals.len() * f.itemsize()];
                assert_eq!(f.narrow(&vals, &mut bytes[pad..]), vals.len());
                let mut back = vec![0f32; vals.len()];
                assert_eq!(f.widen(&bytes[pad..], &mut back), vals.len());
                let tol = match f {
                    KFormat::F32 => 0.0,
                    KFormat::F16 => 2e-3,
                    _ => 2e-2,
                };
                for (a, b) in vals.iter().zip(&back) {
                    assert!((a - b).abs() <= tol * a.abs().max(1.0), "{f:?} pad {pad}: {a} vs {b}");
                }
            }
        }
        // Short buffers: only whole elements move, nothing panics.
        let mut out = [0f32; 4];
        assert_eq!(KFormat::F16.widen(&[0, 60, 0], &mut out), 1);
        assert_eq!(out[0], 1.0);
        assert_eq!(KFormat::F32.narrow(&[1.0, 2.0], &mut [0u8; 7]), 1);
    }
}
