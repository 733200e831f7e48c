//! Concurrent writers, readers, deleters and eviction on one L1, for a bounded number of
//! operations. Every read checks the bytes belong to the key read (a use-after-free or an
//! overlapping allocation would show another key's bytes); at the end the accounting must
//! balance and every handle must have released what it held.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::*;
use lmcache_core::ObjectKey;
use lmcache_l1::{EvictionPolicyKind, L1Cache, WriteRequest};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const KEYS: u32 = 400;
const OPS_PER_THREAD: usize = 20_000;
/// Hits the readers must see before the writers may stop. The writers keep storing until
/// then (up to `WRITER_ROUNDS_CAP`), so the hit count does not depend on how the threads
/// were scheduled: on a loaded machine the writers could otherwise finish before the
/// readers ran, and a last clear by the janitor left the readers nothing to hit.
const MIN_HITS: u64 = 1000;
const WRITER_ROUNDS_CAP: usize = 50 * OPS_PER_THREAD;

fn fill(buf: &mut [u8], k: u32) {
    buf.fill((k % 251) as u8);
    buf[..4].copy_from_slice(&k.to_be_bytes());
}

fn verify(buf: &[u8], k: u32) -> bool {
    buf[..4] == k.to_be_bytes() && buf[4..].iter().all(|&b| b == (k % 251) as u8)
}

fn size_of(k: u32) -> u64 {
    // Mostly one size (the KV case), some others.
    if k % 10 == 0 { 3 * PAGE - 17 } else { PAGE }
}

fn writer(c: L1Cache, seed: u64, stores: Arc<AtomicU64>, reads: Arc<AtomicU64>) {
    let mut rng = SmallRng::seed_from_u64(seed);
    for round in 0..WRITER_ROUNDS_CAP {
        if round >= OPS_PER_THREAD / 4 && reads.load(Ordering::Relaxed) >= MIN_HITS {
            break;
        }
        let start = rng.gen_range(0..KEYS);
        let n = rng.gen_range(1..=4);
        let keys: Vec<u32> = (start..start + n).map(|k| k % KEYS).collect();
        let reqs: Vec<WriteRequest> =
            keys.iter().map(|&k| WriteRequest::new(key(k), size_of(k))).collect();
        let mut ok = Vec::new();
        for (k, r) in keys.iter().zip(c.reserve_write(&reqs)) {
            if let Ok(mut w) = r {
                fill(w.as_mut_slice(), *k);
                ok.push(w);
            }
        }
        if rng.gen_bool(0.05) {
            drop(ok); // abandoned reservations
        } else {
            stores.fetch_add(
                c.commit_batch(ok).iter().filter(|r| r.is_ok()).count() as u64,
                Ordering::Relaxed,
            );
        }
    }
}

/// Reads for at least `OPS_PER_THREAD` rounds and until every writer is done, so the reads
/// overlap the whole write window however the threads are scheduled (on a loaded machine the
/// readers could otherwise finish before the writers stored anything).
fn reader(c: L1Cache, seed: u64, reads: Arc<AtomicU64>, writers_done: Arc<AtomicBool>) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut round = 0usize;
    while round < OPS_PER_THREAD || !writers_done.load(Ordering::Acquire) {
        round += 1;
        let k = rng.gen_range(0..KEYS);
        let keys: Vec<ObjectKey> = (k..k + 3).map(|k| key(k % KEYS)).collect();
        let leases = c.read_lock_prefix(&keys, rng.gen_range(1..3)).unwrap();
        for (i, lease) in leases.iter().enumerate() {
            let kk = (k + i as u32) % KEYS;
            assert!(verify(lease.bytes(), kk), "key {kk}: foreign bytes under a read lock");
        }
        reads.fetch_add(leases.len() as u64, Ordering::Relaxed);
        if rng.gen_bool(0.3) {
            c.touch(&keys);
        }
        // Hold some leases across an eviction-heavy window.
        if rng.gen_bool(0.01) {
            std::thread::yield_now();
        }
        drop(leases);
    }
}

fn janitor(c: L1Cache, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    for i in 0..OPS_PER_THREAD / 2 {
        match rng.gen_range(0..100) {
            0..60 => {
                c.evict(None, rng.gen_range(1..8) * PAGE);
            }
            60..90 => {
                let k = key(rng.gen_range(0..KEYS));
                let _ = c.delete(&[k], rng.gen_bool(0.3));
            }
            90..98 => {
                c.run_maintenance();
            }
            _ => {
                c.clear(i % 7 == 0);
            }
        }
    }
}

fn stress(policy: EvictionPolicyKind) {
    // Smaller than the key space: constant pressure.
    let c = cache_with(160 * PAGE, policy);
    let reads = Arc::new(AtomicU64::new(0));
    let stores = Arc::new(AtomicU64::new(0));
    let writers_done = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    let mut threads = Vec::new();
    for t in 0..2u64 {
        let (c2, s, r) = (c.clone(), stores.clone(), reads.clone());
        writers.push(std::thread::spawn(move || writer(c2, t, s, r)));
        let (c2, r, d) = (c.clone(), reads.clone(), writers_done.clone());
        threads.push(std::thread::spawn(move || reader(c2, 100 + t, r, d)));
    }
    let c2 = c.clone();
    threads.push(std::thread::spawn(move || janitor(c2, 7)));
    for t in writers {
        t.join().expect("a writer thread panicked");
    }
    writers_done.store(true, Ordering::Release);
    for t in threads {
        t.join().expect("a stress thread panicked");
    }
    c.check_invariants().unwrap();
    let u = c.usage();
    assert_eq!(u.staged_objects, 0, "reservation leaked");
    assert_eq!(u.locked_objects, 0, "read lock leaked");
    assert!(stores.load(Ordering::Relaxed) > 1000, "writers barely ran");
    assert!(reads.load(Ordering::Relaxed) >= MIN_HITS, "readers barely hit");
    c.clear(false);
    assert_eq!(c.usage().used_bytes, 0);
    assert_eq!(c.memory().usage().allocator.allocated_bytes, 0);
}

#[test]
fn stress_lru() {
    stress(EvictionPolicyKind::Lru);
}

#[test]
fn stress_arc() {
    stress(EvictionPolicyKind::Arc);
}

#[test]
fn stress_s3fifo() {
    stress(EvictionPolicyKind::S3Fifo);
}

#[test]
fn stress_isolated_lru() {
    stress(EvictionPolicyKind::IsolatedLru);
}
