//! Server settings (the CLI fills them from LMCache's flag names).

use std::time::Duration;

use lmcache_l1::L1Config;
use lmcache_memory::ArenaConfig;

/// Everything `lmcache-rs server` is configured with.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Bind host of the request transport (`localhost` binds 127.0.0.1), or a full
    /// `tcp://`/`ipc://` endpoint (ZMQ) or `grpc://host:port` (gRPC).
    pub host: String,
    /// Port of the request transport (ignored for a full endpoint in `host`; 0 picks a free
    /// port).
    pub port: u16,
    /// `--transport`: ZMQ (LMCache's default) or gRPC.
    pub transport: TransportKind,
    /// HTTP bind host.
    pub http_host: String,
    /// HTTP port (0: any free port); `None` disables the HTTP server.
    pub http_port: Option<u16>,
    /// Where the native P2P transfer channel listens (`None`: off; `--p2p-listen-url`, or the
    /// `--p2p-advertise-url`).
    pub p2p_channel: Option<std::net::SocketAddr>,
    /// `--p2p-transfer-engine`: what the channel speaks.
    pub p2p_engine: P2pEngine,
    /// `--p2p-lookup-timeout` (30 s): each RPC to a peer.
    pub p2p_lookup_timeout: std::time::Duration,
    /// `--p2p-load-timeout` (30 s): one fetch over a peer's channel.
    pub p2p_load_timeout: std::time::Duration,
    /// `--p2p-same-host` (on): with the native channel, read a same-host peer's L1 pool
    /// segment directly (`p2p_same_host`) rather than over TCP.
    pub p2p_same_host: bool,
    /// The CacheBlend engine (LMCache's `--engine-type blend`), `None` for prefix caching
    /// only. Not reachable from the command line until its lookup and scatter are served.
    pub blend: Option<crate::blend::BlendOptions>,
    /// When set, every HTTP route but `/healthcheck` requires `Authorization: Bearer <token>`.
    pub http_auth_token: Option<String>,
    /// Tokens per chunk.
    pub chunk_size: usize,
    /// Threads for lookups and management requests.
    pub max_cpu_workers: usize,
    /// Threads for transfers; a client identity always maps to the same one.
    pub max_gpu_workers: usize,
    /// Registrations of ping-proven workers silent this long are dropped (zero disables).
    pub worker_reap_timeout: Duration,
    /// Registrations never proven by a ping are dropped after this long.
    pub worker_registration_grace: Duration,
    /// Sessions are dropped this long after their creation.
    pub session_ttl: Duration,
    /// Block id that marks an unallocated block (all-null chunks are skipped).
    pub null_block_id: u64,
    /// Store each hybrid model's kernel groups as separate object groups, bucketed by
    /// sliding window and recurrent state (LMCache's `--separate-object-groups`); off: one
    /// full-attention object per chunk.
    pub separate_object_groups: bool,
    /// Threads per large lmcache-driven copy (1: the transfer thread copies alone).
    pub copy_threads: usize,
    /// Lookup-hash JSONL logs (`--lookup-hash-log-dir`); `None`: off.
    pub lookup_hash_log: Option<crate::lookup_log::LookupHashLogConfig>,
    /// Requests whose last lookup "why was this a miss?" remembers (`--explain-requests`;
    /// 0: off).
    pub explain_requests: usize,
    /// `--trace-level` / `--trace-output`: record a `.lct` trace (None: off).
    pub trace: Option<crate::trace_record::TraceConfig>,
    /// This server's id (`--instance-id`, or a random one), named in events traces.
    pub instance_id: String,
    /// KV event records kept for `subscribe_kv_events` (0 disables the channel).
    pub kv_event_log_size: usize,
    /// Queued events the event bus holds before it drops (0 disables the bus).
    pub event_bus_queue_size: usize,
    /// The L1 index settings.
    pub l1: L1Config,
    /// The L1 arena.
    pub arena: ArenaConfig,
    /// L1 object alignment.
    pub align: u64,
    /// The L1's tag (LMCache's `--l1-manager` tag).
    pub l1_tag: String,
    /// Further L1s after it, in write order (`--l1-manager` repeated).
    pub more_l1: Vec<lmcache_storage::L1MemberConfig>,
    /// L2 adapters in priority order (LMCache's `--l2-adapter` JSON objects).
    pub l2_adapters: Vec<serde_json::Value>,
    /// Settings of the L2 store and prefetch controllers.
    pub l2: lmcache_storage::TierConfig,
    /// LMCache-driven `cpu_shm` registrations may map only segments whose name starts with
    /// this (after any leading `/`). `None`: any name (still only segments of the server's
    /// uid, and never its own L1 pool).
    pub allowed_shm_prefix: Option<String>,
    /// Registration and cache-event reporting to a fleet coordinator (`--coordinator-url`);
    /// needs the HTTP server.
    pub coordinator: Option<crate::fleet_report::CoordinatorReporting>,
}

