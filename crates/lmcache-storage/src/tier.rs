//! [`L2Tier`]: the adapters under one L1, in priority order, with their runtime.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lmcache_core::{CacheSalt, ObjectKey};
use lmcache_l1::L1Cache;
use lmcache_l2::config::{self, BuiltAdapter};
use lmcache_l2::{ConfigError, L2Error};
use parking_lot::{Mutex, RwLock};
use serde_json::Value;
use tokio::runtime::Runtime;
use tokio::sync::{Notify, Semaphore, mpsc};

use crate::ledger::{Ledger, Usage, Victim};

/// What the store controller does after a successful L2 write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StorePolicy {
    /// Keep the object in L1 (L1 is a cache over L2).
    #[default]
    Default,
    /// Delete it from L1 once every adapter holds it (L1 is a write buffer).
    SkipL1,
}

/// Settings of the controllers.
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// Keys the write-behind queue holds; beyond it keys are dropped (counted).
    pub store_queue_keys: usize,
    /// Keys per store batch.
    pub store_batch: usize,
    /// Store batches in flight at once.
    pub store_concurrency: usize,
    /// Retries of a store that failed transiently.
    pub store_retries: u32,
    /// First retry delay (doubles each time).
    pub retry_backoff: Duration,
    /// Prefetch requests in flight at once.
    pub max_in_flight: usize,
    /// Time limit of one prefetch request.
    pub prefetch_deadline: Duration,
    /// After-store policy.
    pub store_policy: StorePolicy,
    /// Worker threads of the controllers' runtime.
    pub threads: usize,
    /// How long a store that can only make room in L1 by evicting objects the write-behind
    /// has not written yet waits for it before evicting them anyway (counted).
    pub write_behind_wait: Duration,
    /// How long a graceful shutdown waits for queued write-behind.
    pub flush_timeout: Duration,
    /// Directories fs and raw_block adapters must live in, at start and when added at run
    /// time (`--l2-allowed-root`); empty: no limit.
    pub allowed_roots: Vec<std::path::PathBuf>,
}

impl Default for TierConfig {
    fn default() -> Self {
        Self {
            store_queue_keys: 16 * 1024,
            store_batch: 64,
            store_concurrency: 4,
            store_retries: 3,
            retry_backoff: Duration::from_millis(50),
            max_in_flight: 8,
            prefetch_deadline: Duration::from_secs(5),
            store_policy: StorePolicy::Default,
            threads: 2,
            write_behind_wait: Duration::from_secs(2),
            flush_timeout: Duration::from_secs(10),
            allowed_roots: Vec::new(),
        }
    }
}

/// Counters of one adapter.
#[derive(Debug, Default)]
pub struct AdapterStats {
    /// Keys written.
    pub stored_keys: AtomicU64,
    /// Bytes written.
    pub stored_bytes: AtomicU64,
    /// Keys skipped because the adapter already held them.
    pub skipped_keys: AtomicU64,
    /// Keys whose store failed after retries.
    pub store_failures: AtomicU64,
    /// Keys asked in lookups.
    pub lookup_keys: AtomicU64,
    /// Of those, found.
    pub lookup_hits: AtomicU64,
    /// Keys loaded and verified.
    pub loaded_keys: AtomicU64,
    /// Bytes loaded (raw).
    pub loaded_bytes: AtomicU64,
    /// Loads that failed (errors, misses after a hit).
    pub load_failures: AtomicU64,
    /// Loaded blobs refused by verification (wrong KV never served).
    pub corrupt_blobs: AtomicU64,
    /// Operations that failed at the backend.
    pub errors: AtomicU64,
    /// Keys evicted (watermark passes and admissions).
    pub evicted_keys: AtomicU64,
    /// Bytes evicted.
    pub evicted_bytes: AtomicU64,
    /// Writes refused because their cache_salt's quota could not make room.
    pub quota_rejections: AtomicU64,
    /// Writes refused because the capacity could not make room.
    pub capacity_rejections: AtomicU64,
    /// Keys found in the backend at start (or when attached) and added to the ledger.
    pub seeded_keys: AtomicU64,
    /// Health pings that failed.
    pub ping_failures: AtomicU64,
    /// Times the adapter was marked down.
    pub marked_down: AtomicU64,
}

