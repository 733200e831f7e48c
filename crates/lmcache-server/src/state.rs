//! The state requests share: [`RequestState`], all a handler sees, inside [`ServerState`],
//! which adds the side channels.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_core::{CacheSalt, ChunkHash, KvRank, ModelName, ObjectKey, ObjectShape, TokenHasher};
use lmcache_l1::{L1Cache, LeaseId, ReadLease};
use lmcache_protocol::ProtocolError;
use lmcache_protocol::types::CacheKey;
use lmcache_storage::RequestContext;
use parking_lot::Mutex;

use crate::config::ServerConfig;
use crate::kv_events::KvEventLog;
use crate::metrics::Metrics;
use crate::registry::Registry;
use crate::session::{Session, Sessions};

/// Identity of an engine-driven transfer between its prepare and commit messages:
/// `(instance, request, key identity)`, where the chunk hashes stand for the token list. The
/// request is part of it: two requests of one instance over the same tokens never complete,
/// release or replace each other's reservations and leases.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PendingKey {
    instance_id: u64,
    request_id: String,
    model: ModelName,
    world_size: u32,
    worker_id: Option<u32>,
    cache_salt: CacheSalt,
    start: usize,
    end: usize,
    last_hash: Option<ChunkHash>,
}

impl PendingKey {
    /// The pending-transfer key of `key` for `instance_id`.
    pub fn new(instance_id: u64, key: &CacheKey, hashes: &[ChunkHash]) -> Self {
        Self {
            instance_id,
            request_id: key.request_id.clone(),
            model: key.model_name.clone(),
            world_size: key.world_size,
            worker_id: key.worker_id,
            cache_salt: key.cache_salt.clone(),
            start: key.start,
            end: key.end,
            last_hash: hashes.last().copied(),
        }
    }
}

/// What `prepare_retrieve` left for `commit_retrieve`: the parked leases, or `None` when it
/// failed after spending the lookup's locks (so the commit must not release them again).
pub type PreparedRetrieve = Option<Vec<LeaseId>>;

/// Parked handles of transfers between prepare and commit.
/// What an engine-driven `prepare_store` left for its `commit_store`.
#[derive(Debug)]
pub struct PendingStore {
    /// When prepared.
    pub since: Instant,
    /// The write reservations handed to the client.
    pub leases: Vec<LeaseId>,
}

/// Engine-driven transfers between their prepare and their commit.
#[derive(Debug, Default)]
pub struct Pending {
    /// Write reservations of `prepare_store`.
    pub stores: Mutex<HashMap<PendingKey, PendingStore>>,
    /// Read leases of `prepare_retrieve`.
    pub retrieves: Mutex<HashMap<PendingKey, (Instant, PreparedRetrieve)>>,
}

impl Pending {
    /// Forgets entries older than `ttl` (their handles have expired from the lease tables).
    pub fn reap(&self, now: Instant, ttl: Duration) {
        self.stores.lock().retain(|_, p| now.duration_since(p.since) < ttl);
        self.retrieves.lock().retain(|_, (t, _)| now.duration_since(*t) < ttl);
    }
}

/// What a request handler can reach: settings, sessions, registered workers, parked
/// engine-driven transfers, and storage. Nothing else: the side channels (metrics, the event
/// bus, KV events, the coordinator reporter, trace and lookup-hash logs) subscribe to
/// storage's events ([`crate::observers`]), so a handler that wanted to feed one by hand has
/// no field to do it with.
#[derive(Debug)]
pub struct RequestState {
    /// Settings.
    pub(crate) config: ServerConfig,
    /// Token hasher (chunk size of the server).
    pub(crate) hasher: TokenHasher,
    /// Request sessions.
    pub(crate) sessions: Sessions,
    /// Registered workers.
    pub(crate) registry: Registry,
    /// Engine-driven transfers in flight.
    pub(crate) pending: Pending,
    /// P2P lookups' answers and the locks they hold for peers.
    pub(crate) peers: Arc<crate::peer_locks::PeerLocks>,
    /// The CacheBlend engine, with `--engine-type blend`.
    pub(crate) blend: Option<Arc<crate::blend::BlendEngine>>,
    /// L1 and L2: the one owner of both tiers, and the one source of what requests did.
    /// Stores reserve and commit through it (the commit queues the write-behind), lookups
    /// and retrieves lock and spend through it, and HTTP lists, deletes, sets quotas and
    /// attaches adapters through it.
    pub storage: lmcache_storage::Storage,
}

