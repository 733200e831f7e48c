//! Helpers shared by the storage integration tests.

use lmcache_l1::{L1Cache, L1Config};
use lmcache_memory::{Arena, ArenaAllocator, ArenaBacking, ArenaConfig};

/// An L1 of `capacity` bytes in private anonymous memory, default settings.
pub fn l1(capacity: u64) -> L1Cache {
    let arena = Arena::create(&ArenaConfig {
        size: capacity,
        backing: ArenaBacking::Anonymous,
        mlock: false,
    })
    .unwrap();
    L1Cache::new(L1Config::default(), ArenaAllocator::new(arena, 4096).unwrap()).unwrap()
}
