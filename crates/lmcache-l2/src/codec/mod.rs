//! Payload codecs, chosen per adapter with `"serde": {"type": ...}`.
//!
//! | type | id | lossless | notes |
//! |---|---|---|---|
//! | `none` | 0 | yes | the payload is the object; stores write straight from L1 |
//! | `lz4` | 1 | yes | fast compression |
//! | `zstd` | 2 | yes | `level` (default 1) |
//! | `aesgcm` | 3 | yes | AES-256-GCM, key per cache_salt (HKDF-SHA256 of `master_key_path`), the wire key bound as associated data |
//! | `fp8` | 4 | **no** | e4m3 with one f32 scale per `block_size` elements of the registered layout's dtype (bound at the first registration, or `dtype`; other dtypes refused); NaN kept, an infinity refuses the object; opt-in |

mod aes;
mod fp8;

use bytes::Bytes;
use lmcache_core::ObjectKey;
use serde_json::Value;

use crate::blob::{self, Blob, BlobError};
use crate::error::ConfigError;

pub use aes::AesGcmCodec;
pub use fp8::{Fp8Codec, KvDtype};

/// A payload codec.
#[derive(Debug)]
pub enum Codec {
    /// Stored as is.
    None,
    /// LZ4 block compression.
    Lz4,
    /// Zstandard at a level.
    Zstd {
        /// Compression level (1..=22).
        level: i32,
    },
    /// Authenticated encryption.
    AesGcm(AesGcmCodec),
    /// Lossy 8-bit float quantization.
    Fp8(Box<Fp8Codec>),
}

impl Codec {
    /// The id written in blob headers.
    pub fn id(&self) -> u8 {
        match self {
            Self::None => 0,
            Self::Lz4 => 1,
            Self::Zstd { .. } => 2,
            Self::AesGcm(_) => 3,
            Self::Fp8(_) => 4,
        }
    }

