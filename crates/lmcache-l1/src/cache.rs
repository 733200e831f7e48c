//! The L1 object store: index, lifecycle, synchronous and background eviction, quotas.
//!
//! # Lifecycle
//! ```text
//! absent ──reserve_write──▶ staged ──commit──▶ resident ⇄ read-locked(n)
//!                             │  └─discard/drop─▶ absent        │
//!                             │                 evict (n = 0) ──┴──▶ absent
//!                        delete(force): unindexed, freed when the last handle goes
//! ```
//! Every transition goes through one mutex over [`State`]; work under it is O(1) per key (plus
//! eviction, which frees memory under it). Bulk copies happen outside it, through the
//! handles. Lock order: L1 state → allocator. Handles are never dropped under the state lock
//! by this module, except allocations, whose drop takes only the allocator lock.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Instant;

use lmcache_core::{CacheSalt, ObjectKey};
use lmcache_memory::{AllocError, Allocation, ArenaAllocator, MemoryUsage};
use parking_lot::Mutex;
use slotmap::SlotMap;

use crate::config::L1Config;
use crate::entry::{Entry, EntryId, ObjectMemory, Slot};
use crate::error::{L1ConfigError, L1Error};
use crate::eviction::{EntryMeta, EvictionPolicy};
use crate::handles::{ReadLease, WriteReservation};
use crate::lease_table::{LeaseId, LeaseTable};
use crate::persist::{PersistStats, SealQueue};
use crate::quota::Quotas;

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// One object to reserve.
#[derive(Debug, Clone)]
pub struct WriteRequest {
    /// Its key.
    pub key: ObjectKey,
    /// Its size in bytes.
    pub size: u64,
    /// Deleted when its last read lock is released (one-shot objects).
    pub temporary: bool,
}

impl WriteRequest {
    /// A non-temporary object.
    pub fn new(key: ObjectKey, size: u64) -> Self {
        Self { key, size, temporary: false }
    }
}

/// Counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct L1Stats {
    /// Objects evicted (by allocation pressure, watermark or quota).
    pub evicted_objects: u64,
    /// Bytes evicted.
    pub evicted_bytes: u64,
    /// Times an allocation had to evict synchronously.
    pub sync_evictions: u64,
    /// Write requests refused for lack of memory.
    pub oom_rejections: u64,
    /// Write requests refused by a quota.
    pub quota_rejections: u64,
    /// Objects committed.
    pub committed: u64,
    /// Reservations discarded (explicitly, dropped, or expired).
    pub discarded: u64,
    /// Maintenance passes run (LMCache's eviction-loop ticks).
    pub maintenance_passes: u64,
    /// Parked read leases that expired (their client went silent).
    pub expired_read_leases: u64,
    /// Parked write reservations that expired.
    pub expired_write_leases: u64,
    /// Objects evicted before the write-behind had written them to L2 (their KV is gone).
    pub unwritten_evictions: u64,
    /// Objects the watermark moved to the next L1 in write order instead of evicting them.
    pub demoted_objects: u64,
    /// Commits that found their key already made visible by another writer (their own copy
    /// was dropped; the key was visible either way).
    pub superseded: u64,
}

/// How [`L1Member::reserve_with`] treats what is in its way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReserveMode {
    /// May evict objects the write-behind has not written yet, when nothing else makes room.
    pub evict_unwritten: bool,
    /// Never evicts to make room: a batch that does not fit gets [`L1Error::OutOfMemory`]
    /// (the first pass of [`L1Cache`](crate::L1Cache)'s ordered overflow, which fills its members in order
    /// before any of them evicts).
    pub no_eviction: bool,
    /// A refusal for lack of memory is not counted in [`L1Stats::oom_rejections`]: another
    /// member may still take the key ([`L1Cache`](crate::L1Cache)'s overflow counts a key
    /// once, in the last member that refuses it).
    pub uncounted: bool,
    /// A key another writer holds staged gets a reservation of its own (a *shadow*) instead
    /// of [`L1Error::NotWritable`], so that a store never depends on a writer it cannot see
    /// finishing: the first of the two commits makes the key visible, the other finds it
    /// visible and succeeds too, and a writer that dies takes nothing visible with it. Only a
    /// resident key is `NotWritable`.
    pub supersede_staged: bool,
}

/// A snapshot of L1 occupancy.
#[derive(Debug, Clone, PartialEq)]
pub struct L1Usage {
    /// Usable bytes.
    pub capacity: u64,
    /// Bytes charged to objects (staged, resident and deleted-but-pinned).
    pub used_bytes: u64,
    /// Bytes of staged objects.
    pub staged_bytes: u64,
    /// Resident (visible) objects.
    pub resident_objects: usize,
    /// Staged objects.
    pub staged_objects: usize,
    /// Resident objects with at least one read lock.
    pub locked_objects: usize,
    /// Usage per tenant.
    pub by_salt: Vec<(CacheSalt, u64)>,
    /// Allocator counters.
    pub memory: MemoryUsage,
    /// Counters.
    pub stats: L1Stats,
}

impl L1Usage {
    /// used / capacity.
    pub fn usage_fraction(&self) -> f64 {
        if self.capacity == 0 { 0.0 } else { self.used_bytes as f64 / self.capacity as f64 }
    }
}

/// What a maintenance pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MaintenanceReport {
    /// Bytes evicted to bring tenants back under their quotas.
    pub quota_evicted_bytes: u64,
    /// Bytes evicted by the watermark.
    pub watermark_evicted_bytes: u64,
    /// Bytes the watermark moved to the next L1 in write order (see [`RemovalCause::Demoted`]).
    pub demoted_bytes: u64,
    /// Read leases that expired.
    pub expired_read_leases: usize,
    /// Write leases that expired.
    pub expired_write_leases: usize,
}

