//! [`StorageManager`]: the one owner of L1 and L2 the server's store path calls (LMCache's
//! StorageManager). A store reserves L1 memory through it and commits through it; the commit
//! queues the write-behind to L2 in the same call, so no caller glues the tiers together.
//!
//! Write-behind that loses nothing: with L2 attached, L1 holds every committed object as
//! *unwritten* until the store controller is done with it. Eviction takes written objects
//! first; when only unwritten objects could make room, a store waits for the write-behind
//! (at most [`crate::TierConfig::write_behind_wait`]), and only then evicts unwritten
//! objects, counting each one ([`lmcache_l1::L1Stats::unwritten_evictions`]).

use std::time::{Duration, Instant};

use lmcache_core::ObjectKey;
use lmcache_l1::{L1Cache, L1Error, WriteRequest, WriteReservation};

use crate::tier::L2Tier;

/// L1 and, when adapters are configured, the L2 tier under it. Cheap to clone.
#[derive(Debug, Clone)]
pub struct StorageManager {
    l1: L1Cache,
    l2: Option<L2Tier>,
}

impl StorageManager {
    /// Joins `l1` and `l2`. With adapters attached, L1 keeps unwritten objects from eviction
    /// (see the module docs).
    pub fn new(l1: L1Cache, l2: Option<L2Tier>) -> Self {
        l1.set_write_behind(l2.as_ref().is_some_and(|t| !t.is_empty()));
        Self { l1, l2 }
    }

    /// The L1 tier.
    pub fn l1(&self) -> &L1Cache {
        &self.l1
    }

    /// The L2 tier, when configured.
    pub fn l2(&self) -> Option<&L2Tier> {
        self.l2.as_ref()
    }

    /// Reserves L1 memory for a store (see [`L1Cache::reserve_write`] for the per-key
    /// results). Requests refused for lack of memory while L1 holds objects the write-behind
    /// has not written yet are retried as it writes them, for at most the configured wait;
    /// then they may evict those objects.
    pub fn reserve_write(
        &self,
        requests: &[WriteRequest],
    ) -> Vec<Result<WriteReservation, L1Error>> {
        let mut out = self.l1.reserve_write(requests);
        let Some(tier) = &self.l2 else { return out };
        let deadline = Instant::now() + tier.config().write_behind_wait;
        loop {
            let short: Vec<usize> = out
                .iter()
                .enumerate()
                .filter(|(_, r)| matches!(r, Err(L1Error::OutOfMemory { .. })))
                .map(|(i, _)| i)
                .collect();
            if short.is_empty() || self.l1.unwritten() == 0 {
                return out;
            }
            let retry: Vec<WriteRequest> = short.iter().map(|&i| requests[i].clone()).collect();
            let now = Instant::now();
            let progressed = now < deadline && tier.wait_progress(deadline - now);
            let again = if progressed {
                self.l1.reserve_write(&retry)
            } else {
                // Waited long enough: the oldest unwritten objects go (counted).
                tracing::warn!(
                    chunks = retry.len(),
                    "L1 full of objects L2 has not written yet; evicting some to store"
                );
                self.l1.reserve_write_evicting_unwritten(&retry)
            };
            for (&i, r) in short.iter().zip(again) {
                out[i] = r;
            }
            if !progressed {
                return out;
            }
        }
    }

    /// Commits `writes` to L1 (a request's last chunk enters eviction order first) and queues
    /// the committed ones for the write-behind. Returns one result per reservation, in order.
    pub fn commit(&self, writes: Vec<WriteReservation>) -> Vec<Result<(), L1Error>> {
        let keys: Vec<ObjectKey> = writes.iter().map(|w| w.key().clone()).collect();
        let results = self.l1.commit_batch(writes);
        if let Some(tier) = &self.l2 {
            tier.submit_store(
                keys.into_iter().zip(&results).filter(|(_, r)| r.is_ok()).map(|(k, _)| k),
            );
        }
        results
    }

    /// Waits for queued write-behind, at most `timeout`; returns the keys still pending.
    pub fn flush(&self, timeout: Duration) -> u64 {
        self.l2.as_ref().map_or(0, |t| t.flush(timeout))
    }
}
