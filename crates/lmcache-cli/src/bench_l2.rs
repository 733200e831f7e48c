//! `lmcache-rs bench l2`: store, lookup and load throughput of one L2 adapter, with the flags
//! of `lmcache bench l2`. Objects come from memory (as from L1); stores include encoding (blob
//! header, checksum, codec) and loads include verification and decoding into a destination
//! buffer, so the figures are what the tier gets, not the bare backend.

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Args;
use futures_util::future::join_all;
use lmcache_core::ObjectKey;
use lmcache_l2::config::BuiltAdapter;
use serde_json::{Value, json};

use crate::bench::Format;
use crate::bench::live::{Live, Tracker};

/// Flags of `lmcache-rs bench l2` (named as `lmcache bench l2`'s).
#[derive(Debug, Clone, Args)]
pub struct BenchL2Args {
    /// Adapter spec JSON, e.g. '{"type":"fs","base_path":"/tmp/bench"}' (else $L2_ADAPTER_JSON).
    #[arg(long = "l2-adapter", value_name = "JSON", env = "L2_ADAPTER_JSON")]
    pub l2_adapter: String,
    /// Keys per submit.
    #[arg(long, default_value_t = 32)]
    pub num_keys: usize,
    /// Submits in flight at once.
    #[arg(long, default_value_t = 4)]
    pub in_flight: usize,
    /// Object size in KiB.
    #[arg(long, default_value_t = 256)]
    pub data_size_kb: usize,
    /// Measured rounds per operation.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Unmeasured rounds first.
    #[arg(long, default_value_t = 1)]
    pub warmup_rounds: usize,
    /// Fraction of looked-up keys that may exist (the rest surely do not).
    #[arg(long, default_value_t = 0.0)]
    pub lookup_max_hit_rate: f64,
    /// Skip checking loaded bytes against what was stored (checked by default here; the
    /// verify-by-checksum of every blob happens either way).
    #[arg(long)]
    pub skip_verify: bool,
    /// Run only one operation.
    #[arg(long, value_parser = ["lookup", "store", "load"])]
    pub only: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value = "terminal")]
    pub format: Format,
    /// Also write the JSON result here.
    #[arg(long)]
    pub output: Option<std::path::PathBuf>,
    /// No output; the exit code tells.
    #[arg(short, long)]
    pub quiet: bool,
    /// Write every measured round as CSV (op, seq, at_s, latency_ms, bytes, ok).
    #[arg(long, value_name = "FILE")]
    pub csv: Option<std::path::PathBuf>,
    /// Draw round-latency histograms and throughput over time to this PNG.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<std::path::PathBuf>,
}

const OPS: [&str; 3] = ["store", "lookup", "load"];

/// Records a measured round of `op` into the tracker: the phase's growth since `before`.
fn tracked(t: &Tracker, op: usize, ph: &Phase, before: (f64, u64, usize)) {
    let (s, b, f) = before;
    t.record(op, (ph.seconds - s) * 1e3, ph.bytes - b, ph.failures == f);
}

/// Key `i` of round `run`: its hash bytes are scrambled (splitmix64), like real chunk hashes,
/// so that adapters sharding by hash see a realistic spread.
fn key(run: u64, i: usize) -> ObjectKey {
    let mut x = run.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64);
    let mut h = [0u8; 32];
    for part in h.chunks_mut(8) {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        part.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    ObjectKey { chunk_hash: lmcache_core::ChunkHash(h), ..base_key() }
}

fn base_key() -> ObjectKey {
    // Constant, valid parts: cannot fail.
    ObjectKey::new([0; 32], "bench-model", 1, 0, 0, "").unwrap_or_else(|_| unreachable!())
}

/// Source objects, made before any timing: object `i` of every round has these bytes.
fn make_data(n: usize, len: usize) -> Vec<Bytes> {
    (0..n)
        .map(|i| {
            let seed = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            Bytes::from(
                (0..len).map(|j| (seed >> (j % 8 * 8)) as u8 ^ j as u8).collect::<Vec<u8>>(),
            )
        })
        .collect()
}