/// What a clear did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClearReport {
    /// Objects removed (or, when forced and pinned, unindexed).
    pub removed: usize,
    /// Objects kept because they were locked (non-forced clear).
    pub skipped: usize,
}

/// Why a resident object left L1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RemovalCause {
    /// The eviction policy chose it to make room (a store needed memory, or the watermark).
    Evicted,
    /// The eviction policy chose it to bring its tenant back under its L1 quota.
    EvictedForQuota,
    /// Deleted on request (an HTTP or operator delete, the `skip_l1` store policy).
    Deleted,
    /// Removed by a clear of the whole cache.
    Cleared,
    /// A temporary object (not kept in L1) whose last reader finished.
    Released,
    /// Chosen by the watermark in an L1 that has a next one in write order, and moved there.
    /// Never told to a listener: the object is still in L1 (the listener hears its commit in
    /// the next member, or [`Self::Evicted`] if it found no room there).
    Demoted,
}

impl RemovalCause {
    /// A short name (`evicted`, `evicted_for_quota`, `deleted`, `cleared`, `released`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Evicted => "evicted",
            Self::EvictedForQuota => "evicted_for_quota",
            Self::Deleted => "deleted",
            Self::Cleared => "cleared",
            Self::Released => "released",
            Self::Demoted => "demoted",
        }
    }
}

/// Where a key stands in L1 at one moment (see [`L1Member::probe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// Resident: a lookup finds it.
    Resident,
    /// Reserved and being written by a store that has not committed (write-locked).
    BeingWritten,
    /// Not in L1.
    Absent,
}

#[derive(Debug, Clone, Copy)]
struct IndexSlot {
    id: EntryId,
    resident: bool,
}

/// Told when an object becomes resident in L1 and when it leaves (evicted, deleted or
/// cleared), for KV events and the coordinator's cache events.
///
/// Called with the L1 lock held: implementations must be quick and must not call back into
/// the cache.
pub trait L1Listener: Send + Sync + std::fmt::Debug {
    /// `key` is no longer resident.
    fn removed(&self, key: &ObjectKey);
    /// `key` is no longer resident, and why. What L1 calls; by default [`Self::removed`].
    fn removed_because(&self, key: &ObjectKey, _cause: RemovalCause) {
        self.removed(key);
    }
    /// `key` became resident with `bytes` (a store or a load from L2 committed).
    fn committed(&self, _key: &ObjectKey, _bytes: u64) {}
}

#[derive(Debug)]
pub(crate) struct State {
    listener: Option<Arc<dyn L1Listener>>,
    entries: SlotMap<EntryId, Entry>,
    /// Key → entry, with residency kept beside the id so that a lookup costs one probe.
    index: FastMap<ObjectKey, IndexSlot>,
    policy: Box<dyn EvictionPolicy>,
    quotas: Quotas,
    used_bytes: u64,
    staged_bytes: u64,
    stats: L1Stats,
    /// Whether committed objects wait for the write-behind (see [`L1Member::set_write_behind`]).
    write_behind: bool,
    /// Resident objects not yet written to L2.
    unwritten: usize,
    /// Adopted at start: objects, bytes, refused.
    adopted: (u64, u64, u64),
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    memory: ArenaAllocator,
    config: L1Config,
    key_hasher: foldhash::fast::FixedState,
    /// Objects to seal into the arena's catalog (file arenas only).
    seals: Option<Arc<SealQueue>>,
}

/// One L1 over one arena (LMCache's "tagged L1"); [`L1Cache`](crate::L1Cache) puts one or more of them in
/// write order. Cheap to clone; every clone is the same member.
#[derive(Debug, Clone)]
pub struct L1Member {
    shared: Arc<Shared>,
    leases: Arc<Leases>,
}

#[derive(Debug)]
struct Leases {
    read: LeaseTable<ReadLease>,
    write: LeaseTable<WriteReservation>,
}

impl L1Member {
    /// An L1 over `memory`.
    pub fn new(config: L1Config, memory: ArenaAllocator) -> Result<Self, L1ConfigError> {
        config.validate()?;
        let leases = Arc::new(Leases {
            read: LeaseTable::new(config.read_ttl),
            write: LeaseTable::new(config.write_ttl),
        });
        let state = State {
            listener: None,
            entries: SlotMap::with_key(),
            index: FastMap::default(),
            policy: config.eviction_policy.build(),
            quotas: Quotas::default(),
            used_bytes: 0,
            staged_bytes: 0,
            stats: L1Stats::default(),
            write_behind: false,
            unwritten: 0,
            adopted: (0, 0, 0),
        };
        let seals = memory.is_persistent().then(|| Arc::new(SealQueue::default()));
        Ok(Self {
            shared: Arc::new(Shared {
                state: Mutex::new(state),
                seals,
                memory,
                config,
                key_hasher: foldhash::fast::FixedState::with_seed(0x6c6d_6361_6368_6521),
            }),
            leases,
        })
    }

    /// Whether `shared` (a handle's) is this member's.
    pub(crate) fn owns(&self, shared: &Arc<Shared>) -> bool {
        Arc::ptr_eq(&self.shared, shared)
    }

    /// The seal queue, for an L1 in a file arena.
    pub(crate) fn seal_queue(&self) -> Option<Arc<SealQueue>> {
        self.shared.seals.clone()
    }

