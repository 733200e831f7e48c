//! The L1 arena: one large mapping, committed lazily.
//!
//! Pipeline: pick the backing ([`ArenaBacking`]) → map it (`mmap`, `MAP_NORESERVE` for
//! anonymous memory, a sparse tmpfs file for shared memory, `MAP_HUGETLB` for huge pages) →
//! optionally `mlock`. Nothing is touched at creation, so a 64 GiB arena that holds 1 GiB
//! keeps about 1 GiB resident. When huge pages are asked for but the kernel has none free,
//! the arena falls back to transparent huge pages and says so in [`Arena::kind`], so a
//! silent downgrade is visible to metrics and logs.

use memmap2::{MmapOptions, MmapRaw};

use crate::error::MemoryError;
use crate::file_arena::{FileArena, FileBacking};
use crate::shm::ShmSegment;

/// Size of a huge page (x86-64 and aarch64 default).
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;

/// What memory the arena should use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArenaBacking {
    /// Private anonymous memory: not mappable by another process.
    Anonymous,
    /// A named POSIX shared-memory segment that an engine process can map.
    SharedMemory {
        /// Segment name without the leading `/`.
        name: String,
    },
    /// 2 MiB huge pages (anonymous). Falls back to transparent huge pages.
    HugePages,
    /// A device or file mapped shared (`--l1-devdax-path`: /dev/dax, pmem, tmpfs, any
    /// file), with a catalog of what it holds so that a restarted process can adopt it
    /// ([`crate::file_arena`]).
    File(FileBacking),
}

/// What memory the arena actually got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackingKind {
    /// Private anonymous memory.
    Anonymous,
    /// A named shared-memory segment.
    SharedMemory,
    /// Reserved 2 MiB huge pages (`MAP_HUGETLB`).
    HugePages,
    /// Anonymous memory advised as huge pages (`MADV_HUGEPAGE`): what huge pages fall back to.
    TransparentHugePages,
    /// A device or file (`--l1-devdax-path`).
    DevDax,
}

impl BackingKind {
    /// A short lower-case name for logs and status output.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Anonymous => "anonymous",
            Self::SharedMemory => "shm",
            Self::HugePages => "hugepages",
            Self::TransparentHugePages => "thp",
            Self::DevDax => "devdax",
        }
    }
}

/// How to build an [`Arena`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaConfig {
    /// Size in bytes (rounded up to 2 MiB for huge pages).
    pub size: u64,
    /// The backing memory.
    pub backing: ArenaBacking,
    /// Lock the whole arena in RAM (`mlock`). Commits every page at once: it trades the lazy
    /// commit for never being swapped.
    pub mlock: bool,
}

/// A pool as an engine maps it ([`Arena::engine_segment`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineSegment<'a> {
    /// The POSIX shared-memory name.
    pub name: &'a str,
    /// Offset of the pool's first byte in the segment: add it to a pool offset.
    pub base: u64,
    /// The segment's length.
    pub len: u64,
}

/// One mapped region of memory.
#[derive(Debug)]
pub struct Arena {
    // Field order matters for drop: the mapping goes before the segment is unlinked.
    map: MmapRaw,
    shm: Option<ShmSegment>,
    file: Option<FileArena>,
    kind: BackingKind,
    locked: bool,
}

