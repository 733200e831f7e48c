//! Typed errors of the core vocabulary.

use thiserror::Error;

/// Why an [`crate::ObjectKey`] (or one of its parts) was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum KeyError {
    /// `model_name` contains `@`, the field separator of every L2 key encoding.
    #[error("model_name {model_name:?} must not contain '@'")]
    ModelNameContainsAt {
        /// The refused name.
        model_name: String,
    },
    /// `model_name` is empty.
    #[error("model_name must not be empty")]
    EmptyModelName,
    /// `cache_salt` is longer than [`crate::key::MAX_CACHE_SALT_LEN`] characters.
    #[error("cache_salt is {len} characters long, at most {max} are allowed")]
    CacheSaltTooLong {
        /// Its length in characters.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// `cache_salt` contains one of `@`, `/`, `\` or NUL.
    #[error("cache_salt {cache_salt:?} contains the forbidden character {ch:?}")]
    CacheSaltForbiddenChar {
        /// The refused salt.
        cache_salt: String,
        /// The first forbidden character found.
        ch: char,
    },
    /// `world_size` is 0 or does not fit one byte.
    #[error("world_size {world_size} is out of range 1..=255")]
    WorldSizeOutOfRange {
        /// The refused value.
        world_size: u32,
    },
    /// `worker_id` is not below `world_size`.
    #[error("worker_id {worker_id} is out of range for world_size {world_size}")]
    WorkerIdOutOfRange {
        /// The refused value.
        worker_id: u32,
        /// The world size it was checked against.
        world_size: u32,
    },
    /// A chunk hash of the wrong length was given.
    #[error("chunk hash must be {expected} bytes, got {got}")]
    ChunkHashLength {
        /// 32.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A chunk size of zero was given to the hasher.
    #[error("chunk size must be at least 1 token")]
    ZeroChunkSize,
    /// A token id outside `[0, 2^32)`.
    #[error("token {token} at position {position} is outside [0, 2^32)")]
    TokenOutOfRange {
        /// The refused token.
        token: i64,
        /// Its index in the sequence.
        position: usize,
    },
}