    /// Makes resident every object the arena adopted from its file (see [`crate::persist`]):
    /// the newest record of a key wins, a key that does not decode is dropped, and objects
    /// enter the eviction policy oldest first. Their checksums are known already. Returns
    /// how many were adopted. No-op for other arenas, and after the first call.
    pub fn adopt(&self) -> u64 {
        let mut found = self.shared.memory.take_adopted();
        if found.is_empty() {
            return 0;
        }
        found.sort_by_key(|a| std::cmp::Reverse(a.generation));
        let mut seen = std::collections::HashSet::new();
        let mut keep = Vec::with_capacity(found.len());
        let mut refused = 0u64;
        for a in found {
            match crate::persist::decode_key(&a.key) {
                Some(key) if seen.insert(key.clone()) => keep.push((key, a)),
                _ => refused += 1,
            }
        }
        keep.reverse();
        let shared = &self.shared;
        let mut guard = shared.state.lock();
        let st = &mut *guard;
        let mut n = 0u64;
        for (key, a) in keep {
            if st.index.contains_key(&key) {
                refused += 1;
                continue;
            }
            let bytes = a.alloc.physical_len();
            let memory = Arc::new(ObjectMemory::with_checksum(a.alloc, a.checksum));
            let id = st.entries.insert(Entry {
                key: key.clone(),
                bytes,
                temporary: false,
                indexed: true,
                shadow: false,
                superseded: false,
                unwritten: false,
                slot: Slot::Resident { alloc: memory, readers: 0 },
            });
            st.index.insert(key.clone(), IndexSlot { id, resident: true });
            st.quotas.charge(&key.cache_salt, bytes);
            st.used_bytes += bytes;
            let (key_hash, cache_salt) = st.key_meta(shared, &st.entries[id]);
            st.policy.on_insert(id, EntryMeta { key_hash, cache_salt, bytes });
            if let Some(l) = &st.listener {
                l.committed(&key, bytes);
            }
            st.adopted.0 += 1;
            st.adopted.1 += bytes;
            n += 1;
        }
        st.adopted.2 += refused;
        n
    }

    /// Tells the listener about every resident object, as if each had just been committed:
    /// how a listener installed after [`Self::adopt`] (the coordinator reporter, the KV
    /// events) learns what a restarted L1 holds.
    pub fn announce_resident(&self) {
        let st = self.shared.state.lock();
        let Some(l) = &st.listener else { return };
        for e in st.entries.values() {
            if e.indexed && !e.temporary && matches!(e.slot, Slot::Resident { .. }) {
                l.committed(&e.key, e.bytes);
            }
        }
    }

    /// Waits at most `timeout` for every committed object to be sealed (a shutdown that
    /// should restart warm); returns how many were still waiting. 0 for other arenas.
    pub fn drain_seals(&self, timeout: std::time::Duration) -> u64 {
        self.shared.seals.as_ref().map_or(0, |q| q.drain(timeout))
    }

    /// Sealing and adoption counters (all zero for an L1 not in a file arena).
    pub fn persist_stats(&self) -> PersistStats {
        let (adopted, adopted_bytes, adopt_refused) = self.shared.state.lock().adopted;
        let (sealed, seal_failed, seal_skipped, pending) =
            self.shared.seals.as_ref().map_or((0, 0, 0, 0), |q| q.stats());
        PersistStats {
            sealed,
            seal_failed,
            seal_skipped,
            pending,
            adopted,
            adopted_bytes,
            adopt_refused,
        }
    }

    /// Turns write-behind protection on: every object committed from now on (temporary ones
    /// excepted) is *unwritten* until [`Self::mark_written`]. Eviction takes written objects
    /// first; [`Self::reserve_write`] and maintenance never evict an unwritten one, and
    /// [`Self::reserve_with`] with [`ReserveMode::evict_unwritten`] does so only when nothing
    /// else makes room (counted in [`L1Stats::unwritten_evictions`]).
    pub fn set_write_behind(&self, on: bool) {
        self.shared.state.lock().write_behind = on;
    }

    /// The write-behind is done with `keys` (written to L2, or given up on): they are
    /// ordinary eviction candidates again.
    pub fn mark_written(&self, keys: &[ObjectKey]) {
        let mut st = self.shared.state.lock();
        for k in keys {
            let Some(slot) = st.index.get(k).copied() else { continue };
            if let Some(e) = st.entries.get_mut(slot.id)
                && std::mem::take(&mut e.unwritten)
            {
                st.unwritten -= 1;
            }
        }
    }

    /// Resident objects not yet written to L2.
    pub fn unwritten(&self) -> usize {
        self.shared.state.lock().unwritten
    }

    /// Installs the listener told about every resident object that leaves.
    pub fn set_listener(&self, listener: Arc<dyn L1Listener>) {
        self.shared.state.lock().listener = Some(listener);
    }

    /// The settings.
    pub fn config(&self) -> &L1Config {
        &self.shared.config
    }

    /// The memory the objects live in.
    pub fn memory(&self) -> &ArenaAllocator {
        &self.shared.memory
    }

    /// Reserves memory for each request. Per key: [`L1Error::NotWritable`] if the key is
    /// resident, staged, or repeated in the batch; [`L1Error::QuotaExceeded`] if its tenant's
    /// quota cannot fit it after evicting that tenant's unlocked objects. The remaining keys
    /// are allocated all or nothing, evicting unlocked objects synchronously when memory is
    /// short; if that is not enough, each gets [`L1Error::OutOfMemory`].
    ///
    /// With write-behind on, objects not yet written to L2 are never evicted here.
    pub fn reserve_write(
        &self,
        requests: &[WriteRequest],
    ) -> Vec<Result<WriteReservation, L1Error>> {
        self.reserve_with(requests, ReserveMode::default())
    }

