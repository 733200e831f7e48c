//! The directory on the coordinator-anchors §8 workload: W servers × S sequences of 64 chunks
//! (16 from one of 1,000 shared "system prompts", 48 unique), one store batch per sequence.
//! Reports apply rate (G1), lookup latency of a stored sequence's 64-chunk prefix over the
//! servers (G3/G4: `prefix_runs`), bytes per membership (G7, RSS growth over the generated
//! trace), checkpoint encode/decode (G9), and RSS over rounds of prefix churn (G8: every
//! sequence replaced by a new one).
//!
//! `cargo bench -p lmcache-directory --bench directory -- [servers] [sequences] [churn_rounds]`
//! (defaults 64 2500 0: 10.24 M memberships). `LOOKUPS=n` in the environment sets the number
//! of lookups (100,000).

#![expect(clippy::needless_range_loop, reason = "server × sequence indices read clearer")]

use std::time::Instant;

use lmcache_directory::{
    DirKey, Directory, DirectoryConfig, Entry, EventKind, Namespace, RunQuery, SiteId, Tier,
};
use rand::{Rng, SeedableRng};

const LEN: usize = 64;
const SHARED: usize = 16;
const POOL: u64 = 1000;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()).unwrap_or(0) * 4096
}

fn hash(a: u64, b: u64) -> [u8; 32] {
    *blake3::hash(&[a.to_le_bytes(), b.to_le_bytes()].concat()).as_bytes()
}

