//! CacheBlend's operations (`--engine-type blend`): the handshake, the rope state a scatter
//! re-rotates K with, the unified lookup, the scatter and the reorder plan.
//!
//! The unified lookup, as LMCache's: submit once, poll on every call. The first call starts
//! the prefix leg (the ordinary lookup: L1, then L2 and the fleet's peers), matches the
//! prompt against this server's fingerprints and asks the coordinator for the fleet's (with
//! a coordinator leg); every call answers nothing (a void reply: the client asks again)
//! until the prefix leg has landed and the coordinator answered or its deadline passed.
//! Then the sparse leg: each distinct chunk matched past the prefix has its objects (every
//! blend object group and shard) read-locked `num_kv_readers` times where L1 holds them and
//! loaded from L2 and the peers where it does not; the calls go on answering nothing until
//! those loads land. A chunk found whole is kept unless an earlier kept match overlaps it; a
//! chunk found nowhere is struck (two strikes remove its fingerprint). The answer is the
//! prefix coverage, the kept matches and the segmented tail; the locks stay in the session
//! for the retrieve.

use std::time::Instant;

use lmcache_blend::Found;
use lmcache_core::{ChunkHash, ObjectKey};
use lmcache_protocol::ProtocolError;
use lmcache_protocol::request::{CbRegisterRope, CbRetrievePreComputed, Command};
use lmcache_protocol::types::CacheKey;
use lmcache_protocol::types::IpcDescriptor;
use lmcache_protocol::types::blend::{CbMatch, CbUnifiedLookupResult};
use rmpv::Value;

use super::bad;

use crate::blend::{BlendEngine, ChunkState, FleetLeg, LookupJob, SparseLeg};
use crate::blend_telemetry::{
    BlendEvent, BlendTrace, InstantSpan, LookupOutcome, NoopReason, Phase,
};
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

/// The object groups a blend match reads: every group but recurrent state (a relocated chunk
/// carries no recurrence), as LMCache's blend read set.
pub(crate) fn blend_groups(state: &RequestState, key: &CacheKey) -> Vec<u32> {
    let objects = state.registry.objects(&key.model_name, key.world_size);
    if objects.is_empty() {
        return vec![0];
    }
    (0..objects.len() as u32).filter(|&og| !objects[og as usize].recurrent).collect()
}

/// Every object key of chunk `hash` the blend leg reads: each blend group, each shard.
fn chunk_keys(
    state: &RequestState,
    key: &CacheKey,
    groups: &[u32],
    hash: [u8; 32],
) -> Result<Vec<ObjectKey>, ProtocolError> {
    let mut keys = Vec::with_capacity(groups.len() * key.world_size as usize);
    for &og in groups {
        for w in 0..key.world_size {
            keys.extend(state.object_keys(key, w, &[ChunkHash(hash)], og)?);
        }
    }
    Ok(keys)
}

/// Tokens the matches cover, each token once.
fn coverage(matches: &[CbMatch]) -> u64 {
    let mut spans: Vec<(u64, u64)> = matches.iter().map(|m| (m.cur_st, m.cur_ed)).collect();
    spans.sort_unstable();
    let (mut total, mut end) = (0, 0);
    for (a, b) in spans {
        let a = a.max(end);
        if b > a {
            total += b - a;
            end = b;
        }
    }
    total
}

/// What a poll of the lookup does next.
enum Step {
    /// A leg is still loading: answer nothing (the client asks again).
    Wait,
    /// Every leg landed.
    Ready,
}