    /// Reserves memory for a store whose reply must mean "visible" ([`ReserveMode`]).
    pub fn reserve_with(
        &self,
        requests: &[WriteRequest],
        mode: ReserveMode,
    ) -> Vec<Result<WriteReservation, L1Error>> {
        let evict_unwritten = mode.evict_unwritten;
        let shared = &self.shared;
        let mut results: Vec<Option<Result<WriteReservation, L1Error>>> =
            (0..requests.len()).map(|_| None).collect();
        let mut st = shared.state.lock();
        // 1. Which keys can be written, and how big they are.
        let mut todo: Vec<(usize, u64)> = Vec::with_capacity(requests.len());
        // Which of them shadow another writer's staged reservation.
        let mut shadows: Vec<usize> = Vec::new();
        for (i, req) in requests.iter().enumerate() {
            let refused = match shared.memory.aligned_size(req.size) {
                Err(_) => Some(L1Error::InvalidSize {
                    size: req.size,
                    capacity: shared.memory.capacity(),
                }),
                Ok(size)
                    if mode.supersede_staged
                        && st.index.get(&req.key).is_some_and(|s| !s.resident)
                        && !todo.iter().any(|&(j, _)| requests[j].key == req.key) =>
                {
                    shadows.push(i);
                    todo.push((i, size));
                    None
                }
                Ok(_) if st.index.contains_key(&req.key) => Some(L1Error::NotWritable),
                Ok(_) if todo.iter().any(|&(j, _)| requests[j].key == req.key) => {
                    Some(L1Error::NotWritable)
                }
                Ok(size) => {
                    todo.push((i, size));
                    None
                }
            };
            if let Some(e) = refused {
                results[i] = Some(Err(e));
            }
        }
        // 2. Quotas, per tenant in the batch.
        let mut need: Vec<(CacheSalt, u64)> = Vec::new();
        for &(i, size) in &todo {
            let salt = &requests[i].key.cache_salt;
            match need.iter_mut().find(|(s, _)| s == salt) {
                Some((_, n)) => *n += size,
                None => need.push((salt.clone(), size)),
            }
        }
        for (salt, requested) in need {
            let Some(limit) = st.quotas.limit(&salt) else {
                continue;
            };
            let used = st.quotas.usage(&salt);
            if used + requested > limit {
                st.evict_with(Some(&salt), used + requested - limit, evict_unwritten);
            }
            let used = st.quotas.usage(&salt);
            if used + requested > limit {
                let err =
                    L1Error::QuotaExceeded { cache_salt: salt.clone(), limit, used, requested };
                todo.retain(|&(i, _)| {
                    let keep = requests[i].key.cache_salt != salt;
                    if !keep {
                        results[i] = Some(Err(err.clone()));
                    }
                    keep
                });
                st.stats.quota_rejections += 1;
            }
        }
        // 3. Memory, all or nothing, evicting as needed.
        if !todo.is_empty() {
            let sizes: Vec<u64> = todo.iter().map(|&(i, _)| requests[i].size).collect();
            match st.allocate_evicting(&shared.memory, &sizes, evict_unwritten, !mode.no_eviction) {
                Ok(allocs) => {
                    for (&(i, size), alloc) in todo.iter().zip(allocs) {
                        let req = &requests[i];
                        let shadow = shadows.contains(&i);
                        let id = st.entries.insert(Entry {
                            key: req.key.clone(),
                            bytes: size,
                            temporary: req.temporary,
                            indexed: !shadow,
                            shadow,
                            superseded: false,
                            unwritten: false,
                            slot: Slot::Staged,
                        });
                        if !shadow {
                            st.index.insert(req.key.clone(), IndexSlot { id, resident: false });
                        }
                        st.quotas.charge(&req.key.cache_salt, size);
                        st.used_bytes += size;
                        st.staged_bytes += size;
                        results[i] = Some(Ok(WriteReservation::new(
                            Arc::clone(shared),
                            id,
                            req.key.clone(),
                            alloc,
                        )));
                    }
                }
                Err(e) => {
                    // Not the store's refusal when another member may still take it.
                    if !mode.no_eviction && !mode.uncounted {
                        st.stats.oom_rejections += todo.len() as u64;
                    }
                    for &(i, _) in &todo {
                        results[i] = Some(Err(e.clone()));
                    }
                }
            }
        }
        drop(st);
        results.into_iter().map(|r| r.unwrap_or(Err(L1Error::WrongState))).collect()
    }

    /// Commits reservations in one step, inserting them into the eviction policy in reverse
    /// order, so that a request's last chunk is the first to leave.
    pub fn commit_batch(&self, reservations: Vec<WriteReservation>) -> Vec<Result<(), L1Error>> {
        let mut parts: Vec<(EntryId, Allocation)> = Vec::with_capacity(reservations.len());
        for mut r in reservations {
            parts.push(r.take_parts());
        }
        let mut results = vec![Ok(()); parts.len()];
        let mut garbage = Vec::new();
        {
            let mut st = self.shared.state.lock();
            for (i, (id, alloc)) in parts.into_iter().enumerate().rev() {
                match st.commit(&self.shared, id, alloc, 0) {
                    Ok(_) => {}
                    Err((e, alloc)) => {
                        results[i] = Err(e);
                        garbage.push(alloc);
                    }
                }
            }
        }
        drop(garbage);
        results
    }

    /// Read-locks each key `count` times (one per engine reader). Staged keys are invisible:
    /// [`L1Error::NotFound`].
    pub fn read_lock(&self, keys: &[ObjectKey], count: u32) -> Vec<Result<ReadLease, L1Error>> {
        if let Err(e) = self.check_count(count) {
            return keys.iter().map(|_| Err(e.clone())).collect();
        }
        let mut st = self.shared.state.lock();
        keys.iter().map(|k| st.read_lock(&self.shared, k, count)).collect()
    }

