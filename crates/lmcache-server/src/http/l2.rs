//! The L2 tier at run time: `/reconfigure/{backend}/l2/status|add|remove` and prefetches
//! asked over HTTP (`POST /cache/prefetches`, `GET /cache/prefetches/{id}`).

use super::*;

pub(super) async fn reconfigure_status(
    State(s): State<Shared>,
    axum::extract::Path(backend): axum::extract::Path<String>,
) -> Json<Value> {
    let adapters = l2_status(&s);
    Json(json!({"enabled": s.storage.has_l2(), "backend": backend,
                "num_adapters": adapters.len(), "adapters": adapters}))
}

/// `POST /reconfigure/{backend}/l2/add` with an adapter spec (`{"spec": {...}}` or the spec
/// itself), or `.../remove` with `{"adapter_index": id}`.
pub(super) async fn reconfigure(
    State(s): State<Shared>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<std::net::SocketAddr>,
    axum::extract::Path((_backend, op)): axum::extract::Path<(String, String)>,
    body: Option<Json<Value>>,
) -> Response {
    if !s.storage.has_l2() {
        return error(
            StatusCode::CONFLICT,
            "no L2 tier: start the server with at least one --l2-adapter to reconfigure L2",
        );
    }
    let body = body.map(|Json(v)| v).unwrap_or(Value::Null);
    match op.as_str() {
        "add" => {
            let spec = body.get("spec").cloned().unwrap_or(body);
            let target = endpoint_of(&spec);
            match s.storage.add_adapter(spec).await {
                Ok(id) => {
                    tracing::warn!(%peer, id, target = %target, "L2 adapter added over HTTP");
                    Json(json!({"status": "ok", "adapter_index": id})).into_response()
                }
                Err(e) => {
                    tracing::warn!(%peer, target = %target, error = %e, "L2 adapter refused");
                    error(StatusCode::BAD_REQUEST, public_reason(&e))
                }
            }
        }
        "remove" => match body.get("adapter_index").and_then(Value::as_u64) {
            None => error(StatusCode::BAD_REQUEST, "adapter_index: missing or not an integer"),
            Some(id) => match s.storage.remove_adapter(id).await {
                Ok(()) => Json(json!({"status": "ok", "removed": id})).into_response(),
                Err(_) => error(StatusCode::NOT_FOUND, format!("adapter_index: no adapter {id}")),
            },
        },
        other => {
            error(StatusCode::BAD_REQUEST, format!("operation: {other:?} is not add or remove"))
        }
    }
}

/// What an adapter spec points at, for the log: type, then its path or endpoint (never a
/// password or key).
fn endpoint_of(spec: &Value) -> String {
    let g = |k: &str| spec.get(k).map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned));
    let kind = g("type").unwrap_or_else(|| "?".into());
    let at = ["base_path", "device_path", "endpoint_url", "bucket", "host", "startup_nodes", "url"]
        .iter()
        .filter_map(|k| g(k).map(|v| format!("{k}={v}")))
        .collect::<Vec<_>>()
        .join(" ");
    format!("{kind} {at}")
}

/// A refused adapter's reason for the HTTP caller. Opening a path the caller named may fail
/// with an OS error about a file the caller should learn nothing about (does it exist, who
/// may read it): for `base_path` and `device_path` only our own checks are echoed; the OS
/// error goes to the log.
fn public_reason(e: &lmcache_storage::StorageError) -> String {
    if let lmcache_storage::StorageError::Config(c) = e
        && matches!(
            c.field.as_str(),
            "base_path" | "device_path" | "inner.base_path" | "inner.device_path"
        )
        && !c.reason.contains("--l2-allowed-root")
    {
        return format!(
            "L2 adapter #{} ({}): {}: cannot be opened (the server log says why)",
            c.index, c.kind, c.field
        );
    }
    e.to_string()
}

#[derive(Debug, Deserialize)]
pub(super) struct PrefetchBody {
    model_name: String,
    #[serde(default = "one")]
    world_size: u32,
    token_ids: Vec<i64>,
    #[serde(default)]
    cache_salt: String,
    #[serde(default)]
    source_tier: Option<String>,
    #[serde(default)]
    target_tier: Option<String>,
}

pub(super) fn one() -> u32 {
    1
}

static HTTP_PREFETCH_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// `POST /cache/prefetches`: warm L1 from L2 for a prompt, ahead of the request (202).
pub(super) async fn prefetch_submit(State(s): State<Shared>, raw: axum::body::Bytes) -> Response {
    let b: PrefetchBody = match serde_json::from_slice(&raw) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("body: {e}")),
    };
    if b.source_tier.as_deref().is_some_and(|t| t != "l2") {
        return error(StatusCode::BAD_REQUEST, "source_tier: only l2 is supported");
    }
    if b.target_tier.as_deref().is_some_and(|t| t != "l1") {
        return error(StatusCode::BAD_REQUEST, "target_tier: only l1 is supported");
    }
    if !s.storage.has_l2() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "no L2 tier (start with --l2-adapter)");
    }
    let tokens = match lmcache_core::hashing::tokens_from_i64(&b.token_ids) {
        Ok(t) => t,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("token_ids: {e}")),
    };
    let hashes = s.hasher.hash_tokens(&tokens);
    if hashes.is_empty() {
        return (StatusCode::ACCEPTED, Json(json!({"chunks": 0, "status": "noop"})))
            .into_response();
    }
    let mut shards = Vec::new();
    for w in 0..b.world_size {
        let keys: Result<Vec<lmcache_core::ObjectKey>, _> = hashes
            .iter()
            .map(|h| {
                lmcache_core::ObjectKey::new(
                    *h.as_bytes(),
                    &b.model_name,
                    b.world_size,
                    w,
                    0,
                    &b.cache_salt,
                )
            })
            .collect();
        match keys {
            Ok(k) => shards.push(k),
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("key: {e}")),
        }
    }
    let total = shards.iter().map(Vec::len).sum::<usize>();
    let id = format!(
        "prefetch-{}",
        HTTP_PREFETCH_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    {
        let mut jobs = s.http.prefetches.lock();
        if jobs.len() >= 10_000 {
            return error(StatusCode::SERVICE_UNAVAILABLE, "too many unpolled prefetches");
        }
        jobs.insert(id.clone(), None);
    }
    let (me, rid, chunks) = (s.clone(), id.clone(), hashes.len());
    let req = lmcache_storage::PrefetchRequest { shards, readers: 1 };
    let started = s.storage.prefetch(req, move |out| {
        // The leases drop here: loaded objects stay in L1 under its eviction policy.
        let found = out.hits * out.leases.len();
        me.http.prefetches.lock().insert(rid, Some((found, total)));
    });
    if let Err(e) = started {
        s.http.prefetches.lock().remove(&id);
        return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string());
    }
    (StatusCode::ACCEPTED, Json(json!({"request_id": id, "chunks": chunks, "status": "submitted"})))
        .into_response()
}

/// `GET /cache/prefetches/{request_id}`: pending, or completed once (then forgotten).
pub(super) async fn prefetch_status(
    State(s): State<Shared>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let mut jobs = s.http.prefetches.lock();
    match jobs.get(&id).copied() {
        None => error(StatusCode::NOT_FOUND, format!("request_id: no prefetch {id:?}")),
        Some(None) => Json(json!({"request_id": id, "status": "pending"})).into_response(),
        Some(Some((found, total))) => {
            jobs.remove(&id);
            Json(json!({"request_id": id, "status": "completed", "found_keys": found,
                        "total_keys": total}))
            .into_response()
        }
    }
}
