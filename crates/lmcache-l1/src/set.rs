//! The L1 tier as one or more members in write order: LMCache's tagged L1s
//! (`--l1-manager`, repeated).
//!
//! # Semantics
//! - **Writes** go to the first member; a key the first cannot fit *without evicting* goes to
//!   the next, and so on (LMCache's `OrderedWritePolicy`: only a capacity failure
//!   overflows; a batch may be split across members). When no member fits a key as it is,
//!   the members are tried again in order, now evicting as a single L1 does. A key already in a member (resident or being
//!   written) is reserved nowhere else: that member answers it.
//! - **Reads** come from whichever member holds the key, the first one if two do (two
//!   concurrent stores of one key can race into two members; both hold the same bytes, and
//!   a delete removes both).
//! - Each member keeps its own eviction policy, watermark, lease TTLs and quotas; a tenant's
//!   quota applies within each member. Parked leases live in the first member's table.
//! - **Demotion.** What a member's watermark chooses moves to the next member (copied, when
//!   it fits there without evicting) instead of being discarded: the members form tiers, the
//!   least recently used objects of the first sinking into the second, and only the last
//!   member's watermark discards. (LMCache's L1s each discard at their own watermark, so a
//!   second L1 only fills during bursts the first cannot take.)
//! - The first member is the *mapped* one: the arena engines map (the shared-memory pool)
//!   and peers read by offset. [`L1Cache::memory`] is its memory, and
//!   [`L1Cache::read_lock_mapped`] locks only what it holds.
//!
//! With one member every call goes straight to it.

use std::sync::Arc;

use lmcache_core::{CacheSalt, ObjectKey};
use lmcache_memory::ArenaAllocator;

use crate::cache::{
    ClearReport, Demoted, L1Listener, L1Member, L1Stats, L1Usage, MaintenanceReport, RemovalCause,
    ReserveMode, Residency, WriteRequest, listing_order,
};
use crate::config::L1Config;
use crate::error::{L1ConfigError, L1Error};
use crate::handles::{ReadLease, WriteReservation};
use crate::lease_table::LeaseId;
use crate::persist::PersistStats;

/// The tag of an L1 given by the legacy flags (LMCache's).
pub const DEFAULT_TAG: &str = "_default";

#[derive(Debug)]
struct Tagged {
    tag: String,
    l1: L1Member,
}

/// The L1 tier: one or more [`L1Member`]s in write order (see the module docs). Cheap to
/// clone; every clone is the same cache.
#[derive(Debug, Clone)]
pub struct L1Cache {
    members: Arc<[Tagged]>,
}

type Reserved = Result<WriteReservation, L1Error>;

/// A capacity failure: the only kind that overflows to the next member.
fn overflows(r: &Reserved) -> bool {
    matches!(r, Err(L1Error::OutOfMemory { .. } | L1Error::InvalidSize { .. }))
}

impl L1Cache {
    /// One L1 over `memory`, tagged [`DEFAULT_TAG`].
    pub fn new(config: L1Config, memory: ArenaAllocator) -> Result<Self, L1ConfigError> {
        Self::from_members(vec![(DEFAULT_TAG.to_owned(), L1Member::new(config, memory)?)])
    }

    /// Members in write order, each with its tag: at least one, tags non-empty and distinct.
    pub fn from_members(members: Vec<(String, L1Member)>) -> Result<Self, L1ConfigError> {
        if members.is_empty() {
            return Err(L1ConfigError::Members { reason: "no L1 at all".into() });
        }
        for (i, (tag, _)) in members.iter().enumerate() {
            if tag.trim().is_empty() {
                return Err(L1ConfigError::Members { reason: "an empty tag".into() });
            }
            if members[..i].iter().any(|(t, _)| t == tag) {
                return Err(L1ConfigError::Members { reason: format!("tag {tag:?} twice") });
            }
        }
        Ok(Self { members: members.into_iter().map(|(tag, l1)| Tagged { tag, l1 }).collect() })
    }

    /// The members in write order, with their tags.
    pub fn members(&self) -> impl DoubleEndedIterator<Item = (&str, &L1Member)> {
        self.members.iter().map(|m| (m.tag.as_str(), &m.l1))
    }

    /// How many members.
    pub fn member_count(&self) -> usize {
        self.members.len()
    }

