//! The fleet's peers as a source of a lookup's misses (P2P): when L1 falls short, a lookup asks
//! the installed [`PeerSource`] for the rest of the prefix (after L2, when adapters are
//! attached, for what L2 could not serve, as LMCache's P2P L2 adapter comes after the
//! others), and the answer is the same [`crate::Lookup::Pending`] a prefetch gives:
//! the peer's objects land in L1 reservations, are committed and read-locked for the reader,
//! and `query_prefetch_status` answers once they have (or have not).
//!
//! The source is the server's (it holds the peers, the RPC client and the transfer channel);
//! storage owns only the decision to ask and the handle the lookup waits on.

use lmcache_core::{ObjectKey, ObjectShape};

use crate::prefetch::{PrefetchHandle, PrefetchOutcome};

/// What a lookup asks the peers for.
#[derive(Debug, Clone)]
pub struct PeerFetch {
    /// Per shard, the keys of the chunks L1 lacks (a prefix continuation, the same count each).
    pub shards: Vec<Vec<ObjectKey>>,
    /// Read locks per served object.
    pub readers: u32,
    /// The model's object shape (group 0), for the peers' layout check.
    pub object: Option<ObjectShape>,
}

/// Completes one peer fetch, exactly once (dropping it completes it with nothing).
pub struct PeerDone(Option<Box<dyn FnOnce(PrefetchOutcome) + Send>>);

impl std::fmt::Debug for PeerDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerDone")
    }
}

impl PeerDone {
    /// A completion that hands the outcome to `f` (storage's; a source only completes it).
    pub(crate) fn new(f: impl FnOnce(PrefetchOutcome) + Send + 'static) -> Self {
        Self(Some(Box::new(f)))
    }

    /// Hands the outcome to the lookup waiting on it.
    pub fn complete(mut self, outcome: PrefetchOutcome) {
        if let Some(f) = self.0.take() {
            f(outcome);
        }
    }
}

impl Drop for PeerDone {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f(PrefetchOutcome::default());
        }
    }
}

/// The fleet's peers, as storage asks them.
pub trait PeerSource: Send + Sync + std::fmt::Debug {
    /// Whether a peer could be asked now (cheap: every short lookup calls it).
    fn has_peers(&self) -> bool;
    /// Starts fetching `req` from the peers; must return at once (the lookup that asks runs
    /// on the socket thread) and call `done` from elsewhere, once, with the servable prefix
    /// committed and read-locked `req.readers` times.
    fn start(&self, req: PeerFetch, done: PeerDone);
}

/// Starts `req` on `source`: the handle a pending lookup holds.
pub(crate) fn start(source: &dyn PeerSource, req: PeerFetch) -> PrefetchHandle {
    let (handle, complete) = PrefetchHandle::external();
    source.start(req, PeerDone::new(complete));
    handle
}
