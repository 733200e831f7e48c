//! The policy that never evicts: L1 as a plain buffer whose owner deletes explicitly.

use lmcache_core::CacheSalt;

use super::{Eligible, EntryMeta, EvictionPolicy};
use crate::entry::EntryId;

/// Never evicts; tracks nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct Noop;

impl EvictionPolicy for Noop {
    fn name(&self) -> &'static str {
        "noop"
    }
    fn on_insert(&mut self, _: EntryId, _: EntryMeta<'_>) {}
    fn on_access(&mut self, _: EntryId) {}
    fn on_remove(&mut self, _: EntryId) {}
    fn evict(
        &mut self,
        _: Option<&CacheSalt>,
        _: u64,
        _: &mut Eligible<'_>,
        _: &mut Vec<EntryId>,
    ) -> u64 {
        0
    }
    fn len(&self) -> usize {
        0
    }
    fn clear(&mut self) {}
}
