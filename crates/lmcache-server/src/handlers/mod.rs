//! Request handlers: one module per operation family, and the dispatcher that turns a parsed
//! request into exactly one reply.
//!
//! A request that cannot be understood gets a typed failure wherever its response type has
//! one (`(b"", false)` for transfers, `false` for commits, `{success: false}` for
//! prepare_retrieve, zero hits for lookups), a void reply otherwise; it is logged with the
//! operation and the reason, and counted. It never goes unanswered and never stalls others.
//!
//! A handler that panics is caught here ([`guarded`]): the request gets its typed failure,
//! the panic is logged and counted (`lmcache_rs_mp_request_errors{kind="panic"}` and
//! `lmcache_rs_handler_panics`), and the worker thread keeps serving. Handlers hold their
//! resources as RAII handles (leases, reservations), so unwinding hands them back.
//!
//! A registration the server cannot serve is refused loudly ([`refuse_registration`]): the
//! reply type of `register_kv_cache` is void, so the worker cannot tell; the refusal is logged
//! as an error saying what to do, shown in `/status` (`refused_instances`, and so in
//! `lmcache describe kvcache`), counted, and every later operation of that worker fails naming
//! the reason.

mod blend;
mod engine_driven;
mod lmcache_driven;
mod lookup;
mod management;
mod p2p;

use std::panic::{AssertUnwindSafe, catch_unwind};

use lmcache_http::panic_message;
use lmcache_protocol::frame::{Header, ParseFailure};
use lmcache_protocol::request::Command;
use lmcache_protocol::types;
use lmcache_protocol::{Op, ProtocolError, Reply, Request};
use rmpv::Value;

use crate::metrics::Metrics;
use crate::registry::{Family, Refusal};
use crate::registry_file::Saved;
use crate::state::{RequestState, ServerState};

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

/// Handles one request and returns its reply: always one, even when something panics
/// outside the handler proper (metrics, spans, building the reply), since the uid is known.
pub fn handle(state: &ServerState, req: Request) -> Reply {
    let (header, value) = answer(state, req);
    framed(header, value)
}

/// A reply value in ZMQ frames (`None`: the void reply).
fn framed(header: Header, value: Option<Value>) -> Reply {
    match value {
        Some(v) => Reply::value(header, &v),
        None => Reply::void(header),
    }
}

/// Handles one request and returns its reply value (`None`: a void reply), whatever the
/// transport: the ZMQ one frames it ([`handle`]), the gRPC one writes it as the method's
/// response message. A failure is the operation's typed failure value, as in [`handle`].
pub fn answer(state: &ServerState, req: Request) -> (Header, Option<Value>) {
    let (op, header) = (req.op, req.header.clone());
    catch_unwind(AssertUnwindSafe(|| handle_inner(state, req))).unwrap_or_else(|payload| {
        let reason = panic_message(payload.as_ref());
        tracing::error!(op = op.name(), error = %reason, "request failed outside its handler");
        state.metrics.handler_panics.inc();
        state.metrics.error(op.name(), "panic");
        (header, failure_value(state, Some(op)))
    })
}

fn handle_inner(state: &ServerState, req: Request) -> (Header, Option<Value>) {
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
    let result = guarded(&state.metrics, op.name(), || {
        #[cfg(feature = "testing")]
        if *state.faults.panic_in_handler.lock() == Some(op.name()) {
            panic!("fault injected in the {} handler", op.name());
        }
        dispatch(state, &req)
    });
    state.metrics.observe(op.name(), started.elapsed().as_secs_f64());
    #[cfg(feature = "testing")]
    if *state.faults.panic_after_handler.lock() == Some(op.name()) {
        panic!("fault injected after the {} handler", op.name());
    }
    match result {
        Ok(v) => (header, v),
        Err(e) => {
            if matches!(e, ProtocolError::Internal { .. }) {
                tracing::error!(op = op.name(), error = %e, "handler failed");
            } else {
                tracing::warn!(op = op.name(), error = %e, "refused request");
            }
            state.metrics.error(op.name(), e.kind());
            state.bus.publish(crate::event_bus::Event::Refused { op: op.name(), kind: e.kind() });
            (header, failure_value(state, Some(op)))
        }
    }
}

/// Runs `f`, turning a panic into [`ProtocolError::Internal`] (counted in
/// `handler_panics`). What `f` held is dropped while unwinding, so leases and reservations go
/// back as they would on an error.
pub fn guarded<T>(
    metrics: &Metrics,
    op: &'static str,
    f: impl FnOnce() -> Result<T, ProtocolError>,
) -> Result<T, ProtocolError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        metrics.handler_panics.inc();
        Err(ProtocolError::Internal { op, reason: panic_message(payload.as_ref()) })
    })
}

