//! `lmcache-rs server`: LMCache's MP cache server flags, embedded defaults for everything.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use lmcache_core::units::gib_to_bytes;
use lmcache_l1::{EvictionPolicyKind, L1Config};
use lmcache_memory::shm::default_shm_name;
use lmcache_memory::{ArenaBacking, ArenaConfig};
use lmcache_server::config::TransportKind;
use lmcache_server::{Server, ServerConfig};
use nix::sys::signal::{SigSet, Signal};

/// Flags of `lmcache-rs server`, named and defaulted as `lmcache server`'s.
#[derive(Debug, Clone, Args)]
pub struct ServerArgs {
    /// Read flags from a TOML file (keys are flag names, `[[l2_adapter]]` tables are
    /// adapters); flags on the command line win.
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// Host engines connect to (or, with --transport zmq, a full tcp:// or ipc:// URL).
    #[arg(long, default_value = "localhost")]
    pub host: String,
    /// Port engines connect to.
    #[arg(long, default_value_t = 5555)]
    pub port: u16,
    /// How engines reach the server, as LMCache's: `zmq` (clients use tcp://HOST:PORT, what
    /// vLLM does by default) or `grpc` (LMCache's gRPC services; clients use
    /// grpc://HOST:PORT).
    #[arg(long, default_value = "zmq", value_parser = ["zmq", "grpc"])]
    pub transport: String,
    /// --transport grpc: threads of the runtime that holds the gRPC connections (lookups
    /// and transfers still run on --max-cpu-workers and --max-gpu-workers).
    #[arg(long, default_value_t = lmcache_server::transport::grpc::DEFAULT_SERVER_WORKERS)]
    pub grpc_server_workers: usize,
    /// Host of the HTTP API.
    #[arg(long, default_value = "127.0.0.1")]
    pub http_host: String,
    /// Port of the HTTP API.
    #[arg(long, default_value_t = 8080)]
    pub http_port: u16,
    /// Require `Authorization: Bearer <token>` on every HTTP route but /healthcheck.
    #[arg(long, env = "LMCACHE_RS_HTTP_TOKEN", hide_env_values = true)]
    pub http_auth_token: Option<String>,
    /// Tokens per chunk.
    #[arg(long, default_value_t = lmcache_core::DEFAULT_CHUNK_SIZE)]
    pub chunk_size: usize,
    /// Worker threads per pool (lookups, transfers) unless set separately.
    #[arg(long, default_value_t = 1)]
    pub max_workers: usize,
    /// Threads for lookups and management requests (default: --max-workers).
    #[arg(long)]
    pub max_cpu_workers: Option<usize>,
    /// Threads for transfers (default: --max-workers).
    #[arg(long)]
    pub max_gpu_workers: Option<usize>,
    /// Accepted for compatibility: both transfer families are always served (but
    /// `--engine-type blend` needs lmcache_driven or auto, as LMCache's).
    #[arg(long, default_value = "lmcache_driven", value_parser = ["lmcache_driven", "engine_driven", "auto"])]
    pub supported_transfer_mode: String,
    /// Cache engine: `default` is prefix caching; `blend` adds CacheBlend, which finds stored
    /// chunks anywhere in a prompt and scatters their KV into the engine's blocks at the new
    /// positions, K re-rotated (the cb_* operations; lmcache-driven cpu_shm KV).
    #[arg(long, default_value = "default", value_parser = ["default", "blend"])]
    pub engine_type: String,
    /// --engine-type blend only: chunks of the prompt past a gap in its prefix hit (a chunk
    /// L1 and L2 lack) are still served, at their own positions, when L1 holds them, instead
    /// of the hit ending at the gap.
    #[arg(long)]
    pub enable_segmented_prefix: bool,
    /// --engine-type blend only: a chunk whose tokens are fingerprinted already (the same
    /// text stored behind another prefix) is not fingerprinted again; the first store wins.
    #[arg(long)]
    pub enable_dedup_content: bool,
    /// --engine-type blend only: answer cb_reorder_plan, which orders a prompt so it starts
    /// with an exact copy of a stored prompt's beginning.
    #[arg(long)]
    pub enable_blend_reorder: bool,
    /// Drop registrations of ping-proven workers silent this long (0 disables; else >= 30).
    #[arg(long, default_value_t = 120)]
    pub worker_reap_timeout_seconds: u64,
    /// Drop registrations never proven by a ping after this long.
    #[arg(long, default_value_t = 3600)]
    pub worker_registration_grace_seconds: u64,
    /// Drop request sessions this long after their creation.
    #[arg(long, default_value_t = 600)]
    pub session_ttl_seconds: u64,
    /// Block id marking unallocated blocks (chunks of only null blocks are not stored).
    #[arg(long, default_value_t = 0)]
    pub null_block_id: u64,
    /// Directory for lookup-hash JSONL logs (one line per lookup, LMCache's format, read by
    /// `lmcache tool cache-simulator`). Unset: off.
    #[arg(long, value_name = "DIR")]
    pub lookup_hash_log_dir: Option<std::path::PathBuf>,
    /// Seconds before the lookup-hash log rotates to a new file.
    #[arg(long, default_value_t = 6 * 3600)]
    pub lookup_hash_log_rotation_interval: u64,
    /// Bytes at which the lookup-hash log rotates even before the interval.
    #[arg(long, default_value_t = 100 * 1024 * 1024)]
    pub lookup_hash_log_rotation_max_size: u64,
    /// Lookup-hash log files kept; the oldest of them are deleted past it.
    #[arg(long, default_value_t = 100)]
    pub lookup_hash_log_max_files: usize,
    /// Recent requests whose last lookup the server can explain chunk by chunk ("why was this
    /// a miss?": `lmcache-rs explain REQUEST_ID`, `GET /cache/requests/{id}/explain`). 0: off.
    #[arg(long, value_name = "N", default_value_t = lmcache_server::explain::DEFAULT_REQUESTS)]
    pub explain_requests: usize,
    /// Store a hybrid model's KV groups as separate objects, one per sliding-window size and
    /// for recurrent state, so a hit needs only each group's window (LMCache's flag). Off: one
    /// object per chunk holding every group, served as full attention.
    #[arg(long)]
    pub separate_object_groups: bool,
    /// Threads per large server-side copy (lmcache-driven). On 2 cores, 1 measured fastest.
    #[arg(long, default_value_t = 1)]
    pub copy_threads: usize,
    /// Queued events the event bus holds before it drops (and counts) new ones.
    #[arg(long, default_value_t = 10_000)]
    pub event_bus_queue_size: usize,
    /// Turn off the event bus and the KV event stream.
    #[arg(long)]
    pub disable_observability: bool,
    /// KV event records kept for engines' `subscribe_kv_events` (0 disables the stream).
    #[arg(long, default_value_t = 32768)]
    pub kv_event_log_size: usize,
    /// Token hash: only blake3 (LMCache's default) is reproducible outside Python.
    #[arg(long, default_value = "blake3", value_parser = ["blake3"])]
    pub hash_algorithm: String,
    /// L1 (CPU memory) size in GiB. Memory is committed as it is used.
    #[arg(long, default_value_t = 8.0)]
    pub l1_size_gb: f64,
    /// Alignment of every L1 object in bytes (a power of two).
    #[arg(long, default_value_t = lmcache_memory::DEFAULT_ALIGN)]
    pub l1_align_bytes: u64,
    /// Back L1 with 2 MiB huge pages (private: engine-driven clients then cannot map it).
    #[arg(long)]
    pub l1_use_hugepages: bool,
    /// Lock L1 in RAM (mlock). Commits the whole L1 at start.
    #[arg(long)]
    pub l1_mlock: bool,
    /// Name of the L1 shared-memory segment (default: lmcache_l1_pool_<pid>).
    #[arg(long, default_value = "")]
    pub shm_name: String,
    /// Put L1 in this /dev/dax device or mmap-able file (pmem, a DAX file system, tmpfs, or
    /// any file) instead of shared memory; a missing file is created at --l1-size-gb. Only
    /// lmcache-driven clients can use it (engine-driven ones map shared memory). A device or
    /// file that holds anything but an lmcache-rs L1 is refused unless --l1-devdax-format.
    /// On a /dev/dax device --l1-size-gb must be a whole number of the device's alignment
    /// (2 MiB unless set otherwise with daxctl) and fit its size.
    #[arg(long, value_name = "PATH")]
    pub l1_devdax_path: Option<std::path::PathBuf>,
    /// Format the --l1-devdax-path device or file even if it holds something else (lost).
    #[arg(long)]
    pub l1_devdax_format: bool,
    /// LMCache's GDS L1: L1's objects live in one preallocated slab file,
    /// DIR/lmcache-rs-gds-l1.slab, of --l1-size-gb. Without a GPU, objects are stored into a
    /// DRAM staging area (--gds-l1-staging-gb), written through to the slab, and read back
    /// from it into staging when a lookup finds them only there. Every slot is checksummed:
    /// a torn or foreign one is a miss. The slab starts empty, as LMCache's does, unless
    /// --l1-warm-restart, which serves what the previous process wrote to it (and keeps the
    /// workers' registrations in DIR/lmcache-rs-gds-l1.lock.lmcache-rs-workers). A stop
    /// writes what staging holds to the slab first, for up to 60 s or
    /// --l2-flush-timeout-seconds, whichever is longer. One server per DIR: it holds
    /// DIR/lmcache-rs-gds-l1.lock, and a second one is refused with its pid. Excludes
    /// --l1-devdax-path and L2 adapters (the slab takes their place, as in LMCache).
    #[arg(long, value_name = "DIR")]
    pub gds_l1_path: Option<std::path::PathBuf>,
    /// Open the slab with O_DIRECT (the default, as in LMCache): no page-cache copy.
    #[arg(long, overrides_with = "no_gds_l1_use_direct_io")]
    pub gds_l1_use_direct_io: bool,
    /// Open the slab with buffered (POSIX) I/O instead of O_DIRECT.
    #[arg(long, overrides_with = "gds_l1_use_direct_io")]
    pub no_gds_l1_use_direct_io: bool,
    /// How the slab is reached: auto or posix (file I/O from CPU memory). LMCache's GPU
    /// backends (cufile, hipfile, ugds, phx) need a GPU and are refused.
    #[arg(long, default_value = "auto", value_name = "BACKEND")]
    pub gds_l1_backend: String,
    /// DRAM staging area of the slab L1, in GiB (lmcache-rs's own flag): what is stored,
    /// retrieved or read back from the slab passes through it, and recently used objects stay
    /// in it. Capped at --l1-size-gb.
    #[arg(long, default_value_t = 2.0, value_name = "GB")]
    pub gds_l1_staging_gb: f64,
    /// Bytes per slab slot, in MiB (lmcache-rs's own flag; 0: the size of the first chunk
    /// stored, which suits one model). Give the largest chunk the server will store when
    /// models of several sizes share it: a larger object stays in DRAM staging only. A slab
    /// kept by --l1-warm-restart keeps the slot size it was formatted with.
    #[arg(long, default_value_t = 0, value_name = "MB")]
    pub gds_l1_slot_mb: u64,
    /// Restart warm from the --l1-devdax-path file, or, without it, from the shared-memory
    /// segment --shm-name NAME (kept in /dev/shm across restarts, holding its memory until
    /// removed; engine-driven clients map it as any shared-memory pool): serve what the
    /// previous server held. Each
    /// stored chunk is checksummed in the background and recorded in the file; at start the
    /// new server adopts every recorded chunk whose bytes still match their checksum. What
    /// survives: chunks stored and recorded before a SIGTERM (the stop waits for the
    /// records) or before a SIGKILL or crash (a chunk stored in the last moments may not be
    /// recorded yet: it is dropped, never served half-written). What does not: chunks still
    /// being written, read locks, sessions, quotas set over HTTP, and the file itself across
    /// a reboot unless it is on persistent media (a DAX device, pmem or a disk; tmpfs is RAM).
    /// Adopted chunks go through the L2 write-behind again: what the previous server had not
    /// yet written to an adapter is written (what it holds is skipped). Worker registrations
    /// survive too (kept in FILE.lmcache-rs-workers beside the L1 file): engines go on
    /// storing and retrieving without registering again, unless what they registered is gone
    /// (a client's segment, or an engine-driven pool of another size); those are told by
    /// their next ping and register again. The tokens behind the chunks survive as well
    /// (FILE.lmcache-rs-tokens): the KV events and the coordinator hear the adopted chunks
    /// with their tokens. The same --l1-size-gb is required; without this flag the file is
    /// reset at start, and the registrations and tokens are forgotten.
    #[arg(long)]
    pub l1_warm_restart: bool,
    /// Hot upgrade: start in place of the lmcache-rs server that holds --l1-devdax-path,
    /// --shm-name or --gds-l1-path (run this binary, the new version, with the same flags).
    /// It first receives the old server's listening sockets (the --port and --http-port it
    /// serves), then sends it SIGTERM: the old one answers what is in flight, records its last chunks and lets the
    /// file go; this one adopts its L1 and its workers' registrations and serves on the same
    /// sockets, so a connection made meanwhile waits instead of being refused. Engines see
    /// one pause and go on without registering again. Needs --l1-warm-restart (with
    /// --l1-devdax-path, --shm-name or --gds-l1-path; a slab server first writes what its
    /// DRAM staging holds to the slab).
    #[arg(long)]
    pub take_over: bool,
    /// How long --take-over waits for the old server to let its L1 file go.
    #[arg(long, default_value_t = 60.0)]
    pub take_over_timeout_seconds: f64,
    /// An L1 as LMCache's tagged JSON, e.g. '{"type": "DEVDAX", "tag": "dax0", "size_gb": 8,
    /// "path": "/dev/dax0.0"}' or '{"type": "DRAM", "tag": "_default", "size_gb": 8}'. Its
    /// fields replace the matching --l1-* flags (size_gb, align_bytes, read/write_ttl_seconds,
    /// eviction, shm_name, use_hugepages, path; a GDS entry's path, backend and direct_io
    /// stand for the --gds-l1-* flags). Repeat it for several L1s in write order: a store
    /// goes to the first that fits it without evicting (LMCache's ordered overflow), then to
    /// the first that fits it by evicting; reads find a key in whichever holds it. What an
    /// L1's watermark evicts moves down to the next one (only the last discards). The first
    /// entry is the pool engines map (engine-driven transfer, --shm-name) and the one peers
    /// read; the others are private memory (DRAM; a segment of its own where it names a
    /// shm_name, unique as in LMCache) or a file (DEVDAX). With --l1-warm-restart every file
    /// restarts warm (a named DRAM L1 is then a file in /dev/shm) when the first is a file
    /// too: DEVDAX, or DRAM with a stable shm_name. A GDS entry goes last (or alone): its
    /// slab holds, written through, what the L1s before it store, and they stand in for its
    /// DRAM staging area (--gds-l1-staging-gb is then unused); with --l1-warm-restart the
    /// slab restarts warm, and so does a DRAM L1 in front of it that has a stable shm_name.
    /// LMCache fills a GDS L1 only with what the L1s before it cannot take; ours keeps every
    /// stored chunk in the slab.
    #[arg(long = "l1-manager", value_name = "JSON")]
    pub l1_manager: Vec<String>,
    /// Accepted for LMCache compatibility: L1 memory is always committed as it is used.
    #[arg(long, overrides_with = "no_l1_use_lazy")]
    pub l1_use_lazy: bool,
    /// Accepted for LMCache compatibility (LMCache needs it with --l1-devdax-path).
    #[arg(long, overrides_with = "l1_use_lazy")]
    pub no_l1_use_lazy: bool,
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
    /// An L2 adapter as LMCache's JSON, e.g. '{"type": "fs", "base_path": "/var/cache/kv"}'.
    /// Repeatable; the order is the priority. Types: fs, raw_block, redis (resp, valkey), s3,
    /// dax (slots in a mapped /dev/dax device or file, a volatile index, as LMCache's),
    /// native_plugin (a shared library of yours through lmcache_rs_l2_plugin.h: "path",
    /// "config"), mock, fault_inject; `"serde": {"type": "lz4"|"zstd"|"aesgcm"|"fp8"}` adds a
    /// codec.
    #[arg(long = "l2-adapter", value_name = "JSON")]
    pub l2_adapter: Vec<String>,
    /// A TOML file of `[[l2_adapter]]` tables (same fields as --l2-adapter), added after them.
    #[arg(long, value_name = "FILE")]
    pub l2_config: Option<std::path::PathBuf>,
    /// After an L2 write: `default` keeps the object in L1; `skip_l1` deletes it from L1
    /// (L1 as a write buffer).
    #[arg(long, default_value = "default", value_parser = ["default", "skip_l1"])]
    pub l2_store_policy: String,
    /// Prefetch plan: `default` and `retain` both serve the longest prefix from L1 then L2
    /// (first adapter holding a chunk wins) and keep loaded objects in L1 under its eviction.
    #[arg(long, default_value = "default", value_parser = ["default", "retain"])]
    pub l2_prefetch_policy: String,
    /// L2 prefetch requests in flight at once.
    #[arg(long, default_value_t = 8)]
    pub l2_prefetch_max_in_flight: usize,
    /// A prefetch serves what it loaded by then and stops after this many seconds.
    #[arg(long, default_value_t = 5.0)]
    pub l2_prefetch_timeout_seconds: f64,
    /// Objects the L2 write-behind queue holds; beyond it stores are dropped (and counted).
    #[arg(long, default_value_t = 16384)]
    pub l2_store_queue_size: usize,
    /// When L1 can only make room for a store by evicting objects L2 has not written yet, the
    /// store waits up to this many seconds for the write-behind, then evicts them (counted as
    /// lmcache_rs_l1_unwritten_evictions_total). Under --gds-l1-path the staging area waits
    /// at least 60 s for the slab: the slab is L1's medium, not a copy of it.
    #[arg(long, default_value_t = 2.0)]
    pub l2_store_wait_seconds: f64,
    /// fs and raw_block L2 adapters, at start and when added over HTTP, must have their
    /// base_path or device_path inside this directory (repeatable). Unset: any path.
    #[arg(long = "l2-allowed-root", value_name = "DIR")]
    pub l2_allowed_root: Vec<std::path::PathBuf>,
    /// LMCache-driven cpu_shm registrations may map only shared-memory segments whose name
    /// starts with this (e.g. lmcache_kv_). Unset: any segment owned by the server's uid
    /// (never the server's own L1 pool).
    #[arg(long, value_name = "PREFIX")]
    pub allowed_shm_prefix: Option<String>,
    /// On SIGTERM/SIGINT, wait up to this many seconds for queued L2 write-behind to finish.
    #[arg(long, default_value_t = 10.0)]
    pub l2_flush_timeout_seconds: f64,
    /// Export tracing spans (one per MP request, L2 prefetches and store batches) over OTLP/HTTP
    /// (protobuf) to this collector, e.g. http://127.0.0.1:4318 (`/v1/traces` is appended).
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// Accepted for LMCache compatibility: tracing is on when --otlp-endpoint is given.
    #[arg(long)]
    pub enable_tracing: bool,
    /// This server's id in a coordinator's fleet (default: a random id).
    #[arg(long, default_value = "")]
    pub instance_id: String,
    /// Register with this fleet coordinator (LMCache's `lmcache coordinator` or
    /// `lmcache-rs coordinator`), e.g. http://10.0.0.5:9300; needs the HTTP server.
    #[arg(long, env = "LMCACHE_COORDINATOR_URL", value_name = "URL")]
    pub coordinator_url: Option<String>,
    /// Address the coordinator should call this server at (default: the local address that
    /// reaches the coordinator).
    #[arg(long, env = "LMCACHE_COORDINATOR_ADVERTISE_IP", default_value = "")]
    pub coordinator_advertise_ip: String,
    /// The coordinator's own bearer token (its --auth-token), sent on registration,
    /// heartbeats and event reports. A coordinator sends this fleet's HTTP token only to
    /// servers that registered with it.
    #[arg(
        long,
        env = "LMCACHE_RS_COORDINATOR_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub coordinator_auth_token: Option<String>,
    /// Seconds between heartbeats to the coordinator.
    #[arg(long, env = "LMCACHE_COORDINATOR_HEARTBEAT_INTERVAL", default_value_t = 5.0)]
    pub coordinator_heartbeat_interval: f64,
    /// Report L1 and L2 cache events (stores, evictions, deletes) to the coordinator.
    #[arg(long, env = "LMCACHE_COORDINATOR_EVENT_REPORTING", value_parser = clap::builder::FalseyValueParser::new(), num_args = 0..=1, default_missing_value = "true")]
    pub coordinator_event_reporting: bool,
    /// Seconds between cache-event flushes to the coordinator.
    #[arg(long, env = "LMCACHE_COORDINATOR_EVENT_FLUSH_INTERVAL", default_value_t = 1.0)]
    pub coordinator_event_flush_interval: f64,
    /// --engine-type blend with a coordinator: seconds a fleet CacheBlend lookup to the
    /// coordinator (/directory/blend-lookup) may take, as its HTTP timeout and the lookup's
    /// deadline; past it the lookup goes on with this server's own matches.
    #[arg(long, default_value_t = 1.0)]
    pub coordinator_blend_timeout: f64,
    /// --engine-type blend with a coordinator: fleet CacheBlend lookups in flight at most.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub coordinator_blend_match_concurrency: u32,
    /// How cache events travel: http (POST /events) or jetstream (NATS JetStream, with
    /// --coordinator-nats-url). LMCache's kafka is not available.
    #[arg(long, default_value = "http", value_parser = ["http", "jetstream", "kafka"])]
    pub coordinator_event_transport: String,
    /// NATS server for --coordinator-event-transport jetstream.
    #[arg(long, env = "LMCACHE_COORDINATOR_NATS_URL", value_name = "URL")]
    pub coordinator_nats_url: Option<String>,
    /// JetStream stream the events go to (created when missing).
    #[arg(long, default_value = "LMCACHE_CACHE_EVENTS")]
    pub coordinator_nats_stream: String,
    /// Turns on P2P: this server registers HOST:PORT with the coordinator as its transfer
    /// channel, serves its L1 to the fleet's lmcache-rs peers there (p2p_lookup_and_lock and
    /// friends on the MP port, the bytes on the channel), lists the peers it discovers in
    /// /status, and fetches what its L1 and L2 lack from them.
    /// Needs --coordinator-url.
    #[arg(long, env = "LMCACHE_P2P_ADVERTISE_URL", value_name = "HOST:PORT")]
    pub p2p_advertise_url: Option<String>,
    /// Seconds before a peer's lookup answer counts as a miss.
    #[arg(long, default_value_t = 30.0)]
    pub p2p_lookup_timeout: f64,
    /// Seconds before a fetch from a peer counts as a failure (a miss).
    #[arg(long, default_value_t = 30.0)]
    pub p2p_load_timeout: f64,
    /// With the native channel: read a peer on this host straight out of its L1 pool segment
    /// (one copy, no socket) rather than over TCP. `--p2p-same-host false` turns it off.
    #[arg(long, value_parser = clap::builder::FalseyValueParser::new(), num_args = 0..=1, default_missing_value = "true", default_value = "true", value_name = "BOOL")]
    pub p2p_same_host: bool,
    /// Where the transfer channel listens (default: the advertise URL).
    #[arg(long, value_name = "HOST:PORT", requires = "p2p_advertise_url")]
    pub p2p_listen_url: Option<String>,
    /// The transfer channel. native: lmcache-rs's own (TCP, every object checksummed),
    /// between lmcache-rs servers. nixl: LMCache's default, for a fleet with LMCache's
    /// servers (they read our L1 and we read theirs); it loads the nixl-cu12 wheel's
    /// libnixl_capi.so (pip install nixl-cu12==1.5.1), found in python3's site-packages or
    /// named by --nixl-library. mooncake_te is refused: not built.
    #[arg(long, default_value = "native", value_parser = ["native", "nixl", "mooncake_te"])]
    pub p2p_transfer_engine: String,
    /// With --p2p-transfer-engine nixl: the NIXL C API library (libnixl_capi.so, or the folder
    /// holding it). Default: the nixl, nixl_cu12 or nixl_cu13 wheel in python3's
    /// site-packages.
    #[arg(long, env = "LMCACHE_RS_NIXL_LIBRARY", value_name = "PATH")]
    pub nixl_library: Option<std::path::PathBuf>,
    /// Record a trace for `lmcache-rs trace` (and LMCache's `lmcache trace`): `storage`
    /// records the storage calls requests make (replayed by `trace replay`), `events` the
    /// cache-event stream a coordinator would receive (replayed by `trace replay-events`;
    /// recorded with or without --coordinator-url).
    #[arg(long, value_parser = ["storage", "events"])]
    pub trace_level: Option<String>,
    /// The trace file (default: $TMPDIR/lmcache-trace-<pid>-<UTC time>.lct).
    #[arg(long, value_name = "FILE", requires = "trace_level")]
    pub trace_output: Option<std::path::PathBuf>,
    /// Exit after this many seconds (for tests and benchmarks); 0 runs until a signal.
    #[arg(long, default_value_t = 0, hide = true)]
    pub exit_after_seconds: u64,
}

