//! `lookup`, `wait_prefetch_status` and `free_lookup_locks` (`query_prefetch_status` and
//! `end_session` carry a request id alone).

use rmpv::Value;

use super::expect;
use crate::error::ProtocolError;
use crate::op::Op;
use crate::types::CacheKey;
use crate::value;

/// `lookup(key, tp_size)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Lookup {
    /// The prompt's whole chunks (`worker_id` nil: every shard).
    pub key: CacheKey,
    /// LMCache's legacy `tp_size`, ignored (kept as sent).
    pub tp_size: Value,
}

impl Lookup {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::Lookup, params, 2)?;
        Ok(Self { key: CacheKey::decode("key", &params[0])?, tp_size: params[1].clone() })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![self.key.encode(), self.tp_size.clone()]
    }
}

/// `wait_prefetch_status(request_id, timeout)`.
#[derive(Debug, Clone, PartialEq)]
pub struct WaitPrefetchStatus {
    /// The lookup's request.
    pub request_id: String,
    /// Seconds to wait at most (any float may arrive: NaN, infinities).
    pub timeout: f64,
}

impl WaitPrefetchStatus {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::WaitPrefetchStatus, params, 2)?;
        Ok(Self {
            request_id: value::str_("request_id", &params[0])?.to_owned(),
            timeout: value::float("timeout", &params[1])?,
        })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![Value::from(self.request_id.as_str()), Value::F64(self.timeout)]
    }
}

/// `free_lookup_locks(key, tp_size)`.
#[derive(Debug, Clone, PartialEq)]
pub struct FreeLookupLocks {
    /// The chunks `[start, end)` whose locks go.
    pub key: CacheKey,
    /// LMCache's legacy `tp_size`, ignored (kept as sent).
    pub tp_size: Value,
}

impl FreeLookupLocks {
    /// From the request's parameters.
    pub fn decode(params: &[Value]) -> Result<Self, ProtocolError> {
        expect(Op::FreeLookupLocks, params, 2)?;
        Ok(Self { key: CacheKey::decode("key", &params[0])?, tp_size: params[1].clone() })
    }

    /// The parameters.
    pub fn encode(&self) -> Vec<Value> {
        vec![self.key.encode(), self.tp_size.clone()]
    }
}
