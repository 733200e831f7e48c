//! [`Storage`]: storage built whole from a [`StorageConfig`], with everything it runs. The
//! one door to L1 and L2 for the server and the tools: it creates the arena, the allocator
//! and its prefaulter, L1 and its maintenance thread, and the L2 tier with its runtime and
//! controllers; it dereferences to the [`StorageManager`] every operation goes through, and
//! its [`Storage::shutdown`] flushes the write-behind, closes the adapters and stops the
//! background threads.

use std::ops::Deref;

use lmcache_l1::{L1Cache, L1Config, L1ConfigError, Maintenance};
use lmcache_l2::ConfigError;
use lmcache_memory::{Arena, ArenaAllocator, ArenaConfig, MemoryError, Prefaulter};
use parking_lot::Mutex;
use serde_json::Value;

use crate::manager::StorageManager;
use crate::tier::{L2Tier, TierConfig};

/// Most L1 memory the prefaulter commits ahead of use.
const PREFAULT_AHEAD: u64 = 1 << 30;

/// What storage is built from.
#[derive(Debug, Clone)]
pub struct StorageConfig {
    /// The L1 arena: size, backing (anonymous, shared memory, huge pages), mlock.
    pub arena: ArenaConfig,
    /// Allocation alignment in the arena.
    pub align: u64,
    /// L1's eviction, TTLs and watermarks.
    pub l1: L1Config,
    /// The L2 adapters, as `--l2-adapter` gives them (none: no L2 tier).
    pub l2_adapters: Vec<Value>,
    /// The L2 tier's settings.
    pub l2: TierConfig,
}

/// Why storage could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The L1 arena could not be created.
    #[error("L1 memory: {0}")]
    Memory(#[from] MemoryError),
    /// The L1 settings are invalid.
    #[error(transparent)]
    L1(#[from] L1ConfigError),
    /// An L2 adapter could not be built (the message names the adapter and field).
    #[error(transparent)]
    L2(#[from] ConfigError),
    /// A background thread could not start.
    #[error("starting {what}: {source}")]
    Thread {
        /// Which.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// L1 and L2 with their background work.
#[derive(Debug)]
pub struct Storage {
    manager: StorageManager,
    /// L1's maintenance and the arena's prefaulter; stopped by [`Storage::shutdown`] or drop.
    background: Mutex<Option<(Maintenance, Prefaulter)>>,
}

impl Storage {
    /// Builds the tiers `config` describes and starts their threads.
    pub fn build(config: &StorageConfig) -> Result<Self, BuildError> {
        let thread = |what| move |source| BuildError::Thread { what, source };
        let arena = Arena::create(&config.arena)?;
        let memory = ArenaAllocator::new(arena, config.align)?;
        let prefaulter =
            memory.spawn_prefaulter(PREFAULT_AHEAD).map_err(thread("the L1 prefaulter"))?;
        let l1 = L1Cache::new(config.l1.clone(), memory)?;
        let maintenance = Maintenance::spawn(l1.clone()).map_err(thread("L1 maintenance"))?;
        let l2 = if config.l2_adapters.is_empty() {
            None
        } else {
            let tier = L2Tier::start(l1.clone(), &config.l2_adapters, config.l2.clone())?;
            for a in tier.describe() {
                tracing::info!(id = a.id, kind = %a.kind, "L2 adapter ready");
            }
            Some(tier)
        };
        Ok(Self {
            manager: StorageManager::new(l1, l2),
            background: Mutex::new(Some((maintenance, prefaulter))),
        })
    }

    /// Graceful stop: flushes the write-behind (at most the configured flush timeout), closes
    /// every adapter, and stops the background threads. Returns the keys the flush left
    /// unwritten. Further calls only return 0.
    pub fn shutdown(&self) -> u64 {
        let Some(background) = self.background.lock().take() else { return 0 };
        let pending = self.manager.shutdown();
        drop(background);
        pending
    }
}

impl Deref for Storage {
    type Target = StorageManager;

    fn deref(&self) -> &StorageManager {
        &self.manager
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lmcache_memory::ArenaBacking;

    #[test]
    fn builds_whole_and_stops_once() {
        let dir = std::env::temp_dir().join(format!("lmcache-rs-build-{}", std::process::id()));
        let config = StorageConfig {
            arena: ArenaConfig { size: 8 << 20, backing: ArenaBacking::Anonymous, mlock: false },
            align: lmcache_memory::DEFAULT_ALIGN,
            l1: L1Config::default(),
            l2_adapters: vec![serde_json::json!({"type": "fs", "base_path": dir})],
            l2: TierConfig::default(),
        };
        let s = Storage::build(&config).unwrap();
        assert!(s.has_l2());
        assert_eq!(s.describe_l2().len(), 1);
        assert_eq!(s.shutdown(), 0);
        assert_eq!(s.shutdown(), 0, "a second shutdown is a no-op");
        let bad =
            StorageConfig { l2_adapters: vec![serde_json::json!({"type": "nope"})], ..config };
        assert!(matches!(Storage::build(&bad), Err(BuildError::L2(_))));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
