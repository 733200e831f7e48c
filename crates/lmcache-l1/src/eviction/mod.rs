//! Eviction policies: which unlocked resident objects leave L1 first.
//!
//! A policy tracks every resident object by [`EntryId`] and answers one question: given that
//! `target` bytes must be freed (optionally within one tenant), which entries go? The L1 index
//! owns the lock state, so the policy asks an `eligible` callback whether an entry may go
//! (unlocked, and in scope) and how many bytes it frees. A locked or staged object is never
//! returned: staged objects are never in a policy, and locked ones are refused by the callback.
//!
//! Contract for implementors:
//! - `on_insert` is called once when an entry becomes resident; the caller guarantees the id
//!   is not tracked. Batches are inserted in reverse request order (last chunk first), so a
//!   recency policy ends up evicting a request's suffix chunks before its prefix chunks.
//! - `on_access` records a use (lookups touch in reverse request order as well).
//! - `on_remove` forgets an entry deleted by the cache (not an eviction: no ghost entry).
//! - `evict` gets an `eligible` callback that already refuses locked entries and entries
//!   outside `scope`; `scope` is a hint for policies that can go straight to one tenant.
//!   It MUST only return ids for which `eligible` returned `Some`, MUST stop once the
//!   bytes returned reach `target`, and MUST forget the returned ids itself (the caller
//!   deletes every one of them). It may reorder the entries it keeps.

mod arc;
mod isolated_lru;
pub(crate) mod list;
mod lru;
mod noop;
mod s3fifo;
mod sim;

use std::fmt;
use std::str::FromStr;

use lmcache_core::CacheSalt;

use crate::entry::EntryId;

pub use arc::Arc;
pub use isolated_lru::IsolatedLru;
pub use lru::Lru;
pub use noop::Noop;
pub use s3fifo::S3Fifo;
pub use sim::PolicySim;

/// What a policy learns about an entry when it becomes resident.
#[derive(Debug, Clone, Copy)]
pub struct EntryMeta<'a> {
    /// A well-mixed hash of the object key, stable across re-admissions (for ghost lists).
    pub key_hash: u64,
    /// The entry's tenant.
    pub cache_salt: &'a CacheSalt,
    /// Bytes it occupies.
    pub bytes: u64,
}

/// Decides whether an entry may be evicted now, and how many bytes that frees.
pub type Eligible<'a> = dyn FnMut(EntryId) -> Option<u64> + 'a;

/// An eviction policy. See the module docs for the contract.
pub trait EvictionPolicy: Send + fmt::Debug {
    /// The policy's name as configured (`LRU`, `ARC`, ...).
    fn name(&self) -> &'static str;
    /// An entry became resident.
    fn on_insert(&mut self, id: EntryId, meta: EntryMeta<'_>);
    /// An entry was used.
    fn on_access(&mut self, id: EntryId);
    /// An entry was deleted by the cache (not evicted).
    fn on_remove(&mut self, id: EntryId);
    /// Chooses and forgets victims worth at least `target` bytes, within `scope` if given.
    /// Returns the bytes chosen (less than `target` when not enough are eligible).
    fn evict(
        &mut self,
        scope: Option<&CacheSalt>,
        target: u64,
        eligible: &mut Eligible<'_>,
        out: &mut Vec<EntryId>,
    ) -> u64;
    /// Number of tracked entries.
    fn len(&self) -> usize;
    /// True when nothing is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forgets everything.
    fn clear(&mut self);
}

/// The configurable policies, named as LMCache's `--eviction-policy` (plus `S3FIFO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionPolicyKind {
    /// Least recently used, suffix chunks first.
    #[default]
    Lru,
    /// Adaptive replacement cache.
    Arc,
    /// S3-FIFO: small probationary FIFO, main FIFO with reinsertion, ghost queue.
    S3Fifo,
    /// One LRU per cache_salt; global pressure takes the globally oldest.
    IsolatedLru,
    /// Never evicts.
    Noop,
}

impl EvictionPolicyKind {
    /// Every kind, for help texts and tests.
    pub const ALL: [EvictionPolicyKind; 5] =
        [Self::Lru, Self::Arc, Self::S3Fifo, Self::IsolatedLru, Self::Noop];

    /// The configured name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Lru => "LRU",
            Self::Arc => "ARC",
            Self::S3Fifo => "S3FIFO",
            Self::IsolatedLru => "IsolatedLRU",
            Self::Noop => "noop",
        }
    }

    /// A fresh policy of this kind.
    pub fn build(self) -> Box<dyn EvictionPolicy> {
        match self {
            Self::Lru => Box::new(Lru::default()),
            Self::Arc => Box::new(Arc::default()),
            Self::S3Fifo => Box::new(S3Fifo::default()),
            Self::IsolatedLru => Box::new(IsolatedLru::default()),
            Self::Noop => Box::new(Noop),
        }
    }
}

impl fmt::Display for EvictionPolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown policy name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown eviction policy {0:?}; expected one of LRU, ARC, S3FIFO, IsolatedLRU, noop")]
pub struct UnknownPolicy(pub String);

impl FromStr for EvictionPolicyKind {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "lru" => Ok(Self::Lru),
            "arc" => Ok(Self::Arc),
            "s3fifo" => Ok(Self::S3Fifo),
            "isolatedlru" => Ok(Self::IsolatedLru),
            "noop" | "none" => Ok(Self::Noop),
            _ => Err(UnknownPolicy(s.to_owned())),
        }
    }
}

/// Walks `ids` (eviction order), collecting eligible ones until `target` bytes.
pub(crate) fn collect_from(
    ids: impl Iterator<Item = EntryId>,
    target: u64,
    chosen: &mut u64,
    eligible: &mut Eligible<'_>,
    out: &mut Vec<EntryId>,
) {
    for id in ids {
        if *chosen >= target {
            break;
        }
        if let Some(bytes) = eligible(id) {
            *chosen += bytes;
            out.push(id);
        }
    }
}

#[cfg(test)]
mod conformance;
