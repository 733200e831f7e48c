//! LMCache-driven transfer on the CPU: the server maps the client's `cpu_shm` KV segments
//! and copies between their paged blocks and L1 objects itself.
//!
//! A chunk is visible to lookups by the time its store reply is sent (LMCache commits after
//! replying, so a lookup right after a store can miss), also when another writer holds the
//! same chunks staged: this store then writes its own copy
//! ([`lmcache_storage::StorageManager::reserve_for_store`]). Chunks whose blocks are all the null
//! block are skipped; a resident key is never rewritten; an unregistered instance gets
//! `(b"", false)`; one whose registration was refused gets the same reply, logged and counted
//! with the refusal's reason.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use lmcache_l1::WriteRequest;
use lmcache_memory::ForeignSegment;
use lmcache_protocol::ProtocolError;
use lmcache_protocol::request::{Command, RegisterKvCache, Retrieve, Store};
use lmcache_protocol::types::{self, CacheKey, IpcDescriptor};
use lmcache_storage::{StorageEvent, StoreSlot};
use rmpv::Value;

use super::bad;
use crate::registry::{Family, Instance, KernelGroup, LayerTensor, Registration};
use crate::registry_file::Saved;
use crate::state::RequestState;
use crate::transfer::{CpuTransfer, KvTransfer};

pub(super) fn handle(state: &RequestState, cmd: Command) -> Result<Option<Value>, ProtocolError> {
    match cmd {
        Command::RegisterKvCache(r) => {
            if let Err(e) = register(state, &r) {
                let model = Some(r.model_name.clone());
                let ws = Some(r.world_size);
                super::refuse_registration(
                    state,
                    Family::LmcacheDriven,
                    r.instance_id,
                    model,
                    ws,
                    &e,
                );
                return Err(e);
            }
            Ok(None)
        }
        Command::UnregisterKvCache(id) => {
            state.registry.unregister(Family::LmcacheDriven, id);
            Ok(None)
        }
        Command::Store(Store { key, instance_id, block_ids, .. }) => {
            Ok(Some(types::transfer_result(store(state, &key, instance_id, &block_ids)?)))
        }
        Command::Retrieve(Retrieve {
            key, instance_id, block_ids, skip_first_n_tokens, ..
        }) => {
            let ok = retrieve(state, &key, instance_id, &block_ids, skip_first_n_tokens)?;
            Ok(Some(types::transfer_result(ok)))
        }
        other => Err(ProtocolError::UnsupportedOp(other.encode().0.name())),
    }
}

/// A client segment name the server may map: inside `--allowed-shm-prefix` when one is set.
fn check_segment_name(state: &RequestState, name: &str) -> Result<(), String> {
    let bare = name.strip_prefix('/').unwrap_or(name);
    match &state.config.allowed_shm_prefix {
        Some(p) if !bare.starts_with(p.as_str()) => {
            Err(format!("segment {name:?} is outside --allowed-shm-prefix {p:?}"))
        }
        _ => Ok(()),
    }
}

/// A mapped client segment the server may use: owned by the server's own uid (a segment of
/// another user is not this client's to hand over), and not the server's own L1 pool (which
/// a client could otherwise have the server copy over itself).
fn check_segment(state: &RequestState, name: &str, seg: &ForeignSegment) -> Result<(), String> {
    let me = nix::unistd::geteuid().as_raw();
    if seg.owner_uid() != me {
        return Err(format!(
            "segment {name:?} is owned by uid {}, not the server's uid {me}",
            seg.owner_uid()
        ));
    }
    for (tag, member) in state.l1().members() {
        if member.memory().arena().file_id() == Some(seg.file_id()) {
            return Err(format!("segment {name:?} is the server's own L1 pool ({tag})"));
        }
    }
    Ok(())
}

/// Maps a client segment the server may read, with the checks a KV registration's get: its
/// name inside `--allowed-shm-prefix`, owned by the server's uid, not the server's own pool.
pub(super) fn open_client_segment(
    state: &RequestState,
    name: &str,
    nbytes: u64,
) -> Result<ForeignSegment, String> {
    check_segment_name(state, name)?;
    let seg =
        ForeignSegment::open(name, nbytes).map_err(|e| format!("cannot map {name:?}: {e}"))?;
    check_segment(state, name, &seg)?;
    Ok(seg)
}

