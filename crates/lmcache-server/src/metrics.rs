//! Prometheus metrics on `GET /metrics`, under LMCache 0.5.6's `lmcache_mp_*` names wherever
//! lmcache-rs measures the same quantity (so existing dashboards keep working), plus
//! `lmcache_rs_*` for what LMCache does not have (requests and refusals per operation).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// Labels of per-operation counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    /// Operation name.
    pub op: String,
}

/// Labels of error counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabel {
    /// Operation name, or `unknown`.
    pub op: String,
    /// Error kind.
    pub kind: String,
}

/// Labels of per-adapter L2 metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct L2Label {
    /// Adapter type.
    pub l2_name: String,
    /// Adapter id (priority order at start).
    pub adapter_index: String,
}

/// Label of per-L1 metrics: the L1's tag (`--l1-manager`; `_default` for the legacy flags).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct L1TagLabel {
    /// The tag.
    pub tag: String,
}

/// Label of adapter-count gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// `active` or `draining`.
    pub state: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// Label of CacheBlend retrieves that scattered nothing.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// LMCache's reason: `already_applied`, `matches_beyond_alloc`, ...
    pub reason: String,
}

/// CacheBlend's metrics (`--engine-type blend`), under LMCache's `lmcache_blend_*` names and
/// meanings (its blend metrics subscriber), so its dashboards read ours; phase durations are
/// histograms in milliseconds, as LMCache's.
#[derive(Debug)]
pub struct BlendMetrics {
    /// `cb_unified_lookup` requests (counted once per request, not per poll).
    pub lookup_requests: Counter,
    /// Whole-chunk tokens submitted for lookup.
    pub lookup_requested_tokens: Counter,
    /// Tokens served: the prefix plus the unique tokens of the found matches and the
    /// segmented tail.
    pub lookup_hit_tokens: Counter,
    /// Of those, the prefix's.
    pub lookup_prefix_hit_tokens: Counter,
    /// Of those, the non-prefix (shifted) matches'.
    pub lookup_non_prefix_hit_tokens: Counter,
    /// Of those, the segmented-prefix tail's.
    pub lookup_segmented_prefix_hit_tokens: Counter,
    /// Matches kept past the prefix.
    pub lookup_fingerprint_hits: Counter,
    /// Matches whose objects were found in storage.
    pub lookup_storage_hits: Counter,
    /// Matches past the prefix whose objects were not found.
    pub lookup_stale_chunks: Counter,
    /// Lookups for a model no worker registered (nothing to scatter into).
    pub lookup_no_gpu_context_errors: Counter,
    /// `cb_retrieve_pre_computed` requests that reached the scatter.
    pub retrieve_requests: Counter,
    /// Their matches.
    pub retrieve_chunks: Counter,
    /// Of those requests, the ones that answered `false`.
    pub retrieve_failures: Counter,
    /// Chunks fingerprinted by stores.
    pub fingerprints_registered: Counter,
    /// Fingerprints removed after two stale lookups.
    pub chunks_evicted: Counter,
    /// Chunks the local matcher returned.
    pub fingerprint_matches: Counter,
    /// Segments the coordinator's fleet directory returned.
    pub coordinator_matches: Counter,
    /// Coordinator match legs abandoned at their deadline.
    pub coordinator_match_timeouts: Counter,
    /// Non-prefix keys the sparse prefetch had to read from L2.
    pub sparse_prefetch_l2_keys: Counter,
    /// Of those, the keys that landed in L1.
    pub sparse_prefetch_found_keys: Counter,
    /// Tokens written into the engine's blocks.
    pub scatter_tokens: Counter,
    /// Chunks written at their stored positions (no re-rotation).
    pub scatter_prefix_chunks: Counter,
    /// Chunks re-rotated to new positions.
    pub scatter_shifted_chunks: Counter,
    /// Matches dropped for lying past the block table.
    pub scatter_dropped_chunks: Counter,
    /// Retrieves that scattered nothing, by reason.
    pub retrieve_noops: Family<ReasonLabel, Counter>,
    /// `cb_reorder_plan` answers that reordered the prompt (lmcache-rs's own).
    pub reorder_plans: Counter,
    /// Phase durations, ms: the whole lookup (polls included), the local match, the
    /// prefix leg, the coordinator leg, the sparse prefetch, the retrieve, the scatter.
    pub lookup_duration: Histogram,
    /// See [`Self::lookup_duration`].
    pub fingerprint_match_duration: Histogram,
    /// See [`Self::lookup_duration`].
    pub prefix_lookup_duration: Histogram,
    /// See [`Self::lookup_duration`].
    pub coordinator_match_duration: Histogram,
    /// See [`Self::lookup_duration`].
    pub sparse_prefetch_duration: Histogram,
    /// See [`Self::lookup_duration`].
    pub retrieve_duration: Histogram,
    /// See [`Self::lookup_duration`].
    pub scatter_duration: Histogram,
}

