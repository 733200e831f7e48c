//! `lmcache-rs`: the KV-cache server for LLM inference engines, and its operator commands.
//!
//! One module per command family:
//! - `server`: `lmcache-rs server`, its flags (LMCache's names) to a `ServerConfig`;
//!   `config_file`: `--config FILE` (TOML) expanded into flags; `otel`: the OTLP exporter.
//! - `coordinator`: `lmcache-rs coordinator`.
//! - `bench`: `bench server` (both transfer paths, the live display, `--plot`, `--csv`);
//!   `bench_l2`: `bench l2`; `plot`: PNG charts with an embedded font.
//! - `ops`: operator commands against a server (`ping`, `describe`, `kvcache clear`, `quota`).
//! - `query`: `query coordinator`.
//! - `tool`: `tool cache-simulator`.
//! - `trace`: `trace info|replay|replay-events`.
#![forbid(unsafe_code)]

mod bench;
mod bench_l2;
mod config_file;
mod coordinator;
mod ops;
mod otel;
mod plot;
mod query;
mod server;
mod tool;
mod trace;

use clap::{Parser, Subcommand};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// lmcache-rs: a KV-cache layer for LLM inference engines, compatible with LMCache.
#[derive(Debug, Parser)]
#[command(name = "lmcache-rs", version, about, long_about = None)]
struct Cli {
    /// Log level (error, warn, info, debug, trace); RUST_LOG overrides it.
    #[arg(long, global = true, default_value = "info")]
    log_level: String,
    /// Log format: human text or one JSON object per line.
    #[arg(long, global = true, value_parser = ["text", "json"], default_value = "text")]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the cache server (every flag has a default; LMCache's flag names).
    Server(Box<server::ServerArgs>),
    /// Run the fleet coordinator (LMCache's `lmcache coordinator` API on port 9300).
    Coordinator(Box<coordinator::CoordinatorArgs>),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Check that a server answers (exit 1 if not).
    Ping {
        /// What to ping.
        #[arg(value_enum)]
        target: ops::Target,
        #[command(flatten)]
        common: ops::Common,
    },
    /// Show a server's health, L1 use, policy, sessions and registered workers.
    Describe {
        /// What to describe.
        #[arg(value_enum)]
        target: ops::Target,
        #[command(flatten)]
        common: ops::Common,
    },
    /// Cache operations.
    #[command(subcommand)]
    Kvcache(ops::KvcacheCommand),
    /// Why a request's last lookup missed, chunk by chunk: never stored, stored under another
    /// salt/model/layout, evicted (when, by which policy, from which tier), locked, an L2 error
    /// or timeout, refused by a quota, a peer that did not answer.
    Explain {
        /// The request id the engine looked up with.
        request_id: String,
        #[command(flatten)]
        common: ops::Common,
    },
    /// Per-tenant (cache_salt) quotas; `_default` is the empty salt.
    #[command(subcommand)]
    Quota(ops::QuotaCommand),
    /// Read a fleet coordinator's APIs (ours or LMCache's).
    #[command(subcommand)]
    Query(query::QueryCommand),
    /// Offline tools over lookup-hash logs (LMCache's `lmcache tool`).
    #[command(subcommand)]
    Tool(tool::ToolCommand),
    /// Trace files (`server --trace-level`): inspect, replay storage calls, replay a fleet's
    /// cache events into a coordinator (LMCache's `lmcache trace`).
    #[command(subcommand)]
    Trace(trace::TraceCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Drive an MP server (ours or LMCache's) like engines do: cold store, warm retrieve.
    Server(bench::BenchArgs),
    /// Store, lookup and load throughput of one L2 adapter (as `lmcache bench l2`).
    L2(bench_l2::BenchL2Args),
    /// Drive an inference engine over its OpenAI API with LMCache's workloads (as `lmcache
    /// bench engine`): TTFT, decode speed, throughput, and how much the cache served.
    Engine(Box<bench::engine::EngineArgs>),
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("server") {
        let rest = config_file::expand(args.split_off(2))?;
        args.extend(rest);
        server::refuse_unsupported(&args[2..])?;
    } else if args.get(1).map(String::as_str) == Some("bench")
        && args.get(2).map(String::as_str) == Some("engine")
    {
        let rest = bench::engine::config::expand(args.split_off(3))?;
        args.extend(rest);
    }
    let cli = Cli::parse_from(args);
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cli.log_level));
    let otlp = match &cli.command {
        Command::Server(a) => a.otlp_endpoint.clone(),
        _ => None,
    };
    let (otel_layer, provider) = match otlp.as_deref() {
        Some(ep) => {
            let (layer, provider) = otel::layer(ep)?;
            (Some(layer), Some(provider))
        }
        None => (None, None),
    };
    // Colours on a terminal only: a log file or a pipe gets plain text.
    let fmt = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter).with(otel_layer);
    if cli.log_format == "json" {
        registry.with(fmt.json()).init();
    } else {
        registry.with(fmt).init();
    }
    if let Some(ep) = &otlp {
        tracing::info!(endpoint = %ep, "exporting spans over OTLP/HTTP");
    }
    let result = dispatch(cli.command);
    if let Some(p) = provider
        && let Err(e) = p.shutdown()
    {
        eprintln!("warning: flushing OTLP spans failed: {e}");
    }
    result
}

fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Server(args) => server::run(*args),
        Command::Coordinator(args) => coordinator::run(*args),
        Command::Bench(BenchCommand::Server(args)) => bench::run(args),
        Command::Bench(BenchCommand::L2(args)) => bench_l2::run(args),
        Command::Bench(BenchCommand::Engine(args)) => bench::engine::run(*args),
        Command::Ping { target, common } => ops::ping(target, &common),
        Command::Describe { target, common } => ops::describe(target, &common),
        Command::Explain { request_id, common } => ops::explain(&request_id, &common),
        Command::Kvcache(cmd) => ops::kvcache(&cmd),
        Command::Quota(cmd) => ops::quota(&cmd),
        Command::Query(cmd) => query::run(&cmd),
        Command::Tool(cmd) => tool::run(cmd),
        Command::Trace(cmd) => trace::run(cmd),
    }
}
