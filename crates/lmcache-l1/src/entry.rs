//! Index entries: one per object that holds memory (staged, resident, or deleted while still
//! pinned by a reader or writer).

use std::sync::Arc;

use lmcache_core::ObjectKey;
use lmcache_memory::Allocation;

slotmap::new_key_type! {
    /// Identity of one index entry. A key that is deleted and written again gets a new id, so
    /// a handle of the old object can never touch the new one.
    pub struct EntryId;
}

/// Where an entry is in its life.
#[derive(Debug)]
pub(crate) enum Slot {
    /// Reserved for write: the writer's [`crate::WriteReservation`] owns the memory; invisible
    /// to readers; never evicted.
    Staged,
    /// Visible. `readers` read locks are held by [`crate::ReadLease`]s; evictable at zero.
    Resident { alloc: Arc<Allocation>, readers: u32 },
}

#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) key: ObjectKey,
    /// Physical (aligned) bytes charged to the entry's tenant and to `used_bytes`.
    pub(crate) bytes: u64,
    /// Deleted when its last read lock is released.
    pub(crate) temporary: bool,
    /// False once deleted by force while pinned, or superseded by another writer's commit of
    /// the same key: then it is out of the key index and the policy, and is dropped when its
    /// last handle goes. Also false for a *shadow* reservation until it commits.
    pub(crate) indexed: bool,
    /// A second writer's reservation of a key another writer held staged: out of the index
    /// until its commit, which makes it the key's object unless the key is resident by then.
    pub(crate) shadow: bool,
    /// Taken out of the index by a shadow's commit of the same key: its own commit then
    /// succeeds without effect if the key is still visible.
    pub(crate) superseded: bool,
    /// Committed while write-behind is on and not yet reported written to L2: evicted only
    /// when nothing else can make room.
    pub(crate) unwritten: bool,
    pub(crate) slot: Slot,
}

impl Entry {
    pub(crate) fn readers(&self) -> u32 {
        match self.slot {
            Slot::Resident { readers, .. } => readers,
            Slot::Staged => 0,
        }
    }
}
