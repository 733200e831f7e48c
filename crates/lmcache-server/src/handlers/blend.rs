//! CacheBlend's operations (`--engine-type blend`): the handshake, the rope state a scatter
//! re-rotates K with, and the unified lookup. The scatter and the reorder plan are not
//! served yet (see [`crate::blend`]).
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
use lmcache_protocol::request::{CbRegisterRope, Command};
use lmcache_protocol::types::CacheKey;
use lmcache_protocol::types::IpcDescriptor;
use lmcache_protocol::types::blend::{CbMatch, CbUnifiedLookupResult};
use rmpv::Value;

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
        // Without --enable-blend-reorder LMCache answers `[]` ("keep the prompt"), quietly.
        Command::CbReorderPlan(_) if !engine.options().reorder => Ok(Some(Value::Array(vec![]))),
        Command::CbUnregisterRope(id) => {
            if !engine.unregister_rope(id) {
                tracing::warn!(instance_id = id, "cb_unregister_rope: no rope state registered");
            }
            Ok(None)
        }
        other => Err(ProtocolError::UnsupportedOp(other.encode().0.name())),
    }
}

fn bad(field: &str, reason: impl Into<String>) -> ProtocolError {
    ProtocolError::OutOfRange { field: field.to_owned(), reason: reason.into() }
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
    let groups = state.registry.objects(&key.model_name, key.world_size).len().max(1);
    let strike = state.config.l2_adapters.is_empty();
    let mut found: Vec<(CbMatch, Vec<lmcache_l1::ReadLease>)> = Vec::new();
    for m in matches.into_iter().filter(|m| m.cur_st >= prefix_tokens) {
        let mut keys = Vec::with_capacity(groups * key.world_size as usize);
        for og in 0..groups as u32 {
            for w in 0..key.world_size {
                keys.extend(state.object_keys(key, w, &[ChunkHash(m.hash)], og)?);
            }
        }
        let leases: Vec<_> = state.l1().read_lock(&keys, readers).into_iter().flatten().collect();
        if leases.len() == keys.len() {
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
        segmented_prefix_segments: Vec::new(),
    };
    state.sessions.with(id, |s| s.blend.matched = kept);
    Ok(Some(result.encode()))
}
