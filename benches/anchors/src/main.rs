//! lmcache-rs's directory, Dynamo's `dynamo-kv-router` 1.6.1 `RadixTree` (one thread) and
//! SMG's `kv-index` 2.0.0 `ChainIndex` (the strongest single-core anchor in
//! coordinator-anchors.md §8) on the same trace: W servers × S sequences of 64 chunks (16 from
//! one of 1,000 shared prompts, 48 unique), one store event of 64 blocks per sequence; then
//! 100,000 lookups of a stored sequence's 64 blocks. Reports ingest (blocks/s), lookup
//! p50/p99/p99.9, bytes per membership (RSS growth over the generated trace) and the ratios.
//!
//! Each index runs in a fresh process of its own (this program again, with `--only NAME`),
//! from a heap that no earlier index has grown: run one after another in one process, a later
//! index took the pages an earlier one freed, so it paid fewer page faults in its ingest and
//! showed less RSS growth. `--same-process` runs all three in this process, as before.
//!
//! `--repeat N` runs the three N times, interleaved (ours, ChainIndex, RadixTree, ours, ...),
//! and reports each figure's median: this host is noisy, and one run of each can land on a
//! quiet moment for one index and a busy one for the next.
//!
//! `cargo run --release --manifest-path benches/anchors/Cargo.toml -- [servers] [sequences]
//! [--repeat N] [--same-process]`

#![expect(clippy::needless_range_loop, reason = "server × sequence indices read clearer")]

use std::time::Instant;

use dynamo_kv_router::RadixTree;
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};
use lmcache_directory::{
    DirKey, Directory, DirectoryConfig, Entry, EventKind, Namespace, RunQuery, Tier,
};
use rand::{Rng, SeedableRng};

const LEN: usize = 64;
const SHARED: usize = 16;
const POOL: u64 = 1000;

fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()).unwrap_or(0) * 4096
}

fn h(parts: &[u64]) -> [u8; 32] {
    let mut x = blake3::Hasher::new();
    for p in parts {
        x.update(&p.to_le_bytes());
    }
    *x.finalize().as_bytes()
}

fn word(b: &[u8; 32]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    u64::from_le_bytes(w)
}

/// One block: the prefix-chained hash (LMCache's key; its first word is the anchor's
/// sequence hash) and the position-free content hash the anchor also needs.
#[derive(Clone, Copy)]
struct Block {
    chained: [u8; 32],
    content: u64,
}

struct Stats {
    ingest: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    bytes: f64,
}

impl Stats {
    fn of(ingest: f64, bytes: f64, mut lat: Vec<u64>) -> Self {
        lat.sort_unstable();
        Self {
            ingest,
            p50: pct(&mut lat, 0.5),
            p99: pct(&mut lat, 0.99),
            p999: pct(&mut lat, 0.999),
            bytes,
        }
    }

    /// Each figure's median over `all` (the upper one of an even count).
    fn median(all: &[Stats]) -> Stats {
        let of = |f: fn(&Stats) -> f64| {
            let mut v: Vec<f64> = all.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        Stats {
            ingest: of(|s| s.ingest),
            p50: of(|s| s.p50),
            p99: of(|s| s.p99),
            p999: of(|s| s.p999),
            bytes: of(|s| s.bytes),
        }
    }
}

fn pct(v: &mut [u64], q: f64) -> f64 {
    v[((v.len() as f64 * q) as usize).min(v.len() - 1)] as f64 / 1000.0
}

/// The three indexes, as `--only` names them.
const INDEXES: [&str; 3] = ["lmcache-rs", "chain", "dynamo"];

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<usize> = argv.iter().filter_map(|a| a.parse().ok()).collect();
    let (servers, seqs) =
        (args.first().copied().unwrap_or(64), args.get(1).copied().unwrap_or(2500));
    let only = argv.iter().position(|a| a == "--only").and_then(|i| argv.get(i + 1));
    let same_process = argv.iter().any(|a| a == "--same-process");
    let repeat = argv
        .iter()
        .position(|a| a == "--repeat")
        .and_then(|i| argv.get(i + 1))
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(1)
        .max(1);
    println!(
        "trace: {servers} servers x {seqs} sequences x {LEN} blocks = {} memberships; 100,000 lookups of 64 blocks",
        servers * seqs * LEN
    );
    let [ours, chain, dynamo] = match (only, same_process) {
        (Some(name), _) => {
            let stats = run(name, servers, seqs);
            // The parent reads this line.
            println!(
                "stats {} {} {} {} {}",
                stats.ingest, stats.p50, stats.p99, stats.p999, stats.bytes
            );
            return;
        }
        (None, same_process) => {
            let mut runs: [Vec<Stats>; 3] = Default::default();
            for _ in 0..repeat {
                for (name, all) in INDEXES.iter().zip(runs.iter_mut()) {
                    all.push(if same_process {
                        run(name, servers, seqs)
                    } else {
                        in_child(name, servers, seqs)
                    });
                }
            }
            runs.map(|all| Stats::median(&all))
        }
    };
    if repeat > 1 {
        println!("medians of {repeat} runs each, interleaved");
    }
    report(&ours, &dynamo, &chain);
}