pub(super) fn register(state: &RequestState, r: &RegisterKvCache) -> Result<(), ProtocolError> {
    let id = r.instance_id;
    let model = lmcache_core::ModelName::new(&r.model_name)
        .map_err(|e| bad("model_name", e.to_string()))?;
    let world_size = r.world_size;
    lmcache_core::KvRank::new(world_size, 0).map_err(|e| bad("world_size", e.to_string()))?;
    let groups = &r.engine_group_infos;
    // A worker that registers again is served from what it registers now (it may be a new
    // process under the same instance id: LMCache's bench always uses 1000 + rank, and a
    // warm restart may have taken back the previous process's registration).
    let descs = &r.kv_cache;
    if descs.is_empty() {
        return Err(bad("kv_cache", "no layer tensors"));
    }
    let mut segments: HashMap<String, Arc<ForeignSegment>> = HashMap::new();
    let mut layers = Vec::with_capacity(descs.len());
    for (i, d) in descs.iter().enumerate() {
        let field = format!("kv_cache[{i}]");
        match d.clone() {
            IpcDescriptor::CpuShm { shm_name, nbytes, meta } => {
                let seg = match segments.get(&shm_name) {
                    Some(s) if s.len() >= nbytes => Arc::clone(s),
                    _ => {
                        check_segment_name(state, &shm_name).map_err(|r| bad(&field, r))?;
                        let s = ForeignSegment::open(&shm_name, nbytes)
                            .map_err(|e| bad(&field, format!("cannot map {shm_name:?}: {e}")))?;
                        // Nothing of it was touched yet: refusing now reads and writes nothing.
                        check_segment(state, &shm_name, &s).map_err(|r| bad(&field, r))?;
                        let s = Arc::new(s);
                        segments.insert(shm_name.clone(), Arc::clone(&s));
                        s
                    }
                };
                layers.push(LayerTensor { segment: seg, meta });
            }
            IpcDescriptor::Device { kind } => {
                return Err(bad(
                    &field,
                    format!(
                        "{kind:?} memory needs a GPU backend; this server copies on the CPU \
                         (cpu_shm); start the engine workers with \
                         LMCACHE_MP_TRANSFER_MODE=engine_driven (they then copy through this \
                         server's shared L1 pool), or register cpu_shm tensors"
                    ),
                ));
            }
        }
    }
    let chunk = state.chunk_size() as u64;
    let groups =
        crate::kv_groups::build(&layers, groups, chunk, state.config.separate_object_groups)
            .map_err(|(field, reason)| bad(&field, reason))?;
    let mut dtypes: Vec<lmcache_core::Dtype> = Vec::new();
    for part in groups.objects.iter().flat_map(|o| &o.parts) {
        if !dtypes.contains(&part.dtype) {
            dtypes.push(part.dtype);
        }
    }
    for d in &dtypes {
        state
            .storage
            .bind_layout_dtype(*d)
            .map_err(|e| bad("kv_cache", format!("{e}; use another serde codec for {d}")))?;
    }
    let bytes: Vec<u64> = groups.objects.iter().map(|o| o.bytes().unwrap_or(0)).collect();
    if bytes.iter().any(|&b| b == 0 || b > state.l1().largest_object()) {
        return Err(bad(
            "kv_cache",
            format!("objects of {bytes:?} bytes: empty, or larger than the L1 pool"),
        ));
    }
    tracing::info!(
        instance_id = id,
        model = %model,
        world_size,
        layers = layers.len(),
        kernel_groups = groups.kernel_groups.len(),
        object_groups = groups.object_groups.len(),
        object_bytes = ?bytes,
        "lmcache-driven worker registered"
    );
    // First stores should not pay for untouched memory: commit a few objects ahead.
    state.l1().expect_use(bytes.iter().sum::<u64>().saturating_mul(4));
    state.registry.register(
        Family::LmcacheDriven,
        id,
        Instance {
            model,
            world_size,
            objects: groups.objects,
            registration: Registration::LmcacheDriven {
                kernel_groups: groups.kernel_groups,
                object_groups: groups.object_groups,
                num_layers: layers.len(),
            },
            last_seen: Instant::now(),
            ping_proven: false,
        },
    );
    let (_, params) = Command::RegisterKvCache(r.clone()).encode();
    state.registry.remember(Saved { family: Family::LmcacheDriven, id, params, segment: None });
    Ok(())
}