    /// The first member: the one engines map and peers read by offset.
    pub fn mapped(&self) -> &L1Member {
        // `from_members` refuses an empty list, and nothing removes a member.
        &self.members[0].l1
    }

    /// The only member, when there is one.
    fn single(&self) -> Option<&L1Member> {
        match &*self.members {
            [only] => Some(&only.l1),
            _ => None,
        }
    }

    fn each(&self) -> impl Iterator<Item = &L1Member> {
        self.members.iter().map(|m| &m.l1)
    }

    /// Makes resident what each member's arena adopted from its file (see
    /// [`L1Member::adopt`]). A key two members adopted stays in the first only. Returns how
    /// many objects are resident after it.
    pub fn adopt(&self) -> u64 {
        let mut n: u64 = self.each().map(L1Member::adopt).sum();
        if n > 0 && self.members.len() > 1 {
            for (i, later) in self.members.iter().enumerate().skip(1) {
                let keys: Vec<ObjectKey> =
                    later.l1.resident_keys().into_iter().map(|(k, _)| k).collect();
                let twice: Vec<ObjectKey> = keys
                    .into_iter()
                    .filter(|k| self.members[..i].iter().any(|m| m.l1.contains(k)))
                    .collect();
                n -= later.l1.delete(&twice, true).iter().filter(|r| r.is_ok()).count() as u64;
            }
        }
        n
    }

    /// Tells the listener about every resident object (see [`L1Member::announce_resident`]).
    pub fn announce_resident(&self) {
        self.each().for_each(L1Member::announce_resident);
    }

    /// Waits for every member's seals (see [`L1Member::drain_seals`]); returns how many were
    /// still waiting, in all.
    pub fn drain_seals(&self, timeout: std::time::Duration) -> u64 {
        self.each().map(|m| m.drain_seals(timeout)).sum()
    }

    /// Sealing and adoption counters, summed over the members.
    pub fn persist_stats(&self) -> PersistStats {
        self.each().map(L1Member::persist_stats).fold(PersistStats::default(), |a, b| {
            PersistStats {
                sealed: a.sealed + b.sealed,
                seal_failed: a.seal_failed + b.seal_failed,
                seal_skipped: a.seal_skipped + b.seal_skipped,
                pending: a.pending + b.pending,
                adopted: a.adopted + b.adopted,
                adopted_bytes: a.adopted_bytes + b.adopted_bytes,
                adopt_refused: a.adopt_refused + b.adopt_refused,
            }
        })
    }

    /// Turns write-behind protection on or off in every member
    /// (see [`L1Member::set_write_behind`]).
    pub fn set_write_behind(&self, on: bool) {
        self.each().for_each(|m| m.set_write_behind(on));
    }

    /// The write-behind is done with `keys`, wherever they are.
    pub fn mark_written(&self, keys: &[ObjectKey]) {
        self.each().for_each(|m| m.mark_written(keys));
    }

    /// Resident objects not yet written to L2, in all members.
    pub fn unwritten(&self) -> usize {
        self.each().map(L1Member::unwritten).sum()
    }

    /// Installs the listener in every member.
    pub fn set_listener(&self, listener: Arc<dyn L1Listener>) {
        self.each().for_each(|m| m.set_listener(Arc::clone(&listener)));
    }

    /// The first member's settings (each member has its own: see [`Self::members`]).
    pub fn config(&self) -> &L1Config {
        self.mapped().config()
    }

    /// The memory of the first member: the arena engines map.
    pub fn memory(&self) -> &ArenaAllocator {
        self.mapped().memory()
    }

    /// Tells every member's prefaulter that about `bytes` will be written soon (see
    /// [`ArenaAllocator::expect_use`]): stores that overflow, or objects that move down, land
    /// in memory committed ahead of them too, not only the first member's.
    pub fn expect_use(&self, bytes: u64) {
        self.each().for_each(|m| m.memory().expect_use(bytes));
    }

    /// The largest object any member can hold.
    pub fn largest_object(&self) -> u64 {
        self.each().map(|m| m.memory().arena().len()).max().unwrap_or(0)
    }