impl Arena {
    /// Maps a new arena.
    pub fn create(config: &ArenaConfig) -> Result<Self, MemoryError> {
        if config.size == 0 {
            return Err(MemoryError::InvalidSize { size: 0, reason: "zero" });
        }
        let len = usize::try_from(config.size).map_err(|_| MemoryError::InvalidSize {
            size: config.size,
            reason: "larger than the address space",
        })?;
        let mut file = None;
        let (map, shm, kind) = match &config.backing {
            ArenaBacking::Anonymous => (map_anonymous(len)?, None, BackingKind::Anonymous),
            ArenaBacking::File(backing) => {
                let (map, f) = FileArena::open(backing, config.size)?;
                file = Some(f);
                (map, None, BackingKind::DevDax)
            }
            ArenaBacking::SharedMemory { name } => {
                let seg = ShmSegment::create(name, config.size)?;
                let map = MmapOptions::new()
                    .len(len)
                    .map_raw(seg.file())
                    .map_err(|e| MemoryError::os("mmap shared memory", e))?;
                (map, Some(seg), BackingKind::SharedMemory)
            }
            ArenaBacking::HugePages => {
                let rounded = config
                    .size
                    .checked_next_multiple_of(HUGE_PAGE_SIZE)
                    .and_then(|s| usize::try_from(s).ok())
                    .ok_or(MemoryError::InvalidSize { size: config.size, reason: "overflow" })?;
                match MmapOptions::new().len(rounded).huge(Some(21)).map_anon() {
                    Ok(m) => (MmapRaw::from(m), None, BackingKind::HugePages),
                    Err(e) => {
                        tracing::warn!(error = %e, "no free 2 MiB huge pages; using transparent huge pages");
                        let map = map_anonymous(rounded)?;
                        if let Err(e) = map.advise(memmap2::Advice::HugePage) {
                            tracing::warn!(error = %e, "madvise(MADV_HUGEPAGE) failed");
                        }
                        (map, None, BackingKind::TransparentHugePages)
                    }
                }
            }
        };
        let mut arena = Self { map, shm, file, kind, locked: false };
        if config.mlock {
            arena.map.lock().map_err(|e| MemoryError::os("mlock (check RLIMIT_MEMLOCK)", e))?;
            arena.locked = true;
        }
        Ok(arena)
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// True for a zero-length arena (never: creation refuses size 0).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// What backing the arena landed on.
    pub fn kind(&self) -> BackingKind {
        self.kind
    }

    /// `(device, inode)` of the shared-memory segment, for SHM arenas: what a mapping of it
    /// under any name would show (see [`crate::ForeignSegment::file_id`]).
    pub fn shm_file_id(&self) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let meta = self.shm.as_ref()?.file().metadata().ok()?;
        Some((meta.dev(), meta.ino()))
    }

