//! Named POSIX shared-memory segments and the cleanup of stale ones.
//!
//! A segment is owned by the [`ShmSegment`] guard that created it: the guard holds an
//! exclusive `flock` on the segment for its whole life and unlinks the name when dropped.
//! The lock is what tells a live owner from a crashed one: a segment whose lock can be taken
//! belongs to nobody and is stale. Stale segments of earlier runs are unlinked at start
//! ([`clean_stale_segments`]), so a crash never leaks /dev/shm space across restarts.
//!
//! Only segments lmcache-rs created are ever unlinked. Creating one also creates its
//! *ownership marker*, an empty file `.lmcache-rs-owned.<name>` beside it, removed with it.
//! A segment without a marker (LMCache's own `lmcache_l1_pool_<pid>` of a live server in
//! another PID namespace, which no pid check can see, or anything else) is never replaced or
//! removed, whatever its name, pid or lock say.

use std::fs::File;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg, OFlag};
use nix::sys::stat::Mode;

use crate::error::MemoryError;

/// Prefix of LMCache's default L1 segment names: `lmcache_l1_pool_<pid>`.
pub const DEFAULT_SHM_PREFIX: &str = "lmcache_l1_pool_";

/// Where Linux mounts POSIX shared memory.
pub const SHM_DIR: &str = "/dev/shm";

/// The default segment name of this process, as LMCache names it.
pub fn default_shm_name() -> String {
    format!("{DEFAULT_SHM_PREFIX}{}", std::process::id())
}

/// Prefix of the ownership marker of each segment lmcache-rs created.
pub const OWNER_MARKER_PREFIX: &str = ".lmcache-rs-owned.";

/// The marker's path of segment `name`.
fn marker_path(dir: &Path, name: &str) -> std::path::PathBuf {
    dir.join(format!("{OWNER_MARKER_PREFIX}{name}"))
}

/// Whether segment `name` was created by lmcache-rs (its ownership marker is there).
pub fn is_ours(name: &str) -> bool {
    validate_name(name).is_ok() && marker_path(Path::new(SHM_DIR), name).exists()
}

/// Checks a segment name: non-empty, at most 255 bytes, no `/` and no NUL.
pub fn validate_name(name: &str) -> Result<(), MemoryError> {
    let bad = |reason| Err(MemoryError::InvalidShmName { name: name.to_owned(), reason });
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > 255 {
        return bad("longer than 255 bytes");
    }
    if name.contains('/') || name.contains('\0') {
        return bad("contains '/' or NUL");
    }
    if name == "." || name == ".." {
        return bad("is a directory name");
    }
    Ok(())
}

/// An owned, locked, named shared-memory segment. Unlinked on drop.
#[derive(Debug)]
pub struct ShmSegment {
    name: String,
    /// Holds the exclusive lock that marks the segment as owned by a live process.
    file: Flock<File>,
    len: u64,
    /// Set once the name is unlinked, so that it is never unlinked twice (a second unlink
    /// could remove a new segment another process created under the same name).
    unlinked: std::sync::atomic::AtomicBool,
}

impl ShmSegment {
    /// Creates segment `name` of `len` bytes (sparse: pages are committed on first touch).
    ///
    /// A leftover segment of the same name whose owner is gone is replaced; one whose owner
    /// is alive is refused with [`MemoryError::ShmInUse`]. The segment must fit the free
    /// space of /dev/shm, since a write past that space would raise SIGBUS.
    pub fn create(name: &str, len: u64) -> Result<Self, MemoryError> {
        validate_name(name)?;
        if name.len() + OWNER_MARKER_PREFIX.len() > 255 {
            return Err(MemoryError::InvalidShmName {
                name: name.to_owned(),
                reason: "longer than 237 bytes (its ownership marker would not fit)",
            });
        }
        if len == 0 {
            return Err(MemoryError::InvalidSize { size: len, reason: "zero" });
        }
        let path = format!("/{name}");
        let fd = match open(&path, true) {
            Ok(fd) => fd,
            Err(Errno::EEXIST) => {
                // Someone left a segment of this name. Take it over only if we created it
                // (its marker says so) and its owner is gone (its lock is free).
                if !marker_path(Path::new(SHM_DIR), name).exists() {
                    return Err(MemoryError::ShmNotOurs { name: name.to_owned() });
                }
                let existing = open(&path, false).map_err(|e| MemoryError::os("shm_open", e))?;
                match Flock::lock(File::from(existing), FlockArg::LockExclusiveNonblock) {
                    Ok(stale) => {
                        tracing::warn!(segment = name, "replacing stale shared-memory segment");
                        nix::sys::mman::shm_unlink(path.as_str())
                            .map_err(|e| MemoryError::os("shm_unlink", e))?;
                        drop(stale);
                        open(&path, true).map_err(|e| MemoryError::os("shm_open", e))?
                    }
                    Err((_, _)) => {
                        return Err(MemoryError::ShmInUse { name: name.to_owned() });
                    }
                }
            }
            Err(e) => return Err(MemoryError::os("shm_open", e)),
        };
        let file = match Flock::lock(File::from(fd), FlockArg::LockExclusiveNonblock) {
            Ok(f) => f,
            Err((_, e)) => {
                let _ = nix::sys::mman::shm_unlink(path.as_str());
                return Err(MemoryError::os("flock", e));
            }
        };
        // The marker says the name is ours before anything else can fail.
        std::fs::File::create(marker_path(Path::new(SHM_DIR), name))
            .map_err(|e| MemoryError::os("creating the ownership marker", e))?;
        // From here on the guard exists, so any failure unlinks the name on drop.
        let segment = Self {
            name: name.to_owned(),
            file,
            len,
            unlinked: std::sync::atomic::AtomicBool::new(false),
        };
        let available = shm_free_bytes()?;
        if len > available {
            return Err(MemoryError::ShmTooSmall { size: len, available });
        }
        segment.file.set_len(len).map_err(|e| MemoryError::os("ftruncate", e))?;
        Ok(segment)
    }