/// A positive number of seconds.
fn positive_secs(name: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("--{name}: {v} is not a positive number of seconds"))
}

/// `--p2p-advertise-url` / `--p2p-listen-url`: where the transfer channel listens.
fn p2p_channel(args: &ServerArgs) -> anyhow::Result<Option<std::net::SocketAddr>> {
    let Some(advertise) = &args.p2p_advertise_url else { return Ok(None) };
    if args.coordinator_url.as_deref().is_none_or(str::is_empty) {
        bail!(
            "--p2p-advertise-url: P2P requires a coordinator (peers are found through it): set --coordinator-url"
        );
    }
    if args.p2p_transfer_engine == "mooncake_te" {
        bail!(
            "--p2p-transfer-engine mooncake_te: not built; use nixl (LMCache's default, with \
             LMCache's servers) or native (between lmcache-rs servers)"
        );
    }
    let listen = args.p2p_listen_url.as_deref().unwrap_or(advertise);
    let bare = listen.strip_prefix("tcp://").unwrap_or(listen);
    use std::net::ToSocketAddrs as _;
    let addr = bare
        .to_socket_addrs()
        .with_context(|| format!("--p2p-listen-url {listen}: not a HOST:PORT"))?
        .next()
        .with_context(|| format!("--p2p-listen-url {listen}: resolves to no address"))?;
    Ok(Some(addr))
}

