//! Realistic objects through every adapter, shared by two servers: LMCache's default model
//! shape makes a 256-token chunk 32 MiB, so each test stores 4 such chunks (one 1024-token
//! request) through server A's tier and loads them through server B's, which has its own L1
//! and never saw the stores; then A writes more while B keeps reading them, and every hit B
//! gets must be byte-exact (B never serves a blob A is still writing).
//!
//! Redis, the Redis Cluster and S3 need the servers `scripts/test` starts on loopback
//! (`LMCACHE_RS_TEST_REDIS`, `LMCACHE_RS_TEST_REDIS_CLUSTER`, `LMCACHE_RS_TEST_S3`); with
//! `LMCACHE_RS_REQUIRE_SERVICES=1` (set by scripts/test) a missing one fails the test.
#![allow(missing_docs, clippy::allow_attributes)]

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use lmcache_core::ObjectKey;
use lmcache_l1::{L1Cache, WriteRequest};
use lmcache_storage::testing::TierInternals;
use lmcache_storage::{L2Tier, PrefetchRequest, TierConfig};
use serde_json::{Value, json};

mod common;

const CHUNK: usize = 32 << 20;

fn l1() -> L1Cache {
    common::l1(320 << 20)
}

fn key(run: u64, i: u32) -> ObjectKey {
    let mut h = [0u8; 32];
    h[..8].copy_from_slice(&run.to_le_bytes());
    h[8..12].copy_from_slice(&i.to_le_bytes());
    ObjectKey::new(h, "meta-llama/Llama-3.1-8B", 1, 0, 0, "").unwrap()
}

/// A 32 MiB chunk whose every 8 bytes depend on the key and the offset.
fn fill(k: &ObjectKey, out: &mut [u8]) {
    let seed = u64::from_le_bytes(k.chunk_hash.as_bytes()[..8].try_into().unwrap())
        ^ u64::from(u32::from_le_bytes(k.chunk_hash.as_bytes()[8..12].try_into().unwrap())) << 40;
    for (j, w) in out.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&(j as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    }
}

fn check(k: &ObjectKey, got: &[u8]) {
    let mut want = vec![0u8; CHUNK];
    fill(k, &mut want);
    assert!(got == want.as_slice(), "{k}: bytes served differ from the bytes stored");
}

fn put(l1: &L1Cache, k: &ObjectKey) {
    let mut w =
        l1.reserve_write(&[WriteRequest::new(k.clone(), CHUNK as u64)]).pop().unwrap().unwrap();
    fill(k, w.as_mut_slice());
    w.commit().unwrap();
}

fn service(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ if std::env::var("LMCACHE_RS_REQUIRE_SERVICES").is_ok_and(|v| v == "1") => {
            panic!(
                "{var} is not set, but LMCACHE_RS_REQUIRE_SERVICES=1: start scripts/test-services"
            )
        }
        _ => {
            eprintln!("{var} not set: skipping (scripts/test starts the server and sets it)");
            None
        }
    }
}

fn stored(tier: &L2Tier) -> u64 {
    let s = &tier.adapters()[0].stats;
    assert_eq!(s.store_failures.load(Ordering::Relaxed), 0, "an L2 write failed");
    s.stored_keys.load(Ordering::Relaxed) + s.skipped_keys.load(Ordering::Relaxed)
}

fn wait(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(120), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn run_id() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// Stores one 1024-token request through A, loads it through B; then B reads while A writes.
/// `share` is false for a backend one process owns at a time (raw_block): B then opens it
/// after A has closed it.
fn two_servers(spec: Value, share: bool) {
    let run = run_id();
    let cfg = TierConfig { prefetch_deadline: Duration::from_secs(5), ..TierConfig::default() };
    let (l1a, l1b) = (l1(), l1());
    let a = L2Tier::start(l1a.clone(), std::slice::from_ref(&spec), cfg.clone()).unwrap();
    let first: Vec<ObjectKey> = (0..4).map(|i| key(run, i)).collect();
    for k in &first {
        put(&l1a, k);
    }
    a.submit_store(first.clone());
    wait("A's write-behind", || stored(&a) >= 4);
    let b_start = |a: &L2Tier| {
        if !share {
            a.shutdown();
        }
        L2Tier::start(l1b.clone(), std::slice::from_ref(&spec), cfg.clone()).unwrap()
    };
    let b = b_start(&a);
    let t0 = Instant::now();
    let out = b.prefetch_blocking(PrefetchRequest { shards: vec![first.clone()], readers: 1 });
    let took = t0.elapsed();
    assert_eq!(out.hits, 4, "B found {} of 4 chunks A stored ({spec})", out.hits);
    for (k, lease) in first.iter().zip(&out.leases[0]) {
        check(k, lease.bytes());
    }
    assert!(b.adapters()[0].healthy(), "B's adapter went down loading 4 x 32 MiB ({spec})");
    eprintln!("{}: B loaded 4 x 32 MiB in {took:?}", spec["type"]);
    drop(out);
    if !share {
        return;
    }
    // A writes 2 more while B keeps asking for them: B sees each one whole or not at all.
    let more: Vec<ObjectKey> = (4..6).map(|i| key(run, i)).collect();
    for k in &more {
        put(&l1a, k);
    }
    a.submit_store(more.clone());
    let mut served = 0;
    let t0 = Instant::now();
    loop {
        l1b.clear(true);
        let out = b.prefetch_blocking(PrefetchRequest { shards: vec![more.clone()], readers: 1 });
        for (k, lease) in more.iter().zip(&out.leases[0]) {
            check(k, lease.bytes());
            served += 1;
        }
        if out.hits == more.len() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "B never saw A's second write");
    }
    assert!(served >= 2);
}

#[test]
fn fs_shared_directory_32mib_chunks() {
    let dir = tempfile::tempdir().unwrap();
    two_servers(json!({"type": "fs", "base_path": dir.path()}), true);
}

#[test]
fn raw_block_32mib_chunks_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    two_servers(
        json!({"type": "raw_block", "device_path": dir.path().join("dev"),
               "slot_bytes": (33u64 << 20), "capacity_bytes": ((8 * 33u64) << 20) + (64 << 20)}),
        false,
    );
}

#[test]
fn redis_shared_by_two_servers_32mib_chunks() {
    let Some(addr) = service("LMCACHE_RS_TEST_REDIS") else { return };
    let (host, port) = addr.rsplit_once(':').unwrap();
    two_servers(
        json!({"type": "redis", "host": host, "port": port.parse::<u16>().unwrap(),
               "key_prefix": format!("shared-{}", run_id())}),
        true,
    );
}

#[test]
fn redis_cluster_shared_by_two_servers_32mib_chunks() {
    let Some(nodes) = service("LMCACHE_RS_TEST_REDIS_CLUSTER") else { return };
    two_servers(
        json!({"type": "redis", "startup_nodes": nodes, "cluster_mode": true,
               "key_prefix": format!("shared-{}", run_id())}),
        true,
    );
}

#[test]
fn s3_multipart_shared_by_two_servers_32mib_chunks() {
    let Some(url) = service("LMCACHE_RS_TEST_S3") else { return };
    let bucket = "lmcache-rs-test";
    // moto accepts any credentials; the bucket is made if missing.
    let spec = json!({"type": "s3", "endpoint_url": url, "bucket": bucket,
        "aws_access_key_id": "test", "aws_secret_access_key": "test",
        "s3_prefix": format!("shared-{}", run_id())});
    two_servers(spec, true);
}
