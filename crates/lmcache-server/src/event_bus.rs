//! The event bus: typed events from request paths to subscribers (logging, metrics), through a
//! bounded queue that its own thread drains every 10 ms.
//!
//! Publishing never blocks: when the queue is full the event is dropped and counted
//! (`lmcache_mp_event_bus_dropped_events_total`); LMCache's bus drops silently. The queue depth
//! is exported too. Subscribers run on the drain thread, never on a request path. The bus stops
//! when dropped: the drain thread finishes what is queued and exits.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

/// Something that happened on a request path.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A lookup finished.
    Lookup {
        /// The request.
        request_id: String,
        /// Whole chunks asked for.
        chunks: usize,
        /// Leading chunks found.
        hits: usize,
    },
    /// Chunks were stored into L1.
    Stored {
        /// The request.
        request_id: String,
        /// Chunks committed.
        chunks: usize,
        /// Bytes committed.
        bytes: u64,
    },
    /// Chunks were read out of L1.
    Retrieved {
        /// The request.
        request_id: String,
        /// Chunks read.
        chunks: usize,
    },
    /// A session ended.
    SessionEnded {
        /// The request.
        request_id: String,
    },
    /// An object left L1 (evicted, deleted or cleared).
    L1Removed {
        /// Its model.
        model: String,
        /// Its chunk hash, hex.
        chunk_hash: String,
    },
    /// L1 refused to admit a chunk (out of memory, over quota, invalid size).
    L1WriteRefused {
        /// The request.
        request_id: String,
        /// Why (the L1 error).
        reason: String,
    },
    /// A write-behind batch to one L2 adapter ended.
    L2Stored(lmcache_storage::StoreReport),
    /// An L2 prefetch ended.
    L2Prefetched(lmcache_storage::PrefetchReport),
    /// A blob loaded from L2 failed verification (served as a miss).
    L2BlobRefused {
        /// Adapter id.
        adapter: u64,
        /// The key.
        key: String,
        /// Why.
        reason: String,
    },
    /// CacheBlend (`--engine-type blend`): LMCache's `CB_*` events.
    Blend(crate::blend_telemetry::BlendEvent),
    /// A request was refused as malformed.
    Refused {
        /// Operation.
        op: &'static str,
        /// Error kind.
        kind: &'static str,
    },
}

/// A subscriber, run on the drain thread.
pub type Subscriber = Box<dyn Fn(&Event) + Send>;

/// How often the drain thread empties the queue. Publishing never wakes it: a wakeup per event
/// costs more than the event (measured: +11-15 % on a lookup round trip on 2 cores).
const DRAIN_PERIOD: std::time::Duration = std::time::Duration::from_millis(10);

#[derive(Debug, Default)]
struct Shared {
    queue: parking_lot::Mutex<std::collections::VecDeque<Event>>,
    published: AtomicU64,
    dropped: AtomicU64,
}

/// The bus. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct EventBus {
    capacity: usize,
    shared: Arc<Shared>,
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl EventBus {
    /// A bus holding at most `capacity` queued events; `capacity` 0 makes a disabled bus that
    /// drops nothing and publishes nothing.
    pub fn start(capacity: usize, subscribers: Vec<Subscriber>) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        if capacity == 0 {
            return Ok(Self { capacity, shared, stop: None, thread: None });
        }
        let (stop, rx) = mpsc::channel::<()>();
        let sh = Arc::clone(&shared);
        let thread = std::thread::Builder::new().name("event-bus".into()).spawn(move || {
            let drain = |sh: &Shared| {
                let batch = std::mem::take(&mut *sh.queue.lock());
                for event in &batch {
                    for s in &subscribers {
                        s(event);
                    }
                }
            };
            while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(DRAIN_PERIOD) {
                drain(&sh);
            }
            // Stopping: deliver what is still queued.
            drain(&sh);
        })?;
        Ok(Self { capacity, shared, stop: Some(stop), thread: Some(thread) })
    }

    /// True when events are delivered.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Queues `event`; drops and counts it when the queue is full. Never blocks on a
    /// subscriber and never wakes a thread.
    pub fn publish(&self, event: Event) {
        publish(self.capacity, &self.shared, event);
    }

    /// A handle that publishes to this bus and owns nothing else (for observers installed in
    /// lower layers: no back-reference to the server). Events published after the bus
    /// stopped are queued, bounded, and never delivered.
    pub fn publisher(&self) -> Publisher {
        Publisher { capacity: self.capacity, shared: Arc::clone(&self.shared) }
    }

    /// Events dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Events accepted.
    pub fn published(&self) -> u64 {
        self.shared.published.load(Ordering::Relaxed)
    }

    /// Events queued now.
    pub fn depth(&self) -> i64 {
        self.shared.queue.lock().len() as i64
    }
}

fn publish(capacity: usize, shared: &Shared, event: Event) {
    if capacity == 0 {
        return;
    }
    let mut q = shared.queue.lock();
    if q.len() >= capacity {
        drop(q);
        shared.dropped.fetch_add(1, Ordering::Relaxed);
        return;
    }
    q.push_back(event);
    drop(q);
    shared.published.fetch_add(1, Ordering::Relaxed);
}

/// Publishes to an [`EventBus`] (see [`EventBus::publisher`]). Cheap to clone.
#[derive(Debug, Clone)]
pub struct Publisher {
    capacity: usize,
    shared: Arc<Shared>,
}