/// One attached adapter.
#[derive(Debug)]
pub struct AdapterSlot {
    /// Stable id: creation order, never reused.
    pub id: u64,
    /// The adapter and its codec.
    pub(crate) built: BuiltAdapter,
    /// Counters.
    pub stats: AdapterStats,
    /// What the tier knows the adapter holds: bytes per salt, eviction order, pins.
    pub ledger: Arc<Ledger>,
    healthy: AtomicBool,
    /// Operations failed in a row (reset by any success).
    op_failures: AtomicU32,
    /// Pings failed in a row.
    ping_failures: AtomicU32,
    /// Milliseconds since the tier started, of the last failure.
    last_failure_ms: AtomicU64,
    last_error: Mutex<Option<String>>,
    /// Whether the start-up scan has filled the ledger.
    seeded: AtomicBool,
}

/// While an adapter is down, one operation is let through this often (besides the pings).
const PROBE_EVERY: Duration = Duration::from_secs(1);
/// Operations failed in a row that mark an adapter down: one slow or failed batch never does.
pub const OP_FAILURES_DOWN: u32 = 5;
/// Pings failed in a row that mark an adapter down.
pub const PING_FAILURES_DOWN: u32 = 2;
/// How often every adapter is pinged.
pub const PING_EVERY: Duration = Duration::from_secs(1);
/// Keys read from a backend at start to seed its ledger, at most.
pub const SEED_LIMIT: usize = 4_000_000;
/// Time limit of the start-up scan of one backend.
pub const SEED_TIMEOUT: Duration = Duration::from_secs(120);

impl AdapterSlot {
    fn new(id: u64, built: BuiltAdapter) -> Self {
        let ledger = Arc::new(Ledger::new(built.capacity, built.eviction));
        Self {
            id,
            built,
            stats: AdapterStats::default(),
            ledger,
            healthy: AtomicBool::new(true),
            op_failures: AtomicU32::new(0),
            ping_failures: AtomicU32::new(0),
            last_failure_ms: AtomicU64::new(0),
            last_error: Mutex::new(None),
            seeded: AtomicBool::new(false),
        }
    }

    /// Whether the start-up scan of the backend has filled the ledger.
    pub fn seeded(&self) -> bool {
        self.seeded.load(Ordering::Relaxed)
    }

    fn mark_up(&self, why: &str) {
        if !self.healthy.swap(true, Ordering::Relaxed) {
            tracing::info!(adapter = self.id, kind = %self.built.kind, why, "L2 adapter is back");
        }
    }

