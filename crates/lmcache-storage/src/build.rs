//! [`Storage`]: storage built whole from a [`StorageConfig`], with everything it runs. The
//! one door to L1 and L2 for the server and the tools: it creates each L1's arena, allocator
//! and prefaulter, the L1s and their maintenance thread, and the L2 tier with its runtime and
//! controllers; it dereferences to the [`StorageManager`] every operation goes through, and
//! its [`Storage::shutdown`] flushes the write-behind, closes the adapters and stops the
//! background threads.

use std::ops::Deref;

use lmcache_l1::{L1Cache, L1Config, L1ConfigError, L1Member, Maintenance, Sealer};
use lmcache_l2::ConfigError;
use lmcache_memory::{Arena, ArenaAllocator, ArenaConfig, MemoryError, Prefaulter};
use parking_lot::Mutex;
use serde_json::Value;

use crate::manager::StorageManager;
use crate::tier::{L2Tier, TierConfig};

/// Most L1 memory the prefaulter commits ahead of use.
const PREFAULT_AHEAD: u64 = 1 << 30;

/// How long a shutdown waits for committed objects of an L1 file to be sealed (hashing runs
/// at several GB/s: an 8 GiB L1 written just before the stop takes a few seconds).
const SEAL_DRAIN: std::time::Duration = std::time::Duration::from_secs(30);

/// What storage is built from.
#[derive(Debug, Clone)]
pub struct StorageConfig {
    /// The L1 arena: size, backing (anonymous, shared memory, huge pages), mlock.
    pub arena: ArenaConfig,
    /// Allocation alignment in the arena.
    pub align: u64,
    /// L1's eviction, TTLs and watermarks.
    pub l1: L1Config,
    /// The tag of that L1 (LMCache's `--l1-manager` tag; [`lmcache_l1::DEFAULT_TAG`]).
    pub l1_tag: String,
    /// Further L1s after it, in write order: a store that does not fit one goes to the next.
    pub more_l1: Vec<L1MemberConfig>,
    /// The L2 adapters, as `--l2-adapter` gives them (none: no L2 tier).
    pub l2_adapters: Vec<Value>,
    /// The L2 tier's settings.
    pub l2: TierConfig,
}

/// One more L1 (LMCache's tagged L1): its own arena, alignment and settings.
#[derive(Debug, Clone)]
pub struct L1MemberConfig {
    /// Its tag, unique among the L1s.
    pub tag: String,
    /// Its arena.
    pub arena: ArenaConfig,
    /// Allocation alignment in it.
    pub align: u64,
    /// Its eviction, TTLs and watermarks.
    pub l1: L1Config,
}

/// Why storage could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The L1 arena could not be created. (The message carries the cause's text, so the
    /// cause is not also its `source`: an error chain would print it twice.)
    #[error("L1 memory: {0}")]
    Memory(MemoryError),
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

impl From<MemoryError> for BuildError {
    fn from(e: MemoryError) -> Self {
        Self::Memory(e)
    }
}

/// L1's maintenance thread, a prefaulter per L1 arena, and the sealer of the L1 files.
type Background = (Maintenance, Vec<Prefaulter>, Option<Sealer>);

/// L1 and L2 with their background work.
#[derive(Debug)]
pub struct Storage {
    manager: StorageManager,
    /// L1's maintenance, the arena's prefaulter and, for an L1 file, its sealer; stopped by
    /// [`Storage::shutdown`] or drop.
    background: Mutex<Option<Background>>,
}