fn unified_lookup(
    state: &RequestState,
    engine: &BlendEngine,
    key: &CacheKey,
) -> Result<Option<Value>, ProtocolError> {
    let id = key.request_id.as_str();
    let ns = crate::blend::namespace(key);
    if !state.sessions.with(id, |s| s.blend.job.is_some()) {
        begin(state, engine, key, &ns)?;
    }
    // The prefix leg: the ordinary lookup's hits, answered once, when its prefetch landed.
    let prefix_pending = state
        .sessions
        .with(id, |s| s.blend.job.as_ref().is_some_and(|j| j.prefix_chunks.is_none()));
    if prefix_pending {
        let Some(chunks) = super::lookup::take_hits(state, id).as_u64() else {
            return Ok(None);
        };
        state.sessions.with(id, |s| {
            if let Some(j) = &mut s.blend.job {
                j.prefix_chunks = Some(chunks);
            }
            if let Some(p) = s.blend.trace.as_mut().and_then(|t| t.prefix.take()) {
                engine.emit(BlendEvent::PrefixLookedUp {
                    request_id: id.to_owned(),
                    chunks,
                    took: p.elapsed(),
                });
            }
        });
    }
    if let Step::Wait = poll_fleet(state, engine, id) {
        return Ok(None);
    }
    if state.sessions.with(id, |s| s.blend.job.as_ref().is_some_and(|j| j.sparse.is_none())) {
        start_sparse(state, key)?;
    }
    if let Step::Wait = poll_sparse(state, engine, id) {
        return Ok(None);
    }
    finish(state, engine, key, &ns).map(Some)
}

/// The first poll: the trace opens, the prefix leg starts (the ordinary lookup, L1 then L2
/// and the peers), this server's fingerprints are matched and the coordinator is asked.
fn begin(
    state: &RequestState,
    engine: &BlendEngine,
    key: &CacheKey,
    ns: &lmcache_blend::Namespace,
) -> Result<(), ProtocolError> {
    let id = key.request_id.as_str();
    engine.emit(BlendEvent::LookupStarted { request_id: id.to_owned() });
    let mut trace = BlendTrace::begin(id, key.token_ids.len());
    trace.prefix =
        Some(Phase::begin(tracing::info_span!(parent: trace.lookup_span(), "cb.prefix_lookup")));
    let lookup_span = trace.lookup_span().clone();
    state.sessions.with(id, |s| {
        s.blend.trace = Some(trace);
        s.blend.matched.clear();
        s.blend.leases.clear();
    });
    lookup_span.in_scope(|| super::lookup::lookup(state, key))?;
    // No registered worker of the model: nothing to scatter into, nothing to match.
    let no_context = !state.registry.has_model(&key.model_name, key.world_size);
    let local = if no_context {
        Vec::new()
    } else {
        let span = tracing::info_span!(parent: &lookup_span, "cb.fingerprint_match");
        let t = Instant::now();
        let found = span.in_scope(|| engine.matcher().lock().find(ns, &key.token_ids));
        engine.emit(BlendEvent::FingerprintMatched {
            request_id: id.to_owned(),
            matches: found.len() as u64,
            took: t.elapsed(),
        });
        found
    };
    let fleet = match engine.fleet() {
        Some(f) if !no_context && key.token_ids.len() >= state.chunk_size() => {
            let span = tracing::info_span!(parent: &lookup_span, "cb.coordinator_match");
            state.sessions.with(id, |s| {
                if let Some(t) = &mut s.blend.trace {
                    t.coordinator = Some(Phase::begin(span));
                }
            });
            Some(FleetLeg {
                query: f.submit(&key.token_ids, ns),
                deadline: Instant::now() + f.budget(),
                matches: None,
            })
        }
        _ => None,
    };
    state.sessions.with(id, |s| {
        s.blend.job =
            Some(LookupJob { local, fleet, prefix_chunks: None, sparse: None, no_context });
    });
    Ok(())
}

/// The coordinator leg: its answer, or none once its deadline passed.
fn poll_fleet(state: &RequestState, engine: &BlendEngine, id: &str) -> Step {
    state.sessions.with(id, |s| {
        let Some(leg) = s.blend.job.as_mut().and_then(|j| j.fleet.as_mut()) else {
            return Step::Ready;
        };
        if leg.matches.is_some() {
            return Step::Ready;
        }
        let (matches, timed_out) = match leg.query.poll() {
            Some(Ok(m)) => {
                let m = m
                    .into_iter()
                    .map(|f| Found { hash: f.chunk_hash, old_st: f.old_st, cur_st: f.cur_st })
                    .collect::<Vec<_>>();
                (m, false)
            }
            Some(Err(_)) => (Vec::new(), false),
            None if Instant::now() < leg.deadline => return Step::Wait,
            None => {
                tracing::warn!(
                    request_id = id,
                    "CB coordinator match past its deadline; local only"
                );
                (Vec::new(), true)
            }
        };
        let took = s.blend.trace.as_mut().and_then(|t| t.coordinator.take()).map(|p| p.elapsed());
        engine.emit(BlendEvent::CoordinatorMatched {
            request_id: id.to_owned(),
            matches: matches.len() as u64,
            timed_out,
            took: took.unwrap_or_default(),
        });
        leg.matches = Some(matches);
        Step::Ready
    })
}

