//! Least recently used. Batches arrive in reverse request order, so within one request the
//! last chunk is the least recent and leaves first: a prefix stays usable as long as possible.

use lmcache_core::CacheSalt;

use super::list::IdList;
use super::{Eligible, EntryMeta, EvictionPolicy, collect_from};
use crate::entry::EntryId;

/// Least recently used.
#[derive(Debug, Default)]
pub struct Lru {
    list: IdList,
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "LRU"
    }

    fn on_insert(&mut self, id: EntryId, _meta: EntryMeta<'_>) {
        self.list.push_front(id);
    }

    fn on_access(&mut self, id: EntryId) {
        self.list.move_to_front(id);
    }

    fn on_remove(&mut self, id: EntryId) {
        self.list.remove(id);
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
        collect_from(self.list.iter_from_back(), target, &mut chosen, eligible, out);
        for &id in &out[start..] {
            self.list.remove(id);
        }
        chosen
    }

    fn len(&self) -> usize {
        self.list.len()
    }

    fn clear(&mut self) {
        self.list.clear();
    }
}
