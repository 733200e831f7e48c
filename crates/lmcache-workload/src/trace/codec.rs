//! LMCache's argument codec: msgpack natives pass through; other values are maps
//! `{"__t__": tag, "v": payload}` (`tuple`, `set`, `ObjectKey`, `MemoryLayoutDesc`,
//! `PrefetchTaskSpec`, `GroupedObjectKeys`, `PrefetchLockMode`, `torch.Size`, ...).
//!
//! Here: building the values our recorder writes, and reading back the ones a replay needs,
//! from LMCache's files or ours. LMCache's `ObjectKey` codec has no `cache_salt`; ours adds
//! the field when the salt is not empty (LMCache's decoder reads fields by name and ignores
//! it), so a tenant's keys replay as that tenant's.

use lmcache_core::{ChunkHash, KvRank, ObjectKey};
use rmpv::Value;

use super::format::map_get;

/// The qualified-name prefix of LMCache's storage manager methods.
pub const SM: &str = "lmcache.v1.distributed.storage_manager.StorageManager";
/// `StorageManager.reserve_write(keys, layout_desc)`.
pub const RESERVE_WRITE: &str =
    "lmcache.v1.distributed.storage_manager.StorageManager.reserve_write";
/// `StorageManager.finish_write(keys)`.
pub const FINISH_WRITE: &str = "lmcache.v1.distributed.storage_manager.StorageManager.finish_write";
/// `StorageManager.submit_prefetch_task(spec, external_request_id, skip_l2)`.
pub const SUBMIT_PREFETCH: &str =
    "lmcache.v1.distributed.storage_manager.StorageManager.submit_prefetch_task";
/// `StorageManager.finish_read_prefetched(keys, read_locks)`.
pub const FINISH_READ: &str =
    "lmcache.v1.distributed.storage_manager.StorageManager.finish_read_prefetched";
/// Entering `StorageManager.read_prefetched_results(keys)`.
pub const READ_ENTER: &str =
    "lmcache.v1.distributed.storage_manager.StorageManager.read_prefetched_results.__enter__";
/// Leaving `StorageManager.read_prefetched_results(keys)`.
pub const READ_EXIT: &str =
    "lmcache.v1.distributed.storage_manager.StorageManager.read_prefetched_results.__exit__";
/// An events-level batch, in `POST /events` wire form.
pub const EVENTS_BATCH: &str = "events.batch";
/// An events-level start or stop mark.
pub const EVENTS_LIFECYCLE: &str = "events.lifecycle";

/// An argument that cannot be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("trace argument {what}: {why}")]
pub struct CodecError {
    /// Which argument or field.
    pub what: String,
    /// What was wrong with it.
    pub why: String,
}

fn err(what: &str, why: impl Into<String>) -> CodecError {
    CodecError { what: what.to_owned(), why: why.into() }
}

fn s(v: &str) -> Value {
    Value::from(v)
}

/// `{"__t__": tag, "v": v}`.
pub fn tagged(tag: &str, v: Value) -> Value {
    Value::Map(vec![(s("__t__"), s(tag)), (s("v"), v)])
}

/// The payload of a value tagged `tag`; `v` itself when it is not tagged at all (LMCache's
/// decoder treats an untagged map as a plain dict).
pub fn untag<'a>(v: &'a Value, tag: &str, what: &str) -> Result<&'a Value, CodecError> {
    match map_get(v, "__t__") {
        None => Ok(v),
        Some(t) if t.as_str() == Some(tag) => {
            map_get(v, "v").ok_or_else(|| err(what, format!("tagged {tag} without a value")))
        }
        Some(t) => Err(err(what, format!("tagged {t}, expected {tag}"))),
    }
}

/// A list, from a msgpack array or a tagged `tuple` or `set`.
pub fn list<'a>(v: &'a Value, what: &str) -> Result<&'a [Value], CodecError> {
    let inner = match map_get(v, "__t__").and_then(Value::as_str) {
        Some("tuple") | Some("set") => map_get(v, "v").unwrap_or(&Value::Nil),
        _ => v,
    };
    match inner {
        Value::Array(a) => Ok(a),
        _ => Err(err(what, "not a list")),
    }
}

fn field<'a>(v: &'a Value, name: &str, what: &str) -> Result<&'a Value, CodecError> {
    map_get(v, name).ok_or_else(|| err(what, format!("no field {name}")))
}

fn uint(v: &Value, what: &str) -> Result<u64, CodecError> {
    v.as_u64().ok_or_else(|| err(what, "not a non-negative integer"))
}

