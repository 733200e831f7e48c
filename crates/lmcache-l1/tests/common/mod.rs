//! Shared helpers of the L1 integration tests.
#![allow(dead_code, missing_docs, clippy::allow_attributes)]

use lmcache_core::ObjectKey;
use lmcache_l1::{EvictionPolicyKind, L1Cache, L1Config, L1Member};
use lmcache_memory::{Arena, ArenaAllocator, ArenaBacking, ArenaConfig};

pub const PAGE: u64 = 4096;

pub fn cache_with(capacity: u64, policy: EvictionPolicyKind) -> L1Cache {
    let arena = Arena::create(&ArenaConfig {
        size: capacity,
        backing: ArenaBacking::Anonymous,
        mlock: false,
    })
    .unwrap();
    let memory = ArenaAllocator::new(arena, PAGE).unwrap();
    L1Cache::new(L1Config { eviction_policy: policy, ..L1Config::default() }, memory).unwrap()
}

/// One member per capacity, in write order, tagged m0, m1, ...
pub fn members(capacities: &[u64], policy: EvictionPolicyKind) -> L1Cache {
    let list = capacities
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let arena = Arena::create(&ArenaConfig {
                size,
                backing: ArenaBacking::Anonymous,
                mlock: false,
            })
            .unwrap();
            let memory = ArenaAllocator::new(arena, PAGE).unwrap();
            let config = L1Config { eviction_policy: policy, ..L1Config::default() };
            (format!("m{i}"), L1Member::new(config, memory).unwrap())
        })
        .collect();
    L1Cache::from_members(list).unwrap()
}

pub fn cache(capacity: u64) -> L1Cache {
    cache_with(capacity, EvictionPolicyKind::Lru)
}

pub fn key(i: u32) -> ObjectKey {
    key_salted(i, "")
}

pub fn key_salted(i: u32, salt: &str) -> ObjectKey {
    let mut h = [0u8; 32];
    h[..4].copy_from_slice(&i.to_be_bytes());
    ObjectKey::new(h, "test-model", 1, 0, 0, salt).unwrap()
}
