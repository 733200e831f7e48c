//! L1 index hot paths, side by side with a plain `HashMap` lookup of the same keys.
//!
//! Why: every lookup checks residency of each chunk key and every store commits into the
//! index; targets are <= 150 ns for a resident-key lookup. Groups:
//! - `lookup/*`: `contains` on a resident key among 10k and 100k, vs `std::HashMap::get` with
//!   the same keys (the floor for a hashed index, without the lock).
//! - `prefix/*`: how many of a request's 16 chunk keys are resident.
//! - `read_lock/*`: read-lock and release one key (what a retrieve does per chunk).
//! - `store/*`: reserve + commit of one 256 KiB object into an L1 that is full, so every
//!   store evicts one object synchronously: the eviction throughput, per policy.
//! - `two_members/*`: an L1 of two members (`--l1-manager` twice): a key found in the first
//!   or the second, and a store that overflows from a full first member into the second.
//!
//! Run: `cargo bench -p lmcache-l1 --bench l1`.
#![expect(missing_docs, reason = "criterion macros generate undocumented items")]

use std::collections::HashMap;
use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use lmcache_core::ObjectKey;
use lmcache_l1::{EvictionPolicyKind, L1Cache, L1Config, L1Member, WriteRequest};
use lmcache_memory::{Arena, ArenaAllocator, ArenaBacking, ArenaConfig};

const OBJ: u64 = 256 << 10;

fn key(i: u32) -> ObjectKey {
    let mut h = [0u8; 32];
    h[..4].copy_from_slice(&i.to_be_bytes());
    h[4..8].copy_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
    ObjectKey::new(h, "meta-llama/Llama-3.1-8B-Instruct", 1, 0, 0, "").expect("key")
}

fn cache(capacity: u64, policy: EvictionPolicyKind) -> L1Cache {
    let arena = Arena::create(&ArenaConfig {
        size: capacity,
        backing: ArenaBacking::Anonymous,
        mlock: false,
    })
    .expect("arena");
    let memory = ArenaAllocator::new(arena, 4096).expect("allocator");
    L1Cache::new(L1Config { eviction_policy: policy, ..L1Config::default() }, memory)
        .expect("cache")
}

fn fill(c: &L1Cache, n: u32, size: u64) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(256) {
        let reqs: Vec<_> = chunk.iter().map(|&i| WriteRequest::new(key(i), size)).collect();
        let ws: Vec<_> = c.reserve_write(&reqs).into_iter().map(|r| r.expect("reserve")).collect();
        c.commit_batch(ws);
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("lookup");
    // 10k keys: the index fits the CPU caches; 100k keys (25 GiB of 256 KiB chunks): it does
    // not, and each probe is a DRAM miss for both the L1 and the HashMap baseline.
    for n in [10_000u32, 100_000] {
        let l1 = cache(n as u64 * 4096, EvictionPolicyKind::Lru);
        fill(&l1, n, 4096);
        let keys: Vec<ObjectKey> = (0..n).map(key).collect();
        let map: HashMap<ObjectKey, u64> = keys.iter().cloned().map(|k| (k, 0)).collect();
        let mut i = 0usize;
        g.bench_function(format!("l1_contains_resident_{n}"), |b| {
            b.iter(|| {
                i = (i + 7919) % keys.len();
                black_box(l1.contains(black_box(&keys[i])))
            })
        });
        g.bench_function(format!("std_hashmap_get_{n}"), |b| {
            b.iter(|| {
                i = (i + 7919) % keys.len();
                black_box(map.get(black_box(&keys[i])))
            })
        });
    }
    g.finish();

    const N: u32 = 100_000;
    let l1 = cache(N as u64 * 4096, EvictionPolicyKind::Lru);
    fill(&l1, N, 4096);
    let keys: Vec<ObjectKey> = (0..N).map(key).collect();
    let mut i = 0usize;
    let mut g = c.benchmark_group("prefix");
    g.bench_function("l1_prefix_hits_16_chunks_100k", |b| {
        b.iter(|| {
            i = (i + 7919) % (keys.len() - 16);
            black_box(l1.prefix_hits(black_box(&keys[i..i + 16])))
        })
    });
    g.finish();

    let mut g = c.benchmark_group("read_lock");
    g.bench_function("lock_and_release_one", |b| {
        b.iter(|| {
            i = (i + 7919) % keys.len();
            drop(black_box(l1.read_lock(std::slice::from_ref(&keys[i]), 1)))
        })
    });
    g.finish();
    drop(l1);

    let mut g = c.benchmark_group("store_evicting");
    g.throughput(Throughput::Elements(1));
    for policy in [
        EvictionPolicyKind::Lru,
        EvictionPolicyKind::Arc,
        EvictionPolicyKind::S3Fifo,
        EvictionPolicyKind::IsolatedLru,
    ] {
        let l1 = cache(4096 * OBJ, policy);
        fill(&l1, 4096, OBJ);
        let mut next = 1_000_000u32;
        g.bench_function(format!("{policy}_reserve_commit_256k_full"), |b| {
            b.iter(|| {
                next += 1;
                let w = l1.reserve_write(&[WriteRequest::new(key(next), OBJ)]).pop();
                let w = w.expect("one result").expect("evicts and reserves");
                w.commit().expect("commit");
            })
        });
    }
    g.finish();

    // Two members (--l1-manager twice), 10k keys each: a key of the second costs a probe of
    // the first too; a store that overflows tries the first (no eviction) before the second.
    let member = |n: u64| {
        let arena =
            Arena::create(&ArenaConfig { size: n, backing: ArenaBacking::Anonymous, mlock: false })
                .expect("arena");
        let memory = ArenaAllocator::new(arena, 4096).expect("allocator");
        L1Member::new(L1Config::default(), memory).expect("member")
    };
    let two = L1Cache::from_members(vec![
        ("first".into(), member(10_000 * 4096)),
        ("second".into(), member(10_000 * 4096 + 4096 * OBJ)),
    ])
    .expect("two members");
    fill(&two, 20_000, 4096);
    let keys: Vec<ObjectKey> = (0..20_000).map(key).collect();
    let mut g = c.benchmark_group("two_members");
    for (name, range) in [("first", 0..10_000usize), ("second", 10_000..20_000)] {
        g.bench_function(format!("contains_in_{name}"), |b| {
            b.iter(|| {
                i = range.start + (i + 7919) % range.len();
                black_box(two.contains(black_box(&keys[i])))
            })
        });
        g.bench_function(format!("read_lock_and_release_in_{name}"), |b| {
            b.iter(|| {
                i = range.start + (i + 7919) % range.len();
                drop(black_box(two.read_lock(std::slice::from_ref(&keys[i]), 1)))
            })
        });
    }
    let mut next = 2_000_000u32;
    g.throughput(Throughput::Elements(1));
    g.bench_function("overflow_reserve_commit_256k", |b| {
        b.iter(|| {
            next += 1;
            let w = two.reserve_write(&[WriteRequest::new(key(next), OBJ)]).pop();
            let w = w.expect("one result").expect("overflows and reserves");
            w.commit().expect("commit");
            // Keep the second member's room for the next round.
            two.delete(&[key(next)], true);
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