/// A registration's kernel groups as copy loops, and its object groups.
struct Plan<'a> {
    transfers: Vec<CpuTransfer<'a>>,
    kernel_groups: &'a [KernelGroup],
    object_groups: &'a [crate::registry::ObjectGroup],
}

fn plan<'a>(inst: &'a Instance, threads: usize) -> Option<Plan<'a>> {
    let Registration::LmcacheDriven { kernel_groups, object_groups, .. } = &inst.registration
    else {
        return None;
    };
    let (transfers, _) = crate::transfer::kernel_transfers(inst, threads)?;
    Some(Plan { transfers, kernel_groups, object_groups })
}

impl Plan<'_> {
    /// Checks that every kernel group's block list covers `n` chunks (LMCache fails closed).
    fn check_blocks(&self, blocks: &[Vec<u64>], n: usize) -> Result<(), ProtocolError> {
        for (g, k) in self.kernel_groups.iter().enumerate() {
            let have = blocks.get(k.view).map_or(0, Vec::len);
            if have < n * k.blocks_per_chunk {
                return Err(bad(
                    "block_ids",
                    format!(
                        "{n} chunks need {} block ids for KV group {g}, got {have} ({} lists \
                         for {} groups)",
                        n * k.blocks_per_chunk,
                        blocks.len(),
                        self.kernel_groups.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Kernel group `g`'s blocks of chunk `i`: all of the chunk's, or its window's last ones.
    fn chunk_blocks<'b>(&self, blocks: &'b [Vec<u64>], g: usize, i: usize) -> &'b [u64] {
        let k = &self.kernel_groups[g];
        let all = blocks
            .get(k.view)
            .and_then(|b| b.get(i * k.blocks_per_chunk..(i + 1) * k.blocks_per_chunk))
            .unwrap_or_default();
        &all[all.len().saturating_sub(k.kept_blocks)..]
    }

    /// Whether object group `og` has anything but null blocks in chunk `i` (LMCache skips
    /// all-null chunks: align-mode Mamba layers hold state only in the last one).
    fn has_data(&self, blocks: &[Vec<u64>], og: usize, i: usize, null: u64) -> bool {
        self.object_groups[og].kernel_groups.iter().any(|&g| {
            let k = &self.kernel_groups[g];
            blocks
                .get(k.view)
                .and_then(|b| b.get(i * k.blocks_per_chunk..(i + 1) * k.blocks_per_chunk))
                .is_some_and(|b| b.iter().any(|&x| x != null))
        })
    }

    /// Each kernel group's part of an object of group `og`: (kernel group, byte range).
    fn parts(&self, og: usize) -> Vec<(usize, std::ops::Range<usize>)> {
        let mut at = 0usize;
        self.object_groups[og]
            .kernel_groups
            .iter()
            .map(|&g| {
                let t = &self.transfers[g];
                let len = (t.geometry.kv
                    * t.layers.len() as u64
                    * self.kernel_groups[g].kept_blocks as u64
                    * t.geometry.block_bytes()) as usize;
                let r = at..at + len;
                at += len;
                (g, r)
            })
            .collect()
    }

    fn gather(
        &self,
        blocks: &[Vec<u64>],
        og: usize,
        i: usize,
        object: &mut [u8],
    ) -> Result<(), crate::transfer::TransferError> {
        let got = object.len() as u64;
        for (g, r) in self.parts(og) {
            let part =
                object.get_mut(r.clone()).ok_or(crate::transfer::TransferError::ObjectSize {
                    expected: r.end as u64,
                    got,
                })?;
            self.transfers[g].gather(self.chunk_blocks(blocks, g, i), part)?;
        }
        Ok(())
    }

    /// Writes an object of group `og` into chunk `i`'s blocks, leaving the first
    /// `skip_tokens` tokens of the chunk untouched (vLLM's own prefix cache holds them).
    fn scatter(
        &self,
        blocks: &[Vec<u64>],
        og: usize,
        i: usize,
        skip_tokens: u64,
        object: &[u8],
    ) -> Result<(), crate::transfer::TransferError> {
        for (g, r) in self.parts(og) {
            let part = object.get(r.clone()).ok_or(crate::transfer::TransferError::ObjectSize {
                expected: r.end as u64,
                got: object.len() as u64,
            })?;
            let k = &self.kernel_groups[g];
            // Skipped blocks of the whole chunk, less those outside a sub-chunk window.
            let skip = (skip_tokens / k.tokens_per_block) as usize;
            let skip = skip.saturating_sub(k.blocks_per_chunk - k.kept_blocks);
            let b = self.chunk_blocks(blocks, g, i);
            self.transfers[g].scatter(b, skip.min(b.len()), part)?;
        }
        Ok(())
    }
}

/// Kernel group `k`'s block table in a CacheBlend retrieve: one table per engine group,
/// indexed by its id (LMCache's `gpu_block_ids[engine_group_idx]`; kernel groups of one engine
/// group share it).
pub(super) fn engine_table<'b>(blocks: &'b [Vec<u64>], k: &KernelGroup) -> Option<&'b Vec<u64>> {
    usize::try_from(k.engine_group).ok().and_then(|g| blocks.get(g))
}

/// One match to scatter: the match, and its objects (object group, bytes) of this worker.
pub(super) type ScatterItem<'a> =
    (&'a lmcache_protocol::types::blend::CbMatch, Vec<(usize, &'a [u8])>);

