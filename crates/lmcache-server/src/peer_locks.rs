//! What this server holds for the peers of its fleet between their P2P calls: each
//! `p2p_lookup_and_lock`'s answer until `p2p_query_lookup_results` takes it (exactly once),
//! and the read leases it took, parked in L1's lease table (so a peer that never unlocks
//! loses them when the read TTL expires them, counted in L1's `expired_read_leases`) under
//! their keys until `p2p_unlock_objects` releases one per key.
//!
//! Both tables are bounded by time: the reaper drops answers and lease ids older than the
//! read TTL (the leases themselves are gone from L1 by then).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lmcache_core::ObjectKey;
use lmcache_l1::LeaseId;
use lmcache_protocol::types::TransferAddress;
use parking_lot::Mutex;

/// The P2P tasks and parked leases.
#[derive(Debug, Default)]
pub struct PeerLocks {
    next_task: AtomicU64,
    /// Task id → when answered, and the answer.
    answers: Mutex<HashMap<u64, (Instant, Vec<TransferAddress>)>>,
    /// Key → its parked leases, oldest first.
    held: Mutex<HashMap<ObjectKey, VecDeque<(Instant, LeaseId)>>>,
}

impl PeerLocks {
    /// Records a lookup's answer and its parked leases; returns its task id.
    pub fn add_task(&self, answer: Vec<TransferAddress>, parked: Vec<(ObjectKey, LeaseId)>) -> u64 {
        let now = Instant::now();
        let id = self.next_task.fetch_add(1, Ordering::Relaxed);
        if !parked.is_empty() {
            let mut held = self.held.lock();
            for (k, l) in parked {
                held.entry(k).or_default().push_back((now, l));
            }
        }
        self.answers.lock().insert(id, (now, answer));
        id
    }

    /// The answer of task `id`, once; `None` when unknown or already taken.
    pub fn take_answer(&self, id: u64) -> Option<Vec<TransferAddress>> {
        self.answers.lock().remove(&id).map(|(_, a)| a)
    }

    /// One parked lease per key of `keys` (the oldest), where one is held.
    pub fn take_leases(&self, keys: &[ObjectKey]) -> Vec<LeaseId> {
        let mut held = self.held.lock();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            if let Some(q) = held.get_mut(k) {
                if let Some((_, l)) = q.pop_front() {
                    out.push(l);
                }
                if q.is_empty() {
                    held.remove(k);
                }
            }
        }
        out
    }

    /// Whether a peer holds a lock on `key` (what the transfer channel may send).
    pub fn holds(&self, key: &ObjectKey) -> bool {
        self.held.lock().contains_key(key)
    }

    /// Answers not taken yet (LMCache's `active_p2p_lookup_jobs`).
    pub fn active(&self) -> usize {
        self.answers.lock().len()
    }

    /// Drops answers and lease ids older than `ttl`.
    pub fn reap(&self, now: Instant, ttl: Duration) {
        self.answers.lock().retain(|_, (t, _)| now.duration_since(*t) < ttl);
        self.held.lock().retain(|_, q| {
            q.retain(|(t, _)| now.duration_since(*t) < ttl);
            !q.is_empty()
        });
    }
}
