//! LMCache-driven transfer on the CPU: the server maps the client's `cpu_shm` KV segments
//! and copies between their paged blocks and L1 objects itself.
//!
//! A chunk is visible to lookups by the time its store reply is sent (LMCache commits after
//! replying, so a lookup right after a store can miss). Chunks whose blocks are all the null
//! block are skipped; a resident key is never rewritten; an unregistered instance gets
//! `(b"", false)`; one whose registration was refused gets the same reply, logged and counted
//! with the refusal's reason.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use lmcache_l1::{L1Error, WriteRequest};
use lmcache_memory::ForeignSegment;
use lmcache_protocol::types::{self, CacheKey, EngineGroupInfo, IpcDescriptor};
use lmcache_protocol::{Op, ProtocolError, Request, value};
use rmpv::Value;

use crate::registry::{Family, Instance, LayerTensor, ObjectLayout, Registration};
use crate::state::ServerState;
use crate::transfer::{CpuTransfer, KvTransfer, geometry};

pub(super) fn handle(state: &ServerState, req: &Request) -> Result<Option<Value>, ProtocolError> {
    match req.op {
        Op::RegisterKvCache => {
            req.expect_params(7)?;
            let id = value::u64_("instance_id", &req.params[0])?;
            if let Err(e) = register(state, id, req) {
                let model = value::str_("model_name", &req.params[2]).ok().map(str::to_owned);
                let world_size = value::u32_("world_size", &req.params[3]).ok();
                super::refuse_registration(state, Family::LmcacheDriven, id, model, world_size, &e);
                return Err(e);
            }
            Ok(None)
        }
        Op::UnregisterKvCache => {
            req.expect_params(1)?;
            let id = value::u64_("instance_id", &req.params[0])?;
            state.registry.unregister(Family::LmcacheDriven, id);
            Ok(None)
        }
        Op::Store => {
            req.expect_params(4)?;
            let key = CacheKey::decode("key", &req.params[0])?;
            let id = value::u64_("instance_id", &req.params[1])?;
            let blocks = types::block_ids("block_ids", &req.params[2])?;
            value::bin("event_ipc_handle", &req.params[3])?;
            Ok(Some(types::transfer_result(store(state, &key, id, &blocks)?)))
        }
        Op::Retrieve => {
            req.expect_params(5)?;
            let key = CacheKey::decode("key", &req.params[0])?;
            let id = value::u64_("instance_id", &req.params[1])?;
            let blocks = types::block_ids("block_ids", &req.params[2])?;
            value::bin("event_ipc_handle", &req.params[3])?;
            let skip = value::u64_("skip_first_n_tokens", &req.params[4])?;
            Ok(Some(types::transfer_result(retrieve(state, &key, id, &blocks, skip)?)))
        }
        other => Err(ProtocolError::UnsupportedOp(other.name())),
    }
}

fn bad(field: &str, reason: impl Into<String>) -> ProtocolError {
    ProtocolError::OutOfRange { field: field.to_owned(), reason: reason.into() }
}

