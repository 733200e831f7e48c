//! Payload types of LMCache 0.5.6's MP protocol (`custom_types.py`, `ipc_wire.py`): decoders
//! that check every field, and encoders that produce exactly the maps msgspec expects.

use lmcache_core::hashing::tokens_from_i64;
use lmcache_core::{CacheSalt, Dtype, KvRank, ModelName};
use rmpv::Value;

use crate::error::ProtocolError;
use crate::value::{self, Fields, map};

/// `IPCCacheServerKey`: which tokens of which request, for which model and shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheKey {
    /// The model.
    pub model_name: ModelName,
    /// Shards of the KV.
    pub world_size: u32,
    /// One shard, or `None` for "every shard" (scheduler-side calls).
    pub worker_id: Option<u32>,
    /// The request's full token list.
    pub token_ids: Vec<u32>,
    /// First token of the range the call is about.
    pub start: usize,
    /// End of the range (exclusive).
    pub end: usize,
    /// The request.
    pub request_id: String,
    /// The tenant.
    pub cache_salt: CacheSalt,
    /// Workers that will read each object (read locks taken per hit).
    pub num_kv_readers: u32,
}

impl CacheKey {
    /// Decodes and validates a key. `end` beyond the token list, `start > end`, a worker id
    /// outside the world, or a bad name or salt are refused with the field named.
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let f = Fields::of(field, v)?;
        let model = value::str_(&f.path("model_name"), f.req("model_name")?)?;
        let model_name = ModelName::new(model).map_err(|e| ProtocolError::OutOfRange {
            field: f.path("model_name"),
            reason: e.to_string(),
        })?;
        let world_size = value::u32_(&f.path("world_size"), f.req("world_size")?)?;
        let worker_id = value::opt(f.req("worker_id")?, |v| value::u32_(&f.path("worker_id"), v))?;
        KvRank::new(world_size, worker_id.unwrap_or(0)).map_err(|e| ProtocolError::OutOfRange {
            field: f.path("world_size"),
            reason: e.to_string(),
        })?;
        let raw = value::array(&f.path("token_ids"), f.req("token_ids")?)?;
        let mut token_ids = Vec::with_capacity(raw.len());
        for (i, t) in raw.iter().enumerate() {
            // Fast path without building a field path; the error path names the position.
            match t.as_u64().and_then(|x| u32::try_from(x).ok()) {
                Some(x) => token_ids.push(x),
                None => {
                    let field = format!("{}[{i}]", f.path("token_ids"));
                    let v = value::int(&field, t)?;
                    return Err(tokens_from_i64(&[v]).err().map_or_else(
                        || ProtocolError::OutOfRange {
                            field: field.clone(),
                            reason: "invalid".into(),
                        },
                        |e| ProtocolError::OutOfRange {
                            field: f.path("token_ids"),
                            reason: format!("{e} (index {i})"),
                        },
                    ));
                }
            }
        }
        let start = value::u64_(&f.path("start"), f.req("start")?)? as usize;
        let end = value::u64_(&f.path("end"), f.req("end")?)? as usize;
        if start > end || end > token_ids.len() {
            return Err(ProtocolError::OutOfRange {
                field: f.path("end"),
                reason: format!(
                    "range [{start}, {end}) is not within the {} tokens",
                    token_ids.len()
                ),
            });
        }
        let request_id = value::str_(&f.path("request_id"), f.req("request_id")?)?.to_owned();
        let cache_salt = match f.get("cache_salt") {
            None | Some(Value::Nil) => CacheSalt::EMPTY,
            Some(v) => {
                let s = value::str_(&f.path("cache_salt"), v)?;
                CacheSalt::new(s).map_err(|e| ProtocolError::OutOfRange {
                    field: f.path("cache_salt"),
                    reason: e.to_string(),
                })?
            }
        };
        let num_kv_readers = match f.get("num_kv_readers") {
            None => 0,
            Some(v) => value::u32_(&f.path("num_kv_readers"), v)?,
        };
        Ok(Self {
            model_name,
            world_size,
            worker_id,
            token_ids,
            start,
            end,
            request_id,
            cache_salt,
            num_kv_readers,
        })
    }

    /// A key over every whole chunk of `tokens` (`chunk_size` tokens each), all shards, one
    /// reader, no salt: what a scheduler-side lookup sends.
    pub fn whole(
        model_name: ModelName,
        request_id: &str,
        tokens: Vec<u32>,
        chunk_size: usize,
    ) -> Self {
        let end = tokens.len() / chunk_size.max(1) * chunk_size.max(1);
        Self {
            model_name,
            world_size: 1,
            worker_id: None,
            token_ids: tokens,
            start: 0,
            end,
            request_id: request_id.to_owned(),
            cache_salt: CacheSalt::EMPTY,
            num_kv_readers: 1,
        }
    }

    /// The same key for one shard (worker-side calls).
    pub fn for_worker(&self, worker_id: u32) -> Self {
        Self { worker_id: Some(worker_id), ..self.clone() }
    }

    /// The msgpack map LMCache's client sends, fields in its order (`request_configs` nil).
    /// [`Self::decode`] of it gives back `self`.
    pub fn encode(&self) -> Value {
        map(vec![
            ("model_name", Value::from(self.model_name.as_str())),
            ("world_size", Value::from(self.world_size)),
            ("worker_id", self.worker_id.map_or(Value::Nil, Value::from)),
            ("token_ids", Value::Array(self.token_ids.iter().map(|&t| Value::from(t)).collect())),
            ("start", Value::from(self.start as u64)),
            ("end", Value::from(self.end as u64)),
            ("request_id", Value::from(self.request_id.as_str())),
            ("cache_salt", Value::from(self.cache_salt.as_str())),
            ("request_configs", Value::Nil),
            ("num_kv_readers", Value::from(self.num_kv_readers)),
        ])
    }

    /// Identity as the Python server compares keys: everything but `request_id`,
    /// `request_configs` and `num_kv_readers`.
    pub fn same_identity(&self, other: &CacheKey) -> bool {
        self.model_name == other.model_name
            && self.world_size == other.world_size
            && self.worker_id == other.worker_id
            && self.start == other.start
            && self.end == other.end
            && self.cache_salt == other.cache_salt
            && self.token_ids == other.token_ids
    }
}

