//! A client of LMCache's multiprocess protocol, speaking to `lmcache-rs server` or to
//! LMCache's own server over a ZMQ DEALER socket exactly as LMCache's Python client does:
//! frames `[uid, op, param...]`, replies matched by uid, the op frame checked.
//!
//! Synchronous: one call at a time per [`Client`]; use one client per thread for concurrency.
#![forbid(unsafe_code)]

use std::time::Duration;

use lmcache_protocol::value::{self, map};
use lmcache_protocol::{Op, ProtocolError};
use rmpv::Value;
use thiserror::Error;

/// Why a call failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ClientError {
    /// ZMQ failed.
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    /// No reply within the timeout.
    #[error("no reply to {op} within {timeout:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The timeout.
        timeout: Duration,
    },
    /// The reply could not be decoded or has the wrong shape.
    #[error("bad reply to {op}: {error}")]
    BadReply {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        error: ProtocolError,
    },
}

/// The key of a request range (`IPCCacheServerKey`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpec {
    /// Model name.
    pub model_name: String,
    /// Shards.
    pub world_size: u32,
    /// One shard, or `None` for all (lookups).
    pub worker_id: Option<u32>,
    /// The full token list.
    pub token_ids: Vec<u32>,
    /// Range start.
    pub start: usize,
    /// Range end.
    pub end: usize,
    /// Request id.
    pub request_id: String,
    /// Tenant.
    pub cache_salt: String,
    /// Readers per object.
    pub num_kv_readers: u32,
}

impl KeySpec {
    /// A key over all of `tokens`' whole chunks of `chunk_size`.
    pub fn whole(model: &str, request_id: &str, tokens: Vec<u32>, chunk_size: usize) -> Self {
        let end = tokens.len() / chunk_size * chunk_size;
        Self {
            model_name: model.to_owned(),
            world_size: 1,
            worker_id: None,
            token_ids: tokens,
            start: 0,
            end,
            request_id: request_id.to_owned(),
            cache_salt: String::new(),
            num_kv_readers: 1,
        }
    }

    /// The same key for one shard.
    pub fn for_worker(&self, worker_id: u32) -> Self {
        Self { worker_id: Some(worker_id), ..self.clone() }
    }

    /// The msgpack map, fields in LMCache's order.
    pub fn to_value(&self) -> Value {
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
}

/// A slot of the shared pool, as prepare_store/prepare_retrieve describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// Byte offset in the pool.
    pub offset: u64,
    /// Byte length.
    pub length: u64,
}

/// A connection to an MP server.
pub struct Client {
    _ctx: zmq::Context,
    sock: zmq::Socket,
    next_uid: u64,
    timeout: Duration,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("next_uid", &self.next_uid).finish()
    }
}

