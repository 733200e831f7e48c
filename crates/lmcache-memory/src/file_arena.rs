//! An L1 arena in a file or device that outlives the process: `--l1-devdax-path` (a
//! `/dev/dax` device, a pmem or DAX file system, tmpfs, or any file that can be mapped), with
//! a catalog of the objects it holds, so a restarted server can adopt them.
//!
//! # Layout
//! ```text
//! [0, 4 KiB)                  superblock: magic, version, geometry, checksum
//! [4 KiB, 4 KiB + N × 256)    catalog: one 256-byte record per sealed object, or zeros
//! [data_offset, + data_len)   the objects (data_offset: a multiple of 2 MiB)
//! ```
//! A record names an object's key (opaque bytes, the L1's encoding), its place in the data
//! region, its length and the xxh3-64 of its bytes, and carries its own checksum. It is
//! written once the object's bytes are final ([`crate::Allocation::persist`], after the
//! object was committed) and zeroed before its range can be reused (when the allocation
//! drops). A process killed at any point thus leaves records that either verify or do not;
//! the next process adopts only objects whose record and bytes both verify, so an object
//! whose write or checksum did not complete is never served.
//!
//! Writes go through the shared mapping into the page cache (or straight to the device for
//! DAX), which a killed process does not lose. A power failure on a file system with a page
//! cache can lose recent writes: the checksums then drop what did not reach the medium.
//!
//! # Ownership
//! Only a missing file, an empty regular file, or one whose superblock is ours is used; a
//! device or file holding anything else is refused unless the operator asked to format it
//! (`--l1-devdax-format`). The file is `flock`ed exclusively while mapped, so two servers
//! never share it.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};
use nix::fcntl::{Flock, FlockArg};
use parking_lot::Mutex;
use thiserror::Error;

use crate::dax_device::DaxDevice;
use crate::error::MemoryError;
use crate::file_region::FileRegion;

const SUPER_MAGIC: &[u8; 8] = b"LMRSL1F1";
const VERSION: u32 = 1;
const SUPER_LEN: usize = 64;
const HEADER_BLOCK: u64 = 4096;
/// Bytes of one catalog record.
pub const RECORD_LEN: usize = 256;
const REC_MAGIC: u32 = 0x3152_314c;
/// Longest key a record holds.
pub const MAX_KEY_LEN: usize = 200;
const KEY_AT: usize = 48;
const SUM_AT: usize = RECORD_LEN - 8;
/// The data region starts on a multiple of this (a DAX device maps in 2 MiB pages).
const DATA_ALIGN: u64 = 2 << 20;
/// One record per this many bytes of L1 (at least [`MIN_RECORDS`]).
const BYTES_PER_RECORD: u64 = 128 << 10;
const MIN_RECORDS: u64 = 1024;
const MAX_RECORDS: u64 = 1 << 22;

/// How to open an L1 file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileBacking {
    /// The device or file.
    pub path: PathBuf,
    /// Format it even if it holds something that is not an lmcache-rs L1 (the operator's
    /// explicit choice: its contents are lost).
    pub format: bool,
    /// Adopt the objects a previous process left (restart warm); off: start empty.
    pub adopt: bool,
}

/// Why an object could not be recorded in the catalog. The object is still served by this
/// process; it just does not survive a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PersistError {
    /// The key's encoding is longer than a record holds.
    #[error("key of {len} bytes is longer than the {MAX_KEY_LEN} a catalog record holds")]
    KeyTooLong {
        /// Its length.
        len: usize,
    },
    /// Every catalog record is in use.
    #[error("the L1 file's catalog is full ({records} records)")]
    CatalogFull {
        /// Records in the catalog.
        records: u64,
    },
    /// The catalog could not be written (the file shrank under the mapping).
    #[error("the L1 file's catalog could not be written")]
    Io,
}

/// Geometry recorded in the superblock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    records: u64,
    data_offset: u64,
    data_len: u64,
}

impl Geometry {
    fn for_size(data_len: u64) -> Self {
        let records = (data_len / BYTES_PER_RECORD).clamp(MIN_RECORDS, MAX_RECORDS);
        let end = HEADER_BLOCK + records * RECORD_LEN as u64;
        Self { records, data_offset: end.next_multiple_of(DATA_ALIGN), data_len }
    }