#[derive(Default)]
struct Phase {
    ms: Vec<f64>,
    keys: usize,
    bytes: u64,
    seconds: f64,
    failures: usize,
}

impl Phase {
    fn report(&mut self) -> Value {
        self.ms.sort_by(f64::total_cmp);
        let p = |q: f64| {
            if self.ms.is_empty() {
                0.0
            } else {
                self.ms[((self.ms.len() - 1) as f64 * q).round() as usize]
            }
        };
        json!({
            "keys": self.keys, "bytes": self.bytes, "seconds": self.seconds,
            "mib_per_s": if self.seconds > 0.0 { self.bytes as f64 / self.seconds / (1 << 20) as f64 } else { 0.0 },
            "ops_per_s": if self.seconds > 0.0 { self.keys as f64 / self.seconds } else { 0.0 },
            "submit_p50_ms": p(0.5), "submit_p99_ms": p(0.99), "failures": self.failures,
        })
    }
}

/// One operation's section of the metrics document, field for field as LMCache's
/// `lmcache bench l2` writes it (its names, order, rounding and statistics): the tracker's
/// figures of the rounds (mean, min, max, nearest-rank percentiles) and, from the rounds
/// themselves, the sample standard deviation and the per-round throughput and key rates.
fn op_section(
    name: &str,
    f: &crate::bench::live::OpFigures,
    rounds_ms: &[f64],
    keys_per_round: usize,
    mib_per_round: f64,
    success: usize,
    expected: Option<(f64, usize)>,
) -> Value {
    let r2 = |x: f64| (x * 100.0).round() / 100.0;
    let n = rounds_ms.len();
    let mean = |v: &[f64]| if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
    let avg = f.mean_ms;
    let std = if n > 1 {
        (rounds_ms.iter().map(|x| (x - avg).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
    } else {
        0.0
    };
    let per_round = |amount: f64| -> Vec<f64> {
        rounds_ms
            .iter()
            .map(|ms| if *ms > 0.0 { amount / (ms / 1e3) } else { f64::INFINITY })
            .collect()
    };
    let mbps = if mib_per_round > 0.0 { per_round(mib_per_round) } else { Vec::new() };
    let ops = per_round(keys_per_round as f64);
    let fold = |v: &[f64], f: fn(f64, f64) -> f64| v.iter().copied().reduce(f).unwrap_or(0.0);
    let total_keys = keys_per_round * n;
    let mut op = json!({
        "operation": capitalized(name),
        "rounds": n,
        "rounds_timed_out": 0,
        "keys_per_round": keys_per_round,
        "total_keys": total_keys,
        "total_success": success,
        "duration_avg_ms": r2(avg),
        "duration_min_ms": r2(f.min_ms),
        "duration_max_ms": r2(f.max_ms),
        "duration_p50_ms": r2(f.p50_ms),
        "duration_p99_ms": r2(f.p99_ms),
        "duration_std_ms": r2(std),
        "throughput_avg_mbps": r2(mean(&mbps)),
        "throughput_min_mbps": r2(fold(&mbps, f64::min)),
        "throughput_max_mbps": r2(fold(&mbps, f64::max)),
        "ops_per_sec_avg": r2(mean(&ops)),
        "latency_per_key_ms": if keys_per_round > 0 {
            (avg / keys_per_round as f64 * 1000.0).round() / 1000.0
        } else {
            0.0
        },
    });
    if let Some((rate, count)) = expected.filter(|&(r, c)| r > 0.0 || c > 0) {
        op["expected_max_hit_rate"] = json!((rate * 1e4).round() / 1e4);
        op["expected_hit_count"] = json!(count);
        let actual = if total_keys > 0 { success as f64 / total_keys as f64 } else { 0.0 };
        op["actual_hit_rate"] = json!((actual * 1e4).round() / 1e4);
    }
    op
}

fn capitalized(name: &str) -> String {
    let mut c = name.chars();
    c.next().map(|f| f.to_uppercase().chain(c).collect()).unwrap_or_default()
}

/// Runs one round: `in_flight` submits of `num_keys` keys at once.
async fn store_round(
    b: &BuiltAdapter,
    a: &BenchL2Args,
    src: &[Bytes],
    run: u64,
    ph: &mut Phase,
) -> anyhow::Result<()> {
    let len = a.data_size_kb * 1024;
    let t0 = Instant::now();
    let subs = (0..a.in_flight).map(|s| async move {
        let t = Instant::now();
        let mut items = Vec::with_capacity(a.num_keys);
        for j in 0..a.num_keys {
            let i = s * a.num_keys + j;
            let k = key(run, i);
            let blob =
                b.codec.encode(&k, src[i].clone()).map_err(|e| anyhow::anyhow!("encode: {e}"))?;
            items.push((k, blob));
        }
        let res = b.adapter.store(items).await;
        let failed = res.iter().filter(|r| r.is_err()).count();
        anyhow::Ok((t.elapsed().as_secs_f64() * 1e3, failed))
    });
    for r in join_all(subs).await {
        let (ms, failed) = r?;
        ph.ms.push(ms);
        ph.failures += failed;
    }
    ph.seconds += t0.elapsed().as_secs_f64();
    ph.keys += a.in_flight * a.num_keys;
    ph.bytes += (a.in_flight * a.num_keys * len) as u64;
    Ok(())
}

/// Loads, verifies and decodes into `dest` (one buffer per key, as L1 would be); compares
/// with the source only after the clock stops.
async fn load_round(
    b: &BuiltAdapter,
    a: &BenchL2Args,
    src: &[Bytes],
    dest: &mut [Vec<u8>],
    run: u64,
    ph: &mut Phase,
) -> usize {
    let len = a.data_size_kb * 1024;
    let t0 = Instant::now();
    let direct = matches!(*b.codec, lmcache_l2::Codec::None);
    let subs = dest.chunks_mut(a.num_keys).enumerate().map(|(s, dests)| async move {
        let t = Instant::now();
        let keys: Vec<ObjectKey> = (0..a.num_keys).map(|j| key(run, s * a.num_keys + j)).collect();
        let mut failed = 0;
        if direct {
            // The tier's path for codec none: header and payload read straight into the
            // destination, then verified in place.
            let items: Vec<lmcache_l2::DirectItem> = keys
                .iter()
                .zip(dests.iter_mut())
                .map(|(k, d)| {
                    let sink: Box<dyn lmcache_l2::PayloadSink> = Box::new(std::mem::take(d));
                    (k.clone(), lmcache_l2::blob::header_len(k), sink)
                })
                .collect();
            let results = b.adapter.load_direct(items).await;
            failed += a.num_keys.saturating_sub(results.len());
            for ((k, d), (sink, r)) in keys.iter().zip(dests.iter_mut()).zip(results) {
                if let Ok(v) = sink.into_any().downcast::<Vec<u8>>() {
                    *d = *v;
                }
                let ok = matches!(r, Ok(Some(ref h))
                    if lmcache_l2::blob::verify_parts_hashed(k, &h.bytes, d, h.payload_xxh3).is_ok());
                if !ok {
                    failed += 1;
                }
            }
            return (t.elapsed().as_secs_f64() * 1e3, failed);
        }
        let loaded = b.adapter.load(&keys).await;
        for ((k, r), d) in keys.iter().zip(loaded).zip(dests.iter_mut()) {
            let ok = match r {
                Ok(Some(bytes)) => match b.codec.open(k, &bytes) {
                    Ok((h, payload)) if h.raw_len as usize == len => {
                        b.codec.decode_into(k, payload, d).is_ok()
                    }
                    _ => false,
                },
                _ => false,
            };
            if !ok {
                failed += 1;
            }
        }
        (t.elapsed().as_secs_f64() * 1e3, failed)
    });
    for (ms, failed) in join_all(subs).await {
        ph.ms.push(ms);
        ph.failures += failed;
    }
    ph.seconds += t0.elapsed().as_secs_f64();
    ph.keys += a.in_flight * a.num_keys;
    ph.bytes += (a.in_flight * a.num_keys * len) as u64;
    if a.skip_verify {
        return 0;
    }
    dest.iter().zip(src).filter(|(d, s)| d[..] != s[..]).count()
}

async fn lookup_round(b: &BuiltAdapter, a: &BenchL2Args, run: u64, ph: &mut Phase) -> usize {
    let t0 = Instant::now();
    let hit_keys = ((a.num_keys as f64) * a.lookup_max_hit_rate.clamp(0.0, 1.0)).floor() as usize;
    let subs = (0..a.in_flight).map(|s| async move {
        let t = Instant::now();
        let keys: Vec<ObjectKey> =
            (0..a.num_keys)
                .map(|j| {
                    if j < hit_keys { key(run, s * a.num_keys + j) } else { key(u64::MAX - run, j) }
                })
                .collect();
        let found = b.adapter.lookup(&keys).await.map(|f| f.iter().filter(|x| **x).count());
        (t.elapsed().as_secs_f64() * 1e3, found)
    });
    let mut hits = 0;
    for (ms, found) in join_all(subs).await {
        ph.ms.push(ms);
        match found {
            Ok(n) => hits += n,
            Err(_) => ph.failures += a.num_keys,
        }
    }
    ph.seconds += t0.elapsed().as_secs_f64();
    ph.keys += a.in_flight * a.num_keys;
    hits
}

/// Runs the benchmark.
pub fn run(a: BenchL2Args) -> anyhow::Result<()> {
    if a.num_keys == 0 || a.in_flight == 0 || a.data_size_kb == 0 || a.rounds == 0 {
        bail!("--num-keys, --in-flight, --data-size-kb and --rounds must be at least 1");
    }
    let spec = lmcache_l2::config::parse_json(&a.l2_adapter)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let b = rt.block_on(lmcache_l2::config::build(0, &spec)).context("building the adapter")?;
    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let only = a.only.as_deref();
    let total_rounds = a.warmup_rounds + a.rounds;
    let ops_run = if only.is_some() { 1 } else { 3 };
    let progress = (total_rounds * ops_run) as u64;
    let tracker = Tracker::new(&OPS, Some(progress), "rounds");
    let live = Live::start(
        tracker.clone(),
        format!("bench l2 {}", spec.get("type").and_then(Value::as_str).unwrap_or("?")),
        !a.quiet && matches!(a.format, Format::Terminal),
    );
    let t = &*tracker;
    let (mut store, mut load, mut lookup) = (Phase::default(), Phase::default(), Phase::default());
    let n = a.in_flight * a.num_keys;
    let src = make_data(n, a.data_size_kb * 1024);
    let mut dest: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; a.data_size_kb * 1024]).collect();
    let mut wrong = 0;
    let mut hits = 0;
    rt.block_on(async {
        // Stores (also the data later phases read).
        for r in 0..total_rounds {
            let mut scratch = Phase::default();
            let measured = r >= a.warmup_rounds && only.is_none_or(|o| o == "store");
            let ph = if measured { &mut store } else { &mut scratch };
            let before = (ph.seconds, ph.bytes, ph.failures);
            store_round(&b, &a, &src, run_id + r as u64, ph).await?;
            if measured {
                tracked(t, 0, ph, before);
            }
            if only.is_none_or(|o| o == "store") {
                t.step();
            }
        }
        if only.is_none_or(|o| o == "lookup") {
            for r in 0..total_rounds {
                let mut scratch = Phase::default();
                let ph = if r < a.warmup_rounds { &mut scratch } else { &mut lookup };
                let before = (ph.seconds, ph.bytes, ph.failures);
                let found = lookup_round(&b, &a, run_id + r as u64, ph).await;
                // Hits of the measured rounds only, as their keys: a warm-up's would put
                // `total_success` past `total_keys`.
                if r >= a.warmup_rounds {
                    hits += found;
                    tracked(t, 1, ph, before);
                }
                t.step();
            }
        }
        if only.is_none_or(|o| o == "load") {
            for r in 0..total_rounds {
                let mut scratch = Phase::default();
                let ph = if r < a.warmup_rounds { &mut scratch } else { &mut load };
                let before = (ph.seconds, ph.bytes, ph.failures);
                wrong += load_round(&b, &a, &src, &mut dest, run_id + r as u64, ph).await;
                if r >= a.warmup_rounds {
                    tracked(t, 2, ph, before);
                }
                t.step();
            }
        }
        // Leave the backend as found.
        for r in 0..total_rounds {
            let keys: Vec<ObjectKey> =
                (0..a.in_flight * a.num_keys).map(|i| key(run_id + r as u64, i)).collect();
            let _ = b.adapter.delete(&keys).await;
        }
        b.adapter.close().await;
        anyhow::Ok(())
    })?;
    live.finish();
    let figs = tracker.figures();
    let keys_per_round = a.in_flight * a.num_keys;
    let round_mb = (keys_per_round * a.data_size_kb) as f64 / 1024.0;
    let mut metrics = serde_json::Map::new();
    metrics.insert(
        "config".into(),
        json!({"l2_adapter_json": a.l2_adapter, "num_keys": a.num_keys, "in_flight": a.in_flight,
               "keys_per_round": keys_per_round, "data_size_kb": a.data_size_kb,
               "data_per_round_mb": (round_mb * 100.0).round() / 100.0, "measurement_rounds": a.rounds,
               "warmup_rounds": a.warmup_rounds, "lookup_max_hit_rate": a.lookup_max_hit_rate}),
    );
    let mut sections = Vec::new();
    let samples = tracker.samples();
    let failures = [store.failures, lookup.failures, load.failures];
    for (i, (name, f)) in OPS.iter().zip(&figs).enumerate().filter(|(_, (_, f))| f.count > 0) {
        let mbps = if f.mean_ms > 0.0 { round_mb / (f.mean_ms / 1e3) } else { 0.0 };
        let rounds_ms: Vec<f64> = samples[i].iter().map(|s| s.ms).collect();
        let success = match *name {
            "lookup" => hits,
            _ => (f.count as usize * keys_per_round).saturating_sub(failures[i]),
        };
        let expected = (*name == "lookup").then(|| {
            let per_round =
                (keys_per_round as f64 * a.lookup_max_hit_rate.clamp(0.0, 1.0)) as usize;
            (a.lookup_max_hit_rate, per_round * f.count as usize)
        });
        // LMCache's lookup moves no payload: its throughput figures are 0.
        let bytes_per_round = if *name == "lookup" { 0.0 } else { round_mb };
        metrics.insert(
            format!("op_{i}"),
            op_section(name, f, &rounds_ms, keys_per_round, bytes_per_round, success, expected),
        );
        sections.push((
            *name,
            vec![
                ("Rounds".to_owned(), f.count.to_string()),
                ("Keys / round".to_owned(), keys_per_round.to_string()),
                ("Duration avg (ms)".to_owned(), format!("{:.2}", f.mean_ms)),
                ("Duration min (ms)".to_owned(), format!("{:.2}", f.min_ms)),
                ("Duration max (ms)".to_owned(), format!("{:.2}", f.max_ms)),
                ("Duration p50 (ms)".to_owned(), format!("{:.2}", f.p50_ms)),
                ("Duration p99 (ms)".to_owned(), format!("{:.2}", f.p99_ms)),
                (
                    "Throughput avg (MB/s)".to_owned(),
                    if *name == "lookup" { "-".into() } else { format!("{mbps:.2}") },
                ),
                ("Rounds failed".to_owned(), f.errors.to_string()),
            ],
        ));
    }
    if let Some(path) = &a.csv {
        std::fs::write(path, tracker.to_csv())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &a.plot {
        let title = format!(
            "bench l2: {}, {} KiB objects, {} keys x {} in flight, {} rounds",
            spec.get("type").and_then(Value::as_str).unwrap_or("?"),
            a.data_size_kb,
            a.num_keys,
            a.in_flight,
            a.rounds
        );
        crate::bench::live::plot(&tracker, &title, path)?;
    }
    let doc = json!({
        "title": "L2 Adapter Benchmark Result",
        "metrics": metrics,
        "adapter": b.adapter.describe(),
        "codec": b.codec.name(),
        "num_keys": a.num_keys, "in_flight": a.in_flight, "data_size_kb": a.data_size_kb,
        "rounds": a.rounds, "warmup_rounds": a.warmup_rounds,
        "store": if only.is_none_or(|o| o == "store") { store.report() } else { Value::Null },
        "lookup": if only.is_none_or(|o| o == "lookup") { let mut v = lookup.report(); v["hits"] = json!(hits); v } else { Value::Null },
        "load": if only.is_none_or(|o| o == "load") { load.report() } else { Value::Null },
        "verify": if a.skip_verify { json!("skipped") } else { json!({"wrong_payloads": wrong}) },
    });
    if let Some(path) = &a.output {
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if !a.quiet {
        match a.format {
            Format::Json => println!("{}", serde_json::to_string_pretty(&doc)?),
            Format::Terminal => {
                let mut out = std::io::stdout().lock();
                let mut all = vec![(
                    "Configuration",
                    vec![
                        ("L2 adapter JSON".to_owned(), a.l2_adapter.clone()),
                        ("Keys / submit".to_owned(), a.num_keys.to_string()),
                        ("In-flight / round".to_owned(), a.in_flight.to_string()),
                        ("Data size / key (KB)".to_owned(), a.data_size_kb.to_string()),
                        ("Measurement rounds".to_owned(), a.rounds.to_string()),
                    ],
                )];
                all.extend(sections);
                write!(out, "{}", crate::bench::render("L2 Adapter Benchmark Result", &all))?;
                writeln!(
                    out,
                    "{} (codec {}), {} KiB objects, {} keys x {} in flight, {} rounds",
                    b.adapter.kind(),
                    b.codec.name(),
                    a.data_size_kb,
                    a.num_keys,
                    a.in_flight,
                    a.rounds
                )?;
                writeln!(
                    out,
                    "{:<8}{:>12}{:>12}{:>12}{:>12}{:>10}",
                    "op", "MiB/s", "ops/s", "p50 ms", "p99 ms", "failed"
                )?;
                for op in ["store", "lookup", "load"] {
                    let o = &doc[op];
                    if o.is_null() {
                        continue;
                    }
                    let f = |k: &str| o[k].as_f64().unwrap_or(0.0);
                    let mib = if op == "lookup" {
                        "-".to_owned()
                    } else {
                        format!("{:.0}", f("mib_per_s"))
                    };
                    writeln!(
                        out,
                        "{op:<8}{mib:>12}{:>12.0}{:>12.3}{:>12.3}{:>10}",
                        f("ops_per_s"),
                        f("submit_p50_ms"),
                        f("submit_p99_ms"),
                        o["failures"].as_u64().unwrap_or(0)
                    )?;
                }
                if !a.skip_verify {
                    writeln!(out, "verify: {wrong} wrong payloads")?;
                }
            }
        }
    }
    let failed: u64 =
        ["store", "load"].iter().map(|k| doc[k]["failures"].as_u64().unwrap_or(0)).sum();
    if wrong > 0 || failed > 0 {
        bail!("{failed} failed operations, {wrong} wrong payloads");
    }
    Ok(())
}
