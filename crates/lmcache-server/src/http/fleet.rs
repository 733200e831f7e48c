//! `GET /fleet/snapshot`: this server's resident L1 keys, for a coordinator that lost some of
//! its cache events and resyncs (an lmcache-rs route; LMCache's server has none).
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

/// A frozen key list: id → (taken at, keys with bytes).
pub type Snapshots =
    parking_lot::Mutex<Vec<(u64, Instant, Arc<Vec<(lmcache_core::ObjectKey, u64)>>)>>;

const TTL: Duration = Duration::from_secs(60);
const KEPT: usize = 4;

#[derive(Debug, Deserialize)]
pub(super) struct SnapshotQuery {
    #[serde(default)]
    page_token: Option<String>,
    #[serde(default)]
    page_size: Option<usize>,
}

pub(super) async fn snapshot(State(s): State<Shared>, Query(q): Query<SnapshotQuery>) -> Response {
    let size = q.page_size.unwrap_or(5000);
    if size == 0 || size > 50_000 {
        return error(StatusCode::BAD_REQUEST, format!("page_size: {size} is outside 1..=50000"));
    }
    let now = Instant::now();
    let (id, offset, keys) = match q.page_token.as_deref() {
        None => {
            let keys = Arc::new(s.l1().resident_keys());
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
            match all.iter().find(|(i, at, _)| *i == id && now.duration_since(*at) < TTL) {
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
        .iter()
        .skip(offset)
        .take(size)
        .map(|(k, bytes)| json!({"key": super::cache::encode_key(k), "size_bytes": bytes}))
        .collect();
    let shown = offset.saturating_add(entries.len());
    let next = (shown < keys.len()).then(|| format!("{id}:{shown}"));
    Json(json!({
        "instance_id": s.channels.reporter.as_ref().and_then(|r| r.registered_as.lock().clone()),
        "incarnation": s.channels.reporter.as_ref().map(|r| r.incarnation()),
        "tier": "l1",
        "backend": "dram",
        "total": keys.len(),
        "entries": entries,
        "next_page_token": next,
    }))
    .into_response()
}
