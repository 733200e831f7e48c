//! The server's CacheBlend matcher on the workload: N stored chunks of 256 random
//! tokens fingerprinted (one namespace, runs of one chunk), then queries of Q tokens holding
//! K stored chunks at random unaligned positions among unstored tokens. Reports the
//! fingerprinting rate and query latency p50/p99, and checks every planted chunk is found.
//! `benches/blend_matcher_lmcache.py` runs LMCache 0.5.6's `BlendTokenRangeMatcher` on the
//! same workload for the ratio.
//!
//! `cargo bench -p lmcache-blend --bench matcher -- [chunks] [query_tokens] [hits] [queries]`
//! (defaults 100000 8192 8 2000).

use std::time::Instant;

use lmcache_blend::{Matcher, Namespace, StoredRun};

const CS: usize = 256;

/// A small deterministic generator (xorshift64*), so runs are repeatable without a crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let arg = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let (chunks, qlen, hits, queries) = (arg(0, 100_000), arg(1, 8192), arg(2, 8), arg(3, 2000));
    let mut rng = Rng(7);
    let contents: Vec<Vec<u32>> =
        (0..chunks).map(|_| (0..CS).map(|_| rng.below(150_000) as u32).collect()).collect();
    let ns = Namespace { model: "m".into(), world_size: 1, cache_salt: "".into() };
    let mut m = Matcher::new(CS, false);
    let t = Instant::now();
    for (n, c) in contents.iter().enumerate() {
        let mut hash = [0u8; 32];
        hash[..8].copy_from_slice(&(n as u64).to_le_bytes());
        let run = StoredRun {
            tokens: c,
            hashes: &[hash],
            start_chunk: 0,
            position: ((n % 64) * CS) as u64,
        };
        m.register(&ns, run);
    }
    let index_s = t.elapsed().as_secs_f64();
    let slot = qlen / hits;
    let (mut lat, mut found) = (Vec::with_capacity(queries), 0usize);
    for i in 0..queries + 20 {
        let mut q: Vec<u32> = (0..qlen).map(|_| 150_000 + rng.below(150_000) as u32).collect();
        for h in 0..hits {
            let at = h * slot + rng.below((slot - CS) as u64) as usize;
            q[at..at + CS].copy_from_slice(&contents[rng.below(chunks as u64) as usize]);
        }
        let t = Instant::now();
        let got = m.find(&ns, &q);
        let us = t.elapsed().as_secs_f64() * 1e6;
        if i >= 20 {
            lat.push(us);
            found += got.len();
        }
    }
    lat.sort_by(f64::total_cmp);
    let (p50, p99) = (lat[lat.len() / 2], lat[(lat.len() * 99 / 100).min(lat.len() - 1)]);
    println!(
        "lmcache-rs Matcher index: {chunks} chunks in {index_s:.3} s = {:.0} chunks/s",
        chunks as f64 / index_s
    );
    println!(
        "lmcache-rs Matcher match: {queries} queries of {qlen} tokens with {hits} stored chunks \
         each: p50 {p50:.1} us, p99 {p99:.1} us; found {found} of {}",
        queries * hits
    );
    assert!(found >= queries * hits, "a planted chunk was missed");
}