fn millisecond_buckets() -> Histogram {
    Histogram::new([0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 5000.0])
}

impl Default for BlendMetrics {
    fn default() -> Self {
        Self {
            lookup_requests: Counter::default(),
            lookup_requested_tokens: Counter::default(),
            lookup_hit_tokens: Counter::default(),
            lookup_prefix_hit_tokens: Counter::default(),
            lookup_non_prefix_hit_tokens: Counter::default(),
            lookup_segmented_prefix_hit_tokens: Counter::default(),
            lookup_fingerprint_hits: Counter::default(),
            lookup_storage_hits: Counter::default(),
            lookup_stale_chunks: Counter::default(),
            lookup_no_gpu_context_errors: Counter::default(),
            retrieve_requests: Counter::default(),
            retrieve_chunks: Counter::default(),
            retrieve_failures: Counter::default(),
            fingerprints_registered: Counter::default(),
            chunks_evicted: Counter::default(),
            fingerprint_matches: Counter::default(),
            coordinator_matches: Counter::default(),
            coordinator_match_timeouts: Counter::default(),
            sparse_prefetch_l2_keys: Counter::default(),
            sparse_prefetch_found_keys: Counter::default(),
            scatter_tokens: Counter::default(),
            scatter_prefix_chunks: Counter::default(),
            scatter_shifted_chunks: Counter::default(),
            scatter_dropped_chunks: Counter::default(),
            retrieve_noops: Family::default(),
            reorder_plans: Counter::default(),
            lookup_duration: millisecond_buckets(),
            fingerprint_match_duration: millisecond_buckets(),
            prefix_lookup_duration: millisecond_buckets(),
            coordinator_match_duration: millisecond_buckets(),
            sparse_prefetch_duration: millisecond_buckets(),
            retrieve_duration: millisecond_buckets(),
            scatter_duration: millisecond_buckets(),
        }
    }
}

impl BlendMetrics {
    fn register(&self, r: &mut Registry) {
        let counters: [(&str, &str, &Counter); 25] = [
            ("lookup_requests", "Total CB lookup requests", &self.lookup_requests),
            (
                "lookup_requested_tokens",
                "Chunk-aligned tokens submitted for CB lookup",
                &self.lookup_requested_tokens,
            ),
            ("lookup_hit_tokens", "Tokens served by blend during lookup", &self.lookup_hit_tokens),
            (
                "lookup_prefix_hit_tokens",
                "Tokens served by blend from the prefix (L1+L2)",
                &self.lookup_prefix_hit_tokens,
            ),
            (
                "lookup_non_prefix_hit_tokens",
                "Tokens served by blend from non-prefix (shifted) chunks",
                &self.lookup_non_prefix_hit_tokens,
            ),
            (
                "lookup_segmented_prefix_hit_tokens",
                "Tokens served by blend from the segmented-prefix tail",
                &self.lookup_segmented_prefix_hit_tokens,
            ),
            (
                "lookup_fingerprint_hits",
                "Chunks matched by the fingerprint table past the prefix",
                &self.lookup_fingerprint_hits,
            ),
            (
                "lookup_storage_hits",
                "Chunks confirmed present in storage after prefetch",
                &self.lookup_storage_hits,
            ),
            (
                "lookup_stale_chunks",
                "Fingerprint hits whose chunks storage no longer holds",
                &self.lookup_stale_chunks,
            ),
            (
                "lookup_no_gpu_context_errors",
                "Lookups for a model no worker registered",
                &self.lookup_no_gpu_context_errors,
            ),
            ("retrieve_requests", "Total CB retrieve requests", &self.retrieve_requests),
            ("retrieve_chunks", "Chunks requested for CB retrieval", &self.retrieve_chunks),
            (
                "retrieve_failures",
                "CB retrieve operations that returned success=False",
                &self.retrieve_failures,
            ),
            (
                "fingerprints_registered",
                "Chunks indexed into the fingerprint table",
                &self.fingerprints_registered,
            ),
            (
                "chunks_evicted",
                "Stale chunks evicted from the fingerprint table",
                &self.chunks_evicted,
            ),
            (
                "fingerprint_matches",
                "Chunks returned by the local fingerprint matcher",
                &self.fingerprint_matches,
            ),
            (
                "coordinator_matches",
                "Segments returned by the coordinator fleet directory",
                &self.coordinator_matches,
            ),
            (
                "coordinator_match_timeouts",
                "Coordinator match legs abandoned at their deadline",
                &self.coordinator_match_timeouts,
            ),
            (
                "sparse_prefetch_l2_keys",
                "Non-prefix keys the sparse prefetch had to read from L2",
                &self.sparse_prefetch_l2_keys,
            ),
            (
                "sparse_prefetch_found_keys",
                "Sparse-prefetch keys that became L1-resident",
                &self.sparse_prefetch_found_keys,
            ),
            (
                "scatter_tokens",
                "Tokens written from L1 into the request's paged KV",
                &self.scatter_tokens,
            ),
            (
                "scatter_prefix_chunks",
                "Scattered chunks kept at their stored position (no re-RoPE)",
                &self.scatter_prefix_chunks,
            ),
            (
                "scatter_shifted_chunks",
                "Scattered chunks re-RoPE'd to a new position",
                &self.scatter_shifted_chunks,
            ),
            (
                "scatter_dropped_chunks",
                "Matched chunks dropped for exceeding the allocated slots",
                &self.scatter_dropped_chunks,
            ),
            (
                "reorder_plans",
                "cb_reorder_plan answers that reordered the prompt (lmcache-rs)",
                &self.reorder_plans,
            ),
        ];
        let blend = r.sub_registry_with_prefix("lmcache_blend");
        for (name, help, c) in counters {
            blend.register(name, help, c.clone());
        }
        blend.register(
            "retrieve_noops",
            "CB retrieves that scattered nothing, by reason",
            self.retrieve_noops.clone(),
        );
        let ms = prometheus_client::registry::Unit::Other("milliseconds".into());
        for (phase, h) in [
            ("lookup", &self.lookup_duration),
            ("fingerprint_match", &self.fingerprint_match_duration),
            ("prefix_lookup", &self.prefix_lookup_duration),
            ("coordinator_match", &self.coordinator_match_duration),
            ("sparse_prefetch", &self.sparse_prefetch_duration),
            ("retrieve", &self.retrieve_duration),
            ("scatter", &self.scatter_duration),
        ] {
            blend.register_with_unit(
                format!("{phase}_duration"),
                format!("Wall-clock duration of the CB {phase} phase of one request"),
                ms.clone(),
                h.clone(),
            );
        }
    }