/// Element layout of one tensor (`ipc_wire.py` metadata).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: Dtype,
    /// Shape in elements.
    pub shape: Vec<u64>,
    /// Strides in elements.
    pub stride: Vec<u64>,
    /// Offset of the first element, in elements.
    pub storage_offset: u64,
    /// Device identity (`"cpu"` for shared memory).
    pub device_uuid: String,
}

/// A tensor shared through IPC (`DeviceIPCWrapper`, msgpack ext type 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IpcDescriptor {
    /// A POSIX shared-memory segment.
    CpuShm {
        /// Segment name (a leading `/` is allowed).
        shm_name: String,
        /// Bytes to map.
        nbytes: u64,
        /// The tensor's view of it.
        meta: TensorMeta,
    },
    /// A device memory handle (CUDA and others): needs a GPU backend.
    Device {
        /// The descriptor's `type` tag.
        kind: String,
    },
}

fn u64_list(field: &str, v: &Value) -> Result<Vec<u64>, ProtocolError> {
    value::array(field, v)?
        .iter()
        .enumerate()
        .map(|(i, x)| match x.as_u64() {
            Some(n) => Ok(n),
            None => value::u64_(&format!("{field}[{i}]"), x),
        })
        .collect()
}

impl IpcDescriptor {
    /// Decodes an ext-type-1 descriptor.
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let Value::Ext(1, data) = v else {
            return Err(ProtocolError::WrongType {
                field: field.to_owned(),
                expected: "ext type 1 (DeviceIPCWrapper)",
                got: value::type_name(v),
            });
        };
        let inner = value::decode(0, data).map_err(|e| ProtocolError::WrongType {
            field: field.to_owned(),
            expected: "msgpack descriptor inside ext 1",
            got: e.to_string(),
        })?;
        let f = Fields::of(field, &inner)?;
        let kind = value::str_(&f.path("type"), f.req("type")?)?;
        if kind != "cpu_shm" {
            return Ok(Self::Device { kind: kind.to_owned() });
        }
        let shm_name = value::str_(&f.path("shm_name"), f.req("shm_name")?)?.to_owned();
        let nbytes = value::u64_(&f.path("nbytes"), f.req("nbytes")?)?;
        let mpath = f.path("metadata");
        let m = Fields::of(&mpath, f.req("metadata")?)?;
        let dtype_name = value::str_(&m.path("dtype"), m.req("dtype")?)?;
        let dtype = dtype_name.parse::<Dtype>().map_err(|e| ProtocolError::OutOfRange {
            field: m.path("dtype"),
            reason: e.to_string(),
        })?;
        let meta = TensorMeta {
            dtype,
            shape: u64_list(&m.path("shape"), m.req("shape")?)?,
            stride: u64_list(&m.path("stride"), m.req("stride")?)?,
            storage_offset: value::u64_(&m.path("storage_offset"), m.req("storage_offset")?)?,
            device_uuid: match m.get("device_uuid") {
                Some(v) => value::str_(&m.path("device_uuid"), v)?.to_owned(),
                None => "cpu".into(),
            },
        };
        if meta.shape.len() != meta.stride.len() {
            return Err(ProtocolError::OutOfRange {
                field: mpath,
                reason: format!("{} dims but {} strides", meta.shape.len(), meta.stride.len()),
            });
        }
        Ok(Self::CpuShm { shm_name, nbytes, meta })
    }

    /// The ext-type-1 value LMCache's client sends; [`Self::decode`] of it gives back `self`.
    pub fn encode(&self) -> Value {
        let list = |v: &[u64]| Value::Array(v.iter().map(|&x| Value::from(x)).collect());
        let inner = match self {
            Self::CpuShm { shm_name, nbytes, meta } => map(vec![
                ("type", Value::from("cpu_shm")),
                ("shm_name", Value::from(shm_name.as_str())),
                ("nbytes", Value::from(*nbytes)),
                ("version", Value::from(1)),
                (
                    "metadata",
                    map(vec![
                        ("dtype", Value::from(meta.dtype.as_str())),
                        ("shape", list(&meta.shape)),
                        ("stride", list(&meta.stride)),
                        ("storage_offset", Value::from(meta.storage_offset)),
                        ("device_uuid", Value::from(meta.device_uuid.as_str())),
                    ]),
                ),
            ]),
            Self::Device { kind } => map(vec![("type", Value::from(kind.as_str()))]),
        };
        Value::Ext(1, value::encode(&inner))
    }
}

