//! CacheBlend for lmcache-rs: reusing the KV of chunks that are not a prefix of the prompt.
//!
//! # Modules
//! - `index`: [`BlendIndex`], the chunk-fingerprint index: every stored chunk found anywhere
//!   in a query, each match verified token by token, per blend namespace. The coordinator's
//!   directory keeps one for the fleet.
#![forbid(unsafe_code)]

mod index;

pub use index::{
    BlendConfig, BlendIndex, BlendMatch, BlendNs, BlendStats, MAX_CONTENTS_PER_FINGERPRINT,
};