/// The server's shared state: a [`RequestState`] (it derefs to one) and what the handlers
/// never see. Its public surface is what operators and tests observe: storage, the metrics
/// and the event bus.
#[derive(Debug)]
pub struct ServerState {
    /// What handlers see.
    pub(crate) requests: RequestState,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Typed events for subscribers (logging); never blocks a request.
    pub bus: crate::event_bus::EventBus,
    /// The side channels storage's subscribers feed, as the transport, HTTP and shutdown
    /// reach them.
    pub(crate) channels: SideChannels,
    /// HTTP's own jobs.
    pub(crate) http: HttpJobs,
    /// Start time.
    pub(crate) started: Instant,
    /// Fault hooks for tests (feature `testing`).
    #[cfg(feature = "testing")]
    pub faults: Faults,
}

/// The side channels beside the metrics and the bus, each also held by its storage subscriber
/// ([`crate::observers`]).
#[derive(Debug)]
pub(crate) struct SideChannels {
    /// KV events for `subscribe_kv_events` (the transport streams them).
    pub(crate) kv_events: Arc<KvEventLog>,
    /// Reporting to a fleet coordinator, when `--coordinator-url` is set.
    pub(crate) reporter: Option<Arc<crate::fleet_report::Reporter>>,
    /// The lookup-hash log, when `--lookup-hash-log-dir` is set.
    pub(crate) lookup_log: Option<Arc<crate::lookup_log::LookupHashLog>>,
    /// The trace recorder, when `--trace-level` is set (closed at shutdown).
    pub(crate) trace: Option<Arc<crate::trace_record::TraceRecorder>>,
    /// "Why was this a miss?" (`GET /cache/requests/{id}/explain`).
    pub(crate) explain: Arc<crate::explain::Explainer>,
}

/// What HTTP keeps between calls.
#[derive(Debug, Default)]
pub(crate) struct HttpJobs {
    /// Prefetches asked over HTTP: request id → `None` while running, then
    /// `(found_keys, total_keys)` until polled once.
    pub(crate) prefetches: Mutex<HashMap<String, Option<(usize, usize)>>>,
    /// Frozen key lists of `GET /fleet/snapshot`.
    pub(crate) snapshots: crate::http::fleet::Snapshots,
    /// The status page's last minutes (`GET /status/history`).
    pub(crate) history: crate::http::history::History,
}

impl std::ops::Deref for ServerState {
    type Target = RequestState;

    fn deref(&self) -> &RequestState {
        &self.requests
    }
}

/// Test hooks (feature `testing` only): where a test makes the server panic, by operation
/// name, and a copy of every event the bus delivered.
#[cfg(feature = "testing")]
#[derive(Debug, Default)]
pub struct Faults {
    /// Inside the handler of this operation.
    pub panic_in_handler: Mutex<Option<&'static str>>,
    /// Around the handler of this operation (after it answered, while the reply is built).
    pub panic_after_handler: Mutex<Option<&'static str>>,
    /// Every event the bus's subscribers heard, in order.
    pub bus_heard: Arc<Mutex<Vec<crate::event_bus::Event>>>,
}

impl RequestState {
    /// The L1 tier (for L1-only operations: the arena, parked handles, usage).
    pub fn l1(&self) -> &L1Cache {
        self.storage.l1()
    }

    /// The CacheBlend engine, when the server runs one.
    pub fn blend(&self) -> Option<&crate::blend::BlendEngine> {
        self.blend.as_deref()
    }

