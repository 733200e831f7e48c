//! [`Ledger`]: what the tier knows one adapter holds: each key's stored bytes, the bytes per
//! cache_salt, the eviction order (one of L1's policies, reused), the bytes admitted but still
//! being written, and the keys a prefetch is reading (never evicted while it reads them).
//!
//! One ledger definition for every adapter (LMCache counts differently per adapter and forgets
//! everything at restart): sizes are stored blob lengths; the ledger is seeded at start from
//! what the adapter already holds ([`lmcache_l2::L2Adapter::scan`]), and goes down on every
//! delete and eviction.
//!
//! Capacity is enforced at admission: [`Ledger::admit`] reserves a write's bytes and, if they
//! would not fit under the capacity or the salt's quota, picks victims first (the caller
//! deletes them before writing). What cannot fit is refused, so the adapter never holds more
//! than its capacity through this tier. The watermark pass ([`Ledger::pass`]) then keeps usage
//! below `trigger_watermark` so that admissions rarely have to evict.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use lmcache_core::{CacheSalt, ObjectKey};
use lmcache_l1::EntryId;
use lmcache_l1::EvictionPolicyKind;
use lmcache_l1::eviction::{EntryMeta, EvictionPolicy};
use lmcache_l2::config::{EvictionSpec, L2EvictionPolicy};
use parking_lot::Mutex;
use slotmap::SlotMap;

#[derive(Debug)]
struct Entry {
    key: ObjectKey,
    bytes: u64,
}

#[derive(Debug)]
struct State {
    index: HashMap<ObjectKey, EntryId>,
    entries: SlotMap<EntryId, Entry>,
    policy: Box<dyn EvictionPolicy>,
    /// Bytes of the keys held.
    used: u64,
    /// Bytes admitted whose write has not ended.
    reserved: u64,
    by_salt: HashMap<CacheSalt, u64>,
    reserved_by_salt: HashMap<CacheSalt, u64>,
    /// Keys a prefetch is reading, with the number of readers.
    pins: HashMap<ObjectKey, u32>,
    /// Keys chosen for eviction whose delete has not ended.
    doomed: HashSet<ObjectKey>,
}

/// Why a write was refused admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The salt's quota cannot make room (everything else of that salt is being read).
    Quota,
    /// The capacity cannot make room.
    Capacity,
}

/// A key chosen for eviction: the caller deletes it from the adapter, then calls
/// [`Ledger::evicted`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Victim {
    /// The key.
    pub key: ObjectKey,
    /// Its stored bytes.
    pub bytes: u64,
}

/// The usage of one adapter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes held (keys written or found at start).
    pub used: u64,
    /// Bytes admitted and being written.
    pub reserved: u64,
    /// Keys held.
    pub keys: usize,
    /// Bytes held per cache_salt, sorted by salt.
    pub by_salt: Vec<(CacheSalt, u64)>,
}

/// The ledger of one adapter. See the module docs.
#[derive(Debug)]
pub struct Ledger {
    state: Mutex<State>,
    capacity: Option<u64>,
    eviction: Option<EvictionSpec>,
    hasher: foldhash::fast::FixedState,
}

fn policy_of(spec: Option<EvictionSpec>) -> Box<dyn EvictionPolicy> {
    match spec.map(|e| e.policy) {
        None | Some(L2EvictionPolicy::Lru) => EvictionPolicyKind::Lru.build(),
        Some(L2EvictionPolicy::Arc) => EvictionPolicyKind::Arc.build(),
        Some(L2EvictionPolicy::IsolatedLru) => EvictionPolicyKind::IsolatedLru.build(),
        Some(L2EvictionPolicy::Noop) => EvictionPolicyKind::Noop.build(),
    }
}

fn add(map: &mut HashMap<CacheSalt, u64>, salt: &CacheSalt, delta: i64) {
    let v = map.entry(salt.clone()).or_insert(0);
    *v = v.saturating_add_signed(delta);
    if *v == 0 {
        map.remove(salt);
    }
}