    /// Reserves memory for each request (see [`L1Member::reserve_write`]), across members in
    /// write order.
    pub fn reserve_write(&self, requests: &[WriteRequest]) -> Vec<Reserved> {
        self.reserve_with(requests, ReserveMode::default())
    }

    /// Reserves memory for a store whose reply must mean "visible" ([`ReserveMode`]), across
    /// members in write order (see the module docs).
    pub fn reserve_with(&self, requests: &[WriteRequest], mode: ReserveMode) -> Vec<Reserved> {
        if let Some(only) = self.single() {
            return only.reserve_with(requests, mode);
        }
        let mut out: Vec<Option<Reserved>> = (0..requests.len()).map(|_| None).collect();
        // A key some later member already has is that member's to answer.
        let mut open: Vec<usize> = Vec::with_capacity(requests.len());
        let mut owned: Vec<Vec<usize>> = vec![Vec::new(); self.members.len()];
        let keys: Vec<ObjectKey> = requests.iter().map(|r| r.key.clone()).collect();
        let mut held: Vec<Option<usize>> = vec![None; requests.len()];
        for (m, member) in self.members.iter().enumerate().skip(1) {
            for (i, r) in member.l1.probe(&keys).into_iter().enumerate() {
                if r != Residency::Absent && held[i].is_none() {
                    held[i] = Some(m);
                }
            }
        }
        for (i, h) in held.into_iter().enumerate() {
            match h {
                Some(m) => owned[m].push(i),
                None => open.push(i),
            }
        }
        for (m, idx) in owned.iter().enumerate().filter(|(_, v)| !v.is_empty()) {
            let reqs: Vec<WriteRequest> = idx.iter().map(|&i| requests[i].clone()).collect();
            for (&i, r) in idx.iter().zip(self.members[m].l1.reserve_with(&reqs, mode)) {
                out[i] = Some(r);
            }
        }
        // Fill in order without evicting; what fits nowhere then evicts, in order (a refusal
        // counted once, by the last member).
        let last = self.members.len() - 1;
        for evicting in [false, true] {
            for (m, member) in self.members.iter().enumerate() {
                if open.is_empty() {
                    break;
                }
                let pass = ReserveMode {
                    no_eviction: !evicting,
                    uncounted: !evicting || m < last,
                    ..mode
                };
                let reqs: Vec<WriteRequest> = open.iter().map(|&i| requests[i].clone()).collect();
                let mut next = Vec::new();
                for (&i, r) in open.iter().zip(member.l1.reserve_with(&reqs, pass)) {
                    if overflows(&r) {
                        next.push(i);
                    }
                    out[i] = Some(r);
                }
                // A member allocates a batch all or nothing: without evicting, what is left
                // of it may still take some of the keys, one by one.
                if pass.no_eviction && next.len() > 1 {
                    let mut rest = Vec::new();
                    for i in next {
                        let r = member.l1.reserve_with(std::slice::from_ref(&requests[i]), pass);
                        let r = r.into_iter().next().unwrap_or(Err(L1Error::WrongState));
                        if overflows(&r) {
                            rest.push(i);
                        }
                        out[i] = Some(r);
                    }
                    next = rest;
                }
                open = next;
            }
        }
        out.into_iter().map(|r| r.unwrap_or(Err(L1Error::WrongState))).collect()
    }

    /// Commits reservations in one step per member (see [`L1Member::commit_batch`]).
    pub fn commit_batch(&self, reservations: Vec<WriteReservation>) -> Vec<Result<(), L1Error>> {
        if let Some(only) = self.single() {
            return only.commit_batch(reservations);
        }
        let n = reservations.len();
        let mut groups: Vec<(Vec<usize>, Vec<WriteReservation>)> =
            (0..self.members.len()).map(|_| (Vec::new(), Vec::new())).collect();
        let mut out: Vec<Result<(), L1Error>> = vec![Err(L1Error::WrongState); n];
        for (i, r) in reservations.into_iter().enumerate() {
            match self.members.iter().position(|m| m.l1.owns(r.shared())) {
                Some(m) => {
                    groups[m].0.push(i);
                    groups[m].1.push(r);
                }
                // Another cache's reservation: discarded (dropped) and refused.
                None => drop(r),
            }
        }
        for ((idx, rs), member) in groups.into_iter().zip(self.members.iter()) {
            if !rs.is_empty() {
                for (i, r) in idx.into_iter().zip(member.l1.commit_batch(rs)) {
                    out[i] = r;
                }
            }
        }
        out
    }

