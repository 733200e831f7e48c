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

use lmcache_storage::LookupRequest;

use crate::session::LookupState;
use crate::state::ServerState;

pub(super) fn handle(state: &ServerState, cmd: Command) -> Result<Option<Value>, ProtocolError> {
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
                state.storage.touch(&session.touched);
                if let Some(r) = &state.reporter {
                    r.l1_accessed(&session.touched);
                }
                drop(session);
                state
                    .bus
                    .publish(crate::event_bus::Event::SessionEnded { request_id: id.to_owned() });
            }
            Ok(None)
        }
        other => Err(ProtocolError::UnsupportedOp(other.encode().0.name())),
    }
}

/// The hit count of the request's last lookup, exactly once; nil while its prefetch runs; 0
/// afterwards or if unknown.
fn take_hits(state: &ServerState, request_id: &str) -> Value {
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

fn lookup(state: &ServerState, key: &CacheKey) -> Result<(), ProtocolError> {
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
    state.metrics.lookups.inc();
    state.metrics.lookup_requested_tokens.inc_by((chunks * state.chunk_size()) as u64);
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
    state.sessions.with(&key.request_id, |s| -> Result<(), ProtocolError> {
        let hashes = s.chunk_hashes(&key.token_ids, chunks);
        if let Some(log) = &state.lookup_log {
            log_lookup(state, log, key, &hashes);
        }
        // Old locks go first: a repeated lookup replaces them (and abandons any prefetch it
        // started: dropping it releases that prefetch's leases when it ends).
        s.lookup = LookupState::Idle;
        let mut req = LookupRequest {
            shards: Vec::with_capacity(shards.len()),
            world_size: key.world_size,
            readers,
        };
        let mut touched = Vec::with_capacity(shards.len() * hashes.len());
        for &w in &shards {
            let keys = state.object_keys(key, w, &hashes, 0)?;
            touched.extend(keys.iter().cloned());
            req.shards.push((w, keys));
        }
        let windows = state.registry.object_windows(&key.model_name, key.world_size);
        if let Some(t) = state.storage_trace() {
            trace_lookup(state, t, key, &hashes, &req)?;
        }
        let lookup = if windows.len() > 1 {
            lookup_groups(state, key, &hashes, req, &windows, &mut touched)?
        } else {
            state.storage.lookup(&req)
        };
        let hit = lookup.l1_hit();
        s.touched = touched;
        tracing::Span::current().record("hits", hit);
        let hit_tokens = (hit * state.chunk_size()) as u64;
        state.metrics.lookup_hit_tokens.inc_by(hit_tokens);
        state.metrics.lookup_hit_l1_tokens.inc_by(hit_tokens);
        state.metrics.lookup_hit_l1_keys.inc_by((hit * shards.len()) as u64);
        if !lookup.is_pending() {
            state.bus.publish(crate::event_bus::Event::Lookup {
                request_id: key.request_id.clone(),
                chunks,
                hits: hit,
            });
        }
        s.lookup = LookupState::Active { lookup, chunks, answered: false };
        Ok(())
    })
}

/// A lookup of a model stored as several object groups (`--separate-object-groups`): the
/// keys of every (object group, shard) row; storage decides what hits and what stays locked
/// ([`lmcache_storage::StorageManager::lookup_groups`]).
fn lookup_groups(
    state: &ServerState,
    key: &CacheKey,
    hashes: &[lmcache_core::ChunkHash],
    req: LookupRequest,
    windows: &[Option<u64>],
    touched: &mut Vec<lmcache_core::ObjectKey>,
) -> Result<lmcache_storage::Lookup, ProtocolError> {
    let mut groups = Vec::with_capacity(windows.len());
    for (og, window) in windows.iter().enumerate() {
        let shards = if og == 0 {
            req.shards.clone()
        } else {
            let mut shards = Vec::with_capacity(req.shards.len());
            for (w, _) in &req.shards {
                let k = state.object_keys(key, *w, hashes, og as u32)?;
                touched.extend(k.iter().cloned());
                shards.push((*w, k));
            }
            shards
        };
        groups.push((window.map(|w| w as usize), shards));
    }
    let greq = lmcache_storage::GroupLookupRequest {
        groups,
        world_size: req.world_size,
        readers: req.readers,
    };
    Ok(state.storage.lookup_groups(&greq))
}

/// The lookup as LMCache's storage manager sees it: `submit_prefetch_task` with one key
/// group per object group, each listing every shard's keys (group 0's are `req`'s own).
fn trace_lookup(
    state: &ServerState,
    t: &crate::trace_record::TraceRecorder,
    key: &CacheKey,
    hashes: &[lmcache_core::ChunkHash],
    req: &LookupRequest,
) -> Result<(), ProtocolError> {
    let objects = state.registry.objects(&key.model_name, key.world_size);
    let groups = objects.len().max(1);
    let mut out = Vec::with_capacity(groups);
    for og in 0..groups {
        let keys = if og == 0 {
            req.shards.iter().flat_map(|(_, ks)| ks.iter().cloned()).collect()
        } else {
            let mut keys = Vec::with_capacity(req.shards.len() * hashes.len());
            for (w, _) in &req.shards {
                keys.extend(state.object_keys(key, *w, hashes, og as u32)?);
            }
            keys
        };
        out.push(crate::trace_record::key_group(og as u32, keys, objects.get(og)));
    }
    t.submit_prefetch(&key.request_id, out, req.readers);
    Ok(())
}

/// One line of the lookup-hash log (LMCache's format).
fn log_lookup(
    state: &ServerState,
    log: &crate::lookup_log::LookupHashLog,
    key: &CacheKey,
    hashes: &[lmcache_core::ChunkHash],
) {
    let object = state.registry.first_object(&key.model_name, key.world_size);
    let layout = crate::trace_record::layout_desc(object.as_ref());
    log.record(crate::lookup_log::LookupLine {
        timestamp: crate::lookup_log::now_unix(),
        request_id: key.request_id.clone(),
        model_name: key.model_name.to_string(),
        chunk_size: state.chunk_size(),
        seq_len: key.token_ids.len(),
        dtypes: layout.dtypes,
        shapes: layout.shapes,
        chunk_hashes: hashes.iter().map(|h| format!("0x{}", h.to_hex())).collect(),
    });
}
