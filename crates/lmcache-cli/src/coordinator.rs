//! `lmcache-rs coordinator`: the fleet coordinator, with `lmcache coordinator`'s flags.

use std::time::Duration;

use anyhow::{Context as _, bail};
use lmcache_coordinator::{Coordinator, CoordinatorConfig};

/// Run the fleet coordinator: cache servers register, heartbeat and report their cache
/// events to it; routers ask it which server holds a request's prefix.
#[derive(Debug, clap::Args)]
pub struct CoordinatorArgs {
    /// Address the HTTP server binds to. Loopback by default (LMCache binds 0.0.0.0): open
    /// it to the fleet's network with --auth-token set.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// This coordinator's own bearer token: required on registration, heartbeats, event
    /// reports, deregistration and every write route (quotas, pins, relays). Only servers
    /// that registered with it are sent --server-http-auth-token.
    #[arg(
        long,
        env = "LMCACHE_RS_COORDINATOR_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub auth_token: Option<String>,
    /// Accept registrations, heartbeats and event reports without --auth-token (LMCache's
    /// servers send none). Such instances are never sent --server-http-auth-token.
    #[arg(long)]
    pub allow_unauthenticated_registration: bool,
    /// Port the HTTP server binds to.
    #[arg(long, default_value_t = 9300)]
    pub port: u16,
    /// Seconds without a heartbeat after which an instance is dropped (its L1 placements go).
    #[arg(long, default_value_t = 30.0)]
    pub instance_timeout: f64,
    /// Seconds between health sweeps; 0 disables them.
    #[arg(long, default_value_t = 10.0)]
    pub health_check_interval: f64,
    /// Seconds between fleet L2 eviction sweeps (salts over their quota); 0 disables them.
    #[arg(long, default_value_t = 5.0)]
    pub eviction_check_interval: f64,
    /// Fraction of an over-quota salt's L2 keys a sweep removes, least recently used first.
    #[arg(long, default_value_t = 0.2)]
    pub eviction_ratio: f64,
    /// Usage / quota ratio at which a salt is evicted.
    #[arg(long, default_value_t = 1.0)]
    pub trigger_watermark: f64,
    /// Tokens per chunk; must equal the servers' --chunk-size.
    #[arg(long, default_value_t = 256)]
    pub chunk_size: usize,
    /// Token hash algorithm; must equal the servers'. Only blake3 (the default) is served.
    #[arg(long, default_value = "blake3")]
    pub hash_algorithm: String,
    /// Chunk hashes whose token ids are kept for lookup answers (1 KiB each at 256 tokens);
    /// past it new chunks are indexed without their tokens.
    #[arg(long, default_value_t = 262_144)]
    pub max_token_bindings: usize,
    /// Bearer token of the servers' HTTP APIs (their --http-auth-token): the coordinator
    /// sends it when it fetches snapshots for repairs, relays prefetches and deletes, and
    /// sends fleet eviction orders. Without it such a server is fenced instead of resynced.
    #[arg(long, env = "LMCACHE_RS_HTTP_TOKEN", hide_env_values = true)]
    pub server_http_auth_token: Option<String>,
    /// Index stored chunk content for CacheBlend's /directory/blend-lookup (each chunk costs
    /// its token binding; see --max-token-bindings).
    #[arg(long)]
    pub enable_blend_lookup: bool,
    /// Query positions between CacheBlend probes (1 finds every match; used with
    /// --enable-blend-lookup).
    #[arg(long, default_value_t = 1)]
    pub blend_probe_stride: usize,
    /// File to checkpoint the coordinator's state to (registry, stream cursors, capacity
    /// declarations, the directory), so a restart resumes instead of starting cold. Unset: off.
    #[arg(long)]
    pub checkpoint_path: Option<std::path::PathBuf>,
    /// Seconds between checkpoint writes; 0 writes only at a clean stop.
    #[arg(long, default_value_t = 60.0)]
    pub checkpoint_interval: f64,
    /// JSON object of settings for out-of-tree controllers (LMCache's Python plug-ins; none
    /// are loaded here, so any key is refused).
    #[arg(long)]
    pub extra_config: Option<String>,
    /// File for operator-set state (L2 pins and per-cache_salt quotas), LMCache's JSON
    /// document, rewritten by every change. Unset: that state is lost on restart.
    #[arg(long)]
    pub metadata_path: Option<std::path::PathBuf>,
    /// Seconds idle connections stay open (accepted; connections stay open until closed).
    #[arg(long, default_value_t = 10.0)]
    pub timeout_keep_alive: f64,
    /// Do not serve /metrics.
    #[arg(long)]
    pub disable_metrics: bool,
    /// OTLP metrics push (not available: /metrics is pulled; refused).
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// Transport cache events arrive on, exactly one: http (POST /events) or jetstream (the
    /// NATS JetStream stream at --nats-url; POST /events then answers 404). LMCache's kafka
    /// is not available.
    #[arg(long, default_value = "http", value_parser = ["http", "jetstream", "kafka"])]
    pub event_transport: String,
    /// NATS server for --event-transport jetstream.
    #[arg(long, value_name = "URL")]
    pub nats_url: Option<String>,
    /// JetStream stream to consume (created when missing).
    #[arg(long, default_value = "LMCACHE_CACHE_EVENTS")]
    pub nats_stream: String,
    /// Kafka bootstrap servers (with --event-transport kafka).
    #[arg(long)]
    pub kafka_bootstrap_servers: Option<String>,
    /// Kafka topic.
    #[arg(long, default_value = "lmcache-cache-events")]
    pub kafka_topic: String,
    /// Kafka consumer group.
    #[arg(long, default_value = "lmcache-coordinator")]
    pub kafka_group_id: String,
    /// Re-publish the fleet's cache events in vLLM's KV-event format (msgpack `KVEventBatch`)
    /// on a ZMQ PUB socket bound here, topic `kv@<instance_id>@<model>`, so that routers
    /// consuming vLLM's events (llm-d, Dynamo) see every server's L1 and L2. Off by default.
    #[arg(long, value_name = "ENDPOINT")]
    pub vllm_kv_events_endpoint: Option<String>,
    /// A ZMQ ROUTER endpoint, bound, answering replay requests as vLLM's publisher does
    /// (needs --vllm-kv-events-endpoint).
    #[arg(long, value_name = "ENDPOINT")]
    pub vllm_kv_events_replay_endpoint: Option<String>,
    /// Batches kept for replay (vLLM's buffer_steps).
    #[arg(long, default_value_t = 10_000)]
    pub vllm_kv_events_buffer_steps: usize,
    /// Exit after this many seconds (tests); 0 runs until a signal.
    #[arg(long, default_value_t = 0, hide = true)]
    pub exit_after_seconds: u64,
}