/// Runs index `name` in a fresh process of this program and reads its figures.
fn in_child(name: &str, servers: usize, seqs: usize) -> Stats {
    let exe = std::env::current_exe().expect("this program's path");
    let out = std::process::Command::new(exe)
        .args([servers.to_string(), seqs.to_string(), "--only".into(), name.into()])
        .output()
        .expect("the child runs");
    assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find_map(|l| l.strip_prefix("stats ")).expect("a stats line");
    let v: Vec<f64> = line.split(' ').map(|x| x.parse().expect("a number")).collect();
    Stats { ingest: v[0], p50: v[1], p99: v[2], p999: v[3], bytes: v[4] }
}

fn run(name: &str, servers: usize, seqs: usize) -> Stats {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let trace: Trace = (0..servers)
        .map(|w| {
            (0..seqs)
                .map(|s| {
                    let pool = rng.gen_range(0..POOL);
                    let mut parent = [0u8; 32];
                    (0..LEN as u64)
                        .map(|i| {
                            let content = if (i as usize) < SHARED {
                                word(&h(&[1, pool, i]))
                            } else {
                                word(&h(&[2, w as u64, s as u64, i]))
                            };
                            parent = h(&[word(&parent), content, i]);
                            Block { chained: parent, content }
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    let memberships = (servers * seqs * LEN) as f64;
    let queries: Vec<(usize, usize)> =
        (0..100_000).map(|_| (rng.gen_range(0..servers), rng.gen_range(0..seqs))).collect();
    match name {
        "lmcache-rs" => run_ours(&trace, &queries, memberships),
        "chain" => run_chain(&trace, &queries, memberships),
        "dynamo" => run_dynamo(&trace, &queries, memberships),
        other => panic!("no index {other}: one of {INDEXES:?}"),
    }
}

type Trace = Vec<Vec<Vec<Block>>>;

fn run_ours(trace: &Trace, queries: &[(usize, usize)], memberships: f64) -> Stats {
    let (servers, seqs) = (trace.len(), trace[0].len());
    let r0 = rss();
    let mut d = Directory::new(DirectoryConfig { max_token_bindings: 0, blend: None });
    let ns = d
        .namespace(&Namespace {
            model: "m".into(),
            kv_rank: 0x0100_0100,
            object_group: 0,
            cache_salt: "".into(),
        })
        .unwrap();
    let inst: Vec<_> = (0..servers).map(|w| d.instance(&format!("s{w}")).unwrap()).collect();
    let sites: Vec<_> = inst.iter().map(|&i| d.site(i, Tier::L1, "dram", false).unwrap()).collect();
    let t = Instant::now();
    let mut entries = Vec::with_capacity(LEN);
    for s in 0..seqs {
        for w in 0..servers {
            entries.clear();
            entries.extend(trace[w][s].iter().map(|b| Entry {
                key: DirKey { hash: b.chained, ns },
                size: 1,
                tokens: &[],
                token_offset: -1,
            }));
            d.apply(inst[w], 1, EventKind::Store, sites[w], 0.0, &entries).unwrap();
        }
    }
    let ingest = memberships / t.elapsed().as_secs_f64();
    let bytes = (rss() - r0) as f64 / memberships;
    let mut lat = Vec::with_capacity(queries.len());
    let mut keys = Vec::with_capacity(LEN);
    for &(w, s) in queries {
        keys.clear();
        keys.extend(trace[w][s].iter().map(|b| DirKey { hash: b.chained, ns }));
        let t = Instant::now();
        let runs = d.prefix_runs(RunQuery { keys: &keys, per_chunk: 1 });
        lat.push(t.elapsed().as_nanos() as u64);
        assert!(runs.iter().any(|r| r.l1 == LEN as u32));
    }
    Stats::of(ingest, bytes, lat)
}

fn run_chain(trace: &Trace, queries: &[(usize, usize)], memberships: f64) -> Stats {
    let (servers, seqs) = (trace.len(), trace[0].len());
    let r0 = rss();
    let idx = if servers > 256 { ChainIndex::with_max_workers(servers) } else { ChainIndex::new() };
    let ids: Vec<u32> =
        (0..servers).map(|w| idx.intern_worker(&format!("s{w}")).unwrap()).collect();
    let mut maps: Vec<ChainBlockMap> = (0..servers).map(|_| ChainBlockMap::new()).collect();
    let t = Instant::now();
    let mut blocks = Vec::with_capacity(LEN);
    for s in 0..seqs {
        for w in 0..servers {
            blocks.clear();
            blocks.extend(trace[w][s].iter().map(|b| StoredBlock {
                seq_hash: SequenceHash(word(&b.chained)),
                content_hash: ContentHash(b.content),
            }));
            idx.apply_stored(ids[w], &blocks, None, &mut maps[w]).unwrap();
        }
    }
    let ingest = memberships / t.elapsed().as_secs_f64();
    let bytes = (rss() - r0) as f64 / memberships;
    let mut lat = Vec::with_capacity(queries.len());
    let mut hashes = Vec::with_capacity(LEN);
    for &(w, s) in queries {
        hashes.clear();
        hashes.extend(trace[w][s].iter().map(|b| ContentHash(b.content)));
        let t = Instant::now();
        let scores = idx.find_matches(&hashes, false);
        lat.push(t.elapsed().as_nanos() as u64);
        assert!(scores.scores.values().any(|&d| d == LEN as u32));
    }
    Stats::of(ingest, bytes, lat)
}

/// dynamo-kv-router's RadixTree: its single-threaded index; blocks carry the chained hash and
/// the content hash, as Dynamo's engines report them.
fn run_dynamo(trace: &Trace, queries: &[(usize, usize)], memberships: f64) -> Stats {
    let (servers, seqs) = (trace.len(), trace[0].len());
    let r0 = rss();
    let mut tree = RadixTree::new();
    let t = Instant::now();
    let mut event_id = 0u64;
    for s in 0..seqs {
        for w in 0..servers {
            event_id += 1;
            let blocks = trace[w][s]
                .iter()
                .map(|b| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(word(&b.chained)),
                    tokens_hash: LocalBlockHash(b.content),
                    mm_extra_info: None,
                })
                .collect();
            let event = KvCacheEvent {
                event_id,
                data: KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: None,
                    start_position: None,
                    blocks,
                }),
                dp_rank: 0,
            };
            tree.apply_event(RouterEvent::new(w as u64, event)).unwrap();
        }
    }
    let ingest = memberships / t.elapsed().as_secs_f64();
    let bytes = (rss() - r0) as f64 / memberships;
    let mut lat = Vec::with_capacity(queries.len());
    for &(w, s) in queries {
        // Its API takes the query by value: building it is part of a lookup.
        let t = Instant::now();
        let hashes: Vec<LocalBlockHash> =
            trace[w][s].iter().map(|b| LocalBlockHash(b.content)).collect();
        let scores = tree.find_matches(hashes, false);
        lat.push(t.elapsed().as_nanos() as u64);
        assert!(scores.scores.values().any(|&d| d == LEN as u32));
    }
    Stats::of(ingest, bytes, lat)
}

fn report(ours: &Stats, dynamo: &Stats, chain: &Stats) {
    println!(
        "{:<30}{:>12}{:>16}{:>9}{:>22}{:>9}",
        "", "lmcache-rs", "Dynamo RadixTree", "ratio", "kv-index ChainIndex", "ratio"
    );
    let row = |label: &str, a: f64, d: f64, c: f64, higher_is_better: bool| {
        let r = |x: f64| if higher_is_better { a / x } else { x / a };
        println!("{label:<30}{a:>12.2}{d:>16.2}{:>8.2}x{c:>22.2}{:>8.2}x", r(d), r(c));
    };
    row(
        "ingest (M blocks/s, 1 thread)",
        ours.ingest / 1e6,
        dynamo.ingest / 1e6,
        chain.ingest / 1e6,
        true,
    );
    row("lookup p50 (us)", ours.p50, dynamo.p50, chain.p50, false);
    row("lookup p99 (us)", ours.p99, dynamo.p99, chain.p99, false);
    row("lookup p99.9 (us)", ours.p999, dynamo.p999, chain.p999, false);
    row("bytes per membership", ours.bytes, dynamo.bytes, chain.bytes, false);
    println!("(ratios: > 1 means lmcache-rs is better)");
}