    /// Records a phase's duration in milliseconds.
    pub fn observe_ms(h: &Histogram, d: std::time::Duration) {
        h.observe(d.as_secs_f64() * 1e3);
    }
}

/// L2 metrics, read from the tier's counters at scrape time.
#[derive(Debug, Default)]
pub struct L2Metrics {
    /// Adapters attached to the store controller.
    pub store_adapters: Family<StateLabel, Gauge>,
    /// Adapters attached to the prefetch controller.
    pub prefetch_adapters: Family<StateLabel, Gauge>,
    /// Bytes each adapter holds, as its ledger counts them (seeded at start, down on deletes
    /// and evictions).
    pub usage_bytes: Family<L2Label, Gauge>,
    /// Each adapter's capacity in bytes (-1: unbounded).
    pub capacity_bytes: Family<L2Label, Gauge>,
    /// Keys each adapter holds.
    pub keys: Family<L2Label, Gauge>,
    /// Keys evicted from each adapter.
    pub evicted_objects: Family<L2Label, Counter>,
    /// Bytes evicted from each adapter.
    pub evicted_bytes: Family<L2Label, Counter>,
    /// Writes refused because a cache_salt's L2 quota could not make room.
    pub quota_rejections: Family<L2Label, Counter>,
    /// Writes refused because the capacity could not make room.
    pub capacity_rejections: Family<L2Label, Counter>,
    /// Keys handed to the write-behind queue.
    pub store_submitted_objects: Counter,
    /// Keys written, per adapter.
    pub store_completed_objects: Family<L2Label, Counter>,
    /// Bytes written, per adapter.
    pub stored_bytes: Family<L2Label, Counter>,
    /// Keys not written because the adapter already held them.
    pub store_skipped_objects: Family<L2Label, Counter>,
    /// Keys whose write failed after retries.
    pub store_failures: Family<L2Label, Counter>,
    /// Keys dropped because the write-behind queue was full.
    pub store_dropped_objects: Counter,
    /// Keys loaded and verified, per adapter.
    pub loaded_objects: Family<L2Label, Counter>,
    /// Bytes loaded, per adapter.
    pub loaded_bytes: Family<L2Label, Counter>,
    /// Loads that failed or missed after a lookup hit.
    pub load_failures: Family<L2Label, Counter>,
    /// Blobs refused by verification.
    pub corrupt_blobs: Family<L2Label, Counter>,
    /// Backend errors.
    pub errors: Family<L2Label, Counter>,
    /// 1 when the adapter's last operation succeeded.
    pub healthy: Family<L2Label, Gauge>,
    /// Prefetch requests started.
    pub prefetch_requests: Counter,
    /// Prefetch requests cut by their deadline.
    pub prefetch_expired: Counter,
}

