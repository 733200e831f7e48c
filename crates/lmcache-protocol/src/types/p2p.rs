//! The payloads of the three RPCs a P2P peer serves (LMCache's `p2p_controller.py`):
//! [`WireObjectKey`] (`ObjectKey` as msgspec writes it), [`LayoutDesc`]
//! (`MemoryLayoutDesc`) and [`TransferAddress`] (`TransferChannelAddress`).
//!
//! Verified encodings (blend-p2p-cpu.md B3): a key is
//! `85 aa"chunk_hash" c4 04 00010203 aa"model_name" a1 6d a7"kv_rank" ce01000100
//! af"object_group_id" 00 aa"cache_salt" a0` (LMCache's chunk hashes on the wire may be any
//! length; ours are 32 bytes, and a key of another length can never be resident here), a
//! layout `82 a6"shapes" 91 94 02 20 cd0100 cd0400 a6"dtypes" 91 a7"float16"`, an address
//! `82 a6"offset" cd1000 a4"size" ce00100000` and a miss `82 a6"offset" ff a4"size" 00`.

use lmcache_core::{CacheSalt, ChunkHash, KvRank, ModelName, ObjectKey};
use rmpv::Value;

use crate::error::ProtocolError;
use crate::value::{self, Fields, map};

/// An `ObjectKey` as a peer sends it. A key whose fields our keys cannot hold (a chunk hash
/// of another length than 32 bytes, say) decodes to `None`: it names nothing we could hold,
/// so it is a miss, not an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireObjectKey(pub Option<ObjectKey>);

fn bad(field: String, reason: impl ToString) -> ProtocolError {
    ProtocolError::OutOfRange { field, reason: reason.to_string() }
}

impl WireObjectKey {
    /// Decodes one key: a map of the five fields, each of its msgpack type.
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let f = Fields::of(field, v)?;
        let hash = value::bin(&f.path("chunk_hash"), f.req("chunk_hash")?)?;
        let model = value::str_(&f.path("model_name"), f.req("model_name")?)?;
        let kv_rank = value::u32_(&f.path("kv_rank"), f.req("kv_rank")?)?;
        let group = value::u32_(&f.path("object_group_id"), f.req("object_group_id")?)?;
        let salt = value::str_(&f.path("cache_salt"), f.req("cache_salt")?)?;
        let Ok(chunk_hash) = ChunkHash::from_slice(hash) else { return Ok(Self(None)) };
        let model_name = ModelName::new(model).map_err(|e| bad(f.path("model_name"), e))?;
        let kv_rank = KvRank::from_packed(kv_rank).map_err(|e| bad(f.path("kv_rank"), e))?;
        let cache_salt = CacheSalt::new(salt).map_err(|e| bad(f.path("cache_salt"), e))?;
        Ok(Self(Some(ObjectKey {
            chunk_hash,
            model_name,
            kv_rank,
            object_group_id: group,
            cache_salt,
        })))
    }

    /// The key as LMCache's msgspec encodes it.
    pub fn encode(key: &ObjectKey) -> Value {
        map(vec![
            ("chunk_hash", Value::Binary(key.chunk_hash.as_bytes().to_vec())),
            ("model_name", Value::from(key.model_name.as_str())),
            ("kv_rank", Value::from(key.kv_rank.packed())),
            ("object_group_id", Value::from(key.object_group_id)),
            ("cache_salt", Value::from(key.cache_salt.as_str())),
        ])
    }
}

/// A list of keys.
pub fn decode_keys(field: &str, v: &Value) -> Result<Vec<WireObjectKey>, ProtocolError> {
    value::array(field, v)?
        .iter()
        .enumerate()
        .map(|(i, k)| WireObjectKey::decode(&format!("{field}[{i}]"), k))
        .collect()
}

/// `MemoryLayoutDesc`: per part of an object, its shape and dtype.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutDesc {
    /// One shape per part.
    pub shapes: Vec<Vec<u64>>,
    /// One dtype name per part.
    pub dtypes: Vec<String>,
}

impl LayoutDesc {
    /// The layout of `object` (none: no parts): one shape per part as the wire describes
    /// it ([`lmcache_core::ObjectLayout::shape`]: `[kv, layers, slots, hidden]`, no `kv`
    /// for MLA), its dtype spelled with `dtype_prefix` before our name (`""` in the P2P
    /// RPCs, as LMCache's reader sends it).
    pub fn of_object(object: Option<&lmcache_core::ObjectShape>, dtype_prefix: &str) -> Self {
        let parts = object.map(|o| o.parts.as_slice()).unwrap_or_default();
        Self {
            shapes: parts.iter().map(lmcache_core::ObjectLayout::shape).collect(),
            dtypes: parts.iter().map(|p| format!("{dtype_prefix}{}", p.dtype.as_str())).collect(),
        }
    }

