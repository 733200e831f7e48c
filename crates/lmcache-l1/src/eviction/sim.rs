//! A shipped eviction policy driven alone, over unit-size chunks named by `u32` ids: what the
//! cache simulator (`tool cache-simulator --eviction-policy`) replays lookup logs through, so
//! its numbers are those of the policy code the server runs, not of a model of it.
//!
//! Every chunk costs one unit; inserting into a full cache first asks the policy for one
//! unit's worth of victims (as L1 does when a reservation finds no room; the background
//! watermark pass is not modelled).

use std::collections::HashMap;

use lmcache_core::CacheSalt;
use slotmap::SlotMap;

use super::{EntryMeta, EvictionPolicy, EvictionPolicyKind};
use crate::entry::EntryId;

/// A policy over at most `capacity` chunks.
#[derive(Debug)]
pub struct PolicySim {
    policy: Box<dyn EvictionPolicy>,
    ids: SlotMap<EntryId, u32>,
    of: HashMap<u32, EntryId>,
    capacity: usize,
    evictions: u64,
    salt: CacheSalt,
    victims: Vec<EntryId>,
}

/// A well-mixed hash of a chunk id (what ghost lists remember).
fn mix(k: u32) -> u64 {
    let mut x = u64::from(k).wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl PolicySim {
    /// An empty cache of `capacity` chunks (at least one) under `kind`.
    pub fn new(kind: EvictionPolicyKind, capacity: usize) -> Self {
        Self {
            policy: kind.build(),
            ids: SlotMap::with_key(),
            of: HashMap::new(),
            capacity: capacity.max(1),
            evictions: 0,
            salt: CacheSalt::default(),
            victims: Vec::new(),
        }
    }

    /// The policy's name.
    pub fn name(&self) -> &'static str {
        self.policy.name()
    }

    /// Whether `k` is cached.
    pub fn contains(&self, k: u32) -> bool {
        self.of.contains_key(&k)
    }

    /// Records a use of `k` (ignored when it is not cached).
    pub fn access(&mut self, k: u32) {
        if let Some(&id) = self.of.get(&k) {
            self.policy.on_access(id);
        }
    }

    /// Caches `k` (nothing when it is already cached), evicting first when full. Returns
    /// false when the policy would not make room (`noop`): then `k` is not cached.
    pub fn insert(&mut self, k: u32) -> bool {
        if self.of.contains_key(&k) {
            return true;
        }
        while self.of.len() >= self.capacity {
            self.victims.clear();
            let freed = self.policy.evict(None, 1, &mut |_| Some(1), &mut self.victims);
            if freed == 0 || self.victims.is_empty() {
                return false;
            }
            for v in self.victims.drain(..) {
                if let Some(chunk) = self.ids.remove(v) {
                    self.of.remove(&chunk);
                    self.evictions += 1;
                }
            }
        }
        let id = self.ids.insert(k);
        self.of.insert(k, id);
        self.policy.on_insert(id, EntryMeta { key_hash: mix(k), cache_salt: &self.salt, bytes: 1 });
        true
    }

    /// Chunks cached.
    pub fn len(&self) -> usize {
        self.of.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.of.is_empty()
    }

    /// Chunks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Capacity in chunks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let mut c = PolicySim::new(EvictionPolicyKind::Lru, 2);
        c.insert(1);
        c.insert(2);
        c.access(1);
        c.insert(3);
        assert!(c.contains(1) && c.contains(3) && !c.contains(2));
        assert_eq!(c.evictions(), 1);
        assert_eq!(c.name(), "LRU");
    }

    #[test]
    fn noop_refuses_rather_than_evict() {
        let mut c = PolicySim::new(EvictionPolicyKind::Noop, 1);
        assert!(c.insert(1));
        assert!(!c.insert(2));
        assert!(c.contains(1) && !c.contains(2));
    }

    proptest! {
        /// Every shipped policy keeps within capacity, caches what it was just given, and
        /// counts each eviction of a cached chunk once.
        #[test]
        fn every_policy_stays_within_capacity(
            kind in prop::sample::select(vec![EvictionPolicyKind::Lru, EvictionPolicyKind::Arc, EvictionPolicyKind::S3Fifo, EvictionPolicyKind::IsolatedLru]),
            cap in 1usize..16,
            ops in prop::collection::vec((0u32..40, any::<bool>()), 1..400),
        ) {
            let mut c = PolicySim::new(kind, cap);
            let mut inserted = 0u64;
            for (k, access) in ops {
                if access {
                    c.access(k);
                } else {
                    let fresh = !c.contains(k);
                    prop_assert!(c.insert(k));
                    inserted += u64::from(fresh);
                    prop_assert!(c.contains(k));
                }
                prop_assert!(c.len() <= cap);
            }
            prop_assert_eq!(inserted, c.len() as u64 + c.evictions());
        }
    }
}
