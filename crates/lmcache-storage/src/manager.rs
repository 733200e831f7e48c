//! [`StorageManager`]: the one owner of L1 and L2 the server's store path calls (LMCache's
//! StorageManager). A store reserves L1 memory through it and commits through it; the commit
//! queues the write-behind to L2 in the same call, so no caller glues the tiers together.
//!
//! Write-behind that loses nothing: with L2 attached, L1 holds every committed object as
//! *unwritten* until the store controller is done with it. Eviction takes written objects
//! first; when only unwritten objects could make room, a store waits for the write-behind
//! (at most [`crate::TierConfig::write_behind_wait`]), and only then evicts unwritten
//! objects, counting each one ([`lmcache_l1::L1Stats::unwritten_evictions`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_core::{CacheSalt, ObjectKey};
use lmcache_l1::{L1Cache, L1Error, ReadLease, ReserveMode, WriteRequest, WriteReservation};
use lmcache_l2::{ConfigError, KeyPage, L2Error};
use serde_json::Value;

use crate::lookup::{GroupLookupRequest, Lookup, LookupLeases, LookupRequest, ShardKeys};
use crate::observe::{RequestContext, StorageEvent, StorageSubscriber, Subscribers};
use crate::prefetch::{PrefetchHandle, PrefetchOutcome, PrefetchRequest};
use crate::scope::RequestScope;
use crate::tier::{AdapterInfo, L2Tier, TierObserver};

/// One tier, where a caller names one (quotas, listings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierName {
    /// CPU memory.
    L1,
    /// The adapters under it.
    L2,
}

/// Which tiers a delete reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteScope {
    /// L1 only.
    L1,
    /// L2 only (one adapter, or all).
    L2,
    /// Both.
    All,
}

/// What a store got for one object ([`StorageManager::reserve_for_store`]).
#[derive(Debug)]
pub enum StoreSlot {
    /// Reserved: fill it, then commit it.
    Write(WriteReservation),
    /// Visible already.
    Resident,
    /// Refused (memory, quota, size).
    Refused(L1Error),
}

/// Why the manager could not do what was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StorageError {
    /// The operation needs L2 and none is configured.
    #[error("no L2 tier is configured (start the server with --l2-adapter)")]
    NoL2,
    /// No adapter has this id.
    #[error("no L2 adapter {id}")]
    NoSuchAdapter {
        /// The id asked for.
        id: u64,
    },
    /// The adapter failed.
    #[error("L2 adapter {id} ({kind}): {source}")]
    Adapter {
        /// Its id.
        id: u64,
        /// Its type.
        kind: String,
        /// What failed.
        #[source]
        source: L2Error,
    },
    /// An adapter spec was refused.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An adapter's codec cannot serve a layout (e.g. fp8 bound to another element type).
    #[error("L2 adapter {id} ({kind}) cannot store this layout: {reason}")]
    Layout {
        /// Its id.
        id: u64,
        /// Its type.
        kind: String,
        /// Why.
        reason: String,
    },
}

/// What a delete did, tier by tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeleteReport {
    /// Keys removed (L1 objects plus L2 keys held).
    pub deleted: usize,
    /// Keys asked for but not removed (absent, or locked without `force`).
    pub skipped: usize,
}

/// One page of an adapter's keys.
#[derive(Debug, Clone)]
pub struct L2Listing {
    /// The adapter's id.
    pub adapter: u64,
    /// Its type.
    pub kind: String,
    /// The page.
    pub page: KeyPage,
}

/// L1 and, when adapters are configured, the L2 tier under it. Cheap to clone.
#[derive(Debug, Clone)]
pub struct StorageManager {
    l1: L1Cache,
    l2: Option<L2Tier>,
    subscribers: Subscribers,
    /// The fleet's peers, asked for what L1 (and L2, when attached) lacks.
    peers: Arc<std::sync::OnceLock<Arc<dyn crate::peers::PeerSource>>>,
}