    /// Read-locks each key `count` times in the member that holds it (the first, if two do).
    pub fn read_lock(&self, keys: &[ObjectKey], count: u32) -> Vec<Result<ReadLease, L1Error>> {
        let mut out = self.mapped().read_lock(keys, count);
        for member in self.each().skip(1) {
            let miss: Vec<usize> =
                (0..keys.len()).filter(|&i| matches!(out[i], Err(L1Error::NotFound))).collect();
            if miss.is_empty() {
                break;
            }
            let ks: Vec<ObjectKey> = miss.iter().map(|&i| keys[i].clone()).collect();
            for (i, r) in miss.into_iter().zip(member.read_lock(&ks, count)) {
                out[i] = r;
            }
        }
        out
    }

    /// Read-locks keys the first member holds, and only those: what a peer reads by offset
    /// in the memory this cache maps ([`Self::memory`]).
    pub fn read_lock_mapped(
        &self,
        keys: &[ObjectKey],
        count: u32,
    ) -> Vec<Result<ReadLease, L1Error>> {
        self.mapped().read_lock(keys, count)
    }

    /// Read-locks the longest prefix of `keys` that is resident, stopping at the first miss.
    pub fn read_lock_prefix(
        &self,
        keys: &[ObjectKey],
        count: u32,
    ) -> Result<Vec<ReadLease>, L1Error> {
        if let Some(only) = self.single() {
            return only.read_lock_prefix(keys, count);
        }
        let mut out = Vec::new();
        for r in self.read_lock(keys, count) {
            match r {
                Ok(l) => out.push(l),
                Err(e @ L1Error::InvalidLockCount { .. }) => return Err(e),
                // The locks taken past the miss are released as `rest` drops.
                Err(_) => break,
            }
        }
        Ok(out)
    }

    /// True when `key` is resident in a member.
    pub fn contains(&self, key: &ObjectKey) -> bool {
        self.each().any(|m| m.contains(key))
    }

    /// Where each of `keys` stands: resident in a member, else being written in one, else
    /// absent.
    pub fn probe(&self, keys: &[ObjectKey]) -> Vec<Residency> {
        let mut out = self.mapped().probe(keys);
        for member in self.each().skip(1) {
            if out.iter().all(|r| *r == Residency::Resident) {
                break;
            }
            for (o, r) in out.iter_mut().zip(member.probe(keys)) {
                if r == Residency::Resident
                    || (r == Residency::BeingWritten && *o == Residency::Absent)
                {
                    *o = r;
                }
            }
        }
        out
    }

    /// Every resident key with its bytes, once, in a stable order (see
    /// [`L1Member::resident_keys`]).
    pub fn resident_keys(&self) -> Vec<(ObjectKey, u64)> {
        if let Some(only) = self.single() {
            return only.resident_keys();
        }
        let mut keys: Vec<(ObjectKey, u64)> =
            self.each().flat_map(L1Member::resident_keys).collect();
        keys.sort_by(|(a, _), (b, _)| listing_order(a, b));
        keys.dedup_by(|(a, _), (b, _)| a == b);
        keys
    }

    /// How many leading keys are resident (in any member).
    pub fn prefix_hits(&self, keys: &[ObjectKey]) -> usize {
        if let Some(only) = self.single() {
            return only.prefix_hits(keys);
        }
        keys.iter().take_while(|k| self.contains(k)).count()
    }

    /// Records a use of each resident key, in the member that holds it.
    pub fn touch(&self, keys: &[ObjectKey]) {
        self.each().for_each(|m| m.touch(keys));
    }

    /// Deletes keys from every member (see [`L1Member::delete`]): `Ok` where a member deleted
    /// the key; otherwise the first member's refusal other than [`L1Error::NotFound`].
    pub fn delete(&self, keys: &[ObjectKey], force: bool) -> Vec<Result<(), L1Error>> {
        let mut out = self.mapped().delete(keys, force);
        for member in self.each().skip(1) {
            for (o, r) in out.iter_mut().zip(member.delete(keys, force)) {
                match (&*o, r) {
                    (Ok(()), _) | (Err(_), Err(L1Error::NotFound)) => {}
                    (Err(L1Error::NotFound), r) | (Err(_), r @ Ok(())) => *o = r,
                    (Err(_), Err(_)) => {}
                }
            }
        }
        out
    }

