//! Request and error counters, exposed on `GET /metrics` in Prometheus text format.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

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

/// The server's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests handled, per operation.
    pub requests: Family<OpLabel, Counter>,
    /// Bad requests, per operation and kind.
    pub errors: Family<ErrorLabel, Counter>,
    /// Chunks found by lookups.
    pub lookup_hit_chunks: Counter,
    /// Chunks asked for by lookups.
    pub lookup_chunks: Counter,
    /// Chunks stored.
    pub stored_chunks: Counter,
    /// Chunks retrieved.
    pub retrieved_chunks: Counter,
    /// L1 bytes in use (updated when scraped).
    pub l1_used_bytes: Gauge,
    /// L1 capacity.
    pub l1_capacity_bytes: Gauge,
    /// Live sessions (updated when scraped).
    pub active_sessions: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("lmcache_rs");
        let m = Self {
            requests: Family::default(),
            errors: Family::default(),
            lookup_hit_chunks: Counter::default(),
            lookup_chunks: Counter::default(),
            stored_chunks: Counter::default(),
            retrieved_chunks: Counter::default(),
            l1_used_bytes: Gauge::default(),
            l1_capacity_bytes: Gauge::default(),
            active_sessions: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register("mp_requests", "MP requests handled", m.requests.clone());
        registry.register(
            "mp_request_errors",
            "MP requests refused as malformed",
            m.errors.clone(),
        );
        registry.register(
            "lookup_hit_chunks",
            "Chunks found by lookups",
            m.lookup_hit_chunks.clone(),
        );
        registry.register("lookup_chunks", "Chunks looked up", m.lookup_chunks.clone());
        registry.register("stored_chunks", "Chunks stored into L1", m.stored_chunks.clone());
        registry.register(
            "retrieved_chunks",
            "Chunks retrieved from L1",
            m.retrieved_chunks.clone(),
        );
        registry.register("l1_used_bytes", "L1 bytes in use", m.l1_used_bytes.clone());
        registry.register("l1_capacity_bytes", "L1 capacity in bytes", m.l1_capacity_bytes.clone());
        registry.register("active_sessions", "Live request sessions", m.active_sessions.clone());
        Self { registry, ..m }
    }
}

impl Metrics {
    /// Counts a request.
    pub fn request(&self, op: &str) {
        self.requests.get_or_create(&OpLabel { op: op.to_owned() }).inc();
    }

    /// Counts a refused request.
    pub fn error(&self, op: &str, kind: &str) {
        self.errors.get_or_create(&ErrorLabel { op: op.to_owned(), kind: kind.to_owned() }).inc();
    }

    /// Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
