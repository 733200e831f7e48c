//! L2 capacity, eviction, quotas and the usage ledger over real adapters (fs on disk, mock),
//! and health that one failed batch does not take down.
#![allow(missing_docs, clippy::allow_attributes)]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lmcache_core::{CacheSalt, ObjectKey};
use lmcache_l1::{L1Cache, WriteRequest};
use lmcache_storage::testing::{SlotInternals, TierInternals};
use lmcache_storage::{L2Tier, TierConfig};
use serde_json::json;

mod common;

const OBJ: u64 = 64 * 1024;
const MIB_IN_GB: f64 = 1.0 / 1024.0;

fn l1(capacity: u64) -> L1Cache {
    common::l1(capacity)
}

fn key(i: u32, salt: &str) -> ObjectKey {
    let mut h = [0x77u8; 32];
    h[..4].copy_from_slice(&i.to_le_bytes());
    ObjectKey::new(h, "cap/model", 1, 0, 0, salt).unwrap()
}

fn put(l1: &L1Cache, k: &ObjectKey) {
    let mut w = l1.reserve_write(&[WriteRequest::new(k.clone(), OBJ)]).pop().unwrap().unwrap();
    w.as_mut_slice().fill(k.chunk_hash.as_bytes()[0]);
    w.commit().unwrap();
}

fn wait(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Keys the adapter has finished with: written, skipped, failed or refused admission.
fn settled(tier: &L2Tier) -> u64 {
    let a = &tier.adapters()[0].stats;
    [
        &a.stored_keys,
        &a.skipped_keys,
        &a.store_failures,
        &a.quota_rejections,
        &a.capacity_rejections,
    ]
    .iter()
    .map(|c| c.load(Ordering::Relaxed))
    .sum()
}

/// Bytes of the blob files under an fs adapter's directory (temporaries included).
fn disk_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for shard in std::fs::read_dir(dir).unwrap().flatten() {
        if let Ok(files) = std::fs::read_dir(shard.path()) {
            total +=
                files.flatten().filter_map(|f| f.metadata().ok()).map(|m| m.len()).sum::<u64>();
        }
    }
    total
}

fn lookup(tier: &L2Tier, keys: &[ObjectKey]) -> Vec<bool> {
    let a = tier.adapters()[0].adapter();
    let keys = keys.to_vec();
    tier.block_on(async move { a.lookup(&keys).await.unwrap() })
}