/// Sequence `s` of generation `g`: its 64 chunk hashes (prefix-chained in spirit: a shared
/// head then a unique tail).
fn sequence(pool_id: u64, uniq: u64) -> Vec<[u8; 32]> {
    (0..LEN as u64)
        .map(|i| {
            if (i as usize) < SHARED {
                hash(pool_id, i)
            } else {
                hash(uniq ^ 0x5eed_0000_0000_0000, i)
            }
        })
        .collect()
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let servers = args.first().copied().unwrap_or(64);
    let seqs = args.get(1).copied().unwrap_or(2500);
    let churn = args.get(2).copied().unwrap_or(0);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    // The trace, generated before measuring: per server, its sequences.
    let trace: Vec<Vec<(u64, Vec<[u8; 32]>)>> = (0..servers)
        .map(|w| {
            (0..seqs)
                .map(|s| {
                    let uniq = (w * seqs + s) as u64;
                    let pool = rng.gen_range(0..POOL);
                    (pool, sequence(pool, uniq))
                })
                .collect()
        })
        .collect();
    let memberships = servers * seqs * LEN;
    let mut d = Directory::new(DirectoryConfig { max_token_bindings: 0, blend: None });
    let ns = d
        .namespace(&Namespace {
            model: "m".into(),
            kv_rank: 0x0100_0100,
            object_group: 0,
            cache_salt: "".into(),
        })
        .unwrap();
    let insts: Vec<_> = (0..servers).map(|w| d.instance(&format!("server-{w}")).unwrap()).collect();
    let sites: Vec<SiteId> =
        insts.iter().map(|&i| d.site(i, Tier::L1, "dram", false).unwrap()).collect();
    let rss0 = rss_bytes();
    let t = Instant::now();
    let mut entries: Vec<Entry<'_>> = Vec::with_capacity(LEN);
    // The longest single event batch: a table growth lands inside one.
    let mut stall = std::time::Duration::ZERO;
    for s in 0..seqs {
        for w in 0..servers {
            entries.clear();
            entries.extend(trace[w][s].1.iter().map(|h| Entry {
                key: DirKey { hash: *h, ns },
                size: 32 << 20,
                tokens: &[],
                token_offset: -1,
            }));
            let one = Instant::now();
            d.apply(insts[w], 1, EventKind::Store, sites[w], 0.0, &entries).unwrap();
            stall = stall.max(one.elapsed());
        }
    }
    let apply = t.elapsed();
    let rss1 = rss_bytes();
    let st = d.stats();
    println!(
        "workload: {servers} servers x {seqs} sequences x {LEN} chunks = {memberships} memberships, {} distinct keys",
        st.keys
    );
    println!(
        "G1 apply: {:.2} M chunk events/s ({:.2} s on one thread), longest batch {:.2} ms",
        memberships as f64 / apply.as_secs_f64() / 1e6,
        apply.as_secs_f64(),
        stall.as_secs_f64() * 1e3
    );
    println!(
        "G7 memory: {:.1} B/membership, {:.1} B/key (RSS +{} MiB; table {} MiB)",
        (rss1 - rss0) as f64 / memberships as f64,
        (rss1 - rss0) as f64 / st.keys as f64,
        (rss1 - rss0) >> 20,
        d.table_bytes() >> 20
    );
    // G9: the checkpoint image, encoded and decoded.
    let t = Instant::now();
    let mut image = Vec::new();
    d.encode(&mut image);
    let enc = t.elapsed();
    let t = Instant::now();
    let restored =
        Directory::decode(&image, DirectoryConfig { max_token_bindings: 0, blend: None }).unwrap();
    let dec = t.elapsed();
    assert_eq!(restored.stats(), d.stats());
    drop(restored);
    println!(
        "G9 restore: image {} MiB, encode {:.2} s, decode {:.2} s ({:.1} M memberships/s)",
        image.len() >> 20,
        enc.as_secs_f64(),
        dec.as_secs_f64(),
        memberships as f64 / dec.as_secs_f64() / 1e6
    );
    drop(image);
    // G9 without pausing ingest: the same image in steps of 16,384 keys (the coordinator's
    // step), each step one hold of the coordinator's lock.
    let t = Instant::now();
    let mut b = d.image_builder();
    let mut longest = std::time::Duration::ZERO;
    loop {
        let s = Instant::now();
        let done = d.image_step(&mut b, 16_384);
        longest = longest.max(s.elapsed());
        if done {
            break;
        }
    }
    let s = Instant::now();
    let parts = d.image_finish(b);
    longest = longest.max(s.elapsed());
    let stepped = parts.concat();
    println!(
        "G9 stepped image: {:.2} s in all, longest step {:.2} ms ({} MiB)",
        t.elapsed().as_secs_f64(),
        longest.as_secs_f64() * 1e3,
        stepped.len() >> 20
    );
    drop(stepped);
    // Lookups of stored sequences (`LOOKUPS` sets how many, for a profile of lookups alone).
    let n = std::env::var("LOOKUPS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let mut lat = Vec::with_capacity(n);
    let mut matched = 0u64;
    let mut keys: Vec<DirKey> = Vec::with_capacity(LEN);
    for _ in 0..n {
        let w = rng.gen_range(0..servers);
        let s = rng.gen_range(0..seqs);
        keys.clear();
        keys.extend(trace[w][s].1.iter().map(|h| DirKey { hash: *h, ns }));
        let t = Instant::now();
        let runs = d.prefix_runs(RunQuery { keys: &keys, per_chunk: 1 });
        lat.push(t.elapsed().as_nanos() as u64);
        matched += runs.len() as u64;
        assert!(
            runs.first().is_some_and(|r| r.l1 == LEN as u32),
            "the storing server holds the whole prefix"
        );
    }
    lat.sort_unstable();
    let p = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)] as f64 / 1000.0;
    println!(
        "G3/G4 lookup (64-chunk prefix, avg {:.1} servers per answer): p50 {:.2} us, p99 {:.2} us, p99.9 {:.2} us",
        matched as f64 / n as f64,
        p(0.5),
        p(0.99),
        p(0.999)
    );
    if churn > 0 {
        // The bench's own copy of the live sequences exists before the baseline is read.
        let mut current: Vec<Vec<Vec<[u8; 32]>>> =
            trace.iter().map(|w| w.iter().map(|(_, s)| s.clone()).collect()).collect();
        let mut rss = vec![rss_bytes()];
        let mut events = 0usize;
        let t = Instant::now();
        for round in 1..=churn {
            for w in 0..servers {
                for s in 0..seqs {
                    let uniq = ((round * servers + w) * seqs + s) as u64 + (1 << 40);
                    // Same shape as the fill: 16 chunks from one of 1,000 prompts of this
                    // round (new prefixes every round), 48 unique.
                    let fresh = sequence(POOL * round as u64 + uniq % POOL, uniq);
                    entries.clear();
                    entries.extend(current[w][s].iter().map(|h| Entry {
                        key: DirKey { hash: *h, ns },
                        size: 0,
                        tokens: &[],
                        token_offset: -1,
                    }));
                    d.apply(insts[w], 1, EventKind::Delete, sites[w], 0.0, &entries).unwrap();
                    entries.clear();
                    entries.extend(fresh.iter().map(|h| Entry {
                        key: DirKey { hash: *h, ns },
                        size: 32 << 20,
                        tokens: &[],
                        token_offset: -1,
                    }));
                    d.apply(insts[w], 1, EventKind::Store, sites[w], 0.0, &entries).unwrap();
                    events += 2 * LEN;
                    current[w][s] = fresh;
                }
            }
            rss.push(rss_bytes());
            if round == 5 || round == churn {
                println!(
                    "G8 churn round {round}: RSS {} MiB, {} keys, table {} MiB",
                    rss[round] >> 20,
                    d.stats().keys,
                    d.table_bytes() >> 20
                );
            }
        }
        println!(
            "G8 churn: {:.2} M store+remove events/s; RSS after fill {} MiB -> after {churn} rounds {} MiB ({:+.1}%)",
            events as f64 / t.elapsed().as_secs_f64() / 1e6,
            rss[0] >> 20,
            rss[churn] >> 20,
            (rss[churn] as f64 / rss[0] as f64 - 1.0) * 100.0
        );
    }
}
