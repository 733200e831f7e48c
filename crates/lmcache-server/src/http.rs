//! The HTTP API (axum), LMCache's routes and JSON shapes: `GET /`, `/healthcheck`, `/status`,
//! `/metrics`; `POST /cache/clear`, `/cache/checksums`; `GET /quota`, `GET|PUT|DELETE
//! /quota/{cache_salt}` (`_default` is the empty salt; `?tier=l1`, the default, limits L1:
//! admission and eviction per tenant; `?tier=l2` limits every L2 adapter the same way). Errors are `{"detail": ...}` with a 4xx status naming what was wrong.
//! With `--http-auth-token` (or `LMCACHE_RS_HTTP_TOKEN`) every route but `/healthcheck`
//! requires `Authorization: Bearer <token>`; there is no route that dumps the environment or
//! runs code.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Json, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use lmcache_core::CacheSalt;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::registry::Family;
use crate::state::ServerState;
use crate::transfer::{CpuTransfer, checksums, compress_ranges};

type Shared = Arc<ServerState>;

/// Constant-time comparison, so response timing does not leak the token.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Refuses requests without the configured bearer token (none configured: all pass).
async fn auth(
    State(s): State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(token) = &s.config.http_auth_token
        && req.uri().path() != "/healthcheck"
    {
        let given = req
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same(g.as_bytes(), token.as_bytes())) {
            return error(StatusCode::UNAUTHORIZED, "authorization: missing or wrong bearer token");
        }
    }
    next.run(req).await
}