impl Publisher {
    /// As [`EventBus::publish`].
    pub fn publish(&self, event: Event) {
        publish(self.capacity, &self.shared, event);
    }
}

impl Drop for EventBus {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The logging subscriber: one debug line per event.
pub fn log_subscriber() -> Subscriber {
    Box::new(|e| tracing::debug!(event = ?e, "event"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Duration;

    #[test]
    fn delivers_in_order_to_every_subscriber() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s1 = Arc::clone(&seen);
        let bus = EventBus::start(16, vec![Box::new(move |e| s1.lock().unwrap().push(e.clone()))])
            .unwrap();
        for i in 0..10 {
            bus.publish(Event::Retrieved { request_id: format!("r{i}"), chunks: i });
        }
        drop(bus);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 10);
        assert_eq!(seen[3], Event::Retrieved { request_id: "r3".into(), chunks: 3 });
    }

    #[test]
    fn a_flooded_bus_drops_and_counts_without_blocking() {
        // A subscriber slower than the publisher: the queue of 8 fills and the rest drop.
        let bus =
            EventBus::start(8, vec![Box::new(|_| std::thread::sleep(Duration::from_millis(20)))])
                .unwrap();
        let started = std::time::Instant::now();
        for _ in 0..1000 {
            bus.publish(Event::SessionEnded { request_id: "x".into() });
        }
        assert!(started.elapsed() < Duration::from_millis(500), "publishing blocked");
        assert!(bus.dropped() > 900, "only {} dropped", bus.dropped());
        assert_eq!(
            bus.dropped() + bus.published(),
            1000,
            "every event is either queued or counted"
        );
        assert!(bus.depth() <= 8);
    }

    #[test]
    fn a_disabled_bus_is_inert() {
        let bus = EventBus::start(0, vec![]).unwrap();
        bus.publish(Event::SessionEnded { request_id: "x".into() });
        assert!(!bus.enabled());
        assert_eq!((bus.published(), bus.dropped()), (0, 0));
    }
}

/// Forwards the L2 tier's reports to the server's bus (and to the coordinator reporter).
#[derive(Debug)]
pub struct TierEvents(
    pub Publisher,
    pub Option<Arc<crate::fleet_report::Reporter>>,
    /// "Why was this a miss?" remembers L2 evictions, deletes and refused blobs.
    pub Arc<crate::explain::Explainer>,
);

impl TierEvents {
    fn publish(&self, e: Event) {
        self.0.publish(e);
    }
}

impl lmcache_storage::TierObserver for TierEvents {
    fn stored(&self, r: &lmcache_storage::StoreReport) {
        if let Some(rep) = &self.1 {
            rep.l2_stored(r.adapter, &r.keys);
        }
        self.2.l2_stored(&r.keys);
        let mut r = r.clone();
        r.keys = Vec::new();
        self.publish(Event::L2Stored(r));
    }
    fn evicted(&self, adapter: u64, keys: &[lmcache_core::ObjectKey], _bytes: u64) {
        if let Some(rep) = &self.1 {
            rep.l2_removed(adapter, keys);
        }
        self.2.l2_evicted(adapter, keys);
    }
    fn deleted(&self, adapter: u64, keys: &[lmcache_core::ObjectKey]) {
        if let Some(rep) = &self.1 {
            rep.l2_removed(adapter, keys);
        }
        self.2.l2_deleted(adapter, keys);
    }
    fn prefetched(&self, r: &lmcache_storage::PrefetchReport) {
        self.publish(Event::L2Prefetched(r.clone()));
    }
    fn blob_refused(&self, adapter: u64, key: &lmcache_core::ObjectKey, reason: &str) {
        self.2.blob_refused(adapter, key);
        self.publish(Event::L2BlobRefused {
            adapter,
            key: key.to_string(),
            reason: reason.to_owned(),
        });
    }
}

/// L1 removals to the KV event log and the bus.
#[derive(Debug)]
pub struct L1Events {
    /// The KV event log (engines' `subscribe_kv_events`).
    pub kv: Arc<crate::kv_events::KvEventLog>,
    /// The server's bus.
    pub bus: Publisher,
    /// The coordinator reporter, when reporting.
    pub reporter: Option<Arc<crate::fleet_report::Reporter>>,
    /// "Why was this a miss?": what stored each chunk, and why keys left.
    pub explain: Arc<crate::explain::Explainer>,
}

impl lmcache_l1::L1Listener for L1Events {
    fn committed(&self, key: &lmcache_core::ObjectKey, bytes: u64) {
        if let Some(rep) = &self.reporter {
            rep.l1_stored(key, bytes);
        }
        self.explain.committed(key);
    }
    fn removed_because(&self, key: &lmcache_core::ObjectKey, cause: lmcache_l1::RemovalCause) {
        self.explain.l1_removed(key, cause);
        self.removed(key);
    }
    fn removed(&self, key: &lmcache_core::ObjectKey) {
        if let Some(rep) = &self.reporter {
            rep.l1_removed(key);
        }
        lmcache_l1::L1Listener::removed(self.kv.as_ref(), key);
        self.bus.publish(Event::L1Removed {
            model: key.model_name.as_str().to_owned(),
            chunk_hash: key.chunk_hash.to_hex(),
        });
    }
}
