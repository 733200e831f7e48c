//! CacheBlend's operations (`--engine-type blend`): the handshake, the rope state a scatter
//! re-rotates K with, the unified lookup, the scatter and the reorder plan.
//!
//! The unified lookup, as LMCache's: the first call starts the prefix lookup (the ordinary
//! lookup's, L1 then an L2 prefetch) and matches the prompt against this server's
//! fingerprints; every call answers nothing (a void reply: the client asks again) until the
//! prefix leg has landed. Then the matches past the prefix are read-locked in L1, every
//! object group and shard of each chunk, `num_kv_readers` times: a chunk with every object
//! locked is found; one that is not is a miss, struck (two strikes remove its fingerprint)
//! when no L2 could hold it. The found matches that do not overlap an earlier one are
//! answered with the prefix coverage, and their locks stay in the session for the retrieve.

use lmcache_core::ChunkHash;
use lmcache_protocol::ProtocolError;
use lmcache_protocol::request::{CbRegisterRope, CbRetrievePreComputed, Command};
use lmcache_protocol::types::CacheKey;
use lmcache_protocol::types::IpcDescriptor;
use lmcache_protocol::types::blend::{CbMatch, CbUnifiedLookupResult};
use rmpv::Value;

use super::bad;

use crate::blend::BlendEngine;
use crate::registry::{Family, Registration};
use crate::state::RequestState;

pub(super) fn handle(state: &RequestState, cmd: Command) -> Result<Option<Value>, ProtocolError> {
    let Some(engine) = state.blend.as_deref() else {
        return Err(ProtocolError::UnsupportedOp(cmd.encode().0.name()));
    };
    match cmd {
        Command::CbProtocolHandshake(v) => Ok(Some(BlendEngine::handshake(v))),
        Command::CbRegisterRope(req) => register_rope(state, engine, &req).map(|()| None),
        Command::CbUnifiedLookup(req) => unified_lookup(state, engine, &req.key),
        Command::CbRetrievePreComputed(req) => retrieve(state, engine, &req).map(Some),
        // `[]` keeps the prompt: always without --enable-blend-reorder, as LMCache answers.
        Command::CbReorderPlan(req) => {
            let chain: Vec<[u8; 32]> = if engine.records_prompts() {
                state.hasher.hash_tokens(&req.key.token_ids).iter().map(|h| h.0).collect()
            } else {
                Vec::new()
            };
            let budget = std::time::Duration::from_millis(req.budget_ms);
            let order = engine.reorder(&req.key, req.keep_prefix, budget, &chain);
            Ok(Some(Value::Array(order.into_iter().map(Value::from).collect())))
        }
        Command::CbUnregisterRope(id) => {
            if !engine.unregister_rope(id) {
                tracing::warn!(instance_id = id, "cb_unregister_rope: no rope state registered");
            }
            Ok(None)
        }
        other => Err(ProtocolError::UnsupportedOp(other.encode().0.name())),
    }
}

fn register_rope(
    state: &RequestState,
    engine: &BlendEngine,
    req: &CbRegisterRope,
) -> Result<(), ProtocolError> {
    let id = req.instance_id;
    let max_engine_group = match state.registry.get(Family::LmcacheDriven, id) {
        Some(inst) => match inst.registration {
            Registration::LmcacheDriven { kernel_groups, .. } => {
                kernel_groups.iter().map(|g| g.engine_group).max().unwrap_or(-1)
            }
            Registration::EngineDriven => -1,
        },
        None => {
            return Err(bad(
                "instance_id",
                format!(
                    "instance {id} has no paged KV cache registered; send register_kv_cache \
                     before cb_register_rope"
                ),
            ));
        }
    };
    let mut caches = Vec::with_capacity(req.cos_sin_caches.len());
    for (i, d) in req.cos_sin_caches.iter().enumerate() {
        let field = format!("cos_sin_caches_ipc[{i}]");
        let IpcDescriptor::CpuShm { shm_name, nbytes, meta } = d else {
            return Err(bad(&field, "device memory needs a GPU backend; send a cpu_shm tensor"));
        };
        let seg = super::lmcache_driven::open_client_segment(state, shm_name, *nbytes)
            .map_err(|r| bad(&field, r))?;
        caches.push(crate::blend::read_cos_sin(&seg, meta).map_err(|r| bad(&field, r))?);
    }
    engine.register_rope(req, max_engine_group, caches).map_err(|r| bad("cb_register_rope", r))
}