    /// Clears every member (see [`L1Member::clear`]).
    pub fn clear(&self, force: bool) -> ClearReport {
        self.each().map(|m| m.clear(force)).fold(ClearReport::default(), |a, b| ClearReport {
            removed: a.removed + b.removed,
            skipped: a.skipped + b.skipped,
        })
    }

    /// Frees at least `bytes` by evicting unlocked objects (of one tenant if `scope`), from
    /// the members in order. Returns the bytes freed.
    pub fn evict(&self, scope: Option<&CacheSalt>, bytes: u64) -> u64 {
        let mut freed = 0;
        for m in self.each() {
            if freed >= bytes {
                break;
            }
            freed += m.evict(scope, bytes - freed);
        }
        freed
    }

    /// One maintenance pass in every member, each under its own settings, in write order.
    /// What a member's watermark chooses moves to the next member when it fits there without
    /// evicting (a tier below, as LMCache's L1s are not: they discard), and is evicted
    /// otherwise; the last member evicts.
    pub fn run_maintenance(&self) -> MaintenanceReport {
        let mut total = MaintenanceReport::default();
        for (i, member) in self.members.iter().enumerate() {
            let r = match self.members.get(i + 1) {
                Some(next) => {
                    let mut out = Vec::new();
                    let r = member.l1.run_maintenance_demoting(&mut out);
                    demote(&member.l1, &next.l1, out);
                    r
                }
                None => member.l1.run_maintenance(),
            };
            total = MaintenanceReport {
                quota_evicted_bytes: total.quota_evicted_bytes + r.quota_evicted_bytes,
                watermark_evicted_bytes: total.watermark_evicted_bytes + r.watermark_evicted_bytes,
                demoted_bytes: total.demoted_bytes + r.demoted_bytes,
                expired_read_leases: total.expired_read_leases + r.expired_read_leases,
                expired_write_leases: total.expired_write_leases + r.expired_write_leases,
            };
        }
        total
    }

    /// Sets or removes a tenant's quota in bytes, in every member (it applies within each).
    pub fn set_quota(&self, salt: &CacheSalt, limit: Option<u64>) {
        self.each().for_each(|m| m.set_quota(salt, limit));
    }

    /// A tenant's quota (per member).
    pub fn quota(&self, salt: &CacheSalt) -> Option<u64> {
        self.mapped().quota(salt)
    }

    /// Every quota (per member).
    pub fn quotas(&self) -> Vec<(CacheSalt, u64)> {
        self.mapped().quotas()
    }

    /// A tenant's usage in bytes, in all members.
    pub fn usage_of(&self, salt: &CacheSalt) -> u64 {
        self.each().map(|m| m.usage_of(salt)).sum()
    }

    /// Occupancy and counters of all members together (each member's: [`Self::members`]).
    pub fn usage(&self) -> L1Usage {
        match self.single() {
            Some(only) => only.usage(),
            None => self.usage_by_member().0,
        }
    }

    /// The total of [`Self::usage`] and each member's occupancy in write order, with its tag,
    /// from one snapshot per member (a snapshot walks every entry of the member).
    pub fn usage_by_member(&self) -> (L1Usage, Vec<(&str, L1Usage)>) {
        let per: Vec<(&str, L1Usage)> =
            self.members.iter().map(|m| (m.tag.as_str(), m.l1.usage())).collect();
        // `from_members` refuses an empty list.
        let mut u = per[0].1.clone();
        for (_, v) in &per[1..] {
            u.capacity += v.capacity;
            u.used_bytes += v.used_bytes;
            u.staged_bytes += v.staged_bytes;
            u.resident_objects += v.resident_objects;
            u.staged_objects += v.staged_objects;
            u.locked_objects += v.locked_objects;
            for (salt, bytes) in &v.by_salt {
                match u.by_salt.iter_mut().find(|(s, _)| s == salt) {
                    Some((_, b)) => *b += bytes,
                    None => u.by_salt.push((salt.clone(), *bytes)),
                }
            }
            let (a, b) = (&mut u.memory.allocator, &v.memory.allocator);
            a.capacity += b.capacity;
            a.allocated_bytes += b.allocated_bytes;
            a.live_blocks += b.live_blocks;
            a.binned_bytes += b.binned_bytes;
            a.largest_free_extent = a.largest_free_extent.max(b.largest_free_extent);
            u.stats = add_stats(u.stats, v.stats);
        }
        (u, per)
    }

