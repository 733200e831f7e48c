//! The coordinator's state and every operation on it, without HTTP, one module per question:
//! - `registry`: registration, heartbeats, the health sweep (the table is `Instances`, its
//!   own type and lock);
//! - `events`: the event gate (in order per emitter) and applying batches;
//! - `repair`: resyncing an emitter's stream after a gap;
//! - `directory`: lookups, listings, stats, blend matches, routing;
//! - `usage`: memory usage per instance and shared pool;
//! - `control`: quotas, pins, the fleet eviction plan, the stream position, the digest;
//! - `persist`: the checkpoint image and the restore;
//! - `vllm`: admitted batches and fences handed to the vLLM KV-event publisher;
//! - `replicated`: registry and metadata changes sent to and applied from the other
//!   replicas.
//!
//! Lock order: `views` (gate + directory + capacities, one mutex, so a batch is admitted and
//! applied atomically and in order per emitter) is never held while taking `registry`, and
//! the other way round neither.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lmcache_core::{KvRank, TokenHasher};
use lmcache_directory::{
    DirKey, Directory, Entry, EventKind, KeyFilter, Namespace, PlacementView, PrefixRun, RunQuery,
    Tier,
};
use lmcache_protocol::coordinator::{
    CacheEventBatch, CacheEventType, CacheEventsResponse, DirectoryKeyInfo, DirectoryKeyPlacements,
    EncodedObjectKey, FleetMemoryResponse, InstanceInfo, InstanceMemoryStatus, KeyNamespace,
    MAX_TOKEN_IDS, ModuleMemoryStatus, Placement, RegisterRequest, RegisterResponse, WireTier,
};
use lmcache_protocol::coordinator_borrowed::EncodedObjectKeyRef;
use lmcache_protocol::coordinator_write::KeyAnswer;
use parking_lot::Mutex;

use crate::config::CoordinatorConfig;
use crate::metrics::Metrics;

mod control;
mod directory;
mod events;
mod persist;
mod registry;
mod repair;
mod replicated;
mod usage;
mod vllm;

/// Batch builders the fleet's unit tests share.
#[cfg(test)]
pub(crate) mod test_batches {
    use lmcache_protocol::coordinator::{
        CacheEventBatch, CacheEventEntry, CacheEventType, EncodedObjectKey, WireTier,
    };

    /// Chunk hash `hex` (64 digits) of model `model`, one rank, salt `salt`.
    pub(crate) fn key(hex: String, model: &str, salt: &str) -> EncodedObjectKey {
        EncodedObjectKey {
            chunk_hash_hex: hex,
            model_name: model.into(),
            kv_rank: 0x0100_0100,
            object_group_id: 0,
            cache_salt: salt.into(),
        }
    }

    /// Instance `s` (incarnation 1) stored `keys` in its L1 `dram`, one byte each, as batch
    /// `seq`.
    pub(crate) fn l1_store(
        seq: u64,
        keys: impl IntoIterator<Item = EncodedObjectKey>,
    ) -> CacheEventBatch {
        CacheEventBatch {
            instance_id: "s".into(),
            incarnation: 1,
            seq,
            event_type: CacheEventType::Store,
            tier: WireTier::L1,
            backend: "dram".into(),
            entries: keys
                .into_iter()
                .map(|key| CacheEventEntry {
                    key,
                    size_bytes: 1,
                    token_ids: Vec::new(),
                    token_offset: -1,
                })
                .collect(),
            shared: false,
            ts: 1.0,
            capacity_bytes: 0,
            capacity_revision: 0,
        }
    }
}

pub use control::EvictionOrder;
pub use persist::RestoreStats;

/// Why a request was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FleetError {
    /// The body fails LMCache's validation (HTTP 422).
    #[error("{0}")]
    Invalid(String),
    /// The request is well formed but cannot be served (HTTP 400).
    #[error("{0}")]
    BadRequest(String),
    /// No such instance (HTTP 404).
    #[error("unknown instance {0}")]
    UnknownInstance(String),
    /// A limit of the directory was reached.
    #[error(transparent)]
    Directory(#[from] lmcache_directory::DirectoryError),
}

/// One registered instance.
#[derive(Debug, Clone)]
struct Registration {
    info: InstanceInfo,
    last_heartbeat: Instant,
    /// Whether the registration carried the coordinator's `--auth-token`: only then do the
    /// servers' bearer token and this coordinator's calls go to the address it gave.
    trusted: bool,
}

/// Where the coordinator calls a registered server, and whether the servers' bearer token
/// may go there (only to an instance that registered with the coordinator's own token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `http://ip:port`.
    pub base_url: String,
    /// Registered with the coordinator's token.
    pub trusted: bool,
}