    fn catalog_len(&self) -> usize {
        (HEADER_BLOCK + self.records * RECORD_LEN as u64) as usize
    }

    fn encode(&self) -> [u8; SUPER_LEN] {
        let mut b = [0u8; SUPER_LEN];
        b[0..8].copy_from_slice(SUPER_MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(RECORD_LEN as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.records.to_le_bytes());
        b[24..32].copy_from_slice(&self.data_offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.data_len.to_le_bytes());
        let sum = xxh3(&b[..56]);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// The geometry of a superblock of ours; `None` for anything else.
    fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < SUPER_LEN || &b[0..8] != SUPER_MAGIC || xxh3(&b[..56]) != le64(b, 56) {
            return None;
        }
        if le32(b, 8) != VERSION || le32(b, 12) as usize != RECORD_LEN {
            return None;
        }
        let g = Self { records: le64(b, 16), data_offset: le64(b, 24), data_len: le64(b, 32) };
        (g == Self::for_size(g.data_len)).then_some(g)
    }
}

fn xxh3(b: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(b)
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn le32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

/// One catalog record, decoded and self-checked (its place and bytes still to verify).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) index: u32,
    pub(crate) generation: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) physical: u64,
    pub(crate) checksum: u64,
    pub(crate) key: Vec<u8>,
}

impl Record {
    fn encode(&self) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        b[0..4].copy_from_slice(&REC_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&(self.key.len() as u16).to_le_bytes());
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..40].copy_from_slice(&self.physical.to_le_bytes());
        b[40..48].copy_from_slice(&self.checksum.to_le_bytes());
        b[KEY_AT..KEY_AT + self.key.len()].copy_from_slice(&self.key);
        let sum = xxh3(&b[..SUM_AT]);
        b[SUM_AT..].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// A live record that checks; `None` for a free slot or a torn or damaged one.
    fn decode(index: u32, b: &[u8]) -> Option<Self> {
        if b.len() != RECORD_LEN || le32(b, 0) != REC_MAGIC || xxh3(&b[..SUM_AT]) != le64(b, SUM_AT)
        {
            return None;
        }
        let key_len = u16::from_le_bytes([b[4], b[5]]) as usize;
        if key_len == 0 || key_len > MAX_KEY_LEN {
            return None;
        }
        Some(Self {
            index,
            generation: le64(b, 8),
            offset: le64(b, 16),
            len: le64(b, 24),
            physical: le64(b, 32),
            checksum: le64(b, 40),
            key: b[KEY_AT..KEY_AT + key_len].to_vec(),
        })
    }
}

/// Where record `index` starts in the catalog region.
fn record_at(index: u32) -> usize {
    HEADER_BLOCK as usize + index as usize * RECORD_LEN
}

/// The catalog: records of sealed objects, and which record slots are free.
#[derive(Debug)]
pub(crate) struct Catalog {
    region: Mutex<FileRegion>,
    free: Mutex<Vec<u32>>,
    records: u64,
    generation: AtomicU64,
}