/// An `ObjectKey` value, as LMCache's codec writes it (plus `cache_salt` when set).
pub fn object_key(k: &ObjectKey) -> Value {
    let mut v = vec![
        (s("chunk_hash"), Value::Binary(k.chunk_hash.as_bytes().to_vec())),
        (s("model_name"), s(k.model_name.as_str())),
        (s("kv_rank"), Value::from(k.kv_rank.packed())),
        (s("object_group_id"), Value::from(k.object_group_id)),
    ];
    if !k.cache_salt.is_empty() {
        v.push((s("cache_salt"), s(k.cache_salt.as_str())));
    }
    tagged("ObjectKey", Value::Map(v))
}

/// A list of `ObjectKey`s.
pub fn object_keys<'a>(keys: impl IntoIterator<Item = &'a ObjectKey>) -> Value {
    Value::Array(keys.into_iter().map(object_key).collect())
}

/// Reads an `ObjectKey` back (LMCache's: no salt; ours: a salt when it had one).
pub fn read_object_key(v: &Value) -> Result<ObjectKey, CodecError> {
    let what = "ObjectKey";
    let v = untag(v, "ObjectKey", what)?;
    let hash = match field(v, "chunk_hash", what)? {
        Value::Binary(b) => {
            ChunkHash::from_slice(b).map_err(|e| err("ObjectKey.chunk_hash", e.to_string()))?
        }
        _ => return Err(err("ObjectKey.chunk_hash", "not bytes")),
    };
    let model = field(v, "model_name", what)?
        .as_str()
        .ok_or_else(|| err("ObjectKey.model_name", "not a string"))?;
    let rank = uint(field(v, "kv_rank", what)?, "ObjectKey.kv_rank")?;
    let rank = u32::try_from(rank)
        .ok()
        .and_then(|r| KvRank::from_packed(r).ok())
        .ok_or_else(|| err("ObjectKey.kv_rank", format!("{rank} is not a packed rank")))?;
    let group = match map_get(v, "object_group_id") {
        None => 0,
        Some(g) => u32::try_from(uint(g, "ObjectKey.object_group_id")?)
            .map_err(|_| err("ObjectKey.object_group_id", "out of range"))?,
    };
    let salt = map_get(v, "cache_salt").and_then(Value::as_str).unwrap_or("");
    let mut key = ObjectKey::new(*hash.as_bytes(), model, 1, 0, group, salt)
        .map_err(|e| err(what, e.to_string()))?;
    key.kv_rank = rank;
    Ok(key)
}

/// Reads a list of `ObjectKey`s.
pub fn read_object_keys(v: &Value, what: &str) -> Result<Vec<ObjectKey>, CodecError> {
    list(v, what)?.iter().map(read_object_key).collect()
}

/// A `MemoryLayoutDesc`: one shape and dtype (LMCache's spelling, e.g. `torch.bfloat16`) per
/// part of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutDesc {
    /// Each part's shape.
    pub shapes: Vec<Vec<u64>>,
    /// Each part's dtype.
    pub dtypes: Vec<String>,
}

impl LayoutDesc {
    /// The value LMCache's codec writes.
    pub fn to_value(&self) -> Value {
        let shapes = self
            .shapes
            .iter()
            .map(|sh| Value::Array(sh.iter().map(|&d| Value::from(d)).collect()))
            .collect();
        let dtypes = self.dtypes.iter().map(|d| s(d)).collect();
        tagged(
            "MemoryLayoutDesc",
            Value::Map(vec![
                (s("shapes"), Value::Array(shapes)),
                (s("dtypes"), Value::Array(dtypes)),
            ]),
        )
    }