    /// Parks a read lease for a client that releases it in a later message.
    pub fn park_read(&self, lease: ReadLease) -> LeaseId {
        self.mapped().park_read(lease)
    }

    /// Takes a parked read lease back.
    pub fn take_read(&self, id: LeaseId) -> Option<ReadLease> {
        self.mapped().take_read(id)
    }

    /// Parks a write reservation for a client that commits it in a later message.
    pub fn park_write(&self, reservation: WriteReservation) -> LeaseId {
        self.mapped().park_write(reservation)
    }

    /// Takes a parked write reservation back.
    pub fn take_write(&self, id: LeaseId) -> Option<WriteReservation> {
        self.mapped().take_write(id)
    }

    /// Parked (read, write) leases.
    pub fn parked_leases(&self) -> (usize, usize) {
        self.mapped().parked_leases()
    }

    /// Checks every member (see [`L1Member::check_invariants`]). O(n); for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        for m in self.members.iter() {
            m.l1.check_invariants().map_err(|e| format!("L1 {:?}: {e}", m.tag))?;
        }
        Ok(())
    }
}

/// Moves objects `from`'s watermark handed out into `to`, where they fit without evicting:
/// each copied (its bytes no longer change: the handle in `out` keeps them) and committed;
/// one that does not fit, or that `to` holds already, is gone from `from` as evicted.
fn demote(from: &L1Member, to: &L1Member, out: Demoted) {
    if out.is_empty() {
        return;
    }
    let reqs: Vec<WriteRequest> =
        out.iter().map(|(k, mem)| WriteRequest::new(k.clone(), mem.len())).collect();
    let mode = ReserveMode { no_eviction: true, ..ReserveMode::default() };
    let mut placed = Vec::with_capacity(out.len());
    let mut lost = Vec::new();
    for ((key, mem), r) in out.into_iter().zip(to.reserve_with(&reqs, mode)) {
        match r {
            Ok(mut w) if w.len() == mem.len() => {
                w.as_mut_slice().copy_from_slice(mem.as_slice());
                placed.push(w);
            }
            Err(L1Error::NotWritable) if to.contains(&key) => {}
            _ => lost.push(key),
        }
        // The source's memory goes here, outside every lock.
        drop(mem);
    }
    let keys: Vec<ObjectKey> = placed.iter().map(|w| w.key().clone()).collect();
    for (key, r) in keys.iter().zip(to.commit_batch(placed)) {
        if r.is_err() && !to.contains(key) {
            lost.push(key.clone());
        }
    }
    // The watermark hands out only objects the write-behind is done with (or none runs):
    // the copies are no less written than their sources.
    to.mark_written(&keys);
    for key in &lost {
        from.announce_removed(key, RemovalCause::Evicted);
    }
    if !lost.is_empty() {
        tracing::debug!(objects = lost.len(), "demotion found no room in the next L1: evicted");
    }
}

fn add_stats(a: L1Stats, b: L1Stats) -> L1Stats {
    L1Stats {
        evicted_objects: a.evicted_objects + b.evicted_objects,
        evicted_bytes: a.evicted_bytes + b.evicted_bytes,
        sync_evictions: a.sync_evictions + b.sync_evictions,
        oom_rejections: a.oom_rejections + b.oom_rejections,
        quota_rejections: a.quota_rejections + b.quota_rejections,
        committed: a.committed + b.committed,
        discarded: a.discarded + b.discarded,
        maintenance_passes: a.maintenance_passes.max(b.maintenance_passes),
        expired_read_leases: a.expired_read_leases + b.expired_read_leases,
        expired_write_leases: a.expired_write_leases + b.expired_write_leases,
        unwritten_evictions: a.unwritten_evictions + b.unwritten_evictions,
        demoted_objects: a.demoted_objects + b.demoted_objects,
        superseded: a.superseded + b.superseded,
    }
}
