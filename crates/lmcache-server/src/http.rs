//! The HTTP API (axum), LMCache's routes and JSON shapes: `GET /`, `/healthcheck`, `/status`,
//! `/metrics`; `POST /cache/clear`, `/cache/checksums`. Errors are `{"detail": ...}` with a
//! 4xx status naming what was wrong.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Json, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::registry::Family;
use crate::state::ServerState;
use crate::transfer::{CpuTransfer, PagedGeometry, checksums, compress_ranges};

type Shared = Arc<ServerState>;

/// The router.
pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/", get(|| async { Json(json!({"status": "ok", "service": "LMCache HTTP API"})) }))
        .route("/healthcheck", get(|| async { Json(json!({"status": "healthy"})) }))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/cache/clear", post(clear))
        .route("/cache/checksums", post(cache_checksums))
        .with_state(state)
}

fn error(code: StatusCode, detail: impl Into<String>) -> Response {
    (code, Json(json!({"detail": detail.into()}))).into_response()
}

async fn status(State(s): State<Shared>) -> Json<Value> {
    let u = s.l1.usage();
    let arena = s.l1.memory().arena();
    let instances: Vec<Value> = s
        .registry
        .list()
        .into_iter()
        .map(|(fam, id, model, ws)| {
            json!({
                "instance_id": id,
                "transfer_mode": if fam == Family::EngineDriven { "engine_driven" } else { "lmcache_driven" },
                "model_name": model,
                "world_size": ws,
            })
        })
        .collect();
    Json(json!({
        "is_healthy": true,
        "engine_type": "default",
        "server": "lmcache-rs",
        "version": env!("CARGO_PKG_VERSION"),
        "chunk_size": s.chunk_size(),
        "hash_algorithm": "blake3",
        "active_sessions": s.sessions.len(),
        "uptime_seconds": s.started.elapsed().as_secs_f64(),
        "registered_instances": instances,
        "storage_manager": {
            "l1": {
                "capacity_bytes": u.capacity,
                "used_bytes": u.used_bytes,
                "usage": u.usage_fraction(),
                "resident_objects": u.resident_objects,
                "staged_objects": u.staged_objects,
                "locked_objects": u.locked_objects,
                "eviction_policy": s.l1.config().eviction_policy.as_str(),
                "backing": arena.kind().as_str(),
                "shm_name": arena.shm_name(),
                "evicted_objects": u.stats.evicted_objects,
            }
        }
    }))
}

async fn metrics(State(s): State<Shared>) -> Response {
    let u = s.l1.usage();
    s.metrics.l1_used_bytes.set(u.used_bytes as i64);
    s.metrics.l1_capacity_bytes.set(u.capacity as i64);
    s.metrics.active_sessions.set(s.sessions.len() as i64);
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        s.metrics.encode(),
    )
        .into_response()
}

#[derive(Debug, Deserialize, Default)]
struct ClearBody {
    #[serde(default)]
    tier: Option<String>,
    #[serde(default)]
    force: bool,
}

async fn clear(State(s): State<Shared>, raw: axum::body::Bytes) -> Response {
    // The body is optional (LMCache's CLI may send none): empty means defaults.
    let body: ClearBody = if raw.iter().all(u8::is_ascii_whitespace) {
        ClearBody::default()
    } else {
        match serde_json::from_slice(&raw) {
            Ok(b) => b,
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("body: {e}")),
        }
    };
    let tier = body.tier.unwrap_or_else(|| "l1".into());
    if tier != "l1" && tier != "all" {
        return error(
            StatusCode::BAD_REQUEST,
            format!("tier: unknown tier {tier:?} (only l1 exists)"),
        );
    }
    let r = s.l1.clear(body.force);
    Json(json!({"status": "ok", "cleared": {"tier": tier, "removed": r.removed, "skipped": r.skipped}}))
        .into_response()
}

#[derive(Debug, Deserialize)]
struct ChecksumBody {
    #[serde(default)]
    block_ids: Vec<u64>,
    #[serde(default)]
    chunk_size: i64,
    #[serde(default)]
    instance_id: u64,
    #[serde(default)]
    layerwise: bool,
}

async fn cache_checksums(State(s): State<Shared>, Json(b): Json<ChecksumBody>) -> Response {
    let Some(inst) = s.registry.get(Family::LmcacheDriven, b.instance_id) else {
        return error(
            StatusCode::NOT_FOUND,
            format!("instance_id {} not registered", b.instance_id),
        );
    };
    if b.block_ids.is_empty() {
        return error(StatusCode::BAD_REQUEST, "block_ids is required");
    }
    if b.chunk_size <= 0 {
        return error(StatusCode::BAD_REQUEST, "chunk_size must be positive");
    }
    let crate::registry::Registration::LmcacheDriven { layers, block_size, num_blocks, .. } =
        &inst.registration
    else {
        return error(StatusCode::NOT_IMPLEMENTED, "checksum not supported for this registration");
    };
    let geometry = PagedGeometry {
        kv: inst.layout.kv,
        num_blocks: *num_blocks,
        block_size: *block_size,
        hidden: inst.layout.hidden,
        dtype: inst.layout.dtype,
    };
    let t = CpuTransfer { layers, geometry, threads: 1 };
    let sums = match checksums(&t, &b.block_ids, b.chunk_size as usize, b.layerwise) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("block_ids: {e}")),
    };
    let num_chunks = sums.first().map_or(0, Vec::len);
    let chunk_checksums = if b.layerwise {
        let m: serde_json::Map<String, Value> =
            sums.into_iter().enumerate().map(|(i, v)| (format!("layer_{i}"), json!(v))).collect();
        Value::Object(m)
    } else {
        json!(sums.into_iter().next().unwrap_or_default())
    };
    Json(json!({
        "status": "success",
        "chunk_size": b.chunk_size,
        "num_chunks": num_chunks,
        "chunk_checksums": chunk_checksums,
        "layerwise": b.layerwise,
        "block_id_ranges": compress_ranges(&b.block_ids),
    }))
    .into_response()
}
