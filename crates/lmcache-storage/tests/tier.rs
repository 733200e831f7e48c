//! The L2 tier over a real L1: write-behind, prefetch back into L1, integrity and faults.
#![allow(missing_docs, clippy::allow_attributes)]

use std::time::{Duration, Instant};

use lmcache_core::ObjectKey;
use lmcache_l1::{L1Cache, WriteRequest};
use lmcache_storage::testing::{SlotInternals, TierInternals};
use lmcache_storage::{L2Tier, PrefetchRequest, TierConfig};
use serde_json::{Value, json};

mod common;

const OBJ: u64 = 64 * 1024;

fn l1(capacity: u64) -> L1Cache {
    common::l1(capacity)
}

fn key(i: u32) -> ObjectKey {
    let mut h = [0u8; 32];
    h[..4].copy_from_slice(&i.to_le_bytes());
    ObjectKey::new(h, "test/model", 1, 0, 0, "").unwrap()
}

fn pattern(i: u32) -> Vec<u8> {
    (0..OBJ as usize).map(|j| (j as u32).wrapping_mul(31).wrapping_add(i * 7) as u8).collect()
}

fn put(l1: &L1Cache, i: u32) {
    let mut w = l1.reserve_write(&[WriteRequest::new(key(i), OBJ)]).pop().unwrap().unwrap();
    w.as_mut_slice().copy_from_slice(&pattern(i));
    w.commit().unwrap();
}

