//! Request handlers: one module per operation family, and the dispatcher that turns a parsed
//! request into exactly one reply.
//!
//! A request that cannot be understood gets a typed failure wherever its response type has
//! one (`(b"", false)` for transfers, `false` for commits, `{success: false}` for
//! prepare_retrieve, zero hits for lookups), a void reply otherwise; it is logged with the
//! operation and the reason, and counted. It never goes unanswered and never stalls others.

mod engine_driven;
mod lmcache_driven;
mod lookup;
mod management;

use lmcache_protocol::frame::{Header, ParseFailure};
use lmcache_protocol::types;
use lmcache_protocol::{Op, ProtocolError, Reply, Request};
use rmpv::Value;

use crate::state::ServerState;

/// Where an operation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// On the socket thread (cheap, order-sensitive).
    Inline,
    /// On the lookup/management pool.
    Normal,
    /// On the transfer pool, pinned per client identity.
    Transfer,
}

/// The lane of an operation (LMCache's SYNC / BLOCKING / affinity split).
pub fn lane(op: Op) -> Lane {
    match op {
        // Cheap and bounded (a lookup is O(chunks): hashing plus one index probe per chunk),
        // so they skip two thread hand-offs per request. Transfers never run here.
        Op::GetChunkSize
        | Op::GetExperimental
        | Op::Noop
        | Op::Ping
        | Op::Lookup
        | Op::QueryPrefetchStatus
        | Op::FreeLookupLocks
        | Op::EndSession
        | Op::ReportBlockAllocation
        | Op::RegisterKvCacheEngineDrivenContext
        | Op::UnregisterKvCacheEngineDrivenContext
        | Op::UnregisterKvCache => Lane::Inline,
        Op::Store
        | Op::Retrieve
        | Op::PrepareStore
        | Op::CommitStore
        | Op::PrepareRetrieve
        | Op::CommitRetrieve
        // Registration maps client segments: keep it off the socket thread.
        | Op::RegisterKvCache => Lane::Transfer,
        _ => Lane::Normal,
    }
}

/// Handles one request and returns its reply.
pub fn handle(state: &ServerState, req: Request) -> Reply {
    let op = req.op;
    state.metrics.request(op.name());
    let header = req.header.clone();
    let started = std::time::Instant::now();
    // One span per request (exported with --otlp-endpoint); handlers record what they know.
    let span = tracing::info_span!(
        "mp_request",
        op = op.name(),
        uid = header.uid,
        request_id = tracing::field::Empty,
        chunks = tracing::field::Empty,
        hits = tracing::field::Empty,
        bytes = tracing::field::Empty,
    );
    let _entered = span.enter();
    let result = dispatch(state, &req);
    state.metrics.observe(op.name(), started.elapsed().as_secs_f64());
    match result {
        Ok(Some(v)) => Reply::value(header, &v),
        Ok(None) => Reply::void(header),
        Err(e) => {
            tracing::warn!(op = op.name(), error = %e, "refused request");
            state.metrics.error(op.name(), e.kind());
            state.bus.publish(crate::event_bus::Event::Refused { op: op.name(), kind: e.kind() });
            failure_reply(header, Some(op))
        }
    }
}

/// The reply to a message that failed to parse.
pub fn handle_parse_failure(state: &ServerState, failure: ParseFailure) -> Option<Reply> {
    let op_name = failure.header.as_ref().and_then(|h| h.1).map_or("unknown", Op::name);
    tracing::warn!(op = op_name, error = %failure.error, "malformed message");
    state.metrics.error(op_name, failure.error.kind());
    let (header, op) = *failure.header?;
    Some(failure_reply(header, op))
}

/// The typed failure of `op`.
fn failure_reply(header: Header, op: Option<Op>) -> Reply {
    let v = match op {
        Some(Op::Store | Op::Retrieve | Op::StoreQ | Op::CbRetrievePreComputed) => {
            Some(types::transfer_result(false))
        }
        Some(Op::CommitStore | Op::CommitRetrieve) => Some(Value::Boolean(false)),
        Some(Op::PrepareRetrieve) => Some(types::PrepareRetrieveResponse::FAILED.encode()),
        // An empty context makes the client fall back to a commit we then refuse.
        Some(Op::PrepareStore) => {
            Some(lmcache_protocol::value::map(vec![("context", Value::Map(Vec::new()))]))
        }
        Some(Op::QueryPrefetchStatus) => Some(Value::from(0)),
        Some(Op::RegisterKvCacheEngineDrivenContext) => {
            Some(types::EngineDrivenRegistered { shm_name: String::new(), pool_size: 0 }.encode())
        }
        Some(Op::Ping) => Some(Value::Boolean(true)),
        _ => None,
    };
    match v {
        Some(v) => Reply::value(header, &v),
        None => Reply::void(header),
    }
}

fn dispatch(state: &ServerState, req: &Request) -> Result<Option<Value>, ProtocolError> {
    match req.op {
        Op::GetChunkSize
        | Op::GetExperimental
        | Op::Ping
        | Op::Noop
        | Op::Clear
        | Op::ReportBlockAllocation => management::handle(state, req),
        Op::Lookup
        | Op::QueryPrefetchStatus
        | Op::WaitPrefetchStatus
        | Op::FreeLookupLocks
        | Op::EndSession => lookup::handle(state, req),
        Op::RegisterKvCacheEngineDrivenContext
        | Op::UnregisterKvCacheEngineDrivenContext
        | Op::PrepareStore
        | Op::CommitStore
        | Op::PrepareRetrieve
        | Op::CommitRetrieve => engine_driven::handle(state, req),
        Op::RegisterKvCache | Op::UnregisterKvCache | Op::Store | Op::Retrieve => {
            lmcache_driven::handle(state, req)
        }
        other => Err(ProtocolError::UnsupportedOp(other.name())),
    }
}
