//! Lossy fp8 (e4m3, "fn" variant: no infinities, max 448) with one f32 scale per block.
//!
//! Payload: dtype code (u8), block size (u32), element count (u64), then per block an f32
//! scale followed by one byte per element. Each block is scaled so that its largest finite
//! magnitude maps to 448, which keeps small-valued blocks precise (LMCache's plain cast has no
//! scale and turns out-of-range values into NaN).
//!
//! The element type is the registered layout's (the server binds it when a worker registers,
//! see [`Fp8Codec::bind`]); a spec's `dtype` pre-binds it, and a worker of another dtype is
//! then refused. NaN is kept (e4m3's NaN code); an infinity has no e4m3 code, so an object
//! holding one is refused (it stays in L1 only) rather than stored as a finite number.

use std::sync::atomic::{AtomicU8, Ordering};

use half::{bf16, f16};
use serde_json::{Map, Value};

use crate::blob::BlobError;
use crate::error::ConfigError;

const E4M3_MAX: f32 = 448.0;

/// Element type of the KV bytes being quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
}

impl KvDtype {
    /// The codec's view of a registered layout's element type; `None` for types it cannot
    /// quantize (fp8 already, integers, f64).
    pub fn of_layout(d: lmcache_core::Dtype) -> Option<Self> {
        match d {
            lmcache_core::Dtype::BFloat16 => Some(Self::Bf16),
            lmcache_core::Dtype::Float16 => Some(Self::F16),
            lmcache_core::Dtype::Float32 => Some(Self::F32),
            _ => None,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        match c {
            1 => Some(Self::Bf16),
            2 => Some(Self::F16),
            3 => Some(Self::F32),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bfloat16",
            Self::F16 => "float16",
            Self::F32 => "float32",
        }
    }

    fn code(self) -> u8 {
        match self {
            Self::Bf16 => 1,
            Self::F16 => 2,
            Self::F32 => 3,
        }
    }

    fn size(self) -> usize {
        if self == Self::F32 { 4 } else { 2 }
    }

    fn get(self, b: &[u8]) -> f32 {
        match self {
            Self::Bf16 => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            Self::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
            Self::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }

    fn put(self, v: f32, out: &mut [u8]) {
        match self {
            Self::Bf16 => out.copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
            Self::F16 => out.copy_from_slice(&f16::from_f32(v).to_le_bytes()),
            Self::F32 => out.copy_from_slice(&v.to_le_bytes()),
        }
    }
}

/// The fp8 codec.
#[derive(Debug)]
pub struct Fp8Codec {
    /// [`KvDtype::code`] of the bound element type; 0 until bound.
    dtype: AtomicU8,
    block: usize,
    /// Decoded values of the 127 non-negative finite codes, ascending.
    table: [f32; 127],
}

/// Why a codec bound to `bound` cannot take a layout of `d`.
fn mismatch(bound: KvDtype, d: KvDtype) -> String {
    format!("the fp8 codec quantizes {}, and this layout is {}", bound.name(), d.name())
}

/// e4m3fn's NaN (either sign); it has no infinities.
const NAN_CODE: u8 = 0x7f;

fn e4m3_decode(code: u8) -> f32 {
    if code & 0x7f == NAN_CODE {
        return f32::NAN;
    }
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((code >> 3) & 0xf);
    let man = f32::from(code & 0x7);
    let mag =
        if exp == 0 { man / 8.0 * 2f32.powi(-6) } else { (1.0 + man / 8.0) * 2f32.powi(exp - 7) };
    sign * mag
}

impl Fp8Codec {
    /// From `{"dtype": "bfloat16"|"float16"|"float32", "block_size": 128}`; without a
    /// `dtype` the codec takes the first registered layout's.
    pub fn from_spec(obj: &Map<String, Value>) -> Result<Self, ConfigError> {
        let dtype = match obj.get("dtype").map(|v| v.as_str()) {
            None => None,
            Some(Some("bfloat16" | "bf16")) => Some(KvDtype::Bf16),
            Some(Some("float16" | "half" | "fp16")) => Some(KvDtype::F16),
            Some(Some("float32" | "float" | "fp32")) => Some(KvDtype::F32),
            Some(other) => {
                return Err(ConfigError::field(
                    "serde.dtype",
                    format!("{other:?}: must be bfloat16, float16 or float32"),
                ));
            }
        };
        let block = match obj.get("block_size") {
            None => 128,
            Some(v) => v
                .as_u64()
                .filter(|b| (1..=65536).contains(b))
                .ok_or_else(|| ConfigError::field("serde.block_size", "must be 1..=65536"))?
                as usize,
        };
        Ok(match dtype {
            Some(d) => Self::new(d, block),
            None => Self::unbound(block),
        })
    }

    /// A codec for `dtype` with `block` elements per scale.
    pub fn new(dtype: KvDtype, block: usize) -> Self {
        let c = Self::unbound(block);
        c.dtype.store(dtype.code(), Ordering::Release);
        c
    }

    /// A codec whose element type the first [`Self::bind`] sets.
    pub fn unbound(block: usize) -> Self {
        let mut table = [0f32; 127];
        for (c, t) in table.iter_mut().enumerate() {
            *t = e4m3_decode(c as u8);
        }
        Self { dtype: AtomicU8::new(0), block: block.max(1), table }
    }

    /// The bound element type, if any.
    pub fn dtype(&self) -> Option<KvDtype> {
        KvDtype::from_code(self.dtype.load(Ordering::Acquire))
    }

    /// Whether [`Self::bind`] of `d` would succeed (nothing is changed).
    pub fn can_bind(&self, d: KvDtype) -> Result<(), String> {
        match self.dtype() {
            Some(b) if b != d => Err(mismatch(b, d)),
            _ => Ok(()),
        }
    }

    /// Binds the element type of the registered layout: the first binding sets it, a later
    /// one must agree (one fp8 adapter quantizes one element type).
    pub fn bind(&self, d: KvDtype) -> Result<(), String> {
        match self.dtype.compare_exchange(0, d.code(), Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(()),
            Err(c) if c == d.code() => Ok(()),
            // Only `KvDtype::code`s are ever stored, so `from_code` finds it.
            Err(c) => {
                Err(KvDtype::from_code(c)
                    .map_or_else(|| "fp8: bad dtype".into(), |b| mismatch(b, d)))
            }
        }
    }

    fn quantize(&self, v: f32) -> u8 {
        if v.is_nan() {
            return NAN_CODE;
        }
        let mag = v.abs().min(E4M3_MAX);
        // Nearest table entry (ties to the even code).
        let i = self.table.partition_point(|&t| t < mag);
        let code = if i == 0 {
            0
        } else if i >= self.table.len() {
            126
        } else {
            let (lo, hi) = (self.table[i - 1], self.table[i]);
            if mag - lo < hi - mag || (mag - lo == hi - mag && (i - 1) % 2 == 0) {
                i - 1
            } else {
                i
            }
        } as u8;
        if v.is_sign_negative() && code != 0 { code | 0x80 } else { code }
    }

    /// Quantizes `raw` (elements of the configured dtype).
    pub fn encode(&self, raw: &[u8]) -> Result<Vec<u8>, BlobError> {
        let dtype = self.dtype().ok_or_else(|| {
            BlobError::Decode(
                "fp8: no element type yet (set serde.dtype, or register a worker first)".into(),
            )
        })?;
        let es = dtype.size();
        if raw.len() % es != 0 {
            return Err(BlobError::Decode(format!(
                "fp8: {} bytes is not a whole number of {es}-byte elements",
                raw.len()
            )));
        }
        let n = raw.len() / es;
        let mut out = Vec::with_capacity(13 + n + n.div_ceil(self.block) * 4);
        out.push(dtype.code());
        out.extend_from_slice(&(self.block as u32).to_le_bytes());
        out.extend_from_slice(&(n as u64).to_le_bytes());
        let mut vals = Vec::with_capacity(self.block);
        for chunk in raw.chunks(self.block * es) {
            vals.clear();
            vals.extend(chunk.chunks_exact(es).map(|b| dtype.get(b)));
            if vals.iter().any(|v| v.is_infinite()) {
                return Err(BlobError::Decode(
                    "fp8: an infinity has no e4m3 code; the object is not stored".into(),
                ));
            }
            let amax = vals.iter().filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs()));
            let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
            out.extend_from_slice(&scale.to_le_bytes());
            out.extend(vals.iter().map(|&v| self.quantize(v / scale)));
        }
        Ok(out)
    }

