//! Core vocabulary of lmcache-rs.
//!
//! # Motivation
//! Every layer (L1, L2, wire protocol, server) speaks about the same things: which chunk of
//! which model's KV cache an object is ([`ObjectKey`]), and how a token sequence maps to chunk
//! hashes ([`TokenHasher`]). They live here, free of IO and `unsafe`, so every crate above can
//! depend on them.
//!
//! # Components
//! - [`key`]: [`ObjectKey`], [`ChunkHash`], [`KvRank`] and their validation.
//! - [`hashing`]: LMCache 0.5.6's BLAKE3 prefix chain, batch and incremental.
//! - [`layout`]: tensor element types as the wire names them, and stored objects' shapes.
//! - [`units`]: byte-size helpers shared by configuration code.
//! - [`le_reader`]: a bounds-checked cursor over little-endian bytes, for the binary formats
//!   above (checkpoint images, the JetStream feed).
//! - [`error`]: why a key part or a hash input was refused.
#![forbid(unsafe_code)]

pub mod error;
pub mod hashing;
pub mod key;
pub mod layout;
pub mod le_reader;
pub mod units;

pub use error::KeyError;
pub use hashing::{DEFAULT_CHUNK_SIZE, NONE_HASH, PrefixHasher, TokenHasher};
pub use key::{CacheSalt, ChunkHash, KvRank, ModelName, ObjectKey};
pub use layout::{Dtype, ObjectLayout, ObjectShape};
