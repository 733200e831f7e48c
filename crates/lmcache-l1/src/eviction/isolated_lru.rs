//! One LRU per cache_salt. Quota enforcement evicts straight from the tenant's own list in
//! O(victims); global memory pressure takes the globally least recent entries, merging the
//! tenants' lists by last-use tick. (LMCache's IsolatedLRU refuses global eviction and crashes
//! its L1 eviction thread; here it is a first-class L1 policy.)

use std::collections::HashMap;

use lmcache_core::CacheSalt;
use slotmap::SecondaryMap;

use super::list::IdList;
use super::{Eligible, EntryMeta, EvictionPolicy, collect_from};
use crate::entry::EntryId;

/// Per-tenant LRU.
#[derive(Debug, Default)]
pub struct IsolatedLru {
    lists: HashMap<CacheSalt, IdList, foldhash::fast::RandomState>,
    salt_of: SecondaryMap<EntryId, CacheSalt>,
    tick_of: SecondaryMap<EntryId, u64>,
    clock: u64,
}

impl IsolatedLru {
    fn unlink(&mut self, id: EntryId) {
        let Some(salt) = self.salt_of.remove(id) else {
            return;
        };
        self.tick_of.remove(id);
        if let Some(list) = self.lists.get_mut(&salt) {
            list.remove(id);
            if list.len() == 0 {
                self.lists.remove(&salt);
            }
        }
    }
}

impl EvictionPolicy for IsolatedLru {
    fn name(&self) -> &'static str {
        "IsolatedLRU"
    }

    fn on_insert(&mut self, id: EntryId, meta: EntryMeta<'_>) {
        self.clock += 1;
        self.tick_of.insert(id, self.clock);
        self.salt_of.insert(id, meta.cache_salt.clone());
        self.lists.entry(meta.cache_salt.clone()).or_default().push_front(id);
    }

    fn on_access(&mut self, id: EntryId) {
        let Some(salt) = self.salt_of.get(id) else {
            return;
        };
        self.clock += 1;
        self.tick_of.insert(id, self.clock);
        if let Some(list) = self.lists.get_mut(salt) {
            list.move_to_front(id);
        }
    }

    fn on_remove(&mut self, id: EntryId) {
        self.unlink(id);
    }

    fn evict(
        &mut self,
        scope: Option<&CacheSalt>,
        target: u64,
        eligible: &mut Eligible<'_>,
        out: &mut Vec<EntryId>,
    ) -> u64 {
        let start = out.len();
        let mut chosen = 0;
        match scope {
            Some(salt) => {
                if let Some(list) = self.lists.get(salt) {
                    collect_from(list.iter_from_back(), target, &mut chosen, eligible, out);
                }
            }
            None => {
                // k-way merge of the tenants' lists, oldest tick first.
                let mut cursors: Vec<(&IdList, Option<EntryId>)> =
                    self.lists.values().map(|l| (l, l.back())).collect();
                while chosen < target {
                    let next = cursors
                        .iter_mut()
                        .filter_map(|c| c.1.map(|id| (self.tick_of.get(id).copied(), c)))
                        .min_by_key(|(tick, _)| *tick);
                    let Some((_, cursor)) = next else { break };
                    let Some(id) = cursor.1 else { break };
                    cursor.1 = cursor.0.towards_front(id);
                    if let Some(bytes) = eligible(id) {
                        chosen += bytes;
                        out.push(id);
                    }
                }
            }
        }
        let victims: Vec<EntryId> = out[start..].to_vec();
        for id in victims {
            self.unlink(id);
        }
        chosen
    }

    fn len(&self) -> usize {
        self.salt_of.len()
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}
