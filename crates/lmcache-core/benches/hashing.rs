//! Token hashing throughput, in token bytes per second (4 bytes per token).
//!
//! Why: every lookup and store hashes its prompt; LMCache's target is >= 1 GB/s of token
//! bytes on one core. Run: `cargo bench -p lmcache-core --bench hashing`.
#![expect(missing_docs, reason = "criterion macros generate undocumented items")]
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use lmcache_core::TokenHasher;
use std::hint::black_box;

fn bench_hashing(c: &mut Criterion) {
    let mut group = c.benchmark_group("token_hashing");
    for tokens in [256usize, 4096, 32768] {
        let seq: Vec<u32> = (0..tokens as u32).map(|t| t.wrapping_mul(2_654_435_761)).collect();
        let hasher = TokenHasher::default();
        group.throughput(Throughput::Bytes((tokens * 4) as u64));
        group.bench_function(format!("blake3_chain_{tokens}_tokens"), |b| {
            b.iter(|| black_box(hasher.hash_tokens(black_box(&seq))))
        });
    }
    // Baseline: BLAKE3 itself on one chunk's message (32-byte prefix + 1024 token bytes),
    // the floor for any implementation of LMCache's chain.
    let msg = [7u8; 32 + 1024];
    group.throughput(Throughput::Bytes(1024));
    group.bench_function("raw_blake3_one_1056_byte_message", |b| {
        b.iter(|| black_box(blake3::hash(black_box(&msg))))
    });
    // Growing a request by one chunk: the incremental hasher does one chunk of work.
    let hasher = TokenHasher::default();
    let seq: Vec<u32> = (0..4096u32).collect();
    let mut base = hasher.prefix_hasher();
    base.extend(&seq[..3840]);
    group.throughput(Throughput::Bytes(256 * 4));
    group.bench_function("incremental_extend_one_chunk", |b| {
        b.iter_batched_ref(
            || base.clone(),
            |h| black_box(h.extend(&seq[3840..]).len()),
            criterion::BatchSize::SmallInput,
        )
    });
    group.finish();

    // Several requests at once: each chain is sequential, requests are independent, so a
    // batch scales with cores (`TokenHasher::hash_many`). 16 and 64 requests of 4096 tokens.
    let mut group = c.benchmark_group("token_hashing_batch");
    let hasher = TokenHasher::default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for n in [16u32, 64] {
        let reqs: Vec<Vec<u32>> = (0..n)
            .map(|r| (0..4096u32).map(|t| (t ^ (r << 24)).wrapping_mul(2_654_435_761)).collect())
            .collect();
        let refs: Vec<&[u32]> = reqs.iter().map(Vec::as_slice).collect();
        group.throughput(Throughput::Bytes(u64::from(n) * 4096 * 4));
        group.bench_function(format!("{n}_requests_one_thread"), |b| {
            b.iter(|| black_box(hasher.hash_many(black_box(&refs), 1)))
        });
        group.bench_function(format!("{n}_requests_{cores}_threads"), |b| {
            b.iter(|| black_box(hasher.hash_many(black_box(&refs), cores)))
        });
    }
    group.finish();
}

criterion_group!(benches, bench_hashing);
criterion_main!(benches);
