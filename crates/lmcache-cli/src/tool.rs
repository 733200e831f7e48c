//! `lmcache-rs tool cache-simulator simulate|sweep`: LMCache's cache simulator over
//! lookup-hash logs (LMCache's or ours), with its flags and its report.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use lmcache_workload::{LookupLine, capacity_range_bytes, kv_bytes_per_chunk, parse_lines};

/// `tool ...`.
#[derive(Debug, Subcommand)]
pub enum ToolCommand {
    /// Size a cache from lookup-hash logs (`--lookup-hash-log-dir`): replay them through an LRU.
    #[command(subcommand, name = "cache-simulator")]
    CacheSimulator(SimulatorCommand),
}

/// `tool cache-simulator ...`.
#[derive(Debug, Subcommand)]
pub enum SimulatorCommand {
    /// One capacity: the hit rate, the per-request distribution and the hit prefix lengths.
    Simulate(SimulateArgs),
    /// Many capacities at once (one pass by LRU stack distances): the hit rate at each.
    Sweep(SweepArgs),
}

/// Which logs.
#[derive(Debug, Args)]
pub struct Input {
    /// Lookup-hash JSONL files, or directories of `lookup_hashes_*.jsonl`.
    #[arg(short = 'i', long = "input", num_args = 1.., required = true, value_name = "PATH")]
    pub input: Vec<PathBuf>,
    /// Events to use at most, the earliest (default: all).
    #[arg(short = 'n', long = "max-samples", value_name = "N")]
    pub max_samples: Option<usize>,
    /// Only events of this model.
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// Bytes one cached chunk takes; computed from the first event's shapes and dtypes
    /// (either dtype spelling: `float16` or `torch.float16`) when omitted.
    #[arg(long, value_name = "BYTES")]
    pub kv_bytes_per_chunk: Option<u64>,
}

/// `simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    #[command(flatten)]
    input: Input,
    /// Cache capacity in GiB.
    #[arg(long, value_name = "GiB")]
    cache_capacity_gib: f64,
    /// The statistics chart (PNG, seven panels).
    #[arg(short = 'o', long, default_value = "cache_stats.png", value_name = "FILE")]
    output: PathBuf,
    /// Also replay through this eviction policy as lmcache-rs's L1 runs it (its own code:
    /// LRU, ARC, S3FIFO, IsolatedLRU), after LMCache's report.
    #[arg(long, value_name = "POLICY", value_parser = parse_policy)]
    eviction_policy: Option<lmcache_l1::EvictionPolicyKind>,
    /// Also replay an L1 + L2 pair: L1 of --cache-capacity-gib (under --eviction-policy,
    /// default LRU) over an L2 of this many GiB (LRU) that receives every stored chunk.
    #[arg(long, value_name = "GiB")]
    l2_capacity_gib: Option<f64>,
}

fn parse_policy(s: &str) -> Result<lmcache_l1::EvictionPolicyKind, String> {
    s.parse().map_err(|e: lmcache_l1::eviction::UnknownPolicy| e.to_string())
}

/// A shipped policy as a simulator cache: a request's chunks are touched and inserted last
/// chunk first, as L1 does (so a recency policy evicts suffixes before prefixes).
struct Shipped(lmcache_l1::eviction::PolicySim);

