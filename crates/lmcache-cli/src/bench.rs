//! `lmcache-rs bench server`: what `lmcache bench server` does (cold lookup, store, warm
//! lookup, retrieve, byte check) in the engine-driven SHM mode, from N concurrent clients,
//! with live progress, a final table (p50/p90/p99 per operation, GB/s, ops/s) and JSON.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use lmcache_client::{CacheKey, Client, EngineDrivenRegistration};
use lmcache_core::{Dtype, ModelName};
use lmcache_memory::ForeignSegment;
use serde_json::json;

/// Output format.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Format {
    /// A human table.
    Terminal,
    /// One JSON document.
    Json,
}

/// Flags of `lmcache-rs bench server`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// MP endpoint of the server.
    #[arg(long, default_value = "tcp://localhost:5555")]
    pub rpc_url: String,
    /// Tokens per request (whole chunks are stored).
    #[arg(long, default_value_t = 512)]
    pub num_tokens: usize,
    /// First sequence id.
    #[arg(long, default_value_t = 0)]
    pub start: u32,
    /// End sequence id (exclusive).
    #[arg(long, default_value_t = 20)]
    pub end: u32,
    /// Concurrent clients, each its own registered worker.
    #[arg(long, default_value_t = 1)]
    pub concurrency: u32,
    /// Layers of the simulated model.
    #[arg(long, default_value_t = 32)]
    pub num_layers: u64,
    /// Heads x head size of the simulated model.
    #[arg(long, default_value_t = 1024)]
    pub hidden_dim: u64,
    /// Model name in the keys.
    #[arg(long, default_value = "test-model")]
    pub model: String,
    /// Per-call timeout in seconds.
    #[arg(long, default_value_t = 10)]
    pub timeout_seconds: u64,
    /// Output format.
    #[arg(long, value_enum, default_value = "terminal")]
    pub format: Format,
    /// Also write the JSON result here.
    #[arg(long)]
    pub output: Option<std::path::PathBuf>,
}

const OPS: [&str; 4] = ["cold_lookup", "store", "warm_lookup", "retrieve"];

#[derive(Default)]
struct Tally {
    /// Latencies in ms per op, in OPS order.
    ms: [Vec<f64>; 4],
    bytes_stored: u64,
    bytes_retrieved: u64,
    cold_miss: u32,
    warm_hit: u32,
    bytes_ok: u32,
    requests: u32,
}

fn timed<T>(v: &mut Vec<f64>, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    v.push(t.elapsed().as_secs_f64() * 1e3);
    r
}

