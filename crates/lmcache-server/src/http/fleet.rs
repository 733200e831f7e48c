//! `GET /fleet/snapshot`: this server's resident L1 keys, for a coordinator that lost some of
//! its cache events and resyncs (an lmcache-rs route; LMCache's server has none). With
//! `tier=l2`, the keys of every L2 adapter it reports to the coordinator, each entry naming its
//! `backend` and whether it is `shared`, as its cache events name them; `complete` is false
//! when an adapter could not be listed whole (at most [`L2_MAX`] keys are listed).
//!
//! The first page (no `page_token`) freezes the key list, so later pages come from the same
//! moment whatever the server does meanwhile; a frozen list lives 60 s and at most 4 are
//! kept. Every page names the reporter's incarnation, so a coordinator never mixes a
//! snapshot into another incarnation's stream.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Json, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Shared, error};

/// A frozen key list: id → (taken at, the list).
pub type Snapshots = parking_lot::Mutex<Vec<(u64, Instant, Arc<Frozen>)>>;

/// One frozen list of keys.
#[derive(Debug, Default)]
pub struct Frozen {
    /// `l2` when these are L2 keys.
    l2: bool,
    /// Keys, their bytes, and (L2) the index of their backend in `backends`.
    keys: Vec<(lmcache_core::ObjectKey, u64, usize)>,
    /// (backend, shared) of the L2 adapters listed.
    backends: Vec<(String, bool)>,
    /// Whether every adapter was listed whole.
    complete: bool,
}

const TTL: Duration = Duration::from_secs(60);
const KEPT: usize = 4;
/// Most L2 keys one snapshot lists.
pub const L2_MAX: usize = 1_000_000;

#[derive(Debug, Deserialize)]
pub(super) struct SnapshotQuery {
    #[serde(default)]
    page_token: Option<String>,
    #[serde(default)]
    page_size: Option<usize>,
    /// `l1` (the default) or `l2`.
    #[serde(default)]
    tier: Option<String>,
}

/// Every L2 adapter's keys, as the reporter names the adapters.
async fn list_l2(s: &super::ServerState) -> Frozen {
    let mut out = Frozen { l2: true, complete: true, ..Frozen::default() };
    let Some(reporter) = s.channels.reporter.as_ref() else { return out };
    let mut adapters: Vec<(u64, (String, bool))> = reporter.l2_topology().into_iter().collect();
    adapters.sort_by_key(|(id, _)| *id);
    for (id, backend) in adapters {
        let b = out.backends.len();
        out.backends.push(backend);
        let mut cursor = None;
        loop {
            let room = L2_MAX.saturating_sub(out.keys.len());
            if room == 0 {
                out.complete = false;
                break;
            }
            let page = s
                .storage
                .list_l2(Some(id), lmcache_l2::KeyFilter::ALL, cursor.take(), room.min(10_000))
                .await;
            match page {
                Ok(l) => {
                    out.keys.extend(l.page.keys.into_iter().map(|(k, n)| (k, n, b)));
                    match l.page.next {
                        Some(next) => cursor = Some(next),
                        None => break,
                    }
                }
                Err(e) => {
                    tracing::warn!(adapter = id, error = %e, "fleet snapshot: cannot list this L2 adapter");
                    out.complete = false;
                    break;
                }
            }
        }
    }
    out
}

pub(super) async fn snapshot(State(s): State<Shared>, Query(q): Query<SnapshotQuery>) -> Response {
    let size = q.page_size.unwrap_or(5000);
    if size == 0 || size > 50_000 {
        return error(StatusCode::BAD_REQUEST, format!("page_size: {size} is outside 1..=50000"));
    }
    let l2 = match q.tier.as_deref() {
        None | Some("l1") => false,
        Some("l2") => true,
        Some(other) => {
            return error(StatusCode::BAD_REQUEST, format!("tier: {other:?} is not l1 or l2"));
        }
    };
    let now = Instant::now();
    let (id, offset, keys) = match q.page_token.as_deref() {
        None => {
            let keys = Arc::new(if l2 {
                list_l2(&s).await
            } else {
                Frozen {
                    keys: s.l1().resident_keys().into_iter().map(|(k, n)| (k, n, 0)).collect(),
                    complete: true,
                    ..Frozen::default()
                }
            });
            let mut all = s.http.snapshots.lock();
            all.retain(|(_, at, _)| now.duration_since(*at) < TTL);
            if all.len() >= KEPT {
                all.remove(0);
            }
            let id = all.last().map_or(1, |(id, _, _)| id + 1);
            all.push((id, now, Arc::clone(&keys)));
            (id, 0usize, keys)
        }
        Some(token) => {
            let parsed = token
                .split_once(':')
                .and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<usize>().ok()?)));
            let Some((id, offset)) = parsed else {
                return error(
                    StatusCode::BAD_REQUEST,
                    "page_token: not a token this server issued",
                );
            };
            let all = s.http.snapshots.lock();
            match all
                .iter()
                .find(|(i, at, f)| *i == id && now.duration_since(*at) < TTL && f.l2 == l2)
            {
                Some((_, _, keys)) => (id, offset, Arc::clone(keys)),
                None => {
                    return error(
                        StatusCode::GONE,
                        "page_token: this snapshot expired; start again",
                    );
                }
            }
        }
    };
    let entries: Vec<Value> = keys
        .keys
        .iter()
        .skip(offset)
        .take(size)
        .map(|(k, bytes, b)| {
            let mut e = json!({"key": super::cache::encode_key(k), "size_bytes": bytes});
            if let Some((backend, shared)) = keys.l2.then(|| keys.backends.get(*b)).flatten() {
                e["backend"] = json!(backend);
                e["shared"] = json!(shared);
            }
            e
        })
        .collect();
    let shown = offset.saturating_add(entries.len());
    let next = (shown < keys.keys.len()).then(|| format!("{id}:{shown}"));
    let mut page = json!({
        "instance_id": s.channels.reporter.as_ref().and_then(|r| r.registered_as.lock().clone()),
        "incarnation": s.channels.reporter.as_ref().map(|r| r.incarnation()),
        "tier": if keys.l2 { "l2" } else { "l1" },
        "total": keys.keys.len(),
        "complete": keys.complete,
        "entries": entries,
        "next_page_token": next,
    });
    if !keys.l2 {
        page["backend"] = json!("dram");
    }
    Json(page).into_response()
}