    /// Read-locks the longest prefix of `keys` that is resident, stopping at the first miss.
    pub fn read_lock_prefix(
        &self,
        keys: &[ObjectKey],
        count: u32,
    ) -> Result<Vec<ReadLease>, L1Error> {
        self.check_count(count)?;
        let mut st = self.shared.state.lock();
        let mut out = Vec::new();
        for k in keys {
            match st.read_lock(&self.shared, k, count) {
                Ok(l) => out.push(l),
                Err(_) => break,
            }
        }
        Ok(out)
    }

    /// True when `key` is resident (visible).
    pub fn contains(&self, key: &ObjectKey) -> bool {
        self.shared.state.lock().index.get(key).is_some_and(|s| s.resident)
    }

    /// Where each of `keys` stands (one lock for all): resident, being written by a store
    /// that has not committed, or absent.
    pub fn probe(&self, keys: &[ObjectKey]) -> Vec<Residency> {
        let st = self.shared.state.lock();
        keys.iter()
            .map(|k| match st.index.get(k) {
                Some(s) if s.resident => Residency::Resident,
                Some(_) => Residency::BeingWritten,
                None => Residency::Absent,
            })
            .collect()
    }

    /// Every resident key with its bytes, in a stable order (model, rank, group, hash, salt).
    /// O(n log n): for operator listings, not hot paths.
    pub fn resident_keys(&self) -> Vec<(ObjectKey, u64)> {
        let mut keys: Vec<(ObjectKey, u64)> = {
            let st = self.shared.state.lock();
            st.index
                .iter()
                .filter(|(_, slot)| slot.resident)
                .filter_map(|(k, slot)| st.entries.get(slot.id).map(|e| (k.clone(), e.bytes)))
                .collect()
        };
        keys.sort_by(|(a, _), (b, _)| listing_order(a, b));
        keys
    }

    /// How many leading keys are resident.
    pub fn prefix_hits(&self, keys: &[ObjectKey]) -> usize {
        let st = self.shared.state.lock();
        keys.iter().take_while(|k| st.index.get(*k).is_some_and(|s| s.resident)).count()
    }

    /// Records a use of each resident key (request order; applied in reverse so the prefix
    /// ends up most recent).
    pub fn touch(&self, keys: &[ObjectKey]) {
        let mut st = self.shared.state.lock();
        for k in keys.iter().rev() {
            if let Some(&IndexSlot { id, resident: true }) = st.index.get(k) {
                st.policy.on_access(id);
            }
        }
    }

    /// Deletes keys. Without `force`, a read-locked or staged key is refused with
    /// [`L1Error::Locked`]. With `force`, it disappears from the index at once and its memory
    /// is freed when its last handle goes: memory is never freed under a reader or writer.
    pub fn delete(&self, keys: &[ObjectKey], force: bool) -> Vec<Result<(), L1Error>> {
        let mut st = self.shared.state.lock();
        keys.iter()
            .map(|k| {
                let id = st.index.get(k).ok_or(L1Error::NotFound)?.id;
                st.delete_entry(id, force, RemovalCause::Deleted)
            })
            .collect()
    }

    /// Deletes everything that may go (unlocked resident objects), or with `force` unindexes
    /// everything (pinned memory is freed when its handles go).
    pub fn clear(&self, force: bool) -> ClearReport {
        let mut st = self.shared.state.lock();
        let ids: Vec<EntryId> = st.index.values().map(|s| s.id).collect();
        let mut report = ClearReport::default();
        for id in ids {
            match st.delete_entry(id, force, RemovalCause::Cleared) {
                Ok(()) => report.removed += 1,
                Err(_) => report.skipped += 1,
            }
        }
        report
    }

    /// Frees at least `bytes` by evicting unlocked objects (of one tenant if `scope`).
    /// Returns the bytes freed.
    pub fn evict(&self, scope: Option<&CacheSalt>, bytes: u64) -> u64 {
        self.shared.state.lock().evict(scope, bytes)
    }

    /// One maintenance pass: bring tenants under their quotas, apply the watermark (when
    /// used bytes reach `trigger_watermark` of capacity, evict `eviction_ratio` of them),
    /// expire leases of dead clients.
    pub fn run_maintenance(&self) -> MaintenanceReport {
        self.maintain(None)
    }

    /// [`Self::run_maintenance`], where what the watermark chooses is handed to `demote`
    /// (out of this member, its memory kept alive by the handle) instead of being dropped.
    pub(crate) fn run_maintenance_demoting(&self, demote: &mut Demoted) -> MaintenanceReport {
        self.maintain(Some(demote))
    }

    /// Tells the listener `key` left L1 (a demotion that found no room).
    pub(crate) fn announce_removed(&self, key: &ObjectKey, cause: RemovalCause) {
        if let Some(l) = &self.shared.state.lock().listener {
            l.removed_because(key, cause);
        }
    }

    fn maintain(&self, demote: Option<&mut Demoted>) -> MaintenanceReport {
        let mut report = MaintenanceReport::default();
        {
            let mut st = self.shared.state.lock();
            for (salt, excess) in st.quotas.excess() {
                report.quota_evicted_bytes += st.evict(Some(&salt), excess);
            }
            let capacity = self.shared.memory.capacity() as f64;
            let used = st.used_bytes as f64;
            if capacity > 0.0 && used >= self.shared.config.trigger_watermark * capacity {
                let target = (used * self.shared.config.eviction_ratio).ceil() as u64;
                match demote {
                    Some(out) => {
                        report.demoted_bytes = st.evict_pass(None, target.max(1), false, Some(out))
                    }
                    None => report.watermark_evicted_bytes = st.evict(None, target.max(1)),
                }
            }
        }
        let now = Instant::now();
        report.expired_read_leases = self.leases.read.expire(now);
        report.expired_write_leases = self.leases.write.expire(now);
        let mut st = self.shared.state.lock();
        st.stats.maintenance_passes += 1;
        st.stats.expired_read_leases += report.expired_read_leases as u64;
        st.stats.expired_write_leases += report.expired_write_leases as u64;
        report
    }

