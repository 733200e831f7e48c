//! `lmcache-rs trace info|replay|replay-events`: LMCache's `.lct` traces (recorded by
//! `lmcache-rs server --trace-level` or by LMCache's `lmcache server --trace-level`).

mod replay;
mod replay_events;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use lmcache_workload::trace::info::TraceInfo;
use lmcache_workload::trace::stats::{ReplayStats, short_op_name};
use lmcache_workload::trace::{Record, TraceReader};

use crate::bench::Format;
use crate::server::ServerArgs;

/// `trace ...`.
#[derive(Debug, Subcommand)]
pub enum TraceCommand {
    /// Summarize a trace file (LMCache's `lmcache trace info` report).
    Info(InfoArgs),
    /// Replay a storage-level trace against a fresh storage manager built from the replay
    /// side's server flags (L1 size, eviction policy, L2 adapters), with per-call latency.
    Replay(Box<ReplayArgs>),
    /// Deliver events-level traces (one per recorded server) to a coordinator, ours or
    /// LMCache's, like a live fleet: registration, heartbeats, batches, deregistration.
    ReplayEvents(ReplayEventsArgs),
}

/// `trace info`.
#[derive(Debug, Args)]
pub struct InfoArgs {
    /// A `.lct` trace file.
    #[arg(value_name = "FILE")]
    pub trace_path: PathBuf,
    /// Output: LMCache's report (terminal) or JSON.
    #[arg(long, value_enum, default_value = "terminal")]
    pub format: Format,
}

/// `trace replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// A storage-level `.lct` trace file.
    #[arg(value_name = "FILE")]
    pub trace_path: PathBuf,
    /// Print one line per replayed record.
    #[arg(long)]
    pub verbose: bool,
    /// Write one JSON object per replayed record (qualname, latency_ms, failed) here.
    #[arg(long, value_name = "PATH")]
    pub jsonl_out: Option<PathBuf>,
    /// Directory of the CSV/JSON summaries.
    #[arg(long, default_value = ".", value_name = "DIR")]
    pub output_dir: PathBuf,
    /// Skip the CSV summary (trace_replay_ops.csv).
    #[arg(long)]
    pub no_csv: bool,
    /// Also write the JSON summary (trace_replay_summary.json).
    #[arg(long)]
    pub json: bool,
    /// No summary table.
    #[arg(short, long)]
    pub quiet: bool,
    /// Pacing: 1 honours the recorded gaps (LMCache's behaviour: never faster), 2 twice as
    /// fast, 0 as fast as the storage manager takes the calls.
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Summary output: a table (terminal) or JSON on stdout.
    #[arg(long, value_enum, default_value = "terminal")]
    pub format: Format,
    /// The storage manager replayed into (the server's flags; its L1 is private memory).
    #[command(flatten, next_help_heading = "Replay-side storage (lmcache-rs server's flags)")]
    pub storage: ServerArgs,
}

/// `trace replay-events`.
#[derive(Debug, Args)]
pub struct ReplayEventsArgs {
    /// Events-level `.lct` files, one per server; merged by wall-clock time.
    #[arg(value_name = "FILE", num_args = 1.., required = true)]
    pub trace_path: Vec<PathBuf>,
    /// The coordinator's base URL.
    #[arg(long, value_name = "URL")]
    pub coordinator_url: String,
    /// Pacing: 1 as recorded, 2 twice as fast, 0 as fast as the coordinator takes batches.
    #[arg(long, default_value_t = 0.0)]
    pub speed: f64,
    /// Heartbeat each registered server this often (below the coordinator's instance
    /// timeout); 0 sends none.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    pub heartbeat_interval: f64,
    /// No summary table.
    #[arg(short, long)]
    pub quiet: bool,
    /// Summary output: a table (terminal) or JSON.
    #[arg(long, value_enum, default_value = "terminal")]
    pub format: Format,
}

/// Runs a `trace` command.
pub fn run(cmd: TraceCommand) -> anyhow::Result<()> {
    match cmd {
        TraceCommand::Info(a) => info(&a),
        TraceCommand::Replay(a) => replay_storage(&a),
        TraceCommand::ReplayEvents(a) => replay_events(&a),
    }
}

fn open(path: &std::path::Path) -> anyhow::Result<TraceReader<std::io::BufReader<std::fs::File>>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    TraceReader::new(std::io::BufReader::new(f))
        .with_context(|| format!("reading {}", path.display()))
}

