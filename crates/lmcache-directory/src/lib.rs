//! The coordinator's fleet key directory.
//!
//! It records, from the cache events servers report, which server holds which object key in
//! which tier and backend (a *placement*), and answers two questions: the placements of given
//! keys (LMCache's `/directory/lookup`) and, for a request's chunks, each server's longest
//! leading run of chunks it can serve from L1 and from L1 or L2 (the routing answer LMCache's
//! coordinator leaves to the router).
//!
//! Everything here is plain data and arithmetic: no IO, no locks, no clocks (timestamps come
//! in with the events). Names (models, salts, instances, backends) are interned once into
//! small ids ([`NsId`], [`InstanceId`], [`SiteId`]), so a placement costs 16 bytes and a key
//! its 32-byte chunk hash, a 12-byte record naming its namespace and first placement through a
//! head its store batch shares, and an 8-byte table entry (slot number and fingerprint) in a
//! table kept 7/10 to 15/16 full.
//!
//! Placement identity follows LMCache's key directory: a private placement is one per
//! (instance, tier, backend); a placement in a shared pool (one S3 bucket mounted by several
//! servers) is one per (tier, backend) whoever reports it, and names its latest reporter.
//! Fencing an instance (restart, lost heartbeat) drops its L1 placements only; L2 placements
//! live on persistent storage and leave through delete events.
//!
//! # Modules
//! - `directory`: [`Directory`], the placements per key, the event application and the
//!   routing answers.
//! - `ids`: the interned names ([`NsId`], [`InstanceId`], [`SiteId`]).
//! - `slots`: the key arena (keys in store order, so a request's chunks sit side by side),
//!   its table, and the placement lists of keys held at several sites.
//! - `seg_table`: that table, in segments that split one at a time as it grows.
//! - `runs`: each instance's longest leading run of a request's chunks, by bitsets.
//! - `tokens`: bounded token bindings, for lookups by tokens.
//! - `persist`: the checked checkpoint image, whole or built in steps ([`ImageBuilder`]).
//! - `prefetch`: a read-prefetch hint for a batch's table lines (the crate's one unsafe line).
#![deny(unsafe_code)]

mod directory;
mod ids;
mod persist;
#[expect(unsafe_code, reason = "a prefetch hint: it never faults, reads or writes nothing")]
mod prefetch;
mod runs;
mod seg_table;
mod slots;
mod tokens;

pub use directory::{
    Directory, DirectoryConfig, DirectoryStats, Entry, EventKind, KeyFilter, PlacementView,
    SiteStats,
};
pub use ids::{DirKey, InstanceId, Namespace, NsId, Site, SiteId, Tier};
pub use lmcache_blend::{BlendConfig, BlendMatch, BlendStats, MAX_CONTENTS_PER_FINGERPRINT};
pub use persist::{DecodeError, ImageBuilder, ImageParts};
pub use runs::{PrefixRun, RunQuery};
pub use tokens::TokenBinding;

/// Errors from applying events.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DirectoryError {
    /// An id that this directory never handed out.
    #[error("unknown {what} id {id}")]
    UnknownId {
        /// Which kind of id.
        what: &'static str,
        /// The id.
        id: u32,
    },
    /// More distinct names than ids of this kind (2^32).
    #[error("too many distinct {0}")]
    Exhausted(&'static str),
}