impl ServerConfig {
    /// LMCache's defaults over `arena`, bound to loopback on free ports (ZMQ port 0, no HTTP):
    /// what embedding and tests start from, overriding fields as needed.
    pub fn local(arena: ArenaConfig) -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 0,
            transport: TransportKind::Zmq,
            http_host: "127.0.0.1".into(),
            http_port: None,
            p2p_channel: None,
            p2p_engine: P2pEngine::Native,
            p2p_lookup_timeout: std::time::Duration::from_secs(30),
            p2p_load_timeout: std::time::Duration::from_secs(30),
            p2p_same_host: true,
            blend: None,
            http_auth_token: None,
            chunk_size: lmcache_core::DEFAULT_CHUNK_SIZE,
            max_cpu_workers: 1,
            max_gpu_workers: 1,
            worker_reap_timeout: Duration::from_secs(120),
            worker_registration_grace: Duration::from_secs(3600),
            session_ttl: Duration::from_secs(600),
            null_block_id: 0,
            separate_object_groups: false,
            copy_threads: 1,
            lookup_hash_log: None,
            explain_requests: crate::explain::DEFAULT_REQUESTS,
            trace: None,
            instance_id: String::new(),
            kv_event_log_size: 32768,
            event_bus_queue_size: 10_000,
            l1: L1Config::default(),
            l1_tag: lmcache_l1::DEFAULT_TAG.into(),
            more_l1: Vec::new(),
            arena,
            align: lmcache_memory::DEFAULT_ALIGN,
            l2_adapters: Vec::new(),
            l2: lmcache_storage::TierConfig::default(),
            allowed_shm_prefix: None,
            coordinator: None,
        }
    }

    /// What a restart hangs on, and whether this start is warm: the L1 file
    /// (`--l1-devdax-path`, or `--shm-name` with `--l1-warm-restart`), or for a slab-file L1
    /// (`--gds-l1-path`) its lock file. The workers' registrations are kept beside it, a
    /// `--take-over` stops the process that holds its lock, and the port handover is named
    /// after it. `None`: an L1 in memory only, which nothing outlives.
    pub fn restart_anchor(&self) -> Option<(std::path::PathBuf, bool)> {
        if let lmcache_memory::ArenaBacking::File(f) = &self.arena.backing {
            return Some((f.path.clone(), f.adopt));
        }
        self.l2_adapters.iter().find_map(|spec| {
            (spec.get("type")?.as_str()? == "gds_slab").then_some(())?;
            let dir = std::path::Path::new(spec.get("path")?.as_str()?);
            let warm = spec.get("warm_restart").and_then(serde_json::Value::as_bool) == Some(true);
            Some((lmcache_l2::adapters::slab::lock_path(dir), warm))
        })
    }

    /// What the server's storage is built from.
    pub fn storage_config(&self) -> lmcache_storage::StorageConfig {
        lmcache_storage::StorageConfig {
            arena: self.arena.clone(),
            align: self.align,
            l1: self.l1.clone(),
            l1_tag: self.l1_tag.clone(),
            more_l1: self.more_l1.clone(),
            l2_adapters: self.l2_adapters.clone(),
            l2: self.l2.clone(),
        }
    }

    /// The ZMQ endpoint to bind.
    pub fn endpoint(&self) -> String {
        if self.host.contains("://") {
            return self.host.clone();
        }
        let host = if self.host == "localhost" { "127.0.0.1" } else { self.host.as_str() };
        if self.port == 0 {
            format!("tcp://{host}:*")
        } else {
            format!("tcp://{host}:{}", self.port)
        }
    }
}

/// `--transport`: how clients reach the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportKind {
    /// LMCache's ZMQ ROUTER socket (`tcp://host:port`), the default and vLLM's.
    #[default]
    Zmq,
    /// LMCache's gRPC services (`grpc://host:port`).
    Grpc {
        /// `--grpc-server-workers`: threads of the runtime holding the connections.
        server_workers: usize,
    },
}

/// `--p2p-transfer-engine`: the P2P transfer channel.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum P2pEngine {
    /// lmcache-rs's own channel (TCP, every object checksummed), between lmcache-rs servers.
    #[default]
    Native,
    /// NIXL, LMCache's default: with LMCache's servers (and ours in NIXL mode), through the
    /// nixl wheel's `libnixl_capi.so` at this path.
    Nixl {
        /// The library.
        library: std::path::PathBuf,
    },
}
