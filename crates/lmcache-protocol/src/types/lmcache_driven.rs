//! What an lmcache-driven worker registers (its KV tensors and KV groups) and the shapes
//! of its transfers (block ids, the transfer result).

use lmcache_core::Dtype;
use rmpv::Value;

use crate::error::ProtocolError;
use crate::value::{self, Fields, map};

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

pub(crate) fn u64_list(field: &str, v: &Value) -> Result<Vec<u64>, ProtocolError> {
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

/// `tuple[bytes, bool]` of store/retrieve: an empty event handle means "nothing pending".
pub fn transfer_result(ok: bool) -> Value {
    Value::Array(vec![Value::Binary(Vec::new()), Value::Boolean(ok)])
}

/// Block ids per KV group: `[[int]]`.
pub fn block_ids(field: &str, v: &Value) -> Result<Vec<Vec<u64>>, ProtocolError> {
    value::array(field, v)?
        .iter()
        .enumerate()
        .map(|(g, ids)| u64_list(&format!("{field}[{g}]"), ids))
        .collect()
}
