//! The L1 tier of lmcache-rs: KV objects in CPU memory.
//!
//! # Motivation
//! The engine stores each chunk's KV as one object under an [`ObjectKey`](lmcache_core::ObjectKey),
//! and later loads it back. L1 keeps those objects in one arena (shared memory, so the engine
//! can map it), decides who may read or write what and when, and evicts when full. It fixes
//! LMCache's weak points: allocation evicts synchronously instead of failing until a 1 s loop
//! runs; locks are RAII handles, so a slow reader's memory is never freed under it; eviction
//! is measured in bytes; the same-size case allocates in O(1).
//!
//! # Components
//! - `set`: [`L1Cache`], the tier: one or more tagged [`L1Member`]s in write order (LMCache's
//!   repeated `--l1-manager`), writes overflowing from one to the next when it is full.
//! - `cache`: [`L1Member`], one L1's index and lifecycle (reserve → commit/discard, read locks,
//!   delete, clear; a second writer's shadow reservation of a staged key), eviction on
//!   allocation and by watermark, quotas, parked leases.
//! - `handles`: [`WriteReservation`] and [`ReadLease`], the RAII handles; `entry`: an index
//!   entry and where it is in its life.
//! - [`config`]: [`L1Config`] and its checks; [`error`]: [`L1Error`] and its wire status.
//! - [`eviction`]: the [`EvictionPolicy`](eviction::EvictionPolicy) trait and LRU, ARC,
//!   S3-FIFO, IsolatedLRU, noop.
//! - [`quota`]: per-cache_salt accounting; [`lease_table`]: TTL-bounded parking of handles.
//! - [`maintenance`]: the background watermark/quota/lease thread.
//! - [`persist`]: restart warm for an L1 in a file arena: the [`Sealer`] thread records
//!   committed objects in the arena's catalog; [`L1Cache::adopt`] takes them back at start.
#![forbid(unsafe_code)]

mod cache;
pub mod config;
mod entry;
pub mod error;
pub mod eviction;
mod handles;
pub mod lease_table;
pub mod maintenance;
pub mod persist;
pub mod quota;
mod set;

pub use cache::{
    ClearReport, L1Listener, L1Member, L1Stats, L1Usage, MaintenanceReport, RemovalCause,
    ReserveMode, Residency, WriteRequest,
};
pub use config::L1Config;
pub use entry::EntryId;
pub use error::{L1ConfigError, L1Error, L1Status};
pub use eviction::EvictionPolicyKind;
pub use handles::{ReadLease, WriteReservation};
pub use lease_table::LeaseId;
pub use maintenance::Maintenance;
pub use persist::{PersistStats, Sealer};
pub use set::{DEFAULT_TAG, L1Cache};
