//! Shared-memory segments created by another process (an engine's KV cache in the CPU
//! lmcache-driven mode), mapped read-write and accessed only by bounds-checked copies.
//!
//! The other process writes these pages whenever it likes, so no Rust reference to them is
//! ever formed: bytes move with raw copies (`crate::stream_copy`) after the range has
//! been checked against the mapping with overflow-checked arithmetic. Offsets come from the
//! wire and are treated as untrusted.

use std::fs::File;

use memmap2::{MmapOptions, MmapRaw};
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::allocator::AllocError;
use crate::error::MemoryError;
use crate::shm::validate_name;

/// A mapping of another process's shared-memory segment.
#[derive(Debug)]
pub struct ForeignSegment {
    name: String,
    // Field order matters for drop: the guard unregisters before the mapping goes.
    guard: crate::fault_guard::Guard,
    map: MmapRaw,
    owner_uid: u32,
    file_id: (u64, u64),
}

impl ForeignSegment {
    /// Maps `len` bytes of segment `name` (a leading `/` is accepted). Fails if the segment
    /// is missing or shorter than `len`.
    pub fn open(name: &str, len: u64) -> Result<Self, MemoryError> {
        let bare = name.strip_prefix('/').unwrap_or(name);
        validate_name(bare)?;
        if len == 0 {
            return Err(MemoryError::InvalidSize { size: 0, reason: "zero" });
        }
        let fd =
            nix::sys::mman::shm_open(format!("/{bare}").as_str(), OFlag::O_RDWR, Mode::empty())
                .map_err(|e| MemoryError::os("shm_open (client segment)", e))?;
        let file = File::from(fd);
        let meta = file.metadata().map_err(|e| MemoryError::os("fstat", e))?;
        let actual = meta.len();
        if actual < len {
            return Err(MemoryError::InvalidSize { size: len, reason: "segment is shorter" });
        }
        let len = usize::try_from(len)
            .map_err(|_| MemoryError::InvalidSize { size: len, reason: "address space" })?;
        // No MAP_POPULATE: on a sparse segment (a server's pool) it would commit every page.
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| MemoryError::os("mmap client segment", e))?;
        let guard = crate::fault_guard::guard(map.as_ptr(), map.len());
        use std::os::unix::fs::MetadataExt;
        Ok(Self {
            name: bare.to_owned(),
            guard,
            map,
            owner_uid: meta.uid(),
            file_id: (meta.dev(), meta.ino()),
        })
    }

    /// The uid that owns the segment.
    pub fn owner_uid(&self) -> u32 {
        self.owner_uid
    }

    /// `(device, inode)` of the segment: the same for every name of one segment.
    pub fn file_id(&self) -> (u64, u64) {
        self.file_id
    }

    /// True once its owner shrank it under us (see [`crate::fault_guard`]): every copy fails.
    pub fn truncated(&self) -> bool {
        self.guard.faulted()
    }

    /// The segment's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Mapped length.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// True for an empty mapping (never).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    fn check(&self, offset: u64, len: usize) -> Result<usize, AllocError> {
        if self.guard.faulted() {
            return Err(AllocError::SegmentTruncated);
        }
        let oob = AllocError::OutOfBounds { offset, len: len as u64, size: self.len() };
        let end = offset.checked_add(len as u64).ok_or(oob)?;
        if end > self.len() {
            return Err(oob);
        }
        Ok(offset as usize)
    }

    /// Copies `dst.len()` bytes starting at `offset` of the segment into `dst`.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), AllocError> {
        let off = self.check(offset, dst.len())?;
        // SAFETY: `check` proved `off + dst.len() <= map.len()`, so the source range lies in
        // the live mapping owned by `self`; `dst` is a distinct Rust slice, so the ranges do
        // not overlap (`stream_copy::copy`'s contract). Raw copy: no reference to the shared
        // pages is formed.
        unsafe {
            crate::stream_copy::copy(dst.as_mut_ptr(), self.map.as_ptr().add(off), dst.len())
        };
        // A SIGBUS during the copy (the owner shrank the segment) left zeros in `dst`.
        if self.guard.faulted() {
            return Err(AllocError::SegmentTruncated);
        }
        Ok(())
    }

    /// Copies `src` into the segment at `offset`.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), AllocError> {
        let off = self.check(offset, src.len())?;
        // SAFETY: as in `read`, with the roles swapped: the destination range is inside the
        // mapping and cannot overlap the Rust slice `src`.
        unsafe {
            crate::stream_copy::copy(self.map.as_mut_ptr().add(off), src.as_ptr(), src.len())
        };
        if self.guard.faulted() {
            return Err(AllocError::SegmentTruncated);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::ShmSegment;

    #[test]
    fn copies_are_bounds_checked_at_the_edges() {
        let name = format!("lmcache_rs_test_foreign_{}", std::process::id());
        let _owner = ShmSegment::create(&name, 4096).unwrap();
        let seg = ForeignSegment::open(&format!("/{name}"), 4096).unwrap();
        seg.write(4090, b"abcdef").unwrap();
        let mut out = [0u8; 6];
        seg.read(4090, &mut out).unwrap();
        assert_eq!(&out, b"abcdef");
        assert!(seg.write(4091, b"abcdef").is_err(), "write past the end accepted");
        assert!(seg.read(u64::MAX - 2, &mut out).is_err(), "overflowing offset accepted");
        assert!(seg.read(4096, &mut []).is_ok());
        assert!(ForeignSegment::open(&name, 8192).is_err(), "mapping beyond the segment");
        assert!(ForeignSegment::open("no_such_segment_xyz", 10).is_err());
        assert!(ForeignSegment::open("../etc/passwd", 10).is_err());
    }

    #[test]
    fn a_segment_shrunk_under_us_fails_its_copies_instead_of_killing_the_process() {
        let name = format!("lmcache_rs_test_shrunk_{}", std::process::id());
        let owner = ShmSegment::create(&name, 1 << 20).unwrap();
        let other_name = format!("lmcache_rs_test_intact_{}", std::process::id());
        let _other_owner = ShmSegment::create(&other_name, 8192).unwrap();
        let seg = ForeignSegment::open(&name, 1 << 20).unwrap();
        let other = ForeignSegment::open(&other_name, 8192).unwrap();
        seg.write(0, &[7; 4096]).unwrap();
        assert_eq!(seg.owner_uid(), nix::unistd::geteuid().as_raw());
        // The owner shrinks it to one page: every page past it is gone.
        owner.file().set_len(4096).unwrap();
        let mut buf = vec![0u8; 8192];
        assert_eq!(seg.read(4096, &mut buf), Err(AllocError::SegmentTruncated));
        assert!(seg.truncated());
        assert_eq!(seg.write(8192, &[1; 100]), Err(AllocError::SegmentTruncated));
        assert_eq!(seg.read(0, &mut buf[..10]), Err(AllocError::SegmentTruncated), "stays failed");
        // Other segments are unaffected.
        other.write(0, &[3; 8192]).unwrap();
        other.read(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 3));
        drop(seg);
        // A new mapping of the (now small) segment within its size works.
        let again = ForeignSegment::open(&name, 4096).unwrap();
        again.read(0, &mut buf[..4096]).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 7));
    }
}