/// The server's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests handled, per operation.
    pub requests: Family<OpLabel, Counter>,
    /// Requests refused as malformed, per operation and kind.
    pub errors: Family<ErrorLabel, Counter>,
    /// Handler panics caught (each also a `panic` error of its operation).
    pub handler_panics: Counter,
    /// Registrations refused as unservable (CUDA descriptors, several KV groups, ...).
    pub refused_registrations: Counter,
    /// Lookup-hash log lines dropped because the writer was behind.
    pub lookup_hash_log_dropped: Counter,
    /// Handling time per operation, seconds (socket arrival to reply excluded: handler only).
    pub latency: Family<OpLabel, Histogram>,
    /// Completed lookups.
    pub lookups: Counter,
    /// Tokens submitted for lookup (whole chunks).
    pub lookup_requested_tokens: Counter,
    /// Tokens found.
    pub lookup_hit_tokens: Counter,
    /// Tokens found in L1 (all of them, until L2 exists).
    pub lookup_hit_l1_tokens: Counter,
    /// Hit keys (per shard and chunk) L1 held.
    pub lookup_hit_l1_keys: Counter,
    /// Tokens L2 added beyond the L1 prefix.
    pub lookup_hit_l2_tokens: Counter,
    /// Hit keys loaded from L2 into L1.
    pub lookup_hit_l2_keys: Counter,
    /// The L2 tier.
    pub l2: L2Metrics,
    /// Chunks written to L1.
    pub l1_write_chunks: Counter,
    /// Chunks read from L1.
    pub l1_read_chunks: Counter,
    /// Store transfers started.
    pub submitted_stores: Counter,
    /// Store transfers finished.
    pub finished_stores: Counter,
    /// Retrieve transfers started.
    pub submitted_retrieves: Counter,
    /// Retrieve transfers finished.
    pub finished_retrieves: Counter,
    /// Chunks loaded into engines.
    pub chunks_loaded: Counter,
    /// Server-side store copy throughput per request, GB/s.
    pub store_throughput: Histogram,
    /// Server-side retrieve copy throughput per request, GB/s.
    pub load_throughput: Histogram,
    /// L1 bytes in use (set when scraped).
    pub l1_used_bytes: Gauge,
    /// L1 used / capacity (set when scraped).
    pub l1_usage_ratio: FloatGauge,
    /// L1 bytes of staged objects (set when scraped).
    pub l1_staging_bytes: Gauge,
    /// L1 capacity.
    pub l1_capacity_bytes: Gauge,
    /// Bytes in use per L1, by tag (set when scraped).
    pub l1_tier_used_bytes: Family<L1TagLabel, Gauge>,
    /// Capacity per L1, by tag (set when scraped).
    pub l1_tier_capacity_bytes: Family<L1TagLabel, Gauge>,
    /// Resident objects per L1, by tag (set when scraped).
    pub l1_tier_objects: Family<L1TagLabel, Gauge>,
    /// KV event records retained (set when scraped).
    pub kv_events_log_depth: Gauge,
    /// Prefetch jobs in flight (lookups complete synchronously: always 0 until L2 exists).
    pub active_prefetch_jobs: Gauge,
    /// P2P lookups of peers whose answer was not taken yet (set when scraped).
    pub active_p2p_lookup_jobs: Gauge,
    /// Keys peers asked this server's L1 for (P2P lookups served).
    pub p2p_served_keys: Counter,
    /// Of those, keys found and read-locked for the peer.
    pub p2p_served_hits: Counter,
    /// Peer locks released by the peer's unlock.
    pub p2p_unlocked_keys: Counter,
    /// Peer locks whose unlock came after they expired.
    pub p2p_unlock_expired: Counter,
    /// Objects fetched from peers, verified and committed into L1 (P2P reads).
    pub p2p_fetched_keys: Counter,
    /// Their bytes.
    pub p2p_fetched_bytes: Counter,
    /// Objects a peer locked that did not arrive whole (refused: a miss).
    pub p2p_fetch_failures: Counter,
    /// Of the fetched objects, those copied straight out of a same-host peer's pool.
    pub p2p_fetched_same_host_keys: Counter,
    /// NIXL handshakes refused: from an address no peer of the fleet registered.
    pub p2p_handshakes_refused: Counter,
    /// Live sessions (set when scraped).
    pub active_sessions: Gauge,
    /// Resident memory of the process (set when scraped).
    pub process_resident_memory_bytes: Gauge,
    /// Events queued on the bus (set when scraped).
    pub event_bus_queue_depth: Gauge,
    /// Events the bus dropped (advanced to the bus's count when scraped).
    pub event_bus_dropped: Counter,
    /// L1 maintenance passes (LMCache's eviction-loop ticks).
    pub l1_eviction_loop_ticks: Counter,
    /// Objects evicted from L1.
    pub l1_evicted_objects: Counter,
    /// Bytes evicted from L1.
    pub l1_evicted_bytes: Counter,
    /// Allocations that had to evict synchronously.
    pub l1_sync_evictions: Counter,
    /// Write requests refused for lack of memory.
    pub l1_oom_rejections: Counter,
    /// Write requests refused by a quota.
    pub l1_quota_rejections: Counter,
    /// Read locks of silent clients released by their TTL.
    pub l1_expired_read_leases: Counter,
    /// Write reservations of silent clients dropped by their TTL.
    pub l1_expired_write_leases: Counter,
    /// Objects evicted from L1 before the write-behind wrote them to L2 (lost KV).
    pub l1_unwritten_evictions: Counter,
    /// Resident objects the write-behind has not written to L2 yet.
    pub l1_unwritten_objects: Gauge,
    /// L1 file: objects recorded to survive a restart.
    pub l1_sealed_objects: Counter,
    /// L1 file: objects that could not be recorded (served, not kept).
    pub l1_seal_failures: Counter,
    /// L1 file: committed objects waiting to be recorded.
    pub l1_seal_pending: Gauge,
    /// L1 file: objects adopted at start (restart warm).
    pub l1_adopted_objects: Counter,
    /// L1 file: recorded objects dropped at start (bytes or record did not verify).
    pub l1_adopt_dropped_objects: Counter,
    /// Chunks lookups missed, by reason ("why was this a miss?").
    pub lookup_miss_chunks: Family<ReasonLabel, Counter>,
    /// CacheBlend (`--engine-type blend`).
    pub blend: BlendMetrics,
}

