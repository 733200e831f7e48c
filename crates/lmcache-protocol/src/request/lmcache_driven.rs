//! The lmcache-driven transfers: `register_kv_cache`, `store`, `retrieve` (the server maps the
//! client's KV tensors and copies itself).

use rmpv::Value;

use super::expect;
use crate::error::ProtocolError;
use crate::op::Op;
use crate::types::{self, CacheKey, EngineGroupInfo, IpcDescriptor};
use crate::value;

/// `register_kv_cache(instance_id, kv_cache, model_name, world_size, engine_type, extra,
/// engine_group_infos)`.
#[derive(Debug, Clone, PartialEq)]
pub struct RegisterKvCache {
    /// The worker.
    pub instance_id: u64,
    /// One descriptor per layer tensor, in layer order.
    pub kv_cache: Vec<IpcDescriptor>,
    /// The model.
    pub model_name: String,
    /// Tensor-parallel world size.
    pub world_size: u32,
    /// The engine (`"vllm"`).
    pub engine_type: String,
    /// LMCache's sixth parameter, unused (kept as sent).
    pub extra: Value,
    /// The engine's KV groups.
    pub engine_group_infos: Vec<EngineGroupInfo>,
}

impl RegisterKvCache {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::RegisterKvCache, params, 7)?;
        let kv_cache = value::array("kv_cache", &params[1])?
            .iter()
            .enumerate()
            .map(|(i, d)| IpcDescriptor::decode(&format!("kv_cache[{i}]"), d))
            .collect::<Result<_, _>>()?;
        let engine_group_infos = value::array("engine_group_infos", &params[6])?
            .iter()
            .enumerate()
            .map(|(i, g)| EngineGroupInfo::decode(&format!("engine_group_infos[{i}]"), g))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            instance_id: value::u64_("instance_id", &params[0])?,
            kv_cache,
            model_name: value::str_("model_name", &params[2])?.to_owned(),
            world_size: value::u32_("world_size", &params[3])?,
            engine_type: value::str_("engine_type", &params[4])?.to_owned(),
            extra: params[5].clone(),
            engine_group_infos,
        })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![
            Value::from(self.instance_id),
            Value::Array(self.kv_cache.iter().map(IpcDescriptor::encode).collect()),
            Value::from(self.model_name.as_str()),
            Value::from(self.world_size),
            Value::from(self.engine_type.as_str()),
            self.extra.clone(),
            Value::Array(self.engine_group_infos.iter().map(EngineGroupInfo::encode).collect()),
        ]
    }
}

/// Block-id lists as sent (one list per KV group).
pub(super) fn blocks(block_ids: &[Vec<u64>]) -> Value {
    Value::Array(
        block_ids
            .iter()
            .map(|l| Value::Array(l.iter().map(|&b| Value::from(b)).collect()))
            .collect(),
    )
}

/// `store(key, instance_id, block_ids, event_ipc_handle)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Store {
    /// One worker's chunks.
    pub key: CacheKey,
    /// The registered worker.
    pub instance_id: u64,
    /// The paged blocks of each KV group, in order.
    pub block_ids: Vec<Vec<u64>>,
    /// A CUDA event's handle (empty on the CPU).
    pub event_ipc_handle: Vec<u8>,
}

impl Store {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::Store, params, 4)?;
        Ok(Self {
            key: CacheKey::decode("key", &params[0])?,
            instance_id: value::u64_("instance_id", &params[1])?,
            block_ids: types::block_ids("block_ids", &params[2])?,
            event_ipc_handle: value::bin("event_ipc_handle", &params[3])?.to_vec(),
        })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![
            self.key.encode(),
            Value::from(self.instance_id),
            blocks(&self.block_ids),
            Value::Binary(self.event_ipc_handle.clone()),
        ]
    }
}

/// `retrieve(key, instance_id, block_ids, event_ipc_handle, skip_first_n_tokens)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Retrieve {
    /// One worker's chunks.
    pub key: CacheKey,
    /// The registered worker.
    pub instance_id: u64,
    /// The paged blocks of each KV group, in order.
    pub block_ids: Vec<Vec<u64>>,
    /// A CUDA event's handle (empty on the CPU).
    pub event_ipc_handle: Vec<u8>,
    /// Leading tokens not to write (the engine's own prefix cache holds them).
    pub skip_first_n_tokens: u64,
}

impl Retrieve {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::Retrieve, params, 5)?;
        Ok(Self {
            key: CacheKey::decode("key", &params[0])?,
            instance_id: value::u64_("instance_id", &params[1])?,
            block_ids: types::block_ids("block_ids", &params[2])?,
            event_ipc_handle: value::bin("event_ipc_handle", &params[3])?.to_vec(),
            skip_first_n_tokens: value::u64_("skip_first_n_tokens", &params[4])?,
        })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![
            self.key.encode(),
            Value::from(self.instance_id),
            blocks(&self.block_ids),
            Value::Binary(self.event_ipc_handle.clone()),
            Value::from(self.skip_first_n_tokens),
        ]
    }
}