/// `EngineGroupInfo`: one LMCache KV group of a hybrid model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineGroupInfo {
    /// Engine group id.
    pub engine_group_id: i64,
    /// Layers of the group.
    pub layer_indices: Vec<u64>,
    /// Tokens per engine block.
    pub tokens_per_block: u64,
    /// Sliding window in tokens, -1 for full attention.
    pub sw_size_tokens: i64,
    /// Connector-private extra object group tag (0: a regular group).
    pub extra_object_group_tag: i64,
    /// The group's pages hold recurrent state (Mamba, linear attention), not attention KV.
    pub recurrent_state: bool,
}

impl EngineGroupInfo {
    /// A plain full-attention group over `layer_indices`.
    pub fn full(engine_group_id: i64, layer_indices: Vec<u64>, tokens_per_block: u64) -> Self {
        Self {
            engine_group_id,
            layer_indices,
            tokens_per_block,
            sw_size_tokens: -1,
            extra_object_group_tag: 0,
            recurrent_state: false,
        }
    }

    /// The map LMCache's client sends; [`Self::decode`] of it gives back `self`.
    pub fn encode(&self) -> Value {
        map(vec![
            ("engine_group_id", Value::from(self.engine_group_id)),
            (
                "layer_indices",
                Value::Array(self.layer_indices.iter().map(|&x| Value::from(x)).collect()),
            ),
            ("tokens_per_block", Value::from(self.tokens_per_block)),
            ("sw_size_tokens", Value::from(self.sw_size_tokens)),
            ("extra_object_group_tag", Value::from(self.extra_object_group_tag)),
            ("recurrent_state", Value::from(self.recurrent_state)),
        ])
    }