    /// `(device, inode)` of whatever file backs the arena, a shared-memory segment or an L1
    /// file (`--l1-devdax-path`, a warm-restart segment): what a client naming that file as
    /// its own segment would map. `None` for private memory.
    pub fn file_id(&self) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        if self.shm.is_some() {
            return self.shm_file_id();
        }
        let meta = self.file.as_ref()?.file.metadata().ok()?;
        Some((meta.dev(), meta.ino()))
    }

    /// The shared-memory segment name, for SHM arenas.
    pub fn shm_name(&self) -> Option<&str> {
        self.shm.as_ref().map(ShmSegment::name)
    }

    /// Removes the shared-memory segment's name now (see [`ShmSegment::unlink`]); the
    /// mapping stays valid. No-op for other backings.
    pub fn unlink_name(&self) {
        if let Some(s) = &self.shm {
            s.unlink();
        }
    }

    /// True when the arena is `mlock`ed.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Bytes of the arena currently backed by RAM (`Rss` of the mapping in
    /// `/proc/self/smaps`; for shared memory, the blocks of the segment).
    pub fn resident_bytes(&self) -> Result<u64, MemoryError> {
        if let Some(seg) = &self.shm {
            return seg.committed_bytes();
        }
        let start = self.map.as_ptr() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps")
            .map_err(|e| MemoryError::os("read /proc/self/smaps", e))?;
        Ok(rss_of_mapping(&smaps, start).unwrap_or(0))
    }

    /// Commits and maps the pages of `[offset, offset + len)` in one system call
    /// (`MADV_POPULATE_WRITE`), instead of one page fault per 4 KiB page on first write. A
    /// best-effort hint: kernels before 5.14 refuse it and the pages fault in as usual.
    pub fn prefault(&self, offset: u64, len: u64) {
        self.populate(offset, len, memmap2::Advice::PopulateWrite);
    }

    /// Maps the pages of `[offset, offset + len)` for reading in one system call
    /// (`MADV_POPULATE_READ`): a file arena's pages are in the page cache (or on the device)
    /// but not in this process's page tables, as when a restart verifies them. Best effort.
    pub fn populate_read(&self, offset: u64, len: u64) {
        self.populate(offset, len, memmap2::Advice::PopulateRead);
    }

    /// `advice` over the whole pages of `[offset, offset + len)` within the arena.
    fn populate(&self, offset: u64, len: u64, advice: memmap2::Advice) {
        let page = 4096u64;
        let start = offset - offset % page;
        let Some(end) = offset.checked_add(len).and_then(|e| e.checked_next_multiple_of(page))
        else {
            return;
        };
        let end = end.min(self.len());
        if start >= end {
            return;
        }
        if let Err(e) = self.map.advise_range(advice, start as usize, (end - start) as usize) {
            tracing::debug!(error = %e, ?advice, "page population refused; pages fault in on use");
        }
    }

    /// Allocates file-system space behind `[offset, offset + len)` of a shared-memory arena
    /// (`fallocate`), so that touching it later cannot fault with SIGBUS when /dev/shm fills
    /// up: a full file system is an error here instead. No-op for private memory (which the
    /// kernel backs on touch, or the OOM killer reclaims).
    pub fn reserve(&self, offset: u64, len: u64) -> Result<(), MemoryError> {
        let (fd, base) = match (&self.shm, &self.file) {
            (Some(seg), _) => (std::os::fd::AsRawFd::as_raw_fd(seg.file()), 0),
            (None, Some(f)) if f.regular => {
                (std::os::fd::AsRawFd::as_raw_fd(&f.file), f.data_offset)
            }
            _ => return Ok(()),
        };
        let bad = MemoryError::InvalidSize { size: len, reason: "range outside the arena" };
        let end = offset.checked_add(len).ok_or(bad)?;
        if end > self.len() {
            return Err(MemoryError::InvalidSize { size: len, reason: "range outside the arena" });
        }
        let (off, n) = (
            i64::try_from(offset + base)
                .map_err(|_| MemoryError::InvalidSize { size: offset, reason: "offset" })?,
            i64::try_from(len)
                .map_err(|_| MemoryError::InvalidSize { size: len, reason: "length" })?,
        );
        nix::fcntl::fallocate(fd, nix::fcntl::FallocateFlags::empty(), off, n)
            .map_err(|e| MemoryError::os("fallocate (backing the L1 pool)", e))
    }

    /// True when the arena's pages need [`Self::reserve`] before use (shared memory, a
    /// regular L1 file).
    pub fn needs_reserve(&self) -> bool {
        self.shm.is_some() || self.file.as_ref().is_some_and(|f| f.regular)
    }

    /// The L1 file, for file arenas (`--l1-devdax-path`).
    pub fn file_path(&self) -> Option<&std::path::Path> {
        self.file.as_ref().map(|f| f.path.as_path())
    }

    /// How an engine maps this pool by POSIX shared-memory name: the segment's name, where
    /// the pool's first byte sits in it, and the segment's length. A shared-memory arena is
    /// its own segment (offset 0); a file arena whose file is a segment (directly in
    /// `/dev/shm`: a warm-restart L1 named by `--shm-name`) starts its pool after its
    /// superblock and catalog. `None` for memory no other process can map by name.
    pub fn engine_segment(&self) -> Option<EngineSegment<'_>> {
        if let Some(name) = self.shm_name() {
            return Some(EngineSegment { name, base: 0, len: self.len() });
        }
        let f = self.file.as_ref()?;
        let name = f.path.file_name()?.to_str()?;
        let in_shm = f.path.parent() == Some(std::path::Path::new(crate::shm::SHM_DIR));
        (f.regular && in_shm && crate::shm::validate_name(name).is_ok()).then_some(EngineSegment {
            name,
            base: f.data_offset,
            len: f.data_offset + self.len(),
        })
    }

    /// The file arena's catalog and whether it asked to adopt, for file arenas.
    pub(crate) fn file(&self) -> Option<&FileArena> {
        self.file.as_ref()
    }

    /// The mapping's address, as a number (to register the arena with a transfer engine
    /// such as NIXL, which a peer then reads by offset). Valid for `len()` bytes while `self`
    /// lives.
    pub fn base_address(&self) -> usize {
        self.map.as_ptr() as usize
    }

    /// Base address of the mapping. Valid for `len()` bytes while `self` lives.
    pub(crate) fn base_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
}

fn map_anonymous(len: usize) -> Result<MmapRaw, MemoryError> {
    MmapOptions::new()
        .len(len)
        .no_reserve_swap()
        .map_anon()
        .map(MmapRaw::from)
        .map_err(|e| MemoryError::os("mmap anonymous", e))
}