    /// Reads one back.
    pub fn read(v: &Value) -> Result<Self, CodecError> {
        let what = "MemoryLayoutDesc";
        let v = untag(v, "MemoryLayoutDesc", what)?;
        let shapes = list(field(v, "shapes", what)?, "MemoryLayoutDesc.shapes")?
            .iter()
            .map(|sh| {
                let sh = match map_get(sh, "__t__").and_then(Value::as_str) {
                    Some("torch.Size") => map_get(sh, "v").unwrap_or(&Value::Nil),
                    _ => sh,
                };
                list(sh, "MemoryLayoutDesc.shapes")?
                    .iter()
                    .map(|d| uint(d, "MemoryLayoutDesc.shapes"))
                    .collect::<Result<Vec<u64>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let dtypes = list(field(v, "dtypes", what)?, "MemoryLayoutDesc.dtypes")?
            .iter()
            .map(|d| {
                let d = match map_get(d, "__t__").and_then(Value::as_str) {
                    Some("torch.dtype") => map_get(d, "v").unwrap_or(&Value::Nil),
                    _ => d,
                };
                d.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| err("MemoryLayoutDesc.dtypes", "not a string"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if shapes.len() != dtypes.len() {
            return Err(err(what, format!("{} shapes but {} dtypes", shapes.len(), dtypes.len())));
        }
        Ok(Self { shapes, dtypes })
    }

    /// Bytes of one object of this layout; `None` for an unknown dtype or an overflow.
    pub fn bytes(&self) -> Option<u64> {
        let mut total = 0u64;
        for (shape, dtype) in self.shapes.iter().zip(&self.dtypes) {
            let elem = crate::lookup_log::dtype_bytes(dtype)?;
            let n = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
            total = total.checked_add(n.checked_mul(elem)?)?;
        }
        Some(total)
    }
}

/// One group of a `PrefetchTaskSpec` (`GroupedObjectKeys`).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyGroup {
    /// The keys, in prefix order (every shard's, as LMCache lists them).
    pub keys: Vec<ObjectKey>,
    /// The object group.
    pub object_group_id: u32,
    /// The group's object layout.
    pub layout: Option<LayoutDesc>,
    /// Chunks of its sliding window (LMCache writes -1 for full attention).
    pub sliding_window_size: i64,
}

/// A `PrefetchTaskSpec`, what a lookup asks the storage manager for.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefetchSpec {
    /// The key groups.
    pub key_groups: Vec<KeyGroup>,
    /// Read locks to take per object found (one per engine reader).
    pub num_kv_readers: u32,
    /// LMCache's fetching policy name.
    pub fetching_policy: String,
    /// LMCache's lock mode name (`PrefetchLockMode`).
    pub lock_mode: String,
}

impl PrefetchSpec {
    /// The value LMCache's codec writes.
    pub fn to_value(&self) -> Value {
        let groups = self
            .key_groups
            .iter()
            .map(|g| {
                tagged(
                    "GroupedObjectKeys",
                    Value::Map(vec![
                        (s("keys"), object_keys(&g.keys)),
                        (s("object_group_id"), Value::from(g.object_group_id)),
                        (
                            s("layout_desc"),
                            g.layout.as_ref().map_or(Value::Nil, LayoutDesc::to_value),
                        ),
                        (s("sliding_window_size"), Value::from(g.sliding_window_size)),
                    ]),
                )
            })
            .collect();
        tagged(
            "PrefetchTaskSpec",
            Value::Map(vec![
                (s("key_groups"), Value::Array(groups)),
                (s("num_kv_readers"), Value::from(self.num_kv_readers)),
                (s("fetching_policy"), s(&self.fetching_policy)),
                (s("lock_mode"), tagged("PrefetchLockMode", s(&self.lock_mode))),
            ]),
        )
    }

    /// Reads one back.
    pub fn read(v: &Value) -> Result<Self, CodecError> {
        let what = "PrefetchTaskSpec";
        let v = untag(v, "PrefetchTaskSpec", what)?;
        let key_groups = list(field(v, "key_groups", what)?, "PrefetchTaskSpec.key_groups")?
            .iter()
            .map(|g| {
                let g = untag(g, "GroupedObjectKeys", "GroupedObjectKeys")?;
                Ok(KeyGroup {
                    keys: read_object_keys(
                        field(g, "keys", "GroupedObjectKeys")?,
                        "GroupedObjectKeys.keys",
                    )?,
                    object_group_id: map_get(g, "object_group_id")
                        .and_then(Value::as_u64)
                        .and_then(|x| u32::try_from(x).ok())
                        .unwrap_or(0),
                    layout: match map_get(g, "layout_desc") {
                        None | Some(Value::Nil) => None,
                        Some(l) => Some(LayoutDesc::read(l)?),
                    },
                    sliding_window_size: map_get(g, "sliding_window_size")
                        .and_then(Value::as_i64)
                        .unwrap_or(-1),
                })
            })
            .collect::<Result<Vec<_>, CodecError>>()?;
        let num_kv_readers = map_get(v, "num_kv_readers")
            .and_then(Value::as_u64)
            .and_then(|x| u32::try_from(x).ok())
            .unwrap_or(1);
        let fetching_policy =
            map_get(v, "fetching_policy").and_then(Value::as_str).unwrap_or("").to_owned();
        let lock_mode = match map_get(v, "lock_mode") {
            Some(m) => untag(m, "PrefetchLockMode", "PrefetchTaskSpec.lock_mode")?
                .as_str()
                .unwrap_or("")
                .to_owned(),
            None => String::new(),
        };
        Ok(Self { key_groups, num_kv_readers, fetching_policy, lock_mode })
    }
}

/// An args map from `(name, value)` pairs.
pub fn args(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}

/// A JSON value as msgpack (how an events batch, JSON on the wire, is recorded).
pub fn from_json(j: &serde_json::Value) -> Value {
    match j {
        serde_json::Value::Null => Value::Nil,
        serde_json::Value::Bool(b) => Value::Boolean(*b),
        serde_json::Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                Value::from(u)
            } else if let Some(i) = n.as_i64() {
                Value::from(i)
            } else {
                Value::F64(n.as_f64().unwrap_or(0.0))
            }
        }
        serde_json::Value::String(x) => s(x),
        serde_json::Value::Array(a) => Value::Array(a.iter().map(from_json).collect()),
        serde_json::Value::Object(o) => {
            Value::Map(o.iter().map(|(k, v)| (s(k), from_json(v))).collect())
        }
    }
}

/// Msgpack as JSON (an events batch read back, to post as it was recorded). Bytes become
/// arrays of numbers; non-string map keys are written as text.
pub fn to_json(v: &Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        Value::Nil => J::Null,
        Value::Boolean(b) => J::Bool(*b),
        Value::Integer(i) => {
            if let Some(u) = i.as_u64() {
                J::from(u)
            } else {
                J::from(i.as_i64().unwrap_or(0))
            }
        }
        Value::F32(f) => serde_json::Number::from_f64(f64::from(*f)).map_or(J::Null, J::Number),
        Value::F64(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
        Value::String(x) => J::String(x.as_str().unwrap_or("").to_owned()),
        Value::Binary(b) => J::Array(b.iter().map(|&x| J::from(x)).collect()),
        Value::Array(a) => J::Array(a.iter().map(to_json).collect()),
        Value::Map(m) => J::Object(
            m.iter()
                .map(|(k, v)| {
                    let key = k.as_str().map_or_else(|| k.to_string(), str::to_owned);
                    (key, to_json(v))
                })
                .collect(),
        ),
        Value::Ext(_, b) => J::Array(b.iter().map(|&x| J::from(x)).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8, salt: &str) -> ObjectKey {
        ObjectKey::new([b; 32], "m", 2, 1, 3, salt).unwrap()
    }

    #[test]
    fn object_keys_round_trip_with_and_without_a_salt() {
        for salt in ["", "tenant-a"] {
            let k = key(7, salt);
            assert_eq!(read_object_key(&object_key(&k)).unwrap(), k);
        }
        // LMCache's form has no salt field.
        let v = object_key(&key(1, ""));
        let inner = map_get(&v, "v").unwrap();
        assert!(map_get(inner, "cache_salt").is_none());
        assert_eq!(map_get(inner, "kv_rank").and_then(Value::as_u64), Some(0x0201_0201));
    }

    #[test]
    fn bad_keys_are_named() {
        let mut v = object_key(&key(1, ""));
        if let Value::Map(m) = &mut v
            && let Value::Map(inner) = &mut m[1].1
        {
            inner[0].1 = Value::Binary(vec![1, 2, 3]);
        }
        let e = read_object_key(&v).unwrap_err();
        assert_eq!(e.what, "ObjectKey.chunk_hash");
        let e = read_object_key(&tagged("Nope", Value::Nil)).unwrap_err();
        assert!(e.why.contains("Nope"), "{e}");
    }

    #[test]
    fn specs_and_layouts_round_trip() {
        let layout = LayoutDesc {
            shapes: vec![vec![2, 32, 256, 1024]],
            dtypes: vec!["torch.bfloat16".into()],
        };
        assert_eq!(layout.bytes(), Some(32 << 20));
        let spec = PrefetchSpec {
            key_groups: vec![KeyGroup {
                keys: vec![key(1, ""), key(2, "x")],
                object_group_id: 0,
                layout: Some(layout.clone()),
                sliding_window_size: -1,
            }],
            num_kv_readers: 2,
            fetching_policy: "prefix".into(),
            lock_mode: "LOCK_PREFIX".into(),
        };
        assert_eq!(PrefetchSpec::read(&spec.to_value()).unwrap(), spec);
        assert_eq!(LayoutDesc::read(&layout.to_value()).unwrap(), layout);
    }

    #[test]
    fn json_and_msgpack_convert_both_ways() {
        let j = serde_json::json!({"a": [1, -2, 2.5, "x", null, true], "b": {"c": 18446744073709551615u64}});
        assert_eq!(to_json(&from_json(&j)), j);
    }
}