/// CacheBlend's scatter: each match's chunk objects (every blend object group, this worker's
/// shard) written into `blocks` at its new positions `[cur_st, cur_st + chunk)`, one
/// destination block's run of tokens at a time: V as stored, K re-rotated from `old_st + t`
/// to `cur_st + t` by the worker's rope state (widened to `f32` a run at a time, rotated,
/// narrowed back: `f32`, `f16`, `bf16`, fp8). A sliding-window group writes the tokens it
/// kept, the chunk's last. Every slot outside the matched ranges is left alone. The whole
/// geometry of every group and match is checked before the first write; refused (nothing
/// written, and the caller answers "not ran"): compressed blocks, a rotation the rope state
/// cannot serve, objects shorter than their layout, a match past the block table.
pub(super) fn blend_scatter(
    state: &RequestState,
    id: u64,
    blocks: &[Vec<u64>],
    matches: &[ScatterItem<'_>],
    rope: &crate::blend::RopeState,
) -> Result<crate::blend_telemetry::ScatterWork, String> {
    use crate::blend_telemetry::ScatterWork;
    let inst =
        state.registry.get(Family::LmcacheDriven, id).ok_or("the worker is not registered")?;
    let p = plan(&inst, 1).ok_or("not an lmcache-driven registration")?;
    let chunk = state.chunk_size() as u64;
    // Every (match, kernel group) checked and planned first.
    let mut parts = Vec::new();
    for (m, objects) in matches {
        for &(og, object) in objects {
            if og >= p.object_groups.len() {
                return Err(format!("object group {og} is not registered"));
            }
            for (g, r) in p.parts(og) {
                let src = object.get(r).ok_or("the object is shorter than its layout")?;
                let k = &p.kernel_groups[g];
                let geo = p.transfers[g].geometry;
                if k.tokens_per_block != geo.block_size || k.tokens_per_block == 0 {
                    return Err(format!("kernel group {g}: compressed blocks"));
                }
                let slots = k.kept_blocks as u64 * geo.block_size;
                if slots > chunk {
                    return Err(format!("kernel group {g}: {slots} slots in a chunk of {chunk}"));
                }
                let table = engine_table(blocks, k).ok_or("no block table for an engine group")?;
                if (m.cur_ed).div_ceil(k.tokens_per_block) > table.len() as u64 {
                    return Err("a match past the block table".into());
                }
                // A chunk served at its own position (a segmented prefix) is copied as stored.
                let rot = if m.old_st == m.cur_st {
                    None
                } else {
                    rope.for_group(k.engine_group, geo.hidden, geo.kv, geo.dtype)?
                };
                if let Some(r) = &rot {
                    let last = (m.old_ed.max(m.cur_ed) - 1) as usize;
                    if last >= r.cache.positions() {
                        return Err(format!(
                            "position {last} is past the cos/sin cache's {} rows",
                            r.cache.positions()
                        ));
                    }
                }
                parts.push(Part { m, g, src, slots, rot });
            }
        }
    }
    let mut work = ScatterWork::default();
    for (m, _) in matches {
        if m.old_st == m.cur_st {
            work.prefix_chunks += 1;
        } else {
            work.shifted_chunks += 1;
        }
        work.tokens += chunk;
    }
    for part in &parts {
        scatter_part(state, &p, part, blocks, rope)?;
    }
    Ok(work)
}

/// One match's part of one kernel group, checked by [`blend_scatter`] before any write.
struct Part<'a> {
    /// The match.
    m: &'a lmcache_protocol::types::blend::CbMatch,
    /// The kernel group.
    g: usize,
    /// Its bytes in the match's object.
    src: &'a [u8],
    /// Tokens it stores per chunk (a window keeps the chunk's last).
    slots: u64,
    /// How its K is re-rotated (`None`: written as stored).
    rot: Option<crate::blend::GroupRotation<'a>>,
}

