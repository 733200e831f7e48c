//! lookup, query_prefetch_status, wait_prefetch_status, free_lookup_locks, end_session.
//!
//! A lookup hashes the prompt's whole chunks, finds the longest prefix resident in L1 on every
//! shard, and read-locks those objects `num_kv_readers` times (the locks live in the request's
//! session). With no L2, or when L1 holds the whole prompt, it is complete before its reply.
//! Otherwise an L2 prefetch of the remaining chunks starts; `query_prefetch_status` answers
//! nil until it ends, then the L1 and L2 hits together, exactly once.

use lmcache_protocol::types::CacheKey;
use lmcache_protocol::{Op, ProtocolError, Request, value};
use rmpv::Value;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lmcache_storage::PrefetchRequest;

use crate::session::LookupLocks;
use crate::state::ServerState;

pub(super) fn handle(state: &ServerState, req: &Request) -> Result<Option<Value>, ProtocolError> {
    match req.op {
        Op::Lookup => {
            req.expect_params(2)?;
            let key = CacheKey::decode("key", &req.params[0])?;
            lookup(state, &key)?;
            Ok(None)
        }
        Op::QueryPrefetchStatus => {
            req.expect_params(1)?;
            let id = value::str_("request_id", &req.params[0])?;
            Ok(Some(take_hits(state, id)))
        }
        Op::WaitPrefetchStatus => {
            req.expect_params(2)?;
            let id = value::str_("request_id", &req.params[0])?;
            let timeout = value::float("timeout", &req.params[1])?;
            let limit = Duration::from_secs_f64(timeout.clamp(0.0, 60.0));
            let t0 = Instant::now();
            loop {
                let v = take_hits(state, id);
                if !v.is_nil() || t0.elapsed() >= limit {
                    return Ok(Some(v));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        Op::FreeLookupLocks => {
            req.expect_params(2)?;
            let key = CacheKey::decode("key", &req.params[0])?;
            let c = state.chunk_size();
            let range = key.start / c..key.end / c;
            if !range.is_empty() {
                state.sessions.with_existing(&key.request_id, |s| {
                    // LMCache ignores the call while the prefetch runs; so do we.
                    if s.prefetching.is_none() {
                        s.lookup.release_all(range);
                    }
                });
            }
            Ok(None)
        }
        Op::EndSession => {
            req.expect_params(1)?;
            let id = value::str_("request_id", &req.params[0])?;
            if let Some(session) = state.sessions.remove(id) {
                state.l1.touch(&session.touched);
                drop(session);
                state
                    .bus
                    .publish(crate::event_bus::Event::SessionEnded { request_id: id.to_owned() });
            }
            Ok(None)
        }
        other => Err(ProtocolError::UnsupportedOp(other.name())),
    }
}

/// The hit count of the request's last lookup, exactly once; nil while its prefetch runs; 0
/// afterwards or if unknown.
fn take_hits(state: &ServerState, request_id: &str) -> Value {
    let v = state.sessions.with_existing(request_id, |s| {
        if s.prefetching.is_some() { None } else { Some(s.pending_hits.take().unwrap_or(0)) }
    });
    match v {
        Some(None) => Value::Nil,
        Some(Some(n)) => Value::from(n as u64),
        None => Value::from(0u64),
    }
}

static PREFETCH_GENERATION: AtomicU64 = AtomicU64::new(1);

fn lookup(state: &ServerState, key: &CacheKey) -> Result<(), ProtocolError> {
    let readers = key.num_kv_readers;
    if readers == 0 {
        // LMCache raises here and never replies; we reply, with zero hits.
        state.sessions.with(&key.request_id, |s| s.pending_hits = Some(0));
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
        state.sessions.with(&key.request_id, |s| {
            s.pending_hits = Some(0);
            s.lookup = LookupLocks::default();
        });
        return Ok(());
    }
    let shards: Vec<u32> = match key.worker_id {
        Some(w) => vec![w],
        None => (0..key.world_size).collect(),
    };
    let readers = readers.min(state.l1.config().max_read_locks);
    state.sessions.with(&key.request_id, |s| -> Result<(), ProtocolError> {
        let hashes = s.chunk_hashes(&key.token_ids, chunks);
        // Old locks go first: a repeated lookup replaces them (and any prefetch it started).
        s.lookup = LookupLocks::default();
        s.prefetching = None;
        let mut locks = Vec::with_capacity(key.world_size as usize);
        let mut all_keys = Vec::with_capacity(shards.len());
        let mut hit = usize::MAX;
        let mut touched = Vec::new();
        for &w in &shards {
            let keys = state.object_keys(key, w, &hashes)?;
            let leases = state.l1.read_lock_prefix(&keys, readers).unwrap_or_default();
            hit = hit.min(leases.len());
            touched.extend(keys.iter().cloned());
            all_keys.push(keys);
            locks.push(leases);
        }
        let hit = if hit == usize::MAX { 0 } else { hit };
        let mut per_shard: Vec<Vec<_>> = (0..key.world_size).map(|_| Vec::new()).collect();
        for (&w, mut leases) in shards.iter().zip(locks) {
            leases.truncate(hit);
            per_shard[w as usize] = leases.into_iter().map(Some).collect();
        }
        s.lookup = LookupLocks { locks: per_shard };
        s.touched = touched;
        tracing::Span::current().record("hits", hit);
        let hit_tokens = (hit * state.chunk_size()) as u64;
        state.metrics.lookup_hit_tokens.inc_by(hit_tokens);
        state.metrics.lookup_hit_l1_tokens.inc_by(hit_tokens);
        state.metrics.lookup_hit_l1_keys.inc_by((hit * shards.len()) as u64);
        match (&state.l2, state.me.upgrade()) {
            (Some(l2), Some(me)) if hit < chunks && !l2.is_empty() => {
                let generation = PREFETCH_GENERATION.fetch_add(1, Ordering::Relaxed);
                s.prefetching = Some(generation);
                s.pending_hits = None;
                let rest: Vec<_> = all_keys.into_iter().map(|k| k[hit..].to_vec()).collect();
                let req = PrefetchRequest { shards: rest, readers };
                let (request_id, shards) = (key.request_id.clone(), shards.clone());
                l2.prefetch(req, move |out| {
                    finish_prefetch(&me, &request_id, generation, hit, chunks, &shards, out);
                });
            }
            _ => {
                s.pending_hits = Some(hit);
                state.bus.publish(crate::event_bus::Event::Lookup {
                    request_id: key.request_id.clone(),
                    chunks,
                    hits: hit,
                });
            }
        }
        Ok(())
    })
}

/// Joins an L2 prefetch's result to the request's session, unless a later lookup replaced it
/// (then dropping the outcome releases its locks).
fn finish_prefetch(
    state: &ServerState,
    request_id: &str,
    generation: u64,
    l1_hit: usize,
    chunks: usize,
    shards: &[u32],
    out: lmcache_storage::PrefetchOutcome,
) {
    let extra = out.hits;
    let applied = state.sessions.with_existing(request_id, |s| {
        if s.prefetching != Some(generation) {
            return false;
        }
        for (&w, leases) in shards.iter().zip(out.leases) {
            if let Some(slots) = s.lookup.locks.get_mut(w as usize) {
                slots.extend(leases.into_iter().map(Some));
            }
        }
        s.pending_hits = Some(l1_hit + extra);
        s.prefetching = None;
        true
    });
    if applied != Some(true) {
        return;
    }
    let c = state.chunk_size() as u64;
    state.metrics.lookup_hit_tokens.inc_by(extra as u64 * c);
    state.metrics.lookup_hit_l2_tokens.inc_by(extra as u64 * c);
    state.metrics.lookup_hit_l2_keys.inc_by(out.loaded_keys as u64);
    state.bus.publish(crate::event_bus::Event::Lookup {
        request_id: request_id.to_owned(),
        chunks,
        hits: l1_hit + extra,
    });
}