fn wait_stored(tier: &L2Tier, n: u64) {
    let t0 = Instant::now();
    loop {
        let done: u64 = tier
            .adapters()
            .iter()
            .map(|a| {
                a.stats.stored_keys.load(std::sync::atomic::Ordering::Relaxed)
                    + a.stats.skipped_keys.load(std::sync::atomic::Ordering::Relaxed)
                    + a.stats.store_failures.load(std::sync::atomic::Ordering::Relaxed)
            })
            .min()
            .unwrap_or(0);
        if done >= n {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "stores did not finish: {done}/{n}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Stores `n` objects through L1, evicts them from L1, prefetches them back and checks bytes.
fn round_trip(spec: Value, n: u32) -> (L2Tier, L1Cache) {
    let l1 = l1(64 << 20);
    let tier = L2Tier::start(l1.clone(), &[spec], TierConfig::default()).unwrap();
    for i in 0..n {
        put(&l1, i);
    }
    tier.submit_store((0..n).map(key));
    wait_stored(&tier, n as u64);
    l1.clear(true);
    assert!(!l1.contains(&key(0)));
    let out = tier
        .prefetch_blocking(PrefetchRequest { shards: vec![(0..n).map(key).collect()], readers: 1 });
    assert_eq!(out.hits, n as usize, "every chunk should come back from L2");
    assert_eq!(out.loaded_keys, n as usize);
    for (i, lease) in out.leases[0].iter().enumerate() {
        assert_eq!(lease.bytes(), &pattern(i as u32)[..], "chunk {i} differs after L2 round trip");
    }
    (tier, l1)
}

#[test]
fn mock_round_trip_with_every_lossless_codec() {
    let dir = tempfile::tempdir().unwrap();
    let kp = dir.path().join("k");
    std::fs::write(&kp, [5u8; 32]).unwrap();
    for serde in [
        json!(null),
        json!({"type": "lz4"}),
        json!({"type": "zstd"}),
        json!({"type": "aesgcm", "master_key_path": kp}),
    ] {
        let mut spec = json!({"type": "mock", "max_size_gb": 1});
        if !serde.is_null() {
            spec["serde"] = serde;
        }
        round_trip(spec, 8);
    }
}

#[test]
fn fs_round_trip_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let spec = json!({"type": "fs", "base_path": dir.path()});
    let (tier, _l1) = round_trip(spec.clone(), 16);
    tier.shutdown();
    drop(tier);
    // A new tier over the same directory finds the keys again.
    let l1b = l1(64 << 20);
    let tier2 = L2Tier::start(l1b.clone(), &[spec], TierConfig::default()).unwrap();
    let out = tier2.prefetch_blocking(PrefetchRequest {
        shards: vec![(0..16).map(key).collect()],
        readers: 1,
    });
    assert_eq!(out.hits, 16);
    assert_eq!(out.leases[0][5].bytes(), &pattern(5)[..]);
}

#[test]
fn raw_block_round_trip_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("dev.img");
    let spec = json!({"type": "raw_block", "device_path": dev, "slot_bytes": 128 * 1024,
        "capacity_bytes": 32 << 20, "meta_total_bytes": 1 << 20, "use_odirect": false});
    let (tier, _l1) = round_trip(spec.clone(), 16);
    drop(tier); // no clean close: recovery must replay the journal
    let l1b = l1(64 << 20);
    let tier2 = L2Tier::start(l1b, &[spec], TierConfig::default()).unwrap();
    let out = tier2.prefetch_blocking(PrefetchRequest {
        shards: vec![(0..16).map(key).collect()],
        readers: 1,
    });
    assert_eq!(out.hits, 16);
    assert_eq!(out.leases[0][15].bytes(), &pattern(15)[..]);
}

#[test]
fn prefix_stops_at_the_first_chunk_nowhere() {
    let l1 = l1(64 << 20);
    let tier = L2Tier::start(
        l1.clone(),
        &[json!({"type": "mock", "max_size_gb": 1})],
        TierConfig::default(),
    )
    .unwrap();
    for i in 0..6 {
        put(&l1, i);
    }
    tier.submit_store([0, 1, 3, 4, 5].map(key)); // chunk 2 never reaches L2
    wait_stored(&tier, 5);
    l1.clear(true);
    let out = tier
        .prefetch_blocking(PrefetchRequest { shards: vec![(0..6).map(key).collect()], readers: 2 });
    assert_eq!(out.hits, 2);
    assert_eq!(out.loaded_keys, 2, "chunks after the gap are not loaded");
    assert_eq!(out.leases[0][0].count(), 2);
}

#[test]
fn loading_a_chunk_never_evicts_another_chunk_of_the_same_request() {
    // L1 holds 8 objects: chunks 1..8 of a request and, used last, an unrelated object. The
    // request's chunk 0 is only in L2; loading it needs room, and the room must come from
    // the unrelated object, not from chunk 1 (the prefix would end there: 1 of 8, with all 8
    // in L1 and L2 between them). A slab L1 whose staging holds one request hit 6 of 8 so.
    let l1 = l1(8 * OBJ);
    let tier = L2Tier::start(
        l1.clone(),
        &[json!({"type": "mock", "max_size_gb": 1})],
        TierConfig::default(),
    )
    .unwrap();
    for i in 0..8 {
        put(&l1, i);
    }
    tier.submit_store((0..8).map(key));
    wait_stored(&tier, 8);
    assert!(l1.delete(&[key(0)], false)[0].is_ok());
    put(&l1, 100);
    tier.submit_store([key(100)]);
    wait_stored(&tier, 9);
    let out = tier
        .prefetch_blocking(PrefetchRequest { shards: vec![(0..8).map(key).collect()], readers: 1 });
    assert_eq!(out.loaded_keys, 1);
    assert_eq!(out.hits, 8, "a chunk of the request was evicted for another of its chunks");
    for (i, lease) in out.leases[0].iter().enumerate() {
        assert_eq!(lease.bytes(), &pattern(i as u32)[..], "chunk {i}");
    }
    assert!(!l1.contains(&key(100)), "the unrelated object made the room");
}

#[test]
fn a_watermark_pass_during_a_load_spares_the_requests_chunks_already_in_l1() {
    // L1 holds 8 objects. Chunks 0 and 1 of a request are only in a slow L2, 2..8 in L1
    // too. While 0 and 1 load, their reservations fill L1 and the watermark pass (80 %)
    // evicts a fifth of it: never the request's own chunks (it used to take 2 and 3, and
    // the prefix ended at 2 with all 8 in L1 and L2 between them).
    let l1 = l1(8 * OBJ);
    let spec = json!({"type": "fault_inject", "rate": 1.0, "mode": "delay", "delay_ms": 1000,
        "ops": ["load"], "inner": {"type": "mock", "max_size_gb": 1}});
    let tier = L2Tier::start(l1.clone(), &[spec], TierConfig::default()).unwrap();
    for i in 0..8 {
        put(&l1, i);
    }
    tier.submit_store((0..8).map(key));
    wait_stored(&tier, 8);
    assert!(l1.delete(&[key(0), key(1)], false).iter().all(Result::is_ok));
    let (tier, l1b) = (std::sync::Arc::new(tier), l1.clone());
    let t = tier.clone();
    let prefetch = std::thread::spawn(move || {
        t.prefetch_blocking(PrefetchRequest { shards: vec![(0..8).map(key).collect()], readers: 1 })
    });
    let t0 = Instant::now();
    while l1b.usage().used_bytes < 8 * OBJ {
        assert!(t0.elapsed() < Duration::from_secs(20), "the loads never reserved their room");
        std::thread::sleep(Duration::from_millis(2));
    }
    let report = l1.run_maintenance();
    let out = prefetch.join().unwrap();
    assert_eq!(report.watermark_evicted_bytes, 0, "the pass evicted a chunk of the request");
    assert_eq!((out.loaded_keys, out.hits), (2, 8));
    for (i, lease) in out.leases[0].iter().enumerate() {
        assert_eq!(lease.bytes(), &pattern(i as u32)[..], "chunk {i}");
    }
}

#[test]
fn corrupt_truncated_and_failing_loads_are_misses_never_wrong_bytes() {
    for mode in ["corrupt", "truncate", "fail", "miss"] {
        let l1 = l1(64 << 20);
        let spec = json!({"type": "fault_inject", "rate": 1.0, "mode": mode, "ops": ["load"],
            "inner": {"type": "mock", "max_size_gb": 1}});
        let tier = L2Tier::start(l1.clone(), &[spec], TierConfig::default()).unwrap();
        for i in 0..4 {
            put(&l1, i);
        }
        tier.submit_store((0..4).map(key));
        wait_stored(&tier, 4);
        l1.clear(true);
        let out = tier.prefetch_blocking(PrefetchRequest {
            shards: vec![(0..4).map(key).collect()],
            readers: 1,
        });
        assert_eq!(out.hits, 0, "{mode}: a faulted load must be a miss");
        assert!(!l1.contains(&key(0)), "{mode}: nothing unverified may enter L1");
        if mode == "corrupt" || mode == "truncate" {
            let c =
                tier.adapters()[0].stats.corrupt_blobs.load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(c, 4, "{mode}: every refused blob is counted");
        }
    }
}

/// Faults on store, lookup and load, at rates from 0 to 1, in every mode that applies: every
/// key the injector chose stays out of L1 (not only the first of a prefix), every other key
/// comes back with its own bytes (or, once failures mark the adapter down, misses), and each
/// is prefetched on its own so one fault cannot hide another behind a prefix miss.
#[test]
fn faults_at_any_rate_never_let_a_faulty_key_into_l1() {
    use lmcache_l2::adapters::fault_inject::chosen_by;
    const N: u32 = 48;
    let cases: &[(&str, &[&str])] = &[
        ("store", &["fail"]),
        ("lookup", &["fail", "miss"]),
        ("load", &["fail", "miss", "corrupt", "truncate"]),
    ];
    for &(op, modes) in cases {
        for &mode in modes {
            for rate in [0.0, 0.1, 0.5, 0.9, 1.0] {
                let seed = 7 + (rate * 100.0) as u64;
                let l1 = l1(64 << 20);
                let spec = json!({"type": "fault_inject", "rate": rate, "seed": seed,
                    "mode": mode, "ops": [op], "inner": {"type": "mock", "max_size_gb": 1}});
                let tier = L2Tier::start(l1.clone(), &[spec], TierConfig::default()).unwrap();
                for i in 0..N {
                    put(&l1, i);
                }
                tier.submit_store((0..N).map(key));
                wait_stored(&tier, u64::from(N));
                l1.clear(true);
                let (mut faulted, mut sound_hits) = (0, 0);
                for i in 0..N {
                    let chosen = chosen_by(seed, rate, &key(i));
                    faulted += u32::from(chosen);
                    let out = tier.prefetch_blocking(PrefetchRequest {
                        shards: vec![vec![key(i)]],
                        readers: 1,
                    });
                    let case = format!("{op}/{mode} at {rate}, key {i}");
                    if chosen {
                        assert_eq!(out.hits, 0, "{case}: a faulted key hit");
                        assert!(!l1.contains(&key(i)), "{case}: a faulted key entered L1");
                    } else if out.hits == 1 {
                        assert_eq!(out.leases[0][0].bytes(), &pattern(i)[..], "{case}: bytes");
                        sound_hits += 1;
                    } else {
                        // Failing operations (not misses or bad bytes) count against the
                        // adapter's health: once marked down, sound keys miss too.
                        assert_eq!(mode, "fail", "{case}: a sound key missed");
                    }
                }
                if rate <= 0.5 {
                    assert!(sound_hits > 0, "{op}/{mode} at {rate}: nothing came back");
                }
                let want = match rate {
                    0.0 => 0..=0,
                    1.0 => N..=N,
                    _ => 1..=N - 1,
                };
                assert!(want.contains(&faulted), "{op}/{mode} at {rate}: {faulted} chosen");
                l1.check_invariants().unwrap();
            }
        }
    }
}

#[test]
fn higher_priority_adapter_serves_and_lower_fills_gaps() {
    let l1 = l1(64 << 20);
    let specs =
        [json!({"type": "mock", "max_size_gb": 1}), json!({"type": "mock", "max_size_gb": 1})];
    let tier = L2Tier::start(l1.clone(), &specs, TierConfig::default()).unwrap();
    for i in 0..4 {
        put(&l1, i);
    }
    tier.submit_store((0..4).map(key));
    wait_stored(&tier, 4);
    // Drop chunk 1 from the first adapter only.
    let first = tier.adapters()[0].adapter();
    tier.block_on(async move { first.delete(&[key(1)]).await.unwrap() });
    l1.clear(true);
    let out = tier
        .prefetch_blocking(PrefetchRequest { shards: vec![(0..4).map(key).collect()], readers: 1 });
    assert_eq!(out.hits, 4);
    let loaded =
        |i: usize| tier.adapters()[i].stats.loaded_keys.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!((loaded(0), loaded(1)), (3, 1));
}

#[test]
fn slow_adapter_hits_the_deadline_without_hanging() {
    let l1 = l1(64 << 20);
    let spec = json!({"type": "fault_inject", "rate": 1.0, "mode": "delay", "delay_ms": 3000,
        "ops": ["load"], "inner": {"type": "mock", "max_size_gb": 1}});
    let cfg = TierConfig { prefetch_deadline: Duration::from_millis(200), ..TierConfig::default() };
    let tier = L2Tier::start(l1.clone(), &[spec], cfg).unwrap();
    put(&l1, 0);
    tier.submit_store([key(0)]);
    wait_stored(&tier, 1);
    l1.clear(true);
    let t0 = Instant::now();
    let out = tier.prefetch_blocking(PrefetchRequest { shards: vec![vec![key(0)]], readers: 1 });
    assert!(t0.elapsed() < Duration::from_secs(2), "deadline not honoured");
    assert!(out.expired);
    assert_eq!(out.hits, 0);
}

#[test]
fn full_queue_drops_are_counted_and_engine_never_waits() {
    let l1 = l1(64 << 20);
    let spec = json!({"type": "mock", "max_size_gb": 1, "latency_ms": 50});
    let cfg = TierConfig {
        store_queue_keys: 4,
        store_concurrency: 1,
        store_batch: 1,
        ..TierConfig::default()
    };
    let tier = L2Tier::start(l1.clone(), &[spec], cfg).unwrap();
    for i in 0..64 {
        put(&l1, i);
    }
    let t0 = Instant::now();
    tier.submit_store((0..64).map(key));
    assert!(t0.elapsed() < Duration::from_millis(50), "submit must not wait on L2");
    let dropped = tier.stats().store_dropped.load(std::sync::atomic::Ordering::Relaxed);
    let queued = tier.stats().store_enqueued.load(std::sync::atomic::Ordering::Relaxed);
    assert!(dropped > 0, "a 4-key queue cannot take 64 keys at once");
    assert_eq!(dropped + queued, 64);
}

#[derive(Debug, Default)]
struct Seen {
    stored: std::sync::Mutex<Vec<lmcache_storage::StoreReport>>,
    prefetched: std::sync::Mutex<Vec<lmcache_storage::PrefetchReport>>,
    refused: std::sync::atomic::AtomicUsize,
}

impl lmcache_storage::TierObserver for Seen {
    fn stored(&self, r: &lmcache_storage::StoreReport) {
        self.stored.lock().unwrap().push(r.clone());
    }
    fn prefetched(&self, r: &lmcache_storage::PrefetchReport) {
        self.prefetched.lock().unwrap().push(r.clone());
    }
    fn blob_refused(&self, _: u64, _: &ObjectKey, _: &str) {
        self.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn observer_hears_stores_prefetches_and_refusals() {
    let l1 = l1(64 << 20);
    let spec = json!({"type": "fault_inject", "rate": 1.0, "mode": "corrupt", "ops": ["load"],
        "inner": {"type": "mock", "max_size_gb": 1}});
    let tier = L2Tier::start(l1.clone(), &[spec], TierConfig::default()).unwrap();
    let seen = std::sync::Arc::new(Seen::default());
    tier.set_observer(seen.clone());
    for i in 0..3 {
        put(&l1, i);
    }
    tier.submit_store((0..3).map(key));
    wait_stored(&tier, 3);
    let written: usize = seen.stored.lock().unwrap().iter().map(|r| r.written).sum();
    assert_eq!(written, 3);
    l1.clear(true);
    tier.prefetch_blocking(PrefetchRequest { shards: vec![(0..3).map(key).collect()], readers: 1 });
    let p = seen.prefetched.lock().unwrap().clone();
    assert_eq!(p.len(), 1);
    assert_eq!((p[0].chunks, p[0].hits, p[0].loaded_keys), (3, 0, 0));
    assert_eq!(seen.refused.load(std::sync::atomic::Ordering::Relaxed), 3);
}

#[test]
fn fs_direct_loads_refuse_a_flipped_byte_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let l1 = l1(64 << 20);
    let spec = json!({"type": "fs", "base_path": dir.path()});
    let tier = L2Tier::start(l1.clone(), &[spec], TierConfig::default()).unwrap();
    for i in 0..2 {
        put(&l1, i);
    }
    tier.submit_store((0..2).map(key));
    wait_stored(&tier, 2);
    // Flip one payload byte of chunk 1's file (same length: only the checksum can tell).
    let mut files = Vec::new();
    let mut stack = vec![dir.path().to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                files.push(e.path());
            }
        }
    }
    assert_eq!(files.len(), 2);
    let target = files.iter().find(|p| {
        let b = std::fs::read(p).unwrap();
        lmcache_l2::Codec::None.decode(&key(1), &b).is_ok()
    });
    let target = target.unwrap();
    let mut b = std::fs::read(target).unwrap();
    let n = b.len();
    b[n - 100] ^= 0x01;
    std::fs::write(target, b).unwrap();
    l1.clear(true);
    let out = tier
        .prefetch_blocking(PrefetchRequest { shards: vec![(0..2).map(key).collect()], readers: 1 });
    assert_eq!(out.hits, 1, "chunk 0 is intact, chunk 1 must be a miss");
    assert!(!l1.contains(&key(1)), "a corrupt payload must never become resident");
    assert_eq!(
        tier.adapters()[0].stats.corrupt_blobs.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}
