//! Parked handles with a deadline: how a lock outlives the request that took it.
//!
//! A client that reserves in one message and finishes in another (the MP protocol's
//! store and retrieve) cannot hold a Rust handle, so the server parks the handle here under a
//! [`LeaseId`]. Finishing takes it back out. If the client dies, the lease expires after its
//! TTL and the handle is dropped, which releases the lock the ordinary way (RAII): the TTL is
//! only a safety net, and it never frees memory that a live handle still references.
//!
//! Expired handles are dropped after the table's own lock is released, so a handle's drop
//! (which takes the L1 lock) never nests inside it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Names a parked handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);

#[derive(Debug)]
struct Inner<T> {
    next: u64,
    leases: HashMap<LeaseId, (Instant, T), foldhash::fast::RandomState>,
}

/// Handles parked with a TTL.
#[derive(Debug)]
pub struct LeaseTable<T> {
    ttl: Duration,
    inner: Mutex<Inner<T>>,
}

impl<T> LeaseTable<T> {
    /// An empty table whose leases live `ttl` unless renewed.
    pub fn new(ttl: Duration) -> Self {
        Self { ttl, inner: Mutex::new(Inner { next: 1, leases: HashMap::default() }) }
    }

    /// The TTL.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Parks `value` until taken back or expired.
    pub fn park(&self, value: T) -> LeaseId {
        self.park_until(value, Instant::now() + self.ttl)
    }

    /// Parks `value` with an explicit deadline.
    pub fn park_until(&self, value: T, deadline: Instant) -> LeaseId {
        let mut g = self.inner.lock();
        let id = LeaseId(g.next);
        g.next += 1;
        g.leases.insert(id, (deadline, value));
        id
    }

    /// Takes a parked value back; `None` if unknown or already expired and swept.
    pub fn take(&self, id: LeaseId) -> Option<T> {
        self.inner.lock().leases.remove(&id).map(|(_, v)| v)
    }

    /// Pushes a lease's deadline one TTL from now; false if unknown.
    pub fn renew(&self, id: LeaseId) -> bool {
        let deadline = Instant::now() + self.ttl;
        match self.inner.lock().leases.get_mut(&id) {
            Some(slot) => {
                slot.0 = deadline;
                true
            }
            None => false,
        }
    }

    /// Drops every lease whose deadline is at or before `now`; returns how many.
    pub fn expire(&self, now: Instant) -> usize {
        let expired: Vec<T> = {
            let mut g = self.inner.lock();
            let ids: Vec<LeaseId> =
                g.leases.iter().filter(|(_, (d, _))| *d <= now).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| g.leases.remove(&id)).map(|(_, v)| v).collect()
        };
        let n = expired.len();
        drop(expired);
        n
    }

    /// Parked leases.
    pub fn len(&self) -> usize {
        self.inner.lock().leases.len()
    }

    /// True when nothing is parked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every lease.
    pub fn clear(&self) -> usize {
        let all: Vec<_> = self.inner.lock().leases.drain().collect();
        all.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn expiry_drops_only_due_leases() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let t = LeaseTable::new(Duration::from_secs(60));
        let now = Instant::now();
        let due = t.park_until(Counted(dropped.clone()), now);
        let later = t.park_until(Counted(dropped.clone()), now + Duration::from_secs(10));
        assert_eq!(t.expire(now), 1);
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
        assert!(t.take(due).is_none());
        assert!(t.renew(later));
        assert_eq!(t.expire(now + Duration::from_secs(11)), 0, "renewed lease expired");
        let v = t.take(later).unwrap();
        drop(v);
        assert_eq!(dropped.load(Ordering::SeqCst), 2);
        assert!(t.is_empty());
    }
}
