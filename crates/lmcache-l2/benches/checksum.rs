//! The blob payload checksum (xxh3-64) against a plain copy of the same bytes, at the sizes
//! L2 moves: 256 KiB (LMCache's bench l2 default) and 32 MiB (a 256-token chunk of LMCache's
//! default model). Every L2 store computes it once and every load verifies it once, so it is
//! the verification cost on top of the I/O.
//!
//! `twox_hash` (what lmcache-l2 uses) picks AVX2 or SSE2 at run time; `xxhash_rust` is
//! compiled for the build's target features only (SSE2 on a default x86_64 build).
//! Also a 32 MiB read from the page cache verified in a second pass or a piece at a time, and
//! a 32 MiB file written after a hash pass or hashed a piece at a time as it is written.
//! Run: `cargo bench -p lmcache-l2 --bench checksum`.
#![expect(missing_docs, reason = "criterion macros generate undocumented items")]
use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn bench_checksum(c: &mut Criterion) {
    let mut group = c.benchmark_group("payload_checksum");
    for (name, len) in [("256KiB", 256usize << 10), ("32MiB", 32 << 20)] {
        let data: Vec<u8> =
            (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8).collect();
        let mut dst = vec![0u8; len];
        group.throughput(Throughput::Bytes(len as u64));
        group.bench_function(format!("twox_hash_xxh3_dispatch_{name}"), |b| {
            b.iter(|| black_box(twox_hash::XxHash3_64::oneshot(black_box(&data))))
        });
        group.bench_function(format!("xxhash_rust_xxh3_static_{name}"), |b| {
            b.iter(|| black_box(xxhash_rust::xxh3::xxh3_64(black_box(&data))))
        });
        group.bench_function(format!("memcpy_{name}"), |b| {
            b.iter(|| {
                dst.copy_from_slice(black_box(&data));
                black_box(dst.as_ptr());
            })
        });
    }
    group.finish();
}

/// A 32 MiB load from the page cache and its verification: read whole then hashed (a second
/// pass over memory), or read and hashed a piece at a time while each piece is in cache
/// (`PieceHasher`, what fs, raw_block and dax do), against the read alone. The file lives in
/// `$LMCACHE_RS_BENCH_DIR` (default: the system's temporary directory).
fn bench_read_and_verify(c: &mut Criterion) {
    use lmcache_l2::blob::PieceHasher;
    use std::io::{Read, Seek, SeekFrom, Write};
    let len = 32usize << 20;
    let data: Vec<u8> = (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8).collect();
    let dir = std::env::var_os("LMCACHE_RS_BENCH_DIR").map_or_else(std::env::temp_dir, Into::into);
    let path = dir.join(format!("lmcache-rs-checksum-bench.{}", std::process::id()));
    std::fs::write(&path, &data).unwrap();
    let mut f = std::fs::File::open(&path).unwrap();
    let mut dst = vec![0u8; len];
    let mut group = c.benchmark_group("load_32MiB_from_page_cache");
    group.throughput(Throughput::Bytes(len as u64));
    group.bench_function("read_only", |b| {
        b.iter(|| {
            f.seek(SeekFrom::Start(0)).unwrap();
            f.read_exact(&mut dst).unwrap();
        })
    });
    group.bench_function("read_then_hash", |b| {
        b.iter(|| {
            f.seek(SeekFrom::Start(0)).unwrap();
            f.read_exact(&mut dst).unwrap();
            black_box(twox_hash::XxHash3_64::oneshot(&dst))
        })
    });
    group.bench_function("read_and_hash_in_pieces", |b| {
        b.iter(|| {
            f.seek(SeekFrom::Start(0)).unwrap();
            let mut h = PieceHasher::new();
            for piece in dst.chunks_mut(PieceHasher::PIECE) {
                f.read_exact(piece).unwrap();
                h.piece(piece);
            }
            black_box(h.finish())
        })
    });
    group.finish();
    let _ = std::fs::remove_file(&path);
    // The store side: a new 32 MiB file written alone, after a hash pass over the payload,
    // or with each piece hashed right before its write (what fs does).
    let mut group = c.benchmark_group("store_32MiB_to_page_cache");
    group.throughput(Throughput::Bytes(len as u64));
    let fresh = |tag: &str| {
        let p = dir.join(format!("lmcache-rs-checksum-bench.{}.{tag}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        (std::fs::File::create(&p).unwrap(), p)
    };
    group.bench_function("write_only", |b| {
        b.iter(|| {
            let (mut f, p) = fresh("w");
            f.write_all(&data).unwrap();
            drop(f);
            std::fs::remove_file(p).unwrap();
        })
    });
    group.bench_function("hash_then_write", |b| {
        b.iter(|| {
            let (mut f, p) = fresh("h");
            black_box(twox_hash::XxHash3_64::oneshot(&data));
            f.write_all(&data).unwrap();
            drop(f);
            std::fs::remove_file(p).unwrap();
        })
    });
    group.bench_function("hash_and_write_in_pieces", |b| {
        b.iter(|| {
            let (mut f, p) = fresh("p");
            let mut h = PieceHasher::new();
            for piece in data.chunks(PieceHasher::PIECE) {
                h.piece(piece);
                f.write_all(piece).unwrap();
            }
            black_box(h.finish());
            drop(f);
            std::fs::remove_file(p).unwrap();
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench_checksum, bench_read_and_verify
}
criterion_main!(benches);