/// A client segment name the server may map: inside `--allowed-shm-prefix` when one is set.
fn check_segment_name(state: &ServerState, name: &str) -> Result<(), String> {
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
fn check_segment(state: &ServerState, name: &str, seg: &ForeignSegment) -> Result<(), String> {
    let me = nix::unistd::geteuid().as_raw();
    if seg.owner_uid() != me {
        return Err(format!(
            "segment {name:?} is owned by uid {}, not the server's uid {me}",
            seg.owner_uid()
        ));
    }
    if state.l1().memory().arena().shm_file_id() == Some(seg.file_id()) {
        return Err(format!("segment {name:?} is the server's own L1 pool"));
    }
    Ok(())
}

fn register(state: &ServerState, id: u64, req: &Request) -> Result<(), ProtocolError> {
    let descs = value::array("kv_cache", &req.params[1])?;
    let model = value::str_("model_name", &req.params[2])?;
    let model =
        lmcache_core::ModelName::new(model).map_err(|e| bad("model_name", e.to_string()))?;
    let world_size = value::u32_("world_size", &req.params[3])?;
    lmcache_core::KvRank::new(world_size, 0).map_err(|e| bad("world_size", e.to_string()))?;
    value::str_("engine_type", &req.params[4])?;
    let groups = value::array("engine_group_infos", &req.params[6])?;
    let groups: Vec<EngineGroupInfo> = groups
        .iter()
        .enumerate()
        .map(|(i, g)| EngineGroupInfo::decode(&format!("engine_group_infos[{i}]"), g))
        .collect::<Result<_, _>>()?;
    if groups.len() > 1 {
        return Err(bad(
            "engine_group_infos",
            "hybrid models (several KV groups) are not supported yet",
        ));
    }
    if state.registry.contains(Family::LmcacheDriven, id) {
        state.registry.get(Family::LmcacheDriven, id);
        return Ok(());
    }
    if descs.is_empty() {
        return Err(bad("kv_cache", "no layer tensors"));
    }
    let mut segments: HashMap<String, Arc<ForeignSegment>> = HashMap::new();
    let mut layers = Vec::with_capacity(descs.len());
    for (i, d) in descs.iter().enumerate() {
        let field = format!("kv_cache[{i}]");
        match IpcDescriptor::decode(&field, d)? {
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
    let mla = layers[0].meta.shape.len() == 3;
    let geo = geometry(&layers[0], mla).map_err(|e| bad("kv_cache[0]", e))?;
    for (i, l) in layers.iter().enumerate().skip(1) {
        let g = geometry(l, mla).map_err(|e| bad(&format!("kv_cache[{i}]"), e))?;
        if g != geo {
            return Err(bad(&format!("kv_cache[{i}]"), "layer geometry differs from layer 0"));
        }
    }
    let chunk = state.chunk_size() as u64;
    if geo.block_size == 0 || chunk % geo.block_size != 0 {
        return Err(bad(
            "kv_cache",
            format!("chunk size {chunk} is not a multiple of block size {}", geo.block_size),
        ));
    }
    let layout = ObjectLayout {
        kv: geo.kv,
        layers: layers.len() as u64,
        slots: chunk,
        hidden: geo.hidden,
        dtype: geo.dtype,
    };
    state.storage.bind_layout_dtype(layout.dtype).map_err(|e| {
        bad("kv_cache", format!("{e}; use another serde codec for {}", layout.dtype))
    })?;
    tracing::info!(instance_id = id, model = %model, world_size, layers = layers.len(), shape = ?layout.shape(), dtype = %geo.dtype, "lmcache-driven worker registered");
    // First stores should not pay for untouched memory: commit a few objects ahead.
    state.l1().memory().expect_use(layout.bytes().unwrap_or(0).saturating_mul(4));
    state.registry.register(
        Family::LmcacheDriven,
        id,
        Instance {
            model,
            world_size,
            layout,
            registration: Registration::LmcacheDriven {
                layers,
                block_size: geo.block_size,
                mla,
                num_blocks: geo.num_blocks,
            },
            last_seen: Instant::now(),
            ping_proven: false,
        },
    );
    Ok(())
}

struct Resolved<'a> {
    transfer: CpuTransfer<'a>,
    blocks_per_chunk: usize,
}

fn resolve<'a>(inst: &'a Instance, state: &ServerState) -> Option<Resolved<'a>> {
    let transfer = CpuTransfer::for_instance(inst, state.config.copy_threads)?;
    let blocks_per_chunk = state.chunk_size() / transfer.geometry.block_size as usize;
    Some(Resolved { transfer, blocks_per_chunk })
}

fn chunk_blocks(blocks: &[Vec<u64>], i: usize, bpc: usize) -> Option<&[u64]> {
    blocks.first()?.get(i * bpc..(i + 1) * bpc)
}

