//! S3-FIFO (Yang et al., SOSP'23), counted in entries: new entries enter a small FIFO (about
//! 10 % of entries); those used while there move to the main FIFO, the rest leave and are
//! remembered in a ghost FIFO so that a quick return goes straight to main. Main reinserts
//! entries that were used (a 2-bit frequency) instead of evicting them. Hits only bump a
//! counter, so a lookup never reorders a list.

use lmcache_core::CacheSalt;
use slotmap::SecondaryMap;

use super::list::{GhostList, IdList};
use super::{Eligible, EntryMeta, EvictionPolicy};
use crate::entry::EntryId;

/// Share of entries the small FIFO may hold before it is drained first, in percent.
const SMALL_PERCENT: usize = 10;
/// Frequency saturates here.
const MAX_FREQ: u8 = 3;

/// S3-FIFO.
#[derive(Debug, Default)]
pub struct S3Fifo {
    small: IdList,
    main: IdList,
    ghost: GhostList,
    freq: SecondaryMap<EntryId, u8>,
    hashes: SecondaryMap<EntryId, u64>,
}

impl S3Fifo {
    fn forget(&mut self, id: EntryId) -> u64 {
        self.freq.remove(id);
        self.hashes.remove(id).unwrap_or_default()
    }
}

impl EvictionPolicy for S3Fifo {
    fn name(&self) -> &'static str {
        "S3FIFO"
    }

    fn on_insert(&mut self, id: EntryId, meta: EntryMeta<'_>) {
        self.hashes.insert(id, meta.key_hash);
        self.freq.insert(id, 0);
        if self.ghost.remove(meta.key_hash) {
            self.main.push_front(id);
        } else {
            self.small.push_front(id);
        }
    }

    fn on_access(&mut self, id: EntryId) {
        if let Some(f) = self.freq.get_mut(id) {
            *f = (*f + 1).min(MAX_FREQ);
        }
    }

    fn on_remove(&mut self, id: EntryId) {
        if !self.small.remove(id) {
            self.main.remove(id);
        }
        self.forget(id);
    }

    fn evict(
        &mut self,
        _scope: Option<&CacheSalt>,
        target: u64,
        eligible: &mut Eligible<'_>,
        out: &mut Vec<EntryId>,
    ) -> u64 {
        let mut chosen = 0;
        // Each entry is visited at most MAX_FREQ + 2 times before it must be chosen or be
        // found ineligible again: this bounds the work when nothing is eligible.
        let mut budget = 2 * (self.small.len() + self.main.len()) * (MAX_FREQ as usize + 2) + 8;
        // Steps on main since the last victim: past a full aging of main (every entry's
        // frequency run down), main holds nothing eligible, so look in small even if small
        // is under its share.
        let mut stalled = 0usize;
        while chosen < target && budget > 0 {
            budget -= 1;
            let total = self.small.len() + self.main.len();
            let main_exhausted = stalled > self.main.len() * (MAX_FREQ as usize + 1);
            let from_small = self.small.len() > 0
                && (self.small.len() * 100 >= total * SMALL_PERCENT
                    || self.main.len() == 0
                    || main_exhausted);
            if !from_small {
                stalled += 1;
            }
            let list = if from_small { &mut self.small } else { &mut self.main };
            let Some(id) = list.back() else { break };
            let freq = self.freq.get(id).copied().unwrap_or(0);
            if freq > 0 {
                if from_small {
                    // Used while on probation: promote.
                    self.small.remove(id);
                    self.main.push_front(id);
                    self.freq.insert(id, 0);
                } else {
                    self.main.move_to_front(id);
                    self.freq.insert(id, freq - 1);
                }
                continue;
            }
            match eligible(id) {
                Some(bytes) => {
                    list.remove(id);
                    let h = self.forget(id);
                    if from_small {
                        self.ghost.push(h);
                    }
                    chosen += bytes;
                    out.push(id);
                    stalled = 0;
                }
                // Locked (in use right now) or out of scope: treat it as used. From the
                // small FIFO it moves to main, so the small FIFO always drains.
                None if from_small => {
                    self.small.remove(id);
                    self.main.push_front(id);
                }
                None => {
                    self.main.move_to_front(id);
                }
            }
        }
        let cap = (self.small.len() + self.main.len()).max(16);
        self.ghost.truncate(cap);
        chosen
    }

    fn len(&self) -> usize {
        self.small.len() + self.main.len()
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
    fn one_hit_wonders_leave_before_reused_entries() {
        let mut ids: SlotMap<EntryId, ()> = SlotMap::with_key();
        let mut p = S3Fifo::default();
        let salt = CacheSalt::EMPTY;
        let all: Vec<EntryId> = (0..20).map(|_| ids.insert(())).collect();
        for (i, &id) in all.iter().enumerate() {
            p.on_insert(id, EntryMeta { key_hash: i as u64, cache_salt: &salt, bytes: 1 });
        }
        // The oldest five are used again; they must survive evicting ten.
        for &id in &all[..5] {
            p.on_access(id);
        }
        let mut out = Vec::new();
        assert_eq!(p.evict(None, 10, &mut |_| Some(1), &mut out), 10);
        for id in &all[..5] {
            assert!(!out.contains(id), "reused entry evicted");
        }
        // A ghost that returns goes straight to main.
        let back = ids.insert(());
        p.on_insert(back, EntryMeta { key_hash: 5, cache_salt: &salt, bytes: 1 });
        assert!(p.main.contains(back));
    }
}