impl StorageManager {
    /// Joins `l1` and `l2`. With adapters attached, L1 keeps unwritten objects from eviction
    /// (see the module docs).
    pub fn new(l1: L1Cache, l2: Option<L2Tier>) -> Self {
        l1.set_write_behind(l2.as_ref().is_some_and(|t| !t.is_empty()));
        Self { l1, l2, subscribers: Subscribers::default(), peers: Arc::default() }
    }

    /// Installs the subscribers every [`RequestScope`] call and [`Self::announce`] tells, in
    /// this order. Once: false (nothing changes) when some were installed before.
    pub fn subscribe(&self, subscribers: Vec<Arc<dyn StorageSubscriber>>) -> bool {
        self.subscribers.install(subscribers)
    }

    /// Tells the subscribers what only a caller knows (a request began, a retrieve's copy
    /// ended); storage's own operations announce themselves.
    pub fn announce(&self, event: &StorageEvent<'_>) {
        self.subscribers.publish(event);
    }

    /// Installs the fleet's peers as a source of lookups' L1 misses (once; false when one
    /// was installed before).
    pub fn set_peer_source(&self, source: Arc<dyn crate::peers::PeerSource>) -> bool {
        self.peers.set(source).is_ok()
    }

    pub(crate) fn subscribers(&self) -> &Subscribers {
        &self.subscribers
    }

    /// This storage for one request: every call is announced with `ctx`.
    pub fn scope<'s, 'a>(&'s self, ctx: &'s RequestContext<'a>) -> RequestScope<'s, 'a> {
        RequestScope::new(self, ctx)
    }

    /// A peer's lookup (P2P): read-locks, once each, the keys of `keys` resident in L1, and
    /// nothing else (no L2, gaps allowed). One result per key, in order.
    pub fn lock_for_peer(&self, keys: &[ObjectKey]) -> Vec<Option<ReadLease>> {
        let locked: Vec<Option<ReadLease>> =
            self.l1.read_lock_mapped(keys, 1).into_iter().map(Result::ok).collect();
        let found = locked.iter().filter(|l| l.is_some()).count();
        self.announce(&StorageEvent::PeerLocked { keys: keys.len(), found });
        locked
    }

    /// A peer unlocked what [`Self::lock_for_peer`] locked for it: `leases` are the parked
    /// leases its keys named (`None`: expired before the unlock came). Releases them.
    pub fn unlock_for_peer(&self, leases: Vec<Option<ReadLease>>) {
        let expired = leases.iter().filter(|l| l.is_none()).count();
        let released = leases.len() - expired;
        drop(leases);
        self.announce(&StorageEvent::PeerUnlocked { released, expired });
    }

    /// A request ended: `touched` (the keys it used) move up in L1's eviction order, and
    /// subscribers hear it.
    pub fn end_session(&self, request_id: &str, touched: &[ObjectKey]) {
        self.touch(touched);
        self.announce(&StorageEvent::SessionEnded { request_id, touched });
    }

    /// The L1 tier.
    pub fn l1(&self) -> &L1Cache {
        &self.l1
    }

    /// The L2 tier's counters, when one is configured.
    pub fn l2_stats(&self) -> Option<&crate::tier::TierStats> {
        self.l2.as_ref().map(L2Tier::stats)
    }

    /// The L2 tier, when configured: storage's own (nothing above storage reaches an
    /// adapter, and this crate's visibility, not a review, makes it so).
    pub(crate) fn l2_tier(&self) -> Option<&L2Tier> {
        self.l2.as_ref()
    }

    /// Whether an L2 tier is configured (it may have no adapter attached at the moment).
    pub fn has_l2(&self) -> bool {
        self.l2.is_some()
    }

    fn tier(&self) -> Result<&L2Tier, StorageError> {
        self.l2_tier().ok_or(StorageError::NoL2)
    }

    /// Installs the observers: `tier` hears L2 stores, prefetches and refused blobs; `l1`
    /// hears L1 removals.
    pub fn set_observers(&self, tier: Arc<dyn TierObserver>, l1: Arc<dyn lmcache_l1::L1Listener>) {
        if let Some(t) = &self.l2 {
            t.set_observer(tier);
        }
        self.l1.set_listener(l1);
    }