/// A resync of one instance's L1 placements from its snapshot, in progress.
#[derive(Debug)]
struct Repair {
    incarnation: u64,
    /// Keys L1 events named since the repair began: newer than any snapshot page.
    touched: std::collections::HashSet<DirKey>,
    /// Keys the snapshot listed.
    listed: std::collections::HashSet<DirKey>,
    /// L2 placements (key, site) events named since the repair began.
    touched_l2: std::collections::HashSet<(DirKey, lmcache_directory::SiteId)>,
    /// L2 placements the L2 snapshot listed.
    listed_l2: std::collections::HashSet<(DirKey, lmcache_directory::SiteId)>,
    started: Instant,
    /// Another gap came during this repair: run again after it.
    again: bool,
}

/// Where a repair fetches from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairTarget {
    /// The server.
    pub endpoint: Endpoint,
    /// The incarnation being repaired.
    pub incarnation: u64,
}

/// How a repair ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepairOutcome {
    /// The snapshot replaced the instance's L1 placements.
    Repaired,
    /// No snapshot could be had: the instance's L1 placements were dropped (never wrong,
    /// possibly short until new events come).
    Fenced,
    /// A newer incarnation (or a deregistration) made it moot.
    Superseded,
}

/// Per emitter: where its stream stands.
#[derive(Debug, Clone)]
struct Cursor {
    incarnation: u64,
    last_seq: u64,
    /// Batches missing between admitted ones, ever (this incarnation).
    missing: u64,
    /// Whether a gap is open (seen and not yet repaired).
    gap: bool,
    last_admitted: Instant,
    /// Repairs completed for this emitter.
    repairs: u64,
    /// How long the last repair took.
    last_repair: Option<Duration>,
}

/// One instance's capacity declaration.
#[derive(Debug, Clone, Default)]
struct Declaration {
    stamp: (u64, u64),
    /// (tier, backend, shared) → capacity bytes.
    compartments: BTreeMap<(Tier, String, bool), u64>,
}

#[derive(Debug)]
struct Views {
    dir: Directory,
    cursors: HashMap<String, Cursor>,
    declarations: HashMap<String, Declaration>,
    repairs: HashMap<String, Repair>,
}

/// Admission of one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admission {
    Applied,
    Duplicate,
    Stale,
}

/// What a stream looks like to operators (`/directory/stats`, metrics).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StreamStats {
    /// Emitter.
    pub instance_id: String,
    /// Its incarnation.
    pub incarnation: u64,
    /// Last admitted seq.
    pub last_seq: u64,
    /// Whether a gap is open (seen, not yet repaired).
    pub gap_detected: bool,
    /// Whether a resync is running.
    pub repairing: bool,
    /// Resyncs completed.
    pub repairs: u64,
    /// Seconds the last resync took.
    pub last_repair_seconds: Option<f64>,
    /// Batches missing in gaps, this incarnation.
    pub missing_batches: u64,
    /// Seconds since its last admitted batch.
    pub seconds_since_last_batch: f64,
}

/// An instance's place in a routing answer.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RouteCandidate {
    /// Instance.
    pub instance_id: String,
    /// Leading chunks in its L1.
    pub l1_chunks: u32,
    /// Leading chunks in its L1 or any L2 it can load from.
    pub l1_l2_chunks: u32,
    /// `l1_chunks` in tokens.
    pub l1_tokens: u64,
    /// `l1_l2_chunks` in tokens.
    pub l1_l2_tokens: u64,
    /// Higher is better: chunks saved, L2 ones weighted, minus the load given.
    pub score: f64,
    /// Where to reach it.
    pub ip: String,
    /// Its HTTP port.
    pub http_port: u32,
}

/// The fleet state.
#[derive(Debug)]
pub struct Fleet {
    config: CoordinatorConfig,
    hasher: TokenHasher,
    views: Mutex<Views>,
    registry: registry::Instances,
    /// Instances whose stream needs a resync, for the repair thread.
    repair_tx: Mutex<Option<std::sync::mpsc::Sender<String>>>,
    /// The vLLM KV-event publisher's queue, when re-publishing is on.
    vllm: Mutex<Option<crate::vllm_events::Publisher>>,
    /// Registry changes for the other replicas ([`crate::replication`]), when replicated.
    replicate: Mutex<Option<tokio::sync::mpsc::UnboundedSender<crate::replication::Change>>>,
    /// This replica's id in replicated records (random per process).
    replica_id: u64,
    /// Quotas and pins (lock order: views before control; never the other way).
    control: Mutex<crate::control::Control>,
    /// The last JetStream stream sequence applied (0: none; HTTP transport: always 0).
    stream_position: std::sync::atomic::AtomicU64,
    /// Metrics (shared with the HTTP layer).
    pub metrics: Arc<Metrics>,
}