impl Storage {
    /// Builds the tiers `config` describes and starts their threads.
    pub fn build(config: &StorageConfig) -> Result<Self, BuildError> {
        let thread = |what| move |source| BuildError::Thread { what, source };
        let first = (&config.l1_tag, &config.arena, config.align, &config.l1);
        let rest = config.more_l1.iter().map(|m| (&m.tag, &m.arena, m.align, &m.l1));
        let mut members = Vec::with_capacity(1 + config.more_l1.len());
        let mut prefaulters = Vec::with_capacity(members.capacity());
        for (tag, arena, align, l1) in std::iter::once(first).chain(rest) {
            let memory = ArenaAllocator::new(Arena::create(arena)?, align)?;
            prefaulters.push(
                memory.spawn_prefaulter(PREFAULT_AHEAD).map_err(thread("the L1 prefaulter"))?,
            );
            members.push((tag.clone(), L1Member::new(l1.clone(), memory)?));
        }
        let l1 = L1Cache::from_members(members)?;
        // An L1 file restarted warm: what the arena verified becomes resident before anything
        // can be stored (listeners installed later hear of it through `announce_resident`).
        let adopted = l1.adopt();
        if adopted > 0 {
            tracing::info!(objects = adopted, "L1 restarted warm");
        }
        let sealer = Sealer::spawn(&l1).map_err(thread("the L1 sealer"))?;
        let maintenance = Maintenance::spawn(l1.clone()).map_err(thread("L1 maintenance"))?;
        let l2 = if config.l2_adapters.is_empty() {
            None
        } else {
            let tier = L2Tier::start(l1.clone(), &config.l2_adapters, config.l2.clone())?;
            for a in tier.describe() {
                tracing::info!(id = a.id, kind = %a.kind, "L2 adapter ready");
            }
            if adopted > 0 {
                // What the last process held may not all have reached L2 before it stopped.
                tier.replay_store(l1.resident_keys().into_iter().map(|(k, _)| k).collect());
                tracing::info!(objects = adopted, "adopted L1 objects queued for the write-behind");
            }
            Some(tier)
        };
        Ok(Self {
            manager: StorageManager::new(l1, l2),
            background: Mutex::new(Some((maintenance, prefaulters, sealer))),
        })
    }

