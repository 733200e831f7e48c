//! `IPCCacheServerKey`: the key every transfer and lookup carries.

use lmcache_core::hashing::tokens_from_i64;
use lmcache_core::{CacheSalt, KvRank, ModelName};
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
