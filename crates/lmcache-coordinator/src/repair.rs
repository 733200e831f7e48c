//! The repair thread: when an emitter's stream has a gap (a lost batch, or a new incarnation
//! whose first batches are missing), it fetches the server's resident L1 keys from
//! `GET /fleet/snapshot` (an lmcache-rs server route, paginated from one frozen list) and
//! resyncs them ([`Fleet::resync_page`], [`Fleet::resync_finish`]), then its L2 keys from
//! `GET /fleet/snapshot?tier=l2` ([`Fleet::resync_l2_page`]): listed keys are upserted at
//! their backend, and with a whole listing the instance's private L2 placements it did not
//! name go (a shared pool's are only upserted: another mounter may have written them). A server without the route
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
    /// The L2 backend (L2 snapshots).
    #[serde(default)]
    backend: Option<String>,
    /// Whether that backend is a shared pool (L2 snapshots).
    #[serde(default)]
    shared: bool,
}

#[derive(Debug, Deserialize)]
struct SnapshotPage {
    #[serde(default)]
    incarnation: Option<u64>,
    /// `l1`, or `l2` from a server that lists its L2 (an older one ignores `tier=l2`).
    #[serde(default)]
    tier: Option<String>,
    /// False when the server could not list everything (the sweep is then skipped).
    #[serde(default = "yes")]
    complete: bool,
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

fn yes() -> bool {
    true
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
        let url = page_url(None, token.as_deref());
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
            None => {
                let l2 = resync_l2(fleet, agent, id, stop, target, started);
                return fleet.resync_finish_with(id, target.incarnation, false, l2);
            }
        }
    }
}

/// The L2 half of a resync, after the L1 half succeeded: the server's L2 keys from
/// `GET /fleet/snapshot?tier=l2`, upserted as placements. True when the listing was whole
/// and applied, so that the instance's private L2 placements it did not name can go. A server
/// that does not list its L2, or fails to, leaves the L2 placements as they are (logged).
fn resync_l2(
    fleet: &Fleet,
    agent: &crate::server_client::ServerClient,
    id: &str,
    stop: &AtomicBool,
    target: &crate::fleet::RepairTarget,
    started: Instant,
) -> bool {
    let mut token: Option<String> = None;
    let mut complete = true;
    loop {
        if stop.load(Ordering::Acquire) {
            return false;
        }
        let url = page_url(Some("l2"), token.as_deref());
        let page = match fetch(agent, &target.endpoint, &url) {
            Ok(p) => p,
            Err(why) => {
                tracing::warn!(instance = %id, url = %url, "cannot resync L2 from a snapshot ({why}): its L2 placements stay as reported");
                return false;
            }
        };
        if page.tier.as_deref() != Some("l2") {
            tracing::debug!(instance = %id, "the server does not list its L2: its L2 placements stay as reported");
            return false;
        }
        if page.incarnation != Some(target.incarnation) {
            tracing::warn!(instance = %id, "the L2 snapshot is of another incarnation: its L2 placements stay as reported");
            return false;
        }
        complete &= page.complete;
        let entries: Vec<(EncodedObjectKey, u64, String, bool)> = page
            .entries
            .into_iter()
            .filter_map(|e| Some((e.key, e.size_bytes, e.backend?, e.shared)))
            .collect();
        match fleet.resync_l2_page(id, target.incarnation, &entries) {
            Ok(true) => {}
            Ok(false) => return false,
            Err(e) => {
                tracing::warn!(instance = %id, error = %e, "an L2 snapshot page was refused: its L2 placements stay as reported");
                return false;
            }
        }
        match page.next_page_token {
            Some(t) if started.elapsed() < DEADLINE => token = Some(t),
            Some(_) => {
                tracing::warn!(instance = %id, "the L2 snapshot took longer than {DEADLINE:?}: not swept");
                return false;
            }
            None => return complete,
        }
    }
}

/// One page of the server's snapshot (its L1, or with `tier` that tier): the first without
/// `token`, then from it.
fn page_url(tier: Option<&str>, token: Option<&str>) -> String {
    let url = match tier {
        Some(t) => format!("/fleet/snapshot?tier={t}&page_size={PAGE}"),
        None => format!("/fleet/snapshot?page_size={PAGE}"),
    };
    match token {
        Some(t) => format!("{url}&page_token={t}"),
        None => url,
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