#[test]
fn fs_l2_never_exceeds_its_capacity_and_keeps_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    let cap = 1u64 << 20; // 1 MiB: 15 objects of 64 KiB and their headers
    let spec = json!({"type": "fs", "base_path": dir.path(), "max_capacity_gb": MIB_IN_GB,
        "eviction": {"eviction_policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2}});
    let l1 = l1(16 << 20);
    let tier = L2Tier::start(l1.clone(), &[spec], TierConfig::default()).unwrap();
    // Watch the directory while the stores run.
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (stop, peak, dir) = (stop.clone(), peak.clone(), dir.path().to_owned());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(disk_bytes(&dir), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    // One store at a time, as requests arrive (a batch larger than the capacity would have its
    // newest writes refused, since nothing in flight can be evicted).
    let n = 60u32;
    for i in 0..n {
        put(&l1, &key(i, ""));
        tier.submit_store([key(i, "")]);
        wait("the store to settle", || settled(&tier) > i as u64);
    }
    stop.store(true, Ordering::Relaxed);
    watcher.join().unwrap();
    let slot = &tier.adapters()[0];
    let u = slot.usage();
    assert!(
        peak.load(Ordering::Relaxed) <= cap,
        "disk held {} > {cap}",
        peak.load(Ordering::Relaxed)
    );
    assert!(u.used <= cap, "ledger says {} > {cap}", u.used);
    assert_eq!(u.used, disk_bytes(dir.path()), "the ledger matches the disk");
    assert!(slot.stats.evicted_keys.load(Ordering::Relaxed) >= (n - 15) as u64);
    assert_eq!(slot.stats.capacity_rejections.load(Ordering::Relaxed), 0);
    // The newest are kept, the oldest went.
    assert_eq!(
        lookup(&tier, &[key(0, ""), key(1, ""), key(n - 1, ""), key(n - 2, "")]),
        vec![false, false, true, true]
    );
}

#[test]
fn ledger_is_seeded_from_the_backend_and_goes_down_on_delete_and_eviction() {
    let dir = tempfile::tempdir().unwrap();
    let plain = json!({"type": "fs", "base_path": dir.path()});
    {
        let l1 = l1(16 << 20);
        let tier =
            L2Tier::start(l1.clone(), std::slice::from_ref(&plain), TierConfig::default()).unwrap();
        for i in 0..10 {
            put(&l1, &key(i, ""));
        }
        tier.submit_store((0..10).map(|i| key(i, "")));
        wait("10 stores", || settled(&tier) >= 10);
        tier.shutdown();
    }
    let on_disk = disk_bytes(dir.path());
    // A new server on the same directory counts what is there.
    let tier = L2Tier::start(l1(4 << 20), &[plain], TierConfig::default()).unwrap();
    wait("the start-up scan", || tier.adapters()[0].seeded());
    let u = tier.adapters()[0].usage();
    assert_eq!((u.keys, u.used), (10, on_disk));
    assert_eq!(u.by_salt, vec![(CacheSalt::EMPTY, on_disk)]);
    let gone: Vec<ObjectKey> = (0..4).map(|i| key(i, "")).collect();
    let deleted = tier.block_on(tier.delete(None, gone));
    assert_eq!(deleted.unwrap(), 4);
    let u = tier.adapters()[0].usage();
    assert_eq!((u.keys, u.used), (6, disk_bytes(dir.path())));
    drop(tier);

    // A server whose capacity is below what the directory holds evicts down to the watermark.
    let cap = 6 * OBJ; // 6 objects' payload: the 6 blobs (with headers) cross 0.8 of it
    let spec = json!({"type": "fs", "base_path": dir.path(), "max_capacity_gb": cap as f64 / (1u64 << 30) as f64,
        "eviction": {"eviction_policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2}});
    let tier = L2Tier::start(l1(4 << 20), &[spec], TierConfig::default()).unwrap();
    wait("eviction after the scan", || {
        tier.adapters()[0].seeded() && tier.adapters()[0].usage().used as f64 <= 0.8 * cap as f64
    });
    assert_eq!(tier.adapters()[0].usage().used, disk_bytes(dir.path()));
}

#[test]
fn l2_quotas_evict_the_tenant_over_its_limit_and_isolated_lru_refuses_tenants_without_one() {
    let spec = json!({"type": "mock", "max_size_gb": 1,
        "eviction": {"eviction_policy": "IsolatedLRU"}});
    let l1 = l1(32 << 20);
    let tier = L2Tier::start(l1.clone(), &[spec], TierConfig::default()).unwrap();
    let a = CacheSalt::new("tenant-a").unwrap();
    let limit = 4 * OBJ + 4096; // four blobs and their headers
    tier.set_quota(&a, Some(limit));
    let keys = (0..10).map(|i| key(i, "tenant-a")).chain((100..103).map(|i| key(i, "tenant-b")));
    for (n, k) in keys.enumerate() {
        put(&l1, &k);
        tier.submit_store([k]);
        wait("the store to settle", || settled(&tier) > n as u64);
    }
    let slot = tier.adapters()[0].clone();
    assert!(tier.usage_of(&a) <= limit, "tenant-a holds {} > {limit}", tier.usage_of(&a));
    assert_eq!(slot.stats.quota_rejections.load(Ordering::Relaxed), 3, "tenant-b has no quota");
    assert_eq!(
        lookup(&tier, &[key(100, "tenant-b"), key(9, "tenant-a"), key(0, "tenant-a")]),
        vec![false, true, false]
    );
    // Lowering the quota evicts within a second, and only that tenant.
    tier.set_quota(&a, Some(2 * OBJ + 2048));
    wait("the quota pass", || tier.usage_of(&a) <= 2 * OBJ + 2048);
    assert_eq!(tier.quotas().len(), 1);
}

#[test]
fn one_failed_batch_never_marks_a_healthy_adapter_down_repeated_failures_do() {
    let spec = json!({"type": "fault_inject", "rate": 1.0, "ops": ["store", "lookup"],
        "mode": "fail", "inner": {"type": "mock", "max_size_gb": 1}});
    let l1 = l1(16 << 20);
    let cfg = TierConfig { retry_backoff: Duration::from_millis(1), ..TierConfig::default() };
    let tier = L2Tier::start(l1.clone(), &[spec], cfg).unwrap();
    put(&l1, &key(1, ""));
    tier.submit_store([key(1, "")]);
    wait("the failed store", || settled(&tier) >= 1);
    let slot = tier.adapters()[0].clone();
    assert_eq!(slot.stats.store_failures.load(Ordering::Relaxed), 1);
    assert!(slot.healthy(), "one failed batch (with its retries) took the adapter down");
    assert_eq!(slot.stats.marked_down.load(Ordering::Relaxed), 0);
    // Repeated failures do.
    for i in 2..4 {
        put(&l1, &key(i, ""));
        tier.submit_store([key(i, "")]);
        wait("a failed store", || settled(&tier) >= i as u64);
    }
    assert!(slot.stats.marked_down.load(Ordering::Relaxed) >= 1, "repeated failures: still up");
    // Its pings answer (the faults hit stores and lookups only), so it comes back by itself.
    wait("a ping to bring it back", || slot.healthy());
}