    /// Decodes one group (defaults as msgspec's for absent fields).
    pub fn decode(field: &str, v: &Value) -> Result<Self, ProtocolError> {
        let f = Fields::of(field, v)?;
        Ok(Self {
            engine_group_id: value::int(&f.path("engine_group_id"), f.req("engine_group_id")?)?,
            layer_indices: match f.get("layer_indices") {
                Some(v) => u64_list(&f.path("layer_indices"), v)?,
                None => Vec::new(),
            },
            tokens_per_block: match f.get("tokens_per_block") {
                Some(v) => value::u64_(&f.path("tokens_per_block"), v)?,
                None => 0,
            },
            sw_size_tokens: match f.get("sw_size_tokens") {
                Some(v) => value::int(&f.path("sw_size_tokens"), v)?,
                None => -1,
            },
            extra_object_group_tag: match f.get("extra_object_group_tag") {
                Some(v) => value::int(&f.path("extra_object_group_tag"), v)?,
                None => 0,
            },
            recurrent_state: match f.get("recurrent_state") {
                Some(v) => value::bool_(&f.path("recurrent_state"), v)?,
                None => false,
            },
        })
    }
}

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

/// `tuple[bytes, bool]` of store/retrieve: an empty event handle means "nothing pending".
pub fn transfer_result(ok: bool) -> Value {
    Value::Array(vec![Value::Binary(Vec::new()), Value::Boolean(ok)])
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

/// Block ids per KV group: `[[int]]`.
pub fn block_ids(field: &str, v: &Value) -> Result<Vec<Vec<u64>>, ProtocolError> {
    value::array(field, v)?
        .iter()
        .enumerate()
        .map(|(g, ids)| u64_list(&format!("{field}[{g}]"), ids))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The verified example of lmcache-mp-protocol.md section 3.1, assembled piece by piece:
    /// `8a aa"model_name" a1"m" aa"world_size" 01 a9"worker_id" 00 a9"token_ids" 93 01 02 03
    /// a5"start" 00 a3"end" cd0100 aa"request_id" a5"req-1" aa"cache_salt" a0
    /// af"request_configs" c0 ae"num_kv_readers" 01`.
    fn lmcache_key_bytes() -> Vec<u8> {
        fn s(out: &mut Vec<u8>, text: &str) {
            out.push(0xa0 | text.len() as u8);
            out.extend_from_slice(text.as_bytes());
        }
        let mut b = vec![0x8a];
        s(&mut b, "model_name");
        s(&mut b, "m");
        s(&mut b, "world_size");
        b.push(0x01);
        s(&mut b, "worker_id");
        b.push(0x00);
        s(&mut b, "token_ids");
        b.extend_from_slice(&[0x93, 0x01, 0x02, 0x03]);
        s(&mut b, "start");
        b.push(0x00);
        s(&mut b, "end");
        b.extend_from_slice(&[0xcd, 0x01, 0x00]);
        s(&mut b, "request_id");
        s(&mut b, "req-1");
        s(&mut b, "cache_salt");
        b.push(0xa0);
        s(&mut b, "request_configs");
        b.push(0xc0);
        s(&mut b, "num_kv_readers");
        b.push(0x01);
        assert_eq!(b[1], 0xaa, "aa = fixstr of 10");
        b
    }

    #[test]
    fn key_decodes_lmcache_bytes_but_checks_the_range() {
        // The documented key has end=256 with 3 tokens: a client bug that LMCache raises on.
        let v = value::decode(2, &lmcache_key_bytes()).unwrap();
        let e = CacheKey::decode("key", &v).unwrap_err();
        assert!(e.to_string().contains("key.end"), "{e}");
        // The same key with a valid range.
        let mut v = v;
        if let Value::Map(m) = &mut v {
            for (k, val) in m.iter_mut() {
                if k.as_str() == Some("end") {
                    *val = Value::from(3);
                }
            }
        }
        let k = CacheKey::decode("key", &v).unwrap();
        assert_eq!(k.model_name.as_str(), "m");
        assert_eq!((k.world_size, k.worker_id), (1, Some(0)));
        assert_eq!(k.token_ids, vec![1, 2, 3]);
        assert_eq!((k.start, k.end), (0, 3));
        assert_eq!(k.request_id, "req-1");
        assert!(k.cache_salt.is_empty());
        assert_eq!(k.num_kv_readers, 1);
    }

    fn key_map(fields: Vec<(&str, Value)>) -> Value {
        let mut base = vec![
            ("model_name", Value::from("m")),
            ("world_size", Value::from(2)),
            ("worker_id", Value::Nil),
            ("token_ids", Value::Array(vec![Value::from(1); 4])),
            ("start", Value::from(0)),
            ("end", Value::from(4)),
            ("request_id", Value::from("r")),
            ("cache_salt", Value::from("")),
            ("request_configs", Value::Nil),
            ("num_kv_readers", Value::from(1)),
        ];
        for (k, v) in fields {
            base.iter_mut().find(|(n, _)| *n == k).unwrap().1 = v;
        }
        map(base)
    }

    #[test]
    fn key_fields_are_validated_by_name() {
        let cases = [
            (vec![("worker_id", Value::from(2))], "key.world_size"),
            (vec![("world_size", Value::from(0))], "key.world_size"),
            (vec![("model_name", Value::from("a@b"))], "key.model_name"),
            (vec![("cache_salt", Value::from("x/y"))], "key.cache_salt"),
            (vec![("token_ids", Value::Array(vec![Value::from(-5)]))], "key.token_ids"),
            (vec![("start", Value::from(3)), ("end", Value::from(2))], "key.end"),
            (vec![("world_size", Value::from(true))], "key.world_size"),
            (vec![("request_id", Value::Binary(b"r".to_vec()))], "key.request_id"),
        ];
        for (fields, want) in cases {
            let e = CacheKey::decode("key", &key_map(fields.clone())).unwrap_err();
            assert!(e.to_string().starts_with(want), "{fields:?}: {e}");
        }
        let ok = CacheKey::decode("key", &key_map(vec![])).unwrap();
        assert_eq!(ok.worker_id, None);
        let other = CacheKey::decode("key", &key_map(vec![("request_id", Value::from("z"))]));
        assert!(ok.same_identity(&other.unwrap()), "request_id must not affect identity");
    }

    #[test]
    fn cpu_shm_descriptor_round_trip() {
        let meta = map(vec![
            ("dtype", Value::from("float16")),
            ("shape", Value::Array(vec![Value::from(2), Value::from(8)])),
            ("stride", Value::Array(vec![Value::from(8), Value::from(1)])),
            ("storage_offset", Value::from(0)),
            ("device_uuid", Value::from("cpu")),
        ]);
        let d = map(vec![
            ("type", Value::from("cpu_shm")),
            ("shm_name", Value::from("/lmcache_kv_1_0")),
            ("nbytes", Value::from(32)),
            ("version", Value::from(1)),
            ("metadata", meta),
        ]);
        let ext = Value::Ext(1, value::encode(&d));
        let IpcDescriptor::CpuShm { shm_name, nbytes, meta } =
            IpcDescriptor::decode("kv_cache[0]", &ext).unwrap()
        else {
            panic!("not cpu_shm")
        };
        assert_eq!((shm_name.as_str(), nbytes), ("/lmcache_kv_1_0", 32));
        assert_eq!(meta.dtype, Dtype::Float16);
        let cuda = Value::Ext(1, value::encode(&map(vec![("type", Value::from("cuda"))])));
        assert_eq!(
            IpcDescriptor::decode("x", &cuda).unwrap(),
            IpcDescriptor::Device { kind: "cuda".into() }
        );
        let back = IpcDescriptor::CpuShm { shm_name, nbytes, meta };
        assert_eq!(IpcDescriptor::decode("x", &back.encode()).unwrap(), back);
        assert_eq!(ext, back.encode(), "encodes the documented map, field for field");
        let g = EngineGroupInfo {
            engine_group_id: 1,
            layer_indices: vec![0, 2],
            tokens_per_block: 16,
            sw_size_tokens: 512,
            extra_object_group_tag: 0,
            recurrent_state: true,
        };
        assert_eq!(EngineGroupInfo::decode("g", &g.encode()).unwrap(), g);
        // Fields an older client leaves out take msgspec's defaults.
        let old = map(vec![("engine_group_id", Value::from(0))]);
        assert_eq!(
            EngineGroupInfo::decode("g", &old).unwrap(),
            EngineGroupInfo::full(0, vec![], 0)
        );
        assert!(IpcDescriptor::decode("x", &Value::Ext(2, vec![])).is_err());
        assert!(IpcDescriptor::decode("x", &Value::Ext(1, vec![0xc1])).is_err());
    }

    /// Appendix A: `(b"", True)` is `92 c4 00 c3`.
    #[test]
    fn transfer_result_bytes() {
        assert_eq!(value::encode(&transfer_result(true)), vec![0x92, 0xc4, 0x00, 0xc3]);
    }

    #[test]
    fn encoders_write_lmcache_bytes_and_decoders_read_them_back() {
        // The documented key, byte for byte (end = 256 over 3 tokens is what the reference
        // example carries; encoding does not judge it, decoding does).
        let k = CacheKey {
            model_name: ModelName::new("m").unwrap(),
            world_size: 1,
            worker_id: Some(0),
            token_ids: vec![1, 2, 3],
            start: 0,
            end: 256,
            request_id: "req-1".into(),
            cache_salt: CacheSalt::EMPTY,
            num_kv_readers: 1,
        };
        assert_eq!(value::encode(&k.encode()), lmcache_key_bytes());
        let ok = CacheKey { end: 3, ..k };
        assert_eq!(CacheKey::decode("key", &ok.encode()).unwrap(), ok);
        let whole = CacheKey::whole(ModelName::new("m").unwrap(), "r", (0..40).collect(), 16);
        assert_eq!((whole.end, whole.worker_id), (32, None));
        assert_eq!(
            CacheKey::decode("key", &whole.for_worker(0).encode()).unwrap().worker_id,
            Some(0)
        );

        let reg = EngineDrivenRegistration {
            instance_id: 7,
            model_name: ModelName::new("org/model").unwrap(),
            world_size: 2,
            block_size: 16,
            num_layers: 4,
            hidden_dim_size: 1024,
            dtype: Dtype::BFloat16,
            use_mla: false,
            num_physical_slots: Some(256),
        };
        assert_eq!(EngineDrivenRegistration::decode("p", &reg.encode()).unwrap(), reg);
        let r = EngineDrivenRegistered { shm_name: "/pool".into(), pool_size: 1 << 30 };
        assert_eq!(EngineDrivenRegistered::decode("r", &r.encode()).unwrap(), r);

        let slot = |offset| SlotDesc {
            offset,
            length: 4096,
            shape: vec![2, 2, 16, 32],
            dtype: Dtype::Float16,
        };
        let store =
            PrepareStoreResponse { slots: vec![slot(0), slot(4096)], chunk_indices: vec![0, 2] };
        assert_eq!(PrepareStoreResponse::decode("r", &store.encode()).unwrap(), store);
        let empty = map(vec![("context", Value::Map(Vec::new()))]);
        assert_eq!(
            PrepareStoreResponse::decode("r", &empty).unwrap(),
            PrepareStoreResponse::default()
        );
        let retrieve = PrepareRetrieveResponse { success: true, slots: vec![slot(8192)] };
        assert_eq!(PrepareRetrieveResponse::decode("r", &retrieve.encode()).unwrap(), retrieve);
        let failed = PrepareRetrieveResponse::FAILED.encode();
        assert_eq!(
            PrepareRetrieveResponse::decode("r", &failed).unwrap(),
            PrepareRetrieveResponse::FAILED
        );
    }

    #[test]
    fn a_reply_cannot_describe_more_memory_than_its_tensor() {
        let mut big =
            SlotDesc { offset: 0, length: 4096, shape: vec![2, 2, 16, 32], dtype: Dtype::Float16 }
                .to_value();
        if let Value::Map(m) = &mut big {
            m[1].1 = Value::from(1u64 << 40);
        }
        let e = SlotDesc::decode("slots[0]", &big).unwrap_err();
        assert!(e.to_string().contains("slots[0].length"), "{e}");
        let unpaired = PrepareStoreResponse {
            slots: vec![SlotDesc { offset: 0, length: 2, shape: vec![1], dtype: Dtype::Float16 }],
            chunk_indices: vec![],
        };
        let e = PrepareStoreResponse::decode("r", &unpaired.encode()).unwrap_err();
        assert!(e.to_string().contains("chunk_indices"), "{e}");
    }
}