/// Rotated scatters at least this large spread their slabs over the CPU's cores: the
/// rotation is compute (a plain copy is not, and keeps `--copy-threads`).
const PARALLEL_ROTATION_BYTES: usize = 8 << 20;

/// One match's part of one kernel group: each (plane, layer) slab written one destination
/// block's run of rows at a time, K rotated into a reused buffer (of words, so its bytes are
/// aligned for any element type) on the way. Large rotated parts spread their slabs over
/// threads (disjoint destination rows, so no two threads write the same bytes).
fn scatter_part(
    state: &RequestState,
    p: &Plan<'_>,
    part: &Part<'_>,
    blocks: &[Vec<u64>],
    rope: &crate::blend::RopeState,
) -> Result<(), String> {
    let Part { m, g, src, slots, .. } = *part;
    let rot = part.rot.as_ref();
    let chunk = state.chunk_size() as u64;
    let (k, t) = (&p.kernel_groups[g], &p.transfers[g]);
    let geo = t.geometry;
    let row_bytes = (geo.hidden * geo.dtype.itemsize()) as usize;
    let hidden = geo.hidden as usize;
    let slab = slots as usize * row_bytes;
    let table = engine_table(blocks, k).ok_or("no block table for an engine group")?;
    // The first chunk token a stored row holds (a window keeps the chunk's last).
    let first = chunk - slots;
    let deltas = match rot {
        Some(r) => (first..chunk)
            .map(|i| r.cache.delta((m.old_st + i) as usize, (m.cur_st + i) as usize))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?,
        None => Vec::new(),
    };
    let one_slab = |plane: u64, l: usize, out: &mut Vec<u32>, wide: &mut Vec<f32>| {
        let at = (plane as usize * t.layers.len() + l) * slab;
        let src = src.get(at..at + slab).ok_or("the object is shorter than its slabs")?;
        let mut i = 0u64;
        while i < slots {
            let pos = m.cur_st + first + i;
            let block = *table
                .get((pos / k.tokens_per_block) as usize)
                .ok_or("a match past the block table")?;
            let in_block = pos % k.tokens_per_block;
            let n = (k.tokens_per_block - in_block).min(slots - i);
            let rows = &src[i as usize * row_bytes..(i + n) as usize * row_bytes];
            let rows = match (rot, plane) {
                (Some(r), 0) => {
                    out.resize(rows.len().div_ceil(4), 0);
                    let dst = &mut bytemuck::cast_slice_mut::<u32, u8>(out)[..rows.len()];
                    lmcache_blend::rotate_rows(
                        r.format,
                        rows,
                        dst,
                        hidden,
                        &deltas[i as usize..(i + n) as usize],
                        r.row,
                        rope.style,
                        wide,
                    )
                    .map_err(|e| e.to_string())?;
                    &*dst
                }
                _ => rows,
            };
            t.write_token_rows(l, plane, block, in_block, rows).map_err(|e| e.to_string())?;
            i += n;
        }
        Ok::<(), String>(())
    };
    let slabs: Vec<(u64, usize)> =
        (0..geo.kv).flat_map(|plane| (0..t.layers.len()).map(move |l| (plane, l))).collect();
    let threads = if rot.is_some() && slab * slabs.len() >= PARALLEL_ROTATION_BYTES {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
    } else {
        1
    };
    if threads <= 1 {
        let (mut out, mut wide) = (Vec::new(), Vec::new());
        return slabs
            .into_iter()
            .try_for_each(|(plane, l)| one_slab(plane, l, &mut out, &mut wide));
    }
    // Round-robin, so each thread gets its share of the rotated (K) slabs.
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|th| {
                let mine: Vec<(u64, usize)> =
                    slabs.iter().copied().skip(th).step_by(threads).collect();
                let one_slab = &one_slab;
                scope.spawn(move || {
                    let (mut out, mut wide) = (Vec::new(), Vec::new());
                    mine.into_iter()
                        .try_for_each(|(plane, l)| one_slab(plane, l, &mut out, &mut wide))
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().unwrap_or_else(|_| Err("a scatter thread panicked".into())))
    })
}

