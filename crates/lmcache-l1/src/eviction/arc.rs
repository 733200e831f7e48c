//! Adaptive replacement cache (Megiddo & Modha), counted in entries: T1 holds entries seen
//! once, T2 entries seen again; ghosts of recent evictions (B1, B2) steer the target size `p`
//! of T1. Capacity `c` is the largest number of resident entries seen, as in LMCache.

use lmcache_core::CacheSalt;
use slotmap::SecondaryMap;

use super::list::{GhostList, IdList};
use super::{Eligible, EntryMeta, EvictionPolicy, collect_from};
use crate::entry::EntryId;

/// Adaptive replacement cache.
#[derive(Debug, Default)]
pub struct Arc {
    t1: IdList,
    t2: IdList,
    b1: GhostList,
    b2: GhostList,
    /// Target size of T1.
    p: usize,
    /// Capacity in entries.
    c: usize,
    hashes: SecondaryMap<EntryId, u64>,
}

impl Arc {
    fn trim_ghosts(&mut self) {
        self.b1.truncate(self.c.saturating_sub(self.t1.len()));
        let used = self.t1.len() + self.t2.len() + self.b1.len();
        self.b2.truncate((2 * self.c).saturating_sub(used));
    }

    /// Target size of T1 (for tests).
    #[cfg(test)]
    pub(crate) fn target_t1(&self) -> usize {
        self.p
    }
}

impl EvictionPolicy for Arc {
    fn name(&self) -> &'static str {
        "ARC"
    }

    fn on_insert(&mut self, id: EntryId, meta: EntryMeta<'_>) {
        let h = meta.key_hash;
        self.hashes.insert(id, h);
        if self.b1.remove(h) {
            // A recent T1 victim came back: T1 was too small.
            let delta = (self.b2.len() / self.b1.len().max(1)).max(1);
            self.p = (self.p + delta).min(self.c.max(1));
            self.t2.push_front(id);
        } else if self.b2.remove(h) {
            let delta = (self.b1.len() / self.b2.len().max(1)).max(1);
            self.p = self.p.saturating_sub(delta);
            self.t2.push_front(id);
        } else {
            self.t1.push_front(id);
        }
        self.c = self.c.max(self.t1.len() + self.t2.len());
        self.trim_ghosts();
    }

    fn on_access(&mut self, id: EntryId) {
        if self.t1.remove(id) {
            self.t2.push_front(id);
        } else {
            self.t2.move_to_front(id);
        }
    }

    fn on_remove(&mut self, id: EntryId) {
        if !self.t1.remove(id) {
            self.t2.remove(id);
        }
        self.hashes.remove(id);
    }

    fn evict(
        &mut self,
        _scope: Option<&CacheSalt>,
        target: u64,
        eligible: &mut Eligible<'_>,
        out: &mut Vec<EntryId>,
    ) -> u64 {
        let start = out.len();
        let mut chosen = 0;
        let t1_first = self.t1.len() >= self.p.max(1);
        let (first, second) = if t1_first { (&self.t1, &self.t2) } else { (&self.t2, &self.t1) };
        collect_from(first.iter_from_back(), target, &mut chosen, eligible, out);
        collect_from(second.iter_from_back(), target, &mut chosen, eligible, out);
        for &id in &out[start..] {
            let h = self.hashes.remove(id).unwrap_or_default();
            if self.t1.remove(id) {
                self.b1.push(h);
            } else if self.t2.remove(id) {
                self.b2.push(h);
            }
        }
        self.trim_ghosts();
        chosen
    }

    fn len(&self) -> usize {
        self.t1.len() + self.t2.len()
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slotmap::SlotMap;

    #[test]
    fn ghost_hit_in_b1_grows_t1_target() {
        let mut ids: SlotMap<EntryId, ()> = SlotMap::with_key();
        let mut arc = Arc::default();
        let salt = CacheSalt::EMPTY;
        let a: Vec<EntryId> = (0..4).map(|_| ids.insert(())).collect();
        for (i, &id) in a.iter().enumerate() {
            arc.on_insert(id, EntryMeta { key_hash: i as u64, cache_salt: &salt, bytes: 1 });
        }
        let mut out = Vec::new();
        arc.evict(None, 1, &mut |_| Some(1), &mut out);
        assert_eq!(out, vec![a[0]], "T1's least recent goes first");
        assert_eq!(arc.target_t1(), 0);
        // Key 0 returns: it was in B1, so T1 deserved more room and it lands in T2.
        let again = ids.insert(());
        arc.on_insert(again, EntryMeta { key_hash: 0, cache_salt: &salt, bytes: 1 });
        assert_eq!(arc.target_t1(), 1);
        assert!(arc.t2.contains(again));
    }

    #[test]
    fn access_promotes_to_t2() {
        let mut ids: SlotMap<EntryId, ()> = SlotMap::with_key();
        let mut arc = Arc::default();
        let salt = CacheSalt::EMPTY;
        let id = ids.insert(());
        arc.on_insert(id, EntryMeta { key_hash: 7, cache_salt: &salt, bytes: 1 });
        assert!(arc.t1.contains(id));
        arc.on_access(id);
        assert!(arc.t2.contains(id) && !arc.t1.contains(id));
    }
}