fn unified_lookup(
    state: &RequestState,
    engine: &BlendEngine,
    key: &CacheKey,
) -> Result<Option<Value>, ProtocolError> {
    let id = key.request_id.as_str();
    let ns = crate::blend::namespace(key);
    let started = state.sessions.with(id, |s| s.blend.pending.is_some());
    if !started {
        // First call: the prefix leg starts; the fingerprints are matched now.
        super::lookup::lookup(state, key)?;
        // No registered worker of the model: nothing to scatter into, nothing to match.
        let matches = if state.registry.has_model(&key.model_name, key.world_size) {
            engine.matcher().lock().find(&ns, &key.token_ids)
        } else {
            Vec::new()
        };
        state.sessions.with(id, |s| {
            s.blend.pending = Some(matches);
            s.blend.matched.clear();
        });
    }
    let hits = super::lookup::take_hits(state, id);
    let Some(prefix_chunks) = hits.as_u64() else {
        return Ok(None); // the prefix is still loading: the client asks again
    };
    let matches = state.sessions.with(id, |s| s.blend.pending.take()).unwrap_or_default();
    let chunk = state.chunk_size() as u64;
    let prefix_tokens = prefix_chunks * chunk;
    let readers = key.num_kv_readers.clamp(1, state.l1().config().max_read_locks);
    let objects = state.registry.objects(&key.model_name, key.world_size);
    let groups = objects.len().max(1);
    // Every object (group, shard) of a chunk read-locked, or none.
    let lock = |hash: [u8; 32]| -> Result<Option<Vec<lmcache_l1::ReadLease>>, ProtocolError> {
        let mut keys = Vec::with_capacity(groups * key.world_size as usize);
        for og in 0..groups as u32 {
            for w in 0..key.world_size {
                keys.extend(state.object_keys(key, w, &[ChunkHash(hash)], og)?);
            }
        }
        let leases: Vec<_> = state.l1().read_lock(&keys, readers).into_iter().flatten().collect();
        Ok((leases.len() == keys.len()).then_some(leases))
    };
    // The segmented prefix: the prompt's own chunks past a gap in the prefix hit that L1
    // still holds, served at their positions. Off for recurrent or windowed groups (a gap
    // there cannot be skipped).
    let mut tail: Vec<(CbMatch, Vec<lmcache_l1::ReadLease>)> = Vec::new();
    let full_attention = objects.iter().all(|o| o.window_chunks.is_none() && !o.recurrent);
    if engine.options().segmented_prefix && full_attention {
        let chunks = key.token_ids.len() / state.chunk_size();
        let own = state.sessions.with(id, |s| s.chunk_hashes(&key.token_ids, chunks));
        for (i, h) in own.iter().enumerate().skip(prefix_chunks as usize) {
            if let Some(leases) = lock(h.0)? {
                let st = i as u64 * chunk;
                let m = CbMatch {
                    old_st: st,
                    old_ed: st + chunk,
                    cur_st: st,
                    cur_ed: st + chunk,
                    hash: h.0.to_vec(),
                };
                tail.push((m, leases));
            }
        }
    }
    let strike = state.config.l2_adapters.is_empty();
    let mut found: Vec<(CbMatch, Vec<lmcache_l1::ReadLease>)> = Vec::new();
    // A match at its own position that the segmented tail serves already is not scattered
    // twice (one at its position the tail lacks is a true reuse and stays).
    let in_tail = |m: &lmcache_blend::Found| tail.iter().any(|(t, _)| t.cur_st == m.cur_st);
    for m in matches.into_iter().filter(|m| m.cur_st >= prefix_tokens) {
        if m.old_st == m.cur_st && in_tail(&m) {
            continue;
        }
        if let Some(leases) = lock(m.hash)? {
            engine.matcher().lock().found(&ns, &m.hash);
            let cb = CbMatch {
                old_st: m.old_st,
                old_ed: m.old_st + chunk,
                cur_st: m.cur_st,
                cur_ed: m.cur_st + chunk,
                hash: m.hash.to_vec(),
            };
            found.push((cb, leases));
        } else if strike && engine.matcher().lock().stale(&ns, &m.hash) {
            tracing::debug!(request_id = id, "CB fingerprint removed after two stale lookups");
        }
    }
    // Two matches that write the same request range cannot both scatter: the earlier wins.
    let mut kept = Vec::with_capacity(found.len());
    let mut covered = 0u64;
    for (m, leases) in found {
        if m.cur_st >= covered {
            covered = m.cur_ed;
            kept.push((m, leases));
        }
    }
    let result = CbUnifiedLookupResult {
        prefix_coverage_tokens: prefix_tokens,
        non_prefix_segments: kept.iter().map(|(m, _)| m.clone()).collect(),
        segmented_prefix_segments: tail.iter().map(|(m, _)| m.clone()).collect(),
    };
    kept.extend(tail);
    state.sessions.with(id, |s| s.blend.matched = kept);
    Ok(Some(result.encode()))
}

