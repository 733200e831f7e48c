//! A range of a file we own, mapped shared and written and read by bounds-checked copies: how
//! raw_block appends its journal records and how the L1 file keeps its catalog. A `pwrite` of a record into a file that also takes
//! O_DIRECT writes needs the inode's lock exclusively, so each append waited for every data
//! write in flight and held back the next ones; a store into a mapped page takes no inode
//! lock (BENCHMARKS.md, fifteenth session). The page cache holds what is written, so it
//! survives the process (`kill -9`), as a `pwrite` does; the file's `fdatasync` makes it
//! durable.
//!
//! The file is the caller's own (raw_block refuses files that are not), so nobody should
//! shrink it under the mapping; if something does, the SIGBUS of a copy is caught
//! ([`crate::fault_guard`]) and that copy and every later one fail instead of killing the
//! process.

use std::fs::File;

use memmap2::{MmapOptions, MmapRaw};

use crate::allocator::AllocError;
use crate::dax_device::DaxDevice;
use crate::error::MemoryError;

/// `len` bytes of a file from `offset`, mapped read-write and shared.
#[derive(Debug)]
pub struct FileRegion {
    // Field order matters for drop: the guard unregisters before the mapping goes.
    guard: crate::fault_guard::Guard,
    map: MmapRaw,
    /// The bytes asked for; the mapping may run further (a device-dax device maps whole
    /// steps of its alignment), but copies stay within these.
    len: usize,
}

impl FileRegion {
    /// Maps `[offset, offset + len)` of `file` (opened read-write), which must lie within it.
    pub fn map(file: &File, offset: u64, len: usize) -> Result<Self, MemoryError> {
        if len == 0 {
            return Err(MemoryError::InvalidSize { size: 0, reason: "zero" });
        }
        let meta = file.metadata().map_err(|e| MemoryError::os("fstat", e))?;
        // A block device reports no length here; the kernel bounds its mapping. A device-dax
        // one maps only whole steps of its alignment, within its size.
        let end = offset.checked_add(len as u64);
        if meta.is_file() && end.is_none_or(|end| end > meta.len()) {
            return Err(MemoryError::InvalidSize {
                size: len as u64,
                reason: "past the file's end",
            });
        }
        let mapped = match DaxDevice::of(&meta)? {
            Some(dev) => usize::try_from(dev.check(offset, len as u64)?).map_err(|_| {
                MemoryError::InvalidSize { size: len as u64, reason: "address space" }
            })?,
            None => len,
        };
        let map = MmapOptions::new()
            .offset(offset)
            .len(mapped)
            .map_raw(file)
            .map_err(|e| MemoryError::os("mmap file region", e))?;
        let guard = crate::fault_guard::guard(map.as_ptr(), map.len());
        Ok(Self { guard, map, len })
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), AllocError> {
        if self.guard.faulted() {
            return Err(AllocError::SegmentTruncated);
        }
        let oob = AllocError::OutOfBounds {
            offset: offset as u64,
            len: len as u64,
            size: self.len as u64,
        };
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(oob),
        }
    }

    /// Copies the region's bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), AllocError> {
        self.check(offset, dst.len())?;
        // SAFETY: `check` proved `offset + dst.len() <= len <= map.len()`, so the source lies
        // in the live mapping `self` owns; `dst` is a Rust slice, which cannot overlap a
        // mapping no reference to which is ever handed out. Another process may write the
        // file at the same time: the bytes are then whatever the page held, which callers
        // verify.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        if self.guard.faulted() {
            return Err(AllocError::SegmentTruncated);
        }
        Ok(())
    }

    /// Copies `src` into the region at `offset`. `&mut self`: no two writes race.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), AllocError> {
        self.check(offset, src.len())?;
        // SAFETY: `check` proved `offset + src.len() <= len <= map.len()`, so the destination
        // lies in the live mapping `self` owns; `src` is a Rust slice and cannot overlap a
        // mapping no reference to which is ever handed out; `&mut self` excludes concurrent
        // writers.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.map.as_mut_ptr().add(offset),
                src.len(),
            )
        };
        if self.guard.faulted() {
            return Err(AllocError::SegmentTruncated);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    fn file(len: u64) -> (tempfile::TempDir, File) {
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        f.set_len(len).unwrap();
        (dir, f)
    }

    #[test]
    fn writes_reach_the_file_at_the_regions_offset() {
        let (_dir, f) = file(3 * 4096);
        let mut r = FileRegion::map(&f, 4096, 4096).unwrap();
        r.write(100, b"record").unwrap();
        let mut got = [0u8; 6];
        f.read_exact_at(&mut got, 4096 + 100).unwrap();
        assert_eq!(&got, b"record");
        f.read_exact_at(&mut got, 100).unwrap();
        assert_eq!(got, [0; 6], "nothing before the region");
    }

    #[test]
    fn out_of_bounds_and_past_the_end_are_refused() {
        let (_dir, f) = file(2 * 4096);
        assert!(FileRegion::map(&f, 4096, 2 * 4096).is_err(), "past the file's end");
        assert!(FileRegion::map(&f, 0, 0).is_err());
        let mut r = FileRegion::map(&f, 4096, 4096).unwrap();
        assert!(matches!(r.write(4090, &[0; 7]), Err(AllocError::OutOfBounds { .. })));
        assert!(matches!(r.write(usize::MAX, &[0; 2]), Err(AllocError::OutOfBounds { .. })));
        r.write(4089, &[1; 7]).unwrap();
        let mut back = [0u8; 7];
        r.read(4089, &mut back).unwrap();
        assert_eq!(back, [1; 7]);
        assert!(matches!(r.read(4090, &mut back), Err(AllocError::OutOfBounds { .. })));
    }
}