impl lmcache_workload::tiered::ChunkCache for Shipped {
    fn name(&self) -> String {
        self.0.name().to_owned()
    }
    fn contains(&self, id: u32) -> bool {
        self.0.contains(id)
    }
    fn access(&mut self, ids: &[u32]) {
        for &k in ids.iter().rev() {
            self.0.access(k);
        }
    }
    fn insert(&mut self, ids: &[u32]) {
        for &k in ids.iter().rev() {
            self.0.insert(k);
        }
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn evictions(&self) -> u64 {
        self.0.evictions()
    }
}

fn shipped(kind: lmcache_l1::EvictionPolicyKind, capacity_chunks: u64) -> Shipped {
    Shipped(lmcache_l1::eviction::PolicySim::new(
        kind,
        usize::try_from(capacity_chunks).unwrap_or(usize::MAX),
    ))
}

/// The policies `sweep --compare-policies` replays.
const COMPARED: [lmcache_l1::EvictionPolicyKind; 3] = [
    lmcache_l1::EvictionPolicyKind::Lru,
    lmcache_l1::EvictionPolicyKind::Arc,
    lmcache_l1::EvictionPolicyKind::S3Fifo,
];

/// `sweep`.
#[derive(Debug, Args)]
pub struct SweepArgs {
    #[command(flatten)]
    input: Input,
    /// Smallest capacity, GiB.
    #[arg(long, default_value_t = 0.5, value_name = "GiB")]
    min_capacity_gib: f64,
    /// Largest capacity, GiB.
    #[arg(long, default_value_t = 500.0, value_name = "GiB")]
    max_capacity_gib: f64,
    /// Log-spaced capacities between them.
    #[arg(long, default_value_t = 30, value_name = "N")]
    points: usize,
    /// A linear capacity axis on the chart (default: log scale).
    #[arg(long)]
    linear: bool,
    /// Also replay lmcache-rs's LRU, ARC and S3FIFO (their own code) at every capacity: more
    /// columns and curves (one replay per capacity and policy, on all cores).
    #[arg(long)]
    compare_policies: bool,
    /// The chart of hit rate against capacity (PNG).
    #[arg(short = 'o', long, default_value = "hit_rate_vs_capacity.png", value_name = "FILE")]
    output: PathBuf,
}

/// Reads the events as LMCache's loader does: directory files in name order, lines in
/// order, filtered by model, sorted by timestamp (stably), cut to `max_samples`.
fn load(input: &Input) -> anyhow::Result<Vec<LookupLine>> {
    let mut files: Vec<PathBuf> = Vec::new();
    for p in &input.input {
        if p.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(p)
                .with_context(|| format!("reading {}", p.display()))?
                .flatten()
                .map(|e| e.path())
                .filter(|f| {
                    f.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("lookup_hashes_") && n.ends_with(".jsonl"))
                })
                .collect();
            found.sort();
            if found.is_empty() {
                eprintln!("warning: {} contains no lookup_hashes_*.jsonl files", p.display());
            }
            files.extend(found);
        } else {
            files.push(p.clone());
        }
    }
    let mut events = Vec::new();
    for f in &files {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        events.extend(parse_lines(&f.display().to_string(), &text, input.model.as_deref())?);
    }
    events.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    if let Some(n) = input.max_samples {
        events.truncate(n);
    }
    Ok(events)
}

fn bytes_per_chunk(input: &Input, events: &[LookupLine]) -> anyhow::Result<u64> {
    if let Some(b) = input.kv_bytes_per_chunk {
        if b == 0 {
            bail!("--kv-bytes-per-chunk must be > 0");
        }
        return Ok(b);
    }
    let Some(b) = events.first().and_then(kv_bytes_per_chunk).filter(|&b| b > 0) else {
        bail!(
            "could not determine kv_bytes_per_chunk from the first event (shapes/dtypes empty \
             or unknown); pass --kv-bytes-per-chunk"
        );
    };
    println!(
        "Auto-detected kv_bytes_per_chunk = {} bytes",
        lmcache_workload::simulate::thousands(b)
    );
    Ok(b)
}

fn paths(input: &[PathBuf]) -> String {
    let v: Vec<String> = input.iter().map(|p| format!("'{}'", p.display())).collect();
    format!("[{}]", v.join(", "))
}

fn gib_bytes(gib: f64) -> anyhow::Result<u64> {
    if !(gib.is_finite() && gib > 0.0) {
        bail!("capacity {gib} GiB: must be a positive number");
    }
    Ok((gib * (1u64 << 30) as f64) as u64)
}

