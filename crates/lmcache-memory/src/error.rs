//! Errors of arena creation.

use thiserror::Error;

/// Why an arena could not be created.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// The requested size is zero or not representable on this platform.
    #[error("arena size {size} bytes is invalid: {reason}")]
    InvalidSize {
        /// The requested size.
        size: u64,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The alignment is not a power of two of at least 64 bytes.
    #[error("alignment {align} must be a power of two and at least 64")]
    InvalidAlign {
        /// The refused alignment.
        align: u64,
    },
    /// The shared-memory name is unusable.
    #[error("shared-memory name {name:?} is invalid: {reason}")]
    InvalidShmName {
        /// The refused name.
        name: String,
        /// Why.
        reason: &'static str,
    },
    /// A live process holds the named segment.
    #[error("shared-memory segment {name:?} is in use by another live process")]
    ShmInUse {
        /// The segment's name.
        name: String,
    },
    /// A segment of that name exists and lmcache-rs did not create it (no ownership marker):
    /// it may belong to LMCache's server or anything else, so it is left alone.
    #[error(
        "shared-memory segment {name:?} already exists and was not created by lmcache-rs; \
         it is left alone: pick another --shm-name, or remove it yourself if it is stale"
    )]
    ShmNotOurs {
        /// The segment's name.
        name: String,
    },
    /// /dev/shm has less room than the arena would need once full; writes past it would
    /// kill the process with SIGBUS, so the arena is refused up front.
    #[error(
        "shared-memory arena of {size} bytes does not fit /dev/shm ({available} bytes free); \
         lower --l1-size-gb or enlarge /dev/shm"
    )]
    ShmTooSmall {
        /// The requested size.
        size: u64,
        /// Free bytes on the shared-memory file system.
        available: u64,
    },
    /// An L1 file (`--l1-devdax-path`) could not be opened, sized or mapped.
    #[error("L1 file {path}: {op} failed: {source}")]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Another process holds the L1 file (its `flock`).
    #[error("L1 file {path} is in use by another process")]
    FileInUse {
        /// The file.
        path: std::path::PathBuf,
    },
    /// The L1 file holds something that is not an lmcache-rs L1: left as it is.
    #[error(
        "L1 file {path} holds data that is not an lmcache-rs L1; it is left alone \
         (pass --l1-devdax-format to format it, losing what it holds)"
    )]
    FileNotOurs {
        /// The file.
        path: std::path::PathBuf,
    },
    /// The path is not something an L1 can live in.
    #[error("L1 file {path}: {reason}")]
    FileNotUsable {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        reason: String,
    },
    /// A warm restart found the L1 file laid out for another size.
    #[error(
        "L1 file {path} was formatted for {had} bytes of L1, not the {asked} asked for: pass \
         the same --l1-size-gb to restart warm, or start without --l1-warm-restart to \
         reformat it (what it holds is dropped)"
    )]
    FileGeometry {
        /// The file.
        path: std::path::PathBuf,
        /// Its L1 size.
        had: u64,
        /// The size asked for.
        asked: u64,
    },
    /// A character device that is not device-dax, or a mapping of one that the kernel would
    /// refuse (off its alignment) or that would run past its end.
    #[error("device-dax: {reason}")]
    DaxDevice {
        /// Why.
        reason: String,
    },
    /// A system call failed.
    #[error("{op} failed: {source}")]
    Os {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl MemoryError {
    pub(crate) fn os(op: &'static str, source: impl Into<std::io::Error>) -> Self {
        Self::Os { op, source: source.into() }
    }
}
