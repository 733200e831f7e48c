//! The engine-driven registration and its transfers' replies (slots in the shared pool).

use lmcache_core::{Dtype, KvRank, ModelName};
use rmpv::Value;

use super::lmcache_driven::u64_list;
use crate::error::ProtocolError;
use crate::value::{self, Fields, map};

/// `RegisterEngineDrivenContextPayload`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineDrivenRegistration {
    /// The worker's handle.
    pub instance_id: u64,
    /// The model.
    pub model_name: ModelName,
    /// Shards.
    pub world_size: u32,
    /// Tokens per engine block.
    pub block_size: u64,
    /// Layers.
    pub num_layers: u64,
    /// Heads x head size.
    pub hidden_dim_size: u64,
    /// Element type.
    pub dtype: Dtype,
    /// MLA layout `[L, S, H]` instead of `[2, L, S, H]`.
    pub use_mla: bool,
    /// Token slots per object (`None`: the chunk size).
    pub num_physical_slots: Option<u64>,
}

impl EngineDrivenRegistration {
    /// Decodes and validates.
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let f = Fields::of(field, v)?;
        let model = value::str_(&f.path("model_name"), f.req("model_name")?)?;
        let dtype_name = value::str_(&f.path("dtype_str"), f.req("dtype_str")?)?;
        let world_size = value::u32_(&f.path("world_size"), f.req("world_size")?)?;
        KvRank::new(world_size, 0).map_err(|e| ProtocolError::OutOfRange {
            field: f.path("world_size"),
            reason: e.to_string(),
        })?;
        let r = Self {
            instance_id: value::u64_(&f.path("instance_id"), f.req("instance_id")?)?,
            model_name: ModelName::new(model).map_err(|e| ProtocolError::OutOfRange {
                field: f.path("model_name"),
                reason: e.to_string(),
            })?,
            world_size,
            block_size: value::u64_(&f.path("block_size"), f.req("block_size")?)?,
            num_layers: value::u64_(&f.path("num_layers"), f.req("num_layers")?)?,
            hidden_dim_size: value::u64_(&f.path("hidden_dim_size"), f.req("hidden_dim_size")?)?,
            dtype: dtype_name.parse().map_err(|e: lmcache_core::layout::UnknownDtype| {
                ProtocolError::OutOfRange { field: f.path("dtype_str"), reason: e.to_string() }
            })?,
            use_mla: value::bool_(&f.path("use_mla"), f.req("use_mla")?)?,
            num_physical_slots: match f.get("num_physical_slots") {
                Some(v) => value::opt(v, |v| value::u64_(&f.path("num_physical_slots"), v))?,
                None => None,
            },
        };
        for (name, n) in [("num_layers", r.num_layers), ("hidden_dim_size", r.hidden_dim_size)] {
            if n == 0 || n > 1 << 24 {
                return Err(ProtocolError::OutOfRange {
                    field: f.path(name),
                    reason: format!("{n} is outside 1..=16777216"),
                });
            }
        }
        Ok(r)
    }

    /// The payload LMCache's client sends. [`Self::decode`] of it gives back `self`.
    pub fn encode(&self) -> Value {
        map(vec![
            ("instance_id", Value::from(self.instance_id)),
            ("model_name", Value::from(self.model_name.as_str())),
            ("world_size", Value::from(self.world_size)),
            ("block_size", Value::from(self.block_size)),
            ("num_layers", Value::from(self.num_layers)),
            ("hidden_dim_size", Value::from(self.hidden_dim_size)),
            ("dtype_str", Value::from(self.dtype.as_str())),
            ("use_mla", Value::Boolean(self.use_mla)),
            ("num_physical_slots", self.num_physical_slots.map_or(Value::Nil, Value::from)),
        ])
    }
}

/// Where one chunk's object lives in the shared pool (engine-driven SHM mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotDesc {
    /// Byte offset in the pool.
    pub offset: u64,
    /// Byte length (= product of `shape` x itemsize).
    pub length: u64,
    /// Tensor shape of the object.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: Dtype,
}

impl SlotDesc {
    /// The `{offset, length, shape, dtype}` map.
    pub fn to_value(&self) -> Value {
        map(vec![
            ("offset", Value::from(self.offset)),
            ("length", Value::from(self.length)),
            ("shape", Value::Array(self.shape.iter().map(|&d| Value::from(d)).collect())),
            ("dtype", Value::from(self.dtype.as_str())),
        ])
    }