/// Records that worker `id` registered something this server cannot serve: an error log
/// that says what to do, a refusal in the registry (shown in `/status`; later operations of
/// the worker fail with it), and a count.
pub(crate) fn refuse_registration(
    state: &RequestState,
    family: Family,
    id: u64,
    model: Option<String>,
    world_size: Option<u32>,
    error: &ProtocolError,
) {
    // Each refusal's reason says what to do (the error that made it carries the advice).
    let reason = format!("registration refused: {error}");
    tracing::error!(
        instance_id = id,
        transfer_mode = family.as_str(),
        model = model.as_deref().unwrap_or("?"),
        "{reason}; every store and retrieve of this worker fails until it registers again"
    );
    let at_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    state.registry.refuse(family, id, Refusal { model, world_size, reason, at_unix });
}

/// The error for an operation of a worker with no registration of `family` whose
/// registration was refused: the refusal's reason. `None` when it was never refused.
pub(crate) fn refused(state: &RequestState, family: Family, id: u64) -> Option<ProtocolError> {
    let r = state.registry.refusal(family, id)?;
    Some(ProtocolError::NotServable { instance_id: id, reason: r.reason })
}

/// The reply to a message that failed to parse.
pub fn handle_parse_failure(state: &ServerState, failure: ParseFailure) -> Option<Reply> {
    let op_name = failure.header.as_ref().and_then(|h| h.1).map_or("unknown", Op::name);
    tracing::warn!(op = op_name, error = %failure.error, "malformed message");
    state.metrics.error(op_name, failure.error.kind());
    let (header, op) = *failure.header?;
    Some(framed(header, failure_value(state, op)))
}

/// A field whose value a handler refuses, and why.
pub(super) fn bad(field: &str, reason: impl Into<String>) -> ProtocolError {
    ProtocolError::OutOfRange { field: field.to_owned(), reason: reason.into() }
}

/// The typed failure of `op`: a value of its response type that tells the client the
/// request did nothing (LMCache's clients drop a reply of the wrong type, then time out).
pub(crate) fn failure_value(state: &ServerState, op: Option<Op>) -> Option<Value> {
    let list = |v: Vec<Value>| Some(Value::Array(v));
    match op {
        Some(Op::Store | Op::Retrieve | Op::StoreQ | Op::CbRetrievePreComputed) => {
            Some(types::transfer_result(false))
        }
        Some(Op::CommitStore | Op::CommitRetrieve) => Some(Value::Boolean(false)),
        Some(Op::PrepareRetrieve) => Some(types::PrepareRetrieveResponse::FAILED.encode()),
        // An empty context makes the client fall back to a commit we then refuse.
        Some(Op::PrepareStore) => {
            Some(lmcache_protocol::value::map(vec![("context", Value::Map(Vec::new()))]))
        }
        Some(Op::QueryPrefetchStatus | Op::WaitPrefetchStatus) => Some(Value::from(0)),
        Some(Op::RegisterKvCacheEngineDrivenContext) => {
            Some(types::EngineDrivenRegistered { shm_name: String::new(), pool_size: 0 }.encode())
        }
        Some(Op::Ping) => Some(Value::Boolean(true)),
        // Parameterless queries answer whatever came with them.
        Some(Op::GetChunkSize) => Some(Value::from(state.chunk_size() as u64)),
        Some(Op::GetExperimental) => Some(management::capabilities(&state.requests)),
        Some(Op::Noop) => Some(Value::from("OK")),
        // CacheBlend is not served: a handshake that says "incompatible", an empty plan. A
        // P2P call that failed: a task id whose answer is nil (never issued: ids count up
        // from 0 and this one is the largest), and nil for its answer.
        Some(Op::CbProtocolHandshake) => list(vec![Value::from(0), Value::Boolean(false)]),
        Some(Op::CbReorderPlan) => list(Vec::new()),
        // Not the void reply: that one means "still loading, ask again".
        Some(Op::CbUnifiedLookup) => {
            Some(lmcache_protocol::types::blend::CbUnifiedLookupResult::default().encode())
        }
        Some(Op::P2pQueryLookupResults) => Some(Value::Nil),
        Some(Op::P2pLookupAndLock) => Some(Value::from(u64::MAX)),
        Some(Op::ServerModuleCall) => Some(lmcache_protocol::value::map(vec![
            ("success", Value::Boolean(false)),
            ("payload", Value::Binary(Vec::new())),
            ("error", Value::from("server modules are not supported by lmcache-rs")),
        ])),
        _ => None,
    }
}

/// Decodes the request once into its typed command, then hands it to its family's handler.
/// A registration that does not decode is refused loudly (logged, listed in `/status`) when
/// at least its sender's instance id could be read.
fn dispatch(state: &ServerState, req: &Request) -> Result<Option<Value>, ProtocolError> {
    let cmd = match Command::decode(req.op, &req.params) {
        Ok(c) => c,
        Err(e) => {
            if let Some((id, model, ws)) = Command::registration_identity(req.op, &req.params) {
                let family = match req.op {
                    Op::RegisterKvCache => Family::LmcacheDriven,
                    _ => Family::EngineDriven,
                };
                refuse_registration(state, family, id, model, ws, &e);
                state.metrics.refused_registrations.inc();
            }
            return Err(e);
        }
    };
    let registration =
        matches!(cmd, Command::RegisterKvCache(_) | Command::RegisterEngineDriven(_));
    // The family handlers get the request state only: storage, sessions, the registry.
    let requests: &RequestState = state;
    let result = family_handler(requests, cmd);
    if registration && result.is_err() {
        // Every failed registration was refused (and recorded) by its handler.
        state.metrics.refused_registrations.inc();
    }
    result
}

