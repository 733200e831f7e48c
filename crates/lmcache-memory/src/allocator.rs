//! The offset allocator of the L1 arena. Pure bookkeeping: no pointers, no `unsafe`.
//!
//! # Design
//! Two structures share the address space `[0, capacity)`:
//! - a **free list** of maximal free extents, indexed by address (for coalescing) and by
//!   `(size, address)` (for best-fit), so a general allocation or free costs O(log n);
//! - **exact-size bins**: a freed block goes onto the bin of its size, uncoalesced, and an
//!   allocation of that size pops it in O(1). KV objects of one model are nearly all the same
//!   size, so the steady state of L1 never touches the trees.
//!
//! Bins never waste memory: when a request cannot be served from its bin or the free list,
//! every bin is flushed into the free list (coalescing neighbours) and the request is retried,
//! so "out of memory" means the free bytes are truly too fragmented or too few. At most
//! [`MAX_BINS`] sizes get a bin; blocks of other sizes are coalesced at once.
//!
//! # Invariants (checked by [`Allocator::check_invariants`] and the property tests)
//! 1. Live blocks, free extents and binned blocks are pairwise disjoint and tile
//!    `[0, capacity)` exactly.
//! 2. Every offset and size is a multiple of `align`.
//! 3. No two free extents touch (they would have been coalesced).
//! 4. `allocated_bytes` is the sum of the sizes of live blocks.

use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;

/// Default alignment of every block, as LMCache's `--l1-align-bytes`.
pub const DEFAULT_ALIGN: u64 = 4096;

/// How many distinct block sizes get an O(1) bin.
pub const MAX_BINS: usize = 16;

/// Why an allocation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum AllocError {
    /// A block of zero bytes was asked for.
    #[error("cannot allocate zero bytes")]
    ZeroSize,
    /// Not enough contiguous free memory. Nothing was allocated.
    #[error("out of memory: {requested} bytes requested, {free} bytes free")]
    OutOfMemory {
        /// Total aligned bytes the request needed.
        requested: u64,
        /// Free bytes at the time (possibly fragmented).
        free: u64,
    },
    /// The size does not fit the arena at all (or overflows when aligned).
    #[error("request of {requested} bytes exceeds the arena capacity of {capacity} bytes")]
    TooLarge {
        /// The request.
        requested: u64,
        /// The arena capacity.
        capacity: u64,
    },
    /// A byte range outside an allocation was addressed.
    #[error("range {offset}+{len} is outside an allocation of {size} bytes")]
    OutOfBounds {
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
        /// The allocation's size.
        size: u64,
    },
    /// The alignment is not a power of two of at least 64.
    #[error("alignment {align} must be a power of two and at least 64")]
    BadAlign {
        /// The refused alignment.
        align: u64,
    },
    /// [`Allocator::claim`] named a range that is not wholly free, aligned and inside the
    /// arena.
    #[error("range {offset}+{size} is not a free, aligned range of the arena")]
    NotFree {
        /// Start of the range.
        offset: u64,
        /// Its aligned length.
        size: u64,
    },
    /// The other process shrank its shared-memory segment while it was mapped: the copy hit
    /// pages that no longer exist (SIGBUS, caught). Nothing it read or wrote can be trusted.
    #[error("the client shrank its shared-memory segment while it was mapped; register again")]
    SegmentTruncated,
    /// The arena's range is free, but the file system behind it (/dev/shm) has no room left
    /// to back it: writing there would kill the process with SIGBUS, so nothing was
    /// allocated. Free memory already backed (eviction) and try again.
    #[error(
        "no room in /dev/shm to back {requested} more bytes of the L1 pool ({backed} bytes \
         backed so far)"
    )]
    BackingFull {
        /// Bytes the request needed.
        requested: u64,
        /// Bytes of the arena backed so far.
        backed: u64,
    },
}

/// A live block: `[offset, offset + size)`, aligned. Not `Clone`: exactly one value names a
/// live block, and freeing consumes it.
#[derive(Debug, PartialEq, Eq)]
pub struct Block {
    offset: u64,
    size: u64,
}

impl Block {
    /// Start offset in the arena.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Aligned size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// Counters of an [`Allocator`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AllocatorStats {
    /// Bytes of the address space.
    pub capacity: u64,
    /// Bytes in live blocks.
    pub allocated_bytes: u64,
    /// Number of live blocks.
    pub live_blocks: u64,
    /// Free bytes held in exact-size bins.
    pub binned_bytes: u64,
    /// Largest free extent of the free list (bins not counted).
    pub largest_free_extent: u64,
}