/// The seven panels of LMCache's statistics figure (its 2 x 4 grid; the eighth cell holds
/// the request and token hit shares its first panel shows as insets).
fn stats_chart(
    sim: &lmcache_workload::Simulation,
    chunk_size: u64,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    use crate::plot::{Histogram, Lines, Panel, Pies};
    let rates: Vec<f64> = sim.per_request_token_hit_rates.iter().map(|r| r * 100.0).collect();
    let nonzero: Vec<f64> = rates.iter().copied().filter(|&r| r > 0.0).collect();
    let high: Vec<f64> = nonzero.iter().copied().filter(|&r| r >= 97.0).collect();
    let full = rates.iter().filter(|&&r| r == 100.0).count() as u64;
    let prefix: Vec<f64> =
        sim.hit_prefix_lengths.iter().filter(|&&n| n > 0).map(|&n| n as f64).collect();
    let reuse = &sim.chunk_reuse_counts;
    let reuse_cap = reuse.iter().copied().max().unwrap_or(1).min(100);
    let reuse_v: Vec<f64> = reuse.iter().filter(|&&r| r <= reuse_cap).map(|&r| r as f64).collect();
    let above = reuse.iter().filter(|&&r| r > reuse_cap).count();
    let reuse_note = (above > 0).then(|| {
        format!(
            "max={}\n{} chunks ({:.1}%) above cap",
            lmcache_workload::simulate::thousands(reuse.iter().copied().max().unwrap_or(0)),
            lmcache_workload::simulate::thousands(above as u64),
            above as f64 / reuse.len().max(1) as f64 * 100.0
        )
    });
    let rolling: Vec<(f64, f64)> = sim
        .rolling_token_hit_rate
        .iter()
        .enumerate()
        .map(|(i, r)| ((i + 1) as f64, r * 100.0))
        .collect();
    let inputs: Vec<f64> = sim.input_lengths.iter().map(|&x| x as f64).collect();
    let spans: Vec<f64> = sim.global_span_distribution.iter().map(|&x| x as f64).collect();
    let positions: Vec<f64> = sim.cache_position_distribution.iter().map(|&x| x as f64).collect();
    let miss_tokens = sim.total_tokens - sim.total_hit_tokens;
    let title = format!(
        "Cache simulation statistics  (chunk_size={chunk_size} tokens,  capacity={:.1} GiB,  {} requests,  token hit rate={})",
        sim.cache_capacity_bytes as f64 / (1u64 << 30) as f64,
        lmcache_workload::simulate::thousands(sim.total_requests),
        lmcache_workload::simulate::percent(sim.token_hit_rate(), 2)
    );
    let hist = |title, x_label, values, bins, range, note| {
        Panel::Histogram(Histogram {
            title,
            x_label,
            y_label: "Number of requests",
            values,
            bins,
            range,
            note,
        })
    };
    let panels = [
        hist(
            "1. Per-request token hit rate",
            "Token hit rate (%), zero-hit requests excluded",
            &nonzero[..],
            50,
            Some(0.0..100.0),
            None,
        ),
        hist(
            "1b. Per-request token hit rate (97-100%)",
            "Token hit rate (%), 97-100% zoom",
            &high[..],
            20,
            Some(97.0..100.0),
            Some(format!("100% hit: {} requests", lmcache_workload::simulate::thousands(full))),
        ),
        hist(
            "2. Hit prefix length per request",
            "Hit prefix length (chunks), zero-hit requests excluded",
            &prefix[..],
            50,
            None,
            None,
        ),
        Panel::Histogram(Histogram {
            title: "3. Chunk reuse count",
            x_label: "Times a chunk was hit (capped at 100)",
            y_label: "Number of unique chunks",
            values: &reuse_v,
            bins: reuse_cap as usize,
            range: Some(1.0..reuse_cap as f64 + 1.0),
            note: reuse_note,
        }),
        Panel::Lines(Lines {
            title: "4. Rolling token hit rate over time",
            x_label: "Request index",
            y_label: "Cumulative token hit rate (%)",
            series: vec![("hit rate".into(), rolling)],
            log_x: false,
            y_range: Some(0.0..100.0),
            markers: false,
        }),
        hist(
            "5. Input length per request",
            "Input length (tokens / seq_len)",
            &inputs[..],
            50,
            None,
            None,
        ),
        Panel::Histogram(Histogram {
            title: "6. Global span distribution",
            x_label: "Global span (chunks between last store and hit)",
            y_label: "Number of hit chunks",
            values: &spans,
            bins: 50,
            range: None,
            note: None,
        }),
        Panel::Histogram(Histogram {
            title: "7. Cache position at hit",
            x_label: "Cache position (0 = MRU, max = LRU)",
            y_label: "Number of hit chunks",
            values: &positions,
            bins: 50,
            range: None,
            note: None,
        }),
        Panel::Pies(Pies {
            title: "Hit shares",
            pies: vec![
                (
                    "requests with >= 1 chunk hit".into(),
                    nonzero.len() as f64,
                    (rates.len() - nonzero.len()) as f64,
                ),
                (
                    "tokens served from cache".into(),
                    sim.total_hit_tokens as f64,
                    miss_tokens as f64,
                ),
            ],
        }),
    ];
    crate::plot::figure(path, &title, 3, (700, 450), &panels)
}