/// The sparse leg starts: the matches past the prefix (this server's and the fleet's, each
/// (chunk, position) once), each distinct chunk's objects read-locked where L1 holds them
/// and loaded from L2 and the peers where it does not.
fn start_sparse(state: &RequestState, key: &CacheKey) -> Result<(), ProtocolError> {
    let id = key.request_id.as_str();
    let chunk = state.chunk_size() as u64;
    let Some((mut candidates, prefix)) = state.sessions.with(id, |s| {
        let j = s.blend.job.as_mut()?;
        let mut all = std::mem::take(&mut j.local);
        // The fleet leg is done with once its matches join the candidates (a later poll
        // must not wait for it again).
        all.extend(j.fleet.take().and_then(|f| f.matches).unwrap_or_default());
        Some((all, j.prefix_chunks.unwrap_or(0) * chunk))
    }) else {
        return Ok(());
    };
    // Past the prefix, and inside the prompt (the coordinator's positions are checked too).
    let len = key.token_ids.len() as u64;
    candidates.retain(|m| m.cur_st >= prefix && m.cur_st + chunk <= len);
    candidates.sort_by_key(|m| (m.cur_st, m.hash));
    candidates.dedup_by_key(|m| (m.cur_st, m.hash));
    let readers = key.num_kv_readers.clamp(1, state.l1().config().max_read_locks);
    let groups = blend_groups(state, key);
    let mut leg = SparseLeg::default();
    for m in &candidates {
        if leg.chunks.contains_key(&m.hash) {
            continue;
        }
        let keys = chunk_keys(state, key, &groups, m.hash)?;
        let chunk_state = match state.storage.lock_chunk(&keys, readers) {
            Ok(leases) => ChunkState::Held(leases),
            Err((held, Some(handle))) => {
                leg.l2_keys += (keys.len() - held.len()) as u64;
                ChunkState::Loading { held, handle }
            }
            Err((_, None)) => ChunkState::Missing,
        };
        leg.chunks.insert(m.hash, chunk_state);
    }
    leg.candidates = candidates;
    let loading = leg.loading();
    state.sessions.with(id, |s| {
        if loading && let Some(t) = &mut s.blend.trace {
            let span = tracing::info_span!(parent: t.lookup_span(), "cb.sparse_prefetch", l2_keys = leg.l2_keys);
            t.sparse = Some(Phase::begin(span));
        }
        match &mut s.blend.job {
            Some(j) => j.sparse = Some(leg),
            None => drop(leg),
        }
    });
    Ok(())
}

/// The sparse leg's loads: each chunk found whole (its locks joined) or missing.
fn poll_sparse(state: &RequestState, engine: &BlendEngine, id: &str) -> Step {
    state.sessions.with(id, |s| {
        let Some(leg) = s.blend.job.as_mut().and_then(|j| j.sparse.as_mut()) else {
            return Step::Ready;
        };
        if !leg.loading() {
            return Step::Ready;
        }
        let mut waiting = false;
        for c in leg.chunks.values_mut() {
            let ChunkState::Loading { held, handle } = c else { continue };
            let Some(out) = handle.poll() else {
                waiting = true;
                continue;
            };
            if out.hits >= 1 {
                let mut all = std::mem::take(held);
                for row in out.leases {
                    leg.found_keys += row.len() as u64;
                    all.extend(row);
                }
                *c = ChunkState::Held(all);
            } else {
                *c = ChunkState::Missing;
            }
        }
        if waiting {
            return Step::Wait;
        }
        let took = s.blend.trace.as_mut().and_then(|t| t.sparse.take()).map(|p| p.elapsed());
        engine.emit(BlendEvent::SparsePrefetched {
            request_id: id.to_owned(),
            l2_keys: leg.l2_keys,
            found_keys: leg.found_keys,
            took: took.unwrap_or_default(),
        });
        Step::Ready
    })
}