/// `--p2p-transfer-engine` (and, for nixl, where its library is).
fn p2p_engine(args: &ServerArgs) -> anyhow::Result<lmcache_server::config::P2pEngine> {
    use lmcache_server::config::P2pEngine;
    if args.p2p_advertise_url.is_none() || args.p2p_transfer_engine != "nixl" {
        return Ok(P2pEngine::Native);
    }
    let library = lmcache_nixl::locate(args.nixl_library.as_deref(), "python3")
        .context("--p2p-transfer-engine nixl")?;
    Ok(P2pEngine::Nixl { library })
}

/// `--engine-type` and the blend flags.
fn blend(args: &ServerArgs) -> anyhow::Result<Option<lmcache_server::blend::BlendOptions>> {
    if args.engine_type != "blend" {
        return Ok(None);
    }
    if args.supported_transfer_mode == "engine_driven" {
        bail!(
            "--engine-type blend scatters into lmcache-driven (cpu_shm) KV registrations: use \
             --supported-transfer-mode lmcache_driven or auto"
        );
    }
    Ok(Some(lmcache_server::blend::BlendOptions {
        segmented_prefix: args.enable_segmented_prefix,
        dedup_content: args.enable_dedup_content,
        reorder: args.enable_blend_reorder,
        coordinator_timeout: positive_secs(
            "coordinator-blend-timeout",
            args.coordinator_blend_timeout,
        )?,
        coordinator_match_concurrency: args.coordinator_blend_match_concurrency as usize,
    }))
}

fn coordinator_reporting(
    args: &ServerArgs,
) -> anyhow::Result<Option<lmcache_server::fleet_report::CoordinatorReporting>> {
    let Some(url) = args.coordinator_url.clone().filter(|u| !u.is_empty()) else {
        return Ok(None);
    };
    let transport = match args.coordinator_event_transport.as_str() {
        "http" => lmcache_server::fleet_report::ReportTransport::Http,
        "jetstream" => lmcache_server::fleet_report::ReportTransport::JetStream {
            url: args
                .coordinator_nats_url
                .clone()
                .context("--coordinator-event-transport jetstream needs --coordinator-nats-url")?,
            stream: args.coordinator_nats_stream.clone(),
        },
        other => {
            bail!("--coordinator-event-transport {other}: only http and jetstream are available")
        }
    };
    let secs = |name: &str, v: f64| {
        Duration::try_from_secs_f64(v)
            .ok()
            .filter(|d| !d.is_zero())
            .with_context(|| format!("--{name}: {v} is not a positive number of seconds"))
    };
    let instance_id = instance_id(args);
    Ok(Some(lmcache_server::fleet_report::CoordinatorReporting {
        url,
        instance_id,
        advertise_ip: args.coordinator_advertise_ip.clone(),
        heartbeat_interval: secs(
            "coordinator-heartbeat-interval",
            args.coordinator_heartbeat_interval,
        )?,
        event_reporting: args.coordinator_event_reporting,
        flush_interval: secs(
            "coordinator-event-flush-interval",
            args.coordinator_event_flush_interval,
        )?,
        transport,
        auth_token: args.coordinator_auth_token.clone(),
        p2p_advertised_url: args.p2p_advertise_url.clone(),
    }))
}

