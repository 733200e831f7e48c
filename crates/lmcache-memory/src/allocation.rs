//! Allocations: owned, bounds-checked views of arena bytes.
//!
//! # Soundness
//! An [`Allocation`] is the only value that names its range `[offset, offset + len)` of the
//! arena. The allocator guarantees live ranges never overlap and lie inside `[0, capacity)`,
//! with `capacity <= arena.len()` (checked in [`ArenaAllocator::new`]); the allocation keeps
//! the arena mapped through its `Arc`; and the range is returned to the allocator only in
//! `Drop`. So `&mut self` on an allocation is exclusive access to its bytes within this
//! process, and `&self` is shared access.
//!
//! A shared-memory arena can also be written by another process (the engine, in the
//! engine-driven transfer mode). That is the point of sharing it, and the protocol decides
//! when it may happen: the engine writes only into ranges it was handed for a write
//! reservation, and this process never reads those until the engine commits them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::allocator::{AllocError, Allocator, AllocatorStats, Block};
use crate::arena::{Arena, BackingKind};
use crate::error::MemoryError;
use crate::file_arena::PersistError;

#[derive(Debug)]
struct Shared {
    allocator: Mutex<Allocator>,
    arena: Arena,
    /// Highest end offset any allocation has reached: memory past it has never been used.
    high_water: AtomicU64,
    /// Least lead the prefaulter keeps once asked (see [`ArenaAllocator::expect_use`]).
    min_ahead: AtomicU64,
    /// `[0, populated)` has been committed (by the prefaulter, which walks up from 0 to past
    /// the high-water mark, allocations below it having committed their own): a write there
    /// does not fault, so an allocation inside it needs no prefault call (which costs a
    /// page-table walk per 4 KiB even when every page is present). Only grows.
    populated: AtomicU64,
    /// Shared-memory arenas: `[0, backed)` has file-system space reserved (`fallocate`), so
    /// an allocation below it can be written without risking SIGBUS. Only grows.
    backed: AtomicU64,
    /// Serializes growing `backed`.
    backing: Mutex<()>,
    /// File arenas restarted warm: the objects adopted from the catalog, until the L1 takes
    /// them ([`ArenaAllocator::take_adopted`]).
    adopted: Mutex<Vec<Adopted>>,
    adopt_report: Mutex<Option<AdoptReport>>,
    /// Set by [`ArenaAllocator::detach_catalog`]: recorded objects that drop from now on
    /// keep their records and their ranges.
    detached: std::sync::atomic::AtomicBool,
}

/// No catalog record (the arena keeps none, or the object is not sealed yet).
const NO_RECORD: u32 = u32::MAX;

/// An object a previous process left in a file arena, verified: its record checked, its
/// range was free and inside the arena, and its bytes hash to the recorded checksum.
#[derive(Debug)]
pub struct Adopted {
    /// The key bytes it was persisted with (the L1's encoding).
    pub key: Vec<u8>,
    /// Its memory, already recorded in the catalog.
    pub alloc: Allocation,
    /// The xxh3-64 of its bytes.
    pub checksum: u64,
    /// Its record's generation: later records were sealed later.
    pub generation: u64,
}

/// What adopting a file arena's catalog found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdoptReport {
    /// Records that checked.
    pub records: u64,
    /// Objects adopted.
    pub adopted: u64,
    /// Bytes adopted.
    pub bytes: u64,
    /// Records naming a range outside the arena, unaligned, or overlapping another: dropped.
    pub misplaced: u64,
    /// Objects whose bytes did not match their checksum (a write or a seal that did not
    /// complete): dropped, never served.
    pub corrupt: u64,
}

/// `backed` grows in steps of this size (one `fallocate` per step).
const BACKING_STEP: u64 = 8 << 20;