fn info(a: &InfoArgs) -> anyhow::Result<()> {
    let mut r = open(&a.trace_path)?;
    let mut info = TraceInfo::new(r.header());
    while let Some(rec) = r.next_record()? {
        info.add(&rec);
    }
    info.malformed = r.malformed();
    info.truncated = r.truncated().map(str::to_owned);
    let path = a.trace_path.display().to_string();
    match a.format {
        Format::Terminal => {
            print!("{}", info.render_text(&path));
            if let Some(why) = &info.truncated {
                eprintln!(
                    "warning: the trace ends inside a frame ({why}); the records before it are counted"
                );
            }
            if info.malformed > 0 {
                eprintln!("warning: {} malformed frame(s) skipped", info.malformed);
            }
        }
        Format::Json => println!("{}", serde_json::to_string_pretty(&info.to_json(&path))?),
    }
    Ok(())
}

/// A one-line progress display on stderr, redrawn in place (only on a terminal).
struct Progress {
    on: bool,
    last: Instant,
    started: Instant,
}

impl Progress {
    fn new(on: bool) -> Self {
        let on = on && std::io::stderr().is_terminal();
        Self { on, last: Instant::now() - Duration::from_secs(1), started: Instant::now() }
    }

    fn show(&mut self, done: usize, total: usize) {
        if !self.on || (self.last.elapsed() < Duration::from_millis(100) && done < total) {
            return;
        }
        self.last = Instant::now();
        eprint!(
            "\r  {}  {:.1} s",
            crate::bench::live::bar(done as u64, total as u64, "records"),
            self.started.elapsed().as_secs_f64()
        );
        let _ = std::io::stderr().flush();
        if done >= total {
            eprintln!();
        }
    }
}

/// Refuses, by name, the `lmcache-rs server` flags `trace replay` accepts (it shares the
/// server's flag set) but has no use for: the replay builds storage only (L1 in private
/// memory, L2 adapters, eviction), with no endpoint, HTTP, workers, segment, coordinator,
/// logs or traces of its own, and its keys come whole from the trace.
fn refuse_server_only_flags(given: &ServerArgs) -> anyhow::Result<()> {
    #[derive(clap::Parser)]
    struct Defaults {
        #[command(flatten)]
        server: ServerArgs,
    }
    let d = <Defaults as clap::Parser>::try_parse_from(["replay"])
        .context("the server flags' defaults")?
        .server;
    let mut set = Vec::new();
    macro_rules! unused {
        ($($field:ident),* $(,)?) => {
            $(if given.$field != d.$field {
                set.push(format!("--{}", stringify!($field).replace('_', "-")));
            })*
        };
    }
    unused!(
        config,
        host,
        port,
        http_host,
        http_port,
        http_auth_token,
        chunk_size,
        max_workers,
        max_cpu_workers,
        max_gpu_workers,
        supported_transfer_mode,
        worker_reap_timeout_seconds,
        worker_registration_grace_seconds,
        session_ttl_seconds,
        null_block_id,
        lookup_hash_log_dir,
        lookup_hash_log_rotation_interval,
        lookup_hash_log_rotation_max_size,
        lookup_hash_log_max_files,
        separate_object_groups,
        copy_threads,
        event_bus_queue_size,
        disable_observability,
        kv_event_log_size,
        hash_algorithm,
        l1_use_hugepages,
        shm_name,
        allowed_shm_prefix,
        otlp_endpoint,
        enable_tracing,
        instance_id,
        coordinator_url,
        coordinator_advertise_ip,
        coordinator_heartbeat_interval,
        coordinator_event_reporting,
        coordinator_event_flush_interval,
        coordinator_event_transport,
        coordinator_nats_url,
        coordinator_nats_stream,
        coordinator_auth_token,
        p2p_advertise_url,
        p2p_listen_url,
        p2p_transfer_engine,
        nixl_library,
        p2p_lookup_timeout,
        p2p_load_timeout,
        p2p_same_host,
        trace_level,
        trace_output,
        exit_after_seconds,
    );
    if !set.is_empty() {
        bail!(
            "{} {} a server flag that `trace replay` does not use (it replays into storage \
             only: L1 size, eviction, TTLs and L2 flags apply)",
            set.join(", "),
            if set.len() == 1 { "is" } else { "are" }
        );
    }
    Ok(())
}

