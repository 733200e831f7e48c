//! Index entries: one per object that holds memory (staged, resident, or deleted while still
//! pinned by a reader or writer).

use std::sync::{Arc, OnceLock};

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
    Resident { alloc: Arc<ObjectMemory>, readers: u32 },
}

/// A resident object's memory, shared by its entry and its read leases. Its bytes no longer
/// change once committed, so their checksum is computed at most once, when first asked for.
#[derive(Debug)]
pub(crate) struct ObjectMemory {
    alloc: Allocation,
    checksum: OnceLock<u64>,
}

impl ObjectMemory {
    pub(crate) fn new(alloc: Allocation) -> Self {
        Self { alloc, checksum: OnceLock::new() }
    }

    /// Memory whose checksum is known (an object adopted from a file arena, verified).
    pub(crate) fn with_checksum(alloc: Allocation, checksum: u64) -> Self {
        Self { alloc, checksum: OnceLock::from(checksum) }
    }

    /// The xxh3-64 of the bytes (the L2 blob format's checksum), computed on first use.
    pub(crate) fn checksum(&self) -> u64 {
        *self.checksum.get_or_init(|| twox_hash::XxHash3_64::oneshot(self.alloc.as_slice()))
    }

    /// Hands the bytes to `send` in pieces of `piece` bytes, hashing each one first, or all at
    /// once when the checksum is known; returns the checksum, kept when every piece went.
    pub(crate) fn hash_pieces<E>(
        &self,
        piece: usize,
        mut send: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<u64, E> {
        let bytes = self.alloc.as_slice();
        if let Some(&sum) = self.checksum.get() {
            send(bytes)?;
            return Ok(sum);
        }
        let mut hasher = twox_hash::XxHash3_64::new();
        for p in bytes.chunks(piece.max(1)) {
            std::hash::Hasher::write(&mut hasher, p);
            send(p)?;
        }
        Ok(*self.checksum.get_or_init(|| std::hash::Hasher::finish(&hasher)))
    }

    /// The checksum if some caller computed it already.
    pub(crate) fn known_checksum(&self) -> Option<u64> {
        self.checksum.get().copied()
    }
}

impl std::ops::Deref for ObjectMemory {
    type Target = Allocation;

    fn deref(&self) -> &Allocation {
        &self.alloc
    }
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