    /// Sets or removes a tenant's quota in bytes. Lowering it below usage takes effect at
    /// the next admission of that tenant or the next maintenance pass.
    pub fn set_quota(&self, salt: &CacheSalt, limit: Option<u64>) {
        self.shared.state.lock().quotas.set_limit(salt, limit);
    }

    /// A tenant's quota.
    pub fn quota(&self, salt: &CacheSalt) -> Option<u64> {
        self.shared.state.lock().quotas.limit(salt)
    }

    /// Every quota.
    pub fn quotas(&self) -> Vec<(CacheSalt, u64)> {
        self.shared.state.lock().quotas.limits()
    }

    /// A tenant's usage in bytes.
    pub fn usage_of(&self, salt: &CacheSalt) -> u64 {
        self.shared.state.lock().quotas.usage(salt)
    }

    /// A snapshot of occupancy and counters.
    pub fn usage(&self) -> L1Usage {
        let st = self.shared.state.lock();
        let mut resident = 0;
        let mut staged = 0;
        let mut locked = 0;
        for e in st.entries.values().filter(|e| e.indexed) {
            match e.slot {
                Slot::Staged => staged += 1,
                Slot::Resident { readers, .. } => {
                    resident += 1;
                    if readers > 0 {
                        locked += 1;
                    }
                }
            }
        }
        L1Usage {
            capacity: self.shared.memory.capacity(),
            used_bytes: st.used_bytes,
            staged_bytes: st.staged_bytes,
            resident_objects: resident,
            staged_objects: staged,
            locked_objects: locked,
            by_salt: st.quotas.usage_by_salt(),
            memory: self.shared.memory.usage(),
            stats: st.stats,
        }
    }

    /// Parks a read lease for a client that releases it in a later message.
    pub fn park_read(&self, lease: ReadLease) -> LeaseId {
        self.leases.read.park(lease)
    }

    /// Takes a parked read lease back.
    pub fn take_read(&self, id: LeaseId) -> Option<ReadLease> {
        self.leases.read.take(id)
    }

    /// Parks a write reservation for a client that commits it in a later message.
    pub fn park_write(&self, reservation: WriteReservation) -> LeaseId {
        self.leases.write.park(reservation)
    }

    /// Takes a parked write reservation back.
    pub fn take_write(&self, id: LeaseId) -> Option<WriteReservation> {
        self.leases.write.take(id)
    }

    /// Parked (read, write) leases.
    pub fn parked_leases(&self) -> (usize, usize) {
        (self.leases.read.len(), self.leases.write.len())
    }

    fn check_count(&self, count: u32) -> Result<(), L1Error> {
        let max = self.shared.config.max_read_locks;
        if count == 0 || count > max {
            return Err(L1Error::InvalidLockCount { count, max });
        }
        Ok(())
    }

    /// Checks the index against the allocator and the quotas; returns the first violation.
    /// O(n); for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let st = self.shared.state.lock();
        let entry_bytes: u64 = st.entries.values().map(|e| e.bytes).sum();
        if entry_bytes != st.used_bytes {
            return Err(format!(
                "entries hold {entry_bytes} bytes, used_bytes is {}",
                st.used_bytes
            ));
        }
        let allocated = self.shared.memory.usage().allocator.allocated_bytes;
        if allocated != st.used_bytes {
            return Err(format!(
                "allocator has {allocated} bytes out, L1 accounts {}",
                st.used_bytes
            ));
        }
        let by_salt: u64 = st.quotas.usage_by_salt().iter().map(|(_, b)| b).sum();
        if by_salt != st.used_bytes {
            return Err(format!("tenants account {by_salt} bytes, L1 {}", st.used_bytes));
        }
        let staged: u64 =
            st.entries.values().filter(|e| matches!(e.slot, Slot::Staged)).map(|e| e.bytes).sum();
        if staged != st.staged_bytes {
            return Err(format!(
                "staged entries hold {staged}, staged_bytes is {}",
                st.staged_bytes
            ));
        }
        for (key, slot) in &st.index {
            match st.entries.get(slot.id) {
                Some(e)
                    if e.indexed
                        && &e.key == key
                        && slot.resident == matches!(e.slot, Slot::Resident { .. }) => {}
                _ => return Err(format!("index entry for {key} is stale")),
            }
        }
        let indexed = st.entries.values().filter(|e| e.indexed).count();
        if indexed != st.index.len() {
            return Err(format!("{indexed} indexed entries, index has {}", st.index.len()));
        }
        let policy_expect = st
            .entries
            .values()
            .filter(|e| e.indexed && matches!(e.slot, Slot::Resident { .. }))
            .count();
        if st.policy.name() != "noop" && st.policy.len() != policy_expect {
            return Err(format!("policy tracks {}, {policy_expect} resident", st.policy.len()));
        }
        Ok(())
    }
}

/// The order of [`L1Member::resident_keys`]: model, rank, group, hash, salt.
pub(crate) fn listing_order(a: &ObjectKey, b: &ObjectKey) -> std::cmp::Ordering {
    (&a.model_name, a.kv_rank, a.object_group_id, a.chunk_hash, &a.cache_salt).cmp(&(
        &b.model_name,
        b.kv_rank,
        b.object_group_id,
        b.chunk_hash,
        &b.cache_salt,
    ))
}