impl Catalog {
    /// Records a sealed object; returns the record's slot.
    pub(crate) fn write(
        &self,
        key: &[u8],
        offset: u64,
        len: u64,
        physical: u64,
        checksum: u64,
    ) -> Result<u32, PersistError> {
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(PersistError::KeyTooLong { len: key.len() });
        }
        let index =
            self.free.lock().pop().ok_or(PersistError::CatalogFull { records: self.records })?;
        let generation = self.generation.fetch_add(1, Ordering::Relaxed);
        let rec = Record { index, generation, offset, len, physical, checksum, key: key.to_vec() };
        let at = record_at(index);
        if self.region.lock().write(at, &rec.encode()).is_err() {
            self.free.lock().push(index);
            return Err(PersistError::Io);
        }
        Ok(index)
    }

    /// Zeroes record `index` and frees its slot: its object's range may now be reused.
    pub(crate) fn clear(&self, index: u32) {
        let at = record_at(index);
        if let Err(e) = self.region.lock().write(at, &[0u8; RECORD_LEN]) {
            // The slot is not reused: a record that may still name the range stays unused.
            tracing::error!(error = %e, record = index, "could not clear an L1 catalog record");
            return;
        }
        self.free.lock().push(index);
    }

    /// Records in the catalog.
    pub(crate) fn capacity(&self) -> u64 {
        self.records
    }

    /// Records in use.
    pub(crate) fn used(&self) -> u64 {
        self.records - self.free.lock().len() as u64
    }

    /// Every live record that checks, in slot order; every other slot is zeroed and freed.
    /// Called once, before any object is recorded.
    pub(crate) fn take_records(&self) -> Vec<Record> {
        let mut region = self.region.lock();
        let mut buf = vec![0u8; RECORD_LEN];
        let mut out = Vec::new();
        let mut free = Vec::new();
        let mut top = 0u64;
        for i in (0..self.records as u32).rev() {
            let at = record_at(i);
            let rec = region.read(at, &mut buf).ok().and_then(|()| Record::decode(i, &buf));
            match rec {
                Some(r) => {
                    top = top.max(r.generation);
                    out.push(r);
                }
                None => {
                    if buf.iter().any(|&b| b != 0) {
                        let _ = region.write(at, &[0u8; RECORD_LEN]);
                    }
                    free.push(i);
                }
            }
        }
        out.reverse();
        self.generation.fetch_max(top + 1, Ordering::Relaxed);
        *self.free.lock() = free;
        out
    }

    /// Gives record slots back (records dropped by the adoption: zeroed first).
    pub(crate) fn release(&self, indices: impl IntoIterator<Item = u32>) {
        for i in indices {
            self.clear(i);
        }
    }
}

/// An opened, locked, formatted L1 file: its data mapping and catalog.
#[derive(Debug)]
pub(crate) struct FileArena {
    pub(crate) catalog: Catalog,
    /// Adopt the catalog's objects (asked for, and the file was laid out for this size).
    pub(crate) adopt: bool,
    /// A warm restart was asked for (the file may have been new).
    pub(crate) asked_adopt: bool,
    pub(crate) path: PathBuf,
    pub(crate) data_offset: u64,
    /// A regular file: space is reserved with `fallocate` before use (as for /dev/shm), so a
    /// full file system is an error, not a SIGBUS. Devices need none.
    pub(crate) regular: bool,
    /// The exclusive lock, on a duplicate of `file`'s descriptor (one open file description:
    /// dropping it unlocks the file). Taken by [`FileArena::release`] once nothing will be
    /// written any more, so a process taking over need not wait for this one's unmapping.
    pub(crate) lock: Mutex<Option<Flock<File>>>,
    // Last: the lock (if still held) goes after the mappings.
    pub(crate) file: File,
}

