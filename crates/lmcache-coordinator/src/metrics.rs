//! Prometheus metrics on `GET /metrics`: LMCache's coordinator gauges under the names its
//! OpenTelemetry exporter gives them (`lmcache_coordinator_key_directory_placements{tier}`,
//! `..._placement_bytes{tier}`, and the deprecated `lmcache_mp_key_directory_*` pair), plus
//! `lmcache_rs_coordinator_*` for what LMCache does not export (batches by outcome, missing
//! batches, fenced placements, per-stream staleness).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// `tier` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabel {
    /// `l1` or `l2`.
    pub tier: String,
}

/// `result` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `applied`, `duplicate`, `stale`.
    pub result: String,
}

/// `instance_id` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InstanceLabel {
    /// The emitter.
    pub instance_id: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// The coordinator's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Placements by tier.
    pub placements: Family<TierLabel, Gauge>,
    /// Placement bytes by tier.
    pub placement_bytes: Family<TierLabel, Gauge>,
    placements_old: Family<TierLabel, Gauge>,
    placement_bytes_old: Family<TierLabel, Gauge>,
    /// Keys in the directory.
    pub keys: Gauge,
    /// Registered instances.
    pub instances: Gauge,
    /// Batches by admission result.
    pub batches_total: Family<ResultLabel, Counter>,
    /// Entries applied.
    pub entries: Counter,
    /// Batches missing in gaps.
    pub missing_batches: Counter,
    /// L1 placements dropped by fences (restart, expiry, deregistration).
    pub fenced_placements: Counter,
    /// Registrations.
    pub registrations: Counter,
    /// Instances dropped by the health sweep.
    pub expired_instances: Counter,
    /// Requests refused as invalid.
    pub invalid_requests: Counter,
    /// HTTP handlers that panicked (answered 500; the coordinator served on).
    pub handler_panics: Counter,
    /// Per stream: whether a gap is open (1) in its incarnation.
    pub stream_gap: Family<InstanceLabel, Gauge>,
    /// Per stream: seconds since its last admitted batch.
    pub stream_staleness: Family<InstanceLabel, FloatGauge>,
    /// Resyncs by outcome (`repaired`, `fenced`).
    pub repairs: Family<ResultLabel, Counter>,
    /// Seconds the last resync took.
    pub last_repair_seconds: FloatGauge,
    /// Checkpoint loads at start by result (`restored`, `missing`, `corrupt`).
    pub restores_total: Family<ResultLabel, Counter>,
    /// Checkpoints written.
    pub checkpoints_written: Counter,
    /// Checkpoint writes that failed.
    pub checkpoint_failures: Counter,
    /// L2 keys fleet eviction asked servers to delete.
    pub evictions_requested: Counter,
    /// Failures of the event transport (JetStream connection or consumer).
    pub transport_errors: Counter,
    /// Batches (one per model) and fences handed to the vLLM KV-event publisher.
    pub vllm_batches_queued: Counter,
    /// Batches not re-published: the publisher's queue was full.
    pub vllm_batches_dropped: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registered metrics, all zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Self {
            placements: Family::default(),
            placement_bytes: Family::default(),
            placements_old: Family::default(),
            placement_bytes_old: Family::default(),
            keys: Gauge::default(),
            instances: Gauge::default(),
            batches_total: Family::default(),
            entries: Counter::default(),
            missing_batches: Counter::default(),
            fenced_placements: Counter::default(),
            registrations: Counter::default(),
            expired_instances: Counter::default(),
            invalid_requests: Counter::default(),
            handler_panics: Counter::default(),
            stream_gap: Family::default(),
            stream_staleness: Family::default(),
            repairs: Family::default(),
            last_repair_seconds: FloatGauge::default(),
            restores_total: Family::default(),
            checkpoints_written: Counter::default(),
            checkpoint_failures: Counter::default(),
            evictions_requested: Counter::default(),
            transport_errors: Counter::default(),
            vllm_batches_queued: Counter::default(),
            vllm_batches_dropped: Counter::default(),
            registry: Registry::default(),
        };
        registry.register(
            "lmcache_coordinator_key_directory_placements",
            "Placements recorded in the key directory, by tier",
            m.placements.clone(),
        );
        registry.register(
            "lmcache_coordinator_key_directory_placement_bytes",
            "Reported logical bytes of the placements in the key directory, by tier",
            m.placement_bytes.clone(),
        );
        registry.register(
            "lmcache_mp_key_directory_placement_count",
            "Deprecated: use lmcache_coordinator_key_directory_placements",
            m.placements_old.clone(),
        );
        registry.register(
            "lmcache_mp_key_directory_placement_size_bytes",
            "Deprecated: use lmcache_coordinator_key_directory_placement_bytes",
            m.placement_bytes_old.clone(),
        );
        registry.register("lmcache_rs_coordinator_keys", "Keys with a placement", m.keys.clone());
        registry.register(
            "lmcache_rs_coordinator_instances",
            "Registered instances",
            m.instances.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_event_batches",
            "Cache-event batches by admission result",
            m.batches_total.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_event_entries",
            "Cache-event entries applied",
            m.entries.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_missing_batches",
            "Cache-event batches missing in sequence gaps",
            m.missing_batches.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_fenced_placements",
            "L1 placements dropped because their instance restarted, expired or deregistered",
            m.fenced_placements.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_registrations",
            "Instance registrations",
            m.registrations.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_expired_instances",
            "Instances dropped for missed heartbeats",
            m.expired_instances.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_invalid_requests",
            "Requests refused as invalid (422/400)",
            m.invalid_requests.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_handler_panics",
            "HTTP handlers that panicked (answered 500)",
            m.handler_panics.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_stream_gap",
            "1 while an emitter's stream has a gap in its incarnation",
            m.stream_gap.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_stream_staleness_seconds",
            "Seconds since an emitter's last admitted batch",
            m.stream_staleness.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_repairs",
            "Resyncs of an instance's L1 placements after a stream gap, by outcome",
            m.repairs.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_last_repair_seconds",
            "Seconds the last resync took (gap seen to placements replaced)",
            m.last_repair_seconds.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_checkpoint_restores",
            "Checkpoint loads at start, by result (restored, missing, corrupt)",
            m.restores_total.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_checkpoints_written",
            "Checkpoints written",
            m.checkpoints_written.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_checkpoint_failures",
            "Checkpoint writes that failed (the previous file stays)",
            m.checkpoint_failures.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_evictions_requested",
            "L2 keys the fleet eviction pass asked servers to delete (salts over their quota)",
            m.evictions_requested.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_transport_errors",
            "Event transport failures (JetStream connection or consumer), each followed by a retry",
            m.transport_errors.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_vllm_kv_event_batches_queued",
            "Admitted cache-event batches (one per model) and fences handed to the vLLM KV-event publisher (--vllm-kv-events-endpoint)",
            m.vllm_batches_queued.clone(),
        );
        registry.register(
            "lmcache_rs_coordinator_vllm_kv_event_batches_dropped",
            "vLLM KVEventBatch messages dropped because the publisher's queue was full",
            m.vllm_batches_dropped.clone(),
        );
        Self { registry, ..m }
    }

    /// Counts a checkpoint load.
    pub fn restores(&self, result: &str) {
        self.restores_total.get_or_create(&ResultLabel { result: result.into() }).inc();
    }

    /// Counts a finished resync.
    pub fn repaired(&self, outcome: &str, took: std::time::Duration) {
        self.repairs.get_or_create(&ResultLabel { result: outcome.into() }).inc();
        self.last_repair_seconds.set(took.as_secs_f64());
    }

    /// Counts `n` batches of `result`.
    pub fn batches(&self, result: &str, n: u64) {
        if n > 0 {
            self.batches_total.get_or_create(&ResultLabel { result: result.into() }).inc_by(n);
        }
    }

    /// Sets the per-tier gauges.
    pub fn set_tiers(&self, l1: (u64, u64), l2: (u64, u64)) {
        for (tier, (count, bytes)) in [("l1", l1), ("l2", l2)] {
            let t = TierLabel { tier: tier.into() };
            for f in [&self.placements, &self.placements_old] {
                f.get_or_create(&t).set(count as i64);
            }
            for f in [&self.placement_bytes, &self.placement_bytes_old] {
                f.get_or_create(&t).set(bytes as i64);
            }
        }
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
