//! The repair thread: when an emitter's stream has a gap (a lost batch, or a new incarnation
//! whose first batches are missing), it fetches the server's resident L1 keys from
//! `GET /fleet/snapshot` (an lmcache-rs server route, paginated from one frozen list) and
//! resyncs them ([`Fleet::resync_page`], [`Fleet::resync_finish`]). A server without the route
//! (LMCache's) or one that cannot be reached has its L1 placements fenced instead: the
//! directory may then under-credit it until new events arrive, never over-credit it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use lmcache_protocol::coordinator::EncodedObjectKey;
use serde::Deserialize;

use crate::fleet::{Fleet, RepairOutcome};

/// A whole repair (every page) gets at most this long.
const DEADLINE: Duration = Duration::from_secs(30);
const PAGE: usize = 5000;

#[derive(Debug, Deserialize)]
struct SnapshotEntry {
    key: EncodedObjectKey,
    #[serde(default)]
    size_bytes: u64,
}

#[derive(Debug, Deserialize)]
struct SnapshotPage {
    #[serde(default)]
    incarnation: Option<u64>,
    #[serde(default = "dram")]
    backend: String,
    #[serde(default)]
    entries: Vec<SnapshotEntry>,
    #[serde(default)]
    next_page_token: Option<String>,
}

fn dram() -> String {
    "dram".into()
}

/// How often repairs of instances not registered yet are retried.
const RETRY: Duration = Duration::from_millis(100);

/// Serves repair requests until `stop` is set and the channel closes (the fleet drops its
/// sender: [`Fleet::close_repairer`]). It sleeps on the channel: idle, it wakes only for a
/// request, and only while repairs wait for their instance to register does it also wake to
/// retry them.
pub(crate) fn run(fleet: Arc<Fleet>, rx: Receiver<String>, stop: Arc<AtomicBool>) {
    let agent = crate::server_client::ServerClient::new(
        Duration::from_secs(10),
        fleet.config().server_http_auth_token.as_deref(),
    );
    // Repairs of instances not registered (yet): retried until they register, as a server
    // does within a heartbeat of a coordinator restart, or until UNREGISTERED_WAIT.
    let mut waiting: Vec<(String, Instant)> = Vec::new();
    while !stop.load(Ordering::Acquire) {
        let next = if waiting.is_empty() {
            rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
        } else {
            rx.recv_timeout(RETRY)
        };
        match next {
            Ok(id) => {
                if repair(&fleet, &agent, &id, &stop) == Step::NotRegistered {
                    waiting.push((id, Instant::now()));
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        let mut still = Vec::new();
        for (id, since) in std::mem::take(&mut waiting) {
            match repair(&fleet, &agent, &id, &stop) {
                Step::NotRegistered if since.elapsed() < UNREGISTERED_WAIT => {
                    still.push((id, since))
                }
                Step::NotRegistered => {
                    if let Some(inc) = fleet.repair_incarnation(&id) {
                        tracing::warn!(instance = %id, waited_s = UNREGISTERED_WAIT.as_secs(),
                            "stream gap, and the instance never registered: fencing its L1 placements");
                        fleet.resync_finish(&id, inc, true);
                    }
                }
                Step::Done(_) => {}
            }
        }
        waiting = still;
    }
}

/// How long a repair waits for its instance to (re-)register before fencing it.
const UNREGISTERED_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, PartialEq, Eq)]
enum Step {
    Done(RepairOutcome),
    /// The instance is not registered: try again later.
    NotRegistered,
}

fn repair(
    fleet: &Fleet,
    agent: &crate::server_client::ServerClient,
    id: &str,
    stop: &AtomicBool,
) -> Step {
    let Some(target) = fleet.repair_target(id) else {
        return match fleet.repair_incarnation(id) {
            Some(_) => Step::NotRegistered,
            None => Step::Done(RepairOutcome::Superseded),
        };
    };
    Step::Done(resync(fleet, agent, id, stop, &target))
}

fn resync(
    fleet: &Fleet,
    agent: &crate::server_client::ServerClient,
    id: &str,
    stop: &AtomicBool,
    target: &crate::fleet::RepairTarget,
) -> RepairOutcome {
    let started = Instant::now();
    let mut token: Option<String> = None;
    loop {
        if stop.load(Ordering::Acquire) {
            return RepairOutcome::Superseded;
        }
        let mut url = format!("/fleet/snapshot?page_size={PAGE}");
        if let Some(t) = &token {
            url.push_str("&page_token=");
            url.push_str(t);
        }
        let page = match fetch(agent, &target.endpoint, &url) {
            Ok(p) => p,
            Err(why) => {
                tracing::warn!(instance = %id, url = %url, "cannot resync from a snapshot ({why}): fencing its L1 placements");
                return fleet.resync_finish(id, target.incarnation, true);
            }
        };
        if page.incarnation != Some(target.incarnation) {
            tracing::warn!(instance = %id, want = target.incarnation, got = ?page.incarnation,
                "the snapshot is of another incarnation: fencing its L1 placements");
            return fleet.resync_finish(id, target.incarnation, true);
        }
        let entries: Vec<(EncodedObjectKey, u64)> =
            page.entries.into_iter().map(|e| (e.key, e.size_bytes)).collect();
        match fleet.resync_page(id, target.incarnation, &page.backend, &entries) {
            Ok(true) => {}
            Ok(false) => return RepairOutcome::Superseded,
            Err(e) => {
                tracing::warn!(instance = %id, error = %e, "a snapshot page was refused: fencing its L1 placements");
                return fleet.resync_finish(id, target.incarnation, true);
            }
        }
        match page.next_page_token {
            Some(t) if started.elapsed() < DEADLINE => token = Some(t),
            Some(_) => {
                tracing::warn!(instance = %id, "the snapshot took longer than {DEADLINE:?}: fencing its L1 placements");
                return fleet.resync_finish(id, target.incarnation, true);
            }
            None => return fleet.resync_finish(id, target.incarnation, false),
        }
    }
}

fn fetch(
    agent: &crate::server_client::ServerClient,
    to: &crate::fleet::Endpoint,
    path: &str,
) -> Result<SnapshotPage, String> {
    let mut r = agent.get(to, path).call().map_err(|e| e.to_string())?;
    if !r.status().is_success() {
        return Err(format!("HTTP {}", r.status().as_u16()));
    }
    let text =
        r.body_mut().with_config().limit(256 << 20).read_to_string().map_err(|e| e.to_string())?;
    serde_json::from_str(&text).map_err(|e| format!("bad snapshot page: {e}"))
}