impl State {
    fn insert(&mut self, key: &ObjectKey, bytes: u64, hash: u64) {
        if let Some(&id) = self.index.get(key) {
            // Held already (a rewrite, or a store of a key found at start): refresh it.
            if let Some(e) = self.entries.get_mut(id) {
                let old = e.bytes;
                e.bytes = bytes;
                self.used = self.used - old + bytes;
                add(&mut self.by_salt, &key.cache_salt, bytes as i64 - old as i64);
            }
            self.policy.on_access(id);
            return;
        }
        let id = self.entries.insert(Entry { key: key.clone(), bytes });
        self.index.insert(key.clone(), id);
        self.policy.on_insert(id, EntryMeta { key_hash: hash, cache_salt: &key.cache_salt, bytes });
        self.used += bytes;
        add(&mut self.by_salt, &key.cache_salt, bytes as i64);
    }

    fn remove_entry(&mut self, id: EntryId) -> Option<Entry> {
        let e = self.entries.remove(id)?;
        self.index.remove(&e.key);
        self.used = self.used.saturating_sub(e.bytes);
        add(&mut self.by_salt, &e.key.cache_salt, -(e.bytes as i64));
        Some(e)
    }

    /// Chooses victims worth `target` bytes (within `scope`), never a pinned key, removes
    /// them from the ledger and marks them doomed.
    fn choose(&mut self, scope: Option<&CacheSalt>, target: u64, out: &mut Vec<Victim>) -> u64 {
        if target == 0 {
            return 0;
        }
        let mut ids = Vec::new();
        let (entries, pins) = (&self.entries, &self.pins);
        let mut eligible = |id: EntryId| {
            let e = entries.get(id)?;
            if pins.contains_key(&e.key) || scope.is_some_and(|s| *s != e.key.cache_salt) {
                return None;
            }
            Some(e.bytes)
        };
        let chosen = self.policy.evict(scope, target, &mut eligible, &mut ids);
        for id in ids {
            if let Some(e) = self.remove_entry(id) {
                self.doomed.insert(e.key.clone());
                out.push(Victim { key: e.key, bytes: e.bytes });
            }
        }
        chosen
    }
}

impl Ledger {
    /// A ledger for an adapter of `capacity` bytes (unbounded if `None`) with `eviction`
    /// settings (absent: LRU order, evicting only when a write would not fit).
    pub fn new(capacity: Option<u64>, eviction: Option<EvictionSpec>) -> Self {
        Self {
            state: Mutex::new(State {
                index: HashMap::new(),
                entries: SlotMap::with_key(),
                policy: policy_of(eviction),
                used: 0,
                reserved: 0,
                by_salt: HashMap::new(),
                reserved_by_salt: HashMap::new(),
                pins: HashMap::new(),
                doomed: HashSet::new(),
            }),
            capacity,
            eviction,
            hasher: foldhash::fast::FixedState::with_seed(0x6c32_6c65_6467_6572),
        }
    }

    /// The capacity in bytes, if bounded.
    pub fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// The eviction settings, if configured.
    pub fn eviction(&self) -> Option<EvictionSpec> {
        self.eviction
    }

    /// Whether a salt without a quota may keep nothing (IsolatedLRU, as LMCache's allowlist).
    pub fn quota_required(&self) -> bool {
        self.eviction.is_some_and(|e| e.policy == L2EvictionPolicy::IsolatedLru)
    }