    /// Dequantizes into `dest` (elements of the configured dtype).
    pub fn decode_into(&self, payload: &[u8], dest: &mut [u8]) -> Result<(), BlobError> {
        let bad = |m: &str| BlobError::Decode(format!("fp8: {m}"));
        if payload.len() < 13 {
            return Err(bad("header"));
        }
        // The payload names its element type; a bound codec must agree with it (an
        // unbound one, before any registration, decodes to the stored representation).
        let dtype = KvDtype::from_code(payload[0]).ok_or_else(|| bad("unknown dtype"))?;
        if self.dtype().is_some_and(|d| d != dtype) {
            return Err(bad("stored for another element type than the registered layout"));
        }
        let block = u32::from_le_bytes([payload[1], payload[2], payload[3], payload[4]]) as usize;
        let mut nb = [0u8; 8];
        nb.copy_from_slice(&payload[5..13]);
        let n = usize::try_from(u64::from_le_bytes(nb)).map_err(|_| bad("count"))?;
        let es = dtype.size();
        if block == 0 || n.checked_mul(es) != Some(dest.len()) {
            return Err(BlobError::RawLength {
                found: (n * es) as u64,
                expected: dest.len() as u64,
            });
        }
        let mut body = &payload[13..];
        for out in dest.chunks_mut(block * es) {
            let k = out.len() / es;
            if body.len() < 4 + k {
                return Err(bad("truncated"));
            }
            let scale = f32::from_le_bytes([body[0], body[1], body[2], body[3]]);
            for (q, o) in body[4..4 + k].iter().zip(out.chunks_exact_mut(es)) {
                dtype.put(e4m3_decode(*q) * scale, o);
            }
            body = &body[4 + k..];
        }
        if !body.is_empty() {
            return Err(bad("trailing bytes"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_table_matches_the_format() {
        assert_eq!(e4m3_decode(0x7e), 448.0);
        assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_decode(0x38), 1.0);
        assert_eq!(e4m3_decode(0xb8), -1.0);
    }

    #[test]
    fn bf16_round_trip_error_is_bounded_per_block() {
        let c = Fp8Codec::new(KvDtype::Bf16, 64);
        let vals: Vec<f32> =
            (0..4096).map(|i| ((i as f32) * 0.37).sin() * (1 + i / 512) as f32).collect();
        let raw: Vec<u8> = vals.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
        let enc = c.encode(&raw).unwrap();
        assert!(enc.len() < raw.len() * 6 / 10, "fp8 should about halve bf16");
        let mut out = vec![0u8; raw.len()];
        c.decode_into(&enc, &mut out).unwrap();
        for (blk, orig) in vals.chunks(64).enumerate() {
            let amax = orig.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (j, &v) in orig.iter().enumerate() {
                let i = blk * 64 + j;
                let got = bf16::from_le_bytes([out[2 * i], out[2 * i + 1]]).to_f32();
                // e4m3 keeps 3 mantissa bits: relative step 1/16, plus the subnormal floor.
                assert!(
                    (got - v).abs() <= v.abs() / 14.0 + amax / 448.0 * 2f32.powi(-6),
                    "{v} -> {got}"
                );
            }
        }
    }

    /// NaN stays NaN; an infinity is refused, never stored as a finite number.
    #[test]
    fn nan_is_kept_and_infinity_refused() {
        for dtype in [KvDtype::Bf16, KvDtype::F16, KvDtype::F32] {
            let c = Fp8Codec::new(dtype, 4);
            let es = dtype.size();
            let vals = [1.5f32, f32::NAN, -2.0, 0.25, -f32::NAN, 3.0];
            let mut raw = vec![0u8; vals.len() * es];
            for (v, o) in vals.iter().zip(raw.chunks_exact_mut(es)) {
                dtype.put(*v, o);
            }
            let enc = c.encode(&raw).unwrap();
            let mut out = vec![0u8; raw.len()];
            c.decode_into(&enc, &mut out).unwrap();
            let back: Vec<f32> = out.chunks_exact(es).map(|b| dtype.get(b)).collect();
            assert!(back[1].is_nan() && back[4].is_nan(), "{dtype:?}: NaN lost: {back:?}");
            for i in [0, 2, 3, 5] {
                assert!((back[i] - vals[i]).abs() <= vals[i].abs() / 8.0, "{dtype:?}: {back:?}");
            }
            for inf in [f32::INFINITY, f32::NEG_INFINITY] {
                let mut raw = vec![0u8; 2 * es];
                dtype.put(1.0, &mut raw[..es]);
                dtype.put(inf, &mut raw[es..]);
                assert!(c.encode(&raw).is_err(), "{dtype:?}: {inf} stored");
            }
        }
    }

    /// The element type comes from the registered layout; a second, different one is
    /// refused, and so is a payload of another element type.
    #[test]
    fn the_dtype_is_bound_once_and_mismatches_refused() {
        let c = Fp8Codec::unbound(8);
        let raw: Vec<u8> =
            (0..16u16).flat_map(|i| f16::from_f32(f32::from(i)).to_le_bytes()).collect();
        assert!(c.encode(&raw).is_err(), "encoded without an element type");
        c.bind(KvDtype::F16).unwrap();
        c.bind(KvDtype::F16).unwrap();
        assert!(c.bind(KvDtype::Bf16).unwrap_err().contains("float16"));
        let enc = c.encode(&raw).unwrap();
        let mut out = vec![0u8; raw.len()];
        c.decode_into(&enc, &mut out).unwrap();
        for (i, b) in out.chunks_exact(2).enumerate() {
            let (got, want) = (f16::from_le_bytes([b[0], b[1]]).to_f32(), i as f32);
            assert!((got - want).abs() <= want / 14.0 + 0.01, "{want} -> {got}");
        }
        let other = Fp8Codec::new(KvDtype::Bf16, 8);
        assert!(other.decode_into(&enc, &mut out).is_err(), "f16 payload decoded as bf16");
        assert_eq!(KvDtype::of_layout(lmcache_core::Dtype::Int8), None);
    }

    #[test]
    fn misaligned_input_is_refused() {
        let c = Fp8Codec::new(KvDtype::F32, 16);
        assert!(c.encode(&[0u8; 7]).is_err());
        let mut out = [0u8; 8];
        assert!(c.decode_into(&[3, 16, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0], &mut out).is_err());
    }
}