    /// Looks `req` up: the longest prefix L1 holds on every shard is read-locked `readers`
    /// times; if that is short and L2 has adapters, a prefetch of the rest starts and the
    /// answer is [`Lookup::Pending`].
    pub fn lookup(&self, req: &LookupRequest) -> Lookup {
        self.lookup_shards(&req.shards, req.world_size, req.readers, None)
    }

    fn lookup_shards(
        &self,
        shards: &[ShardKeys],
        world_size: u32,
        readers: u32,
        object: Option<&lmcache_core::ObjectShape>,
    ) -> Lookup {
        let chunks = shards.first().map_or(0, |(_, k)| k.len());
        let per_shard: Vec<(u32, Vec<ReadLease>)> = shards
            .iter()
            .map(|(w, keys)| (*w, self.l1.read_lock_prefix(keys, readers).unwrap_or_default()))
            .collect();
        let (leases, hit) = LookupLeases::common_prefix(world_size, per_shard);
        if hit >= chunks {
            return Lookup::Ready { leases, hits: hit };
        }
        // Per shard, the keys of the chunks L1 lacks.
        let rest: Vec<Vec<ObjectKey>> =
            shards.iter().map(|(_, k)| k.get(hit..).unwrap_or_default().to_vec()).collect();
        let workers = shards.iter().map(|(w, _)| *w).collect();
        match self.fetch_missing(rest, readers, object) {
            Some(handle) => Lookup::pending(leases, hit, handle, workers),
            None => Lookup::Ready { leases, hits: hit },
        }
    }

    /// Starts loading `rest` (per shard, keys of the same chunks, in order) into L1 from L2,
    /// then from the fleet's peers for what L2 could not serve; the handle's outcome holds
    /// the servable prefix, read-locked `readers` times. `None` when there is neither.
    fn fetch_missing(
        &self,
        rest: Vec<Vec<ObjectKey>>,
        readers: u32,
        object: Option<&lmcache_core::ObjectShape>,
    ) -> Option<PrefetchHandle> {
        let peers = self.peers.get().filter(|p| p.has_peers()).cloned();
        match (self.l2.as_ref().filter(|l2| !l2.is_empty()), peers) {
            (Some(l2), None) => Some(l2.start_prefetch(PrefetchRequest { shards: rest, readers })),
            (Some(l2), Some(peers)) => {
                // L2 first; what it could not serve, the peers are asked for.
                let (handle, complete) = crate::prefetch::PrefetchHandle::external();
                let req = PrefetchRequest { shards: rest.clone(), readers };
                let object = object.cloned();
                l2.prefetch(req, move |from_l2| {
                    let served = from_l2.hits;
                    if from_l2.expired || rest.first().is_none_or(|k| served >= k.len()) {
                        return complete(from_l2);
                    }
                    let shards = rest.into_iter().map(|k| k.into_iter().skip(served).collect());
                    let req = crate::peers::PeerFetch { shards: shards.collect(), readers, object };
                    let done = move |from_peers| complete(from_l2.then(from_peers));
                    peers.start(req, crate::peers::PeerDone::new(done));
                });
                Some(handle)
            }
            (None, Some(peers)) => {
                let req =
                    crate::peers::PeerFetch { shards: rest, readers, object: object.cloned() };
                Some(crate::peers::start(peers.as_ref(), req))
            }
            (None, None) => None,
        }
    }

    /// One chunk's objects (`keys`: one per object group and shard) read-locked `readers`
    /// times each, wherever they are: all of them in L1 at once (`Ok`), or a load of the
    /// ones L1 lacks from L2 and then the fleet's peers, whose outcome (`hits == 1`: every
    /// object resident and locked) holds the locks on those, with `Err`'s leases on the
    /// ones L1 had. `Err` with no handle: some object is nowhere to be asked for. A sparse
    /// lookup (CacheBlend's chunks found anywhere in a prompt) runs one per chunk.
    pub fn lock_chunk(
        &self,
        keys: &[ObjectKey],
        readers: u32,
    ) -> Result<Vec<ReadLease>, (Vec<ReadLease>, Option<PrefetchHandle>)> {
        let mut held = Vec::with_capacity(keys.len());
        let mut missing = Vec::new();
        for (k, r) in keys.iter().zip(self.l1.read_lock(keys, readers)) {
            match r {
                Ok(lease) => held.push(lease),
                Err(_) => missing.push(vec![k.clone()]),
            }
        }
        if missing.is_empty() {
            return Ok(held);
        }
        let handle = self.fetch_missing(missing, readers, None);
        Err((held, handle))
    }