/// The router.
pub fn router(state: Shared) -> Router {
    let guard = axum::middleware::from_fn_with_state(state.clone(), auth);
    Router::new()
        .route("/", get(|| async { Json(json!({"status": "ok", "service": "LMCache HTTP API"})) }))
        .route("/healthcheck", get(|| async { Json(json!({"status": "healthy"})) }))
        .route("/status", get(status))
        .route("/version", get(version))
        .route("/lmc_version", get(version))
        .route(
            "/commit_id",
            get(|| async {
                Json(json!({"commit_id": option_env!("LMCACHE_RS_COMMIT").unwrap_or("unknown")}))
            }),
        )
        .route("/config", get(config))
        .route("/config/adapters", get(config_adapters))
        .route("/reconfigure/{backend}/l2/status", get(reconfigure_status))
        .route("/reconfigure/{backend}/l2/{operation}", post(reconfigure))
        .route("/metrics", get(metrics))
        .route("/metrics/reset", post(metrics_reset))
        .route("/cache/prefetches", post(prefetch_submit))
        .route("/cache/prefetches/{request_id}", get(prefetch_status))
        .route("/cache/clear", post(clear))
        .route("/cache/objects", get(objects_list).delete(objects_delete))
        .route("/cache/checksums", post(cache_checksums))
        .route("/quota", get(quota_list))
        .route("/quota/{salt}", get(quota_get).put(quota_put).delete(quota_delete))
        .layer(guard)
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
    // LMCache's `cache_context_meta`, per registered worker: what `lmcache describe kvcache`
    // prints per model.
    let mut meta = serde_json::Map::new();
    for (_, id, inst) in s.registry.snapshot() {
        let l = inst.layout;
        let per_token = l.kv * l.layers * l.hidden * l.dtype.itemsize();
        let mut layout = json!({
            "num_layers": l.layers,
            "cache_size_per_token": per_token,
            "kernel_groups": [{
                "kernel_group_idx": 0, "engine_group_idx": 0, "object_group_idx": 0,
                "num_layers": l.layers, "dtype": l.dtype.as_str(), "is_mla": l.kv == 1,
                "object_shape": l.shape(),
            }],
        });
        if let crate::registry::Registration::LmcacheDriven { num_blocks, block_size, .. } =
            &inst.registration
        {
            layout["num_blocks"] = json!(num_blocks);
            layout["kernel_groups"][0]["tokens_per_block"] = json!(block_size);
        }
        meta.insert(
            id.to_string(),
            json!({"model_name": inst.model.as_str(), "world_size": inst.world_size, "kv_cache_layout": layout}),
        );
    }
    Json(json!({
        "cache_context_meta": meta,
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
            "l1_manager": {
                "memory_total_bytes": u.capacity,
                "memory_used_bytes": u.used_bytes,
                "memory_usage_ratio": u.usage_fraction(),
                "total_object_count": u.resident_objects,
            },
            "eviction_controller": {"eviction_policy": s.l1.config().eviction_policy.as_str()},
            "l2_adapters": l2_status(&s),
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

async fn version() -> Json<Value> {
    Json(
        json!({"version": env!("CARGO_PKG_VERSION"), "server": "lmcache-rs", "protocol": "lmcache-mp-0.5.6"}),
    )
}

/// The effective configuration (the token itself is never shown).
async fn config(State(s): State<Shared>) -> Json<Value> {
    let c = &s.config;
    let arena = s.l1.memory().arena();
    Json(json!({
        "mp": {
            "host": c.host, "port": c.port, "chunk_size": c.chunk_size,
            "max_cpu_workers": c.max_cpu_workers, "max_gpu_workers": c.max_gpu_workers,
            "worker_reap_timeout_seconds": c.worker_reap_timeout.as_secs_f64(),
            "worker_registration_grace_seconds": c.worker_registration_grace.as_secs_f64(),
            "session_ttl_seconds": c.session_ttl.as_secs_f64(),
            "null_block_id": c.null_block_id, "copy_threads": c.copy_threads,
            "kv_event_log_size": c.kv_event_log_size, "hash_algorithm": "blake3",
            "supported_transfer_modes": ["lmcache_driven", "engine_driven"],
        },
        "storage_manager": {
            "l1_size_bytes": arena.len(), "l1_backing": arena.kind().as_str(),
            "shm_name": arena.shm_name(), "l1_align_bytes": c.align, "l1_mlock": arena.is_locked(),
            "eviction_policy": c.l1.eviction_policy.as_str(),
            "eviction_trigger_watermark": c.l1.trigger_watermark, "eviction_ratio": c.l1.eviction_ratio,
            "l1_read_ttl_seconds": c.l1.read_ttl.as_secs_f64(),
            "l1_write_ttl_seconds": c.l1.write_ttl.as_secs_f64(),
            "l2_adapters": l2_specs(&s),
        },
        "http": {"http_host": c.http_host, "http_port": c.http_port, "auth": c.http_auth_token.is_some()},
    }))
}

/// Each adapter's state for /status: LMCache's `type` and `is_healthy`, then our detail.
fn l2_status(s: &ServerState) -> Vec<Value> {
    let Some(t) = &s.l2 else { return Vec::new() };
    t.describe()
        .into_iter()
        .map(|a| {
            let mut d = a.detail;
            d["is_healthy"] = json!(a.healthy);
            d
        })
        .collect()
}

/// The adapters' configurations (secrets masked), for /config.
fn l2_specs(s: &ServerState) -> Vec<Value> {
    s.l2.as_ref()
        .map_or_else(Vec::new, |t| t.adapters().iter().map(|a| a.built.spec.clone()).collect())
}

async fn config_adapters(State(s): State<Shared>) -> Json<Value> {
    let list: Vec<Value> = s.l2.as_ref().map_or_else(Vec::new, |t| {
        t.adapters()
            .iter()
            .enumerate()
            .map(|(i, a)| {
                json!({"index": a.id, "type_name": a.built.kind, "tier": "l2",
                       "primary": i == 0, "reconfigurable": true})
            })
            .collect()
    });
    Json(json!({"adapters": list}))
}

async fn reconfigure_status(
    State(s): State<Shared>,
    axum::extract::Path(backend): axum::extract::Path<String>,
) -> Json<Value> {
    let adapters = l2_status(&s);
    Json(json!({"enabled": s.l2.is_some(), "backend": backend,
                "num_adapters": adapters.len(), "adapters": adapters}))
}

/// `POST /reconfigure/{backend}/l2/add` with an adapter spec (`{"spec": {...}}` or the spec
/// itself), or `.../remove` with `{"adapter_index": id}`.
async fn reconfigure(
    State(s): State<Shared>,
    axum::extract::Path((_backend, op)): axum::extract::Path<(String, String)>,
    body: Option<Json<Value>>,
) -> Response {
    let Some(tier) = s.l2.clone() else {
        return error(
            StatusCode::CONFLICT,
            "no L2 tier: start the server with at least one --l2-adapter to reconfigure L2",
        );
    };
    let body = body.map(|Json(v)| v).unwrap_or(Value::Null);
    match op.as_str() {
        "add" => {
            let spec = body.get("spec").cloned().unwrap_or(body);
            match tokio::task::spawn_blocking(move || tier.add_adapter(&spec)).await {
                Ok(Ok(id)) => Json(json!({"status": "ok", "adapter_index": id})).into_response(),
                Ok(Err(e)) => error(StatusCode::BAD_REQUEST, e.to_string()),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            }
        }
        "remove" => match body.get("adapter_index").and_then(Value::as_u64) {
            None => error(StatusCode::BAD_REQUEST, "adapter_index: missing or not an integer"),
            Some(id) if tier.remove_adapter(id) => {
                Json(json!({"status": "ok", "removed": id})).into_response()
            }
            Some(id) => error(StatusCode::NOT_FOUND, format!("adapter_index: no adapter {id}")),
        },
        other => {
            error(StatusCode::BAD_REQUEST, format!("operation: {other:?} is not add or remove"))
        }
    }
}

/// `POST /metrics/reset`: clears the per-operation request, refusal and latency series (the
/// lmcache_mp counters are cumulative, as Prometheus expects, and are not reset).
async fn metrics_reset(State(s): State<Shared>) -> Json<Value> {
    s.metrics.requests.clear();
    s.metrics.errors.clear();
    s.metrics.latency.clear();
    Json(json!({"status": "ok"}))
}

#[derive(Debug, Deserialize)]
struct PrefetchBody {
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

fn one() -> u32 {
    1
}

static HTTP_PREFETCH_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// `POST /cache/prefetches`: warm L1 from L2 for a prompt, ahead of the request (202).
async fn prefetch_submit(State(s): State<Shared>, raw: axum::body::Bytes) -> Response {
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
    let Some(tier) = s.l2.clone() else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "no L2 tier (start with --l2-adapter)");
    };
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
        let mut jobs = s.http_prefetches.lock();
        if jobs.len() >= 10_000 {
            return error(StatusCode::SERVICE_UNAVAILABLE, "too many unpolled prefetches");
        }
        jobs.insert(id.clone(), None);
    }
    let (me, rid, chunks) = (s.clone(), id.clone(), hashes.len());
    tier.prefetch(lmcache_storage::PrefetchRequest { shards, readers: 1 }, move |out| {
        // The leases drop here: loaded objects stay in L1 under its eviction policy.
        let found = out.hits * out.leases.len();
        me.http_prefetches.lock().insert(rid, Some((found, total)));
    });
    (StatusCode::ACCEPTED, Json(json!({"request_id": id, "chunks": chunks, "status": "submitted"})))
        .into_response()
}

/// `GET /cache/prefetches/{request_id}`: pending, or completed once (then forgotten).
async fn prefetch_status(
    State(s): State<Shared>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let mut jobs = s.http_prefetches.lock();
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

fn refresh_l2_metrics(s: &ServerState) {
    use crate::metrics::{L2Label, StateLabel, advance};
    use std::sync::atomic::Ordering::Relaxed;
    let m = &s.metrics.l2;
    let n = s.l2.as_ref().map_or(0, |t| t.len()) as i64;
    let active = StateLabel { state: "active".into() };
    m.store_adapters.get_or_create(&active).set(n);
    m.prefetch_adapters.get_or_create(&active).set(n);
    let Some(tier) = &s.l2 else { return };
    let ts = tier.stats();
    advance(&m.store_submitted_objects, ts.store_enqueued.load(Relaxed));
    advance(&m.store_dropped_objects, ts.store_dropped.load(Relaxed));
    advance(&m.prefetch_requests, ts.prefetch_requests.load(Relaxed));
    advance(&m.prefetch_expired, ts.prefetch_expired.load(Relaxed));
    s.metrics.active_prefetch_jobs.set(ts.prefetch_in_flight.load(Relaxed) as i64);
    for a in tier.adapters() {
        let l = L2Label { l2_name: a.built.kind.clone(), adapter_index: a.id.to_string() };
        let st = &a.stats;
        let u = a.usage();
        m.usage_bytes.get_or_create(&l).set(u.used as i64);
        m.capacity_bytes.get_or_create(&l).set(a.ledger.capacity().map_or(-1, |c| c as i64));
        m.keys.get_or_create(&l).set(u.keys as i64);
        advance(&m.evicted_objects.get_or_create(&l), st.evicted_keys.load(Relaxed));
        advance(&m.evicted_bytes.get_or_create(&l), st.evicted_bytes.load(Relaxed));
        advance(&m.quota_rejections.get_or_create(&l), st.quota_rejections.load(Relaxed));
        advance(&m.capacity_rejections.get_or_create(&l), st.capacity_rejections.load(Relaxed));
        m.healthy.get_or_create(&l).set(i64::from(a.healthy()));
        advance(&m.store_completed_objects.get_or_create(&l), st.stored_keys.load(Relaxed));
        advance(&m.stored_bytes.get_or_create(&l), st.stored_bytes.load(Relaxed));
        advance(&m.store_skipped_objects.get_or_create(&l), st.skipped_keys.load(Relaxed));
        advance(&m.store_failures.get_or_create(&l), st.store_failures.load(Relaxed));
        advance(&m.loaded_objects.get_or_create(&l), st.loaded_keys.load(Relaxed));
        advance(&m.loaded_bytes.get_or_create(&l), st.loaded_bytes.load(Relaxed));
        advance(&m.load_failures.get_or_create(&l), st.load_failures.load(Relaxed));
        advance(&m.corrupt_blobs.get_or_create(&l), st.corrupt_blobs.load(Relaxed));
        advance(&m.errors.get_or_create(&l), st.errors.load(Relaxed));
    }
}

async fn metrics(State(s): State<Shared>) -> Response {
    let u = s.l1.usage();
    s.metrics.l1_used_bytes.set(u.used_bytes as i64);
    s.metrics.l1_usage_ratio.set(u.usage_fraction());
    s.metrics.l1_staging_bytes.set(u.staged_bytes as i64);
    s.metrics.l1_capacity_bytes.set(u.capacity as i64);
    s.metrics.kv_events_log_depth.set(s.events.len() as i64);
    s.metrics.active_sessions.set(s.sessions.len() as i64);
    s.metrics.process_resident_memory_bytes.set(crate::metrics::process_rss_bytes() as i64);
    s.metrics.event_bus_queue_depth.set(s.bus.depth());
    use crate::metrics::advance;
    let m = &s.metrics;
    advance(&m.event_bus_dropped, s.bus.dropped());
    let st = u.stats;
    advance(&m.l1_eviction_loop_ticks, st.maintenance_passes);
    advance(&m.l1_evicted_objects, st.evicted_objects);
    advance(&m.l1_evicted_bytes, st.evicted_bytes);
    advance(&m.l1_sync_evictions, st.sync_evictions);
    advance(&m.l1_oom_rejections, st.oom_rejections);
    advance(&m.l1_quota_rejections, st.quota_rejections);
    advance(&m.l1_expired_read_leases, st.expired_read_leases);
    advance(&m.l1_expired_write_leases, st.expired_write_leases);
    advance(&m.l1_unwritten_evictions, st.unwritten_evictions);
    m.l1_unwritten_objects.set(s.l1.unwritten() as i64);
    refresh_l2_metrics(&s);
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
    let Some(t) = CpuTransfer::for_instance(&inst, 1) else {
        return error(StatusCode::NOT_IMPLEMENTED, "checksum not supported for this registration");
    };
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

const GB: f64 = (1u64 << 30) as f64;

/// `_default` in a path is the empty salt.
fn salt_from_path(raw: &str) -> Result<CacheSalt, String> {
    let name = if raw == "_default" { "" } else { raw };
    CacheSalt::new(name).map_err(|e| format!("cache_salt: {e}"))
}

fn salt_name(salt: &CacheSalt) -> String {
    if salt.is_empty() { "_default".into() } else { salt.as_str().to_owned() }
}

#[derive(Debug, Deserialize)]
struct QuotaQuery {
    #[serde(default)]
    tier: Option<String>,
}

/// Which tier's quotas a request is about: `?tier=l1` (the default) or `?tier=l2`.
enum QuotaTier {
    L1,
    L2(lmcache_storage::L2Tier),
}

impl QuotaTier {
    fn of(s: &ServerState, q: &QuotaQuery) -> Result<Self, String> {
        match q.tier.as_deref().unwrap_or("l1") {
            "l1" => Ok(Self::L1),
            "l2" => s.l2.clone().map(Self::L2).ok_or_else(|| {
                "tier: l2 is not configured (start the server with --l2-adapter)".to_owned()
            }),
            other => Err(format!("tier: {other:?} is not l1 or l2")),
        }
    }
    fn name(&self) -> &'static str {
        match self {
            Self::L1 => "l1",
            Self::L2(_) => "l2",
        }
    }
    fn quotas(&self, s: &ServerState) -> Vec<(CacheSalt, u64)> {
        match self {
            Self::L1 => s.l1.quotas(),
            Self::L2(t) => t.quotas(),
        }
    }
    fn quota(&self, s: &ServerState, salt: &CacheSalt) -> Option<u64> {
        match self {
            Self::L1 => s.l1.quota(salt),
            Self::L2(t) => t.quota(salt),
        }
    }
    fn usage_of(&self, s: &ServerState, salt: &CacheSalt) -> u64 {
        match self {
            Self::L1 => s.l1.usage_of(salt),
            Self::L2(t) => t.usage_of(salt),
        }
    }
    fn set(&self, s: &ServerState, salt: &CacheSalt, limit: Option<u64>) {
        match self {
            Self::L1 => {
                s.l1.set_quota(salt, limit);
                // Enforce now rather than at the next maintenance pass.
                s.l1.run_maintenance();
            }
            Self::L2(t) => t.set_quota(salt, limit),
        }
    }
}

async fn quota_list(
    State(s): State<Shared>,
    axum::extract::Query(q): axum::extract::Query<QuotaQuery>,
) -> Response {
    let tier = match QuotaTier::of(&s, &q) {
        Ok(t) => t,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let users: serde_json::Map<String, Value> = tier
        .quotas(&s)
        .into_iter()
        .map(|(salt, limit)| {
            let usage = tier.usage_of(&s, &salt);
            (
                salt_name(&salt),
                json!({"limit_gb": limit as f64 / GB, "current_usage_gb": usage as f64 / GB}),
            )
        })
        .collect();
    Json(json!({"tier": tier.name(), "users": users})).into_response()
}

async fn quota_get(
    State(s): State<Shared>,
    Path(raw): Path<String>,
    axum::extract::Query(q): axum::extract::Query<QuotaQuery>,
) -> Response {
    let tier = match QuotaTier::of(&s, &q) {
        Ok(t) => t,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let salt = match salt_from_path(&raw) {
        Ok(salt) => salt,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let limit = tier.quota(&s, &salt);
    Json(json!({
        "cache_salt": salt_name(&salt),
        "tier": tier.name(),
        "limit_gb": limit.map_or(0.0, |l| l as f64 / GB),
        "current_usage_gb": tier.usage_of(&s, &salt) as f64 / GB,
        "exists": limit.is_some(),
    }))
    .into_response()
}

#[derive(Debug, Deserialize)]
struct QuotaBody {
    limit_gb: f64,
}

async fn quota_put(
    State(s): State<Shared>,
    Path(raw): Path<String>,
    axum::extract::Query(q): axum::extract::Query<QuotaQuery>,
    body: axum::body::Bytes,
) -> Response {
    let tier = match QuotaTier::of(&s, &q) {
        Ok(t) => t,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let salt = match salt_from_path(&raw) {
        Ok(salt) => salt,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let body: QuotaBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("limit_gb: {e}")),
    };
    let Some(bytes) = lmcache_core::units::gib_to_bytes(body.limit_gb) else {
        return error(
            StatusCode::BAD_REQUEST,
            format!("limit_gb: {} is not a finite size >= 0", body.limit_gb),
        );
    };
    tier.set(&s, &salt, Some(bytes));
    Json(json!({"cache_salt": salt_name(&salt), "tier": tier.name(), "limit_gb": body.limit_gb,
                "status": "ok"}))
    .into_response()
}

async fn quota_delete(
    State(s): State<Shared>,
    Path(raw): Path<String>,
    axum::extract::Query(q): axum::extract::Query<QuotaQuery>,
) -> Response {
    let tier = match QuotaTier::of(&s, &q) {
        Ok(t) => t,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let salt = match salt_from_path(&raw) {
        Ok(salt) => salt,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let existed = tier.quota(&s, &salt).is_some();
    tier.set(&s, &salt, None);
    let status = if existed { "removed" } else { "not_found" };
    Json(json!({"cache_salt": salt_name(&salt), "tier": tier.name(), "status": status}))
        .into_response()
}

#[derive(Debug, Deserialize)]
struct ObjectsQuery {
    #[serde(default)]
    tier: Option<String>,
    #[serde(default)]
    adapter: Option<u64>,
    #[serde(default)]
    model_name: Option<String>,
    #[serde(default)]
    page_size: Option<usize>,
    #[serde(default)]
    page_token: Option<String>,
}

fn check_tier(s: &ServerState, tier: Option<&str>) -> Result<(), String> {
    match tier.unwrap_or("l1") {
        "l1" | "all" => Ok(()),
        "l2" if s.l2.is_some() => Ok(()),
        "l2" => Err("tier: l2 is not configured (start the server with --l2-adapter)".into()),
        other => Err(format!("tier: {other:?} is not l1, l2 or all")),
    }
}

/// The adapter a request names (`adapter` = its index), or the first.
fn pick_adapter(
    s: &ServerState,
    index: Option<u64>,
) -> Result<std::sync::Arc<lmcache_storage::tier::AdapterSlot>, (StatusCode, String)> {
    let Some(tier) = &s.l2 else {
        return Err((StatusCode::BAD_REQUEST, "tier: l2 is not configured".into()));
    };
    let all = tier.adapters();
    match index {
        None => all.first().cloned(),
        Some(i) => all.iter().find(|a| a.id == i).cloned(),
    }
    .ok_or_else(|| (StatusCode::NOT_FOUND, format!("adapter: no L2 adapter {index:?}")))
}

fn encode_key(k: &lmcache_core::ObjectKey) -> Value {
    json!({
        "chunk_hash_hex": k.chunk_hash.to_hex(),
        "model_name": k.model_name.as_str(),
        "kv_rank": k.kv_rank.packed(),
        "object_group_id": k.object_group_id,
        "cache_salt": k.cache_salt.as_str(),
    })
}

/// `GET /cache/objects`: resident L1 objects, paginated (`page_size` <= 5000, default 500).
async fn objects_list(
    State(s): State<Shared>,
    axum::extract::Query(q): axum::extract::Query<ObjectsQuery>,
) -> Response {
    if let Err(msg) = check_tier(&s, q.tier.as_deref()) {
        return error(StatusCode::BAD_REQUEST, msg);
    }
    let size = q.page_size.unwrap_or(500);
    if size == 0 || size > 5000 {
        return error(StatusCode::BAD_REQUEST, format!("page_size: {size} is outside 1..=5000"));
    }
    if q.tier.as_deref() == Some("l2") {
        return l2_objects_list(&s, q, size).await;
    }
    let skip = match q.page_token.as_deref().map(str::parse::<usize>) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            return error(StatusCode::BAD_REQUEST, "page_token: not a token this server issued");
        }
    };
    // Filter before paging so pages stay full.
    let all = s.l1.resident_keys();
    let matching: Vec<_> = all
        .into_iter()
        .filter(|(k, _)| q.model_name.as_deref().is_none_or(|m| k.model_name.as_str() == m))
        .collect();
    let total = matching.len();
    let entries: Vec<Value> = matching
        .iter()
        .skip(skip)
        .take(size)
        .map(|(k, bytes)| {
            let mut v = encode_key(k);
            v["size_bytes"] = json!(bytes);
            v
        })
        .collect();
    let next = (skip + entries.len() < total).then(|| (skip + entries.len()).to_string());
    Json(json!({"tier": "l1", "shared": false, "total": total, "entries": entries, "next_page_token": next}))
        .into_response()
}

#[derive(Debug, Deserialize)]
struct DeleteKey {
    chunk_hash_hex: String,
    model_name: String,
    kv_rank: u32,
    #[serde(default)]
    object_group_id: u32,
    #[serde(default)]
    cache_salt: String,
}

#[derive(Debug, Deserialize)]
struct DeleteBody {
    keys: Vec<DeleteKey>,
    #[serde(default)]
    tier: Option<String>,
    #[serde(default)]
    adapter: Option<u64>,
    #[serde(default)]
    force: bool,
}

/// `DELETE /cache/objects`: delete keys from L1 (`force` also drops locked ones once released).
async fn objects_delete(State(s): State<Shared>, raw: axum::body::Bytes) -> Response {
    let body: DeleteBody = match serde_json::from_slice(&raw) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("body: {e}")),
    };
    if let Err(msg) = check_tier(&s, body.tier.as_deref()) {
        return error(StatusCode::BAD_REQUEST, msg);
    }
    if body.keys.len() > 10_000 {
        return error(
            StatusCode::BAD_REQUEST,
            format!("keys: {} keys, at most 10000", body.keys.len()),
        );
    }
    let mut keys = Vec::with_capacity(body.keys.len());
    for (i, k) in body.keys.iter().enumerate() {
        let parsed = (|| -> Result<lmcache_core::ObjectKey, String> {
            let raw = (0..k.chunk_hash_hex.len())
                .step_by(2)
                .map(|j| {
                    k.chunk_hash_hex.get(j..j + 2).and_then(|h| u8::from_str_radix(h, 16).ok())
                })
                .collect::<Option<Vec<u8>>>()
                .ok_or("chunk_hash_hex: not hex")?;
            Ok(lmcache_core::ObjectKey {
                chunk_hash: lmcache_core::ChunkHash::from_slice(&raw).map_err(|e| e.to_string())?,
                model_name: lmcache_core::ModelName::new(&k.model_name)
                    .map_err(|e| e.to_string())?,
                kv_rank: lmcache_core::KvRank::from_packed(k.kv_rank).map_err(|e| e.to_string())?,
                object_group_id: k.object_group_id,
                cache_salt: CacheSalt::new(&k.cache_salt).map_err(|e| e.to_string())?,
            })
        })();
        match parsed {
            Ok(key) => keys.push(key),
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("keys[{i}]: {e}")),
        }
    }
    let tier = body.tier.as_deref().unwrap_or("l1");
    let mut deleted = 0usize;
    let mut skipped = 0usize;
    if tier != "l2" {
        let results = s.l1.delete(&keys, body.force);
        deleted += results.iter().filter(|r| r.is_ok()).count();
        skipped += results.iter().filter(|r| r.is_err()).count();
    }
    if tier != "l1"
        && let Some(t) = s.l2.clone()
    {
        let n = keys.len();
        match t.delete(body.adapter, keys).await {
            Ok(d) => {
                deleted += d as usize;
                skipped += n.saturating_sub(d as usize);
            }
            Err(e) => {
                return Json(json!({"deleted": deleted, "skipped": skipped, "ok": false,
                                   "error": format!("L2 delete failed: {e}")}))
                .into_response();
            }
        }
    }
    Json(json!({"deleted": deleted, "skipped": skipped, "ok": true})).into_response()
}

/// `GET /cache/objects?tier=l2[&adapter=N]`: one adapter's keys, a page at a time.
async fn l2_objects_list(s: &ServerState, q: ObjectsQuery, size: usize) -> Response {
    let slot = match pick_adapter(s, q.adapter) {
        Ok(a) => a,
        Err((code, msg)) => return error(code, msg),
    };
    let Some(tier) = s.l2.clone() else { return error(StatusCode::BAD_REQUEST, "no L2") };
    let (model, token) = (q.model_name.clone(), q.page_token.clone());
    let Some(page) = tier.list(slot.id, model, token, size).await else {
        return error(StatusCode::NOT_FOUND, format!("adapter: no L2 adapter {}", slot.id));
    };
    match page {
        Ok(p) => {
            let entries: Vec<Value> = p
                .keys
                .iter()
                .map(|(k, n)| {
                    let mut v = encode_key(k);
                    v["size_bytes"] = json!(n);
                    v
                })
                .collect();
            Json(json!({"tier": "l2", "adapter": slot.id, "type": slot.built.kind,
                        "shared": false, "entries": entries, "next_page_token": p.next}))
            .into_response()
        }
        Err(lmcache_l2::L2Error::Unsupported(what)) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("adapter {} ({}) does not support {what}", slot.id, slot.built.kind),
        ),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, format!("adapter {}: {e}", slot.id)),
    }
}