fn seconds(name: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v)
        .with_context(|| format!("--{name}: {v} is not a number of seconds"))
}

fn config(a: &CoordinatorArgs) -> anyhow::Result<CoordinatorConfig> {
    if a.blend_probe_stride < 1 {
        bail!("--blend-probe-stride: must be >= 1 (got {})", a.blend_probe_stride);
    }
    if a.otlp_endpoint.is_some() {
        bail!("--otlp-endpoint: metrics are served for Prometheus on /metrics only");
    }
    let event_transport = match a.event_transport.as_str() {
        "http" => lmcache_coordinator::transport::EventTransport::Http,
        "jetstream" => lmcache_coordinator::transport::EventTransport::JetStream {
            url: a.nats_url.clone().context("--event-transport jetstream needs --nats-url")?,
            stream: a.nats_stream.clone(),
        },
        other => bail!("--event-transport {other}: only http and jetstream are available"),
    };
    if let Some(extra) = &a.extra_config {
        let v: serde_json::Value =
            serde_json::from_str(extra).context("--extra-config: not JSON")?;
        match v.as_object() {
            Some(o) if o.is_empty() => {}
            Some(o) => bail!(
                "--extra-config: keys {:?} name Python controllers; lmcache-rs loads none",
                o.keys().collect::<Vec<_>>()
            ),
            None => bail!("--extra-config: must be a JSON object"),
        }
    }
    for (name, v) in
        [("eviction-ratio", a.eviction_ratio), ("trigger-watermark", a.trigger_watermark)]
    {
        if !(v.is_finite() && v >= 0.0) {
            bail!("--{name}: {v} must be a finite number >= 0");
        }
    }

    seconds("timeout-keep-alive", a.timeout_keep_alive)?;
    let vllm_kv_events = match (&a.vllm_kv_events_endpoint, &a.vllm_kv_events_replay_endpoint) {
        (Some(endpoint), replay) => Some(lmcache_coordinator::vllm_events::VllmEventsConfig {
            endpoint: endpoint.clone(),
            replay_endpoint: replay.clone(),
            buffer_steps: a.vllm_kv_events_buffer_steps.max(1),
        }),
        (None, Some(_)) => {
            bail!("--vllm-kv-events-replay-endpoint needs --vllm-kv-events-endpoint")
        }
        (None, None) => None,
    };
    Ok(CoordinatorConfig {
        host: a.host.clone(),
        port: a.port,
        instance_timeout: seconds("instance-timeout", a.instance_timeout)?,
        health_check_interval: seconds("health-check-interval", a.health_check_interval)?,
        chunk_size: a.chunk_size,
        hash_algorithm: a.hash_algorithm.clone(),
        max_token_bindings: a.max_token_bindings,
        server_http_auth_token: a.server_http_auth_token.clone(),
        auth_token: a.auth_token.clone(),
        allow_unauthenticated_registration: a.allow_unauthenticated_registration,
        enable_blend_lookup: a.enable_blend_lookup,
        blend_probe_stride: a.blend_probe_stride,
        checkpoint_path: a.checkpoint_path.clone(),
        checkpoint_interval: seconds("checkpoint-interval", a.checkpoint_interval)?,
        metadata_path: a.metadata_path.clone(),
        eviction_check_interval: seconds("eviction-check-interval", a.eviction_check_interval)?,
        eviction_ratio: a.eviction_ratio,
        trigger_watermark: a.trigger_watermark,
        metrics_enabled: !a.disable_metrics,
        event_transport,
        vllm_kv_events,
    })
}

/// Runs the coordinator until SIGINT/SIGTERM.
pub fn run(args: CoordinatorArgs) -> anyhow::Result<()> {
    let signals = crate::server::block_shutdown_signals()?;
    let c = Coordinator::start(config(&args)?).context("starting the coordinator")?;
    tracing::info!(http = %c.addr(), chunk_size = args.chunk_size, "lmcache-rs coordinator serving");
    crate::server::wait_for_shutdown(&signals, args.exit_after_seconds)?;
    c.stop();
    Ok(())
}
