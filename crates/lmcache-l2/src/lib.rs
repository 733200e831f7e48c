//! The L2 tier of lmcache-rs: storage below L1.
//!
//! - [`adapter`]: the async, batched [`L2Adapter`] trait every backend implements.
//! - [`blob`]: the self-checking format of stored objects (magic, version, codec, the full key,
//!   lengths, xxh3 checksums); a blob that fails any check is a miss.
//! - [`codec`]: none, lz4, zstd, AES-256-GCM (per-salt keys, key as associated data), fp8.
//! - [`adapters`]: `fs`, `raw_block`, `gds_slab` (the slab file of a CPU GDS L1, a raw_block
//!   device formatted at its first store), `redis` (Redis/Valkey, single node or cluster),
//!   `s3`, `dax` (LMCache's: slots in a mapped device or file, a volatile index),
//!   `native_plugin` (a shared library through our C ABI), `mock` and `fault_inject`, one file
//!   each.
//! - `plugin_ffi`: the native plugin ABI (`include/lmcache_rs_l2_plugin.h`): loading, the
//!   version handshake, the calls; the crate's only unsafe code.
//! - [`config`]: LMCache's `--l2-adapter` JSON (and TOML) to built adapters, field by field.
//! - [`wire_key`]: LMCache's string form of an object key.
//! - [`error`]: [`L2Error`] (transient or permanent, so the store controller knows whether to
//!   retry) and [`ConfigError`].
#![deny(unsafe_code)]

pub mod adapter;
pub mod adapters;
pub mod blob;
pub mod codec;
pub mod config;
pub mod error;
#[expect(unsafe_code, reason = "the native plugin ABI: dlopen and calls through its table")]
mod plugin_ffi;
pub mod wire_key;

pub use adapter::{
    DirectHeader, DirectItem, DirectResult, FLOOR_BANDWIDTH, KeyFilter, KeyPage, L2Adapter,
    PayloadSink, Stored, time_budget,
};
pub use blob::{Blob, BlobError};
pub use codec::Codec;
pub use config::BuiltAdapter;
pub use error::{ConfigError, L2Error};
