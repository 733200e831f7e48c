//! `lmcache-rs tool cache-simulator simulate|sweep`: LMCache's cache simulator over
//! lookup-hash logs (LMCache's or ours), with its flags and its report.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use lmcache_workload::{LookupEvent, capacity_range_bytes, kv_bytes_per_chunk, parse_lines};

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
}

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
}

/// Reads the events as LMCache's loader does: directory files in name order, lines in
/// order, filtered by model, sorted by timestamp (stably), cut to `max_samples`.
fn load(input: &Input) -> anyhow::Result<Vec<LookupEvent>> {
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

fn bytes_per_chunk(input: &Input, events: &[LookupEvent]) -> anyhow::Result<u64> {
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
            print!("{}", lmcache_workload::simulate(&events, cap, bpc).report());
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
            let model = a.input.model.as_deref().unwrap_or("all models");
            println!(
                "Sweeping {} capacity values ({:.2} – {:.2} GiB), chunk_size = {} tokens, model = {model}\n",
                caps.len(),
                a.min_capacity_gib,
                a.max_capacity_gib,
                events[0].chunk_size
            );
            println!("{:>18}  {:>10}", "Capacity (GiB)", "Hit rate");
            println!("{}", "-".repeat(32));
            for (b, r) in caps.iter().zip(&rates) {
                println!(
                    "{:>18.3}  {:>9}",
                    *b as f64 / (1u64 << 30) as f64,
                    lmcache_workload::simulate::percent(*r, 2)
                );
            }
            eprintln!(
                "({} capacities in one pass: {:.3} s)",
                caps.len(),
                t.elapsed().as_secs_f64()
            );
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
