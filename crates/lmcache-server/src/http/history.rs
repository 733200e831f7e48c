//! `GET /status/history`: the last fifteen minutes of the figures the status page charts, one
//! sample every five seconds, so a page opened now draws the minutes before it was opened.
//! Sampled by a task on the HTTP runtime ([`run`]); a fixed ring, never more.

use std::collections::VecDeque;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::Serialize;

use super::*;

/// Seconds between samples.
pub const INTERVAL: Duration = Duration::from_secs(5);
/// Samples kept (fifteen minutes).
pub const KEEP: usize = 180;

/// The figures at one moment (counters are totals since start).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Sample {
    /// Unix milliseconds.
    pub t: u64,
    /// L1 bytes in use.
    pub l1_used_bytes: u64,
    /// L1 capacity.
    pub l1_capacity_bytes: u64,
    /// Tokens looked up.
    pub lookup_requested_tokens: u64,
    /// Tokens found.
    pub lookup_hit_tokens: u64,
    /// Lookups.
    pub lookups: u64,
    /// Stores finished.
    pub stores: u64,
    /// Retrieves finished.
    pub retrieves: u64,
    /// Objects the L2 write-behind has not written yet (`None` without L2).
    pub l2_unwritten_objects: Option<u64>,
}

/// The ring.
#[derive(Debug, Default)]
pub(crate) struct History(Mutex<VecDeque<Sample>>);

impl History {
    fn push(&self, s: Sample) {
        let mut q = self.0.lock();
        if q.len() == KEEP {
            q.pop_front();
        }
        q.push_back(s);
    }

    fn samples(&self) -> Vec<Sample> {
        self.0.lock().iter().copied().collect()
    }
}

fn sample(s: &ServerState) -> Sample {
    let u = s.l1().usage();
    let m = &s.metrics;
    Sample {
        t: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
        l1_used_bytes: u.used_bytes,
        l1_capacity_bytes: u.capacity,
        lookup_requested_tokens: m.lookup_requested_tokens.get(),
        lookup_hit_tokens: m.lookup_hit_tokens.get(),
        lookups: m.lookups.get(),
        stores: m.finished_stores.get(),
        retrieves: m.finished_retrieves.get(),
        l2_unwritten_objects: s.storage.has_l2().then(|| s.l1().unwritten() as u64),
    }
}

/// Samples every [`INTERVAL`] until the runtime stops.
pub(crate) async fn run(state: Shared) {
    let mut tick = tokio::time::interval(INTERVAL);
    loop {
        tick.tick().await;
        state.http.history.push(sample(&state));
    }
}

pub(super) async fn history(State(s): State<Shared>) -> Json<Value> {
    Json(json!({"interval_seconds": INTERVAL.as_secs(), "samples": s.http.history.samples()}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_samples() {
        let h = History::default();
        let s = |t| Sample {
            t,
            l1_used_bytes: 0,
            l1_capacity_bytes: 0,
            lookup_requested_tokens: 0,
            lookup_hit_tokens: 0,
            lookups: 0,
            stores: 0,
            retrieves: 0,
            l2_unwritten_objects: None,
        };
        for t in 0..(KEEP as u64 + 10) {
            h.push(s(t));
        }
        let got = h.samples();
        assert_eq!(got.len(), KEEP);
        assert_eq!((got[0].t, got[KEEP - 1].t), (10, KEEP as u64 + 9));
    }
}