#[derive(Debug)]
struct Bin {
    size: u64,
    offsets: Vec<u64>,
}

/// Aligned best-fit allocator with coalescing and exact-size bins.
#[derive(Debug)]
pub struct Allocator {
    capacity: u64,
    align: u64,
    by_addr: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    bins: Vec<Bin>,
    binned_bytes: u64,
    allocated_bytes: u64,
    live_blocks: u64,
}

impl Allocator {
    /// An allocator over `[0, capacity)` rounded down to `align`.
    pub fn new(capacity: u64, align: u64) -> Result<Self, AllocError> {
        if !align.is_power_of_two() || align < 64 {
            return Err(AllocError::BadAlign { align });
        }
        let capacity = capacity & !(align - 1);
        let mut a = Self {
            capacity,
            align,
            by_addr: BTreeMap::new(),
            by_size: BTreeSet::new(),
            bins: Vec::new(),
            binned_bytes: 0,
            allocated_bytes: 0,
            live_blocks: 0,
        };
        if capacity > 0 {
            a.insert_extent(0, capacity);
        }
        Ok(a)
    }

    /// The usable capacity (a multiple of the alignment).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The alignment of every block.
    pub fn align(&self) -> u64 {
        self.align
    }

    /// Bytes in live blocks.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_bytes
    }

    /// Bytes not in live blocks (binned or in the free list).
    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.allocated_bytes
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> AllocatorStats {
        AllocatorStats {
            capacity: self.capacity,
            allocated_bytes: self.allocated_bytes,
            live_blocks: self.live_blocks,
            binned_bytes: self.binned_bytes,
            largest_free_extent: self.by_size.last().map_or(0, |&(s, _)| s),
        }
    }

    /// The aligned size a request of `size` bytes occupies.
    pub fn aligned_size(&self, size: u64) -> Result<u64, AllocError> {
        if size == 0 {
            return Err(AllocError::ZeroSize);
        }
        match size.checked_next_multiple_of(self.align) {
            Some(s) if s <= self.capacity => Ok(s),
            _ => Err(AllocError::TooLarge { requested: size, capacity: self.capacity }),
        }
    }

    /// Allocates one block of at least `size` bytes.
    pub fn allocate(&mut self, size: u64) -> Result<Block, AllocError> {
        let size = self.aligned_size(size)?;
        let block = match self.pop_bin(size) {
            Some(offset) => Block { offset, size },
            None => match self.carve(size) {
                Some(offset) => Block { offset, size },
                None => {
                    self.consolidate();
                    let offset = self.carve(size).ok_or(AllocError::OutOfMemory {
                        requested: size,
                        free: self.free_bytes(),
                    })?;
                    Block { offset, size }
                }
            },
        };
        self.allocated_bytes += size;
        self.live_blocks += 1;
        Ok(block)
    }

    /// Allocates one block per entry of `sizes`, all or nothing: on failure nothing stays
    /// allocated and the error reports the total requested.
    pub fn allocate_batch(&mut self, sizes: &[u64]) -> Result<Vec<Block>, AllocError> {
        let mut total = 0u64;
        for &s in sizes {
            total = total.saturating_add(self.aligned_size(s)?);
        }
        if total > self.free_bytes() {
            return Err(AllocError::OutOfMemory { requested: total, free: self.free_bytes() });
        }
        let mut out = Vec::with_capacity(sizes.len());
        for &s in sizes {
            match self.allocate(s) {
                Ok(b) => out.push(b),
                Err(e) => {
                    for b in out {
                        self.free(b);
                    }
                    return Err(match e {
                        AllocError::OutOfMemory { free, .. } => {
                            AllocError::OutOfMemory { requested: total, free }
                        }
                        other => other,
                    });
                }
            }
        }
        Ok(out)
    }

    /// Takes exactly `[offset, offset + size)` out of the free memory: how a restarted L1
    /// adopts the objects its file still holds. `size` is aligned up; the range must be
    /// aligned, inside the capacity and wholly free ([`AllocError::NotFree`] otherwise, and
    /// nothing changes).
    pub fn claim(&mut self, offset: u64, size: u64) -> Result<Block, AllocError> {
        let size = self.aligned_size(size)?;
        let not_free = AllocError::NotFree { offset, size };
        let end = offset.checked_add(size).ok_or(not_free)?;
        if offset % self.align != 0 || end > self.capacity {
            return Err(not_free);
        }
        self.consolidate();
        let (&start, &len) = self.by_addr.range(..=offset).next_back().ok_or(not_free)?;
        if start + len < end {
            return Err(not_free);
        }
        self.by_addr.remove(&start);
        self.by_size.remove(&(len, start));
        if start < offset {
            self.by_addr.insert(start, offset - start);
            self.by_size.insert((offset - start, start));
        }
        if end < start + len {
            self.by_addr.insert(end, start + len - end);
            self.by_size.insert((start + len - end, end));
        }
        self.allocated_bytes += size;
        self.live_blocks += 1;
        Ok(Block { offset, size })
    }

    /// Returns a block. O(1) when its size has a bin.
    pub fn free(&mut self, block: Block) {
        self.allocated_bytes -= block.size;
        self.live_blocks -= 1;
        if let Some(bin) = self.bins.iter_mut().find(|b| b.size == block.size) {
            bin.offsets.push(block.offset);
            self.binned_bytes += block.size;
        } else if self.bins.len() < MAX_BINS {
            self.bins.push(Bin { size: block.size, offsets: vec![block.offset] });
            self.binned_bytes += block.size;
        } else {
            self.insert_extent(block.offset, block.size);
        }
    }

    /// Moves every binned block into the free list, coalescing neighbours.
    pub fn consolidate(&mut self) {
        if self.binned_bytes == 0 {
            return;
        }
        let bins = std::mem::take(&mut self.bins);
        for bin in &bins {
            for &offset in &bin.offsets {
                self.insert_extent(offset, bin.size);
            }
        }
        self.binned_bytes = 0;
        // Keep the bins' sizes (and their vectors' capacity) for the next frees.
        self.bins = bins
            .into_iter()
            .map(|mut b| {
                b.offsets.clear();
                b
            })
            .collect();
    }

    fn pop_bin(&mut self, size: u64) -> Option<u64> {
        let bin = self.bins.iter_mut().find(|b| b.size == size)?;
        let offset = bin.offsets.pop()?;
        self.binned_bytes -= size;
        Some(offset)
    }

    /// Best fit from the free list; splits the extent.
    fn carve(&mut self, size: u64) -> Option<u64> {
        let &(len, start) = self.by_size.range((size, 0)..).next()?;
        self.by_size.remove(&(len, start));
        self.by_addr.remove(&start);
        if len > size {
            // The remainder's neighbours are live (else they would be coalesced): no merge.
            self.by_addr.insert(start + size, len - size);
            self.by_size.insert((len - size, start + size));
        }
        Some(start)
    }

    /// Adds `[start, start+len)` to the free list, merging with touching extents.
    fn insert_extent(&mut self, mut start: u64, mut len: u64) {
        if let Some((&prev_start, &prev_len)) = self.by_addr.range(..start).next_back() {
            if prev_start + prev_len == start {
                self.by_addr.remove(&prev_start);
                self.by_size.remove(&(prev_len, prev_start));
                start = prev_start;
                len += prev_len;
            }
        }
        if let Some(&next_len) = self.by_addr.get(&(start + len)) {
            let next_start = start + len;
            self.by_addr.remove(&next_start);
            self.by_size.remove(&(next_len, next_start));
            len += next_len;
        }
        self.by_addr.insert(start, len);
        self.by_size.insert((len, start));
    }

    /// Checks invariants 1-4 given the live blocks as `(offset, size)`; returns a description
    /// of the first violation. For tests and debug assertions; O(n log n).
    pub fn check_invariants(&self, live: &[(u64, u64)]) -> Result<(), String> {
        let mut ranges: Vec<(u64, u64, &str)> = Vec::new();
        ranges.extend(live.iter().map(|&(o, s)| (o, s, "live")));
        ranges.extend(self.by_addr.iter().map(|(&o, &s)| (o, s, "free")));
        for bin in &self.bins {
            ranges.extend(bin.offsets.iter().map(|&o| (o, bin.size, "binned")));
        }
        ranges.sort_unstable();
        let mut cursor = 0u64;
        for &(o, s, what) in &ranges {
            if o % self.align != 0 || s % self.align != 0 || s == 0 {
                return Err(format!("{what} range {o}+{s} is not aligned to {}", self.align));
            }
            if o != cursor {
                return Err(format!("{what} range {o}+{s} does not start at {cursor}"));
            }
            cursor = o + s;
        }
        if cursor != self.capacity {
            return Err(format!("ranges end at {cursor}, capacity is {}", self.capacity));
        }
        let mut prev_end = None;
        for (&o, &s) in &self.by_addr {
            if prev_end == Some(o) {
                return Err(format!("free extents touch at {o}"));
            }
            prev_end = Some(o + s);
        }
        if self.by_addr.len() != self.by_size.len() {
            return Err("free-list indexes disagree".into());
        }
        let live_bytes: u64 = live.iter().map(|&(_, s)| s).sum();
        if live_bytes != self.allocated_bytes || live.len() as u64 != self.live_blocks {
            return Err(format!(
                "accounting says {} bytes in {} blocks, live set has {live_bytes} in {}",
                self.allocated_bytes,
                self.live_blocks,
                live.len()
            ));
        }
        let binned: u64 = self.bins.iter().map(|b| b.size * b.offsets.len() as u64).sum();
        if binned != self.binned_bytes {
            return Err(format!("binned bytes {} != {}", self.binned_bytes, binned));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: u64 = 4096;

    #[test]
    fn rejects_bad_alignment_and_sizes() {
        assert!(matches!(Allocator::new(1 << 20, 3), Err(AllocError::BadAlign { .. })));
        assert!(matches!(Allocator::new(1 << 20, 32), Err(AllocError::BadAlign { .. })));
        let mut a = Allocator::new(1 << 20, A).unwrap();
        assert_eq!(a.allocate(0), Err(AllocError::ZeroSize));
        assert!(matches!(a.allocate((1 << 20) + 1), Err(AllocError::TooLarge { .. })));
        assert!(matches!(a.allocate(u64::MAX), Err(AllocError::TooLarge { .. })));
    }

    #[test]
    fn capacity_rounds_down_to_alignment() {
        let a = Allocator::new(10_000, A).unwrap();
        assert_eq!(a.capacity(), 8192);
    }

    #[test]
    fn rounds_up_and_fills_exactly() {
        let mut a = Allocator::new(16 * A, A).unwrap();
        let blocks: Vec<_> = (0..16).map(|_| a.allocate(1).unwrap()).collect();
        assert_eq!(a.allocated_bytes(), 16 * A);
        assert!(matches!(a.allocate(1), Err(AllocError::OutOfMemory { .. })));
        let live: Vec<_> = blocks.iter().map(|b| (b.offset(), b.size())).collect();
        a.check_invariants(&live).unwrap();
    }

    #[test]
    fn bins_make_same_size_reuse_lifo() {
        let mut a = Allocator::new(64 * A, A).unwrap();
        let b1 = a.allocate(3 * A).unwrap();
        let off = b1.offset();
        a.free(b1);
        assert_eq!(a.stats().binned_bytes, 3 * A);
        assert_eq!(a.allocate(3 * A).unwrap().offset(), off);
    }

    #[test]
    fn consolidation_coalesces_binned_blocks_for_a_bigger_request() {
        let mut a = Allocator::new(8 * A, A).unwrap();
        let blocks: Vec<_> = (0..8).map(|_| a.allocate(A).unwrap()).collect();
        for b in blocks {
            a.free(b);
        }
        // Every byte is free but binned in 4 KiB pieces: a 32 KiB request must still succeed.
        let big = a.allocate(8 * A).unwrap();
        assert_eq!((big.offset(), big.size()), (0, 8 * A));
        a.check_invariants(&[(0, 8 * A)]).unwrap();
    }

    #[test]
    fn batch_is_all_or_nothing() {
        let mut a = Allocator::new(10 * A, A).unwrap();
        let _keep = a.allocate(4 * A).unwrap();
        let err = a.allocate_batch(&[2 * A, 2 * A, 2 * A, 2 * A]).unwrap_err();
        assert_eq!(err, AllocError::OutOfMemory { requested: 8 * A, free: 6 * A });
        assert_eq!(a.allocated_bytes(), 4 * A);
        // Fragmented failure path: enough bytes in total, but not contiguous.
        let mut b = Allocator::new(4 * A, A).unwrap();
        let x = b.allocate(A).unwrap();
        let y = b.allocate(A).unwrap();
        let z = b.allocate(A).unwrap();
        b.free(y);
        let live = [(x.offset(), A), (z.offset(), A)];
        assert!(b.allocate_batch(&[A, 2 * A]).is_err());
        b.check_invariants(&live).unwrap();
        assert_eq!(b.allocated_bytes(), 2 * A);
    }

    #[test]
    fn overflow_of_bins_goes_to_the_free_list() {
        let mut a = Allocator::new(1024 * A, A).unwrap();
        let mut live = Vec::new();
        for i in 1..=(MAX_BINS as u64 + 4) {
            live.push(a.allocate(i * A).unwrap());
        }
        let mut kept = Vec::new();
        for (i, b) in live.into_iter().enumerate() {
            if i % 2 == 0 { a.free(b) } else { kept.push(b) }
        }
        let l: Vec<_> = kept.iter().map(|b| (b.offset(), b.size())).collect();
        a.check_invariants(&l).unwrap();
    }

    #[test]
    fn claim_takes_exactly_a_free_range() {
        let mut a = Allocator::new(16 * A, A).unwrap();
        let b = a.claim(4 * A, 2 * A - 100).unwrap();
        assert_eq!((b.offset(), b.size()), (4 * A, 2 * A));
        assert!(matches!(a.claim(5 * A, A), Err(AllocError::NotFree { .. })), "overlaps");
        assert!(matches!(a.claim(A + 1, A), Err(AllocError::NotFree { .. })), "unaligned");
        assert!(matches!(a.claim(15 * A, 2 * A), Err(AllocError::NotFree { .. })), "past end");
        let c = a.claim(6 * A, A).unwrap();
        a.check_invariants(&[(4 * A, 2 * A), (6 * A, A)]).unwrap();
        // What is left is still allocatable around the claimed ranges.
        let d = a.allocate(4 * A).unwrap();
        assert_eq!(d.offset(), 0);
        a.free(b);
        a.free(c);
        a.free(d);
        a.check_invariants(&[]).unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Batch(Vec<u64>),
        Free(usize),
        Consolidate,
        /// Claim `(offset in alignment units, size)`.
        Claim(u64, u64),
    }

    fn op(uniform: bool) -> impl Strategy<Value = Op> {
        let size = if uniform { Just(5 * A).boxed() } else { (1u64..40 * A).boxed() };
        prop_oneof![
            4 => size.clone().prop_map(Op::Alloc),
            1 => proptest::collection::vec(size, 1..6).prop_map(Op::Batch),
            4 => any::<usize>().prop_map(Op::Free),
            1 => Just(Op::Consolidate),
            2 => (0u64..300, 1u64..12 * A).prop_map(|(o, s)| Op::Claim(o, s)),
        ]
    }

    fn run(ops: Vec<Op>, capacity: u64) -> Result<(), TestCaseError> {
        let mut a = Allocator::new(capacity, A).unwrap();
        let mut live: Vec<Block> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(s) => {
                    let free_before = a.free_bytes();
                    match a.allocate(s) {
                        Ok(b) => {
                            prop_assert!(b.size() >= s);
                            live.push(b);
                        }
                        Err(AllocError::OutOfMemory { .. }) => {
                            prop_assert_eq!(a.free_bytes(), free_before);
                            // After consolidation a failure means no extent is big enough.
                            prop_assert!(
                                a.stats().largest_free_extent < a.aligned_size(s).unwrap()
                            );
                        }
                        Err(AllocError::TooLarge { .. }) => prop_assert!(s > capacity),
                        Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                    }
                }
                Op::Batch(sizes) => {
                    let before = a.allocated_bytes();
                    match a.allocate_batch(&sizes) {
                        Ok(bs) => {
                            prop_assert_eq!(bs.len(), sizes.len());
                            live.extend(bs);
                        }
                        Err(_) => prop_assert_eq!(a.allocated_bytes(), before),
                    }
                }
                Op::Free(i) if !live.is_empty() => {
                    let b = live.swap_remove(i % live.len());
                    a.free(b);
                }
                Op::Free(_) => {}
                Op::Consolidate => a.consolidate(),
                Op::Claim(unit, s) => {
                    let offset = unit * A;
                    let size = s.next_multiple_of(A);
                    let free = offset + size <= a.capacity()
                        && live.iter().all(|b| {
                            b.offset() + b.size() <= offset || offset + size <= b.offset()
                        });
                    let before = a.allocated_bytes();
                    match a.claim(offset, s) {
                        Ok(b) => {
                            prop_assert!(free, "claimed a range that was not free");
                            prop_assert_eq!((b.offset(), b.size()), (offset, size));
                            live.push(b);
                        }
                        Err(AllocError::NotFree { .. }) | Err(AllocError::TooLarge { .. }) => {
                            prop_assert!(!free, "refused a free range");
                            prop_assert_eq!(a.allocated_bytes(), before);
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                    }
                }
            }
            let l: Vec<_> = live.iter().map(|b| (b.offset(), b.size())).collect();
            if let Err(msg) = a.check_invariants(&l) {
                return Err(TestCaseError::fail(msg));
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Mixed sizes: live blocks never overlap, bytes accounted equal bytes allocated,
        /// failed batches leave nothing behind.
        #[test]
        fn mixed_sizes_keep_invariants(ops in proptest::collection::vec(op(false), 1..120)) {
            run(ops, 256 * A)?;
        }

        /// Uniform sizes: the common KV case.
        #[test]
        fn uniform_sizes_keep_invariants(ops in proptest::collection::vec(op(true), 1..200)) {
            run(ops, 101 * A)?;
        }
    }
}