fn store(
    state: &RequestState,
    key: &CacheKey,
    id: u64,
    blocks: &[Vec<u64>],
) -> Result<bool, ProtocolError> {
    let t0 = Instant::now();
    state.storage.announce(&StorageEvent::StoreStarted { request_id: &key.request_id });
    let Some(inst) = state.registry.get(Family::LmcacheDriven, id) else {
        return super::refused(state, Family::LmcacheDriven, id).map_or(Ok(false), Err);
    };
    let Some(p) = plan(&inst, state.config.copy_threads) else { return Ok(false) };
    let (first, hashes, parent) = state.range_hashes_with_parent(key);
    let n = hashes.len();
    p.check_blocks(blocks, n)?;
    let shard = key.worker_id.unwrap_or(0);
    let ctx = state.context(key, shard, first, &hashes, parent, &inst.objects);
    let storage = state.storage.scope(&ctx);
    let null = state.config.null_block_id;
    let mut ok = true;
    let mut bytes = 0u64;
    // Per chunk: whether every object group holding data for it has it stored.
    let mut stored = vec![true; n];
    let mut any = vec![false; n];
    for og in 0..p.object_groups.len() {
        let keys = state.object_keys(key, shard, &hashes, og as u32)?;
        let size = inst.objects.get(og).and_then(|o| o.bytes()).unwrap_or(0);
        let wanted: Vec<usize> = (0..n).filter(|&i| p.has_data(blocks, og, i, null)).collect();
        let reqs: Vec<WriteRequest> =
            wanted.iter().map(|&i| WriteRequest::new(keys[i].clone(), size)).collect();
        let mut filled = Vec::new();
        let mut filled_idx = Vec::new();
        for (&i, res) in wanted.iter().zip(storage.reserve_for_store(og as u32, &reqs)) {
            any[i] = true;
            match res {
                StoreSlot::Write(mut w) => {
                    w.prefault();
                    match p.gather(blocks, og, i, w.as_mut_slice()) {
                        Ok(()) => {
                            filled.push(w);
                            filled_idx.push(i);
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "store gather failed");
                            stored[i] = false;
                            ok = false;
                        }
                    }
                }
                // Visible already (a chunk another writer is still staging was reserved
                // again for this store, which never counts on that writer).
                StoreSlot::Resident => {}
                StoreSlot::Refused(e) => {
                    stored[i] = false;
                    tracing::debug!(error = %e, "chunk not stored");
                }
            }
        }
        let results = storage.commit(filled);
        for (&i, r) in filled_idx.iter().zip(&results) {
            match r {
                Ok(_) => bytes += size,
                Err(_) => stored[i] = false,
            }
        }
    }
    let t_copy = t0.elapsed();
    let committed: Vec<usize> = (0..n).filter(|&i| any[i] && stored[i]).collect();
    let span = tracing::Span::current();
    span.record("request_id", key.request_id.as_str());
    span.record("chunks", committed.len());
    storage.store_finished(&committed, bytes, Some(t_copy));
    if let Some(blend) = &state.blend {
        let raw: Vec<[u8; 32]> = hashes.iter().map(|h| h.0).collect();
        blend.on_store(key, &raw, &committed);
        if blend.records_prompts() && !committed.is_empty() {
            let chunks = key.end / state.chunk_size();
            let chain =
                state.sessions.with(&key.request_id, |s| s.chunk_hashes(&key.token_ids, chunks));
            blend.record_prompt(key, &chain.iter().map(|h| h.0).collect::<Vec<_>>());
        }
    }
    tracing::debug!(
        chunks = committed.len(),
        copy_ms = t_copy.as_secs_f64() * 1e3,
        total_ms = t0.elapsed().as_secs_f64() * 1e3,
        "store"
    );
    Ok(ok)
}

