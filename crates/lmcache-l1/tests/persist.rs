//! An L1 in a file arena restarts warm: what was committed and sealed before a shutdown is
//! resident again, byte for byte, after `adopt`; quotas, the policy and the listener see it.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{PAGE, key, key_salted};
use lmcache_core::ObjectKey;
use lmcache_l1::{L1Cache, L1Config, L1Listener, Sealer, WriteRequest};
use lmcache_memory::{Arena, ArenaAllocator, ArenaBacking, ArenaConfig, FileBacking};

const SIZE: u64 = 64 << 20;

fn file_cache(path: &Path, adopt: bool) -> L1Cache {
    let arena = Arena::create(&ArenaConfig {
        size: SIZE,
        backing: ArenaBacking::File(FileBacking { path: path.to_owned(), format: false, adopt }),
        mlock: false,
    })
    .unwrap();
    L1Cache::new(L1Config::default(), ArenaAllocator::new(arena, PAGE).unwrap()).unwrap()
}

fn bytes_of(k: &ObjectKey, len: usize) -> Vec<u8> {
    let seed = k.chunk_hash.0[3] as usize + k.cache_salt.as_str().len();
    (0..len).map(|i| (i * 7 + seed) as u8).collect()
}

fn store(cache: &L1Cache, keys: &[ObjectKey], len: usize) {
    let reqs: Vec<_> = keys.iter().map(|k| WriteRequest::new(k.clone(), len as u64)).collect();
    for (r, k) in cache.reserve_write(&reqs).into_iter().zip(keys) {
        let mut w = r.unwrap();
        w.as_mut_slice().copy_from_slice(&bytes_of(k, len));
        w.commit().unwrap();
    }
}

#[derive(Debug, Default)]
struct Heard(Mutex<Vec<ObjectKey>>);

impl L1Listener for Heard {
    fn removed(&self, _key: &ObjectKey) {}
    fn committed(&self, key: &ObjectKey, _bytes: u64) {
        self.0.lock().unwrap().push(key.clone());
    }
}

#[test]
fn a_warm_shutdown_is_adopted_whole_by_the_next_cache() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l1");
    let len = 1 << 20;
    let keys: Vec<_> = (0..6).map(key).chain([key_salted(99, "tenant-a")]).collect();
    {
        let cache = file_cache(&path, true);
        let sealer = Sealer::spawn(&cache).unwrap().expect("a file arena seals");
        store(&cache, &keys, len);
        // One object deleted before the shutdown: its record goes with it.
        cache.delete(&keys[..1], false).into_iter().for_each(|r| r.unwrap());
        assert_eq!(cache.drain_seals(Duration::from_secs(10)), 0);
        let s = cache.persist_stats();
        assert_eq!((s.sealed + s.seal_skipped, s.pending), (7, 0), "{s:?}");
        cache.memory().detach_catalog();
        drop(sealer);
    }
    let cache = file_cache(&path, true);
    let heard = Arc::new(Heard::default());
    cache.set_listener(heard.clone());
    assert_eq!(cache.adopt(), 6);
    assert_eq!(cache.adopt(), 0, "once");
    cache.check_invariants().unwrap();
    assert!(!cache.contains(&keys[0]), "the deleted object stays deleted");
    for k in &keys[1..] {
        let lease = cache.read_lock(std::slice::from_ref(k), 1).pop().unwrap().unwrap();
        assert_eq!(lease.bytes(), bytes_of(k, len), "{k}");
        assert_eq!(lease.known_checksum(), Some(twox_hash::XxHash3_64::oneshot(lease.bytes())));
    }
    assert_eq!(heard.0.lock().unwrap().len(), 6, "the listener heard each adopted object");
    assert_eq!(cache.usage_of(&keys[6].cache_salt), len as u64, "the tenant is charged");
    let s = cache.persist_stats();
    assert_eq!((s.adopted, s.adopted_bytes, s.adopt_refused), (6, 6 * len as u64, 0));
    // announce_resident repeats them for a listener installed late.
    heard.0.lock().unwrap().clear();
    cache.announce_resident();
    assert_eq!(heard.0.lock().unwrap().len(), 6);
    // The adopted objects are ordinary residents: evictable, and their memory reusable.
    assert_eq!(cache.delete(&keys[1..], false).iter().filter(|r| r.is_ok()).count(), 6);
    store(&cache, &keys, len);
    cache.check_invariants().unwrap();
}

#[test]
fn a_shutdown_without_detach_or_a_cold_start_adopts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l1");
    let keys: Vec<_> = (0..3).map(key).collect();
    {
        let cache = file_cache(&path, true);
        let _sealer = Sealer::spawn(&cache).unwrap();
        store(&cache, &keys, 4096);
        cache.drain_seals(Duration::from_secs(10));
        // No detach: the objects drop with the cache and their records with them.
    }
    assert_eq!(file_cache(&path, true).adopt(), 0);
    {
        let cache = file_cache(&path, true);
        let _sealer = Sealer::spawn(&cache).unwrap();
        store(&cache, &keys, 4096);
        cache.drain_seals(Duration::from_secs(10));
        cache.memory().detach_catalog();
    }
    assert_eq!(file_cache(&path, false).adopt(), 0, "a cold start drops what was kept");
}

#[test]
fn anonymous_memory_has_no_sealer() {
    let cache = common::cache(1 << 20);
    assert!(Sealer::spawn(&cache).unwrap().is_none());
    assert_eq!(cache.drain_seals(Duration::ZERO), 0);
}