/// Every leg landed: found matches kept (the earlier of two overlapping wins), missing ones
/// struck, the segmented tail added, the locks kept in the session for the retrieve, and the
/// answer built.
fn finish(
    state: &RequestState,
    engine: &BlendEngine,
    key: &CacheKey,
    ns: &lmcache_blend::Namespace,
) -> Result<Value, ProtocolError> {
    let id = key.request_id.as_str();
    let chunk = state.chunk_size() as u64;
    let Some(job) = state.sessions.with(id, |s| s.blend.job.take()) else {
        return Ok(CbUnifiedLookupResult::default().encode());
    };
    let prefix_chunks = job.prefix_chunks.unwrap_or(0);
    let prefix_tokens = prefix_chunks * chunk;
    let mut leg = job.sparse.unwrap_or_default();
    let readers = key.num_kv_readers.clamp(1, state.l1().config().max_read_locks);
    // The segmented prefix: the prompt's own chunks past a gap in the prefix hit that L1
    // still holds, served at their positions. Off for recurrent or windowed groups (a gap
    // there cannot be skipped).
    let mut tail: Vec<CbMatch> = Vec::new();
    let mut leases: Vec<lmcache_l1::ReadLease> = Vec::new();
    let objects = state.registry.objects(&key.model_name, key.world_size);
    let full_attention = objects.iter().all(|o| o.window_chunks.is_none() && !o.recurrent);
    if engine.options().segmented_prefix && full_attention && !job.no_context {
        let groups = blend_groups(state, key);
        let chunks = key.token_ids.len() / state.chunk_size();
        let own = state.sessions.with(id, |s| s.chunk_hashes(&key.token_ids, chunks));
        for (i, h) in own.iter().enumerate().skip(prefix_chunks as usize) {
            let keys = chunk_keys(state, key, &groups, h.0)?;
            let locked: Vec<_> =
                state.l1().read_lock(&keys, readers).into_iter().flatten().collect();
            if locked.len() == keys.len() {
                let st = i as u64 * chunk;
                tail.push(CbMatch {
                    old_st: st,
                    old_ed: st + chunk,
                    cur_st: st,
                    cur_ed: st + chunk,
                    hash: h.0.to_vec(),
                });
                leases.extend(locked);
            }
        }
    }
    // A match at its own position that the segmented tail serves already is not scattered
    // twice (one at its position the tail lacks is a true reuse and stays).
    let in_tail = |m: &Found| m.old_st == m.cur_st && tail.iter().any(|t| t.cur_st == m.cur_st);
    let candidates: Vec<Found> =
        std::mem::take(&mut leg.candidates).into_iter().filter(|m| !in_tail(m)).collect();
    let mut kept: Vec<CbMatch> = Vec::new();
    let mut covered = 0u64;
    let mut used: Vec<[u8; 32]> = Vec::new();
    let mut struck = 0u64;
    for m in &candidates {
        match leg.chunks.get(&m.hash) {
            Some(ChunkState::Held(_)) => {
                engine.matcher().lock().found(ns, &m.hash);
                // Two matches that write the same request range cannot both scatter: the
                // earlier wins.
                if m.cur_st >= covered {
                    covered = m.cur_st + chunk;
                    used.push(m.hash);
                    kept.push(CbMatch {
                        old_st: m.old_st,
                        old_ed: m.old_st + chunk,
                        cur_st: m.cur_st,
                        cur_ed: m.cur_st + chunk,
                        hash: m.hash.to_vec(),
                    });
                }
            }
            _ => {
                if engine.matcher().lock().stale(ns, &m.hash) {
                    struck += 1;
                }
            }
        }
    }
    // The locks of the chunks kept stay for the retrieve; the others go now.
    for (hash, c) in leg.chunks {
        if let ChunkState::Held(l) = c
            && used.contains(&hash)
        {
            leases.extend(l);
        }
    }
    let outcome = LookupOutcome {
        requested_tokens: (key.token_ids.len() as u64 / chunk) * chunk,
        prefix_tokens,
        non_prefix_tokens: coverage(&kept),
        segmented_tokens: coverage(&tail),
        found: kept.len() as u64,
        stale: candidates.len().saturating_sub(kept.len()) as u64,
        no_context: job.no_context,
    };
    let result = CbUnifiedLookupResult {
        prefix_coverage_tokens: prefix_tokens,
        non_prefix_segments: kept.clone(),
        segmented_prefix_segments: tail.clone(),
    };
    let nothing = kept.is_empty() && tail.is_empty();
    state.sessions.with(id, |s| {
        let took = match &mut s.blend.trace {
            Some(t) => {
                t.record(&outcome);
                if struck > 0 {
                    InstantSpan::ChunksEvicted.record(Some(t.lookup_span()), struck);
                }
                t.lookup.take().map(|p| p.elapsed())
            }
            None => None,
        };
        engine.emit(BlendEvent::LookupEnded {
            request_id: id.to_owned(),
            outcome: outcome.clone(),
            took: took.unwrap_or_default(),
        });
        if struck > 0 {
            engine.emit(BlendEvent::ChunksEvicted { request_id: id.to_owned(), chunks: struck });
        }
        kept.extend(tail);
        s.blend.matched = kept;
        s.blend.leases = leases;
        if nothing {
            // No retrieve follows: the request's trace ends here, as LMCache's does.
            s.blend.trace = None;
        }
    });
    Ok(result.encode())
}