impl FileArena {
    /// Opens (creating or formatting if need be) `backing.path` for `data_len` bytes of L1;
    /// returns the data region's mapping beside it.
    pub(crate) fn open(
        backing: &FileBacking,
        data_len: u64,
    ) -> Result<(MmapRaw, Self), MemoryError> {
        let path = &backing.path;
        let want = Geometry::for_size(data_len);
        let file = match OpenOptions::new().read(true).write(true).open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                OpenOptions::new().read(true).write(true).create_new(true).open(path).map_err(
                    |e| MemoryError::File { path: path.clone(), op: "create", source: e },
                )?
            }
            Err(e) => return Err(MemoryError::File { path: path.clone(), op: "open", source: e }),
        };
        let dup = file.try_clone().map_err(|e| MemoryError::File {
            path: path.clone(),
            op: "dup",
            source: e,
        })?;
        let lock = Flock::lock(dup, FlockArg::LockExclusiveNonblock)
            .map_err(|_| MemoryError::FileInUse { path: path.clone() })?;
        let meta = file.metadata().map_err(|e| MemoryError::File {
            path: path.clone(),
            op: "stat",
            source: e,
        })?;
        let regular = meta.is_file();
        if !regular && !meta.file_type().is_char_device() && !meta.file_type().is_block_device() {
            return Err(MemoryError::FileNotUsable {
                path: path.clone(),
                reason: "neither a regular file nor a device".into(),
            });
        }
        // A device-dax device maps only whole steps of its alignment, within its size: checked
        // before anything is mapped or written, so a device that cannot hold this L1 (or a
        // character device that is not device-dax) is refused by name and left as it was. The
        // data's check covers the catalog's: the catalog ends before the data, which starts
        // on the alignment.
        let refused = |reason: String| MemoryError::FileNotUsable { path: path.clone(), reason };
        if let Some(dev) = DaxDevice::of(&meta).map_err(|e| refused(e.to_string()))? {
            let mapped =
                dev.check(want.data_offset, data_len).map_err(|e| refused(e.to_string()))?;
            if mapped != data_len {
                return Err(refused(format!(
                    "an L1 of {data_len} bytes is not a whole number of the device's {}-byte \
                     steps; pick an --l1-size-gb that is",
                    dev.align
                )));
            }
        }
        let found = read_superblock(&file, regular, meta.len());
        let fresh = regular && meta.len() == 0;
        let geometry_ok = found == Some(want);
        if found.is_none() && !fresh && !backing.format {
            return Err(MemoryError::FileNotOurs { path: path.clone() });
        }
        if backing.adopt
            && let Some(had) = found
            && had != want
        {
            return Err(MemoryError::FileGeometry {
                path: path.clone(),
                had: had.data_len,
                asked: data_len,
            });
        }
        let total = want.data_offset + data_len;
        if regular && meta.len() < total {
            file.set_len(total).map_err(|e| MemoryError::File {
                path: path.clone(),
                op: "ftruncate",
                source: e,
            })?;
        }
        let len = usize::try_from(data_len)
            .map_err(|_| MemoryError::InvalidSize { size: data_len, reason: "address space" })?;
        let mut region = FileRegion::map(&file, 0, want.catalog_len())?;
        let adopt = backing.adopt && geometry_ok;
        if !adopt {
            // Start empty. The records left by an earlier process (or whatever a formatted
            // file held) are zeroed by the allocator over this arena before it hands out
            // anything (`Catalog::take_records`, then `release`), whether it adopts or not.
            region.write(0, &want.encode()).map_err(|e| MemoryError::File {
                path: path.clone(),
                op: "write the superblock",
                source: std::io::Error::other(e),
            })?;
        }
        let data = MmapOptions::new()
            .offset(want.data_offset)
            .len(len)
            .map_raw(&file)
            .map_err(|e| MemoryError::File { path: path.clone(), op: "mmap", source: e })?;
        let catalog = Catalog {
            region: Mutex::new(region),
            free: Mutex::new((0..want.records as u32).rev().collect()),
            records: want.records,
            generation: AtomicU64::new(1),
        };
        Ok((
            data,
            Self {
                catalog,
                adopt,
                asked_adopt: backing.adopt,
                path: path.clone(),
                data_offset: want.data_offset,
                regular,
                lock: Mutex::new(Some(lock)),
                file,
            },
        ))
    }

    /// Lets the file go (unlocks it) while it stays mapped: for a shutdown that has stopped
    /// every writer and kept the catalog, so that a successor starts adopting while this
    /// process still tears down its mapping (that can take most of a second for GiBs of
    /// 4 KiB pages).
    pub(crate) fn release(&self) {
        drop(self.lock.lock().take());
    }
}

/// The superblock's geometry, if the file starts with ours.
fn read_superblock(file: &File, regular: bool, len: u64) -> Option<Geometry> {
    if regular && len < HEADER_BLOCK {
        return None;
    }
    // Mapped, not read: a DAX character device supports only mmap.
    let region = FileRegion::map(file, 0, HEADER_BLOCK as usize).ok()?;
    let mut b = [0u8; SUPER_LEN];
    region.read(0, &mut b).ok()?;
    Geometry::decode(&b)
}

/// Whether `path` holds an L1 file of ours (a superblock we wrote), for tools and tests.
/// Opened read-write, as the arena maps it, but nothing is written.
pub fn is_l1_file(path: &Path) -> bool {
    let Ok(file) = OpenOptions::new().read(true).write(true).open(path) else { return false };
    let Ok(meta) = file.metadata() else { return false };
    read_superblock(&file, meta.is_file(), meta.len()).is_some()
}