    /// Decodes `{shapes: [[int]], dtypes: [str]}`.
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let f = Fields::of(field, v)?;
        let shapes_path = f.path("shapes");
        let shapes = value::array(&shapes_path, f.req("shapes")?)?
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let p = format!("{shapes_path}[{i}]");
                value::array(&p, s)?.iter().map(|d| value::u64_(&p, d)).collect()
            })
            .collect::<Result<Vec<Vec<u64>>, _>>()?;
        let dtypes_path = f.path("dtypes");
        let dtypes = value::array(&dtypes_path, f.req("dtypes")?)?
            .iter()
            .map(|d| value::str_(&dtypes_path, d).map(str::to_owned))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { shapes, dtypes })
    }

    /// `{shapes, dtypes}`.
    pub fn encode(&self) -> Value {
        let shapes = self
            .shapes
            .iter()
            .map(|s| Value::Array(s.iter().map(|&d| Value::from(d)).collect()))
            .collect();
        let dtypes = self.dtypes.iter().map(|d| Value::from(d.as_str())).collect();
        map(vec![("shapes", Value::Array(shapes)), ("dtypes", Value::Array(dtypes))])
    }
}

/// `TransferChannelAddress`: where a locked object lies in the peer's registered L1 (byte
/// offset from its base) and its length; [`TransferAddress::MISS`] for a key not served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferAddress {
    /// Offset from the L1 base; negative for a miss.
    pub offset: i64,
    /// Bytes.
    pub size: u64,
}

impl TransferAddress {
    /// A key the peer does not serve.
    pub const MISS: Self = Self { offset: -1, size: 0 };

    /// Whether this is a hit.
    pub fn is_hit(&self) -> bool {
        self.offset >= 0
    }

    /// `{offset, size}`.
    pub fn encode(&self) -> Value {
        map(vec![("offset", Value::from(self.offset)), ("size", Value::from(self.size))])
    }

    /// Decodes `{offset, size}`.
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let f = Fields::of(field, v)?;
        Ok(Self {
            offset: value::int(&f.path("offset"), f.req("offset")?)?,
            size: value::u64_(&f.path("size"), f.req("size")?)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(v: &Value) -> String {
        value::encode(v).iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn addresses_and_layouts_encode_as_lmcache_verified() {
        let hit = TransferAddress { offset: 0x1000, size: 0x0010_0000 };
        assert_eq!(
            hex(&Value::Array(vec![hit.encode(), TransferAddress::MISS.encode()])),
            "9282a66f6666736574cd1000a473697a65ce0010000082a66f6666736574ffa473697a6500"
        );
        let layout =
            LayoutDesc { shapes: vec![vec![2, 32, 256, 1024]], dtypes: vec!["float16".into()] };
        assert_eq!(
            hex(&layout.encode()),
            "82a673686170657391940220cd0100cd0400a664747970657391a7666c6f61743136"
        );
        assert_eq!(LayoutDesc::decode("l", &layout.encode()).unwrap(), layout);
        assert_eq!(TransferAddress::decode("a", &hit.encode()).unwrap(), hit);
        // LMCache's default model's object, as our reader describes it.
        let part = |kv| lmcache_core::ObjectLayout {
            kv,
            layers: 32,
            slots: 256,
            hidden: 1024,
            dtype: lmcache_core::Dtype::Float16,
        };
        let object = |kv| lmcache_core::ObjectShape {
            parts: vec![part(kv)],
            window_chunks: None,
            recurrent: false,
        };
        assert_eq!(LayoutDesc::of_object(Some(&object(2)), ""), layout);
        let mla = LayoutDesc::of_object(Some(&object(1)), "torch.");
        assert_eq!(
            (mla.shapes, mla.dtypes),
            (vec![vec![32, 256, 1024]], vec!["torch.float16".into()])
        );
        assert_eq!(LayoutDesc::of_object(None, ""), LayoutDesc { shapes: vec![], dtypes: vec![] });
    }

    #[test]
    fn keys_round_trip_and_a_short_hash_is_a_miss_not_an_error() {
        let k = ObjectKey::new([7; 32], "m", 2, 1, 3, "salt").unwrap();
        assert_eq!(WireObjectKey::decode("k", &WireObjectKey::encode(&k)).unwrap().0, Some(k));
        // LMCache's verified example: a 4-byte hash, model "m", kv_rank 0x01000100.
        let short = map(vec![
            ("chunk_hash", Value::Binary(vec![0, 1, 2, 3])),
            ("model_name", Value::from("m")),
            ("kv_rank", Value::from(0x0100_0100u32)),
            ("object_group_id", Value::from(0)),
            ("cache_salt", Value::from("")),
        ]);
        assert_eq!(
            hex(&short),
            "85aa6368756e6b5f68617368c40400010203aa6d6f64656c5f6e616d65a16da76b765f72616e6bce01000100af6f626a6563745f67726f75705f696400aa63616368655f73616c74a0"
        );
        assert_eq!(WireObjectKey::decode("k", &short).unwrap().0, None);
        let e = WireObjectKey::decode("keys[0]", &Value::from(3)).unwrap_err();
        assert!(e.to_string().contains("keys[0]"), "{e}");
    }
}
