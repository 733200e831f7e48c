//! Engine-driven transfer, always in SHM mode: the L1 arena is the shared pool; the client
//! copies into and out of the slots we hand it.
//!
//! prepare_store reserves one object per chunk not already resident and returns their slots;
//! commit_store makes them visible. prepare_retrieve takes this worker's share of the lookup's
//! locks on every chunk of the range (a new lock where the lookup holds none, or it fails) and
//! returns their slots; commit_retrieve releases them. Handles between the two messages are parked in the L1 lease
//! tables, so a client that dies releases them when the lease expires.

use std::time::Instant;

use lmcache_l1::WriteRequest;
use lmcache_protocol::ProtocolError;
use lmcache_protocol::request::{Command, CommitStore, KeyAndInstance};
use lmcache_protocol::types::{self, CacheKey, SlotDesc};
use lmcache_storage::{StorageEvent, StoreSlot};
use rmpv::Value;

use crate::registry::{Family, Instance, ObjectLayout, ObjectShape, Registration};
use crate::registry_file::Saved;
use crate::state::{PendingKey, PendingStore, RequestState};

/// Registers an engine-driven worker: checks its layout against the pool and binds the
/// pool's dtype; the reply names the shared pool. A refusal is its caller's to record
/// (`handle` refuses; a warm restart's replay drops the registration instead).
pub(super) fn register(
    state: &RequestState,
    r: &types::EngineDrivenRegistration,
) -> Result<Value, ProtocolError> {
    let slots = r.num_physical_slots.unwrap_or(state.chunk_size() as u64);
    let layout = ObjectLayout {
        kv: if r.use_mla { 1 } else { 2 },
        layers: r.num_layers,
        slots,
        hidden: r.hidden_dim_size,
        dtype: r.dtype,
    };
    let members = state.l1().member_count();
    if members > 1 {
        // The engine writes and reads the pool by offset: an object another L1 holds would
        // be the wrong bytes. LMCache turns its shared pool off with several L1s too.
        return Err(ProtocolError::OutOfRange {
            field: "payload".into(),
            reason: format!(
                "engine-driven transfer maps one L1 pool, and this server runs {members} L1s \
                 (--l1-manager): use the lmcache_driven transfer mode"
            ),
        });
    }
    let arena = state.l1().memory().arena();
    let fits = layout.bytes().is_some_and(|b| b > 0 && b <= arena.len());
    if !fits {
        return Err(ProtocolError::OutOfRange {
            field: "payload".into(),
            reason: format!("object layout {:?} does not fit the L1 pool", layout.shape()),
        });
    }
    // Without a shared pool the client would fall back to pickle mode, which this
    // server does not serve: every store would fail. Say so now.
    let Some(segment) = arena.engine_segment() else {
        return Err(ProtocolError::OutOfRange {
            field: "payload".into(),
            reason: if arena.file_path().is_some() {
                "engine-driven transfer needs the L1 pool in POSIX shared memory, and \
                     this server's is a file outside /dev/shm (--l1-devdax-path, as \
                     LMCache's): use the lmcache_driven transfer mode, or restart warm in \
                     shared memory (--shm-name NAME --l1-warm-restart)"
            } else {
                "engine-driven transfer needs the L1 pool in POSIX shared memory, and \
                     this server's is private (--l1-use-hugepages); restart it without that \
                     flag"
            }
            .into(),
        });
    };
    let (name, size) = (segment.name.to_owned(), segment.len);
    if let Err(e) = state.storage.bind_layout_dtype(layout.dtype) {
        return Err(ProtocolError::OutOfRange {
            field: "payload.dtype_str".into(),
            reason: e.to_string(),
        });
    }
    // First stores should not pay for untouched memory: commit a few objects ahead.
    state.l1().expect_use(layout.bytes().unwrap_or(0).saturating_mul(4));
    state.registry.register(
        Family::EngineDriven,
        r.instance_id,
        Instance {
            model: r.model_name.clone(),
            world_size: r.world_size,
            objects: vec![ObjectShape::single(layout)],
            registration: Registration::EngineDriven,
            last_seen: Instant::now(),
            ping_proven: false,
        },
    );
    tracing::info!(
        instance_id = r.instance_id,
        model = %r.model_name,
        world_size = r.world_size,
        shape = ?layout.shape(),
        dtype = %layout.dtype,
        "engine-driven worker registered"
    );
    let (_, params) = Command::RegisterEngineDriven(r.clone()).encode();
    let segment = Some((name.clone(), size));
    let (family, id) = (Family::EngineDriven, r.instance_id);
    state.registry.remember(Saved { family, id, params, segment });
    Ok(types::EngineDrivenRegistered { shm_name: name, pool_size: size }.encode())
}