/// `--instance-id`, or a random one minted once per process (the coordinator registration
/// and an events trace name the same server).
fn instance_id(args: &ServerArgs) -> String {
    static MINTED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if args.instance_id.is_empty() {
        MINTED.get_or_init(default_instance_id).clone()
    } else {
        args.instance_id.clone()
    }
}

/// A random id (LMCache mints a UUID v4): 32 hex digits of BLAKE3 over the time, the pid and
/// the kernel's random UUID.
fn default_instance_id() -> String {
    let mut h = blake3::Hasher::new();
    h.update(
        &std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos()
            .to_le_bytes(),
    );
    h.update(&std::process::id().to_le_bytes());
    h.update(&std::fs::read("/proc/sys/kernel/random/uuid").unwrap_or_default());
    h.finalize().to_hex()[..32].to_string()
}

/// LMCache `server` flags that lmcache-rs does not implement yet: refused by name.
pub const UNSUPPORTED_LMCACHE_FLAGS: &[&str] = &[
    "--isolated-ipc",
    "--runtime-plugin-locations",
    "--server-module",
    "--enable",
    "--coordinator-kafka-bootstrap-servers",
    "--coordinator-kafka-topic",
    "--coordinator-kafka-delivery-timeout",
    "--run-script-api-enabled",
];

/// Refuses a known-but-unsupported LMCache flag with a message naming it.
pub fn refuse_unsupported(args: &[String]) -> anyhow::Result<()> {
    for a in args {
        let flag = a.split('=').next().unwrap_or(a);
        if UNSUPPORTED_LMCACHE_FLAGS.contains(&flag) {
            bail!("{flag} is an LMCache server flag that lmcache-rs does not support yet");
        }
    }
    Ok(())
}

fn parse_policy(s: &str) -> Result<EvictionPolicyKind, String> {
    s.parse().map_err(|e: lmcache_l1::eviction::UnknownPolicy| e.to_string())
}

/// Least time a slab L1's staging area waits for the slab before evicting an object the
/// slab does not hold yet.
const GDS_STAGING_WAIT_SECONDS: f64 = 60.0;

/// A GDS L1 on CPU: the slab (an L2 adapter spec of type `gds_slab`, the only tier) and the
/// DRAM staging area that L1's arena becomes.
#[derive(Debug)]
struct GdsL1 {
    slab: serde_json::Value,
    staging_bytes: u64,
}

/// `--gds-l1-path` and its flags, checked; `None` without it. `slab_bytes` is --l1-size-gb.
fn gds_l1(args: &ServerArgs, slab_bytes: u64) -> anyhow::Result<Option<GdsL1>> {
    let Some(dir) = &args.gds_l1_path else { return Ok(None) };
    if args.l1_devdax_path.is_some() {
        bail!("--gds-l1-path cannot be used with --l1-devdax-path");
    }
    if args.l1_devdax_format {
        bail!("--l1-devdax-format applies to --l1-devdax-path, not to --gds-l1-path");
    }
    let staging = positive_size(args.gds_l1_staging_gb, "--gds-l1-staging-gb")?;
    Ok(Some(GdsL1 {
        slab: gds_slab(args, dir, slab_bytes)?,
        staging_bytes: staging.min(slab_bytes),
    }))
}

/// The slab (a `gds_slab` L2 spec) of `slab_bytes` in `dir` that a GDS L1 stands for, from
/// the --gds-l1-* flags in `args`, checked.
fn gds_slab(
    args: &ServerArgs,
    dir: &std::path::Path,
    slab_bytes: u64,
) -> anyhow::Result<serde_json::Value> {
    match args.gds_l1_backend.as_str() {
        "auto" | "posix" => {}
        b @ ("cufile" | "hipfile" | "ugds" | "phx") => bail!(
            "--gds-l1-backend {b} moves KV between a GPU and the slab by DMA; lmcache-rs has \
             no GPU path: use auto or posix (file I/O from DRAM staging)"
        ),
        other => bail!("--gds-l1-backend {other:?}: expected auto or posix"),
    }
    if !args.l2_adapter.is_empty() || args.l2_config.is_some() {
        bail!(
            "--gds-l1-path and --l2-adapter/--l2-config exclude each other: the slab takes the \
             L2 tier's place (LMCache also asks for L2 adapters to be off under GDS L1)"
        );
    }
    Ok(serde_json::json!({
        "type": "gds_slab",
        "path": dir,
        "capacity_bytes": slab_bytes,
        "use_odirect": !args.no_gds_l1_use_direct_io,
        "warm_restart": args.l1_warm_restart,
        "slot_bytes": args.gds_l1_slot_mb.saturating_mul(1 << 20),
    }))
}

/// What the `--l1-manager` entries (LMCache's tagged L1 JSON) describe.
struct L1List {
    /// The first entry as the flags it stands for (the L1 every other flag speaks of).
    first: ServerArgs,
    /// The first entry's tag.
    tag: String,
    /// The further L1s in write order, which a store that does not fit the ones before goes to.
    more: Vec<lmcache_storage::L1MemberConfig>,
    /// A GDS entry last in a list of several: its flags. Its slab sits behind the L1s before
    /// it, which stand in for its DRAM staging area.
    slab_behind: Option<ServerArgs>,
}

/// The L1s the `--l1-manager` entries describe, checked.
fn apply_l1_managers(args: &ServerArgs) -> anyhow::Result<L1List> {
    let Some((first, rest)) = args.l1_manager.split_first() else {
        bail!("--l1-manager: no entry");
    };
    let L1Entry { args: first_args, tag: first_tag, kind: first_kind, .. } =
        apply_l1_manager(args, first).with_context(|| format!("--l1-manager #0 ({first})"))?;
    let mut tags = vec![first_tag.clone()];
    // Segment names in use: each DRAM L1 that names one has its own (as LMCache asks).
    let mut shm_names: Vec<String> =
        Some(first_args.shm_name.clone()).filter(|n| !n.is_empty()).into_iter().collect();
    let mut paths: Vec<std::path::PathBuf> = first_args.l1_devdax_path.iter().cloned().collect();
    let mut more = Vec::with_capacity(rest.len());
    let mut slab_behind = None;
    if first_kind == "GDS" && !rest.is_empty() {
        bail!(
            "--l1-manager #0: a GDS L1 goes last in a list: its slab holds, written through, \
             what the L1s before it store, and they stand in for its DRAM staging area"
        );
    }
    for (i, text) in rest.iter().enumerate() {
        let n = i + 1;
        let L1Entry { args: m, tag, kind, shm_name } =
            apply_l1_manager(args, text).with_context(|| format!("--l1-manager #{n} ({text})"))?;
        if tags.contains(&tag) {
            bail!("--l1-manager #{n}: tag {tag:?} is already another L1's (tags are unique)");
        }
        tags.push(tag.clone());
        if kind == "GDS" {
            if n != rest.len() {
                bail!(
                    "--l1-manager #{n}: a GDS L1 goes last in a list: its slab holds, written \
                     through, what the L1s before it store (one slab at most)"
                );
            }
            slab_behind = Some(m);
            continue;
        }
        // A further DRAM L1 is private memory unless it names a segment of its own (only the
        // first is the pool engines map; with --l1-warm-restart a named one is a file in
        // /dev/shm, warm as the first).
        let own_shm = shm_name.filter(|n| !n.is_empty());
        if let Some(name) = &own_shm {
            if shm_names.contains(name) {
                bail!("--l1-manager #{n}: shm_name {name:?} is another L1's (names are unique)");
            }
            if m.l1_use_hugepages {
                bail!("--l1-manager #{n}: use_hugepages and shm_name exclude each other");
            }
            lmcache_memory::shm::validate_name(name)
                .map_err(|e| anyhow::anyhow!("--l1-manager #{n}: shm_name: {e}"))?;
            shm_names.push(name.clone());
        }
        let backing = match (&m.l1_devdax_path, own_shm) {
            (Some(path), _) => {
                if paths.contains(path) {
                    bail!("--l1-manager #{n}: path {} is another L1's", path.display());
                }
                paths.push(path.clone());
                ArenaBacking::File(lmcache_memory::FileBacking {
                    path: path.clone(),
                    format: args.l1_devdax_format,
                    adopt: args.l1_warm_restart,
                })
            }
            (None, Some(name)) if args.l1_warm_restart => {
                warm_segment(&name, args.l1_devdax_format)
            }
            (None, Some(name)) => ArenaBacking::SharedMemory { name },
            (None, None) if m.l1_use_hugepages => ArenaBacking::HugePages,
            (None, None) => ArenaBacking::Anonymous,
        };
        let size = positive_size(m.l1_size_gb, &format!("--l1-manager #{n}: size_gb"))?;
        more.push(lmcache_storage::L1MemberConfig {
            tag,
            arena: ArenaConfig { size, backing, mlock: args.l1_mlock },
            align: m.l1_align_bytes,
            l1: l1_config(&m),
        });
    }
    if !more.is_empty()
        && args.l1_warm_restart
        && first_args.l1_devdax_path.is_none()
        && first_args.shm_name.is_empty()
    {
        bail!(
            "--l1-warm-restart with several L1s needs the first to be a file: a DEVDAX L1, or a \
             DRAM L1 with a stable shm_name (it anchors the restart; the files after it, \
             DEVDAX or named DRAM, restart warm with it)"
        );
    }
    Ok(L1List { first: first_args, tag: first_tag, more, slab_behind })
}

/// One `--l1-manager` entry (LMCache's tagged L1 JSON), read.
struct L1Entry {
    /// The flags it stands for.
    args: ServerArgs,
    tag: String,
    /// Its type, upper case.
    kind: String,
    /// The shm_name it names itself (a DRAM entry), if any.
    shm_name: Option<String>,
}