/// `cb_retrieve_pre_computed`: the early outcomes as LMCache answers them, then the scatter.
/// - every match scattered already for this request and worker (or none sent): `(b"", true)`,
///   nothing written again;
/// - every match past the block table: `(b"", true)`, nothing written (a later call with the
///   whole table scatters them; the locks stay);
/// - some inside and some past it: `(b"", false)` (the engine recomputes);
/// - otherwise each match's objects (every blend object group, this worker's shard) are read
///   from L1 and scattered: `(b"", true)`, or `(b"", false)` when an object is gone or its
///   geometry is not served (nothing written).
fn retrieve(
    state: &RequestState,
    engine: &BlendEngine,
    req: &CbRetrievePreComputed,
) -> Result<Value, ProtocolError> {
    use lmcache_protocol::types::transfer_result;
    let t0 = Instant::now();
    let id = req.instance_id;
    let rid = req.key.request_id.as_str();
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
            && m.cur_ed <= u64::from(u32::MAX)
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
    let n = req.match_results.len() as u64;
    // The retrieve's span under the request's root (`cb.request`), when its lookup opened one.
    let root =
        state.sessions.with_existing(rid, |s| s.blend.trace.as_ref().map(|t| t.request.clone()));
    let parent = root.flatten().and_then(|r| r.id()).or_else(|| tracing::Span::current().id());
    let span = tracing::info_span!(parent: parent, "cb.retrieve", num_chunks = n, success = tracing::field::Empty);
    let _entered = span.enter();
    let end_request = |keep: bool| {
        if !keep {
            state.sessions.with_existing(rid, |s| s.blend.trace = None);
        }
    };
    let noop = |reason: NoopReason| {
        InstantSpan::RetrieveNoop.record(Some(&span), n);
        engine.emit(BlendEvent::RetrieveNoop { request_id: rid.to_owned(), reason, matches: n });
        // The request ends here unless a later call with the whole table follows.
        end_request(reason == NoopReason::MatchesBeyondAlloc);
        Ok(transfer_result(reason.scatter_ran()))
    };
    // The blend read set: every object group but recurrent state.
    let groups: Vec<usize> = (0..object_groups.len())
        .filter(|&og| inst.objects.get(og).is_none_or(|o| !o.recurrent))
        .collect();
    let staged: Vec<usize> =
        groups.iter().flat_map(|&og| object_groups[og].kernel_groups.iter().copied()).collect();
    // One block table per engine group the scatter writes (LMCache raises without one).
    if let Some(k) = staged
        .iter()
        .filter_map(|&g| kernel_groups.get(g))
        .find(|k| super::lmcache_driven::engine_table(&req.block_ids, k).is_none())
    {
        return Err(bad(
            "block_ids",
            format!(
                "{} block table(s), but a KV group of engine group {} needs its own",
                req.block_ids.len(),
                k.engine_group
            ),
        ));
    }
    let tpb = |g: usize| kernel_groups.get(g).map_or(1, |k| k.tokens_per_block.max(1));
    // Each match with what identifies it as applied: its hash, start and destination blocks.
    let dest = |m: &CbMatch| -> Vec<u64> {
        staged
            .iter()
            .flat_map(|&g| {
                let list = kernel_groups
                    .get(g)
                    .and_then(|k| super::lmcache_driven::engine_table(&req.block_ids, k));
                let (a, b) = (m.cur_st / tpb(g), m.cur_ed.div_ceil(tpb(g)));
                list.map(|l| {
                    l.iter().skip(a as usize).take((b - a) as usize).copied().collect::<Vec<_>>()
                })
                .unwrap_or_default()
            })
            .collect()
    };
    let tagged: Vec<(&CbMatch, crate::blend::AppliedKey)> =
        req.match_results.iter().map(|m| (m, (m.hash.clone(), m.cur_st, dest(m)))).collect();
    let request = (req.key.request_id.clone(), req.key.worker_id);
    let todo = engine.not_applied(&request, &tagged);
    if req.match_results.is_empty() {
        return noop(NoopReason::NoObjectKeys);
    }
    if todo.is_empty() {
        return noop(NoopReason::AlreadyApplied);
    }
    let bound = staged
        .iter()
        .map(|&g| {
            let k = &kernel_groups[g];
            super::lmcache_driven::engine_table(&req.block_ids, k).map_or(0, |l| l.len() as u64)
                * k.tokens_per_block
        })
        .min()
        .unwrap_or(0);
    if todo.iter().any(|(m, _)| m.cur_ed > bound) {
        if todo.iter().all(|(m, _)| m.cur_st >= bound) {
            return noop(NoopReason::MatchesBeyondAlloc);
        }
        return noop(NoopReason::MatchesStraddleAlloc);
    }
    // This worker's objects of each match, read-locked for the copy (the lookup's locks keep
    // them resident meanwhile; these go when the copy ends).
    let worker = req.key.worker_id.unwrap_or(0);
    let mut leases = Vec::with_capacity(todo.len());
    let mut gone = false;
    for (m, _) in &todo {
        let Ok(hash) = <[u8; 32]>::try_from(m.hash.as_slice()) else {
            return Err(bad("match_results", "a hash of other than 32 bytes"));
        };
        let mut objects = Vec::with_capacity(groups.len());
        for &og in &groups {
            let keys = state.object_keys(&req.key, worker, &[ChunkHash(hash)], og as u32)?;
            match state.l1().read_lock(&keys, 1).pop() {
                Some(Ok(lease)) => objects.push((og, lease)),
                _ => gone = true,
            }
        }
        leases.push(objects);
    }
    let scattered = if gone {
        tracing::warn!(request_id = rid, "CB retrieve: a matched chunk left L1");
        Err("a matched chunk left L1".to_owned())
    } else {
        let work: Vec<super::lmcache_driven::ScatterItem<'_>> = todo
            .iter()
            .zip(&leases)
            .map(|((m, _), objs)| (*m, objs.iter().map(|(og, l)| (*og, l.bytes())).collect()))
            .collect();
        let scatter_span = tracing::info_span!("cb.scatter", matches = work.len());
        let t = Instant::now();
        let r = scatter_span.in_scope(|| {
            super::lmcache_driven::blend_scatter(state, id, &req.block_ids, &work, &rope)
        });
        r.map(|w| (w, t.elapsed()))
    };
    let (work, scatter, success) = match scattered {
        Ok((w, t)) => {
            engine.mark_applied(request, todo.iter().map(|(_, k)| k.clone()));
            (w, t, true)
        }
        Err(why) => {
            tracing::warn!(request_id = rid, error = %why, "CB scatter refused");
            (Default::default(), Default::default(), false)
        }
    };
    span.record("success", success);
    engine.emit(BlendEvent::Retrieved {
        request_id: rid.to_owned(),
        chunks: n,
        work,
        dropped: 0,
        success,
        scatter,
        took: t0.elapsed(),
    });
    end_request(false);
    Ok(transfer_result(success))
}
