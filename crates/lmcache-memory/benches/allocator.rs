//! Allocator hot paths, side by side with the system allocator.
//!
//! Why: every L1 store allocates and every eviction frees; the target is <= 200 ns for an
//! allocate+free pair. Groups:
//! - `alloc_free/*`: one allocate and one free of a 256 KiB KV-sized object at steady state,
//!   for the raw offset allocator, the full `ArenaAllocator` (lock + handle), and
//!   `malloc`+`free` of the same size (the baseline).
//! - `batch8/*`: one all-or-nothing batch of 8 objects and their frees.
//!
//! Run: `cargo bench -p lmcache-memory --bench allocator`.
#![expect(missing_docs, reason = "criterion macros generate undocumented items")]

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use lmcache_memory::{Allocator, Arena, ArenaAllocator, ArenaBacking, ArenaConfig};

const OBJ: u64 = 256 << 10;
const ARENA: u64 = 1 << 30;

fn arena_allocator() -> ArenaAllocator {
    let arena =
        Arena::create(&ArenaConfig { size: ARENA, backing: ArenaBacking::Anonymous, mlock: false })
            .expect("arena");
    ArenaAllocator::new(arena, 4096).expect("allocator")
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free");
    // Half full, so the steady state is realistic (bins warm, free list non-trivial).
    let mut raw = Allocator::new(ARENA, 4096).expect("allocator");
    let keep: Vec<_> = (0..2048).map(|_| raw.allocate(OBJ).expect("fill")).collect();
    g.bench_function("offset_allocator_256k", |b| {
        b.iter(|| {
            let blk = raw.allocate(black_box(OBJ)).expect("alloc");
            raw.free(blk);
        })
    });
    drop(keep);
    let arena = arena_allocator();
    let keep: Vec<_> = (0..2048).map(|_| arena.allocate(OBJ).expect("fill")).collect();
    g.bench_function("arena_allocation_256k", |b| {
        b.iter(|| drop(black_box(arena.allocate(black_box(OBJ)).expect("alloc"))))
    });
    g.bench_function("system_malloc_256k", |b| {
        b.iter(|| drop(black_box(Vec::<u8>::with_capacity(black_box(OBJ as usize)))))
    });
    g.finish();

    let mut g = c.benchmark_group("batch8");
    g.bench_function("arena_allocate_batch_8x256k", |b| {
        b.iter(|| drop(black_box(arena.allocate_batch(&[OBJ; 8]).expect("batch"))))
    });
    g.bench_function("system_malloc_8x256k", |b| {
        b.iter(|| {
            let v: Vec<Vec<u8>> = (0..8).map(|_| Vec::with_capacity(OBJ as usize)).collect();
            drop(black_box(v))
        })
    });
    g.finish();
    drop(keep);
}

criterion_group!(benches, bench);
criterion_main!(benches);
