//! The CacheBlend fingerprint index: N stored chunks of 256 random tokens (one namespace, one
//! rank, each at a known position), then fragment queries of Q tokens that contain K stored
//! chunks at random, unaligned positions among unstored tokens. Reports the indexing rate,
//! bytes per indexed chunk (RSS growth, tokens included), and query latency p50/p99 with the
//! matches found (every query must find its K chunks).
//!
//! `cargo bench -p lmcache-directory --bench blend -- [chunks] [query_tokens] [hits] [queries]`
//! (defaults 100000 8192 8 2000). `benches/blend_lmcache.py` runs LMCache's BlendIndex on the
//! same workload for the ratio.

use std::time::Instant;

use lmcache_directory::{
    BlendConfig, DirKey, Directory, DirectoryConfig, Entry, EventKind, Namespace, Tier,
};
use rand::{Rng, SeedableRng};

const CS: usize = 256;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()).unwrap_or(0) * 4096
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let chunks = args.first().copied().unwrap_or(100_000);
    let qlen = args.get(1).copied().unwrap_or(8192);
    let hits = args.get(2).copied().unwrap_or(8);
    let queries = args.get(3).copied().unwrap_or(2000);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let contents: Vec<Vec<u32>> =
        (0..chunks).map(|_| (0..CS).map(|_| rng.gen_range(0..150_000)).collect()).collect();

    let before = rss_bytes();
    let mut d = Directory::new(DirectoryConfig {
        max_token_bindings: chunks,
        blend: Some(BlendConfig { chunk_size: CS, probe_stride: 1 }),
    });
    let ns = d
        .namespace(&Namespace {
            model: "m".into(),
            kv_rank: 1 << 24 | 1 << 8,
            object_group: 0,
            cache_salt: "".into(),
        })
        .unwrap();
    let a = d.instance("a").unwrap();
    let l1 = d.site(a, Tier::L1, "dram", false).unwrap();
    let t = Instant::now();
    for (batch, group) in contents.chunks(64).enumerate() {
        let e: Vec<Entry<'_>> = group
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let n = (batch * 64 + i) as u64;
                Entry {
                    key: DirKey { hash: *blake3::hash(&n.to_le_bytes()).as_bytes(), ns },
                    size: 1,
                    tokens: c,
                    token_offset: (n % 64 * CS as u64) as i64,
                }
            })
            .collect();
        d.apply(a, 1, EventKind::Store, l1, 0.0, &e).unwrap();
    }
    let index_s = t.elapsed().as_secs_f64();
    let grown = rss_bytes().saturating_sub(before);
    let st = d.blend_stats();
    assert_eq!(st.num_contents as usize, chunks);

    let mut lat = Vec::with_capacity(queries);
    let mut found = 0usize;
    for _ in 0..queries {
        let mut q: Vec<u32> = (0..qlen).map(|_| rng.gen_range(150_000..300_000)).collect();
        // K chunks at distinct, non-overlapping, unaligned positions.
        let slot = qlen / hits;
        for h in 0..hits {
            let at = h * slot + rng.gen_range(0..slot - CS);
            let c = &contents[rng.gen_range(0..chunks)];
            q[at..at + CS].copy_from_slice(c);
        }
        let t = Instant::now();
        let m = d.blend_matches(&q, "m", "", 1);
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        found += m.len();
    }
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    println!(
        "index: {chunks} chunks of {CS} tokens in {index_s:.3} s = {:.0} chunks/s; RSS +{:.0} B/chunk (tokens are {} B)",
        chunks as f64 / index_s,
        grown as f64 / chunks as f64,
        CS * 4
    );
    println!(
        "match: {queries} queries of {qlen} tokens with {hits} stored chunks each: p50 {:.1} us, p99 {:.1} us ({:.1} ns/token p50); found {found} of {}",
        pct(0.5),
        pct(0.99),
        pct(0.5) * 1000.0 / qlen as f64,
        queries * hits
    );
    assert!(found >= queries * hits, "every planted chunk must be found");
}