    /// The segment's name, without the leading `/`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The open segment.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when the length is zero (never, for a created segment).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the segment actually backed by memory (tmpfs allocates on first touch).
    pub fn committed_bytes(&self) -> Result<u64, MemoryError> {
        use std::os::unix::fs::MetadataExt;
        let meta = self.file.metadata().map_err(|e| MemoryError::os("fstat", e))?;
        Ok(meta.blocks() * 512)
    }
}

impl ShmSegment {
    /// Removes the segment's name now (the memory stays mapped until the mapping goes), once:
    /// a shutdown calls this so that the name never outlives the server, even if some handle
    /// to the memory is still alive when the process exits.
    pub fn unlink(&self) {
        if self.unlinked.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        let path = format!("/{}", self.name);
        if let Err(e) = nix::sys::mman::shm_unlink(path.as_str()) {
            tracing::warn!(segment = %self.name, error = %e, "could not unlink shared memory");
        }
        let _ = std::fs::remove_file(marker_path(Path::new(SHM_DIR), &self.name));
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        self.unlink();
    }
}

fn open(path: &str, create: bool) -> Result<std::os::fd::OwnedFd, Errno> {
    let flags = if create { OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL } else { OFlag::O_RDWR };
    nix::sys::mman::shm_open(path, flags, Mode::S_IRUSR | Mode::S_IWUSR)
}

fn shm_free_bytes() -> Result<u64, MemoryError> {
    let st = nix::sys::statvfs::statvfs(SHM_DIR).map_err(|e| MemoryError::os("statvfs", e))?;
    Ok(st.blocks_available().saturating_mul(st.fragment_size()))
}