    fn mark_down(&self, epoch: Instant, e: &L2Error, why: &str) {
        self.last_failure_ms.store(epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
        if self.healthy.swap(false, Ordering::Relaxed) {
            self.stats.marked_down.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(adapter = self.id, kind = %self.built.kind, error = %e, why,
                "L2 adapter down; its keys are misses until it answers again");
        }
    }

    /// A health ping answered.
    pub(crate) fn ping_ok(&self) {
        self.ping_failures.store(0, Ordering::Relaxed);
        if !self.healthy() {
            self.op_failures.store(0, Ordering::Relaxed);
            self.mark_up("ping answered");
        }
    }

    /// A health ping failed.
    pub(crate) fn ping_failed(&self, epoch: Instant, e: &L2Error) {
        self.stats.ping_failures.fetch_add(1, Ordering::Relaxed);
        *self.last_error.lock() = Some(format!("ping: {e}"));
        let n = self.ping_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= PING_FAILURES_DOWN {
            self.mark_down(epoch, e, "pings failed");
        }
    }

    /// Whether the backend answered its last operation.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Whether to send it work: healthy, or unhealthy long enough that a probe is due.
    pub(crate) fn usable(&self, epoch: Instant) -> bool {
        self.healthy()
            || epoch.elapsed().as_millis() as u64
                >= self.last_failure_ms.load(Ordering::Relaxed) + PROBE_EVERY.as_millis() as u64
    }

    /// An operation succeeded.
    pub(crate) fn ok(&self) {
        self.op_failures.store(0, Ordering::Relaxed);
        self.mark_up("operation succeeded");
    }

    /// An operation failed. Backend failures count towards [`OP_FAILURES_DOWN`]; one slow
    /// or failed batch never takes a healthy adapter out.
    pub(crate) fn failed(&self, epoch: Instant, e: &L2Error) {
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        if matches!(e, L2Error::Unavailable { .. } | L2Error::Io { .. } | L2Error::Transient { .. })
        {
            let n = self.op_failures.fetch_add(1, Ordering::Relaxed) + 1;
            if n >= OP_FAILURES_DOWN || !self.healthy() {
                self.mark_down(epoch, e, "operations failed");
            }
        }
        *self.last_error.lock() = Some(e.to_string());
    }

    /// What the ledger holds: bytes, keys, bytes per cache_salt.
    pub fn usage(&self) -> Usage {
        self.ledger.usage()
    }
}

/// Tier-wide counters.
#[derive(Debug, Default)]
pub struct TierStats {
    /// Keys handed to the write-behind queue.
    pub store_enqueued: AtomicU64,
    /// Keys dropped because the queue was full.
    pub store_dropped: AtomicU64,
    /// Keys skipped because L1 no longer held them when their turn came.
    pub store_vanished: AtomicU64,
    /// Keys deleted from L1 by the skip_l1 policy.
    pub l1_deleted_after_store: AtomicU64,
    /// Prefetch requests started.
    pub prefetch_requests: AtomicU64,
    /// Prefetch requests that hit their deadline.
    pub prefetch_expired: AtomicU64,
    /// Prefetch requests in flight now.
    pub prefetch_in_flight: AtomicU64,
    /// Keys loaded from L2 into L1.
    pub prefetch_loaded_keys: AtomicU64,
    /// Bytes loaded from L2 into L1.
    pub prefetch_loaded_bytes: AtomicU64,
    /// Loaded keys that could not be placed in L1 (no memory, or raced with a store).
    pub prefetch_l1_refused: AtomicU64,
}

/// Told when the controllers finish work, for event buses and logs. Called on the tier's
/// threads: implementations must be quick and must not block.
pub trait TierObserver: Send + Sync + std::fmt::Debug {
    /// A store batch to one adapter ended.
    fn stored(&self, _report: &StoreReport) {}
    /// A prefetch ended.
    fn prefetched(&self, _report: &PrefetchReport) {}
    /// A loaded blob failed verification and was treated as a miss.
    fn blob_refused(&self, _adapter: u64, _key: &ObjectKey, _reason: &str) {}
    /// Keys were evicted from an adapter (capacity, watermark or quota).
    fn evicted(&self, _adapter: u64, _keys: &[ObjectKey], _bytes: u64) {}
    /// Keys were deleted from an adapter on request (HTTP delete).
    fn deleted(&self, _adapter: u64, _keys: &[ObjectKey]) {}
}

/// One store batch to one adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreReport {
    /// Adapter id.
    pub adapter: u64,
    /// Adapter type.
    pub kind: String,
    /// Keys written.
    pub written: usize,
    /// Keys the adapter already held.
    pub skipped: usize,
    /// Keys that failed (after retries).
    pub failed: usize,
    /// Bytes written.
    pub bytes: u64,
    /// The keys the adapter holds after this batch because it wrote them (or found them
    /// already written), with their stored bytes.
    pub keys: Vec<(ObjectKey, u64)>,
}

/// One finished prefetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefetchReport {
    /// Chunks asked for (per shard).
    pub chunks: usize,
    /// Chunks servable on every shard afterwards.
    pub hits: usize,
    /// Objects loaded from L2.
    pub loaded_keys: usize,
    /// Bytes loaded from L2.
    pub loaded_bytes: u64,
    /// Whether the deadline cut it short.
    pub expired: bool,
}

/// A snapshot of one adapter, for status pages, metrics and logs: plain data, shown however
/// the caller likes (the server renders it as /status JSON).
#[derive(Debug, Clone)]
pub struct AdapterInfo {
    /// Id.
    pub id: u64,
    /// Type.
    pub kind: String,
    /// Whether it is up (see the health rules in [`AdapterSlot`]'s methods).
    pub healthy: bool,
    /// The last error, if any.
    pub last_error: Option<String>,
    /// Codec name.
    pub codec: &'static str,
    /// The configuration as given (secrets masked).
    pub spec: Value,
    /// The backend's own settings (never secrets).
    pub backend: Value,
    /// Capacity in bytes, if bounded.
    pub capacity: Option<u64>,
    /// What the ledger holds.
    pub usage: Usage,
    /// Whether the start-up scan has filled the ledger.
    pub seeded: bool,
    /// The eviction settings, if configured.
    pub eviction: Option<lmcache_l2::config::EvictionSpec>,
    /// The counters.
    pub counters: AdapterCounters,
}