    /// A lookup of a model stored as several object groups (a hybrid model under
    /// `--separate-object-groups`): every (object group, shard) row's resident chunks are
    /// locked, the hit is the longest prefix every row serves under its window
    /// ([`crate::fold`]), and only the cells that prefix needs stay locked: a sliding-window
    /// group never pins chunks it will not restore. When L1 falls short and L2 may have the
    /// rest, the lookup goes through L2 with every group needing every chunk (never more
    /// credit than the fold, perhaps less): taken only when L1 gave the windows no advantage,
    /// i.e. when the fold's hit is the common prefix of every row. With one group this is
    /// [`Self::lookup`].
    pub fn lookup_groups(&self, req: &GroupLookupRequest) -> Lookup {
        self.lookup_groups_of(req, None)
    }

    /// As [`Self::lookup_groups`], with the model's object shapes (what peers check a P2P
    /// lookup's layout against).
    pub(crate) fn lookup_groups_of(
        &self,
        req: &GroupLookupRequest,
        objects: Option<&[lmcache_core::ObjectShape]>,
    ) -> Lookup {
        use crate::fold;
        let Some((_, first)) = req.groups.first() else {
            return Lookup::Ready { leases: LookupLeases::default(), hits: 0 };
        };
        if req.groups.len() == 1 && req.groups[0].0.is_none() {
            let object = objects.and_then(<[_]>::first);
            return self.lookup_shards(first, req.world_size, req.readers, object);
        }
        let chunks = first.first().map_or(0, |(_, k)| k.len());
        // rows[og][shard]: the lock result of every chunk.
        let rows: Vec<Vec<(u32, Vec<Option<ReadLease>>)>> = req
            .groups
            .iter()
            .map(|(_, shards)| {
                shards
                    .iter()
                    .map(|(w, keys)| {
                        let l = self.l1.read_lock(keys, req.readers);
                        (*w, l.into_iter().map(Result::ok).collect())
                    })
                    .collect()
            })
            .collect();
        let present: Vec<(Vec<bool>, fold::Window)> = rows
            .iter()
            .zip(&req.groups)
            .flat_map(|(per_shard, (window, _))| {
                per_shard
                    .iter()
                    .map(move |(_, l)| (l.iter().map(Option::is_some).collect(), *window))
            })
            .collect();
        let view: Vec<(&[bool], fold::Window)> =
            present.iter().map(|(p, w)| (p.as_slice(), *w)).collect();
        let hit = fold::fold(&view);
        let common = present.iter().map(|(p, _)| p.iter().take_while(|&&x| x).count()).min();
        if self.has_l2() && hit < chunks && common == Some(hit) {
            drop(rows);
            let ws = req.world_size;
            let groups = req.groups.len() as u32;
            let mut strict = LookupRequest {
                shards: Vec::with_capacity(req.groups.len() * first.len()),
                world_size: ws.saturating_mul(groups),
                readers: req.readers,
            };
            for (og, (_, shards)) in req.groups.iter().enumerate() {
                for (w, keys) in shards {
                    // Row (og, w) is lease shard og * world_size + w: object group 0's rows
                    // keep their worker ids, which a retrieve spends; the others only hold
                    // their locks.
                    strict.shards.push((og as u32 * ws + w, keys.clone()));
                }
            }
            return self.lookup_shards(&strict.shards, strict.world_size, strict.readers, None);
        }
        let mut prefix = Vec::new();
        let mut pinned = Vec::new();
        for (og, (per_shard, (window, _))) in rows.into_iter().zip(&req.groups).enumerate() {
            let need = fold::needed(*window, hit);
            // Group 0 at full attention holds the prefix a retrieve spends; the rest is pinned.
            let full_attention_group_0 = og == 0 && window.is_none();
            for (w, leases) in per_shard {
                let kept = leases.into_iter().enumerate().filter(|(i, _)| need.contains(i));
                if full_attention_group_0 {
                    prefix.push((w, kept.filter_map(|(_, l)| l).collect::<Vec<_>>()));
                } else {
                    pinned.extend(kept.filter_map(|(_, l)| l));
                }
            }
        }
        let (mut leases, _) = LookupLeases::of_prefix(req.world_size, prefix);
        leases.pin(pinned);
        Lookup::Ready { leases, hits: hit }
    }