/// Unlinks the segments in `dir` that lmcache-rs created (each has its ownership marker)
/// and whose owner is gone (nobody holds its lock), with their markers; a marker whose
/// segment is gone goes too. Segments without a marker are never touched, whatever their
/// name. Returns the names removed. Errors on single entries are logged and skipped:
/// cleanup never stops a start.
pub fn clean_stale_segments(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let marker = entry.file_name();
        let Some(name) = marker.to_str().and_then(|m| m.strip_prefix(OWNER_MARKER_PREFIX)) else {
            continue;
        };
        if validate_name(name).is_err() {
            continue;
        }
        let path = dir.join(name);
        let file = match File::options().read(true).write(true).open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let _ = std::fs::remove_file(entry.path());
                continue;
            }
            Err(_) => continue,
        };
        if let Ok(lock) = Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    let _ = std::fs::remove_file(entry.path());
                    tracing::info!(segment = name, "removed stale shared-memory segment");
                    removed.push(name.to_owned());
                }
                Err(e) => {
                    tracing::warn!(segment = name, error = %e, "could not remove stale segment")
                }
            }
            drop(lock);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unique(tag: &str) -> String {
        format!("lmcache_rs_test_{tag}_{}", std::process::id())
    }

    #[test]
    fn create_is_sparse_and_unlinks_on_drop() {
        let name = unique("sparse");
        let seg = ShmSegment::create(&name, 1 << 30).unwrap();
        assert_eq!(seg.len(), 1 << 30);
        assert!(seg.committed_bytes().unwrap() < 1 << 20, "segment committed eagerly");
        assert!(Path::new(SHM_DIR).join(&name).exists());
        drop(seg);
        assert!(!Path::new(SHM_DIR).join(&name).exists());
    }

    #[test]
    fn unlink_removes_the_name_once_and_drop_spares_a_successor() {
        let name = unique("unlink");
        let seg = ShmSegment::create(&name, 4096).unwrap();
        seg.unlink();
        assert!(!Path::new(SHM_DIR).join(&name).exists(), "unlink left the name");
        // A new server takes the name while the old handle lives; its drop spares the name.
        let next = ShmSegment::create(&name, 4096).unwrap();
        drop(seg);
        assert!(Path::new(SHM_DIR).join(&name).exists(), "the old handle unlinked its successor");
        drop(next);
        assert!(!Path::new(SHM_DIR).join(&name).exists());
    }

    #[test]
    fn live_segment_is_refused_and_stale_one_replaced() {
        let name = unique("inuse");
        let seg = ShmSegment::create(&name, 4096).unwrap();
        assert!(matches!(ShmSegment::create(&name, 4096), Err(MemoryError::ShmInUse { .. })));
        drop(seg);
        assert!(!marker_path(Path::new(SHM_DIR), &name).exists(), "drop left the marker");
        // A crashed owner leaves the name and its marker behind, nobody holding its lock.
        let path = Path::new(SHM_DIR).join(&name);
        std::fs::write(&path, b"stale").unwrap();
        std::fs::write(marker_path(Path::new(SHM_DIR), &name), b"").unwrap();
        let seg = ShmSegment::create(&name, 8192).unwrap();
        assert_eq!(seg.file().metadata().unwrap().len(), 8192);
    }

    #[test]
    fn a_segment_we_did_not_create_is_never_replaced() {
        // LMCache's server (no lock, no marker) holds this name: even with nobody holding a
        // lock on it, it is not ours to replace.
        let name = unique("theirs");
        let path = Path::new(SHM_DIR).join(&name);
        std::fs::write(&path, b"their KV").unwrap();
        let err = ShmSegment::create(&name, 4096).unwrap_err();
        assert!(matches!(err, MemoryError::ShmNotOurs { .. }), "{err}");
        assert!(err.to_string().contains("not created by lmcache-rs"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"their KV");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn names_are_validated() {
        for bad in ["", "a/b", "a\0b", ".", ".."] {
            assert!(matches!(validate_name(bad), Err(MemoryError::InvalidShmName { .. })));
        }
        assert!(validate_name(&"x".repeat(256)).is_err());
        assert!(validate_name("lmcache_l1_pool_1").is_ok());
    }

    #[test]
    fn oversized_segment_is_refused_not_sigbus() {
        let name = unique("huge");
        let err = ShmSegment::create(&name, 1 << 60).unwrap_err();
        assert!(matches!(err, MemoryError::ShmTooSmall { .. }), "{err}");
        assert!(!Path::new(SHM_DIR).join(&name).exists(), "failed create left the name");
    }

    #[test]
    fn stale_cleanup_removes_only_our_unlocked_segments() {
        let dir = std::env::temp_dir().join(format!("lmcache_rs_stale_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // LMCache-named segments of pids this process cannot see (another PID namespace's
        // live server looks exactly like this): without our marker, never touched.
        let theirs = dir.join(format!("{DEFAULT_SHM_PREFIX}{}", 999_999_999));
        let unrelated = dir.join("unrelated_segment");
        // Ours, crashed: marker present, nobody holds the lock.
        let ours_dead = dir.join(format!("{DEFAULT_SHM_PREFIX}{}", 999_999_998));
        // Ours, alive: its lock is held.
        let ours_live = dir.join("lmcache_rs_live");
        for p in [&theirs, &unrelated, &ours_dead, &ours_live] {
            std::fs::write(p, b"x").unwrap();
        }
        for n in [format!("{DEFAULT_SHM_PREFIX}999999998"), "lmcache_rs_live".into(), "gone".into()]
        {
            std::fs::write(marker_path(&dir, &n), b"").unwrap();
        }
        let held = Flock::lock(
            File::options().read(true).write(true).open(&ours_live).unwrap(),
            FlockArg::LockExclusiveNonblock,
        )
        .unwrap();
        let removed = clean_stale_segments(&dir);
        assert_eq!(removed, vec![format!("{DEFAULT_SHM_PREFIX}999999998")]);
        assert!(!ours_dead.exists() && !marker_path(&dir, &removed[0]).exists());
        assert!(theirs.exists(), "removed a segment we did not create");
        assert!(unrelated.exists());
        assert!(ours_live.exists() && marker_path(&dir, "lmcache_rs_live").exists());
        assert!(!marker_path(&dir, "gone").exists(), "a marker without its segment stayed");
        drop(held);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
