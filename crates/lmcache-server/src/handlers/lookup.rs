//! lookup, query_prefetch_status, wait_prefetch_status, free_lookup_locks, end_session.
//!
//! A lookup hashes the prompt's whole chunks, finds the longest prefix resident in L1 on every
//! shard, and read-locks those objects `num_kv_readers` times (the locks live in the request's
//! session). With no L2, or when L1 holds the whole prompt, it is complete before its reply.
//! Otherwise an L2 prefetch of the remaining chunks starts, and the session holds its handle
//! ([`LookupState::Pending`]); `query_prefetch_status` answers nil until it ends, then joins
//! its leases to the lookup's and answers the L1 and L2 hits together, exactly once.
//! `wait_prefetch_status` blocks on the prefetch itself (bounded), not on a polling loop.

use lmcache_protocol::ProtocolError;
use lmcache_protocol::request::{Command, FreeLookupLocks, WaitPrefetchStatus};
use lmcache_protocol::types::CacheKey;
use rmpv::Value;

use std::time::Duration;

use lmcache_storage::{GroupLookupRequest, StorageEvent};

use crate::session::LookupState;
use crate::state::RequestState;

pub(super) fn handle(state: &RequestState, cmd: Command) -> Result<Option<Value>, ProtocolError> {
    match cmd {
        Command::Lookup(l) => {
            lookup(state, &l.key)?;
            Ok(None)
        }
        Command::QueryPrefetchStatus(id) => Ok(Some(take_hits(state, &id))),
        Command::WaitPrefetchStatus(WaitPrefetchStatus { request_id, timeout }) => {
            let id = request_id.as_str();
            // NaN (any f64 may arrive) waits not at all; +inf waits the longest we allow.
            let secs = if timeout.is_nan() { 0.0 } else { timeout.clamp(0.0, 60.0) };
            let limit = Duration::from_secs_f64(secs);
            // Wait on the prefetch itself, without holding the sessions' lock.
            let waiter = state.sessions.with_existing(id, |s| match &s.lookup {
                LookupState::Active { lookup, .. } => lookup.waiter(),
                LookupState::Idle => None,
            });
            if let Some(Some(w)) = waiter {
                w.wait(limit);
            }
            Ok(Some(take_hits(state, id)))
        }
        Command::FreeLookupLocks(FreeLookupLocks { key, .. }) => {
            let c = state.chunk_size();
            let range = key.start / c..key.end / c;
            if !range.is_empty() {
                state.with_settled(&key.request_id, |s| {
                    // LMCache ignores the call while the prefetch runs; so do we.
                    if !s.lookup.is_pending()
                        && let Some(l) = s.lookup.leases_mut()
                    {
                        l.release_all(range);
                    }
                });
            }
            Ok(None)
        }
        Command::EndSession(request_id) => {
            let id = request_id.as_str();
            if let Some(session) = state.sessions.remove(id) {
                state.storage.end_session(id, &session.touched);
            }
            Ok(None)
        }
        other => Err(ProtocolError::UnsupportedOp(other.encode().0.name())),
    }
}

/// The hit count of the request's last lookup, exactly once; nil while its prefetch runs; 0
/// afterwards or if unknown.
pub(super) fn take_hits(state: &RequestState, request_id: &str) -> Value {
    let hits = state.with_settled(request_id, |s| match &mut s.lookup {
        LookupState::Active { answered: true, .. } | LookupState::Idle => Some(0),
        LookupState::Active { lookup, answered, .. } => {
            let h = lookup.hits();
            *answered = h.is_some();
            h
        }
    });
    match hits {
        None => Value::from(0u64),
        Some(h) => h.map_or(Value::Nil, |n| Value::from(n as u64)),
    }
}

pub(super) fn lookup(state: &RequestState, key: &CacheKey) -> Result<(), ProtocolError> {
    let readers = key.num_kv_readers;
    if readers == 0 {
        // LMCache raises here and never replies; we reply, with zero hits.
        state.sessions.with(&key.request_id, |s| s.lookup = LookupState::Idle);
        return Err(ProtocolError::OutOfRange {
            field: "key.num_kv_readers".into(),
            reason: "must be at least 1".into(),
        });
    }
    let chunks = key.end / state.chunk_size();
    let span = tracing::Span::current();
    span.record("request_id", key.request_id.as_str());
    span.record("chunks", chunks);
    state.storage.announce(&StorageEvent::LookupAsked { request_id: &key.request_id, chunks });
    if chunks == 0 || !state.registry.has_model(&key.model_name, key.world_size) {
        // Old locks go; nothing to answer but 0.
        state.sessions.with(&key.request_id, |s| s.lookup = LookupState::Idle);
        return Ok(());
    }
    let shards: Vec<u32> = match key.worker_id {
        Some(w) => vec![w],
        None => (0..key.world_size).collect(),
    };
    let readers = readers.min(state.l1().config().max_read_locks);
    let objects = state.registry.objects(&key.model_name, key.world_size);
    state.sessions.with(&key.request_id, |s| -> Result<(), ProtocolError> {
        let hashes = s.chunk_hashes(&key.token_ids, chunks);
        // Old locks go first: a repeated lookup replaces them (and abandons any prefetch it
        // started: dropping it releases that prefetch's leases when it ends).
        s.lookup = LookupState::Idle;
        // One row of keys per (object group, shard): object group 0's are what a retrieve
        // spends; a hybrid model's other groups hold the cells its windows need.
        let groups = objects.len().max(1);
        let mut req = GroupLookupRequest {
            groups: Vec::with_capacity(groups),
            world_size: key.world_size,
            readers,
        };
        let mut touched = Vec::with_capacity(groups * shards.len() * hashes.len());
        for og in 0..groups {
            let mut rows = Vec::with_capacity(shards.len());
            for &w in &shards {
                let keys = state.object_keys(key, w, &hashes, og as u32)?;
                touched.extend(keys.iter().cloned());
                rows.push((w, keys));
            }
            let window = objects.get(og).and_then(|o| o.window_chunks).map(|w| w as usize);
            req.groups.push((window, rows));
        }
        let shard = key.worker_id.unwrap_or(0);
        let ctx = state.context(key, shard, 0, &hashes, None, &objects);
        let lookup = state.storage.scope(&ctx).lookup(&req);
        s.touched = touched;
        tracing::Span::current().record("hits", lookup.l1_hit());
        s.lookup = LookupState::Active {
            lookup,
            chunks,
            answered: false,
            model: key.model_name.clone(),
            shard,
            hashes,
        };
        Ok(())
    })
}
