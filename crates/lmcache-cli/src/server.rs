//! `lmcache-rs server`: builds the L1 tier from LMCache's flags and serves until SIGINT or
//! SIGTERM, then releases everything (the shared-memory segment is unlinked).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use lmcache_core::units::{gib_to_bytes, human_bytes};
use lmcache_l1::{EvictionPolicyKind, L1Cache, L1Config, Maintenance};
use lmcache_memory::shm::{SHM_DIR, clean_stale_segments, default_shm_name};
use lmcache_memory::{Arena, ArenaAllocator, ArenaBacking, ArenaConfig};
use nix::sys::signal::{SigSet, Signal};

/// Flags of `lmcache-rs server`, named and defaulted as `lmcache server`'s.
#[derive(Debug, Clone, Args)]
pub struct ServerArgs {
    /// Tokens per chunk.
    #[arg(long, default_value_t = lmcache_core::DEFAULT_CHUNK_SIZE)]
    pub chunk_size: usize,
    /// L1 (CPU memory) size in GiB. Memory is committed as it is used.
    #[arg(long, default_value_t = 8.0)]
    pub l1_size_gb: f64,
    /// Alignment of every L1 object in bytes (a power of two).
    #[arg(long, default_value_t = lmcache_memory::DEFAULT_ALIGN)]
    pub l1_align_bytes: u64,
    /// Back L1 with 2 MiB huge pages (private memory; not shareable with the engine).
    #[arg(long)]
    pub l1_use_hugepages: bool,
    /// Lock L1 in RAM (mlock). Commits the whole L1 at start.
    #[arg(long)]
    pub l1_mlock: bool,
    /// Name of the L1 shared-memory segment (default: lmcache_l1_pool_<pid>).
    #[arg(long, default_value = "")]
    pub shm_name: String,
    /// Eviction policy: LRU, ARC, S3FIFO, IsolatedLRU or noop.
    #[arg(long, default_value = "LRU", value_parser = parse_policy)]
    pub eviction_policy: EvictionPolicyKind,
    /// Background eviction starts when this fraction of L1 is used.
    #[arg(long, default_value_t = 0.8)]
    pub eviction_trigger_watermark: f64,
    /// Fraction of used L1 bytes each background pass evicts.
    #[arg(long, default_value_t = 0.2)]
    pub eviction_ratio: f64,
    /// A read lock of a client that went silent is released after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub l1_read_ttl_seconds: u64,
    /// A write reservation of a client that went silent is dropped after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub l1_write_ttl_seconds: u64,
    /// Exit after this many seconds (for tests and benchmarks); 0 runs until a signal.
    #[arg(long, default_value_t = 0, hide = true)]
    pub exit_after_seconds: u64,
}

fn parse_policy(s: &str) -> Result<EvictionPolicyKind, String> {
    s.parse().map_err(|e: lmcache_l1::eviction::UnknownPolicy| e.to_string())
}

/// Everything the server owns; dropped in field order on shutdown.
struct Server {
    _maintenance: Maintenance,
    l1: L1Cache,
}

fn build(args: &ServerArgs) -> anyhow::Result<Server> {
    if args.chunk_size == 0 {
        bail!("--chunk-size must be at least 1");
    }
    let size = gib_to_bytes(args.l1_size_gb)
        .filter(|&b| b > 0)
        .with_context(|| format!("--l1-size-gb {} is not a positive size", args.l1_size_gb))?;
    let backing = if args.l1_use_hugepages {
        if !args.shm_name.is_empty() {
            bail!("--l1-use-hugepages and --shm-name exclude each other (huge pages are private)");
        }
        ArenaBacking::HugePages
    } else {
        let removed = clean_stale_segments(std::path::Path::new(SHM_DIR));
        if !removed.is_empty() {
            tracing::info!(count = removed.len(), "removed stale L1 segments of crashed runs");
        }
        let name =
            if args.shm_name.is_empty() { default_shm_name() } else { args.shm_name.clone() };
        ArenaBacking::SharedMemory { name }
    };
    let arena = Arena::create(&ArenaConfig { size, backing, mlock: args.l1_mlock })
        .context("creating the L1 arena")?;
    let memory = ArenaAllocator::new(arena, args.l1_align_bytes)
        .with_context(|| format!("--l1-align-bytes {}", args.l1_align_bytes))?;
    let config = L1Config {
        eviction_policy: args.eviction_policy,
        trigger_watermark: args.eviction_trigger_watermark,
        eviction_ratio: args.eviction_ratio,
        read_ttl: Duration::from_secs(args.l1_read_ttl_seconds),
        write_ttl: Duration::from_secs(args.l1_write_ttl_seconds),
        ..L1Config::default()
    };
    let l1 = L1Cache::new(config, memory).context("configuring L1")?;
    let maintenance = Maintenance::spawn(l1.clone()).context("starting L1 maintenance")?;
    Ok(Server { _maintenance: maintenance, l1 })
}

/// Runs the server until SIGINT/SIGTERM (or `--exit-after-seconds`).
pub fn run(args: ServerArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    // Block the shutdown signals before any thread starts, so every thread inherits the mask
    // and the main thread alone receives them through sigwait.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals.thread_block().context("blocking shutdown signals")?;

    let server = build(&args)?;
    let arena = server.l1.memory().arena();
    tracing::info!(
        l1 = %human_bytes(arena.len()),
        backing = arena.kind().as_str(),
        shm = arena.shm_name().unwrap_or("-"),
        policy = %args.eviction_policy,
        chunk_size = args.chunk_size,
        ready_ms = started.elapsed().as_millis() as u64,
        "lmcache-rs L1 ready"
    );
    if args.exit_after_seconds > 0 {
        std::thread::sleep(Duration::from_secs(args.exit_after_seconds));
    } else {
        let sig = signals.wait().context("waiting for a shutdown signal")?;
        tracing::info!(signal = ?sig, "shutting down");
    }
    drop(server);
    tracing::info!("stopped");
    Ok(())
}