    fn hash(&self, key: &ObjectKey) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(key)
    }

    /// Records that the adapter holds `key` with `bytes` stored bytes (a refresh if known).
    pub fn record(&self, key: &ObjectKey, bytes: u64) {
        let h = self.hash(key);
        self.state.lock().insert(key, bytes, h);
    }

    /// Adds keys found in the adapter at start; keys already known are left as they are.
    /// Returns how many were added.
    pub fn seed(&self, items: &[(ObjectKey, u64)]) -> usize {
        let mut st = self.state.lock();
        let mut n = 0;
        for (k, b) in items {
            if !st.index.contains_key(k) && !st.doomed.contains(k) {
                st.insert(k, *b, self.hash(k));
                n += 1;
            }
        }
        n
    }

    /// Forgets keys deleted from the adapter; returns the bytes they held.
    pub fn forget(&self, keys: &[ObjectKey]) -> u64 {
        let mut st = self.state.lock();
        let mut freed = 0;
        for k in keys {
            if let Some(id) = st.index.get(k).copied() {
                st.policy.on_remove(id);
                if let Some(e) = st.remove_entry(id) {
                    freed += e.bytes;
                }
            }
        }
        freed
    }

    /// Records a use of `keys` (a load).
    pub fn touch(&self, keys: &[ObjectKey]) {
        let mut st = self.state.lock();
        for k in keys.iter().rev() {
            if let Some(id) = st.index.get(k).copied() {
                st.policy.on_access(id);
            }
        }
    }

    /// Whether the ledger knows `key`.
    pub fn contains(&self, key: &ObjectKey) -> bool {
        self.state.lock().index.contains_key(key)
    }

    /// Usage now.
    pub fn usage(&self) -> Usage {
        let st = self.state.lock();
        let mut by_salt: Vec<(CacheSalt, u64)> =
            st.by_salt.iter().map(|(k, v)| (k.clone(), *v)).collect();
        by_salt.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        Usage { used: st.used, reserved: st.reserved, keys: st.index.len(), by_salt }
    }

    /// Pins `keys` against eviction while a prefetch reads them. Returns the guard and, per
    /// key, whether it is being evicted right now (then it must be treated as a miss).
    pub fn pin(self: &Arc<Self>, keys: &[ObjectKey]) -> (Pins, Vec<bool>) {
        let mut st = self.state.lock();
        let mut doomed = Vec::with_capacity(keys.len());
        for k in keys {
            *st.pins.entry(k.clone()).or_insert(0) += 1;
            doomed.push(st.doomed.contains(k));
        }
        (Pins { ledger: self.clone(), keys: keys.to_vec() }, doomed)
    }

    /// Admits a write of `bytes` under `salt` whose quota is `quota` (`None`: none set).
    /// On success the bytes are reserved until the returned [`Admission`] is committed or
    /// dropped, and the victims (possibly none) must be deleted from the adapter first.
    pub fn admit(
        self: &Arc<Self>,
        salt: &CacheSalt,
        bytes: u64,
        quota: Option<u64>,
    ) -> Result<(Admission, Vec<Victim>), Refusal> {
        let mut st = self.state.lock();
        let mut victims = Vec::new();
        let limit = match quota {
            Some(q) => Some(q),
            None if self.quota_required() => Some(0),
            None => None,
        };
        if let Some(limit) = limit {
            if bytes > limit {
                return Err(Refusal::Quota);
            }
            let held = st.by_salt.get(salt).copied().unwrap_or(0)
                + st.reserved_by_salt.get(salt).copied().unwrap_or(0);
            let excess = (held + bytes).saturating_sub(limit);
            if excess > 0 && st.choose(Some(salt), excess, &mut victims) < excess {
                self.restore(&mut st, victims);
                return Err(Refusal::Quota);
            }
        }
        if let Some(cap) = self.capacity {
            if bytes > cap {
                self.restore(&mut st, victims);
                return Err(Refusal::Capacity);
            }
            let excess = (st.used + st.reserved + bytes).saturating_sub(cap);
            if excess > 0 && st.choose(None, excess, &mut victims) < excess {
                self.restore(&mut st, victims);
                return Err(Refusal::Capacity);
            }
        }
        st.reserved += bytes;
        *st.reserved_by_salt.entry(salt.clone()).or_insert(0) += bytes;
        drop(st);
        Ok((Admission { ledger: self.clone(), salt: salt.clone(), bytes, open: true }, victims))
    }

    /// Puts back victims chosen for an admission that was then refused.
    fn restore(&self, st: &mut State, victims: Vec<Victim>) {
        for v in victims {
            st.doomed.remove(&v.key);
            st.insert(&v.key, v.bytes, self.hash(&v.key));
        }
    }

    /// Ends the eviction of `victims`: `deleted` says, per victim, whether the adapter
    /// deleted it (or no longer held it). Those not deleted are put back.
    pub fn evicted(&self, victims: &[Victim], deleted: bool) {
        let mut st = self.state.lock();
        for v in victims {
            st.doomed.remove(&v.key);
            if !deleted {
                st.insert(&v.key, v.bytes, self.hash(&v.key));
            }
        }
    }

    /// Whether usage has reached the watermark (never without an eviction block).
    pub fn over_watermark(&self) -> bool {
        match (self.capacity, self.eviction) {
            (Some(cap), Some(e)) => {
                let st = self.state.lock();
                (st.used + st.reserved) as f64 >= e.trigger_watermark * cap as f64
            }
            _ => false,
        }
    }

    /// One watermark pass: victims that bring each salt above its quota (or, for IsolatedLRU,
    /// each salt without one) back under it, then the whole adapter back under its watermark.
    /// Each pass frees at least `eviction_ratio` of what it looks at, so it does not run for
    /// every store.
    pub fn pass(&self, quotas: &HashMap<CacheSalt, u64>) -> Vec<Victim> {
        let Some(e) = self.eviction else { return Vec::new() };
        let mut st = self.state.lock();
        let mut victims = Vec::new();
        let salts: Vec<(CacheSalt, u64)> =
            st.by_salt.iter().map(|(k, v)| (k.clone(), *v)).collect();
        for (salt, held) in salts {
            let limit = match quotas.get(&salt) {
                Some(q) => *q,
                None if self.quota_required() => 0,
                None => continue,
            };
            let mark = (e.trigger_watermark * limit as f64) as u64;
            if held > limit || (limit > 0 && held >= mark) {
                let target = held.saturating_sub(mark).max((e.eviction_ratio * held as f64) as u64);
                st.choose(Some(&salt), target, &mut victims);
            }
        }
        if let Some(cap) = self.capacity {
            let used = st.used + st.reserved;
            let mark = (e.trigger_watermark * cap as f64) as u64;
            if used >= mark {
                let target = (used - mark).max((e.eviction_ratio * st.used as f64) as u64);
                st.choose(None, target, &mut victims);
            }
        }
        victims
    }
}