fn store(
    state: &ServerState,
    key: &CacheKey,
    id: u64,
    blocks: &[Vec<u64>],
) -> Result<bool, ProtocolError> {
    let t0 = Instant::now();
    state.metrics.submitted_stores.inc();
    let Some(inst) = state.registry.get(Family::LmcacheDriven, id) else {
        return super::refused(state, Family::LmcacheDriven, id).map_or(Ok(false), Err);
    };
    let Some(r) = resolve(&inst, state) else { return Ok(false) };
    let (first, hashes, parent) = state.range_hashes_with_parent(key);
    let n = hashes.len();
    if blocks.first().map_or(0, Vec::len) < n * r.blocks_per_chunk {
        return Err(bad(
            "block_ids",
            format!("{n} chunks need {} block ids", n * r.blocks_per_chunk),
        ));
    }
    let keys = state.object_keys(key, key.worker_id.unwrap_or(0), &hashes)?;
    let size = inst.layout.bytes().unwrap_or(0);
    let null = state.config.null_block_id;
    let wanted: Vec<usize> = (0..n)
        .filter(|&i| {
            chunk_blocks(blocks, i, r.blocks_per_chunk)
                .is_some_and(|b| b.iter().any(|&x| x != null))
        })
        .collect();
    let reqs: Vec<WriteRequest> =
        wanted.iter().map(|&i| WriteRequest::new(keys[i].clone(), size)).collect();
    let mut ok = true;
    let mut filled = Vec::new();
    let mut filled_idx = Vec::new();
    for (&i, res) in wanted.iter().zip(state.storage.reserve_write(&reqs)) {
        match res {
            Ok(mut w) => {
                let Some(b) = chunk_blocks(blocks, i, r.blocks_per_chunk) else { continue };
                w.prefault();
                match r.transfer.gather(b, w.as_mut_slice()) {
                    Ok(()) => {
                        filled.push(w);
                        filled_idx.push(i);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "store gather failed");
                        ok = false;
                    }
                }
            }
            Err(L1Error::NotWritable) => {}
            Err(e) => {
                tracing::debug!(error = %e, "chunk not stored");
                state.bus.publish(crate::event_bus::Event::L1WriteRefused {
                    request_id: key.request_id.clone(),
                    reason: e.to_string(),
                });
            }
        }
    }
    let t_copy = t0.elapsed();
    let results = state.storage.commit(filled);
    let committed: Vec<usize> =
        filled_idx.iter().zip(&results).filter(|(_, r)| r.is_ok()).map(|(&i, _)| i).collect();
    state.metrics.l1_write_chunks.inc_by(committed.len() as u64);
    state.metrics.finished_stores.inc();
    crate::metrics::Metrics::copy_throughput(
        &state.metrics.store_throughput,
        committed.len() as u64 * size,
        t_copy.as_secs_f64(),
    );
    state.record_stored(key, first, &hashes, parent, &committed);
    state.bus.publish(crate::event_bus::Event::Stored {
        request_id: key.request_id.clone(),
        chunks: committed.len(),
        bytes: committed.len() as u64 * size,
    });
    tracing::debug!(
        chunks = committed.len(),
        copy_ms = t_copy.as_secs_f64() * 1e3,
        total_ms = t0.elapsed().as_secs_f64() * 1e3,
        "store"
    );
    Ok(ok)
}

fn retrieve(
    state: &ServerState,
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
    let Some(r) = resolve(&inst, state) else {
        release();
        return Ok(false);
    };
    let n = hashes.len();
    if blocks.first().map_or(0, Vec::len) < n * r.blocks_per_chunk {
        release();
        return Err(bad(
            "block_ids",
            format!("{n} chunks need {} block ids", n * r.blocks_per_chunk),
        ));
    }
    let keys = match state.object_keys(key, key.worker_id.unwrap_or(0), &hashes) {
        Ok(k) => k,
        Err(e) => {
            release();
            return Err(e);
        }
    };
    let mut skip_blocks = (skip_tokens / r.transfer.geometry.block_size) as usize;
    let mut ok = true;
    let mut copied = 0u64;
    let mut chunks = 0usize;
    let t0 = Instant::now();
    state.metrics.submitted_retrieves.inc();
    // Spend the lookup's locks on these chunks (a new lock only where it holds none): each
    // lease is released as soon as its chunk is copied.
    let spent = state.spend_lookup_locks(&key.request_id, shard, first..first + n);
    for (i, lease) in state.storage.retrieve_leases(spent, &keys).into_iter().enumerate() {
        let Ok(lease) = lease else {
            ok = false;
            break;
        };
        let Some(b) = chunk_blocks(blocks, i, r.blocks_per_chunk) else { break };
        let skip = skip_blocks.min(b.len());
        skip_blocks -= skip;
        if let Err(e) = r.transfer.scatter(b, skip, lease.bytes()) {
            tracing::warn!(error = %e, "retrieve scatter failed");
            ok = false;
            break;
        }
        state.metrics.l1_read_chunks.inc();
        state.metrics.chunks_loaded.inc();
        copied += lease.len();
        chunks += 1;
    }
    state.metrics.finished_retrieves.inc();
    state
        .bus
        .publish(crate::event_bus::Event::Retrieved { request_id: key.request_id.clone(), chunks });
    crate::metrics::Metrics::copy_throughput(
        &state.metrics.load_throughput,
        copied,
        t0.elapsed().as_secs_f64(),
    );
    Ok(ok)
}