impl Client {
    /// Connects a DEALER to `endpoint` (`tcp://host:port` or `ipc://path`).
    pub fn connect(endpoint: &str, timeout: Duration) -> Result<Self, ClientError> {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::DEALER)?;
        sock.set_linger(0)?;
        sock.connect(endpoint)?;
        Ok(Self { _ctx: ctx, sock, next_uid: 0, timeout })
    }

    /// Sends raw frames (for tests of malformed input).
    pub fn send_frames(&self, frames: &[Vec<u8>]) -> Result<(), ClientError> {
        self.sock.send_multipart(frames, 0)?;
        Ok(())
    }

    /// Receives one raw reply, or `None` on timeout.
    pub fn recv_frames(&self) -> Result<Option<Vec<Vec<u8>>>, ClientError> {
        let ms = i64::try_from(self.timeout.as_millis()).unwrap_or(i64::MAX);
        if self.sock.poll(zmq::POLLIN, ms)? == 0 {
            return Ok(None);
        }
        Ok(Some(self.sock.recv_multipart(0)?))
    }

    /// Calls `op` with `params`; returns the payload (`None` for a void reply).
    pub fn call(&mut self, op: Op, params: &[Value]) -> Result<Option<Value>, ClientError> {
        let uid = self.next_uid;
        self.next_uid += 1;
        let op_value = op.id().map_or_else(|| Value::from(op.name()), Value::from);
        let mut frames = vec![value::encode(&Value::from(uid)), value::encode(&op_value)];
        frames.extend(params.iter().map(value::encode));
        self.sock.send_multipart(frames, 0)?;
        let bad = |error| ClientError::BadReply { op: op.name(), error };
        loop {
            let Some(reply) = self.recv_frames()? else {
                return Err(ClientError::Timeout { op: op.name(), timeout: self.timeout });
            };
            if reply.len() < 2 {
                return Err(bad(ProtocolError::TooFewFrames { expected: 2, got: reply.len() }));
            }
            let got = value::decode(0, &reply[0]).and_then(|v| value::u64_("uid", &v));
            if got.map_err(bad)? != uid {
                continue; // a late reply to an earlier, timed-out call
            }
            if reply[1] != value::encode(&op_value) {
                return Err(bad(ProtocolError::UnknownOp("reply names another operation".into())));
            }
            return match reply.get(2) {
                None => Ok(None),
                Some(p) => value::decode(2, p).map(Some).map_err(bad),
            };
        }
    }

    fn expect(&mut self, op: Op, params: &[Value]) -> Result<Value, ClientError> {
        self.call(op, params)?.ok_or(ClientError::BadReply {
            op: op.name(),
            error: ProtocolError::MissingField { field: "payload".into() },
        })
    }

    /// `get_chunk_size`.
    pub fn get_chunk_size(&mut self) -> Result<u64, ClientError> {
        let v = self.expect(Op::GetChunkSize, &[])?;
        value::u64_("chunk_size", &v)
            .map_err(|error| ClientError::BadReply { op: "get_chunk_size", error })
    }

    /// `ping`.
    pub fn ping(&mut self, instance_id: Option<u64>) -> Result<bool, ClientError> {
        let v = self.expect(Op::Ping, &[instance_id.map_or(Value::Nil, Value::from)])?;
        value::bool_("ping", &v).map_err(|error| ClientError::BadReply { op: "ping", error })
    }

    /// `lookup` (void), then `query_prefetch_status`: the hit count in chunks.
    pub fn lookup(&mut self, key: &KeySpec) -> Result<u64, ClientError> {
        self.call(Op::Lookup, &[key.to_value(), Value::from(1)])?;
        let v = self.expect(Op::QueryPrefetchStatus, &[Value::from(key.request_id.as_str())])?;
        value::u64_("hits", &v)
            .map_err(|error| ClientError::BadReply { op: "query_prefetch_status", error })
    }

    /// `end_session`.
    pub fn end_session(&mut self, request_id: &str) -> Result<(), ClientError> {
        self.call(Op::EndSession, &[Value::from(request_id)]).map(|_| ())
    }

    /// `register_kv_cache_engine_driven_context`: returns `(shm_name, pool_size)`.
    #[expect(clippy::too_many_arguments, reason = "mirrors the wire payload's fields")]
    pub fn register_engine_driven(
        &mut self,
        instance_id: u64,
        model: &str,
        world_size: u32,
        block_size: u64,
        num_layers: u64,
        hidden: u64,
        dtype: &str,
    ) -> Result<(String, u64), ClientError> {
        let payload = map(vec![
            ("instance_id", Value::from(instance_id)),
            ("model_name", Value::from(model)),
            ("world_size", Value::from(world_size)),
            ("block_size", Value::from(block_size)),
            ("num_layers", Value::from(num_layers)),
            ("hidden_dim_size", Value::from(hidden)),
            ("dtype_str", Value::from(dtype)),
            ("use_mla", Value::Boolean(false)),
            ("num_physical_slots", Value::Nil),
        ]);
        let v = self.expect(Op::RegisterKvCacheEngineDrivenContext, &[payload])?;
        let bad =
            |error| ClientError::BadReply { op: "register_kv_cache_engine_driven_context", error };
        let f = value::Fields::of("reply", &v).map_err(bad)?;
        let name = value::str_("shm_name", f.req("shm_name").map_err(bad)?).map_err(bad)?;
        let size = value::u64_("pool_size", f.req("pool_size").map_err(bad)?).map_err(bad)?;
        Ok((name.to_owned(), size))
    }

    /// `prepare_store`: the slots to fill, with their chunk indices in the range.
    pub fn prepare_store(
        &mut self,
        key: &KeySpec,
        instance_id: u64,
    ) -> Result<Vec<(u64, Slot)>, ClientError> {
        let v = self.expect(Op::PrepareStore, &[key.to_value(), Value::from(instance_id)])?;
        let bad = |error| ClientError::BadReply { op: "prepare_store", error };
        let ctx = value::Fields::of("reply", &v).and_then(|f| f.req("context")).map_err(bad)?;
        let ctx = value::Fields::of("context", ctx).map_err(bad)?;
        let Some(slots) = ctx.get("slots") else { return Ok(Vec::new()) };
        let slots = parse_slots(slots).map_err(bad)?;
        let idx =
            value::array("chunk_indices", ctx.req("chunk_indices").map_err(bad)?).map_err(bad)?;
        let idx: Vec<u64> = idx
            .iter()
            .map(|i| value::u64_("chunk_indices", i))
            .collect::<Result<_, _>>()
            .map_err(bad)?;
        Ok(idx.into_iter().zip(slots).collect())
    }

    /// `commit_store`.
    pub fn commit_store(&mut self, key: &KeySpec, instance_id: u64) -> Result<bool, ClientError> {
        let v = self.expect(
            Op::CommitStore,
            &[key.to_value(), Value::from(instance_id), Value::Binary(Vec::new())],
        )?;
        value::bool_("ok", &v).map_err(|error| ClientError::BadReply { op: "commit_store", error })
    }

    /// `prepare_retrieve`: `None` when not every chunk is available.
    pub fn prepare_retrieve(
        &mut self,
        key: &KeySpec,
        instance_id: u64,
    ) -> Result<Option<Vec<Slot>>, ClientError> {
        let v = self.expect(Op::PrepareRetrieve, &[key.to_value(), Value::from(instance_id)])?;
        let bad = |error| ClientError::BadReply { op: "prepare_retrieve", error };
        let f = value::Fields::of("reply", &v).map_err(bad)?;
        if !value::bool_("success", f.req("success").map_err(bad)?).map_err(bad)? {
            return Ok(None);
        }
        let ctx = value::Fields::of("context", f.req("context").map_err(bad)?).map_err(bad)?;
        parse_slots(ctx.req("slots").map_err(bad)?).map(Some).map_err(bad)
    }

    /// `commit_retrieve`.
    pub fn commit_retrieve(
        &mut self,
        key: &KeySpec,
        instance_id: u64,
    ) -> Result<bool, ClientError> {
        let v = self.expect(Op::CommitRetrieve, &[key.to_value(), Value::from(instance_id)])?;
        value::bool_("ok", &v)
            .map_err(|error| ClientError::BadReply { op: "commit_retrieve", error })
    }
}

fn parse_slots(v: &Value) -> Result<Vec<Slot>, ProtocolError> {
    value::array("slots", v)?
        .iter()
        .map(|s| {
            let f = value::Fields::of("slot", s)?;
            Ok(Slot {
                offset: value::u64_("offset", f.req("offset")?)?,
                length: value::u64_("length", f.req("length")?)?,
            })
        })
        .collect()
}
