//! A client of LMCache's multiprocess protocol, speaking to `lmcache-rs server` or to
//! LMCache's own server over a ZMQ DEALER socket exactly as LMCache's Python client does:
//! frames `[uid, op, param...]`, replies matched by uid, the op frame checked.
//!
//! Synchronous: one call at a time per [`Client`]; use one client per thread for concurrency.
#![forbid(unsafe_code)]

use std::time::Duration;

use lmcache_protocol::request::{
    Command, CommitStore, KeyAndInstance, Lookup, Ping, RegisterKvCache, WaitPrefetchStatus,
};
pub use lmcache_protocol::request::{Retrieve, Store};
use lmcache_protocol::types::{PrepareRetrieveResponse, PrepareStoreResponse};
use lmcache_protocol::value;
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

pub use lmcache_protocol::types::{
    CacheKey, EngineDrivenRegistered, EngineDrivenRegistration, EngineGroupInfo, IpcDescriptor,
    SlotDesc, TensorMeta,
};

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
        self.recv_frames_within(self.timeout)
    }

    /// Receives one raw reply, or `None` if none arrives within `wait`.
    pub fn recv_frames_within(&self, wait: Duration) -> Result<Option<Vec<Vec<u8>>>, ClientError> {
        let ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
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

    /// Sends one typed request (its shape is the protocol crate's, the one the server
    /// decodes); returns the payload (`None` for a void reply).
    pub fn send(&mut self, cmd: &Command) -> Result<Option<Value>, ClientError> {
        let (op, params) = cmd.encode();
        self.call(op, &params)
    }

    fn expect(&mut self, cmd: &Command) -> Result<Value, ClientError> {
        let op = cmd.encode().0;
        self.send(cmd)?.ok_or(ClientError::BadReply {
            op: op.name(),
            error: ProtocolError::MissingField { field: "payload".into() },
        })
    }

    /// A transfer's reply `[event_handle, ok]`: its success flag.
    fn transfer_ok(op: &'static str, v: Option<Value>) -> Result<bool, ClientError> {
        let bad = |error| ClientError::BadReply { op, error };
        let v = v.ok_or_else(|| bad(ProtocolError::MissingField { field: "payload".into() }))?;
        let items = value::array("reply", &v).map_err(bad)?;
        match items.get(1) {
            Some(ok) => value::bool_("ok", ok).map_err(bad),
            None => Err(bad(ProtocolError::MissingField { field: "reply[1]".into() })),
        }
    }

    /// `store` (lmcache-driven): whether the server stored every chunk.
    pub fn store(&mut self, req: Store) -> Result<bool, ClientError> {
        let v = self.send(&Command::Store(req))?;
        Self::transfer_ok("store", v)
    }

    /// `retrieve` (lmcache-driven): whether the server wrote every chunk.
    pub fn retrieve(&mut self, req: Retrieve) -> Result<bool, ClientError> {
        let v = self.send(&Command::Retrieve(req))?;
        Self::transfer_ok("retrieve", v)
    }

    /// `get_chunk_size`.
    pub fn get_chunk_size(&mut self) -> Result<u64, ClientError> {
        let v = self.expect(&Command::GetChunkSize)?;
        value::u64_("chunk_size", &v)
            .map_err(|error| ClientError::BadReply { op: "get_chunk_size", error })
    }

    /// `ping`.
    pub fn ping(&mut self, instance_id: Option<u64>) -> Result<bool, ClientError> {
        let v = self.expect(&Command::Ping(Ping { instance_id }))?;
        value::bool_("ping", &v).map_err(|error| ClientError::BadReply { op: "ping", error })
    }

    /// `lookup` (void), then `query_prefetch_status`: the hit count in chunks. While an L2
    /// prefetch runs the status is nil; the client then waits on it (`wait_prefetch_status`)
    /// until it settles or the call timeout passes.
    pub fn lookup(&mut self, key: &CacheKey) -> Result<u64, ClientError> {
        const OP: &str = "query_prefetch_status";
        self.send(&Command::Lookup(Lookup { key: key.clone(), tp_size: Value::from(1) }))?;
        let id = key.request_id.clone();
        let hits = |v: &Value| {
            value::u64_("hits", v).map_err(|error| ClientError::BadReply { op: OP, error })
        };
        match self.send(&Command::QueryPrefetchStatus(id.clone()))? {
            Some(Value::Nil) | None => {}
            Some(v) => return hits(&v),
        }
        let deadline = std::time::Instant::now() + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(ClientError::Timeout { op: OP, timeout: self.timeout });
            }
            // Leave the reply time to arrive within this call's own timeout.
            let timeout = (left.as_secs_f64() * 0.8).max(0.001);
            let wait = WaitPrefetchStatus { request_id: id.clone(), timeout };
            match self.send(&Command::WaitPrefetchStatus(wait))? {
                Some(Value::Nil) | None => {}
                Some(v) => return hits(&v),
            }
        }
    }

    /// `end_session`.
    pub fn end_session(&mut self, request_id: &str) -> Result<(), ClientError> {
        self.send(&Command::EndSession(request_id.to_owned())).map(|_| ())
    }

    /// `register_kv_cache` (lmcache-driven): one descriptor per layer tensor, in layer order.
    /// The reply is void whether or not the server accepted it (LMCache's contract); a
    /// refusal shows in the server's `/status`.
    pub fn register_kv_cache(
        &mut self,
        instance_id: u64,
        kv_cache: &[IpcDescriptor],
        model_name: &str,
        world_size: u32,
        engine_group_infos: &[EngineGroupInfo],
    ) -> Result<(), ClientError> {
        self.send(&Command::RegisterKvCache(RegisterKvCache {
            instance_id,
            kv_cache: kv_cache.to_vec(),
            model_name: model_name.to_owned(),
            world_size,
            engine_type: "vllm".into(),
            extra: Value::Map(Vec::new()),
            engine_group_infos: engine_group_infos.to_vec(),
        }))
        .map(|_| ())
    }

    /// `register_kv_cache_engine_driven_context`: returns the pool to map.
    pub fn register_engine_driven(
        &mut self,
        registration: &EngineDrivenRegistration,
    ) -> Result<EngineDrivenRegistered, ClientError> {
        const OP: &str = "register_kv_cache_engine_driven_context";
        let v = self.expect(&Command::RegisterEngineDriven(registration.clone()))?;
        EngineDrivenRegistered::decode("reply", &v)
            .map_err(|error| ClientError::BadReply { op: OP, error })
    }

    /// `prepare_store`: the slots to fill, with their chunk indices in the range.
    pub fn prepare_store(
        &mut self,
        key: &CacheKey,
        instance_id: u64,
    ) -> Result<Vec<(u64, SlotDesc)>, ClientError> {
        let v =
            self.expect(&Command::PrepareStore(KeyAndInstance { key: key.clone(), instance_id }))?;
        let r = PrepareStoreResponse::decode("reply", &v)
            .map_err(|error| ClientError::BadReply { op: "prepare_store", error })?;
        Ok(r.chunk_indices.into_iter().zip(r.slots).collect())
    }

    /// `commit_store`.
    pub fn commit_store(&mut self, key: &CacheKey, instance_id: u64) -> Result<bool, ClientError> {
        let commit = CommitStore { key: key.clone(), instance_id, data: Vec::new() };
        let v = self.expect(&Command::CommitStore(commit))?;
        value::bool_("ok", &v).map_err(|error| ClientError::BadReply { op: "commit_store", error })
    }

    /// `prepare_retrieve`: `None` when not every chunk is available.
    pub fn prepare_retrieve(
        &mut self,
        key: &CacheKey,
        instance_id: u64,
    ) -> Result<Option<Vec<SlotDesc>>, ClientError> {
        let k = KeyAndInstance { key: key.clone(), instance_id };
        let v = self.expect(&Command::PrepareRetrieve(k))?;
        let r = PrepareRetrieveResponse::decode("reply", &v)
            .map_err(|error| ClientError::BadReply { op: "prepare_retrieve", error })?;
        Ok(r.success.then_some(r.slots))
    }

    /// `commit_retrieve`.
    pub fn commit_retrieve(
        &mut self,
        key: &CacheKey,
        instance_id: u64,
    ) -> Result<bool, ClientError> {
        let k = KeyAndInstance { key: key.clone(), instance_id };
        let v = self.expect(&Command::CommitRetrieve(k))?;
        value::bool_("ok", &v)
            .map_err(|error| ClientError::BadReply { op: "commit_retrieve", error })
    }
}