fn replay_storage(a: &ReplayArgs) -> anyhow::Result<()> {
    refuse_server_only_flags(&a.storage)?;
    if !(a.speed.is_finite() && a.speed >= 0.0) {
        bail!("--speed must be a number >= 0, got {}", a.speed);
    }
    let mut reader = open(&a.trace_path)?;
    let header = reader.header().clone();
    if header.level != "storage" {
        bail!(
            "{} is a {:?}-level trace; `trace replay` replays \"storage\" traces (an \"events\" trace goes to `trace replay-events`)",
            a.trace_path.display(),
            header.level
        );
    }
    let records: Vec<Record> = reader.read_all()?;
    if let Some(why) = reader.truncated() {
        tracing::warn!("{why}; replaying the records before it");
    }
    let mut config = crate::server::config(&a.storage)?;
    // The replay's L1 is its own: private memory, no segment for anyone to map.
    config.arena.backing = lmcache_memory::ArenaBacking::Anonymous;
    let replay_json = lmcache_server::server::storage_config_json(&config);
    let (_, replay_digest) = lmcache_server::trace_record::config_digest(&replay_json);
    // The same door the server builds its storage through.
    let storage = lmcache_storage::Storage::build(&config.storage_config())
        .context("building the replay's storage")?;
    let mut replayer = replay::Replayer::new((*storage).clone());
    std::fs::create_dir_all(&a.output_dir)
        .with_context(|| format!("creating {}", a.output_dir.display()))?;
    let mut jsonl = match &a.jsonl_out {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let mut stats = ReplayStats::default();
    let (mut replayed, mut skipped, mut failed) = (0u64, 0u64, 0u64);
    let total = records.len();
    let mut progress = Progress::new(!a.quiet && !a.verbose);
    let started = Instant::now();
    for (i, rec) in records.iter().enumerate() {
        if a.speed > 0.0 {
            let due = started + Duration::from_secs_f64((rec.t_mono / a.speed).max(0.0));
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
        }
        let t0 = Instant::now();
        let res = replayer.apply(rec);
        let latency = t0.elapsed().as_secs_f64();
        let is_failed = match &res {
            Ok(()) => {
                replayed += 1;
                stats.record(&rec.qualname, latency, false);
                false
            }
            Err(replay::ReplayError::Unknown(q)) => {
                skipped += 1;
                tracing::warn!(qualname = %q, "no handler; skipping");
                true
            }
            Err(replay::ReplayError::Decode(e)) => {
                failed += 1;
                stats.record(&rec.qualname, latency, true);
                tracing::warn!(qualname = %rec.qualname, error = %e, "record failed");
                true
            }
        };
        let status = if is_failed { "FAIL" } else { "OK" };
        if a.verbose {
            println!(
                "  [{}/{total}]  {status:<4}  {:8.3}ms  {}",
                i + 1,
                latency * 1e3,
                rec.qualname
            );
        }
        if let Some(w) = &mut jsonl {
            writeln!(
                w,
                "{}",
                serde_json::json!({"qualname": rec.qualname, "latency_ms": latency * 1e3, "failed": is_failed})
            )?;
        }
        progress.show(i + 1, total);
    }
    replayer.finish();
    let duration = started.elapsed().as_secs_f64();
    if let Some(mut w) = jsonl {
        w.flush()?;
    }
    if !a.no_csv {
        let p = a.output_dir.join("trace_replay_ops.csv");
        std::fs::write(&p, stats.to_csv()).with_context(|| format!("writing {}", p.display()))?;
    }
    let outcome = replayer.outcome.clone();
    let mut doc = stats.to_json(duration);
    doc["level"] = header.level.clone().into();
    doc["records"] =
        serde_json::json!({"replayed": replayed, "skipped": skipped, "failed": failed});
    doc["config_digest"] =
        serde_json::json!({"recorded": header.sm_config_digest, "replay": replay_digest});
    doc["storage"] = serde_json::to_value(&outcome)?;
    doc["storage"]["hit_rate"] = outcome.hit_rate().into();
    if a.json {
        let p = a.output_dir.join("trace_replay_summary.json");
        std::fs::write(&p, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", p.display()))?;
    }
    drop(replayer);
    storage.shutdown();
    drop(storage);
    if !a.quiet {
        match a.format {
            Format::Json => println!("{}", serde_json::to_string_pretty(&doc)?),
            Format::Terminal => print_replay(
                &header,
                &stats,
                &outcome,
                (replayed, skipped, failed),
                duration,
                &replay_digest,
            ),
        }
    }
    if failed > 0 {
        bail!("{failed} record(s) failed to replay");
    }
    Ok(())
}

fn print_replay(
    header: &lmcache_workload::trace::Header,
    stats: &ReplayStats,
    o: &replay::Outcome,
    (replayed, skipped, failed): (u64, u64, u64),
    duration: f64,
    replay_digest: &str,
) {
    let bar = "=".repeat(64);
    println!("{bar}\n{:^64}\n{bar}", "Trace Replay Result");
    let row = |k: &str, v: String| println!("  {k:<36}{v:>26}");
    println!("Overall");
    row("Trace level", header.level.clone());
    row("Records replayed", replayed.to_string());
    row("Records skipped", skipped.to_string());
    row("Records failed", failed.to_string());
    row("Replay duration (s)", format!("{duration:.3}"));
    let rec = &header.sm_config_digest;
    if !rec.is_empty() {
        let short = |d: &str| d.chars().take(8).collect::<String>();
        row(
            "Config digest",
            if rec == replay_digest {
                format!("match ({})", short(rec))
            } else {
                format!("differs (rec={}, run={})", short(rec), short(replay_digest))
            },
        );
    }
    println!("Storage");
    row("Lookups (key groups)", o.lookups.to_string());
    row("Lookup hit rate", format!("{:.2}%", o.hit_rate() * 100.0));
    row("  L1 / L2 hit chunks", format!("{} / {}", o.l1_hit_chunks, o.l2_hit_chunks));
    row("Reserved / refused", format!("{} / {}", o.reserved, o.reserve_refused));
    row("Committed", o.committed.to_string());
    row("Locks released / not held", format!("{} / {}", o.locks_released, o.locks_not_held));
    if o.reads + o.read_misses > 0 {
        row("Reads / misses", format!("{} / {}", o.reads, o.read_misses));
    }
    println!("Per-Op Latency (ms)");
    println!("  {:<30}{:>7}{:>9}{:>9}{:>9}{:>9}", "op", "count", "mean", "p50", "p99", "errors");
    for (q, s) in stats.summary() {
        println!(
            "  {:<30}{:>7}{:>9.3}{:>9.3}{:>9.3}{:>9}",
            short_op_name(&q),
            s.count,
            s.mean_ms,
            s.p50_ms,
            s.p99_ms,
            s.errors
        );
    }
    println!("{bar}");
}

fn replay_events(a: &ReplayEventsArgs) -> anyhow::Result<()> {
    let interval = Duration::try_from_secs_f64(a.heartbeat_interval).map_err(|_| {
        anyhow::anyhow!("--heartbeat-interval must be >= 0, got {}", a.heartbeat_interval)
    })?;
    let trace = replay_events::EventsTrace::load(&a.trace_path)?;
    let servers = trace.instances();
    tracing::info!(
        files = trace.files.len(),
        servers = servers.len(),
        records = trace.records.len(),
        coordinator = %a.coordinator_url,
        "replaying events"
    );
    let mut target = replay_events::CoordinatorTarget::new(&a.coordinator_url, interval);
    let mut progress = Progress::new(!a.quiet);
    let result = replay_events::replay(&trace, &mut target, a.speed, |d, t| progress.show(d, t))
        .with_context(|| {
            format!("replay stopped: the coordinator at {} failed a call", a.coordinator_url)
        })?;
    drop(target);
    if a.quiet {
        return Ok(());
    }
    match a.format {
        Format::Json => {
            let mut doc = serde_json::to_value(&result)?;
            doc["files"] =
                trace.files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().into();
            doc["servers"] = servers.into();
            println!("{}", serde_json::to_string_pretty(&doc)?);
        }
        Format::Terminal => {
            let bar = "=".repeat(64);
            println!("{bar}\n{:^64}\n{bar}", "Events Replay Result");
            let row = |k: &str, v: String| println!("  {k:<36}{v:>26}");
            row("Files", trace.files.len().to_string());
            row("Servers", servers.len().to_string());
            row("Records", result.records.to_string());
            row("Batches delivered", result.batches.to_string());
            row("Batches applied", result.applied.to_string());
            row("Batches duplicate", result.duplicates.to_string());
            row("Batches stale", result.stale.to_string());
            row("Start marks", result.starts.to_string());
            row("Stop marks", result.stops.to_string());
            row("Streams cut without stop", result.ended.to_string());
            row("Records skipped", result.skipped.to_string());
            row("Replay duration (s)", format!("{:.3}", result.duration_s));
            println!("{bar}");
        }
    }
    Ok(())
}