fn retrieve(
    state: &RequestState,
    key: &CacheKey,
    id: u64,
    blocks: &[Vec<u64>],
    skip_tokens: u64,
) -> Result<bool, ProtocolError> {
    let (first, hashes) = state.range_hashes(key);
    let shard = key.worker_id.unwrap_or(0) as usize;
    let release =
        || state.release_lookup_locks(&key.request_id, shard, first..first + hashes.len());
    let Some(inst) = state.registry.get(Family::LmcacheDriven, id) else {
        release();
        return super::refused(state, Family::LmcacheDriven, id).map_or(Ok(false), Err);
    };
    let Some(p) = plan(&inst, state.config.copy_threads) else {
        release();
        return Ok(false);
    };
    let n = hashes.len();
    if let Err(e) = p.check_blocks(blocks, n) {
        release();
        return Err(e);
    }
    let ctx = state.context(key, shard as u32, first, &hashes, None, &inst.objects);
    let storage = state.storage.scope(&ctx);
    let chunk = state.chunk_size() as u64;
    let mut ok = true;
    let mut copied = 0u64;
    let mut chunks = 0usize;
    let t0 = Instant::now();
    state.storage.announce(&StorageEvent::RetrieveStarted { request_id: &key.request_id });
    // Spend the lookup's locks on these chunks (a new lock only where it holds none): each
    // lease is released as soon as its chunk is copied.
    let mut spent = Some(state.spend_lookup_locks(&key.request_id, shard, first..first + n));
    for og in 0..p.object_groups.len() {
        let keys = match state.object_keys(key, shard as u32, &hashes, og as u32) {
            Ok(k) => k,
            Err(e) => {
                release();
                return Err(e);
            }
        };
        // A windowed group restores only the last chunks of the range (its window).
        let from = match inst.objects.get(og).and_then(|o| o.window_chunks) {
            Some(w) => n.saturating_sub(w as usize),
            None => 0,
        };
        // The lookup locked object group 0; the others take a lock of their own here. Locks
        // on chunks before a window are released unread.
        let mut locks = match (og, spent.take()) {
            (0, Some(s)) => s,
            (_, s) => {
                drop(s);
                (0..n).map(|_| None).collect()
            }
        };
        let locks = locks.split_off(from.min(locks.len()));
        let leases = storage.retrieve_leases(locks, &keys[from..]);
        for (i, lease) in (from..).zip(leases) {
            let Ok(lease) = lease else {
                ok = false;
                break;
            };
            let chunk_skip = skip_tokens.saturating_sub(i as u64 * chunk).min(chunk);
            if let Err(e) = p.scatter(blocks, og, i, chunk_skip, lease.bytes()) {
                tracing::warn!(error = %e, "retrieve scatter failed");
                ok = false;
                break;
            }
            if og == 0 {
                chunks += 1;
            }
            copied += lease.len();
        }
        if !ok {
            break;
        }
    }
    state.storage.announce(&StorageEvent::RetrieveFinished {
        request_id: &key.request_id,
        chunks,
        bytes: copied,
        copy_time: Some(t0.elapsed()),
    });
    Ok(ok)
}