pub(super) fn handle(state: &RequestState, cmd: Command) -> Result<Option<Value>, ProtocolError> {
    match cmd {
        Command::RegisterEngineDriven(r) => register(state, &r).map(Some).inspect_err(|e| {
            super::refuse_registration(
                state,
                Family::EngineDriven,
                r.instance_id,
                Some(r.model_name.to_string()),
                Some(r.world_size),
                e,
            );
        }),
        Command::UnregisterEngineDriven(id) => {
            state.registry.unregister(Family::EngineDriven, id);
            Ok(None)
        }
        Command::PrepareStore(KeyAndInstance { key, instance_id }) => {
            prepare_store(state, &key, instance_id).map(Some)
        }
        Command::CommitStore(CommitStore { key, instance_id, data }) => {
            if !data.is_empty() {
                return Err(ProtocolError::OutOfRange {
                    field: "data".into(),
                    reason: "pickle mode is not supported; map the advertised SHM pool".into(),
                });
            }
            Ok(Some(Value::Boolean(commit_store(state, &key, instance_id)?)))
        }
        Command::PrepareRetrieve(KeyAndInstance { key, instance_id }) => {
            prepare_retrieve(state, &key, instance_id).map(Some)
        }
        Command::CommitRetrieve(KeyAndInstance { key, instance_id }) => {
            Ok(Some(Value::Boolean(commit_retrieve(state, &key, instance_id))))
        }
        other => Err(ProtocolError::UnsupportedOp(other.encode().0.name())),
    }
}

fn instance(state: &RequestState, id: u64) -> Result<Instance, ProtocolError> {
    state.registry.get(Family::EngineDriven, id).ok_or_else(|| {
        super::refused(state, Family::EngineDriven, id).unwrap_or_else(|| {
            ProtocolError::NotServable {
                instance_id: id,
                reason: "not registered for engine-driven transfer".into(),
            }
        })
    })
}

fn slot(layout: &ObjectLayout, offset: u64, length: u64) -> SlotDesc {
    SlotDesc { offset, length, shape: layout.shape(), dtype: layout.dtype }
}

/// Where the pool starts in the segment the engine maps (0 unless L1 is a warm-restart file
/// in /dev/shm, whose catalog comes first): added to every pool offset sent to the client.
fn pool_base(state: &RequestState) -> u64 {
    state.l1().memory().arena().engine_segment().map_or(0, |s| s.base)
}

/// An engine-driven instance's object layout (always one single-part group).
fn layout_of(inst: &Instance) -> Result<ObjectLayout, ProtocolError> {
    inst.single_layout().copied().ok_or_else(|| ProtocolError::OutOfRange {
        field: "instance_id".into(),
        reason: "engine-driven transfer serves one KV group only".into(),
    })
}

fn prepare_store(state: &RequestState, key: &CacheKey, id: u64) -> Result<Value, ProtocolError> {
    let inst = instance(state, id)?;
    let layout = layout_of(&inst)?;
    state.storage.announce(&StorageEvent::StoreStarted { request_id: &key.request_id });
    let size = layout.bytes().unwrap_or(0);
    let (first, hashes) = state.range_hashes(key);
    let shard = key.worker_id.unwrap_or(0);
    let keys = state.object_keys(key, shard, &hashes, 0)?;
    let ctx = state.context(key, shard, first, &hashes, None, &inst.objects);
    let reqs: Vec<WriteRequest> = keys.iter().map(|k| WriteRequest::new(k.clone(), size)).collect();
    let mut slots = Vec::new();
    let mut indices = Vec::new();
    let mut leases = Vec::new();
    let base = pool_base(state);
    // A chunk another writer is still staging gets a slot of this store's own: the client's
    // commit never counts on that writer finishing.
    for (i, r) in state.storage.scope(&ctx).reserve_for_store(0, &reqs).into_iter().enumerate() {
        match r {
            StoreSlot::Write(w) => {
                // Allocate the tmpfs pages here, so the client's copy only maps them.
                w.prefault();
                slots.push(slot(&layout, base + w.offset(), w.len()));
                indices.push(i as u64);
                leases.push(state.l1().park_write(w));
            }
            StoreSlot::Resident => {}
            StoreSlot::Refused(e) => tracing::debug!(error = %e, "chunk not stored"),
        }
    }
    if !leases.is_empty() {
        let pk = PendingKey::new(id, key, &hashes);
        let pending = PendingStore { since: Instant::now(), leases };
        let old = state.pending.stores.lock().insert(pk, pending);
        discard_parked_writes(state, old);
    }
    Ok(types::PrepareStoreResponse { slots, chunk_indices: indices }.encode())
}

fn discard_parked_writes(state: &RequestState, old: Option<PendingStore>) {
    for id in old.map(|p| p.leases).unwrap_or_default() {
        drop(state.l1().take_write(id));
    }
}