/// The counters of one adapter at one moment (see [`AdapterStats`] for each meaning).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[expect(missing_docs, reason = "each field is the `AdapterStats` counter of the same name")]
pub struct AdapterCounters {
    pub stored_keys: u64,
    pub stored_bytes: u64,
    pub skipped_keys: u64,
    pub store_failures: u64,
    pub lookup_keys: u64,
    pub lookup_hits: u64,
    pub loaded_keys: u64,
    pub loaded_bytes: u64,
    pub load_failures: u64,
    pub corrupt_blobs: u64,
    pub errors: u64,
    pub evicted_keys: u64,
    pub evicted_bytes: u64,
    pub quota_rejections: u64,
    pub capacity_rejections: u64,
    pub seeded_keys: u64,
    pub ping_failures: u64,
    pub marked_down: u64,
}

impl AdapterStats {
    /// The counters now.
    pub fn snapshot(&self) -> AdapterCounters {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        AdapterCounters {
            stored_keys: g(&self.stored_keys),
            stored_bytes: g(&self.stored_bytes),
            skipped_keys: g(&self.skipped_keys),
            store_failures: g(&self.store_failures),
            lookup_keys: g(&self.lookup_keys),
            lookup_hits: g(&self.lookup_hits),
            loaded_keys: g(&self.loaded_keys),
            loaded_bytes: g(&self.loaded_bytes),
            load_failures: g(&self.load_failures),
            corrupt_blobs: g(&self.corrupt_blobs),
            errors: g(&self.errors),
            evicted_keys: g(&self.evicted_keys),
            evicted_bytes: g(&self.evicted_bytes),
            quota_rejections: g(&self.quota_rejections),
            capacity_rejections: g(&self.capacity_rejections),
            seeded_keys: g(&self.seeded_keys),
            ping_failures: g(&self.ping_failures),
            marked_down: g(&self.marked_down),
        }
    }
}

/// State shared with the controllers' tasks (never the runtime itself).
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) l1: L1Cache,
    pub(crate) adapters: RwLock<Vec<Arc<AdapterSlot>>>,
    pub(crate) config: TierConfig,
    pub(crate) stats: TierStats,
    pub(crate) epoch: Instant,
    pub(crate) prefetch_slots: Arc<Semaphore>,
    pub(crate) store_slots: Arc<Semaphore>,
    pub(crate) observer: RwLock<Option<Arc<dyn TierObserver>>>,
    /// L2 quotas per cache_salt, in bytes.
    pub(crate) quotas: RwLock<HashMap<CacheSalt, u64>>,
    /// Wakes the eviction task as soon as an adapter crosses its watermark.
    pub(crate) evict_now: Notify,
    /// Keys the write-behind is done with (written or given up), and its condition variable:
    /// stores waiting for L1 room and shutdown flushes wait on it.
    pub(crate) processed: Mutex<u64>,
    pub(crate) progress: parking_lot::Condvar,
    /// The same wake-up for tasks on the tier's runtime (a prefetch waiting for L1 room).
    pub(crate) progress_wake: Notify,
    next_id: AtomicU64,
    /// Element types of the layouts registered so far: adapters added later bind them too.
    dtypes: Mutex<Vec<lmcache_core::Dtype>>,
}

impl Shared {
    pub(crate) fn observe(&self, f: impl FnOnce(&dyn TierObserver)) {
        if let Some(o) = self.observer.read().as_ref() {
            f(o.as_ref());
        }
    }
}

impl Shared {
    /// The adapters in priority order.
    pub(crate) fn slots(&self) -> Vec<Arc<AdapterSlot>> {
        self.adapters.read().clone()
    }

    /// The L2 quota of `salt`, if one is set.
    pub(crate) fn quota(&self, salt: &CacheSalt) -> Option<u64> {
        self.quotas.read().get(salt).copied()
    }

