//! [`L2Tier`]: the adapters under one L1, in priority order, with their runtime.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lmcache_core::{CacheSalt, ObjectKey};
use lmcache_l1::L1Cache;
use lmcache_l2::config::{self, BuiltAdapter};
use lmcache_l2::{ConfigError, L2Error};
use parking_lot::{Mutex, RwLock};
use serde_json::{Value, json};
use tokio::runtime::Runtime;
use tokio::sync::{Semaphore, mpsc};

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
}

/// One attached adapter.
#[derive(Debug)]
pub struct AdapterSlot {
    /// Stable id: creation order, never reused.
    pub id: u64,
    /// The adapter and its codec.
    pub built: BuiltAdapter,
    /// Counters.
    pub stats: AdapterStats,
    healthy: AtomicBool,
    /// Milliseconds since the tier started, of the last failure.
    last_failure_ms: AtomicU64,
    last_error: Mutex<Option<String>>,
    usage: Mutex<HashMap<CacheSalt, u64>>,
}

const PROBE_EVERY: Duration = Duration::from_secs(1);

impl AdapterSlot {
    fn new(id: u64, built: BuiltAdapter) -> Self {
        Self {
            id,
            built,
            stats: AdapterStats::default(),
            healthy: AtomicBool::new(true),
            last_failure_ms: AtomicU64::new(0),
            last_error: Mutex::new(None),
            usage: Mutex::new(HashMap::new()),
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

    pub(crate) fn ok(&self) {
        if !self.healthy.swap(true, Ordering::Relaxed) {
            tracing::info!(adapter = self.id, kind = %self.built.kind, "L2 adapter is back");
        }
    }

    pub(crate) fn failed(&self, epoch: Instant, e: &L2Error) {
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        if matches!(e, L2Error::Unavailable(_) | L2Error::Io(_) | L2Error::Transient(_)) {
            self.last_failure_ms.store(epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
            if self.healthy.swap(false, Ordering::Relaxed) {
                tracing::warn!(adapter = self.id, kind = %self.built.kind, error = %e,
                    "L2 adapter failing; its keys are misses until it answers again");
            }
        }
        *self.last_error.lock() = Some(e.to_string());
    }

    pub(crate) fn account(&self, salt: &CacheSalt, bytes: i64) {
        let mut u = self.usage.lock();
        let e = u.entry(salt.clone()).or_insert(0);
        *e = e.saturating_add_signed(bytes);
    }

    /// Bytes this server wrote, per cache_salt.
    pub fn usage(&self) -> Vec<(CacheSalt, u64)> {
        let mut v: Vec<_> = self.usage.lock().iter().map(|(k, v)| (k.clone(), *v)).collect();
        v.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        v
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

/// A view of one adapter for /status and metrics.
#[derive(Debug, Clone)]
pub struct AdapterInfo {
    /// Id.
    pub id: u64,
    /// Type.
    pub kind: String,
    /// Whether its last operation succeeded.
    pub healthy: bool,
    /// Counters and settings as JSON.
    pub detail: Value,
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
    next_id: AtomicU64,
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
    pub(crate) fn adapters(&self) -> Vec<Arc<AdapterSlot>> {
        self.adapters.read().clone()
    }
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
            next_id: AtomicU64::new(0),
        });
        for b in built {
            let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
            shared.adapters.write().push(Arc::new(AdapterSlot::new(id, b)));
        }
        rt.spawn(crate::store::run(shared.clone(), rx));
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
    pub fn adapters(&self) -> Vec<Arc<AdapterSlot>> {
        self.shared.adapters()
    }

    /// Builds and attaches an adapter at the lowest priority; returns its id.
    pub fn add_adapter(&self, spec: &Value) -> Result<u64, ConfigError> {
        let index = self.len();
        let built =
            std::thread::scope(|s| s.spawn(|| self.rt.block_on(config::build(index, spec))).join())
                .map_err(|_| ConfigError::field("l2-adapter", "adapter construction panicked"))??;
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        self.shared.adapters.write().push(Arc::new(AdapterSlot::new(id, built)));
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

    /// One adapter's view, or all.
    pub fn describe(&self) -> Vec<AdapterInfo> {
        self.adapters().iter().map(|s| describe_slot(s)).collect()
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
        let adapters = self.adapters();
        self.block_on(async move {
            for a in adapters {
                a.built.adapter.close().await;
            }
        });
    }
}

fn describe_slot(s: &AdapterSlot) -> AdapterInfo {
    let st = &s.stats;
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let usage: serde_json::Map<String, Value> = s
        .usage()
        .into_iter()
        .map(|(k, v)| {
            (if k.is_empty() { "_default".into() } else { k.as_str().to_owned() }, json!(v))
        })
        .collect();
    AdapterInfo {
        id: s.id,
        kind: s.built.kind.clone(),
        healthy: s.healthy(),
        detail: json!({
            "id": s.id,
            "type": s.built.kind,
            "healthy": s.healthy(),
            "last_error": s.last_error.lock().clone(),
            "codec": s.built.codec.name(),
            "config": s.built.spec,
            "adapter": s.built.adapter.describe(),
            "capacity_bytes": s.built.adapter.capacity(),
            "usage_bytes_by_salt": usage,
            "stored_keys": g(&st.stored_keys),
            "stored_bytes": g(&st.stored_bytes),
            "skipped_keys": g(&st.skipped_keys),
            "store_failures": g(&st.store_failures),
            "lookup_keys": g(&st.lookup_keys),
            "lookup_hits": g(&st.lookup_hits),
            "loaded_keys": g(&st.loaded_keys),
            "loaded_bytes": g(&st.loaded_bytes),
            "load_failures": g(&st.load_failures),
            "corrupt_blobs": g(&st.corrupt_blobs),
            "errors": g(&st.errors),
        }),
    }
}