/// The process that holds `path`'s lock (the server using it as its L1), read from
/// `/proc/locks`; `None` when nobody holds it.
pub fn lock_holder(path: &Path) -> Result<Option<u32>, MemoryError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(|e| MemoryError::File {
        path: path.to_owned(),
        op: "stat",
        source: e,
    })?;
    let locks = std::fs::read_to_string("/proc/locks")
        .map_err(|e| MemoryError::os("read /proc/locks", e))?;
    let (major, minor) = (nix::sys::stat::major(meta.dev()), nix::sys::stat::minor(meta.dev()));
    Ok(locks.lines().find_map(|line| holder_of(line, major, minor, meta.ino())))
}

/// The pid of a `/proc/locks` line (`1: FLOCK ADVISORY WRITE 123 fe:00:456 0 EOF`) that locks
/// inode `ino` of device `major:minor`.
fn holder_of(line: &str, major: u64, minor: u64, ino: u64) -> Option<u32> {
    let f: Vec<&str> = line.split_whitespace().collect();
    // A blocked waiter's line starts with "->": it does not hold the lock.
    if f.first().is_some_and(|x| x.starts_with("->")) || f.get(1) != Some(&"FLOCK") {
        return None;
    }
    let pid = f.get(4)?.parse().ok()?;
    let mut id = f.get(5)?.split(':');
    let ma = u64::from_str_radix(id.next()?, 16).ok()?;
    let mi = u64::from_str_radix(id.next()?, 16).ok()?;
    let i: u64 = id.next()?.parse().ok()?;
    (ma == major && mi == minor && i == ino).then_some(pid)
}

/// Waits until nobody holds `path`'s lock (its server let it go), at most `timeout`; false
/// if it is still held then.
pub fn wait_released(path: &Path, timeout: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let free =
            File::open(path).is_ok_and(|f| Flock::lock(f, FlockArg::LockSharedNonblock).is_ok());
        if free {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_round_trips_and_damage_is_not_ours() {
        let g = Geometry::for_size(8 << 30);
        assert_eq!(g.records, 65536);
        assert_eq!(g.data_offset % DATA_ALIGN, 0);
        assert!(g.data_offset >= g.catalog_len() as u64);
        let mut b = g.encode();
        assert_eq!(Geometry::decode(&b), Some(g));
        b[20] ^= 1;
        assert_eq!(Geometry::decode(&b), None);
        assert_eq!(Geometry::for_size(1 << 20).records, MIN_RECORDS);
    }

    #[test]
    fn records_round_trip_and_any_flipped_bit_is_refused() {
        let r = Record {
            index: 7,
            generation: 9,
            offset: 4096,
            len: 100,
            physical: 4096,
            checksum: 0xfeed,
            key: b"model@key".to_vec(),
        };
        let b = r.encode();
        assert_eq!(Record::decode(7, &b), Some(r));
        for bit in [0usize, 33, 8 * 50, 8 * 250] {
            let mut d = b;
            d[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(Record::decode(7, &d), None, "bit {bit}");
        }
        assert_eq!(Record::decode(7, &[0u8; RECORD_LEN]), None);
    }

    #[test]
    fn the_lock_holder_is_found_in_proc_locks() {
        let line = "1: FLOCK  ADVISORY  WRITE 22887 fe:00:10133565 0 EOF";
        assert_eq!(holder_of(line, 0xfe, 0, 10133565), Some(22887));
        assert_eq!(holder_of(line, 0xfe, 0, 10133566), None);
        assert_eq!(
            holder_of("2: POSIX  ADVISORY  WRITE 1 fe:00:10133565 0 EOF", 0xfe, 0, 10133565),
            None
        );
        assert_eq!(
            holder_of("1: -> FLOCK  ADVISORY  WRITE 9 fe:00:10133565 0 EOF", 0xfe, 0, 10133565),
            None
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l1");
        std::fs::write(&path, b"").unwrap();
        assert_eq!(lock_holder(&path).unwrap(), None);
        let held =
            Flock::lock(File::open(&path).unwrap(), FlockArg::LockExclusiveNonblock).unwrap();
        assert_eq!(lock_holder(&path).unwrap(), Some(std::process::id()));
        assert!(!wait_released(&path, std::time::Duration::from_millis(20)));
        drop(held);
        assert!(wait_released(&path, std::time::Duration::from_millis(20)));
    }
}