/// Finds the mapping that starts at `start` in smaps text and returns its Rss in bytes.
fn rss_of_mapping(smaps: &str, start: usize) -> Option<u64> {
    let header = format!("{start:x}-");
    let mut in_mapping = false;
    let mut rss = 0u64;
    for line in smaps.lines() {
        if line.starts_with(|c: char| c.is_ascii_hexdigit()) && line.contains('-') {
            if in_mapping {
                return Some(rss);
            }
            in_mapping = line.starts_with(&header);
        } else if in_mapping {
            let field = |name: &str| {
                line.strip_prefix(name)
                    .and_then(|v| v.trim().strip_suffix("kB"))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            };
            if let Some(kb) = field("Rss:") {
                rss += kb * 1024;
            }
            // Reserved huge pages are not counted in Rss.
            if let Some(kb) = field("Private_Hugetlb:").or_else(|| field("Shared_Hugetlb:")) {
                rss += kb * 1024;
            }
        }
    }
    in_mapping.then_some(rss)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::SHM_DIR;

    #[test]
    fn an_engine_maps_shm_pools_and_l1_files_that_are_segments_by_name() {
        let size = 8 << 20;
        let name = format!("lmcache_rs_test_engseg_{}", std::process::id());
        let shm = Arena::create(&ArenaConfig {
            size,
            backing: ArenaBacking::SharedMemory { name: name.clone() },
            mlock: false,
        })
        .unwrap();
        assert_eq!(shm.engine_segment(), Some(EngineSegment { name: &name, base: 0, len: size }));
        drop(shm);
        // An L1 file directly in /dev/shm is a segment: its pool starts after the catalog.
        let path = std::path::Path::new(SHM_DIR).join(&name);
        let file = |path: &std::path::Path| ArenaConfig {
            size,
            backing: ArenaBacking::File(FileBacking {
                path: path.to_path_buf(),
                format: false,
                adopt: true,
            }),
            mlock: false,
        };
        let a = Arena::create(&file(&path)).unwrap();
        let seg = a.engine_segment().unwrap();
        assert_eq!(seg.name, name);
        assert!(seg.base > 0 && seg.base % (2 << 20) == 0, "{seg:?}");
        assert_eq!(seg.len, seg.base + size);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), seg.len);
        drop(a);
        std::fs::remove_file(&path).unwrap();
        // Elsewhere it is not one.
        let dir = tempfile::tempdir().unwrap();
        let a = Arena::create(&file(&dir.path().join("l1"))).unwrap();
        assert_eq!(a.engine_segment(), None);
    }

    #[test]
    fn zero_size_is_refused() {
        let cfg = ArenaConfig { size: 0, backing: ArenaBacking::Anonymous, mlock: false };
        assert!(matches!(Arena::create(&cfg), Err(MemoryError::InvalidSize { .. })));
    }

    #[test]
    fn anonymous_arena_is_lazily_committed() {
        // 64 GiB of address space on a 24 GiB machine: only possible because nothing is
        // committed up front.
        let cfg = ArenaConfig { size: 64 << 30, backing: ArenaBacking::Anonymous, mlock: false };
        let arena = Arena::create(&cfg).unwrap();
        assert_eq!(arena.kind(), BackingKind::Anonymous);
        assert!(arena.resident_bytes().unwrap() < 4 << 20);
    }

    #[test]
    fn shm_arena_unlinks_on_drop() {
        let name = format!("lmcache_rs_test_arena_{}", std::process::id());
        let cfg = ArenaConfig {
            size: 8 << 20,
            backing: ArenaBacking::SharedMemory { name: name.clone() },
            mlock: false,
        };
        let arena = Arena::create(&cfg).unwrap();
        assert_eq!(arena.shm_name(), Some(name.as_str()));
        assert_eq!(arena.resident_bytes().unwrap(), 0);
        drop(arena);
        assert!(!std::path::Path::new(SHM_DIR).join(&name).exists());
    }

    #[test]
    fn hugepages_fall_back_visibly() {
        let cfg = ArenaConfig { size: 3 << 20, backing: ArenaBacking::HugePages, mlock: false };
        let arena = Arena::create(&cfg).unwrap();
        assert!(matches!(arena.kind(), BackingKind::HugePages | BackingKind::TransparentHugePages));
        assert_eq!(arena.len(), 4 << 20, "rounded up to whole huge pages");
    }

    #[test]
    fn smaps_parser_sums_the_right_mapping() {
        let smaps = "7f00-7f10 rw-p 0 0 0\nRss:   8 kB\n1000-2000 rw-p 0 0 0\nRss:  12 kB\n\
                     Private_Hugetlb:   2048 kB\n3000-4000 r--p\nRss: 4 kB\n";
        assert_eq!(rss_of_mapping(smaps, 0x1000), Some(12 * 1024 + 2048 * 1024));
        assert_eq!(rss_of_mapping(smaps, 0x3000), Some(4096));
        assert_eq!(rss_of_mapping(smaps, 0x5000), None);
    }
}