    /// Chunk size in tokens.
    pub fn chunk_size(&self) -> usize {
        self.hasher.chunk_size()
    }

    /// Object keys of `hashes` for one shard.
    pub fn object_keys(
        &self,
        key: &CacheKey,
        worker_id: u32,
        hashes: &[ChunkHash],
        object_group_id: u32,
    ) -> Result<Vec<ObjectKey>, ProtocolError> {
        let kv_rank = KvRank::new(key.world_size, worker_id).map_err(|e| {
            ProtocolError::OutOfRange { field: "key.worker_id".into(), reason: e.to_string() }
        })?;
        Ok(hashes
            .iter()
            .map(|h| ObjectKey {
                chunk_hash: *h,
                model_name: key.model_name.clone(),
                kv_rank,
                object_group_id,
                cache_salt: key.cache_salt.clone(),
            })
            .collect())
    }

    /// The chunk hashes of `key`'s range `[start, end)` (whole chunks), computed through the
    /// request's session. Returns `(first chunk index, hashes)`.
    pub fn range_hashes(&self, key: &CacheKey) -> (usize, Vec<ChunkHash>) {
        let (first, hashes, _) = self.range_hashes_with_parent(key);
        (first, hashes)
    }

    /// As [`Self::range_hashes`], plus the hash of the chunk before the range (`None` when
    /// the range starts at chunk 0).
    pub fn range_hashes_with_parent(
        &self,
        key: &CacheKey,
    ) -> (usize, Vec<ChunkHash>, Option<ChunkHash>) {
        let c = self.chunk_size();
        let first = key.start / c;
        let last = key.end / c;
        let all = self.sessions.with(&key.request_id, |s| s.chunk_hashes(&key.token_ids, last));
        let parent = first.checked_sub(1).and_then(|p| all.get(p).copied());
        let hashes = all.get(first..).map(<[ChunkHash]>::to_vec).unwrap_or_default();
        (first, hashes, parent)
    }

    /// Releases one shard's lookup locks of chunks `range` (a retrieve that failed before
    /// spending them). A prefetch of that lookup that has ended is joined first, so its leases
    /// are the ones released.
    pub fn release_lookup_locks(
        &self,
        request_id: &str,
        shard: usize,
        range: std::ops::Range<usize>,
    ) {
        drop(self.spend_lookup_locks(request_id, shard, range));
    }

    /// One lock of shard `shard` on chunks `range` from the request's lookup (after joining
    /// its prefetch if it ended), as the retrieve of those chunks spends them; `None` where
    /// the lookup holds none. Empty without a session.
    pub fn spend_lookup_locks(
        &self,
        request_id: &str,
        shard: usize,
        range: std::ops::Range<usize>,
    ) -> Vec<Option<ReadLease>> {
        let n = range.len();
        self.with_settled(request_id, |s| {
            s.lookup.leases_mut().map(|l| l.take_one(shard, range.clone()))
        })
        .flatten()
        .unwrap_or_else(|| (0..n).map(|_| None).collect())
    }

    /// Runs `f` on the request's existing session (`None` if there is none), after joining
    /// the last lookup's prefetch if it has ended (storage announces what it added, once).
    pub fn with_settled<R>(
        &self,
        request_id: &str,
        f: impl FnOnce(&mut Session) -> R,
    ) -> Option<R> {
        self.sessions.with_existing(request_id, |s| {
            s.settle(&self.storage, request_id);
            f(s)
        })
    }

    /// The context storage announces a request's calls with: `key`'s range on shard `shard`.
    pub fn context<'a>(
        &self,
        key: &'a CacheKey,
        shard: u32,
        first_chunk: usize,
        hashes: &'a [ChunkHash],
        parent: Option<ChunkHash>,
        objects: &'a [ObjectShape],
    ) -> RequestContext<'a> {
        RequestContext {
            request_id: &key.request_id,
            model: &key.model_name,
            shard,
            chunk_size: self.chunk_size(),
            first_chunk,
            hashes,
            parent,
            tokens: &key.token_ids,
            objects,
        }
    }
}