impl Shared {
    /// Fresh blocks, backed (see [`Self::ensure_backed`]) and counted in the high-water
    /// mark; on failure they go back to the allocator.
    fn back(&self, blocks: Vec<Block>) -> Result<Vec<Block>, AllocError> {
        let Some(end) = blocks.iter().map(|b| b.offset() + b.size()).max() else {
            return Ok(blocks);
        };
        if let Err(e) = self.ensure_backed(end) {
            let mut a = self.allocator.lock();
            for b in blocks {
                a.free(b);
            }
            return Err(e);
        }
        self.high_water.fetch_max(end, Ordering::Relaxed);
        Ok(blocks)
    }

    /// Marks `[0, end of the last block)` backed after adopting `blocks` (sorted by offset):
    /// the blocks hold a previous process's data, so their file space exists; only the gaps
    /// between them are reserved (a `fallocate` of space that exists still walks every page:
    /// a fifth of an 8 GiB tmpfs adoption). If a gap cannot be, `backed` stays as it was and
    /// allocations reserve their ranges as usual.
    fn back_around(&self, blocks: impl Iterator<Item = (u64, u64)>) {
        if !self.arena.needs_reserve() {
            return;
        }
        let _g = self.backing.lock();
        let mut at = 0u64;
        for (offset, size) in blocks {
            if offset > at && self.arena.reserve(at, offset - at).is_err() {
                tracing::warn!(offset = at, "cannot back the L1 file between adopted objects");
                return;
            }
            at = at.max(offset + size);
        }
        self.backed.fetch_max(at, Ordering::AcqRel);
    }

    /// Makes sure `[0, end)` of the arena is backed (see [`Arena::reserve`]).
    fn ensure_backed(&self, end: u64) -> Result<(), AllocError> {
        if self.backed.load(Ordering::Acquire) >= end || !self.arena.needs_reserve() {
            return Ok(());
        }
        let _g = self.backing.lock();
        let done = self.backed.load(Ordering::Acquire);
        if done >= end {
            return Ok(());
        }
        let len = self.arena.len();
        let step = end.checked_next_multiple_of(BACKING_STEP).unwrap_or(len).min(len).max(end);
        // A whole step if there is room, else just what this allocation needs.
        let target = if self.arena.reserve(done, step - done).is_ok() {
            step
        } else {
            match self.arena.reserve(done, end - done) {
                Ok(()) => end,
                Err(e) => {
                    tracing::warn!(error = %e, backed = done, needed = end, "L1 pool cannot grow");
                    return Err(AllocError::BackingFull { requested: end - done, backed: done });
                }
            }
        };
        self.backed.store(target, Ordering::Release);
        Ok(())
    }
}

/// An arena with its allocator: the source of [`Allocation`]s. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ArenaAllocator {
    shared: Arc<Shared>,
}

/// Memory use of an [`ArenaAllocator`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Allocator counters.
    pub allocator: AllocatorStats,
    /// The backing the arena landed on.
    pub backing: BackingKind,
}

impl ArenaAllocator {
    /// Puts an allocator with alignment `align` over the whole arena. A file arena opened
    /// to adopt ([`crate::FileBacking::adopt`]) first takes back every object its catalog
    /// names that verifies (see [`Self::take_adopted`]); the others' records are zeroed.
    pub fn new(arena: Arena, align: u64) -> Result<Self, MemoryError> {
        let this = Self::over(arena, align)?;
        this.adopt();
        Ok(this)
    }

