//! lookup, query_prefetch_status, wait_prefetch_status, free_lookup_locks, end_session.
//!
//! A lookup completes before its reply is sent: it hashes the prompt's whole chunks, finds
//! the longest prefix resident on every shard, and read-locks those objects
//! `num_kv_readers` times (the locks live in the request's session). The hit count is then
//! handed out once by `query_prefetch_status`.

use lmcache_protocol::types::CacheKey;
use lmcache_protocol::{Op, ProtocolError, Request, value};
use rmpv::Value;

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
            Ok(Some(Value::from(take_hits(state, id))))
        }
        Op::WaitPrefetchStatus => {
            req.expect_params(2)?;
            let id = value::str_("request_id", &req.params[0])?;
            value::float("timeout", &req.params[1])?;
            Ok(Some(Value::from(take_hits(state, id))))
        }
        Op::FreeLookupLocks => {
            req.expect_params(2)?;
            let key = CacheKey::decode("key", &req.params[0])?;
            let c = state.chunk_size();
            let range = key.start / c..key.end / c;
            if !range.is_empty() {
                state.sessions.with_existing(&key.request_id, |s| s.lookup.release_all(range));
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

/// The hit count of the request's last lookup, exactly once; 0 afterwards or if unknown.
fn take_hits(state: &ServerState, request_id: &str) -> u64 {
    state.sessions.with_existing(request_id, |s| s.pending_hits.take()).flatten().unwrap_or(0)
        as u64
}

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
    state.sessions.with(&key.request_id, |s| -> Result<(), ProtocolError> {
        let hashes = s.chunk_hashes(&key.token_ids, chunks);
        // Old locks go first: a repeated lookup replaces them.
        s.lookup = LookupLocks::default();
        let mut locks = Vec::with_capacity(key.world_size as usize);
        let mut hit = usize::MAX;
        let mut touched = Vec::new();
        for &w in &shards {
            let keys = state.object_keys(key, w, &hashes)?;
            let leases = state
                .l1
                .read_lock_prefix(&keys, readers.min(state.l1.config().max_read_locks))
                .unwrap_or_default();
            hit = hit.min(leases.len());
            touched.extend(keys);
            locks.push(leases);
        }
        let hit = if hit == usize::MAX { 0 } else { hit };
        let mut per_shard: Vec<Vec<_>> = (0..key.world_size).map(|_| Vec::new()).collect();
        for (&w, mut leases) in shards.iter().zip(locks) {
            leases.truncate(hit);
            per_shard[w as usize] = leases.into_iter().map(Some).collect();
        }
        s.lookup = LookupLocks { locks: per_shard };
        s.pending_hits = Some(hit);
        state.bus.publish(crate::event_bus::Event::Lookup {
            request_id: key.request_id.clone(),
            chunks,
            hits: hit,
        });
        s.touched = touched;
        let hit_tokens = (hit * state.chunk_size()) as u64;
        state.metrics.lookup_hit_tokens.inc_by(hit_tokens);
        state.metrics.lookup_hit_l1_tokens.inc_by(hit_tokens);
        state.metrics.lookup_hit_l1_keys.inc_by((hit * shards.len()) as u64);
        Ok(())
    })
}