/// `cb_retrieve_pre_computed`: the early outcomes as LMCache answers them, then the scatter.
/// - every match scattered already for this request and worker: `(b"", true)`, nothing
///   written again;
/// - every match past the block table: `(b"", true)`, nothing written (a later call with the
///   whole table scatters them; the locks stay);
/// - some inside and some past it: `(b"", false)` (the engine recomputes);
/// - otherwise each match's object is read from L1 and scattered: `(b"", true)`, or
///   `(b"", false)` when an object is gone or its geometry is not handled.
fn retrieve(
    state: &RequestState,
    engine: &BlendEngine,
    req: &CbRetrievePreComputed,
) -> Result<Value, ProtocolError> {
    use lmcache_protocol::types::transfer_result;
    let id = req.instance_id;
    let inst = state.registry.get(Family::LmcacheDriven, id).ok_or_else(|| {
        bad("instance_id", format!("instance {id} has no paged KV cache registered"))
    })?;
    let rope = engine.rope(id).ok_or_else(|| {
        bad("instance_id", format!("instance {id} has no rope state; send cb_register_rope first"))
    })?;
    let Registration::LmcacheDriven { kernel_groups, object_groups, .. } = &inst.registration
    else {
        return Err(bad("instance_id", "not an lmcache-driven registration"));
    };
    let chunk = state.chunk_size() as u64;
    // Positions come from the client: each match must be one chunk, at both ends, before any
    // arithmetic on them.
    let one_chunk = |m: &CbMatch| {
        m.cur_ed.checked_sub(m.cur_st) == Some(chunk)
            && m.old_ed.checked_sub(m.old_st) == Some(chunk)
            && m.old_ed <= u64::from(u32::MAX)
    };
    if let Some(m) = req.match_results.iter().find(|m| !one_chunk(m)) {
        return Err(bad(
            "match_results",
            format!(
                "[{}, {}) -> [{}, {}) is not one chunk of {chunk} at both ends",
                m.old_st, m.old_ed, m.cur_st, m.cur_ed
            ),
        ));
    }
    let tpb = |g: usize| kernel_groups.get(g).map_or(1, |k| k.tokens_per_block.max(1));
    // Each match with what identifies it as applied: its hash, start and destination blocks.
    let dest = |m: &CbMatch| -> Vec<u64> {
        object_groups.first().map_or_else(Vec::new, |og| {
            og.kernel_groups
                .iter()
                .flat_map(|&g| {
                    let list = kernel_groups.get(g).and_then(|k| req.block_ids.get(k.view));
                    let (a, b) = (m.cur_st / tpb(g), m.cur_ed.div_ceil(tpb(g)));
                    list.map(|l| {
                        l.iter()
                            .skip(a as usize)
                            .take((b - a) as usize)
                            .copied()
                            .collect::<Vec<_>>()
                    })
                    .unwrap_or_default()
                })
                .collect()
        })
    };
    let tagged: Vec<(&CbMatch, crate::blend::AppliedKey)> =
        req.match_results.iter().map(|m| (m, (m.hash.clone(), m.cur_st, dest(m)))).collect();
    let request = (req.key.request_id.clone(), req.key.worker_id);
    let todo = engine.not_applied(&request, &tagged);
    if todo.is_empty() {
        return Ok(transfer_result(true));
    }
    let bound = object_groups
        .first()
        .map(|og| {
            og.kernel_groups
                .iter()
                .map(|&g| {
                    let k = &kernel_groups[g];
                    req.block_ids.get(k.view).map_or(0, |l| l.len() as u64) * k.tokens_per_block
                })
                .min()
                .unwrap_or(0)
        })
        .unwrap_or(0);
    if todo.iter().any(|(m, _)| m.cur_ed > bound) {
        let beyond = todo.iter().all(|(m, _)| m.cur_st >= bound);
        return Ok(transfer_result(beyond));
    }
    // This worker's object of each match, read-locked for the copy (the lookup's locks keep
    // them resident meanwhile; these go when the copy ends).
    let worker = req.key.worker_id.unwrap_or(0);
    let mut leases = Vec::with_capacity(todo.len());
    for (m, _) in &todo {
        let Ok(hash) = <[u8; 32]>::try_from(m.hash.as_slice()) else {
            return Err(bad("match_results", "a hash of other than 32 bytes"));
        };
        let keys = state.object_keys(&req.key, worker, &[ChunkHash(hash)], 0)?;
        match state.l1().read_lock(&keys, 1).pop() {
            Some(Ok(lease)) => leases.push(lease),
            _ => {
                tracing::warn!(request_id = %req.key.request_id, "CB retrieve: a matched chunk left L1");
                return Ok(transfer_result(false));
            }
        }
    }
    let work: Vec<(&CbMatch, &[u8])> =
        todo.iter().zip(&leases).map(|((m, _), l)| (*m, l.bytes())).collect();
    match super::lmcache_driven::blend_scatter(state, id, &req.block_ids, &work, &rope) {
        Ok(()) => {
            engine.mark_applied(request, todo.iter().map(|(_, k)| k.clone()));
            Ok(transfer_result(true))
        }
        Err(why) => {
            tracing::warn!(request_id = %req.key.request_id, error = %why, "CB scatter refused");
            Ok(transfer_result(false))
        }
    }
}