/// Runs a `tool` command.
pub fn run(cmd: ToolCommand) -> anyhow::Result<()> {
    let ToolCommand::CacheSimulator(sim) = cmd;
    let input = match &sim {
        SimulatorCommand::Simulate(a) => &a.input,
        SimulatorCommand::Sweep(a) => &a.input,
    };
    println!("Loading lookup events from {} …", paths(&input.input));
    let events = load(input)?;
    let thousands = lmcache_workload::simulate::thousands;
    match sim {
        SimulatorCommand::Simulate(a) => {
            println!("Loaded {} event(s)", thousands(events.len() as u64));
            if events.is_empty() {
                println!("No events to process.");
                return Ok(());
            }
            let bpc = bytes_per_chunk(&a.input, &events)?;
            let cap = gib_bytes(a.cache_capacity_gib)?;
            println!("\nSimulation parameters:");
            println!(
                "  Cache capacity     : {:.2} GiB ({} bytes)",
                a.cache_capacity_gib,
                thousands(cap)
            );
            println!("  KV bytes/chunk     : {}", thousands(bpc));
            println!("  Chunk size         : {} tokens", events[0].chunk_size);
            if let Some(m) = &a.input.model {
                println!("  Model filter       : {m}");
            }
            println!();
            let sim = lmcache_workload::simulate(&events, cap, bpc);
            print!("{}", sim.report());
            stats_chart(&sim, events[0].chunk_size, &a.output)?;
            println!("\nStats plot saved to '{}'", a.output.display());
            if a.eviction_policy.is_some() || a.l2_capacity_gib.is_some() {
                let kind = a.eviction_policy.unwrap_or_default();
                let l1_chunks = (cap / bpc).max(1);
                let mut l1 = shipped(kind, l1_chunks);
                let mut l2 = match a.l2_capacity_gib {
                    Some(g) => Some(lmcache_workload::tiered::LmcacheLru::new(
                        usize::try_from((gib_bytes(g)? / bpc).max(1)).unwrap_or(usize::MAX),
                    )),
                    None => None,
                };
                let t = lmcache_workload::tiered::simulate_tiers(
                    &events,
                    &mut l1,
                    l2.as_mut().map(|c| c as &mut dyn lmcache_workload::tiered::ChunkCache),
                );
                let sep = "=".repeat(60);
                let pct = |x| lmcache_workload::simulate::percent(x, 2);
                let l2_text = a
                    .l2_capacity_gib
                    .map_or(String::new(), |g| format!(" over L2 {g:.2} GiB (LRU)"));
                println!(
                    "\n{sep}\nlmcache-rs L1 {kind} {:.2} GiB{l2_text}\n{sep}",
                    a.cache_capacity_gib
                );
                println!("  Token hit rate      : {}", pct(t.hit_rate()));
                if a.l2_capacity_gib.is_some() {
                    println!("    from L1           : {}", pct(t.l1_hit_rate()));
                    println!("    from L2           : {}", pct(t.l2_hit_rate()));
                }
                println!("  L1 evictions        : {}", thousands(t.l1_evictions));
                println!(
                    "  L1 occupancy        : {} / {} chunks",
                    thousands(t.l1_chunks),
                    thousands(l1_chunks)
                );
                if a.l2_capacity_gib.is_some() {
                    println!("  L2 evictions        : {}", thousands(t.l2_evictions));
                    println!("  L2 occupancy        : {} chunks", thousands(t.l2_chunks));
                }
                println!(
                    "  vs LMCache's LRU    : {:+.2} points",
                    (t.hit_rate() - sim.token_hit_rate()) * 100.0
                );
                println!("{sep}");
            }
        }
        SimulatorCommand::Sweep(a) => {
            println!("Loaded {} event(s)\n", thousands(events.len() as u64));
            if events.is_empty() {
                println!("No events to process.");
                return Ok(());
            }
            let bpc = bytes_per_chunk(&a.input, &events)?;
            gib_bytes(a.min_capacity_gib)?;
            gib_bytes(a.max_capacity_gib)?;
            let caps = capacity_range_bytes(a.min_capacity_gib, a.max_capacity_gib, a.points);
            let chunks: Vec<u64> = caps.iter().map(|&b| (b / bpc).max(1)).collect();
            let t = std::time::Instant::now();
            let rates = lmcache_workload::sweep(&events, &chunks);
            let one_pass = t.elapsed();
            let model = a.input.model.as_deref().unwrap_or("all models");
            println!(
                "Sweeping {} capacity values ({:.2} – {:.2} GiB), chunk_size = {} tokens, model = {model}\n",
                caps.len(),
                a.min_capacity_gib,
                a.max_capacity_gib,
                events[0].chunk_size
            );
            // Ours, one replay per (policy, capacity), spread over the cores.
            let compared: Vec<Vec<f64>> = if a.compare_policies {
                let jobs: Vec<(usize, usize)> = (0..COMPARED.len())
                    .flat_map(|p| (0..chunks.len()).map(move |c| (p, c)))
                    .collect();
                let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
                let next = std::sync::atomic::AtomicUsize::new(0);
                let out = std::sync::Mutex::new(vec![vec![0.0; chunks.len()]; COMPARED.len()]);
                std::thread::scope(|s| {
                    for _ in 0..threads {
                        s.spawn(|| {
                            loop {
                                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                let Some(&(p, c)) = jobs.get(i) else { break };
                                let mut l1 = shipped(COMPARED[p], chunks[c]);
                                let r = lmcache_workload::tiered::simulate_tiers(
                                    &events, &mut l1, None,
                                )
                                .hit_rate();
                                if let Ok(mut o) = out.lock() {
                                    o[p][c] = r;
                                }
                            }
                        });
                    }
                });
                out.into_inner().unwrap_or_default()
            } else {
                Vec::new()
            };
            print!("{:>18}  {:>10}", "Capacity (GiB)", "Hit rate");
            for k in COMPARED.iter().take(compared.len()) {
                print!("  {:>10}", format!("rs {k}"));
            }
            println!();
            println!("{}", "-".repeat(32 + 12 * compared.len()));
            for (i, (b, r)) in caps.iter().zip(&rates).enumerate() {
                print!(
                    "{:>18.3}  {:>9}",
                    *b as f64 / (1u64 << 30) as f64,
                    lmcache_workload::simulate::percent(*r, 2)
                );
                for col in &compared {
                    print!("  {:>10}", lmcache_workload::simulate::percent(col[i], 2));
                }
                println!();
            }
            eprintln!("({} capacities in one pass: {:.3} s)", caps.len(), one_pass.as_secs_f64());
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            let title = format!(
                "Token cache hit rate vs capacity (chunk_size = {} tokens, {} requests, model = {model}, {} scale)",
                events[0].chunk_size,
                thousands(events.len() as u64),
                if a.linear { "linear" } else { "log" }
            );
            let points: Vec<(f64, f64)> =
                caps.iter().zip(&rates).map(|(&b, &r)| (gib(b), r * 100.0)).collect();
            let mut series = vec![("LRU (LMCache's replay)".to_owned(), points)];
            for (k, col) in COMPARED.iter().zip(&compared) {
                series.push((
                    format!("lmcache-rs {k}"),
                    caps.iter().zip(col).map(|(&b, &r)| (gib(b), r * 100.0)).collect(),
                ));
            }
            crate::plot::figure(
                &a.output,
                &title,
                1,
                (1350, 750),
                &[crate::plot::Panel::Lines(crate::plot::Lines {
                    title: "",
                    x_label: "Cache capacity (GiB)",
                    y_label: "Token hit rate (%)",
                    series,
                    log_x: !a.linear,
                    y_range: Some(0.0..100.0),
                    markers: true,
                })],
            )?;
            println!("\nPlot saved to '{}'", a.output.display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_are_read_in_name_order_and_sorted_by_time() {
        let dir = tempfile::tempdir().unwrap();
        let line = |ts: f64, id: &str| {
            format!(
                r#"{{"timestamp": {ts}, "request_id": "{id}", "model_name": "m", "chunk_size": 4, "seq_len": 8, "chunk_hashes": ["0x1"]}}"#
            )
        };
        std::fs::write(
            dir.path().join("lookup_hashes_20260101_000000_000001.jsonl"),
            line(2.0, "b"),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("lookup_hashes_20260101_000000_000000.jsonl"),
            line(3.0, "c"),
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not a log").unwrap();
        let input = Input {
            input: vec![dir.path().to_path_buf()],
            max_samples: Some(1),
            model: None,
            kv_bytes_per_chunk: None,
        };
        let e = load(&input).unwrap();
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].request_id, "b", "the earliest");
        assert!(bytes_per_chunk(&input, &e).is_err(), "no shapes: must be given");
    }
}