/// The flags one `--l1-manager` entry stands for, with its tag and type.
fn apply_l1_manager(args: &ServerArgs, text: &str) -> anyhow::Result<L1Entry> {
    let mut out = args.clone();
    let v: serde_json::Value =
        serde_json::from_str(text).with_context(|| format!("--l1-manager: not JSON: {text}"))?;
    let obj = v.as_object().context("--l1-manager: expected a JSON object")?;
    let kind = obj.get("type").and_then(|t| t.as_str()).context("--l1-manager: type: missing")?;
    let common = [
        "type",
        "tag",
        "size_gb",
        "align_bytes",
        "read_ttl_seconds",
        "write_ttl_seconds",
        "eviction",
    ];
    let own: &[&str] = match kind.to_ascii_uppercase().as_str() {
        "DRAM" => &["use_lazy", "init_size_gb", "shm_name", "use_hugepages"],
        "DEVDAX" => &["path"],
        "GDS" => &["path", "backend", "direct_io"],
        other => bail!("--l1-manager: type: {other:?} is not DRAM, DEVDAX or GDS"),
    };
    for k in obj.keys() {
        if !common.contains(&k.as_str()) && !own.contains(&k.as_str()) {
            bail!("--l1-manager: {k}: unknown field for a {kind} L1");
        }
    }
    let Some(tag) = obj.get("tag").and_then(|t| t.as_str()).filter(|t| !t.trim().is_empty()) else {
        bail!("--l1-manager: tag: missing (a non-empty string)");
    };
    let (tag, kind_upper) = (tag.to_owned(), kind.to_ascii_uppercase());
    let num = |k: &str| -> anyhow::Result<Option<f64>> {
        match obj.get(k) {
            None => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .with_context(|| format!("--l1-manager: {k}: not a number: {x}")),
        }
    };
    let whole = |k: &str| -> anyhow::Result<Option<u64>> {
        match obj.get(k) {
            None => Ok(None),
            Some(x) => {
                x.as_u64().map(Some).with_context(|| format!("--l1-manager: {k}: not a count: {x}"))
            }
        }
    };
    out.l1_size_gb = num("size_gb")?.context("--l1-manager: size_gb: missing")?;
    if let Some(a) = whole("align_bytes")? {
        out.l1_align_bytes = a;
    }
    if let Some(t) = whole("read_ttl_seconds")? {
        out.l1_read_ttl_seconds = t;
    }
    if let Some(t) = whole("write_ttl_seconds")? {
        out.l1_write_ttl_seconds = t;
    }
    if let Some(e) = obj.get("eviction") {
        let e = e.as_object().context("--l1-manager: eviction: expected an object")?;
        for (k, x) in e {
            match k.as_str() {
                "eviction_policy" => {
                    let p = x.as_str().context("--l1-manager: eviction.eviction_policy")?;
                    out.eviction_policy = parse_policy(p)
                        .map_err(|e| anyhow::anyhow!("--l1-manager: eviction_policy: {e}"))?;
                }
                "trigger_watermark" => {
                    out.eviction_trigger_watermark =
                        x.as_f64().context("--l1-manager: eviction.trigger_watermark")?;
                }
                "eviction_ratio" => {
                    out.eviction_ratio =
                        x.as_f64().context("--l1-manager: eviction.eviction_ratio")?;
                }
                other => bail!("--l1-manager: eviction.{other}: unknown field"),
            }
        }
    }
    // The `path` a DEVDAX or GDS entry must name.
    let path = |kind: &str| -> anyhow::Result<std::path::PathBuf> {
        let p = obj.get("path").and_then(|p| p.as_str()).filter(|p| !p.is_empty());
        Ok(p.with_context(|| format!("--l1-manager: path: missing for a {kind} L1"))?.into())
    };
    let mut shm_name = None;
    match kind.to_ascii_uppercase().as_str() {
        "DEVDAX" => out.l1_devdax_path = Some(path("DEVDAX")?),
        "GDS" => {
            out.gds_l1_path = Some(path("GDS")?);
            if let Some(b) = obj.get("backend") {
                out.gds_l1_backend =
                    b.as_str().context("--l1-manager: backend: not a string")?.to_owned();
            }
            if let Some(d) = obj.get("direct_io") {
                let d = d.as_bool().context("--l1-manager: direct_io: not a boolean")?;
                out.gds_l1_use_direct_io = d;
                out.no_gds_l1_use_direct_io = !d;
            }
        }
        _ => {
            if let Some(n) = obj.get("shm_name") {
                let n = n.as_str().context("--l1-manager: shm_name: not a string")?;
                out.shm_name = n.to_owned();
                shm_name = Some(n.to_owned());
            }
            if let Some(h) = obj.get("use_hugepages") {
                out.l1_use_hugepages =
                    h.as_bool().context("--l1-manager: use_hugepages: not a boolean")?;
            }
        }
    }
    Ok(L1Entry { args: out, tag, kind: kind_upper, shm_name })
}

/// `gb` GiB in bytes, refused (naming `what`) unless a positive size.
fn positive_size(gb: f64, what: &str) -> anyhow::Result<u64> {
    gib_to_bytes(gb)
        .filter(|&b| b > 0)
        .with_context(|| format!("{what} {gb} is not a positive size"))
}

/// The L1 of shared-memory segment `name` restarted warm: the file /dev/shm/NAME, adopted (it
/// stays when the server stops).
fn warm_segment(name: &str, format: bool) -> ArenaBacking {
    ArenaBacking::File(lmcache_memory::FileBacking {
        path: std::path::Path::new(lmcache_memory::shm::SHM_DIR).join(name),
        format,
        adopt: true,
    })
}

/// An L1's eviction and lease settings, from its flags.
fn l1_config(args: &ServerArgs) -> L1Config {
    L1Config {
        eviction_policy: args.eviction_policy,
        trigger_watermark: args.eviction_trigger_watermark,
        eviction_ratio: args.eviction_ratio,
        read_ttl: Duration::from_secs(args.l1_read_ttl_seconds),
        write_ttl: Duration::from_secs(args.l1_write_ttl_seconds),
        ..L1Config::default()
    }
}