fn wall_clock() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn tier_of(t: WireTier) -> Option<Tier> {
    match t {
        WireTier::L1 => Some(Tier::L1),
        WireTier::L2 => Some(Tier::L2),
        WireTier::All => None,
    }
}

fn wire_tier(t: Tier) -> WireTier {
    match t {
        Tier::L1 => WireTier::L1,
        Tier::L2 => WireTier::L2,
    }
}

fn placement(p: PlacementView) -> Placement {
    Placement {
        instance_id: p.instance,
        incarnation: p.incarnation,
        tier: wire_tier(p.tier),
        backend: p.backend,
        size_bytes: p.size,
        shared: p.shared,
    }
}

/// `mp-<32 hex>`: unique enough for instance ids (time, pid and a counter through BLAKE3).
fn fresh_instance_id() -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = blake3::Hasher::new();
    h.update(&wall_clock().to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    h.update(&N.fetch_add(1, std::sync::atomic::Ordering::Relaxed).to_le_bytes());
    format!("mp-{}", &h.finalize().to_hex()[..32])
}

impl Fleet {
    /// A coordinator with nothing registered.
    pub fn new(config: CoordinatorConfig) -> Result<Self, FleetError> {
        if config.hash_algorithm != "blake3" {
            return Err(FleetError::BadRequest(format!(
                "hash algorithm {:?} is not supported (the fleet must use blake3, LMCache's default)",
                config.hash_algorithm
            )));
        }
        let hasher = TokenHasher::new(config.chunk_size)
            .map_err(|e| FleetError::BadRequest(format!("chunk_size: {e}")))?;
        let dir = Directory::new(config.directory());
        Ok(Self {
            config,
            hasher,
            views: Mutex::new(Views {
                dir,
                cursors: HashMap::new(),
                declarations: HashMap::new(),
                repairs: HashMap::new(),
            }),
            registry: registry::Instances::default(),
            repair_tx: Mutex::new(None),
            vllm: Mutex::new(None),
            replicate: Mutex::new(None),
            replica_id: {
                use std::hash::{BuildHasher, Hasher};
                let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                h.write_u128(
                    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()),
                );
                h.write_u32(std::process::id());
                h.finish()
            },
            control: Mutex::new(crate::control::Control::default()),
            stream_position: std::sync::atomic::AtomicU64::new(0),
            metrics: Arc::new(Metrics::new()),
        })
    }

    /// The settings.
    pub fn config(&self) -> &CoordinatorConfig {
        &self.config
    }
}

/// `http://ip:port` of a registered instance (an IPv6 address in brackets).
fn base_url_of(info: &InstanceInfo) -> String {
    let host = if info.ip.contains(':') { format!("[{}]", info.ip) } else { info.ip.clone() };
    format!("http://{host}:{}", info.http_port)
}

fn declare<B: events::IncomingBatch>(decls: &mut HashMap<String, Declaration>, b: &B, tier: Tier) {
    let (capacity, revision) = b.capacity();
    let stamp = (b.incarnation(), revision);
    let d = decls.entry(b.instance_id().to_string()).or_default();
    if stamp < d.stamp {
        return;
    }
    if stamp > d.stamp {
        d.compartments.clear();
        d.stamp = stamp;
    }
    d.compartments.insert((tier, b.backend().to_string(), b.shared()), capacity);
}

/// The object keys of chunks given by their hex hashes: chunk-major, one key per rank of a
/// world of `world_size`, object group 0 (LMCache's key resolver).
pub(crate) fn keys_of_chunks(
    hashes: &[String],
    model: &str,
    world_size: u32,
    salt: &str,
) -> Result<Vec<EncodedObjectKey>, FleetError> {
    let ranks: Vec<u32> = KvRank::all(world_size)
        .map_err(|e| FleetError::Invalid(format!("world_size: {e}")))?
        .map(KvRank::packed)
        .collect();
    Ok(hashes
        .iter()
        .flat_map(|h| {
            ranks.iter().map(move |&kv_rank| EncodedObjectKey {
                chunk_hash_hex: h.clone(),
                model_name: model.to_string(),
                kv_rank,
                object_group_id: 0,
                cache_salt: salt.to_string(),
            })
        })
        .collect())
}

fn namespace(k: KeyNamespace<'_>) -> Namespace {
    Namespace {
        model: Arc::from(k.model_name),
        kv_rank: k.kv_rank,
        object_group: k.object_group_id,
        cache_salt: Arc::from(k.cache_salt),
    }
}

fn encoded(hash: &[u8; 32], ns: &Namespace) -> EncodedObjectKey {
    EncodedObjectKey {
        chunk_hash_hex: hex::encode(hash),
        model_name: ns.model.to_string(),
        kv_rank: ns.kv_rank,
        object_group_id: ns.object_group,
        cache_salt: ns.cache_salt.to_string(),
    }
}