    /// Deletes eviction victims from one adapter and settles them in its ledger (put back
    /// if the delete failed).
    pub(crate) async fn delete_victims(&self, slot: &AdapterSlot, victims: Vec<Victim>) {
        if victims.is_empty() {
            return;
        }
        let keys: Vec<ObjectKey> = victims.iter().map(|v| v.key.clone()).collect();
        match slot.built.adapter.delete(&keys).await {
            Ok(_) => {
                slot.ok();
                slot.ledger.evicted(&victims, true);
                let bytes: u64 = victims.iter().map(|v| v.bytes).sum();
                slot.stats.evicted_keys.fetch_add(keys.len() as u64, Ordering::Relaxed);
                slot.stats.evicted_bytes.fetch_add(bytes, Ordering::Relaxed);
                tracing::debug!(adapter = slot.id, keys = keys.len(), bytes, "L2 eviction");
                self.observe(|o| o.evicted(slot.id, &keys, bytes));
            }
            Err(e) => {
                tracing::warn!(adapter = slot.id, error = %e, keys = keys.len(),
                    "L2 eviction failed; the keys stay in the ledger");
                slot.failed(self.epoch, &e);
                slot.ledger.evicted(&victims, false);
            }
        }
    }

    /// One watermark and quota pass over every adapter.
    async fn evict_pass(&self) {
        let quotas = self.quotas.read().clone();
        for slot in self.slots() {
            let victims = slot.ledger.pass(&quotas);
            self.delete_victims(&slot, victims).await;
        }
    }
}