/// Takes back the registrations the previous process saved (a warm restart or a take-over;
/// see [`crate::registry_file`]), each through its family's handler with every check a new
/// registration gets. One that no longer applies is dropped and forgotten, refusal included,
/// so the worker's next ping tells it to register again. Returns (taken back, dropped).
pub fn replay_registrations(state: &ServerState, saved: Vec<Saved>) -> (usize, usize) {
    let (mut taken, mut dropped) = (0, 0);
    for s in saved {
        let why_not = replay_one(state, &s).err();
        match why_not {
            None => {
                tracing::info!(
                    instance_id = s.id,
                    transfer_mode = s.family.as_str(),
                    "took back a registration of the previous process"
                );
                taken += 1;
            }
            Some(reason) => {
                state.registry.unregister(s.family, s.id);
                tracing::warn!(
                    instance_id = s.id,
                    transfer_mode = s.family.as_str(),
                    %reason,
                    "dropped a registration of the previous process; the worker registers again after its next ping"
                );
                dropped += 1;
            }
        }
    }
    (taken, dropped)
}

fn replay_one(state: &ServerState, s: &Saved) -> Result<(), String> {
    if s.family == Family::EngineDriven {
        let now = state.l1().memory().arena().engine_segment().map(|g| (g.name.to_owned(), g.len));
        if now != s.segment {
            return Err(format!(
                "the worker mapped the pool {:?}; this server's is {now:?}",
                s.segment
            ));
        }
    }
    let op = s.family.register_op();
    let cmd = Command::decode(op, &s.params).map_err(|e| e.to_string())?;
    // The family's registration itself, not its handler: a registration that no longer
    // applies is dropped by the caller, not refused (a refusal would log that the worker
    // fails until it registers again, which it need not: its next ping asks it to).
    let requests: &RequestState = state;
    guarded(&state.metrics, op.name(), || match &cmd {
        Command::RegisterKvCache(r) => lmcache_driven::register(requests, r),
        Command::RegisterEngineDriven(r) => engine_driven::register(requests, r).map(|_| ()),
        _ => Err(ProtocolError::OutOfRange {
            field: "op".into(),
            reason: format!("{} is not a registration", op.name()),
        }),
    })
    .map_err(|e| e.to_string())
}

fn family_handler(state: &RequestState, cmd: Command) -> Result<Option<Value>, ProtocolError> {
    match cmd {
        Command::GetChunkSize
        | Command::GetExperimental
        | Command::Ping(_)
        | Command::Noop
        | Command::Clear(_)
        | Command::ReportBlockAllocation(_) => management::handle(state, cmd),
        Command::Lookup(_)
        | Command::QueryPrefetchStatus(_)
        | Command::WaitPrefetchStatus(_)
        | Command::FreeLookupLocks(_)
        | Command::EndSession(_) => lookup::handle(state, cmd),
        Command::RegisterEngineDriven(_)
        | Command::UnregisterEngineDriven(_)
        | Command::PrepareStore(_)
        | Command::CommitStore(_)
        | Command::PrepareRetrieve(_)
        | Command::CommitRetrieve(_) => engine_driven::handle(state, cmd),
        Command::RegisterKvCache(_)
        | Command::UnregisterKvCache(_)
        | Command::Store(_)
        | Command::Retrieve(_) => lmcache_driven::handle(state, cmd),
        Command::P2pLookupAndLock(_)
        | Command::P2pQueryLookupResults(_)
        | Command::P2pUnlockObjects(_) => p2p::handle(state, cmd),
        // Without the blend engine, the typed failure answers the handshake "incompatible"
        // and the plan empty, so LMCache's clients do not blend against this server.
        Command::CbProtocolHandshake(_)
        | Command::CbRegisterRope(_)
        | Command::CbUnregisterRope(_)
        | Command::CbUnifiedLookup(_)
        | Command::CbRetrievePreComputed(_)
        | Command::CbReorderPlan(_) => blend::handle(state, cmd),
        // Streams are served by the transport's socket thread, never here.
        Command::SubscribeKvEvents(_) => {
            Err(ProtocolError::UnsupportedOp(Op::SubscribeKvEvents.name()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_handler_becomes_a_counted_typed_failure() {
        let m = Metrics::default();
        let r: Result<(), _> = guarded(&m, "store", || panic!("boom {}", 42));
        assert_eq!(r, Err(ProtocolError::Internal { op: "store", reason: "boom 42".into() }));
        let r: Result<(), _> = guarded(&m, "store", || std::panic::panic_any(7u8));
        assert!(
            matches!(r, Err(ProtocolError::Internal { reason, .. }) if reason.contains("without"))
        );
        assert_eq!(m.handler_panics.get(), 2);
        assert_eq!(guarded(&m, "store", || Ok(5)), Ok(5));
        assert_eq!(m.handler_panics.get(), 2, "no panic, no count");
    }
}