fn throughput_buckets() -> Histogram {
    Histogram::new([0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
}

impl Default for Metrics {
    fn default() -> Self {
        let m = Self {
            registry: Registry::default(),
            requests: Family::default(),
            errors: Family::default(),
            handler_panics: Counter::default(),
            refused_registrations: Counter::default(),
            lookup_hash_log_dropped: Counter::default(),
            latency: Family::new_with_constructor(|| {
                Histogram::new([1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0])
            }),
            lookups: Counter::default(),
            lookup_requested_tokens: Counter::default(),
            lookup_hit_tokens: Counter::default(),
            lookup_hit_l1_tokens: Counter::default(),
            lookup_hit_l1_keys: Counter::default(),
            lookup_hit_l2_tokens: Counter::default(),
            lookup_hit_l2_keys: Counter::default(),
            l2: L2Metrics::default(),
            l1_write_chunks: Counter::default(),
            l1_read_chunks: Counter::default(),
            submitted_stores: Counter::default(),
            finished_stores: Counter::default(),
            submitted_retrieves: Counter::default(),
            finished_retrieves: Counter::default(),
            chunks_loaded: Counter::default(),
            store_throughput: throughput_buckets(),
            load_throughput: throughput_buckets(),
            l1_used_bytes: Gauge::default(),
            l1_usage_ratio: FloatGauge::default(),
            l1_staging_bytes: Gauge::default(),
            l1_capacity_bytes: Gauge::default(),
            l1_tier_used_bytes: Family::default(),
            l1_tier_capacity_bytes: Family::default(),
            l1_tier_objects: Family::default(),
            kv_events_log_depth: Gauge::default(),
            active_prefetch_jobs: Gauge::default(),
            active_p2p_lookup_jobs: Gauge::default(),
            p2p_served_keys: Counter::default(),
            p2p_served_hits: Counter::default(),
            p2p_unlocked_keys: Counter::default(),
            p2p_unlock_expired: Counter::default(),
            p2p_fetched_keys: Counter::default(),
            p2p_fetched_bytes: Counter::default(),
            p2p_fetch_failures: Counter::default(),
            p2p_fetched_same_host_keys: Counter::default(),
            p2p_handshakes_refused: Counter::default(),
            active_sessions: Gauge::default(),
            process_resident_memory_bytes: Gauge::default(),
            event_bus_queue_depth: Gauge::default(),
            event_bus_dropped: Counter::default(),
            l1_eviction_loop_ticks: Counter::default(),
            l1_evicted_objects: Counter::default(),
            l1_evicted_bytes: Counter::default(),
            l1_sync_evictions: Counter::default(),
            l1_oom_rejections: Counter::default(),
            l1_quota_rejections: Counter::default(),
            l1_expired_read_leases: Counter::default(),
            l1_expired_write_leases: Counter::default(),
            l1_unwritten_evictions: Counter::default(),
            l1_sealed_objects: Counter::default(),
            lookup_miss_chunks: Family::default(),
            l1_seal_failures: Counter::default(),
            l1_seal_pending: Gauge::default(),
            l1_adopted_objects: Counter::default(),
            l1_adopt_dropped_objects: Counter::default(),
            l1_unwritten_objects: Gauge::default(),
            blend: BlendMetrics::default(),
        };
        let mut r = Registry::default();
        {
            let mp = r.sub_registry_with_prefix("lmcache_mp");
            mp.register(
                "l1_eviction_loop_ticks",
                "L1 eviction-loop iterations (every cycle)",
                m.l1_eviction_loop_ticks.clone(),
            );
            mp.register("lookups_requests", "Completed lookups", m.lookups.clone());
            mp.register(
                "lookup_requested_tokens",
                "Tokens submitted for lookup (whole chunks)",
                m.lookup_requested_tokens.clone(),
            );
            mp.register(
                "lookup_hit_tokens",
                "Tokens found in L1+L2 during lookup (contiguous prefix)",
                m.lookup_hit_tokens.clone(),
            );
            mp.register(
                "lookup_hit_l1_tokens",
                "Of lookup_hit: tokens L1 already held",
                m.lookup_hit_l1_tokens.clone(),
            );
            mp.register(
                "lookup_hit_l2_tokens",
                "Of lookup_hit: tokens L2 added beyond the L1 prefix",
                m.lookup_hit_l2_tokens.clone(),
            );
            mp.register(
                "lookup_hit_l2_keys",
                "Hit keys loaded from L2 into L1",
                m.lookup_hit_l2_keys.clone(),
            );
            let l2 = &m.l2;
            mp.register(
                "l2_store_adapters",
                "L2 adapters attached to the store controller, by state",
                l2.store_adapters.clone(),
            );
            mp.register(
                "l2_prefetch_adapters",
                "L2 adapters attached to the prefetch controller, by state",
                l2.prefetch_adapters.clone(),
            );
            mp.register(
                "l2_usage_bytes",
                "Bytes written to each L2 adapter",
                l2.usage_bytes.clone(),
            );
            mp.register(
                "l2_store_submitted_objects",
                "Objects submitted for L2 store",
                l2.store_submitted_objects.clone(),
            );
            mp.register(
                "l2_store_completed_objects",
                "Objects written to L2",
                l2.store_completed_objects.clone(),
            );
            mp.register(
                "lookup_hit_l1_keys",
                "Hit keys (per shard and chunk) that L1 already held",
                m.lookup_hit_l1_keys.clone(),
            );
            mp.register("l1_write_chunks", "Total chunks written to L1", m.l1_write_chunks.clone());
            mp.register("l1_read_chunks", "Total chunks read from L1", m.l1_read_chunks.clone());
            mp.register(
                "num_submitted_stores",
                "Store transfers started",
                m.submitted_stores.clone(),
            );
            mp.register(
                "num_finished_stores",
                "Store transfers finished",
                m.finished_stores.clone(),
            );
            mp.register(
                "num_submitted_retrieves",
                "Retrieve transfers started",
                m.submitted_retrieves.clone(),
            );
            mp.register(
                "num_finished_retrieves",
                "Retrieve transfers finished",
                m.finished_retrieves.clone(),
            );
            mp.register("num_chunks_loaded", "Chunks loaded into engines", m.chunks_loaded.clone());
            mp.register(
                "l0_l1_store_throughput_GB_per_second",
                "Server-side store copy throughput per request, GB/s",
                m.store_throughput.clone(),
            );
            mp.register(
                "l0_l1_load_throughput_GB_per_second",
                "Server-side retrieve copy throughput per request, GB/s",
                m.load_throughput.clone(),
            );
            mp.register(
                "l1_memory_usage_bytes",
                "Bytes currently held in L1 cache",
                m.l1_used_bytes.clone(),
            );
            mp.register(
                "l1_usage_ratio",
                "L1 used/total ratio (0.0-1.0)",
                m.l1_usage_ratio.clone(),
            );
            mp.register(
                "l1_staging_bytes",
                "Bytes held by L1 staging objects (write-reserved, not admitted)",
                m.l1_staging_bytes.clone(),
            );
            mp.register(
                "event_bus_queue_depth",
                "Events currently queued in the EventBus",
                m.event_bus_queue_depth.clone(),
            );
            mp.register(
                "event_bus_dropped_events",
                "Cumulative events dropped because the EventBus queue was full",
                m.event_bus_dropped.clone(),
            );
            mp.register(
                "kv_events_log_depth",
                "Cache-event records retained for subscribers and reconnects",
                m.kv_events_log_depth.clone(),
            );
            mp.register(
                "active_prefetch_jobs",
                "Number of active prefetch jobs",
                m.active_prefetch_jobs.clone(),
            );
            mp.register(
                "active_p2p_lookup_jobs",
                "Number of active P2P lookup jobs",
                m.active_p2p_lookup_jobs.clone(),
            );
        }
        {
            let rs = r.sub_registry_with_prefix("lmcache_rs");
            rs.register("mp_requests", "MP requests handled, per operation", m.requests.clone());
            rs.register(
                "mp_request_errors",
                "MP requests refused as malformed, per operation and kind",
                m.errors.clone(),
            );
            rs.register(
                "handler_panics",
                "Handler panics caught (the request got its failure reply; the worker went on)",
                m.handler_panics.clone(),
            );
            rs.register(
                "refused_registrations",
                "Worker registrations refused as unservable (see /status refused_instances)",
                m.refused_registrations.clone(),
            );
            rs.register(
                "lookup_hash_log_dropped_lines",
                "Lookup-hash log lines dropped because the writer was behind the lookups",
                m.lookup_hash_log_dropped.clone(),
            );
            rs.register(
                "p2p_served_keys",
                "Keys peers of the fleet asked this server's L1 for (P2P lookups served)",
                m.p2p_served_keys.clone(),
            );
            rs.register(
                "p2p_served_hits",
                "Keys found in L1 and read-locked for a peer",
                m.p2p_served_hits.clone(),
            );
            rs.register(
                "p2p_unlocked_keys",
                "Peer read locks released by the peer",
                m.p2p_unlocked_keys.clone(),
            );
            rs.register(
                "p2p_unlock_expired",
                "Peer read locks whose unlock came after they expired (L1 read TTL)",
                m.p2p_unlock_expired.clone(),
            );
            rs.register(
                "p2p_fetched_keys",
                "Objects fetched from the fleet's peers, verified and committed into L1",
                m.p2p_fetched_keys.clone(),
            );
            rs.register(
                "p2p_fetched_bytes",
                "Bytes fetched from peers",
                m.p2p_fetched_bytes.clone(),
            );
            rs.register(
                "p2p_fetch_failures",
                "Objects a peer locked that did not arrive whole (refused: served as a miss)",
                m.p2p_fetch_failures.clone(),
            );
            rs.register(
                "p2p_fetched_same_host_keys",
                "Of the fetched objects, those copied straight out of a same-host peer's L1 pool",
                m.p2p_fetched_same_host_keys.clone(),
            );
            rs.register(
                "p2p_handshakes_refused",
                "NIXL handshakes refused because they came from an address no registered peer has",
                m.p2p_handshakes_refused.clone(),
            );
            rs.register("mp_request_seconds", "Handler time per MP operation", m.latency.clone());
            rs.register("l1_capacity_bytes", "L1 capacity in bytes", m.l1_capacity_bytes.clone());
            rs.register(
                "l1_tier_used_bytes",
                "Bytes in use in each L1, by its tag (several with --l1-manager repeated)",
                m.l1_tier_used_bytes.clone(),
            );
            rs.register(
                "l1_tier_capacity_bytes",
                "Capacity of each L1, by its tag",
                m.l1_tier_capacity_bytes.clone(),
            );
            rs.register(
                "l1_tier_objects",
                "Resident objects in each L1, by its tag",
                m.l1_tier_objects.clone(),
            );
            rs.register(
                "l1_evicted_objects",
                "Objects evicted from L1",
                m.l1_evicted_objects.clone(),
            );
            rs.register("l1_evicted_bytes", "Bytes evicted from L1", m.l1_evicted_bytes.clone());
            rs.register(
                "l1_sync_evictions",
                "Allocations that evicted synchronously",
                m.l1_sync_evictions.clone(),
            );
            rs.register(
                "l1_oom_rejections",
                "Write requests refused for lack of memory",
                m.l1_oom_rejections.clone(),
            );
            rs.register(
                "l1_quota_rejections",
                "Write requests refused by a quota",
                m.l1_quota_rejections.clone(),
            );
            rs.register(
                "l1_expired_read_leases",
                "Read locks of silent clients released by their TTL",
                m.l1_expired_read_leases.clone(),
            );
            rs.register(
                "l1_expired_write_leases",
                "Write reservations of silent clients dropped by their TTL",
                m.l1_expired_write_leases.clone(),
            );
            rs.register(
                "l1_unwritten_evictions",
                "Objects evicted from L1 before the L2 write-behind wrote them (their KV is lost)",
                m.l1_unwritten_evictions.clone(),
            );
            rs.register(
                "l1_unwritten_objects",
                "Resident L1 objects the L2 write-behind has not written yet",
                m.l1_unwritten_objects.clone(),
            );
            rs.register(
                "lookup_miss_chunks",
                "Chunks lookups missed, by reason (lmcache-rs explain REQUEST_ID tells each chunk)",
                m.lookup_miss_chunks.clone(),
            );
            rs.register(
                "l1_sealed_objects",
                "L1 file: objects recorded (checksummed) to survive a restart",
                m.l1_sealed_objects.clone(),
            );
            rs.register(
                "l1_seal_failures",
                "L1 file: objects that could not be recorded (served, not kept across a restart)",
                m.l1_seal_failures.clone(),
            );
            rs.register(
                "l1_seal_pending",
                "L1 file: committed objects waiting to be recorded",
                m.l1_seal_pending.clone(),
            );
            rs.register(
                "l1_adopted_objects",
                "L1 file: objects adopted at start from the previous process (restart warm)",
                m.l1_adopted_objects.clone(),
            );
            rs.register(
                "l1_adopt_dropped_objects",
                "L1 file: recorded objects dropped at start because their bytes or record did not verify",
                m.l1_adopt_dropped_objects.clone(),
            );
            rs.register("active_sessions", "Live request sessions", m.active_sessions.clone());
            let l2 = &m.l2;
            rs.register("l2_stored_bytes", "Bytes written to L2", l2.stored_bytes.clone());
            rs.register(
                "l2_store_skipped_objects",
                "Objects not written because the adapter held them",
                l2.store_skipped_objects.clone(),
            );
            rs.register(
                "l2_store_failures",
                "Objects whose L2 write failed after retries",
                l2.store_failures.clone(),
            );
            rs.register(
                "l2_store_dropped_objects",
                "Objects dropped because the write-behind queue was full",
                l2.store_dropped_objects.clone(),
            );
            rs.register("l2_loaded_objects", "Objects loaded from L2", l2.loaded_objects.clone());
            rs.register("l2_loaded_bytes", "Bytes loaded from L2", l2.loaded_bytes.clone());
            rs.register(
                "l2_load_failures",
                "L2 loads that failed or missed after a lookup hit",
                l2.load_failures.clone(),
            );
            rs.register(
                "l2_corrupt_blobs",
                "L2 blobs refused by verification (served as misses)",
                l2.corrupt_blobs.clone(),
            );
            rs.register("l2_errors", "L2 backend errors", l2.errors.clone());
            rs.register(
                "l2_capacity_bytes",
                "Bytes the adapter may hold (-1: unbounded)",
                l2.capacity_bytes.clone(),
            );
            rs.register("l2_keys", "Keys the adapter holds", l2.keys.clone());
            rs.register(
                "l2_evicted_objects",
                "Objects evicted from L2",
                l2.evicted_objects.clone(),
            );
            rs.register("l2_evicted_bytes", "Bytes evicted from L2", l2.evicted_bytes.clone());
            rs.register(
                "l2_quota_rejections",
                "L2 writes refused because the cache_salt's quota could not make room",
                l2.quota_rejections.clone(),
            );
            rs.register(
                "l2_capacity_rejections",
                "L2 writes refused because the capacity could not make room",
                l2.capacity_rejections.clone(),
            );
            rs.register("l2_healthy", "1 when the adapter answers", l2.healthy.clone());
            rs.register(
                "l2_prefetch_requests",
                "L2 prefetch requests started",
                l2.prefetch_requests.clone(),
            );
            rs.register(
                "l2_prefetch_expired",
                "L2 prefetch requests cut short by their deadline",
                l2.prefetch_expired.clone(),
            );
        }
        m.blend.register(&mut r);
        r.register(
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            m.process_resident_memory_bytes.clone(),
        );
        Self { registry: r, ..m }
    }
}

impl Metrics {
    /// Counts a request.
    pub fn request(&self, op: &str) {
        self.requests.get_or_create(&OpLabel { op: op.to_owned() }).inc();
    }

    /// Records a handler's time.
    pub fn observe(&self, op: &str, seconds: f64) {
        self.latency.get_or_create(&OpLabel { op: op.to_owned() }).observe(seconds);
    }

    /// Counts a refused request.
    pub fn error(&self, op: &str, kind: &str) {
        self.errors.get_or_create(&ErrorLabel { op: op.to_owned(), kind: kind.to_owned() }).inc();
    }

    /// Records a server-side copy of `bytes` that took `seconds`.
    pub fn copy_throughput(h: &Histogram, bytes: u64, seconds: f64) {
        if seconds > 0.0 && bytes > 0 {
            h.observe(bytes as f64 / seconds / 1e9);
        }
    }

    /// Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Moves a counter up to `value` (for counts kept elsewhere, read at scrape time).
pub fn advance(c: &Counter, value: u64) {
    let seen = c.get();
    if value > seen {
        c.inc_by(value - seen);
    }
}

/// Resident memory of this process, from /proc/self/statm.
pub fn process_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .map_or(0, |pages| pages * 4096)
}