/// Evicts when an adapter crosses its watermark (woken by the store path) and once a second
/// (quota changes, seeded ledgers).
async fn evict_loop(shared: Arc<Shared>) {
    loop {
        tokio::select! {
            () = shared.evict_now.notified() => {}
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        shared.evict_pass().await;
    }
}

/// Pings every adapter once a second: health comes from pings and repeated failures, never
/// from one slow batch.
async fn health_loop(shared: Arc<Shared>) {
    loop {
        tokio::time::sleep(PING_EVERY).await;
        for slot in shared.slots() {
            let r = tokio::time::timeout(PING_EVERY * 2, slot.built.adapter.ping()).await;
            match r {
                Ok(Ok(())) => slot.ping_ok(),
                Ok(Err(e)) => slot.ping_failed(shared.epoch, &e),
                Err(_) => slot.ping_failed(
                    shared.epoch,
                    &L2Error::transient(format!("ping over {:?}", PING_EVERY * 2)),
                ),
            }
        }
    }
}

/// Fills an adapter's ledger from what its backend already holds (bounded in keys and time).
async fn seed(shared: Arc<Shared>, slot: Arc<AdapterSlot>) {
    let started = Instant::now();
    match tokio::time::timeout(SEED_TIMEOUT, slot.built.adapter.scan(SEED_LIMIT)).await {
        Ok(Ok(items)) => {
            let n = slot.ledger.seed(&items);
            slot.stats.seeded_keys.fetch_add(n as u64, Ordering::Relaxed);
            let u = slot.ledger.usage();
            tracing::info!(adapter = slot.id, kind = %slot.built.kind, keys = n, bytes = u.used,
                capped = items.len() >= SEED_LIMIT, secs = started.elapsed().as_secs_f64(),
                "L2 ledger seeded from the backend");
            shared.evict_now.notify_one();
        }
        Ok(Err(L2Error::Unsupported { .. })) => {}
        Ok(Err(e)) => tracing::warn!(adapter = slot.id, error = %e,
            "L2 start-up scan failed; usage counts only what this server writes"),
        Err(_) => tracing::warn!(adapter = slot.id, "L2 start-up scan timed out"),
    }
    slot.seeded.store(true, Ordering::Relaxed);
}

/// The controllers' runtime. Dropped without blocking, so that the last owner may let go of
/// it anywhere, even on one of its own threads.
#[derive(Debug)]
pub(crate) struct Rt(Option<Runtime>);

impl std::ops::Deref for Rt {
    type Target = Runtime;
    fn deref(&self) -> &Runtime {
        // Only Drop takes the runtime out.
        self.0.as_ref().unwrap_or_else(|| unreachable!("runtime used after drop"))
    }
}

impl Drop for Rt {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Adapters added at run time (over HTTP) never load a native plugin: that runs a library's
/// code, which only `--l2-adapter` at start may ask for.
fn refuse_native_code(index: usize, spec: &Value) -> Result<(), ConfigError> {
    if config::loads_native_code(spec) {
        let mut e = ConfigError::field(
            "type",
            "native_plugin adapters are loaded only at start (--l2-adapter): loading a library \
             runs its code",
        );
        e.index = index;
        e.kind = "native_plugin".into();
        return Err(e);
    }
    Ok(())
}

/// The L2 tier under one L1. Cheap to clone.
#[derive(Debug, Clone)]
pub struct L2Tier {
    pub(crate) shared: Arc<Shared>,
    pub(crate) rt: Arc<Rt>,
    pub(crate) store_tx: mpsc::Sender<ObjectKey>,
}

impl L2Tier {
    /// Builds every adapter of `specs` (connecting to each backend; any failure names the
    /// adapter and field) and starts the controllers.
    pub fn start(l1: L1Cache, specs: &[Value], config: TierConfig) -> Result<Self, ConfigError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads.max(1))
            .thread_name("lmcache-l2")
            .enable_all()
            .build()
            .map_err(|e| {
                ConfigError::field("l2-adapter", format!("cannot start the L2 runtime: {e}"))
            })?;
        let mut built = Vec::new();
        for (i, s) in specs.iter().enumerate() {
            config::check_allowed_paths(i, s, &config.allowed_roots)?;
            built.push(rt.block_on(config::build(i, s))?);
        }
        let (tx, rx) = mpsc::channel(config.store_queue_keys.max(1));
        let shared = Arc::new(Shared {
            l1,
            adapters: RwLock::new(Vec::new()),
            prefetch_slots: Arc::new(Semaphore::new(config.max_in_flight.max(1))),
            store_slots: Arc::new(Semaphore::new(config.store_concurrency.max(1))),
            config,
            stats: TierStats::default(),
            epoch: Instant::now(),
            observer: RwLock::new(None),
            quotas: RwLock::new(HashMap::new()),
            evict_now: Notify::new(),
            processed: Mutex::new(0),
            progress: parking_lot::Condvar::new(),
            progress_wake: Notify::new(),
            next_id: AtomicU64::new(0),
            dtypes: Mutex::new(Vec::new()),
        });
        for b in built {
            let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
            let slot = Arc::new(AdapterSlot::new(id, b));
            warn_isolated(&slot);
            shared.adapters.write().push(slot.clone());
            rt.spawn(seed(shared.clone(), slot));
        }
        rt.spawn(crate::store::run(shared.clone(), rx));
        rt.spawn(evict_loop(shared.clone()));
        rt.spawn(health_loop(shared.clone()));
        Ok(Self { shared, rt: Arc::new(Rt(Some(rt))), store_tx: tx })
    }

    /// Installs the observer told of finished stores and prefetches.
    pub fn set_observer(&self, observer: Arc<dyn TierObserver>) {
        *self.shared.observer.write() = Some(observer);
    }

    /// Whether any adapter is attached.
    pub fn is_empty(&self) -> bool {
        self.shared.adapters.read().is_empty()
    }

    /// Number of adapters.
    pub fn len(&self) -> usize {
        self.shared.adapters.read().len()
    }

    /// Tier counters.
    pub fn stats(&self) -> &TierStats {
        &self.shared.stats
    }

    /// The controllers' settings.
    pub fn config(&self) -> &TierConfig {
        &self.shared.config
    }

    /// The attached adapters in priority order.
    pub(crate) fn slots(&self) -> Vec<Arc<AdapterSlot>> {
        self.shared.slots()
    }

    /// Builds and attaches an adapter at the lowest priority; returns its id. Blocks the
    /// calling thread (call it off any async runtime, or use [`Self::add_adapter_async`]).
    pub fn add_adapter(&self, spec: &Value) -> Result<u64, ConfigError> {
        let index = self.len();
        refuse_native_code(index, spec)?;
        config::check_allowed_paths(index, spec, &self.shared.config.allowed_roots)?;
        let built =
            std::thread::scope(|s| s.spawn(|| self.rt.block_on(config::build(index, spec))).join())
                .map_err(|_| ConfigError::field("l2-adapter", "adapter construction panicked"))??;
        self.attach(built)
    }

    /// As [`Self::add_adapter`], awaited from any async runtime: the backend is connected on
    /// the tier's own runtime.
    pub async fn add_adapter_async(&self, spec: Value) -> Result<u64, ConfigError> {
        let index = self.len();
        refuse_native_code(index, &spec)?;
        config::check_allowed_paths(index, &spec, &self.shared.config.allowed_roots)?;
        let built = self
            .on_tier(async move { config::build(index, &spec).await })
            .await
            .map_err(|e| ConfigError::field("l2-adapter", e.to_string()))??;
        self.attach(built)
    }

    /// Binds a registered layout's element type to every adapter's codec (fp8 quantizes by
    /// it), all or none: `Err((adapter id, kind, reason))` when one cannot serve it.
    pub fn bind_dtype(&self, dtype: lmcache_core::Dtype) -> Result<(), (u64, String, String)> {
        let adapters = self.slots();
        for dry_run in [true, false] {
            for s in &adapters {
                s.built
                    .codec
                    .bind_dtype(dtype, dry_run)
                    .map_err(|r| (s.id, s.built.kind.clone(), r))?;
            }
        }
        let mut d = self.shared.dtypes.lock();
        if !d.contains(&dtype) {
            d.push(dtype);
        }
        Ok(())
    }

    fn attach(&self, built: BuiltAdapter) -> Result<u64, ConfigError> {
        // An adapter added at run time serves the layouts already registered.
        for &d in self.shared.dtypes.lock().iter() {
            built.codec.bind_dtype(d, false).map_err(|r| ConfigError::field("serde", r))?;
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(AdapterSlot::new(id, built));
        warn_isolated(&slot);
        self.shared.adapters.write().push(slot.clone());
        self.rt.spawn(seed(self.shared.clone(), slot));
        tracing::info!(id, "L2 adapter added");
        Ok(id)
    }

    /// Detaches adapter `id` (in-flight operations on it finish; new ones go elsewhere) and
    /// closes it. Returns false if no such adapter.
    pub fn remove_adapter(&self, id: u64) -> bool {
        let removed = {
            let mut a = self.shared.adapters.write();
            let pos = a.iter().position(|s| s.id == id);
            pos.map(|p| a.remove(p))
        };
        match removed {
            Some(slot) => {
                let ad = slot.built.adapter.clone();
                self.rt.spawn(async move { ad.close().await });
                tracing::info!(id, "L2 adapter removed");
                true
            }
            None => false,
        }
    }

    /// Sets (or with `None` removes) the L2 quota of `salt`, in bytes, for every adapter.
    /// It applies at the next admission and within a second to what is already stored.
    pub fn set_quota(&self, salt: &CacheSalt, limit: Option<u64>) {
        {
            let mut q = self.shared.quotas.write();
            match limit {
                Some(l) => q.insert(salt.clone(), l),
                None => q.remove(salt),
            };
        }
        self.shared.evict_now.notify_one();
    }

    /// The L2 quota of `salt`, if set.
    pub fn quota(&self, salt: &CacheSalt) -> Option<u64> {
        self.shared.quota(salt)
    }

    /// Every L2 quota, sorted by salt.
    pub fn quotas(&self) -> Vec<(CacheSalt, u64)> {
        let mut v: Vec<_> =
            self.shared.quotas.read().iter().map(|(k, v)| (k.clone(), *v)).collect();
        v.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        v
    }

    /// Bytes held under `salt` across adapters.
    pub fn usage_of(&self, salt: &CacheSalt) -> u64 {
        self.slots()
            .iter()
            .map(|a| a.usage().by_salt.iter().find(|(s, _)| s == salt).map_or(0, |(_, b)| *b))
            .sum()
    }

    pub(crate) fn slot(&self, id: u64) -> Option<Arc<AdapterSlot>> {
        self.slots().into_iter().find(|a| a.id == id)
    }

    /// Runs `fut` on the tier's runtime and awaits it from any runtime (one hop).
    async fn on_tier<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Result<T, L2Error> {
        self.rt.spawn(fut).await.map_err(|e| L2Error::transient(format!("L2 task: {e}")))
    }

    /// Deletes `keys` from adapter `id` (every adapter if `None`) and from its ledger;
    /// returns how many were held. Callable from any async runtime.
    ///
    /// Every adapter asked is tried, even after one fails (the others' copies still go);
    /// the first failure is returned with the adapter's id and type.
    pub async fn delete(
        &self,
        id: Option<u64>,
        keys: Vec<ObjectKey>,
    ) -> Result<u64, (Option<(u64, String)>, L2Error)> {
        let slots: Vec<_> =
            self.slots().into_iter().filter(|a| id.is_none_or(|i| a.id == i)).collect();
        let shared = Arc::clone(&self.shared);
        let done = self.on_tier(async move {
            let mut total = 0;
            let mut failed = None;
            for slot in slots {
                match slot.built.adapter.delete(&keys).await {
                    Ok(n) => {
                        total += n;
                        slot.ledger.forget(&keys);
                        shared.observe(|o| o.deleted(slot.id, &keys));
                    }
                    Err(e) => {
                        tracing::warn!(id = slot.id, error = %e, "L2 delete failed");
                        failed.get_or_insert((Some((slot.id, slot.built.kind.clone())), e));
                    }
                }
            }
            match failed {
                None => Ok(total),
                Some(f) => Err(f),
            }
        });
        done.await.map_err(|e| (None, e))?
    }

    /// One page of adapter `id`'s keys that pass `filter`, or `None` if there is no such
    /// adapter. Callable from any async runtime.
    pub async fn list(
        &self,
        id: u64,
        filter: lmcache_l2::KeyFilter,
        cursor: Option<String>,
        limit: usize,
    ) -> Option<Result<lmcache_l2::KeyPage, L2Error>> {
        let slot = self.slot(id)?;
        let page = self.on_tier(async move {
            slot.built.adapter.list(&filter, cursor.as_deref(), limit).await
        });
        Some(page.await.and_then(|r| r))
    }

    /// Waits until the write-behind finishes a batch, or `timeout`. Returns false on timeout.
    pub fn wait_progress(&self, timeout: Duration) -> bool {
        let mut p = self.shared.processed.lock();
        let before = *p;
        let deadline = Instant::now() + timeout;
        while *p == before {
            if self.shared.progress.wait_until(&mut p, deadline).timed_out() {
                return false;
            }
        }
        true
    }

    /// Waits until every key queued so far has been written (or given up on), at most
    /// `timeout`. Returns the keys still pending (0: flushed).
    pub fn flush(&self, timeout: Duration) -> u64 {
        let target = self.shared.stats.store_enqueued.load(Ordering::Relaxed);
        let deadline = Instant::now() + timeout;
        let mut p = self.shared.processed.lock();
        while *p < target {
            if self.shared.progress.wait_until(&mut p, deadline).timed_out() {
                break;
            }
        }
        target.saturating_sub(*p)
    }

    /// One adapter's view, or all.
    pub fn describe(&self) -> Vec<AdapterInfo> {
        self.slots().iter().map(|s| describe_slot(s)).collect()
    }

    /// Runs a future on the tier's runtime from a plain thread.
    pub fn block_on<F: std::future::Future + Send>(&self, f: F) -> F::Output
    where
        F::Output: Send,
    {
        std::thread::scope(|s| s.spawn(|| self.rt.block_on(f)).join())
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    }

    /// Closes every adapter (checkpoints, connections). Queued stores not yet written are
    /// dropped.
    pub fn shutdown(&self) {
        let adapters = self.slots();
        self.block_on(async move {
            for a in adapters {
                a.built.adapter.close().await;
            }
        });
    }
}

fn warn_isolated(slot: &AdapterSlot) {
    if slot.ledger.quota_required() {
        tracing::warn!(
            adapter = slot.id,
            "IsolatedLRU: a cache_salt without an L2 quota keeps nothing in this adapter \
             (LMCache's allowlist); set quotas with PUT /quota/{{salt}}?tier=l2"
        );
    }
}

pub(crate) fn describe_slot(s: &AdapterSlot) -> AdapterInfo {
    AdapterInfo {
        id: s.id,
        kind: s.built.kind.clone(),
        healthy: s.healthy(),
        last_error: s.last_error.lock().clone(),
        codec: s.built.codec.name(),
        spec: s.built.spec.clone(),
        backend: s.built.adapter.describe(),
        capacity: s.ledger.capacity(),
        usage: s.usage(),
        seeded: s.seeded(),
        eviction: s.ledger.eviction(),
        counters: s.stats.snapshot(),
    }
}