    /// The read leases a retrieve of `keys` copies from: `spent[i]` (one lock a lookup held,
    /// from [`crate::LookupLeases::take_one`]) where it is a lease on `keys[i]`, a new L1
    /// read lock of the key otherwise. One result per key, in order.
    pub fn retrieve_leases(
        &self,
        spent: Vec<Option<ReadLease>>,
        keys: &[ObjectKey],
    ) -> Vec<Result<ReadLease, L1Error>> {
        let mut out: Vec<Option<Result<ReadLease, L1Error>>> = Vec::with_capacity(keys.len());
        let mut spent = spent.into_iter();
        let mut missing = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            match spent.next().flatten() {
                Some(l) if l.key() == k => out.push(Some(Ok(l))),
                _ => {
                    missing.push(i);
                    out.push(None);
                }
            }
        }
        if !missing.is_empty() {
            let ks: Vec<ObjectKey> = missing.iter().map(|&i| keys[i].clone()).collect();
            for (&i, r) in missing.iter().zip(self.l1.read_lock(&ks, 1)) {
                out[i] = Some(r);
            }
        }
        out.into_iter().map(|r| r.unwrap_or(Err(L1Error::NotFound))).collect()
    }

    /// Warms L1 from L2 for `req` (no reader waits); `done` hears the outcome once, from a
    /// tier thread. Its leases are dropped by `done`'s caller: the objects stay in L1 under
    /// its eviction policy.
    pub fn prefetch(
        &self,
        req: PrefetchRequest,
        done: impl FnOnce(PrefetchOutcome) + Send + 'static,
    ) -> Result<(), StorageError> {
        self.tier()?.prefetch(req, done);
        Ok(())
    }

    /// Moves `keys` up in L1's eviction order (a request that used them ended).
    pub fn touch(&self, keys: &[ObjectKey]) {
        self.l1.touch(keys);
    }

    /// The quotas of one tier, sorted by salt.
    pub fn quotas(&self, tier: TierName) -> Result<Vec<(CacheSalt, u64)>, StorageError> {
        Ok(match tier {
            TierName::L1 => self.l1.quotas(),
            TierName::L2 => self.tier()?.quotas(),
        })
    }

    /// The quota of `salt` in one tier, if set.
    pub fn quota(&self, tier: TierName, salt: &CacheSalt) -> Result<Option<u64>, StorageError> {
        Ok(match tier {
            TierName::L1 => self.l1.quota(salt),
            TierName::L2 => self.tier()?.quota(salt),
        })
    }

    /// Bytes `salt` holds in one tier (all adapters, for L2).
    pub fn usage_of(&self, tier: TierName, salt: &CacheSalt) -> Result<u64, StorageError> {
        Ok(match tier {
            TierName::L1 => self.l1.usage_of(salt),
            TierName::L2 => self.tier()?.usage_of(salt),
        })
    }

    /// Sets (`None`: removes) the quota of `salt` in one tier. L1 enforces it at once; L2 at
    /// the next admission and within a second for what it holds.
    pub fn set_quota(
        &self,
        tier: TierName,
        salt: &CacheSalt,
        limit: Option<u64>,
    ) -> Result<(), StorageError> {
        match tier {
            TierName::L1 => {
                self.l1.set_quota(salt, limit);
                self.l1.run_maintenance();
            }
            TierName::L2 => self.tier()?.set_quota(salt, limit),
        }
        Ok(())
    }

    /// Deletes `keys` from the tiers `scope` names (`adapter`: one L2 adapter's id, or all).
    /// L1 objects locked by a reader stay unless `force` (then they go once released).
    pub async fn delete(
        &self,
        scope: DeleteScope,
        adapter: Option<u64>,
        keys: Vec<ObjectKey>,
        force: bool,
    ) -> Result<DeleteReport, StorageError> {
        let mut report = DeleteReport::default();
        if scope != DeleteScope::L2 {
            for r in self.l1.delete(&keys, force) {
                if r.is_ok() { report.deleted += 1 } else { report.skipped += 1 }
            }
        }
        if scope != DeleteScope::L1
            && let Some(t) = &self.l2
        {
            if let Some(id) = adapter
                && t.slot(id).is_none()
            {
                return Err(StorageError::NoSuchAdapter { id });
            }
            let n = keys.len();
            let held = t.delete(adapter, keys).await.map_err(|(who, source)| match who {
                Some((id, kind)) => StorageError::Adapter { id, kind, source },
                None => StorageError::Adapter {
                    id: adapter.unwrap_or(0),
                    kind: "l2 tier".into(),
                    source,
                },
            })? as usize;
            report.deleted += held;
            report.skipped += n.saturating_sub(held);
        }
        Ok(report)
    }

    /// One page of an L2 adapter's keys (`adapter`: its id, or the first), optionally of one
    /// model, from `cursor` (a token an earlier page returned).
    pub async fn list_l2(
        &self,
        adapter: Option<u64>,
        filter: lmcache_l2::KeyFilter,
        cursor: Option<String>,
        limit: usize,
    ) -> Result<L2Listing, StorageError> {
        let t = self.tier()?;
        let info = self.l2_adapter(adapter)?;
        let page = t
            .list(info.id, filter, cursor, limit)
            .await
            .ok_or(StorageError::NoSuchAdapter { id: info.id })?;
        let (id, kind) = (info.id, info.kind);
        match page {
            Ok(page) => Ok(L2Listing { adapter: id, kind, page }),
            Err(source) => Err(StorageError::Adapter { id, kind, source }),
        }
    }

    /// A snapshot of L2 adapter `id` (the first if `None`).
    pub fn l2_adapter(&self, id: Option<u64>) -> Result<AdapterInfo, StorageError> {
        let t = self.tier()?;
        let slot = match id {
            None => t.slots().into_iter().next(),
            Some(i) => t.slot(i),
        };
        slot.map(|s| crate::tier::describe_slot(&s))
            .ok_or(StorageError::NoSuchAdapter { id: id.unwrap_or(0) })
    }

    /// Snapshots of every L2 adapter, in priority order (empty without L2).
    pub fn describe_l2(&self) -> Vec<AdapterInfo> {
        self.l2.as_ref().map_or_else(Vec::new, L2Tier::describe)
    }

    /// Builds an adapter from `spec` (connecting to its backend, off the caller's runtime)
    /// and attaches it at the lowest priority; returns its id.
    pub async fn add_adapter(&self, spec: Value) -> Result<u64, StorageError> {
        Ok(self.tier()?.add_adapter_async(spec).await?)
    }

    /// Tells the L2 codecs the element type of a layout a worker registers (fp8 quantizes
    /// by it): Err when an adapter cannot serve it, and then nothing changed. No-op without L2.
    pub fn bind_layout_dtype(&self, dtype: lmcache_core::Dtype) -> Result<(), StorageError> {
        let Some(t) = &self.l2 else { return Ok(()) };
        t.bind_dtype(dtype).map_err(|(id, kind, reason)| StorageError::Layout { id, kind, reason })
    }

    /// Detaches and closes adapter `id`.
    pub async fn remove_adapter(&self, id: u64) -> Result<(), StorageError> {
        if self.tier()?.remove_adapter(id) {
            Ok(())
        } else {
            Err(StorageError::NoSuchAdapter { id })
        }
    }

    /// Reserves L1 memory for a store (see [`L1Cache::reserve_write`] for the per-key
    /// results). Requests refused for lack of memory while L1 holds objects the write-behind
    /// has not written yet are retried as it writes them, for at most the configured wait;
    /// then they may evict those objects.
    pub fn reserve_write(
        &self,
        requests: &[WriteRequest],
    ) -> Vec<Result<WriteReservation, L1Error>> {
        self.reserve_mode(requests, false)
    }

    fn reserve_mode(
        &self,
        requests: &[WriteRequest],
        supersede_staged: bool,
    ) -> Vec<Result<WriteReservation, L1Error>> {
        let mode = |evict_unwritten| ReserveMode {
            evict_unwritten,
            supersede_staged,
            ..ReserveMode::default()
        };
        let mut out = self.l1.reserve_with(requests, mode(false));
        let Some(tier) = &self.l2 else { return out };
        let deadline = Instant::now() + tier.config().write_behind_wait;
        loop {
            let (short, retry) = short_of_memory(requests, &out);
            if short.is_empty() || self.l1.unwritten() == 0 {
                return out;
            }
            let now = Instant::now();
            let progressed = now < deadline && tier.wait_progress(deadline - now);
            let again = if progressed {
                self.l1.reserve_with(&retry, mode(false))
            } else {
                // Waited long enough: the oldest unwritten objects go (counted).
                tracing::warn!(
                    chunks = retry.len(),
                    "L1 full of objects L2 has not written yet; evicting some to store"
                );
                self.l1.reserve_with(&retry, mode(true))
            };
            for (&i, r) in short.iter().zip(again) {
                out[i] = r;
            }
            if !progressed {
                return out;
            }
        }
    }

    /// Reserves L1 memory for a store whose reply must mean "visible": as
    /// [`Self::reserve_write`], but a key another writer holds staged (an engine-driven client
    /// still copying, a concurrent store) gets a reservation of this store's own instead of
    /// being taken as stored ([`lmcache_l1::ReserveMode::supersede_staged`]): this store
    /// never waits on, nor trusts, a writer that may be slow or dead. Only a resident key is
    /// [`StoreSlot::Resident`].
    pub fn reserve_for_store(&self, requests: &[WriteRequest]) -> Vec<StoreSlot> {
        self.reserve_mode(requests, true)
            .into_iter()
            .map(|r| match r {
                Ok(w) => StoreSlot::Write(w),
                Err(L1Error::NotWritable) => StoreSlot::Resident,
                Err(e) => StoreSlot::Refused(e),
            })
            .collect()
    }

    /// Commits `writes` to L1 (a request's last chunk enters eviction order first) and queues
    /// the committed ones for the write-behind. Returns one result per reservation, in order.
    pub fn commit(&self, writes: Vec<WriteReservation>) -> Vec<Result<(), L1Error>> {
        let keys: Vec<ObjectKey> = writes.iter().map(|w| w.key().clone()).collect();
        let results = self.l1.commit_batch(writes);
        if let Some(tier) = &self.l2 {
            tier.queue_store(
                keys.into_iter().zip(&results).filter(|(_, r)| r.is_ok()).map(|(k, _)| k),
            );
        }
        results
    }

    /// Waits for queued write-behind, at most `timeout`; returns the keys still pending.
    pub fn flush(&self, timeout: Duration) -> u64 {
        self.l2.as_ref().map_or(0, |t| t.flush(timeout))
    }

    /// Graceful stop: flushes the write-behind (at most the configured flush timeout), then
    /// closes every adapter. Returns the keys the flush left unwritten.
    pub fn shutdown(&self) -> u64 {
        let Some(t) = &self.l2 else { return 0 };
        let timeout = t.config().flush_timeout;
        let pending = t.flush(timeout);
        if pending > 0 {
            tracing::warn!(pending, ?timeout, "L2 write-behind not finished at shutdown");
        }
        t.shutdown();
        pending
    }
}

/// The requests whose reservation in `got` (one per request, in order) was refused for lack
/// of memory: their indices, and the requests to retry. A store and a prefetch both retry
/// these while the write-behind frees L1.
pub(crate) fn short_of_memory(
    requests: &[WriteRequest],
    got: &[Result<WriteReservation, L1Error>],
) -> (Vec<usize>, Vec<WriteRequest>) {
    got.iter()
        .enumerate()
        .filter(|(_, r)| matches!(r, Err(L1Error::OutOfMemory { .. })))
        .map(|(i, _)| (i, requests[i].clone()))
        .unzip()
}