pub(crate) fn config(args: &ServerArgs) -> anyhow::Result<ServerConfig> {
    let managed;
    let (args, l1_tag, more_l1, slab_behind) = if args.l1_manager.is_empty() {
        (args, lmcache_l1::DEFAULT_TAG.to_owned(), Vec::new(), None)
    } else {
        if args.l1_devdax_path.is_some() || args.l1_use_hugepages || args.gds_l1_path.is_some() {
            bail!(
                "--l1-manager and the L1 flags it replaces (--l1-devdax-path, --l1-use-hugepages, \
                 --gds-l1-path) exclude each other"
            );
        }
        let list = apply_l1_managers(args)?;
        managed = list.first;
        (&managed, list.tag, list.more, list.slab_behind)
    };
    if !more_l1.is_empty() && args.p2p_advertise_url.is_some() && args.p2p_transfer_engine == "nixl"
    {
        bail!(
            "--p2p-transfer-engine nixl with several L1s: NIXL reads and writes one registered \
             L1 by offset; use the native engine, or one L1"
        );
    }
    let size = positive_size(args.l1_size_gb, "--l1-size-gb")?;
    // Under GDS, --l1-size-gb sizes the slab (as in LMCache) and DRAM holds the staging area;
    // a GDS entry after other L1s sizes its own slab, and they are its staging.
    let gds = match &slab_behind {
        None => gds_l1(args, size)?,
        Some(g) => {
            let dir = g.gds_l1_path.as_deref().context("--l1-manager: GDS without a path")?;
            let slab = positive_size(g.l1_size_gb, "--l1-manager: GDS size_gb")?;
            Some(GdsL1 { slab: gds_slab(g, dir, slab)?, staging_bytes: size })
        }
    };
    let size = gds.as_ref().map_or(size, |g| g.staging_bytes);
    let t = args.worker_reap_timeout_seconds;
    if t != 0 && t < 30 {
        bail!("--worker-reap-timeout-seconds must be 0 (disabled) or at least 30, got {t}");
    }
    if args.l1_devdax_path.is_none()
        && gds.is_none()
        && (args.l1_warm_restart || args.l1_devdax_format)
        && args.shm_name.is_empty()
    {
        bail!(
            "--l1-warm-restart and --l1-devdax-format need --l1-devdax-path or a stable \
             --shm-name (private memory, or a segment named after the process id, does not \
             outlive the process)"
        );
    }
    if args.l1_devdax_path.is_none() && args.l1_devdax_format && !args.l1_warm_restart {
        bail!("--l1-devdax-format needs --l1-devdax-path or --l1-warm-restart");
    }
    // A DRAM L1 with a stable name in front of a listed slab restarts warm too (a GDS L1's own
    // staging area does not).
    let warm_shm = gds.is_none() || (slab_behind.is_some() && !args.shm_name.is_empty());
    let backing = if args.l1_devdax_path.is_none() && args.l1_warm_restart && warm_shm {
        // A warm restart in shared memory: the L1 file is the segment /dev/shm/NAME, which
        // engines map by name as any shared-memory pool; it stays when the server stops.
        if args.l1_use_hugepages {
            bail!("--l1-warm-restart and --l1-use-hugepages exclude each other");
        }
        lmcache_memory::shm::validate_name(&args.shm_name)
            .map_err(|e| anyhow::anyhow!("--shm-name: {e}"))?;
        warm_segment(&args.shm_name, args.l1_devdax_format)
    } else if let Some(path) = &args.l1_devdax_path {
        if !args.shm_name.is_empty() {
            bail!("--l1-devdax-path and --shm-name exclude each other (L1 lives in the file)");
        }
        if args.l1_use_hugepages {
            bail!("--l1-devdax-path and --l1-use-hugepages exclude each other");
        }
        ArenaBacking::File(lmcache_memory::FileBacking {
            path: path.clone(),
            format: args.l1_devdax_format,
            adopt: args.l1_warm_restart,
        })
    } else if args.l1_use_hugepages {
        if !args.shm_name.is_empty() {
            bail!("--l1-use-hugepages and --shm-name exclude each other (huge pages are private)");
        }
        ArenaBacking::HugePages
    } else {
        let name =
            if args.shm_name.is_empty() { default_shm_name() } else { args.shm_name.clone() };
        ArenaBacking::SharedMemory { name }
    };
    let mut l2_adapters = Vec::new();
    for (i, text) in args.l2_adapter.iter().enumerate() {
        l2_adapters.push(
            lmcache_l2::config::parse_json(text).with_context(|| format!("--l2-adapter #{i}"))?,
        );
    }
    if let Some(path) = &args.l2_config {
        l2_adapters.extend(lmcache_l2::config::parse_toml_file(path)?);
    }
    let slab_l1 = gds.is_some();
    if let Some(g) = gds {
        l2_adapters.push(g.slab);
    }
    let t_prefetch = args.l2_prefetch_timeout_seconds;
    if !(t_prefetch.is_finite() && t_prefetch > 0.0) {
        bail!("--l2-prefetch-timeout-seconds must be a positive number, got {t_prefetch}");
    }
    for (flag, v) in [
        ("--l2-store-wait-seconds", args.l2_store_wait_seconds),
        ("--l2-flush-timeout-seconds", args.l2_flush_timeout_seconds),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            bail!("{flag} must be a number >= 0, got {v}");
        }
    }
    // A slab L1's staging gives an object up only once the slab holds it, unless the slab is
    // stuck for a minute; a stop (or a --take-over) writes what staging holds to the slab
    // first, for as long.
    let (store_wait, flush) = if slab_l1 {
        (
            args.l2_store_wait_seconds.max(GDS_STAGING_WAIT_SECONDS),
            args.l2_flush_timeout_seconds.max(GDS_STAGING_WAIT_SECONDS),
        )
    } else {
        (args.l2_store_wait_seconds, args.l2_flush_timeout_seconds)
    };
    let l2 = lmcache_storage::TierConfig {
        write_behind_wait: Duration::from_secs_f64(store_wait),
        flush_timeout: Duration::from_secs_f64(flush),
        max_in_flight: args.l2_prefetch_max_in_flight.max(1),
        prefetch_deadline: Duration::from_secs_f64(t_prefetch),
        store_queue_keys: args.l2_store_queue_size.max(1),
        allowed_roots: args.l2_allowed_root.clone(),
        store_policy: if args.l2_store_policy == "skip_l1" {
            lmcache_storage::StorePolicy::SkipL1
        } else {
            lmcache_storage::StorePolicy::Default
        },
        ..lmcache_storage::TierConfig::default()
    };
    Ok(ServerConfig {
        coordinator: coordinator_reporting(args)?,
        allowed_shm_prefix: args.allowed_shm_prefix.clone().filter(|p| !p.is_empty()),
        l2_adapters,
        l2,
        host: args.host.clone(),
        port: args.port,
        transport: match args.transport.as_str() {
            "grpc" => TransportKind::Grpc { server_workers: args.grpc_server_workers.max(1) },
            _ => TransportKind::Zmq,
        },
        http_host: args.http_host.clone(),
        http_port: Some(args.http_port),
        p2p_channel: p2p_channel(args)?,
        p2p_engine: p2p_engine(args)?,
        p2p_lookup_timeout: positive_secs("p2p-lookup-timeout", args.p2p_lookup_timeout)?,
        p2p_load_timeout: positive_secs("p2p-load-timeout", args.p2p_load_timeout)?,
        p2p_same_host: args.p2p_same_host,
        blend: blend(args)?,
        http_auth_token: args.http_auth_token.clone().filter(|t| !t.is_empty()),
        chunk_size: args.chunk_size,
        max_cpu_workers: args.max_cpu_workers.unwrap_or(args.max_workers).max(1),
        max_gpu_workers: args.max_gpu_workers.unwrap_or(args.max_workers).max(1),
        worker_reap_timeout: Duration::from_secs(t),
        worker_registration_grace: Duration::from_secs(args.worker_registration_grace_seconds),
        session_ttl: Duration::from_secs(args.session_ttl_seconds.max(1)),
        null_block_id: args.null_block_id,
        separate_object_groups: args.separate_object_groups,
        trace: args.trace_level.as_deref().map(|level| {
            let level = lmcache_workload::trace::Level::parse(level)
                .unwrap_or(lmcache_workload::trace::Level::Storage);
            let path = args
                .trace_output
                .clone()
                .unwrap_or_else(lmcache_server::trace_record::default_trace_path);
            lmcache_server::trace_record::TraceConfig { level, path }
        }),
        instance_id: instance_id(args),
        lookup_hash_log: args.lookup_hash_log_dir.as_ref().map(|dir| {
            lmcache_server::lookup_log::LookupHashLogConfig {
                dir: dir.clone(),
                rotation_interval: Duration::from_secs(args.lookup_hash_log_rotation_interval),
                rotation_max_size: args.lookup_hash_log_rotation_max_size,
                max_files: args.lookup_hash_log_max_files,
            }
        }),
        explain_requests: if args.disable_observability { 0 } else { args.explain_requests },
        kv_event_log_size: if args.disable_observability { 0 } else { args.kv_event_log_size },
        event_bus_queue_size: if args.disable_observability {
            0
        } else {
            args.event_bus_queue_size
        },
        copy_threads: args.copy_threads.max(1),
        l1: l1_config(args),
        arena: ArenaConfig { size, backing, mlock: args.l1_mlock },
        align: args.l1_align_bytes,
        l1_tag,
        more_l1,
    })
}

/// Blocks SIGINT and SIGTERM for every thread started after it (so that only the main
/// thread's `sigwait` receives them) and returns the set to wait on.
pub(crate) fn block_shutdown_signals() -> anyhow::Result<SigSet> {
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals.thread_block().context("blocking shutdown signals")?;
    Ok(signals)
}

/// Waits for SIGINT/SIGTERM, or for `exit_after_seconds` (a SIGTERM to ourselves; 0: never).
pub(crate) fn wait_for_shutdown(signals: &SigSet, exit_after_seconds: u64) -> anyhow::Result<()> {
    if exit_after_seconds > 0 {
        let after = Duration::from_secs(exit_after_seconds);
        std::thread::Builder::new()
            .name("exit-after".into())
            .spawn(move || {
                std::thread::sleep(after);
                let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), Signal::SIGTERM);
            })
            .context("starting the exit timer")?;
    }
    let sig = signals.wait().context("waiting for a shutdown signal")?;
    tracing::info!(signal = ?sig, "shutting down");
    Ok(())
}

/// What `--take-over` took from the old server.
struct TookOver {
    pid: u32,
    /// When the old server was asked to stop.
    since: Instant,
    /// Its listening sockets, received before it was asked to stop.
    listeners: lmcache_server::handover::Listeners,
}

/// `--take-over`: takes the listening ports of the lmcache-rs server holding the L1 file
/// (when it offers them), stops it, and waits until it let the file go. `None`: nobody held
/// the file.
fn take_over(args: &ServerArgs, config: &ServerConfig) -> anyhow::Result<Option<TookOver>> {
    let path = match config.restart_anchor() {
        Some((anchor, true)) => anchor,
        _ => bail!(
            "--take-over needs --l1-warm-restart, with --l1-devdax-path, --shm-name or \
             --gds-l1-path (the new server adopts the old one's L1)"
        ),
    };
    let timeout = Duration::try_from_secs_f64(args.take_over_timeout_seconds)
        .ok()
        .filter(|t| !t.is_zero())
        .context("--take-over-timeout-seconds must be a positive number")?;
    if !path.exists() {
        tracing::info!(path = %path.display(), "--take-over: no L1 file yet, starting fresh");
        return Ok(None);
    }
    let Some(pid) = lmcache_memory::file_arena::lock_holder(&path)? else {
        tracing::info!(path = %path.display(), "--take-over: no server holds the L1 file");
        return Ok(None);
    };
    // Only an lmcache-rs server is ever signalled (a process whose name starts so: a binary
    // installed as lmcache-rs-0.2 is one too): a foreign holder is named and left alone.
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    if !comm.trim().starts_with("lmcache-rs") {
        bail!(
            "--take-over: {} is held by pid {pid} ({:?}), not an lmcache-rs server; it is left alone",
            path.display(),
            comm.trim()
        );
    }
    // The ports first, while the old server still serves on them: from then on a connection
    // waits in their listen queue for whichever of the two accepts it.
    let name = lmcache_server::handover::socket_name(&path);
    let listeners = match lmcache_server::handover::receive(&name, pid, Duration::from_secs(5)) {
        Ok(l) => {
            tracing::info!(old_pid = pid, roles = ?l.roles(), "--take-over: received the ports");
            l
        }
        Err(e) => {
            tracing::warn!(
                old_pid = pid,
                error = %e,
                "--take-over: the ports will be bound afresh once the old server has let them go"
            );
            lmcache_server::handover::Listeners::default()
        }
    };
    let since = Instant::now();
    let target = i32::try_from(pid).context("pid out of range")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(target), Signal::SIGTERM)
        .with_context(|| format!("--take-over: signalling pid {pid}"))?;
    tracing::info!(old_pid = pid, "--take-over: asked the old server to stop");
    if !lmcache_memory::file_arena::wait_released(&path, timeout) {
        bail!(
            "--take-over: pid {pid} still holds {} after {:.0} s (--take-over-timeout-seconds)",
            path.display(),
            timeout.as_secs_f64()
        );
    }
    Ok(Some(TookOver { pid, since, listeners }))
}