fn commit_store(state: &RequestState, key: &CacheKey, id: u64) -> Result<bool, ProtocolError> {
    let inst = instance(state, id)?;
    let (first, hashes, parent) = state.range_hashes_with_parent(key);
    let pk = PendingKey::new(id, key, &hashes);
    let Some(PendingStore { leases: ids, .. }) = state.pending.stores.lock().remove(&pk) else {
        return Ok(false);
    };
    // Every chunk prepare reserved must be committed, including any whose reservation expired.
    let expected = ids.len();
    let writes: Vec<_> = ids.into_iter().filter_map(|i| state.l1().take_write(i)).collect();
    // Which chunk of the range each reservation is: match by key.
    let idx: Vec<usize> = writes
        .iter()
        .filter_map(|w| hashes.iter().position(|h| *h == w.key().chunk_hash))
        .collect();
    let ctx = state.context(key, key.worker_id.unwrap_or(0), first, &hashes, parent, &inst.objects);
    let storage = state.storage.scope(&ctx);
    let results = storage.commit(writes);
    let committed: Vec<usize> =
        idx.iter().zip(&results).filter(|(_, r)| r.is_ok()).map(|(&i, _)| i).collect();
    let span = tracing::Span::current();
    span.record("request_id", key.request_id.as_str());
    span.record("chunks", committed.len());
    storage.store_finished(&committed, 0, None);
    Ok(committed.len() == expected)
}

fn prepare_retrieve(state: &RequestState, key: &CacheKey, id: u64) -> Result<Value, ProtocolError> {
    let inst = instance(state, id)?;
    let layout = layout_of(&inst)?;
    state.storage.announce(&StorageEvent::RetrieveStarted { request_id: &key.request_id });
    let (first, hashes) = state.range_hashes(key);
    let keys = state.object_keys(key, key.worker_id.unwrap_or(0), &hashes, 0)?;
    // Spend this worker's share of the lookup's locks (a new lock only where it holds none);
    // from here on commit_retrieve releases what this parks, and nothing of the lookup's.
    let shard = key.worker_id.unwrap_or(0) as usize;
    let spent = state.spend_lookup_locks(&key.request_id, shard, first..first + hashes.len());
    let ctx = state.context(key, shard as u32, first, &hashes, None, &inst.objects);
    let leases: Result<Vec<_>, _> =
        state.storage.scope(&ctx).retrieve_leases(spent, &keys).into_iter().collect();
    let pk = PendingKey::new(id, key, &hashes);
    // Each object must have this instance's layout: a slot is the client's copy length.
    let want = layout.bytes();
    let leases = match leases {
        Ok(l) if !l.is_empty() && l.iter().all(|x| Some(x.len()) == want) => l,
        Ok(l) if !l.is_empty() => {
            tracing::warn!(
                request_id = %key.request_id,
                expected = ?want,
                got = ?l.iter().map(|x| x.len()).collect::<Vec<_>>(),
                "prepare_retrieve: objects of another layout than the instance registered"
            );
            park_retrieve(state, pk, None);
            return Ok(types::PrepareRetrieveResponse::FAILED.encode());
        }
        _ => {
            park_retrieve(state, pk, None);
            return Ok(types::PrepareRetrieveResponse::FAILED.encode());
        }
    };
    let base = pool_base(state);
    let slots: Vec<SlotDesc> =
        leases.iter().map(|l| slot(&layout, base + l.offset(), l.len())).collect();
    let parked: Vec<_> = leases.into_iter().map(|l| state.l1().park_read(l)).collect();
    park_retrieve(state, pk, Some(parked));
    Ok(types::PrepareRetrieveResponse { success: true, slots }.encode())
}

/// Parks a prepared retrieve's leases (`None`: it failed, having spent the lookup's locks),
/// releasing any earlier one of the same transfer.
fn park_retrieve(state: &RequestState, pk: PendingKey, parked: Option<Vec<lmcache_l1::LeaseId>>) {
    let old = state.pending.retrieves.lock().insert(pk, (Instant::now(), parked));
    for lid in old.and_then(|(_, v)| v).unwrap_or_default() {
        drop(state.l1().take_read(lid));
    }
}

fn commit_retrieve(state: &RequestState, key: &CacheKey, id: u64) -> bool {
    let (first, hashes) = state.range_hashes(key);
    let pk = PendingKey::new(id, key, &hashes);
    let parked = state.pending.retrieves.lock().remove(&pk);
    match parked {
        Some((_, Some(ids))) => {
            let n = ids.iter().filter_map(|i| state.l1().take_read(*i)).count();
            state.storage.announce(&StorageEvent::RetrieveFinished {
                request_id: &key.request_id,
                chunks: n,
                bytes: 0,
                copy_time: None,
            });
            true
        }
        // Prepared and failed: the lookup's locks were spent then.
        Some((_, None)) => false,
        None => {
            // Never prepared: this worker's share of the lookup's locks goes now.
            let shard = key.worker_id.unwrap_or(0) as usize;
            state.release_lookup_locks(&key.request_id, shard, first..first + hashes.len());
            false
        }
    }
}
