//! The event bus: typed events from request paths to subscribers (logging, metrics), through a
//! bounded queue drained by its own thread.
//!
//! Publishing never blocks: when the queue is full the event is dropped and counted
//! (`lmcache_mp_event_bus_dropped_events_total`); LMCache's bus drops silently. The queue depth
//! is exported too. Subscribers run on the drain thread, never on a request path. The bus stops
//! when dropped: the drain thread finishes what is queued and exits.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
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

#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    dropped: AtomicU64,
    depth: AtomicI64,
}

/// The bus. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct EventBus {
    tx: Option<SyncSender<Event>>,
    counters: Arc<Counters>,
    thread: Option<JoinHandle<()>>,
}

impl EventBus {
    /// A bus holding at most `capacity` queued events; `capacity` 0 makes a disabled bus that
    /// drops nothing and publishes nothing.
    pub fn start(capacity: usize, subscribers: Vec<Subscriber>) -> std::io::Result<Self> {
        let counters = Arc::new(Counters::default());
        if capacity == 0 {
            return Ok(Self { tx: None, counters, thread: None });
        }
        let (tx, rx): (SyncSender<Event>, Receiver<Event>) = mpsc::sync_channel(capacity);
        let c = Arc::clone(&counters);
        let thread = std::thread::Builder::new().name("event-bus".into()).spawn(move || {
            for event in rx {
                c.depth.fetch_sub(1, Ordering::Relaxed);
                for s in &subscribers {
                    s(&event);
                }
            }
        })?;
        Ok(Self { tx: Some(tx), counters, thread: Some(thread) })
    }

    /// True when events are delivered.
    pub fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    /// Queues `event`; drops and counts it when the queue is full. Never blocks.
    pub fn publish(&self, event: Event) {
        let Some(tx) = &self.tx else { return };
        self.counters.depth.fetch_add(1, Ordering::Relaxed);
        match tx.try_send(event) {
            Ok(()) => {
                self.counters.published.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counters.depth.fetch_sub(1, Ordering::Relaxed);
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Events dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }

    /// Events accepted.
    pub fn published(&self) -> u64 {
        self.counters.published.load(Ordering::Relaxed)
    }

    /// Events queued now.
    pub fn depth(&self) -> i64 {
        self.counters.depth.load(Ordering::Relaxed).max(0)
    }
}

impl Drop for EventBus {
    fn drop(&mut self) {
        drop(self.tx.take());
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
        assert!(bus.depth() <= 9);
    }

    #[test]
    fn a_disabled_bus_is_inert() {
        let bus = EventBus::start(0, vec![]).unwrap();
        bus.publish(Event::SessionEnded { request_id: "x".into() });
        assert!(!bus.enabled());
        assert_eq!((bus.published(), bus.dropped()), (0, 0));
    }
}