    /// The codec's name as configured.
    pub fn name(&self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Lz4 => "lz4",
            Self::Zstd { .. } => "zstd",
            Self::AesGcm(_) => "aesgcm",
            Self::Fp8(_) => "fp8",
        }
    }

    /// Builds a codec from a `serde` object (`{"type": ..., ...}`); `None` means no codec.
    pub fn from_spec(spec: Option<&Value>) -> Result<Self, ConfigError> {
        let Some(spec) = spec else { return Ok(Self::None) };
        let obj =
            spec.as_object().ok_or_else(|| ConfigError::field("serde", "must be an object"))?;
        let kind = obj.get("type").and_then(Value::as_str).ok_or_else(|| {
            ConfigError::field("serde.type", "missing (none|lz4|zstd|aesgcm|fp8)")
        })?;
        match kind {
            "none" => Ok(Self::None),
            "lz4" => Ok(Self::Lz4),
            "zstd" => {
                let level = match obj.get("level") {
                    None => 1,
                    Some(v) => v
                        .as_i64()
                        .filter(|l| (1..=22).contains(l))
                        .ok_or_else(|| ConfigError::field("serde.level", "must be 1..=22"))?
                        as i32,
                };
                Ok(Self::Zstd { level })
            }
            "aesgcm" => Ok(Self::AesGcm(AesGcmCodec::from_spec(obj)?)),
            "fp8" => Ok(Self::Fp8(Box::new(Fp8Codec::from_spec(obj)?))),
            other => Err(ConfigError::field(
                "serde.type",
                format!("unknown codec {other:?} (none|lz4|zstd|aesgcm|fp8)"),
            )),
        }
    }

    /// Binds the element type of a registered layout (fp8 quantizes by it; the other codecs
    /// are byte-exact and take any). Err when this codec cannot serve `dtype`; with
    /// `dry_run` nothing is bound.
    pub fn bind_dtype(&self, dtype: lmcache_core::Dtype, dry_run: bool) -> Result<(), String> {
        match self {
            Self::Fp8(c) => {
                let d = KvDtype::of_layout(dtype)
                    .ok_or_else(|| format!("the fp8 codec cannot quantize {dtype} objects"))?;
                if dry_run { c.can_bind(d) } else { c.bind(d) }
            }
            _ => Ok(()),
        }
    }

    /// Encodes `raw` for `key` into a blob.
    pub fn encode(&self, key: &ObjectKey, raw: Bytes) -> Result<Blob, BlobError> {
        let raw_len = raw.len() as u64;
        let payload = match self {
            Self::None => raw,
            Self::Lz4 => Bytes::from(lz4_flex::block::compress(&raw)),
            Self::Zstd { level } => Bytes::from(
                zstd::bulk::compress(&raw, *level).map_err(|e| BlobError::Decode(e.to_string()))?,
            ),
            Self::AesGcm(c) => Bytes::from(c.seal(key, &raw)?),
            Self::Fp8(c) => Bytes::from(c.encode(&raw)?),
        };
        Ok(Blob::new(key, self.id(), payload, raw_len))
    }

    /// Verifies a stored blob for `key` and returns its header and encoded payload.
    pub fn open<'a>(
        &self,
        key: &ObjectKey,
        bytes: &'a [u8],
    ) -> Result<(blob::Header, &'a [u8]), BlobError> {
        let (h, payload) = blob::verify(key, bytes)?;
        if h.codec != self.id() {
            return Err(BlobError::Codec { found: h.codec, expected: self.id() });
        }
        Ok((h, payload))
    }

    /// Decodes a verified payload into `dest`, which must be exactly the raw length.
    pub fn decode_into(
        &self,
        key: &ObjectKey,
        payload: &[u8],
        dest: &mut [u8],
    ) -> Result<(), BlobError> {
        let bad = |e: String| BlobError::Decode(e);
        match self {
            Self::None => {
                if payload.len() != dest.len() {
                    return Err(BlobError::RawLength {
                        found: payload.len() as u64,
                        expected: dest.len() as u64,
                    });
                }
                dest.copy_from_slice(payload);
            }
            Self::Lz4 => {
                let n = lz4_flex::block::decompress_into(payload, dest)
                    .map_err(|e| bad(e.to_string()))?;
                if n != dest.len() {
                    return Err(BlobError::RawLength {
                        found: n as u64,
                        expected: dest.len() as u64,
                    });
                }
            }
            Self::Zstd { .. } => {
                let n = zstd::bulk::decompress_to_buffer(payload, dest)
                    .map_err(|e| bad(e.to_string()))?;
                if n != dest.len() {
                    return Err(BlobError::RawLength {
                        found: n as u64,
                        expected: dest.len() as u64,
                    });
                }
            }
            Self::AesGcm(c) => c.open_into(key, payload, dest)?,
            Self::Fp8(c) => c.decode_into(payload, dest)?,
        }
        Ok(())
    }

    /// Verifies and decodes a whole blob into a new buffer.
    pub fn decode(&self, key: &ObjectKey, bytes: &[u8]) -> Result<Vec<u8>, BlobError> {
        let (h, payload) = self.open(key, bytes)?;
        let len = usize::try_from(h.raw_len)
            .map_err(|_| BlobError::Decode(format!("raw length {} too large", h.raw_len)))?;
        let mut out = vec![0u8; len];
        self.decode_into(key, payload, &mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key() -> ObjectKey {
        ObjectKey::new([3; 32], "m", 1, 0, 0, "tenant").unwrap()
    }

    fn sample() -> Vec<u8> {
        (0..64 * 1024u32).flat_map(|i| ((i % 251) as u16 * 3).to_le_bytes()).collect()
    }

    #[test]
    fn lossless_codecs_round_trip_and_detect_tampering() {
        let dir = tempfile::tempdir().unwrap();
        let kp = dir.path().join("master.key");
        std::fs::write(&kp, [9u8; 32]).unwrap();
        let specs = [
            json!({"type": "none"}),
            json!({"type": "lz4"}),
            json!({"type": "zstd", "level": 3}),
            json!({"type": "aesgcm", "master_key_path": kp}),
        ];
        for spec in specs {
            let c = Codec::from_spec(Some(&spec)).unwrap();
            let raw = sample();
            let blob = c.encode(&key(), Bytes::from(raw.clone())).unwrap();
            let bytes = blob.to_contiguous();
            assert_eq!(c.decode(&key(), &bytes).unwrap(), raw, "{spec}");
            let mut bad = bytes.to_vec();
            let last = bad.len() - 1;
            bad[last] ^= 1;
            assert!(c.decode(&key(), &bad).is_err(), "{spec}: tamper accepted");
        }
    }

    #[test]
    fn codec_mismatch_is_refused() {
        let lz4 = Codec::Lz4;
        let blob = lz4.encode(&key(), Bytes::from(sample())).unwrap().to_contiguous();
        assert!(matches!(Codec::None.decode(&key(), &blob), Err(BlobError::Codec { .. })));
    }

    #[test]
    fn bad_specs_name_the_field() {
        for (spec, field) in [
            (json!("lz4"), "serde"),
            (json!({}), "serde.type"),
            (json!({"type": "brotli"}), "serde.type"),
            (json!({"type": "zstd", "level": 99}), "serde.level"),
            (json!({"type": "aesgcm"}), "serde.master_key_path"),
            (json!({"type": "fp8", "dtype": "int4"}), "serde.dtype"),
        ] {
            let e = Codec::from_spec(Some(&spec)).unwrap_err();
            assert_eq!(e.field, field, "{spec}");
        }
    }
}
