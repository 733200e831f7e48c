//! Per-key results of L1 operations, and configuration errors.

use lmcache_core::CacheSalt;
use lmcache_memory::MemoryError;
use thiserror::Error;

/// LMCache's per-key status codes, to which every [`L1Error`] maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum L1Status {
    /// Success.
    Ok,
    /// No resident object under the key.
    NotFound,
    /// The object exists but cannot be read (not locked for reading).
    NotReadable,
    /// The key is resident or being written.
    NotWritable,
    /// The operation does not fit the object's state.
    WrongState,
    /// The object is locked.
    Locked,
    /// No memory (or no quota) for the object.
    OutOfMemory,
}

/// Why an operation on one key failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum L1Error {
    /// No resident object under the key (a staged object is invisible too).
    #[error("key not found")]
    NotFound,
    /// The object exists but is not readable now.
    #[error("key not readable")]
    NotReadable,
    /// The key is already resident or being written by another writer.
    #[error("key not writable: resident or being written")]
    NotWritable,
    /// The object was deleted (forced) while reserved, or is not in the state the operation
    /// needs.
    #[error("key in wrong state for this operation")]
    WrongState,
    /// The object is read-locked or reserved; a non-forced delete refuses it.
    #[error("key is locked")]
    Locked,
    /// No memory even after evicting every unlocked object that could go.
    #[error("out of memory: {requested} bytes requested, {free} free after eviction")]
    OutOfMemory {
        /// Aligned bytes the batch needed.
        requested: u64,
        /// Free bytes left.
        free: u64,
    },
    /// The tenant's quota cannot fit the object, even after evicting its unlocked objects.
    #[error(
        "quota of cache_salt {cache_salt:?} exceeded: {used} of {limit} bytes used, {requested} requested"
    )]
    QuotaExceeded {
        /// The tenant.
        cache_salt: CacheSalt,
        /// Its limit.
        limit: u64,
        /// Its usage.
        used: u64,
        /// What the batch wanted for it.
        requested: u64,
    },
    /// An object larger than the whole L1, or of zero bytes.
    #[error("object size {size} is invalid for an L1 of {capacity} bytes")]
    InvalidSize {
        /// The requested size.
        size: u64,
        /// The L1 capacity.
        capacity: u64,
    },
    /// A read-lock count outside `1..=max`.
    #[error("read-lock count {count} is outside 1..={max}")]
    InvalidLockCount {
        /// The requested count.
        count: u32,
        /// The configured maximum.
        max: u32,
    },
}

impl L1Error {
    /// The LMCache status code this error is reported as.
    pub fn status(&self) -> L1Status {
        match self {
            Self::NotFound => L1Status::NotFound,
            Self::NotReadable => L1Status::NotReadable,
            Self::NotWritable => L1Status::NotWritable,
            Self::WrongState | Self::InvalidLockCount { .. } => L1Status::WrongState,
            Self::Locked => L1Status::Locked,
            Self::OutOfMemory { .. } | Self::QuotaExceeded { .. } | Self::InvalidSize { .. } => {
                L1Status::OutOfMemory
            }
        }
    }
}

/// Why an L1 could not be built.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum L1ConfigError {
    /// A fraction outside its range.
    #[error("{name} must be in (0, 1], got {value}")]
    Fraction {
        /// The setting.
        name: &'static str,
        /// The refused value.
        value: f64,
    },
    /// A zero duration or count where one is needed.
    #[error("{name} must be greater than zero")]
    Zero {
        /// The setting.
        name: &'static str,
    },
    /// The list of L1s is not one lmcache-rs can run.
    #[error("L1 list refused: {reason}")]
    Members {
        /// What is wrong with it.
        reason: String,
    },
    /// The arena could not be created.
    #[error(transparent)]
    Memory(#[from] MemoryError),
}