    /// Graceful stop: flushes the write-behind (at most the configured flush timeout), closes
    /// every adapter, and stops the background threads. An L1 file then waits for its seals
    /// and keeps its catalog, so the next process can restart warm. Returns the keys the
    /// flush left unwritten. Further calls only return 0.
    pub fn shutdown(&self) -> u64 {
        let Some(background) = self.background.lock().take() else { return 0 };
        let pending = self.manager.shutdown();
        let l1 = self.manager.l1();
        let left = l1.drain_seals(SEAL_DRAIN);
        if left > 0 {
            tracing::warn!(objects = left, "L1 objects not sealed in time: not kept");
        }
        for (_, member) in l1.members() {
            if member.memory().is_persistent() {
                member.memory().detach_catalog();
            }
        }
        drop(background);
        // Every writer has stopped (the transport before this, the controllers and the
        // sealer above): a successor may take the files while this process unmaps them. The
        // first goes last: a successor (`--take-over`) waits for it, then opens the others.
        for (_, member) in l1.members().rev() {
            member.memory().release_file();
        }
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
            l1_tag: lmcache_l1::DEFAULT_TAG.into(),
            more_l1: vec![],
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

    /// Storage over a 16 MiB L1 file in `dir`.
    fn file_config(dir: &std::path::Path, adopt: bool, l2_adapters: Vec<Value>) -> StorageConfig {
        StorageConfig {
            arena: ArenaConfig {
                size: 16 << 20,
                backing: ArenaBacking::File(lmcache_memory::FileBacking {
                    path: dir.join("l1"),
                    format: false,
                    adopt,
                }),
                mlock: false,
            },
            align: lmcache_memory::DEFAULT_ALIGN,
            l1: L1Config::default(),
            l1_tag: lmcache_l1::DEFAULT_TAG.into(),
            more_l1: vec![],
            l2_adapters,
            l2: TierConfig::default(),
        }
    }

    fn key(i: u8) -> lmcache_core::ObjectKey {
        lmcache_core::ObjectKey::new([i; 32], "m", 1, 0, 0, "").unwrap()
    }

    /// Stores objects 0..4 in L1, object `i` filled with `i + 1`.
    fn store_four(s: &Storage) {
        let reqs: Vec<_> = (0..4).map(|i| lmcache_l1::WriteRequest::new(key(i), 5000)).collect();
        for (i, r) in s.l1().reserve_write(&reqs).into_iter().enumerate() {
            let mut w = r.unwrap();
            w.as_mut_slice().fill(i as u8 + 1);
            w.commit().unwrap();
        }
    }

    #[test]
    fn a_shutdown_keeps_an_l1_file_for_the_next_build() {
        let dir = tempfile::tempdir().unwrap();
        let config = |adopt| file_config(dir.path(), adopt, vec![]);
        let s = Storage::build(&config(true)).unwrap();
        store_four(&s);
        // The shutdown waits for the seals, keeps the records as the objects drop, and lets
        // the file go at once: a successor (a hot upgrade) adopts while this one still maps it.
        s.shutdown();
        let next = Storage::build(&config(true)).unwrap();
        drop(s);
        let s = next;
        for i in 0..4 {
            let lease = s.l1().read_lock(&[key(i)], 1).pop().unwrap().unwrap();
            assert!(lease.bytes().iter().all(|&b| b == i + 1), "object {i}");
        }
        assert_eq!(s.l1().persist_stats().adopted, 4);
        // Dropped without a shutdown (a panic unwinding), nothing is kept.
        drop(s);
        let s = Storage::build(&config(true)).unwrap();
        assert_eq!(s.l1().persist_stats().adopted, 0);
    }

    #[test]
    fn two_l1_files_in_write_order_restart_warm_together() {
        let dir = tempfile::tempdir().unwrap();
        let config = |adopt| {
            let mut c = file_config(dir.path(), adopt, vec![]);
            c.l1_tag = "dax0".into();
            let mut second = c.arena.clone();
            second.backing = ArenaBacking::File(lmcache_memory::FileBacking {
                path: dir.path().join("l1-second"),
                format: false,
                adopt,
            });
            c.more_l1 = vec![L1MemberConfig {
                tag: "dax1".into(),
                arena: second,
                align: c.align,
                l1: L1Config::default(),
            }];
            c
        };
        let big = 5 << 20;
        let s = Storage::build(&config(true)).unwrap();
        for i in 0..5u8 {
            let mut w = s
                .l1()
                .reserve_write(&[lmcache_l1::WriteRequest::new(key(i), big)])
                .pop()
                .unwrap()
                .unwrap();
            w.as_mut_slice().fill(i + 1);
            w.commit().unwrap();
        }
        let held = |s: &Storage| -> Vec<usize> {
            s.l1().members().map(|(_, m)| m.usage().resident_objects).collect()
        };
        let before = held(&s);
        assert!(before[0] > 0 && before[1] > 0, "the first file overflowed: {before:?}");
        assert_eq!(before.iter().sum::<usize>(), 5, "nothing evicted while the second had room");
        s.shutdown();
        drop(s);
        let s = Storage::build(&config(true)).unwrap();
        assert_eq!(held(&s), before, "each file adopted its own objects");
        assert_eq!(s.l1().persist_stats().adopted, 5);
        for i in 0..5u8 {
            let lease = s.l1().read_lock(&[key(i)], 1).pop().unwrap().unwrap();
            assert!(lease.bytes().iter().all(|&b| b == i + 1), "object {i}");
        }
        s.shutdown();
    }

    #[test]
    fn adopted_objects_reach_an_l2_the_last_process_never_wrote_them_to() {
        let dir = tempfile::tempdir().unwrap();
        let l2_dir = dir.path().join("l2");
        let config = |l2_adapters| file_config(dir.path(), true, l2_adapters);
        // The first process stores four objects and stops before any reached L2 (here: it
        // had none; a SIGKILL before the write-behind leaves the same state).
        let s = Storage::build(&config(vec![])).unwrap();
        store_four(&s);
        s.shutdown();
        drop(s);
        let s =
            Storage::build(&config(vec![serde_json::json!({"type": "fs", "base_path": l2_dir})]))
                .unwrap();
        assert_eq!(s.l1().persist_stats().adopted, 4);
        // Every adopted object is written behind.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while s.l2_stats().unwrap().store_enqueued.load(std::sync::atomic::Ordering::Relaxed) < 4 {
            assert!(std::time::Instant::now() < deadline, "adopted objects never queued");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(s.flush(std::time::Duration::from_secs(20)), 0);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let listed = rt.block_on(s.list_l2(None, lmcache_l2::KeyFilter::ALL, None, 100)).unwrap();
        assert_eq!(listed.page.keys.len(), 4, "{listed:?}");
        // Restarted again over an L2 that holds them: the replay is checked against it.
        s.shutdown();
        drop(s);
        let s =
            Storage::build(&config(vec![serde_json::json!({"type": "fs", "base_path": l2_dir})]))
                .unwrap();
        assert_eq!(s.l1().persist_stats().adopted, 4);
        assert_eq!(s.flush(std::time::Duration::from_secs(20)), 0);
        s.shutdown();
    }
}
