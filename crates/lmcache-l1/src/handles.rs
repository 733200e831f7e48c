//! RAII handles on L1 objects: a [`WriteReservation`] is the exclusive right to fill a staged
//! object; a [`ReadLease`] holds read locks on a resident one. Dropping either releases what
//! it holds, so an early return or a panic can never leak a lock, and memory is never freed
//! while a handle can still reach it (each handle keeps its allocation alive).

use std::sync::Arc;

use lmcache_core::ObjectKey;
use lmcache_memory::{AllocError, Allocation};

use crate::cache::Shared;
use crate::entry::{EntryId, ObjectMemory};
use crate::error::L1Error;

/// The exclusive right to write one staged object. Commit to make it visible; dropping it
/// discards the object and frees its memory.
#[derive(Debug)]
pub struct WriteReservation {
    shared: Arc<Shared>,
    id: EntryId,
    key: ObjectKey,
    /// `Some` until committed or discarded.
    alloc: Option<Allocation>,
}

impl WriteReservation {
    pub(crate) fn new(shared: Arc<Shared>, id: EntryId, key: ObjectKey, alloc: Allocation) -> Self {
        Self { shared, id, key, alloc: Some(alloc) }
    }

    /// The object's key.
    pub fn key(&self) -> &ObjectKey {
        &self.key
    }

    /// The member the object is reserved in.
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Offset of the object in the arena (for an engine that maps it).
    pub fn offset(&self) -> u64 {
        self.alloc.as_ref().map_or(0, Allocation::offset)
    }

    /// The object's size in bytes.
    pub fn len(&self) -> u64 {
        self.alloc.as_ref().map_or(0, Allocation::len)
    }

    /// True for an empty object (never: zero-byte reservations are refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The object's bytes, to fill.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.alloc.as_mut().map_or(&mut [], Allocation::as_mut_slice)
    }

    /// Commits the object's memory pages in one call ahead of a bulk write (fresh L1 memory
    /// otherwise takes one page fault per 4 KiB on first touch).
    pub fn prefault(&self) {
        if let Some(a) = &self.alloc {
            a.prefault();
        }
    }

    /// The object's bytes as written so far.
    pub fn as_slice(&self) -> &[u8] {
        self.alloc.as_ref().map_or(&[], Allocation::as_slice)
    }

    /// Copies `src` into the object at `offset`, after checking the range.
    pub fn write_at(&mut self, offset: u64, src: &[u8]) -> Result<(), AllocError> {
        match self.alloc.as_mut() {
            Some(a) => a.write_at(offset, src),
            None => Err(AllocError::OutOfBounds { offset, len: src.len() as u64, size: 0 }),
        }
    }

    /// Makes the object visible to readers. [`L1Error::WrongState`] if it was deleted by
    /// force meanwhile (its memory is then freed).
    pub fn commit(mut self) -> Result<(), L1Error> {
        self.commit_inner(0).map(|_| ())
    }

    /// Makes the object visible and read-locks it `count` times in the same step, so no
    /// eviction can slip in between (what a prefetch into L1 needs).
    pub fn commit_and_read_lock(mut self, count: u32) -> Result<ReadLease, L1Error> {
        let max = self.shared.max_read_locks();
        if count == 0 || count > max {
            return Err(L1Error::InvalidLockCount { count, max });
        }
        self.commit_inner(count)?.ok_or(L1Error::WrongState)
    }

    /// Drops the object without ever making it visible.
    pub fn discard(self) {}

    fn commit_inner(&mut self, readers: u32) -> Result<Option<ReadLease>, L1Error> {
        let (id, alloc) = self.take_parts();
        let result = self.shared.state.lock().commit(&self.shared, id, alloc, readers);
        // On failure the allocation comes back and is freed here, outside the L1 lock.
        result.map_err(|(e, _alloc)| e)
    }

    /// Takes the entry id and allocation out, leaving the handle inert.
    pub(crate) fn take_parts(&mut self) -> (EntryId, Allocation) {
        match self.alloc.take() {
            Some(a) => (self.id, a),
            // Unreachable: every consuming path takes the parts exactly once.
            None => unreachable_parts(),
        }
    }
}

#[cold]
fn unreachable_parts() -> ! {
    unreachable!("write reservation parts taken twice")
}

impl Drop for WriteReservation {
    fn drop(&mut self) {
        if let Some(alloc) = self.alloc.take() {
            self.shared.discard(self.id);
            drop(alloc);
        }
    }
}

/// `count` read locks on one resident object. The bytes stay valid and the object stays in
/// L1 (no eviction) while any lock is held. Dropping releases the remaining locks; a
/// temporary object is deleted with its last lock.
#[derive(Debug)]
pub struct ReadLease {
    shared: Arc<Shared>,
    id: EntryId,
    key: ObjectKey,
    alloc: Arc<ObjectMemory>,
    count: u32,
}

impl ReadLease {
    pub(crate) fn new(
        shared: Arc<Shared>,
        id: EntryId,
        key: ObjectKey,
        alloc: Arc<ObjectMemory>,
        count: u32,
    ) -> Self {
        Self { shared, id, key, alloc, count }
    }

    /// The object's key.
    pub fn key(&self) -> &ObjectKey {
        &self.key
    }

    /// The object's bytes.
    pub fn bytes(&self) -> &[u8] {
        self.alloc.as_slice()
    }

    /// Offset of the object in the arena.
    pub fn offset(&self) -> u64 {
        self.alloc.offset()
    }

    /// The xxh3-64 of the object's bytes (the L2 blob format's checksum). Committed bytes
    /// never change, so it is computed once per object, by whichever lease asks first.
    pub fn checksum(&self) -> u64 {
        self.alloc.checksum()
    }

    /// Hands the object's bytes to `send` in pieces of `piece` bytes (to send them while they
    /// are hashed) and returns [`Self::checksum`]: hashed here, piece by piece before each
    /// goes, the first time; once known, the bytes go in one piece.
    pub fn hash_pieces<E>(
        &self,
        piece: usize,
        send: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<u64, E> {
        self.alloc.hash_pieces(piece, send)
    }

    /// [`Self::checksum`] if it was computed already, without computing it.
    pub fn known_checksum(&self) -> Option<u64> {
        self.alloc.known_checksum()
    }

    /// The object's size.
    pub fn len(&self) -> u64 {
        self.alloc.len()
    }

    /// True for an empty object (never).
    pub fn is_empty(&self) -> bool {
        self.alloc.is_empty()
    }

    /// Read locks this lease holds.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Moves `n` of this lease's locks into a new lease (e.g. one per tensor-parallel
    /// reader). `None` unless `0 < n < count`.
    pub fn split(&mut self, n: u32) -> Option<ReadLease> {
        if n == 0 || n >= self.count {
            return None;
        }
        self.count -= n;
        Some(ReadLease {
            shared: Arc::clone(&self.shared),
            id: self.id,
            key: self.key.clone(),
            alloc: Arc::clone(&self.alloc),
            count: n,
        })
    }

    /// Releases the locks now (same as dropping).
    pub fn release(self) {}
}

impl Drop for ReadLease {
    fn drop(&mut self) {
        if self.count > 0 {
            self.shared.release_read(self.id, self.count);
        }
    }
}