/// Objects a member's watermark chose, handed out of it for the next member (see
/// [`L1Member::run_maintenance_demoting`]): each key with the memory it still holds.
pub(crate) type Demoted = Vec<(ObjectKey, Arc<ObjectMemory>)>;

impl State {
    fn key_meta<'a>(&self, shared: &Shared, e: &'a Entry) -> (u64, &'a CacheSalt) {
        (shared.key_hasher.hash_one(&e.key), &e.key.cache_salt)
    }

    /// Allocates `sizes` all or nothing, evicting unlocked objects while it helps.
    fn allocate_evicting(
        &mut self,
        memory: &ArenaAllocator,
        sizes: &[u64],
        evict_unwritten: bool,
        may_evict: bool,
    ) -> Result<Vec<Allocation>, L1Error> {
        let mut evicted_any = false;
        loop {
            match memory.allocate_batch(sizes) {
                Ok(v) => return Ok(v),
                Err(AllocError::OutOfMemory { requested, free }) => {
                    // Free the shortfall; when the bytes exist but are fragmented, free at
                    // least one object's worth more and try again.
                    let want = requested.saturating_sub(free).max(1);
                    let freed =
                        if may_evict { self.evict_with(None, want, evict_unwritten) } else { 0 };
                    if freed == 0 {
                        let free = memory.usage().allocator.capacity - self.used_bytes;
                        return Err(L1Error::OutOfMemory { requested, free });
                    }
                    if !evicted_any {
                        self.stats.sync_evictions += 1;
                        evicted_any = true;
                    }
                }
                Err(AllocError::BackingFull { requested, .. }) => {
                    // /dev/shm is full (other processes filled it): only memory already
                    // backed can be reused, so evict what the request needs and retry there.
                    let freed = if may_evict {
                        self.evict_with(None, requested.max(1), evict_unwritten)
                    } else {
                        0
                    };
                    if freed == 0 {
                        return Err(L1Error::OutOfMemory { requested, free: 0 });
                    }
                    if !evicted_any {
                        self.stats.sync_evictions += 1;
                        evicted_any = true;
                    }
                }
                Err(_) => {
                    let size = sizes.iter().copied().max().unwrap_or(0);
                    return Err(L1Error::InvalidSize { size, capacity: memory.capacity() });
                }
            }
        }
    }

    /// Evicts unlocked resident objects (of `scope` only, if given) worth `target` bytes,
    /// never one the write-behind has not written yet.
    pub(crate) fn evict(&mut self, scope: Option<&CacheSalt>, target: u64) -> u64 {
        self.evict_with(scope, target, false)
    }

    /// As [`Self::evict`]; objects not yet written to L2 go too, last, when `unwritten`.
    pub(crate) fn evict_with(
        &mut self,
        scope: Option<&CacheSalt>,
        target: u64,
        unwritten: bool,
    ) -> u64 {
        let freed = self.evict_pass(scope, target, false, None);
        if freed < target && unwritten && self.unwritten > 0 {
            freed + self.evict_pass(scope, target - freed, true, None)
        } else {
            freed
        }
    }

    /// Evicts objects the policy chooses, worth `target` bytes; with `demote`, they leave as
    /// [`RemovalCause::Demoted`] and their memory goes to `demote` instead of being freed.
    fn evict_pass(
        &mut self,
        scope: Option<&CacheSalt>,
        target: u64,
        unwritten: bool,
        mut demote: Option<&mut Demoted>,
    ) -> u64 {
        let mut victims = Vec::new();
        let entries = &self.entries;
        let freed = self.policy.evict(
            scope,
            target,
            &mut |id| {
                let e = entries.get(id)?;
                let in_scope = scope.is_none_or(|s| &e.key.cache_salt == s);
                match e.slot {
                    Slot::Resident { readers: 0, .. }
                        if e.indexed && in_scope && (unwritten || !e.unwritten) =>
                    {
                        Some(e.bytes)
                    }
                    _ => None,
                }
            },
            &mut victims,
        );
        let cause = match (scope, &demote) {
            (_, Some(_)) => RemovalCause::Demoted,
            (Some(_), None) => RemovalCause::EvictedForQuota,
            (None, None) => RemovalCause::Evicted,
        };
        for id in victims {
            let Some(e) = self.remove_entry(id, cause) else { continue };
            if let (Some(out), Slot::Resident { alloc, .. }) = (demote.as_deref_mut(), &e.slot) {
                self.stats.demoted_objects += 1;
                out.push((e.key.clone(), Arc::clone(alloc)));
                continue;
            }
            self.stats.evicted_objects += 1;
            self.stats.evicted_bytes += e.bytes;
            if e.unwritten {
                self.stats.unwritten_evictions += 1;
                tracing::debug!(key = %e.key, "evicted before the write-behind wrote it");
            }
        }
        freed
    }

    /// Removes an entry and its accounting. The caller has already told the policy.
    fn remove_entry(&mut self, id: EntryId, cause: RemovalCause) -> Option<Entry> {
        let e = self.entries.remove(id)?;
        if e.unwritten {
            self.unwritten -= 1;
        }
        if e.indexed {
            self.index.remove(&e.key);
            // A demoted object stays in L1 (in the next member): the listener hears its
            // commit there, or its eviction if it finds no room.
            if let (Some(l), Slot::Resident { .. }, false) =
                (&self.listener, &e.slot, cause == RemovalCause::Demoted)
            {
                l.removed_because(&e.key, cause);
            }
        }
        self.quotas.credit(&e.key.cache_salt, e.bytes);
        self.used_bytes -= e.bytes;
        if matches!(e.slot, Slot::Staged) {
            self.staged_bytes -= e.bytes;
        }
        Some(e)
    }

    fn delete_entry(
        &mut self,
        id: EntryId,
        force: bool,
        cause: RemovalCause,
    ) -> Result<(), L1Error> {
        let e = self.entries.get_mut(id).ok_or(L1Error::NotFound)?;
        let pinned = matches!(e.slot, Slot::Staged) || e.readers() > 0;
        if pinned && !force {
            return Err(L1Error::Locked);
        }
        let resident = matches!(e.slot, Slot::Resident { .. });
        if pinned {
            // Out of sight now; memory goes with the last handle.
            e.indexed = false;
            let key = e.key.clone();
            self.index.remove(&key);
            if let (Some(l), true) = (&self.listener, resident) {
                l.removed_because(&key, cause);
            }
        }
        if resident {
            self.policy.on_remove(id);
        }
        if !pinned {
            self.remove_entry(id, cause);
        }
        Ok(())
    }

    fn read_lock(
        &mut self,
        shared: &Arc<Shared>,
        key: &ObjectKey,
        count: u32,
    ) -> Result<ReadLease, L1Error> {
        let slot = self.index.get(key).ok_or(L1Error::NotFound)?;
        if !slot.resident {
            return Err(L1Error::NotFound);
        }
        let id = slot.id;
        let e = self.entries.get_mut(id).ok_or(L1Error::NotFound)?;
        match &mut e.slot {
            Slot::Staged => Err(L1Error::NotFound),
            Slot::Resident { alloc, readers } => {
                *readers += count;
                Ok(ReadLease::new(Arc::clone(shared), id, e.key.clone(), Arc::clone(alloc), count))
            }
        }
    }

    /// Makes a staged entry resident with `readers` read locks. On failure the allocation is
    /// handed back so the caller can drop it outside the lock.
    pub(crate) fn commit(
        &mut self,
        shared: &Arc<Shared>,
        id: EntryId,
        alloc: Allocation,
        readers: u32,
    ) -> Result<Option<ReadLease>, (L1Error, Allocation)> {
        let Some(e) = self.entries.get_mut(id) else {
            return Err((L1Error::WrongState, alloc));
        };
        if !matches!(e.slot, Slot::Staged) {
            return Err((L1Error::WrongState, alloc));
        }
        let key = e.key.clone();
        let current = self.index.get(&key).copied();
        if !e.indexed {
            match current {
                // A shadow, or a writer a shadow took the key from, finds the key visible:
                // this commit is done (the bytes of one key are the same KV whoever wrote
                // them); its copy goes.
                Some(slot) if slot.resident && (e.shadow || e.superseded) => {
                    self.remove_entry(id, RemovalCause::Released);
                    self.stats.superseded += 1;
                    return match readers {
                        0 => Ok(None),
                        n => match self.read_lock(shared, &key, n) {
                            Ok(lease) => Ok(Some(lease)),
                            Err(e) => Err((e, alloc)),
                        },
                    };
                }
                // A shadow takes the key over from the writer still staging it (that one's
                // commit will find this object resident), or takes an empty key.
                current if e.shadow => {
                    if let Some(slot) = current
                        && let Some(other) = self.entries.get_mut(slot.id)
                    {
                        other.indexed = false;
                        other.superseded = true;
                    }
                    let e = &mut self.entries[id];
                    e.indexed = true;
                    e.shadow = false;
                    self.index.insert(key.clone(), IndexSlot { id, resident: false });
                }
                // Deleted by force while being written: the object never becomes visible.
                _ => {
                    self.remove_entry(id, RemovalCause::Released);
                    self.stats.discarded += 1;
                    return Err((L1Error::WrongState, alloc));
                }
            }
        }
        let e = &mut self.entries[id];
        let alloc = Arc::new(ObjectMemory::new(alloc));
        e.slot = Slot::Resident { alloc: Arc::clone(&alloc), readers };
        if self.write_behind && !e.temporary {
            e.unwritten = true;
            self.unwritten += 1;
        }
        if let Some(slot) = self.index.get_mut(&key) {
            slot.resident = true;
        }
        self.staged_bytes -= e.bytes;
        self.stats.committed += 1;
        let e = &self.entries[id];
        if let (Some(l), false) = (&self.listener, e.temporary) {
            l.committed(&key, e.bytes);
        }
        if let (Some(q), false) = (&shared.seals, e.temporary) {
            q.push(&alloc, &key);
        }
        let (key_hash, cache_salt) = self.key_meta(shared, e);
        let meta = EntryMeta { key_hash, cache_salt, bytes: e.bytes };
        self.policy.on_insert(id, meta);
        Ok((readers > 0).then(|| ReadLease::new(Arc::clone(shared), id, key, alloc, readers)))
    }
}

impl Shared {
    /// A reservation ended without commit.
    pub(crate) fn discard(&self, id: EntryId) {
        let mut st = self.state.lock();
        if matches!(st.entries.get(id).map(|e| &e.slot), Some(Slot::Staged)) {
            st.remove_entry(id, RemovalCause::Released);
            st.stats.discarded += 1;
        }
    }

    /// A lease gave back `count` read locks.
    pub(crate) fn release_read(&self, id: EntryId, count: u32) {
        let mut st = self.state.lock();
        let Some(e) = st.entries.get_mut(id) else {
            return;
        };
        let Slot::Resident { readers, .. } = &mut e.slot else {
            return;
        };
        debug_assert!(*readers >= count, "read locks released twice");
        *readers = readers.saturating_sub(count);
        if *readers == 0 && (e.temporary || !e.indexed) {
            if e.indexed {
                st.policy.on_remove(id);
            }
            st.remove_entry(id, RemovalCause::Released);
        }
    }

    pub(crate) fn max_read_locks(&self) -> u32 {
        self.config.max_read_locks
    }
}