    fn over(arena: Arena, align: u64) -> Result<Self, MemoryError> {
        let allocator =
            Allocator::new(arena.len(), align).map_err(|_| MemoryError::InvalidAlign { align })?;
        // The soundness of every slice below rests on this.
        if allocator.capacity() > arena.len() {
            return Err(MemoryError::InvalidSize { size: arena.len(), reason: "capacity" });
        }
        Ok(Self {
            shared: Arc::new(Shared {
                allocator: Mutex::new(allocator),
                arena,
                high_water: AtomicU64::new(0),
                min_ahead: AtomicU64::new(0),
                populated: AtomicU64::new(0),
                backed: AtomicU64::new(0),
                backing: Mutex::new(()),
                adopted: Mutex::new(Vec::new()),
                adopt_report: Mutex::new(None),
                detached: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    /// Adopts what the catalog of a file arena names (see [`Self::new`]).
    fn adopt(&self) {
        let Some(file) = self.shared.arena.file() else { return };
        let records = file.catalog.take_records();
        if !file.adopt {
            file.catalog.release(records.into_iter().map(|r| r.index));
            if file.asked_adopt {
                *self.shared.adopt_report.lock() = Some(AdoptReport::default());
            }
            return;
        }
        let started = std::time::Instant::now();
        let mut report = AdoptReport { records: records.len() as u64, ..AdoptReport::default() };
        // Claim each record's range; records that overlap one claimed already, or name a
        // range the arena does not have, are dropped.
        let mut claimed = Vec::with_capacity(records.len());
        let mut dropped = Vec::new();
        {
            let mut a = self.shared.allocator.lock();
            for r in records {
                let fits = r.len > 0 && a.aligned_size(r.len).is_ok_and(|p| p == r.physical);
                match fits.then(|| a.claim(r.offset, r.physical)) {
                    Some(Ok(block)) => claimed.push((r, block)),
                    _ => {
                        report.misplaced += 1;
                        dropped.push(r.index);
                    }
                }
            }
        }
        file.catalog.release(dropped);
        claimed.sort_by_key(|(_, b)| b.offset());
        if let Some((_, last)) = claimed.last() {
            let end = last.offset() + last.size();
            self.shared.back_around(claimed.iter().map(|(_, b)| (b.offset(), b.size())));
            self.shared.high_water.fetch_max(end, Ordering::Relaxed);
        }
        let allocs: Vec<(crate::file_arena::Record, Allocation)> = claimed
            .into_iter()
            .map(|(r, block)| {
                let alloc = Allocation {
                    shared: Arc::clone(&self.shared),
                    block: Some(block),
                    len: r.len,
                    record: AtomicU32::new(r.index),
                };
                (r, alloc)
            })
            .collect();
        // Verify every object's bytes, on every core: objects that fail drop (their records
        // are zeroed as they go).
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).max(1);
        let per = allocs.len().div_ceil(threads).max(1);
        let mut parts: Vec<Vec<(crate::file_arena::Record, Allocation)>> = Vec::new();
        let mut it = allocs.into_iter();
        loop {
            let part: Vec<_> = it.by_ref().take(per).collect();
            if part.is_empty() {
                break;
            }
            parts.push(part);
        }
        let verified: Vec<Vec<Adopted>> = std::thread::scope(|s| {
            let handles: Vec<_> = parts
                .into_iter()
                .map(|part| {
                    s.spawn(move || {
                        part.into_iter()
                            .filter_map(|(r, alloc)| {
                                alloc.shared.arena.populate_read(alloc.offset(), alloc.len());
                                let sum = twox_hash::XxHash3_64::oneshot(alloc.as_slice());
                                (sum == r.checksum).then_some(Adopted {
                                    key: r.key,
                                    alloc,
                                    checksum: sum,
                                    generation: r.generation,
                                })
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
        });
        let adopted: Vec<Adopted> = verified.into_iter().flatten().collect();
        report.adopted = adopted.len() as u64;
        report.bytes = adopted.iter().map(|a| a.alloc.len()).sum();
        report.corrupt = report.records - report.misplaced - report.adopted;
        tracing::info!(
            path = %file.path.display(),
            adopted = report.adopted,
            bytes = report.bytes,
            misplaced = report.misplaced,
            corrupt = report.corrupt,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "adopted the L1 file's objects"
        );
        *self.shared.adopted.lock() = adopted;
        *self.shared.adopt_report.lock() = Some(report);
    }

    /// The objects adopted from a file arena's catalog (once; empty afterwards and for every
    /// other arena). Dropping one frees its memory and zeroes its record.
    pub fn take_adopted(&self) -> Vec<Adopted> {
        std::mem::take(&mut *self.shared.adopted.lock())
    }

    /// What the adoption found, for a file arena opened to adopt.
    pub fn adopt_report(&self) -> Option<AdoptReport> {
        *self.shared.adopt_report.lock()
    }

    /// For a shutdown that should restart warm: every recorded object that drops from now on
    /// keeps its catalog record, and its range is never handed out again by this process,
    /// so the next process adopts it. Call it when nothing will be written any more (the
    /// process is about to exit).
    pub fn detach_catalog(&self) {
        self.shared.detached.store(true, Ordering::Release);
    }

    /// The end of a shutdown that keeps a file arena for the next process: after
    /// [`Self::detach_catalog`], once nothing can write the arena any more (no allocation,
    /// no copy into one), the file's lock is let go while the mapping stays, so a process
    /// taking over (`--take-over`) starts adopting at once. Nothing may be allocated or
    /// written afterwards: a successor may be using the bytes.
    pub fn release_file(&self) {
        if let Some(f) = self.shared.arena.file() {
            f.release();
        }
    }

    /// Whether objects can be recorded to survive a restart ([`Allocation::persist`]).
    pub fn is_persistent(&self) -> bool {
        self.shared.arena.file().is_some()
    }

    /// `(records in use, records)` of a file arena's catalog.
    pub fn catalog_usage(&self) -> Option<(u64, u64)> {
        let f = self.shared.arena.file()?;
        Some((f.catalog.used(), f.catalog.capacity()))
    }

    /// The alignment of every allocation's offset and size (`--l1-align-bytes`).
    pub fn align(&self) -> u64 {
        self.shared.allocator.lock().align()
    }

    /// Allocates `len` bytes (aligned up internally). On a shared-memory arena the range
    /// is backed by /dev/shm first; [`AllocError::BackingFull`] when it cannot be.
    pub fn allocate(&self, len: u64) -> Result<Allocation, AllocError> {
        let block = self.shared.allocator.lock().allocate(len)?;
        let mut v = self.shared.back(vec![block])?;
        let block = v.pop();
        Ok(Allocation {
            shared: Arc::clone(&self.shared),
            block,
            len,
            record: AtomicU32::new(NO_RECORD),
        })
    }

    /// Allocates one allocation per entry of `lens`, all or nothing (backed, as
    /// [`Self::allocate`]).
    pub fn allocate_batch(&self, lens: &[u64]) -> Result<Vec<Allocation>, AllocError> {
        let blocks = self.shared.allocator.lock().allocate_batch(lens)?;
        Ok(self
            .shared
            .back(blocks)?
            .into_iter()
            .zip(lens)
            .map(|(block, &len)| Allocation {
                shared: Arc::clone(&self.shared),
                block: Some(block),
                len,
                record: AtomicU32::new(NO_RECORD),
            })
            .collect())
    }

    /// The aligned size an allocation of `len` bytes occupies, or why it can never fit.
    pub fn aligned_size(&self, len: u64) -> Result<u64, AllocError> {
        self.shared.allocator.lock().aligned_size(len)
    }

    /// Current counters.
    pub fn usage(&self) -> MemoryUsage {
        MemoryUsage {
            allocator: self.shared.allocator.lock().stats(),
            backing: self.shared.arena.kind(),
        }
    }

    /// Usable capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.shared.allocator.lock().capacity()
    }

    /// The arena.
    pub fn arena(&self) -> &Arena {
        &self.shared.arena
    }

    /// Highest offset any allocation has reached.
    pub fn high_water(&self) -> u64 {
        self.shared.high_water.load(Ordering::Relaxed)
    }

    /// Tells the prefaulter that about `bytes` will be written soon (a client registered a
    /// layout): it keeps at least that much committed ahead, within its cap.
    pub fn expect_use(&self, bytes: u64) {
        self.shared.min_ahead.fetch_max(bytes, Ordering::Relaxed);
    }

    /// Starts a background thread that commits arena pages ahead of use (see [`Prefaulter`]).
    pub fn spawn_prefaulter(&self, max_ahead: u64) -> std::io::Result<Prefaulter> {
        Prefaulter::spawn(self.clone(), max_ahead)
    }
}

/// Commits arena pages just ahead of the allocation high-water mark, off the request path.
///
/// Fresh memory is expensive to touch the first time (the kernel allocates and zeroes each
/// page; in a VM the hypervisor may have to back it too), which would otherwise land on the
/// first store into each part of L1. The prefaulter keeps `[high_water, high_water + ahead)`
/// committed with `ahead = min(max_ahead, max(high_water, expected))`, where `expected` is what
/// [`ArenaAllocator::expect_use`] announced: nothing at idle with no client, so an L1 that
/// holds nothing stays uncommitted. It stops when dropped.
#[derive(Debug)]
pub struct Prefaulter {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Pages are committed in steps of this size.
const PREFAULT_STEP: u64 = 8 << 20;

impl Prefaulter {
    fn spawn(alloc: ArenaAllocator, max_ahead: u64) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new().name("l1-prefault".into()).spawn(move || {
            let len = alloc.arena().len();
            let mut done = 0u64;
            loop {
                let hw = alloc.high_water();
                let expected = alloc.shared.min_ahead.load(Ordering::Relaxed);
                let target = hw.saturating_add(hw.max(expected).min(max_ahead)).min(len);
                if done < hw {
                    done = hw;
                }
                if done < target {
                    let step = PREFAULT_STEP.min(target - done);
                    // Back the pages first (shared memory), so neither this nor a later write
                    // can fault on a full /dev/shm; if it is full, commit nothing ahead.
                    if alloc.shared.ensure_backed(done + step).is_err() {
                        done = target;
                        continue;
                    }
                    alloc.arena().prefault(done, step);
                    done += step;
                    alloc.shared.populated.fetch_max(done, Ordering::Release);
                    if !matches!(rx.try_recv(), Err(std::sync::mpsc::TryRecvError::Empty)) {
                        return;
                    }
                    continue;
                }
                match rx.recv_timeout(std::time::Duration::from_millis(5)) {
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
            }
        })?;
        Ok(Self { stop: Some(tx), thread: Some(thread) })
    }
}

impl Drop for Prefaulter {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An owned range of the arena. Returned to the allocator when dropped.
#[derive(Debug)]
pub struct Allocation {
    shared: Arc<Shared>,
    /// Always `Some` until `Drop` takes it.
    block: Option<Block>,
    /// Logical length (what was asked for); the block may be larger.
    len: u64,
    /// Its catalog record in a file arena ([`NO_RECORD`]: none).
    record: AtomicU32,
}

impl Allocation {
    /// Offset of the first byte in the arena (what a process that maps the segment uses).
    pub fn offset(&self) -> u64 {
        self.block.as_ref().map_or(0, Block::offset)
    }

    /// Logical length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for a zero-length allocation (never: zero-byte requests are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the allocation occupies in the arena (aligned).
    pub fn physical_len(&self) -> u64 {
        self.block.as_ref().map_or(0, Block::size)
    }

    /// The allocation's bytes.
    pub fn as_slice(&self) -> &[u8] {
        let (ptr, len) = self.raw();
        // SAFETY: `raw` points at `len` bytes inside the live mapping (module docs: the
        // range lies within the arena, which `self.shared` keeps mapped), no `&mut` to this
        // range can exist while `&self` is borrowed, and the range is disjoint from every
        // other allocation's.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    /// The allocation's bytes, exclusively.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let (ptr, len) = self.raw();
        // SAFETY: as in `as_slice`; `&mut self` makes this the only borrow of the range.
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }
    }

    /// Commits the allocation's pages ahead of a bulk write (see [`Arena::prefault`]): only
    /// when some of them may never have been committed (recycled L1 memory below the
    /// prefaulter's mark is resident already).
    pub fn prefault(&self) {
        let end = self.offset() + self.physical_len();
        if end > self.shared.populated.load(Ordering::Acquire) {
            self.shared.arena.prefault(self.offset(), self.physical_len());
        }
    }

    /// Whether [`Self::prefault`] would commit pages (tests).
    pub fn needs_prefault(&self) -> bool {
        self.offset() + self.physical_len() > self.shared.populated.load(Ordering::Acquire)
    }

    /// Copies `src` to `offset` within the allocation, after checking the range.
    pub fn write_at(&mut self, offset: u64, src: &[u8]) -> Result<(), AllocError> {
        let range = self.checked_range(offset, src.len() as u64)?;
        self.as_mut_slice()[range].copy_from_slice(src);
        Ok(())
    }

    /// Copies from `offset` within the allocation into `dst`, after checking the range.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), AllocError> {
        let range = self.checked_range(offset, dst.len() as u64)?;
        dst.copy_from_slice(&self.as_slice()[range]);
        Ok(())
    }

    /// Records the object in a file arena's catalog under `key`, with `checksum` (the
    /// xxh3-64 of its bytes, which must be final: the next process adopts it only if they
    /// still hash to it). `Ok(false)` when the arena keeps no catalog or the object is
    /// recorded already. The record is zeroed when the allocation drops.
    pub fn persist(&self, key: &[u8], checksum: u64) -> Result<bool, PersistError> {
        let Some(f) = self.shared.arena.file() else { return Ok(false) };
        if self.record.load(Ordering::Acquire) != NO_RECORD {
            return Ok(false);
        }
        let index = f.catalog.write(key, self.offset(), self.len, self.physical_len(), checksum)?;
        if self
            .record
            .compare_exchange(NO_RECORD, index, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            f.catalog.clear(index);
            return Ok(false);
        }
        Ok(true)
    }

    /// Whether the object is recorded in a file arena's catalog.
    pub fn is_persisted(&self) -> bool {
        self.record.load(Ordering::Acquire) != NO_RECORD
    }

    fn checked_range(&self, offset: u64, len: u64) -> Result<std::ops::Range<usize>, AllocError> {
        let oob = AllocError::OutOfBounds { offset, len, size: self.len };
        let end = offset.checked_add(len).ok_or(oob)?;
        if end > self.len {
            return Err(oob);
        }
        // Both fit usize: end <= self.len, which is a mapped length.
        Ok(offset as usize..end as usize)
    }

    fn raw(&self) -> (*mut u8, usize) {
        let offset = self.offset() as usize;
        // `offset + len <= capacity <= arena.len()`, a usize: no overflow, stays in bounds.
        // `wrapping_add` keeps pointer arithmetic safe code; the bound is what makes it valid.
        (self.shared.arena.base_ptr().wrapping_add(offset), self.len as usize)
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let record = *self.record.get_mut();
        if record != NO_RECORD && self.shared.detached.load(Ordering::Acquire) {
            // Shutting down warm: the record and the bytes it names stay for the next process.
            let _kept = self.block.take();
            return;
        }
        if record != NO_RECORD
            && let Some(f) = self.shared.arena.file()
        {
            // Before the range can be handed out again: no record may name it then.
            f.catalog.clear(record);
        }
        if let Some(block) = self.block.take() {
            self.shared.allocator.lock().free(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::{ArenaBacking, ArenaConfig};

    fn allocator(size: u64) -> ArenaAllocator {
        let arena =
            Arena::create(&ArenaConfig { size, backing: ArenaBacking::Anonymous, mlock: false })
                .unwrap();
        ArenaAllocator::new(arena, 4096).unwrap()
    }

    #[test]
    fn bytes_round_trip_and_stay_separate() {
        let a = allocator(1 << 20);
        let mut x = a.allocate(5000).unwrap();
        let mut y = a.allocate(100).unwrap();
        assert_eq!(x.len(), 5000);
        assert_eq!(x.physical_len(), 8192);
        x.as_mut_slice().fill(0xaa);
        y.as_mut_slice().fill(0x55);
        assert!(x.as_slice().iter().all(|&b| b == 0xaa));
        assert!(y.as_slice().iter().all(|&b| b == 0x55));
        assert_ne!(x.offset(), y.offset());
    }

    #[test]
    fn bounds_are_checked_at_the_edges() {
        let a = allocator(1 << 20);
        let mut x = a.allocate(100).unwrap();
        assert!(x.write_at(0, &[1; 100]).is_ok());
        assert!(x.write_at(99, &[7]).is_ok());
        assert!(x.write_at(100, &[]).is_ok());
        assert_eq!(
            x.write_at(100, &[1]),
            Err(AllocError::OutOfBounds { offset: 100, len: 1, size: 100 })
        );
        assert!(x.write_at(u64::MAX, &[1]).is_err(), "overflowing offset accepted");
        let mut out = [0u8; 2];
        x.read_at(98, &mut out).unwrap();
        assert_eq!(out, [1, 7]);
        assert!(x.read_at(99, &mut out).is_err());
    }

    #[test]
    fn prefaulter_commits_ahead_of_use_and_nothing_at_idle() {
        let name = format!("lmcache_rs_test_prefault_{}", std::process::id());
        let arena = Arena::create(&ArenaConfig {
            size: 256 << 20,
            backing: ArenaBacking::SharedMemory { name },
            mlock: false,
        })
        .unwrap();
        let a = ArenaAllocator::new(arena, 4096).unwrap();
        let p = a.spawn_prefaulter(64 << 20).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(30));
        assert_eq!(a.arena().resident_bytes().unwrap(), 0, "committed memory at idle");
        let _x = a.allocate(16 << 20).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while a.arena().resident_bytes().unwrap() < 16 << 20 && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let r = a.arena().resident_bytes().unwrap();
        assert!(r >= 16 << 20, "nothing committed ahead: {r}");
        assert!(r <= 32 << 20, "committed more than in use again: {r}");
        // A client announces 40 MiB of writes: the lead grows to that, within the cap.
        a.expect_use(40 << 20);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while a.arena().resident_bytes().unwrap() < 40 << 20 && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        drop(p);
        let r = a.arena().resident_bytes().unwrap();
        assert!((40 << 20..=(16 + 64) << 20).contains(&r), "announced lead not honoured: {r}");
        // Memory the prefaulter committed needs no prefault call of its own; memory past
        // its mark does.
        let below = a.allocate(8 << 20).unwrap();
        assert!(below.offset() + (8 << 20) <= r);
        assert!(!below.needs_prefault(), "an allocation in committed memory would walk its pages");
        let far = a.allocate(200 << 20).unwrap();
        assert!(far.needs_prefault(), "an allocation past the committed memory skips its prefault");
    }

    #[test]
    fn drop_returns_memory() {
        let a = allocator(64 << 10);
        let all = a.allocate_batch(&[16 << 10; 4]).unwrap();
        assert!(a.allocate(1).is_err());
        drop(all);
        assert_eq!(a.usage().allocator.allocated_bytes, 0);
        assert!(a.allocate(64 << 10).is_ok());
    }

    #[test]
    fn allocations_outlive_the_allocator_handle() {
        let a = allocator(1 << 20);
        let mut x = a.allocate(10).unwrap();
        drop(a);
        x.as_mut_slice().copy_from_slice(b"still here");
        assert_eq!(x.as_slice(), b"still here");
    }

    #[test]
    fn shared_memory_is_visible_through_a_second_mapping() {
        let name = format!("lmcache_rs_test_alloc_{}", std::process::id());
        let arena = Arena::create(&ArenaConfig {
            size: 1 << 20,
            backing: ArenaBacking::SharedMemory { name: name.clone() },
            mlock: false,
        })
        .unwrap();
        let a = ArenaAllocator::new(arena, 4096).unwrap();
        let mut x = a.allocate(16).unwrap();
        x.as_mut_slice().copy_from_slice(b"kv-bytes-for-eng");
        // What an engine process does: open the segment by name and read at the offset.
        let bytes = std::fs::read(format!("/dev/shm/{name}")).unwrap();
        let off = x.offset() as usize;
        assert_eq!(&bytes[off..off + 16], b"kv-bytes-for-eng");
    }
}