/// Runs the server until SIGINT/SIGTERM (or `--exit-after-seconds`).
pub fn run(args: ServerArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    // Block the shutdown signals before any thread starts, so every thread inherits the mask
    // and the main thread alone receives them through sigwait.
    let signals = block_shutdown_signals()?;

    let config = config(&args)?;
    let mut took_over = if args.take_over { take_over(&args, &config)? } else { None };
    let inherited = took_over.as_mut().map(|t| std::mem::take(&mut t.listeners));
    let server =
        Server::start_with(config, inherited.unwrap_or_default()).context("starting the server")?;
    tracing::info!(
        endpoint = server.endpoint(),
        http = ?server.http_addr(),
        policy = %args.eviction_policy,
        l1_gb = args.l1_size_gb,
        ready_ms = started.elapsed().as_millis() as u64,
        "lmcache-rs serving"
    );
    if let Some(t) = took_over {
        tracing::info!(
            old_pid = t.pid,
            pause_ms = t.since.elapsed().as_millis() as u64,
            ports_handed_over = ?server.handed_over(),
            "took over: serving the old server's L1"
        );
    }
    wait_for_shutdown(&signals, args.exit_after_seconds)?;
    server.shutdown();
    tracing::info!("stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn try_parse(flags: &[&str]) -> Result<ServerArgs, clap::Error> {
        #[derive(clap::Parser)]
        struct Cmd {
            #[command(flatten)]
            server: ServerArgs,
        }
        let argv = std::iter::once("server").chain(flags.iter().copied());
        <Cmd as clap::Parser>::try_parse_from(argv).map(|c| c.server)
    }

    fn parse(flags: &[&str]) -> ServerArgs {
        try_parse(flags).unwrap()
    }

    #[test]
    fn an_l1_manager_entry_stands_for_the_l1_flags() {
        let c = config(&parse(&[
            "--l1-manager",
            r#"{"type": "DEVDAX", "tag": "dax0", "size_gb": 2, "path": "/x/l1", "align_bytes": 8192,
                "read_ttl_seconds": 7, "eviction": {"eviction_policy": "ARC", "trigger_watermark": 0.7,
                "eviction_ratio": 0.1}}"#,
        ]))
        .unwrap();
        assert_eq!(c.arena.size, 2 << 30);
        assert_eq!(c.align, 8192);
        assert_eq!(c.l1.read_ttl, Duration::from_secs(7));
        assert_eq!(c.l1.eviction_policy.as_str(), "ARC");
        assert_eq!((c.l1.trigger_watermark, c.l1.eviction_ratio), (0.7, 0.1));
        match &c.arena.backing {
            ArenaBacking::File(f) => assert_eq!(f.path, std::path::Path::new("/x/l1")),
            other => panic!("{other:?}"),
        }
        let c = config(&parse(&[
            "--l1-manager",
            r#"{"type": "DRAM", "tag": "_default", "size_gb": 0.5, "shm_name": "pool_x", "use_lazy": false}"#,
        ]))
        .unwrap();
        assert_eq!(c.arena.size, 512 << 20);
        assert_eq!(c.arena.backing, ArenaBacking::SharedMemory { name: "pool_x".into() });
        // A GDS entry stands for the --gds-l1-* flags: the slab is the only L2 tier.
        let c = config(&parse(&[
            "--l1-manager",
            r#"{"type": "GDS", "tag": "g", "size_gb": 8, "path": "/nvme", "direct_io": false,
                "backend": "posix"}"#,
        ]))
        .unwrap();
        assert_eq!(c.arena.size, 2 << 30, "DRAM staging, not the slab");
        assert_eq!(
            c.l2_adapters,
            vec![serde_json::json!({"type": "gds_slab", "path": "/nvme",
                "capacity_bytes": 8u64 << 30, "use_odirect": false, "warm_restart": false,
                "slot_bytes": 0})]
        );
        for (bad, named) in [
            (r#"{"type": "GDS", "tag": "g", "size_gb": 1}"#, "path: missing"),
            (
                r#"{"type": "GDS", "tag": "g", "size_gb": 1, "path": "/n", "backend": "cufile"}"#,
                "GPU",
            ),
            (r#"{"type": "DRAM", "tag": "t"}"#, "size_gb"),
            (r#"{"type": "DRAM", "size_gb": 1}"#, "tag"),
            (r#"{"type": "DEVDAX", "tag": "t", "size_gb": 1}"#, "path"),
            (r#"{"type": "DRAM", "tag": "t", "size_gb": 1, "path": "/x"}"#, "path: unknown"),
            (r#"{"type": "HBM", "tag": "t", "size_gb": 1}"#, "HBM"),
            (r#"{"type": "DRAM", "tag": "t", "size_gb": true}"#, "size_gb"),
            ("not json", "not JSON"),
        ] {
            let err = config(&parse(&["--l1-manager", bad])).unwrap_err();
            assert!(format!("{err:#}").contains(named), "{bad}: {err:#}");
        }
        let two = ["--l1-manager", r#"{"type":"DRAM","tag":"a","size_gb":1}"#];
        let err = config(&parse(&[two[0], two[1], "--l1-devdax-path", "/x"])).unwrap_err();
        assert!(err.to_string().contains("exclude"), "{err}");
    }

    #[test]
    fn several_l1_manager_entries_are_l1s_in_write_order() {
        let c = config(&parse(&[
            "--l1-manager",
            r#"{"type": "DRAM", "tag": "fast", "size_gb": 1}"#,
            "--l1-manager",
            r#"{"type": "DEVDAX", "tag": "dax0", "size_gb": 2, "path": "/x/l1", "align_bytes": 8192,
                "eviction": {"eviction_policy": "ARC"}}"#,
            "--l1-manager",
            r#"{"type": "DRAM", "tag": "huge", "size_gb": 0.5, "use_hugepages": true,
                "write_ttl_seconds": 9}"#,
        ]))
        .unwrap();
        assert_eq!((c.l1_tag.as_str(), c.arena.size), ("fast", 1 << 30));
        assert!(matches!(c.arena.backing, ArenaBacking::SharedMemory { .. }), "the mapped pool");
        let [dax, huge] = c.more_l1.as_slice() else { panic!("{:?}", c.more_l1) };
        assert_eq!((dax.tag.as_str(), dax.arena.size, dax.align), ("dax0", 2 << 30, 8192));
        assert_eq!(dax.l1.eviction_policy.as_str(), "ARC");
        assert_eq!(c.l1.eviction_policy.as_str(), "LRU", "each L1 its own policy");
        match &dax.arena.backing {
            ArenaBacking::File(f) => assert_eq!(f.path, std::path::Path::new("/x/l1")),
            other => panic!("{other:?}"),
        }
        assert_eq!((huge.arena.size, &huge.arena.backing), (512 << 20, &ArenaBacking::HugePages));
        assert_eq!(huge.l1.write_ttl, Duration::from_secs(9));
        let dram = |tag: &str| format!(r#"{{"type":"DRAM","tag":"{tag}","size_gb":1}}"#);
        let dax = |tag: &str, path: &str| {
            format!(r#"{{"type":"DEVDAX","tag":"{tag}","size_gb":1,"path":"{path}"}}"#)
        };
        let gds = r#"{"type":"GDS","tag":"g","size_gb":1,"path":"/n"}"#.to_owned();
        let shm = r#"{"type":"DRAM","tag":"s","size_gb":1,"shm_name":"x"}"#.to_owned();
        for (entries, extra, named) in [
            (vec![dram("a"), dram("a")], vec![], "already another L1's"),
            (vec![gds.clone(), dram("a")], vec![], "GDS L1 goes last"),
            (vec![dram("a"), gds.clone(), dram("b")], vec![], "GDS L1 goes last"),
            (vec![dram("a"), gds.clone(), gds.replace("\"g\"", "\"h\"")], vec![], "goes last"),
            (
                vec![dram("a"), gds.clone()],
                vec!["--l2-adapter", r#"{"type":"mock","max_size_gb":1}"#],
                "exclude each other",
            ),
            (vec![dram("a"), gds.clone()], vec!["--gds-l1-path", "/m"], "exclude each other"),
            (vec![shm.clone(), shm.replace("\"s\"", "\"t\"")], vec![], "another L1's (names"),
            (vec![dram("a"), shm.clone()], vec!["--shm-name", "x"], "another L1's (names"),
            (
                vec![dram("a"), shm.replace("\"x\"", "\"x\",\"use_hugepages\":true")],
                vec![],
                "use_hugepages and shm_name",
            ),
            (vec![dram("a"), shm.replace("\"x\"", "\"../x\"")], vec![], "shm_name"),
            (vec![dax("a", "/p"), dax("b", "/p")], vec![], "is another L1's"),
            (vec![dram("a"), dax("b", "/p")], vec!["--l1-warm-restart"], "first to be a file"),
            (
                vec![dram("a"), dram("b")],
                vec![
                    "--p2p-transfer-engine",
                    "nixl",
                    "--p2p-advertise-url",
                    "127.0.0.1:1",
                    "--coordinator-url",
                    "http://127.0.0.1:1",
                ],
                "nixl with several L1s",
            ),
        ] {
            let mut argv: Vec<&str> = Vec::new();
            for e in &entries {
                argv.extend(["--l1-manager", e.as_str()]);
            }
            argv.extend(extra.iter().copied());
            let err = config(&parse(&argv)).unwrap_err();
            assert!(format!("{err:#}").contains(named), "{entries:?}: {err:#}");
        }
    }

    #[test]
    fn a_gds_entry_last_in_a_list_is_a_slab_behind_the_l1s_before_it() {
        let gds = r#"{"type": "GDS", "tag": "slab", "size_gb": 100, "path": "/nvme/kv",
            "direct_io": false}"#;
        let c = config(&parse(&[
            "--l1-manager",
            r#"{"type": "DRAM", "tag": "dram", "size_gb": 1}"#,
            "--l1-manager",
            r#"{"type": "DEVDAX", "tag": "dax", "size_gb": 2, "path": "/x/l1"}"#,
            "--l1-manager",
            gds,
        ]))
        .unwrap();
        assert_eq!((c.l1_tag.as_str(), c.arena.size), ("dram", 1 << 30), "no staging area");
        assert!(matches!(c.arena.backing, ArenaBacking::SharedMemory { .. }), "the mapped pool");
        let [dax] = c.more_l1.as_slice() else { panic!("{:?}", c.more_l1) };
        assert_eq!((dax.tag.as_str(), dax.arena.size), ("dax", 2 << 30));
        assert_eq!(
            c.l2_adapters,
            vec![serde_json::json!({"type": "gds_slab", "path": "/nvme/kv",
                "capacity_bytes": 100u64 << 30, "use_odirect": false, "warm_restart": false,
                "slot_bytes": 0})],
            "the slab is sized by its own entry"
        );
        assert_eq!(c.l2.write_behind_wait, Duration::from_secs(60), "L1 waits for the slab");
        assert_eq!(c.l2.flush_timeout, Duration::from_secs(60), "a stop writes L1 out");
        let lock = std::path::PathBuf::from("/nvme/kv/lmcache-rs-gds-l1.lock");
        assert_eq!(c.restart_anchor(), Some((lock.clone(), false)));

        // Warm: a DRAM L1 without a stable name stays cold (as a GDS L1's staging does) and
        // the slab anchors the restart; with a stable name it is a file and anchors it.
        let dram = r#"{"type": "DRAM", "tag": "dram", "size_gb": 1}"#;
        let warm = ["--l1-warm-restart", "--l1-manager", dram, "--l1-manager", gds];
        let c = config(&parse(&warm)).unwrap();
        assert!(matches!(c.arena.backing, ArenaBacking::SharedMemory { .. }));
        assert_eq!(c.l2_adapters[0]["warm_restart"], true);
        assert_eq!(c.restart_anchor(), Some((lock, true)));
        let mut named = warm.to_vec();
        named.extend(["--shm-name", "kv_pool"]);
        let c = config(&parse(&named)).unwrap();
        let shm = std::path::Path::new(lmcache_memory::shm::SHM_DIR).join("kv_pool");
        match &c.arena.backing {
            ArenaBacking::File(f) => assert!(f.path == shm && f.adopt, "{f:?}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(c.restart_anchor(), Some((shm, true)));
        assert_eq!(c.l2_adapters[0]["warm_restart"], true);
        // A GDS entry alone is still its own staging area in front of its slab.
        let alone = config(&parse(&["--l1-manager", gds])).unwrap();
        assert_eq!(alone.arena.size, 2 << 30, "the staging area");
        assert_eq!(alone.l2_adapters[0]["capacity_bytes"], 100u64 << 30);
    }

    #[test]
    fn a_further_dram_l1_may_name_a_segment_of_its_own() {
        let entries = [
            "--l1-manager",
            r#"{"type": "DRAM", "tag": "a", "size_gb": 1, "shm_name": "pool_a"}"#,
            "--l1-manager",
            r#"{"type": "DRAM", "tag": "b", "size_gb": 1, "shm_name": "pool_b"}"#,
            "--l1-manager",
            r#"{"type": "DRAM", "tag": "c", "size_gb": 1}"#,
        ];
        let c = config(&parse(&entries)).unwrap();
        assert_eq!(c.arena.backing, ArenaBacking::SharedMemory { name: "pool_a".into() });
        let [b, anon] = c.more_l1.as_slice() else { panic!("{:?}", c.more_l1) };
        assert_eq!(b.arena.backing, ArenaBacking::SharedMemory { name: "pool_b".into() });
        assert_eq!(anon.arena.backing, ArenaBacking::Anonymous, "no name: private memory");
        // Restarted warm, each named one is a file in /dev/shm and adopts what it held.
        let mut warm = entries.to_vec();
        warm.push("--l1-warm-restart");
        let c = config(&parse(&warm)).unwrap();
        let shm = std::path::Path::new(lmcache_memory::shm::SHM_DIR);
        assert_eq!(c.restart_anchor(), Some((shm.join("pool_a"), true)));
        match &c.more_l1[0].arena.backing {
            ArenaBacking::File(f) => assert!(f.path == shm.join("pool_b") && f.adopt, "{f:?}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(c.more_l1[1].arena.backing, ArenaBacking::Anonymous);
    }

    #[test]
    fn several_l1s_restart_warm_from_a_named_dram_pool_too() {
        let c = config(&parse(&[
            "--l1-warm-restart",
            "--shm-name",
            "kv_pool",
            "--l1-manager",
            r#"{"type": "DRAM", "tag": "dram", "size_gb": 1}"#,
            "--l1-manager",
            r#"{"type": "DEVDAX", "tag": "dax", "size_gb": 2, "path": "/x/l1"}"#,
        ]))
        .unwrap();
        let shm = std::path::Path::new(lmcache_memory::shm::SHM_DIR).join("kv_pool");
        assert_eq!(c.restart_anchor(), Some((shm, true)));
        match &c.more_l1[0].arena.backing {
            ArenaBacking::File(f) => assert!(f.adopt, "the DEVDAX L1 restarts warm with it"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_gds_l1_flags_make_a_slab_and_a_staging_area() {
        let c = config(&parse(&["--gds-l1-path", "/nvme/kv", "--l1-size-gb", "100"])).unwrap();
        assert_eq!(c.arena.size, 2 << 30);
        assert_eq!(c.l2.write_behind_wait, Duration::from_secs(60), "staging waits for the slab");
        assert_eq!(c.l2.flush_timeout, Duration::from_secs(60), "a stop writes staging out");
        let slab = &c.l2_adapters[0];
        assert_eq!(slab["type"], "gds_slab");
        assert_eq!(slab["capacity_bytes"], 100u64 << 30);
        assert_eq!((&slab["use_odirect"], &slab["warm_restart"]), (&true.into(), &false.into()));
        // Warm restart keeps the slab; the staging area is not a file, so no stable
        // --shm-name is needed.
        let c = config(&parse(&[
            "--gds-l1-path",
            "/nvme/kv",
            "--l1-size-gb",
            "1",
            "--gds-l1-staging-gb",
            "4",
            "--no-gds-l1-use-direct-io",
            "--l1-warm-restart",
        ]))
        .unwrap();
        assert_eq!(c.arena.size, 1 << 30, "staging is capped at the slab");
        assert_eq!(c.l2_adapters[0]["slot_bytes"], 0);
        let sized = config(&parse(&["--gds-l1-path", "/n", "--gds-l1-slot-mb", "40"])).unwrap();
        assert_eq!(sized.l2_adapters[0]["slot_bytes"], 40u64 << 20);
        assert!(matches!(c.arena.backing, ArenaBacking::SharedMemory { .. }));
        assert_eq!(
            (&c.l2_adapters[0]["use_odirect"], &c.l2_adapters[0]["warm_restart"]),
            (&false.into(), &true.into())
        );
        // A restart (and a --take-over) hangs on the slab's lock file.
        let lock = std::path::PathBuf::from("/nvme/kv/lmcache-rs-gds-l1.lock");
        assert_eq!(c.restart_anchor(), Some((lock.clone(), true)));
        let cold = config(&parse(&["--gds-l1-path", "/nvme/kv"])).unwrap();
        assert_eq!(cold.restart_anchor(), Some((lock, false)));
        assert_eq!(config(&parse(&[])).unwrap().restart_anchor(), None);
        for (extra, named) in [
            (&["--gds-l1-backend", "ugds"][..], "ugds"),
            (&["--gds-l1-backend", "nvme"], "auto or posix"),
            (&["--l1-devdax-path", "/x"], "--l1-devdax-path"),
            (&["--l2-adapter", r#"{"type": "fs", "base_path": "/x"}"#], "exclude"),
            (&["--gds-l1-staging-gb", "0"], "staging"),
        ] {
            let mut flags = vec!["--gds-l1-path", "/nvme/kv"];
            flags.extend_from_slice(extra);
            let err = config(&parse(&flags)).unwrap_err();
            assert!(format!("{err:#}").contains(named), "{extra:?}: {err:#}");
        }
    }

    #[test]
    fn the_blend_engine_takes_its_flags_and_refuses_engine_driven() {
        assert!(config(&parse(&[])).unwrap().blend.is_none());
        assert!(config(&parse(&["--enable-blend-reorder"])).unwrap().blend.is_none());
        let b = config(&parse(&["--engine-type", "blend", "--enable-dedup-content"]))
            .unwrap()
            .blend
            .unwrap();
        assert!(b.dedup_content && !b.reorder && !b.segmented_prefix);
        let flags =
            ["--engine-type", "blend", "--enable-blend-reorder", "--enable-segmented-prefix"];
        let b = config(&parse(&flags)).unwrap().blend.unwrap();
        assert!(b.reorder && b.segmented_prefix);
        let b = config(&parse(&flags)).unwrap().blend.unwrap();
        assert_eq!(b.coordinator_timeout, Duration::from_secs(1));
        assert_eq!(b.coordinator_match_concurrency, 8);
        let fleet = ["--engine-type", "blend", "--coordinator-blend-timeout", "0.25"];
        let b = config(&parse(&fleet)).unwrap().blend.unwrap();
        assert_eq!(b.coordinator_timeout, Duration::from_millis(250));
        for bad in ["0", "-1", "nan", "inf"] {
            let argv = ["--engine-type", "blend", "--coordinator-blend-timeout", bad];
            assert!(try_parse(&argv).map_or(true, |a| config(&a).is_err()), "{bad}");
        }
        assert!(try_parse(&["--coordinator-blend-match-concurrency", "0"]).is_err());
        let bad = ["--engine-type", "blend", "--supported-transfer-mode", "engine_driven"];
        let e = config(&parse(&bad)).unwrap_err().to_string();
        assert!(e.contains("--supported-transfer-mode"), "{e}");
        assert!(refuse_unsupported(&["--engine-type".into()]).is_ok());
    }

    #[test]
    fn the_same_host_path_is_on_unless_turned_off() {
        assert!(config(&parse(&[])).unwrap().p2p_same_host);
        assert!(config(&parse(&["--p2p-same-host"])).unwrap().p2p_same_host);
        assert!(!config(&parse(&["--p2p-same-host", "false"])).unwrap().p2p_same_host);
        assert!(!config(&parse(&["--p2p-same-host=0"])).unwrap().p2p_same_host);
    }
}
