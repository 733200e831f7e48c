//! The engine-driven transfers: `prepare_store`, `commit_store`, `prepare_retrieve`,
//! `commit_retrieve` (the registration's payload is
//! [`EngineDrivenRegistration`](crate::types::EngineDrivenRegistration)).

use rmpv::Value;

use super::expect;
use crate::error::ProtocolError;
use crate::op::Op;
use crate::types::CacheKey;
use crate::value;

/// `(key, instance_id)`: `prepare_store`, `prepare_retrieve`, `commit_retrieve`.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyAndInstance {
    /// One worker's chunks.
    pub key: CacheKey,
    /// The registered worker.
    pub instance_id: u64,
}

impl KeyAndInstance {
    /// From the parameters of `op`.
    pub fn decode(op: Op, params: &[Value]) -> Result<Self, ProtocolError> {
        expect(op, params, 2)?;
        Ok(Self {
            key: CacheKey::decode("key", &params[0])?,
            instance_id: value::u64_("instance_id", &params[1])?,
        })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![self.key.encode(), Value::from(self.instance_id)]
    }
}

/// `commit_store(key, instance_id, data)`.
#[derive(Debug, Clone, PartialEq)]
pub struct CommitStore {
    /// One worker's chunks.
    pub key: CacheKey,
    /// The registered worker.
    pub instance_id: u64,
    /// Pickle mode's bytes (empty when the client copied into the shared pool).
    pub data: Vec<u8>,
}

impl CommitStore {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::CommitStore, params, 3)?;
        Ok(Self {
            key: CacheKey::decode("key", &params[0])?,
            instance_id: value::u64_("instance_id", &params[1])?,
            data: value::bin("data", &params[2])?.to_vec(),
        })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![self.key.encode(), Value::from(self.instance_id), Value::Binary(self.data.clone())]
    }
}