fn worker(
    a: &BenchArgs,
    index: u32,
    seqs: Vec<u32>,
    done: &std::sync::atomic::AtomicU32,
) -> anyhow::Result<Tally> {
    let mut c = Client::connect(&a.rpc_url, Duration::from_secs(a.timeout_seconds))?;
    let chunk = c.get_chunk_size().context("get_chunk_size")? as usize;
    let id = 2000 + u64::from(index);
    let model = ModelName::new(&a.model).map_err(|e| anyhow::anyhow!("--model: {e}"))?;
    let registration = EngineDrivenRegistration {
        instance_id: id,
        model_name: model.clone(),
        world_size: 1,
        block_size: 16,
        num_layers: a.num_layers,
        hidden_dim_size: a.hidden_dim,
        dtype: Dtype::Float16,
        use_mla: false,
        num_physical_slots: None,
    };
    let pool = c.register_engine_driven(&registration).context("registering")?;
    let (name, size) = (pool.shm_name, pool.pool_size);
    if name.is_empty() {
        bail!("the server advertises no shared-memory pool");
    }
    let pool = ForeignSegment::open(&name, size).context("mapping the server's pool")?;
    let mut t = Tally::default();
    for s in seqs {
        let mut tokens = vec![s];
        tokens.extend(std::iter::repeat_n(9906u32, a.num_tokens));
        let chunks = tokens.len() / chunk;
        let cold = CacheKey::whole(model.clone(), &format!("req-{s}-cold"), tokens.clone(), chunk);
        let pattern = |i: u64| (s as u64 * 31 + i) as u8 | 1;
        let hits = timed(&mut t.ms[0], || c.lookup(&cold))?;
        t.cold_miss += u32::from(hits == 0);
        let stored = timed(&mut t.ms[1], || -> anyhow::Result<u64> {
            let k = cold.for_worker(0);
            let mut bytes = 0;
            for (i, slot) in c.prepare_store(&k, id)? {
                pool.write(slot.offset, &vec![pattern(i); slot.length as usize])?;
                bytes += slot.length;
            }
            c.commit_store(&k, id)?;
            Ok(bytes)
        })?;
        t.bytes_stored += stored;
        c.end_session(&cold.request_id)?;
        let warm = CacheKey::whole(model.clone(), &format!("req-{s}-warm"), tokens, chunk);
        let hits = timed(&mut t.ms[2], || c.lookup(&warm))?;
        t.warm_hit += u32::from(hits as usize == chunks);
        let ok = timed(&mut t.ms[3], || -> anyhow::Result<bool> {
            let k = warm.for_worker(0);
            let Some(slots) = c.prepare_retrieve(&k, id)? else {
                c.commit_retrieve(&k, id)?;
                return Ok(false);
            };
            let mut ok = slots.len() == chunks;
            for (i, slot) in slots.iter().enumerate() {
                let mut buf = vec![0u8; slot.length as usize];
                pool.read(slot.offset, &mut buf)?;
                t.bytes_retrieved += slot.length;
                ok &= buf.iter().all(|&b| b == pattern(i as u64));
            }
            c.commit_retrieve(&k, id)?;
            Ok(ok)
        })?;
        t.bytes_ok += u32::from(ok);
        c.end_session(&warm.request_id)?;
        t.requests += 1;
        done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(t)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Runs the benchmark.
pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    if a.end <= a.start || a.concurrency == 0 {
        bail!("need --end > --start and --concurrency >= 1");
    }
    let total = a.end - a.start;
    let done = std::sync::atomic::AtomicU32::new(0);
    let started = Instant::now();
    let results: Vec<anyhow::Result<Tally>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..a.concurrency)
            .map(|w| {
                let seqs: Vec<u32> = (a.start..a.end).filter(|s| s % a.concurrency == w).collect();
                let (a, done) = (&a, &done);
                scope.spawn(move || worker(a, w, seqs, done))
            })
            .collect();
        let tty = matches!(a.format, Format::Terminal);
        while handles.iter().any(|h| !h.is_finished()) {
            if tty {
                let d = done.load(std::sync::atomic::Ordering::Relaxed);
                eprint!("\r  [{d}/{total}] requests, {:.1} s", started.elapsed().as_secs_f64());
                let _ = std::io::stderr().flush();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if tty {
            eprintln!();
        }
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("a client panicked")))
            .collect()
    });
    let wall = started.elapsed().as_secs_f64();
    let mut all = Tally::default();
    for r in results {
        let t = r?;
        for i in 0..4 {
            all.ms[i].extend(&t.ms[i]);
        }
        all.bytes_stored += t.bytes_stored;
        all.bytes_retrieved += t.bytes_retrieved;
        all.cold_miss += t.cold_miss;
        all.warm_hit += t.warm_hit;
        all.bytes_ok += t.bytes_ok;
        all.requests += t.requests;
    }
    let store_s: f64 = all.ms[1].iter().sum::<f64>() / 1e3;
    let retrieve_s: f64 = all.ms[3].iter().sum::<f64>() / 1e3;
    let mut ops = serde_json::Map::new();
    for (i, name) in OPS.iter().enumerate() {
        let v = &mut all.ms[i];
        ops.insert(
            (*name).into(),
            json!({"count": v.len(), "p50_ms": pct(v, 0.5), "p90_ms": pct(v, 0.9), "p99_ms": pct(v, 0.99)}),
        );
    }
    let doc = json!({
        "rpc_url": a.rpc_url,
        "requests": all.requests,
        "concurrency": a.concurrency,
        "wall_seconds": wall,
        "requests_per_second": f64::from(all.requests) / wall,
        "cold_full_miss": all.cold_miss,
        "warm_full_hit": all.warm_hit,
        "bytes_match": all.bytes_ok,
        "store_gb_per_s": if store_s > 0.0 { all.bytes_stored as f64 / store_s / 1e9 } else { 0.0 },
        "retrieve_gb_per_s": if retrieve_s > 0.0 { all.bytes_retrieved as f64 / retrieve_s / 1e9 } else { 0.0 },
        "ops": ops,
    });
    if let Some(path) = &a.output {
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    match a.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&doc)?),
        Format::Terminal => {
            println!("{:<14}{:>8}{:>10}{:>10}{:>10}", "op", "count", "p50 ms", "p90 ms", "p99 ms");
            for name in OPS {
                let o = &doc["ops"][name];
                println!(
                    "{name:<14}{:>8}{:>10.2}{:>10.2}{:>10.2}",
                    o["count"],
                    o["p50_ms"].as_f64().unwrap_or(0.0),
                    o["p90_ms"].as_f64().unwrap_or(0.0),
                    o["p99_ms"].as_f64().unwrap_or(0.0)
                );
            }
            println!(
                "requests {}  ({:.1}/s, concurrency {})  store {:.2} GB/s  retrieve {:.2} GB/s",
                all.requests,
                doc["requests_per_second"].as_f64().unwrap_or(0.0),
                a.concurrency,
                doc["store_gb_per_s"].as_f64().unwrap_or(0.0),
                doc["retrieve_gb_per_s"].as_f64().unwrap_or(0.0)
            );
            println!(
                "cold full miss {}/{n}  warm full hit {}/{n}  bytes match {}/{n}",
                all.cold_miss,
                all.warm_hit,
                all.bytes_ok,
                n = all.requests
            );
        }
    }
    if all.cold_miss != all.requests || all.warm_hit != all.requests || all.bytes_ok != all.requests
    {
        bail!("correctness checks failed (see above)");
    }
    Ok(())
}