    /// Decodes one slot (a client reading a prepare reply). `length` must be the shape's
    /// bytes, so a reply cannot describe more memory than its tensor.
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let f = Fields::of(field, v)?;
        let dtype_name = value::str_(&f.path("dtype"), f.req("dtype")?)?;
        let s = Self {
            offset: value::u64_(&f.path("offset"), f.req("offset")?)?,
            length: value::u64_(&f.path("length"), f.req("length")?)?,
            shape: u64_list(&f.path("shape"), f.req("shape")?)?,
            dtype: dtype_name.parse().map_err(|e: lmcache_core::layout::UnknownDtype| {
                ProtocolError::OutOfRange { field: f.path("dtype"), reason: e.to_string() }
            })?,
        };
        let bytes = s.shape.iter().try_fold(s.dtype.itemsize(), |acc, &d| acc.checked_mul(d));
        if bytes != Some(s.length) || s.offset.checked_add(s.length).is_none() {
            return Err(ProtocolError::OutOfRange {
                field: f.path("length"),
                reason: format!(
                    "{} bytes at offset {} for shape {:?} of {}",
                    s.length,
                    s.offset,
                    s.shape,
                    s.dtype.as_str()
                ),
            });
        }
        Ok(s)
    }
}

fn slots(field: &str, v: &Value) -> Result<Vec<SlotDesc>, ProtocolError> {
    value::array(field, v)?
        .iter()
        .enumerate()
        .map(|(i, s)| SlotDesc::decode(&format!("{field}[{i}]"), s))
        .collect()
}

/// `RegisterEngineDrivenContextResponse`: the shared pool the engine maps (empty name and 0
/// when there is none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineDrivenRegistered {
    /// POSIX shared-memory name of the pool.
    pub shm_name: String,
    /// Its size in bytes.
    pub pool_size: u64,
}

impl EngineDrivenRegistered {
    /// The reply map.
    pub fn encode(&self) -> Value {
        map(vec![
            ("shm_name", Value::from(self.shm_name.as_str())),
            ("pool_size", Value::from(self.pool_size)),
        ])
    }

    /// Decodes a reply.
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let f = Fields::of(field, v)?;
        Ok(Self {
            shm_name: value::str_(&f.path("shm_name"), f.req("shm_name")?)?.to_owned(),
            pool_size: value::u64_(&f.path("pool_size"), f.req("pool_size")?)?,
        })
    }
}

/// `PrepareStoreResponse`: a slot for each chunk to write, with its index in the range.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrepareStoreResponse {
    /// Where to write.
    pub slots: Vec<SlotDesc>,
    /// Which chunk of the range each slot is.
    pub chunk_indices: Vec<u64>,
}

impl PrepareStoreResponse {
    /// The reply map (`{"context": {"slots", "chunk_indices"}}`).
    pub fn encode(&self) -> Value {
        let context = map(vec![
            ("slots", Value::Array(self.slots.iter().map(SlotDesc::to_value).collect())),
            (
                "chunk_indices",
                Value::Array(self.chunk_indices.iter().map(|&i| Value::from(i)).collect()),
            ),
        ]);
        map(vec![("context", context)])
    }

    /// Decodes a reply; a context without slots is an empty response. Slots and indices
    /// must pair up.
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let f = Fields::of(field, v)?;
        let path = f.path("context");
        let ctx = Fields::of(&path, f.req("context")?)?;
        let Some(s) = ctx.get("slots") else { return Ok(Self::default()) };
        let r = Self {
            slots: slots(&ctx.path("slots"), s)?,
            chunk_indices: u64_list(&ctx.path("chunk_indices"), ctx.req("chunk_indices")?)?,
        };
        if r.slots.len() != r.chunk_indices.len() {
            return Err(ProtocolError::OutOfRange {
                field: ctx.path("chunk_indices"),
                reason: format!("{} indices for {} slots", r.chunk_indices.len(), r.slots.len()),
            });
        }
        Ok(r)
    }
}

/// `PrepareRetrieveResponse`: the slots to read, or `success: false`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrepareRetrieveResponse {
    /// Whether every chunk of the range is available.
    pub success: bool,
    /// Where to read, one slot per chunk (empty unless `success`).
    pub slots: Vec<SlotDesc>,
}

impl PrepareRetrieveResponse {
    /// The failure reply.
    pub const FAILED: Self = Self { success: false, slots: Vec::new() };

    /// The reply map.
    pub fn encode(&self) -> Value {
        let context = if self.success {
            map(vec![("slots", Value::Array(self.slots.iter().map(SlotDesc::to_value).collect()))])
        } else {
            Value::Map(Vec::new())
        };
        map(vec![
            ("success", Value::Boolean(self.success)),
            ("data", Value::Binary(Vec::new())),
            ("context", context),
        ])
    }

    /// Decodes a reply.
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let f = Fields::of(field, v)?;
        let success = value::bool_(&f.path("success"), f.req("success")?)?;
        if !success {
            return Ok(Self::FAILED);
        }
        let path = f.path("context");
        let ctx = Fields::of(&path, f.req("context")?)?;
        Ok(Self { success, slots: slots(&ctx.path("slots"), ctx.req("slots")?)? })
    }
}