/// Bytes reserved for one write: [`Admission::commit`] turns them into a held key; dropping
/// it (a failed write) releases them.
#[derive(Debug)]
pub struct Admission {
    ledger: Arc<Ledger>,
    salt: CacheSalt,
    bytes: u64,
    open: bool,
}

impl Admission {
    fn release(&mut self, st: &mut State) {
        if std::mem::take(&mut self.open) {
            st.reserved = st.reserved.saturating_sub(self.bytes);
            add(&mut st.reserved_by_salt, &self.salt, -(self.bytes as i64));
        }
    }

    /// The write ended with the adapter holding `key` in `bytes` bytes.
    pub fn commit(mut self, key: &ObjectKey, bytes: u64) {
        let h = self.ledger.hash(key);
        let ledger = self.ledger.clone();
        let mut st = ledger.state.lock();
        self.release(&mut st);
        st.insert(key, bytes, h);
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if self.open {
            let ledger = self.ledger.clone();
            let mut st = ledger.state.lock();
            self.release(&mut st);
        }
    }
}

/// Keys pinned against eviction while a prefetch reads them; dropping unpins.
#[derive(Debug)]
pub struct Pins {
    ledger: Arc<Ledger>,
    keys: Vec<ObjectKey>,
}

impl Drop for Pins {
    fn drop(&mut self) {
        let mut st = self.ledger.state.lock();
        for k in &self.keys {
            if let Some(n) = st.pins.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    st.pins.remove(k);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8, salt: &str) -> ObjectKey {
        ObjectKey::new([i; 32], "m", 1, 0, 0, salt).unwrap()
    }

    fn lru(cap: u64) -> Arc<Ledger> {
        Arc::new(Ledger::new(
            Some(cap),
            Some(EvictionSpec {
                policy: L2EvictionPolicy::Lru,
                trigger_watermark: 0.8,
                eviction_ratio: 0.2,
            }),
        ))
    }

    fn store(l: &Arc<Ledger>, k: &ObjectKey, b: u64) -> Vec<Victim> {
        let (adm, v) = l.admit(&k.cache_salt, b, None).unwrap();
        l.evicted(&v, true);
        adm.commit(k, b);
        v
    }

    #[test]
    fn admission_evicts_oldest_to_stay_within_capacity() {
        let l = lru(100);
        for i in 0..10 {
            assert!(store(&l, &key(i, ""), 10).is_empty());
        }
        assert_eq!(l.usage().used, 100);
        let v = store(&l, &key(10, ""), 25);
        assert_eq!(
            v.iter().map(|v| v.key.clone()).collect::<Vec<_>>(),
            vec![key(0, ""), key(1, ""), key(2, "")]
        );
        assert!(l.usage().used <= 100);
        assert!(!l.contains(&key(0, "")) && l.contains(&key(10, "")));
    }

    #[test]
    fn pinned_keys_are_never_victims_and_a_full_pinned_ledger_refuses() {
        let l = lru(30);
        for i in 0..3 {
            store(&l, &key(i, ""), 10);
        }
        let (pins, doomed) = l.pin(&[key(0, ""), key(1, ""), key(2, "")]);
        assert_eq!(doomed, vec![false; 3]);
        assert_eq!(l.admit(&CacheSalt::EMPTY, 10, None).unwrap_err(), Refusal::Capacity);
        assert_eq!(l.usage().used, 30, "a refused admission puts its victims back");
        assert!(l.pass(&HashMap::new()).is_empty());
        drop(pins);
        let v = store(&l, &key(3, ""), 10);
        assert_eq!(v.len(), 1);
    }

    #[test]
    fn doomed_keys_are_reported_to_readers() {
        let l = lru(20);
        store(&l, &key(0, ""), 10);
        store(&l, &key(1, ""), 10);
        let (adm, v) = l.admit(&CacheSalt::EMPTY, 10, None).unwrap();
        assert_eq!(v.len(), 1);
        let (_p, doomed) = l.pin(&[v[0].key.clone()]);
        assert_eq!(doomed, vec![true]);
        l.evicted(&v, true);
        drop(adm);
        assert_eq!(l.usage().reserved, 0);
    }

    #[test]
    fn quota_evicts_within_the_salt_and_isolated_lru_needs_a_quota() {
        let l = lru(1000);
        store(&l, &key(0, "a"), 10);
        store(&l, &key(1, "b"), 10);
        store(&l, &key(2, "a"), 10);
        // Salt a limited to 20: a third write of a evicts a's oldest, never b's.
        let (adm, v) = l.admit(&CacheSalt::new("a").unwrap(), 10, Some(20)).unwrap();
        assert_eq!(v.iter().map(|v| v.key.clone()).collect::<Vec<_>>(), vec![key(0, "a")]);
        l.evicted(&v, true);
        adm.commit(&key(3, "a"), 10);
        assert!(l.contains(&key(1, "b")));
        assert_eq!(
            l.admit(&CacheSalt::new("a").unwrap(), 30, Some(20)).unwrap_err(),
            Refusal::Quota
        );

        let iso = Arc::new(Ledger::new(
            Some(1000),
            Some(EvictionSpec {
                policy: L2EvictionPolicy::IsolatedLru,
                trigger_watermark: 0.8,
                eviction_ratio: 0.2,
            }),
        ));
        assert_eq!(iso.admit(&CacheSalt::new("x").unwrap(), 1, None).unwrap_err(), Refusal::Quota);
        iso.seed(&[(key(5, "x"), 10), (key(6, "y"), 10)]);
        let mut q = HashMap::new();
        q.insert(CacheSalt::new("y").unwrap(), 100);
        let v = iso.pass(&q);
        assert_eq!(v.iter().map(|v| v.key.clone()).collect::<Vec<_>>(), vec![key(5, "x")]);
    }

    #[test]
    fn watermark_pass_brings_usage_under_the_mark_and_forget_lowers_usage() {
        let l = lru(100);
        for i in 0..9 {
            store(&l, &key(i, ""), 10);
        }
        assert!(l.over_watermark());
        let v = l.pass(&HashMap::new());
        l.evicted(&v, true);
        assert!(l.usage().used <= 80 - 10, "{:?}", l.usage());
        assert!(!l.over_watermark());
        let before = l.usage().used;
        let k = key(8, "");
        assert_eq!(l.forget(std::slice::from_ref(&k)), 10);
        assert_eq!(l.usage().used, before - 10);
        // Failed deletes are put back.
        let v = l.pass(&HashMap::new());
        assert!(v.is_empty());
        let victims = vec![Victim { key: key(50, ""), bytes: 5 }];
        l.evicted(&victims, false);
        assert!(l.contains(&key(50, "")));
    }
}
