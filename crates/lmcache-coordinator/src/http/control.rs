//! LMCache's controller routes: per-salt L2 quotas (`/quota*`), L2 pins (`/cache/pins`),
//! and the relays to one server (`/cache/prefetches`, `/cache/delete`), with LMCache's
//! bodies, replies and status codes. `_default` in a path is the empty salt; GiB = 2^30 bytes.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lmcache_directory::Tier;
use lmcache_protocol::coordinator::{EncodedObjectKey, WireTier};
use serde::Deserialize;
use serde_json::{Value, json};

use lmcache_http::{Api, JsonBody as Body, error};

use super::{Shared, fail};
use crate::control::GIB;
use crate::fleet::FleetError;

/// The routes.
pub(super) fn api() -> Api<Shared> {
    Api::new()
        .get("/quota", quota_list)
        .get("/quota/config", quota_config_get)
        .put("/quota/config", quota_config_put)
        .get("/quota/{salt}", quota_get)
        .put("/quota/{salt}", quota_put)
        .delete("/quota/{salt}", quota_delete)
        .post("/cache/pins", pin)
        .delete("/cache/pins", unpin)
        .get("/cache/pins", pins)
        .post("/cache/prefetches", prefetch)
        .get("/cache/prefetches/{instance}/{request}", prefetch_status)
        .post("/cache/delete", delete)
}

fn salt_of(path: &str) -> String {
    if path == "_default" { String::new() } else { path.to_string() }
}

fn json(v: Value) -> Response {
    axum::Json(v).into_response()
}

fn l2_only(tier: WireTier) -> Result<(), FleetError> {
    match tier {
        WireTier::L2 => Ok(()),
        other => Err(FleetError::BadRequest(
            format!("quotas apply to tier 'l2' only, not {other:?}").to_lowercase(),
        )),
    }
}

fn accounted(tier: WireTier) -> Result<Tier, FleetError> {
    match tier {
        WireTier::L1 => Ok(Tier::L1),
        WireTier::L2 => Ok(Tier::L2),
        WireTier::All => Err(FleetError::BadRequest(
            "tier 'all' has no usage accounting; only 'l1', 'l2'".into(),
        )),
    }
}

fn l2() -> WireTier {
    WireTier::L2
}

#[derive(Debug, Deserialize)]
struct TierQuery {
    #[serde(default = "l2")]
    tier: WireTier,
}

#[derive(Debug, Deserialize)]
struct QuotaConfigBody {
    #[serde(default)]
    default_limit_gb: Option<f64>,
    #[serde(default = "l2")]
    tier: WireTier,
}

#[derive(Debug, Deserialize)]
struct QuotaBody {
    limit_gb: f64,
    #[serde(default = "l2")]
    tier: WireTier,
}

fn gib_bytes(v: f64, field: &str) -> Result<u64, FleetError> {
    if !(v.is_finite() && v >= 0.0) {
        return Err(FleetError::Invalid(format!("{field}: {v} must be a finite number >= 0")));
    }
    Ok((v * GIB) as u64)
}

async fn quota_config_get(State(s): State<Shared>, Query(q): Query<TierQuery>) -> Response {
    if let Err(e) = l2_only(q.tier) {
        return fail(&s, e);
    }
    let d = s.control(false, |c| c.default_limit()).ok().flatten();
    json(json!({"default_limit_gb": d.map(|b| b as f64 / GIB)}))
}

async fn quota_config_put(State(s): State<Shared>, Body(b): Body<QuotaConfigBody>) -> Response {
    if let Err(e) = l2_only(b.tier) {
        return fail(&s, e);
    }
    let bytes = match b.default_limit_gb.map(|g| gib_bytes(g, "default_limit_gb")).transpose() {
        Ok(v) => v,
        Err(e) => return fail(&s, e),
    };
    match s.control(true, |c| c.set_default(bytes)) {
        Ok(()) => json(json!({"default_limit_gb": b.default_limit_gb})),
        Err(e) => fail(&s, e),
    }
}

async fn quota_put(
    State(s): State<Shared>,
    Path(salt): Path<String>,
    Body(b): Body<QuotaBody>,
) -> Response {
    if let Err(e) = l2_only(b.tier) {
        return fail(&s, e);
    }
    let bytes = match gib_bytes(b.limit_gb, "limit_gb") {
        Ok(v) => v,
        Err(e) => return fail(&s, e),
    };
    let salt = salt_of(&salt);
    match s.control(true, |c| c.set_quota(&salt, bytes)) {
        Ok(()) => json(json!({"cache_salt": salt, "limit_gb": b.limit_gb, "status": "ok"})),
        Err(e) => fail(&s, e),
    }
}

async fn quota_delete(
    State(s): State<Shared>,
    Path(salt): Path<String>,
    Query(q): Query<TierQuery>,
) -> Response {
    if let Err(e) = l2_only(q.tier) {
        return fail(&s, e);
    }
    let salt = salt_of(&salt);
    match s.control(true, |c| c.delete_quota(&salt)) {
        Ok(removed) => json(
            json!({"cache_salt": salt, "limit_gb": 0.0, "status": if removed { "removed" } else { "not_found" }}),
        ),
        Err(e) => fail(&s, e),
    }
}

async fn quota_get(
    State(s): State<Shared>,
    Path(salt): Path<String>,
    Query(q): Query<TierQuery>,
) -> Response {
    let tier = match accounted(q.tier) {
        Ok(t) => t,
        Err(e) => return fail(&s, e),
    };
    let salt = salt_of(&salt);
    let (by, _) = s.salt_bytes(tier);
    let limit =
        if tier == Tier::L2 { s.control(false, |c| c.quota(&salt)).ok().flatten() } else { None };
    json(json!({
        "cache_salt": salt,
        "quota_limit_gb": limit.unwrap_or(0) as f64 / GIB,
        "quota_exists": limit.is_some(),
        "usage_gb": by.get(&salt).copied().unwrap_or(0) as f64 / GIB,
    }))
}

async fn quota_list(State(s): State<Shared>, Query(q): Query<TierQuery>) -> Response {
    let tier = match accounted(q.tier) {
        Ok(t) => t,
        Err(e) => return fail(&s, e),
    };
    let (by, total) = s.salt_bytes(tier);
    let quotas = if tier == Tier::L2 {
        s.control(false, |c| c.quotas().clone()).unwrap_or_default()
    } else {
        Default::default()
    };
    let mut salts: Vec<&String> = by.keys().chain(quotas.keys()).collect();
    salts.sort();
    salts.dedup();
    let rows: Vec<Value> = salts
        .into_iter()
        .map(|salt| {
            json!({
                "cache_salt": salt,
                "quota_limit_gb": quotas.get(salt).copied().unwrap_or(0) as f64 / GIB,
                "quota_exists": quotas.contains_key(salt),
                "usage_gb": by.get(salt).copied().unwrap_or(0) as f64 / GIB,
            })
        })
        .collect();
    json(json!({"total_gb": total as f64 / GIB, "by_cache_salt": rows}))
}

/// `model_name`, `world_size`, `token_ids`, `cache_salt`: resolved like LMCache's pins.
#[derive(Debug, Deserialize)]
struct TokensBody {
    model_name: String,
    world_size: u32,
    #[serde(default)]
    token_ids: Vec<u32>,
    #[serde(default)]
    cache_salt: String,
}

async fn pin_or_unpin(s: Shared, b: TokensBody, pin: bool) -> Response {
    let (chunks, keys) =
        match s.resolve_tokens(&b.token_ids, &b.model_name, b.world_size, &b.cache_salt) {
            Ok(r) => r,
            Err(e) => return fail(&s, e),
        };
    let done = s.control(true, |c| if pin { c.pin(&keys) } else { c.unpin(&keys) });
    match done {
        Ok(n) => json(
            json!({"requested": chunks, "affected": n, "status": if pin { "pinned" } else { "unpinned" }}),
        ),
        Err(e) => fail(&s, e),
    }
}

async fn pin(State(s): State<Shared>, Body(b): Body<TokensBody>) -> Response {
    pin_or_unpin(s, b, true).await
}

async fn unpin(State(s): State<Shared>, Body(b): Body<TokensBody>) -> Response {
    pin_or_unpin(s, b, false).await
}

fn thousand() -> usize {
    1000
}

#[derive(Debug, Deserialize)]
struct PinsQuery {
    #[serde(default)]
    cache_salt: String,
    #[serde(default)]
    model_name: String,
    #[serde(default)]
    offset: usize,
    #[serde(default = "thousand")]
    limit: usize,
}

async fn pins(State(s): State<Shared>, Query(q): Query<PinsQuery>) -> Response {
    if !(1..=10_000).contains(&q.limit) {
        return fail(&s, FleetError::Invalid(format!("limit: {} is not in 1..10000", q.limit)));
    }
    let (total, page) = s
        .control(false, |c| c.list_pins(&q.cache_salt, &q.model_name, q.offset, q.limit))
        .unwrap_or_default();
    let pins: Vec<Value> =
        page.into_iter().map(|(k, n)| json!({"key": k, "pin_count": n})).collect();
    json(json!({"total": total, "pins": pins}))
}

/// One call to a registered server, off the runtime's threads.
async fn relay(
    s: &Shared,
    method: &'static str,
    to: crate::fleet::Endpoint,
    path: String,
    body: Option<Value>,
) -> Result<(u16, Value), String> {
    let agent = crate::server_client::ServerClient::new(
        std::time::Duration::from_secs(30),
        s.config().server_http_auth_token.as_deref(),
    );
    tokio::task::spawn_blocking(move || {
        let resp = match (method, body) {
            ("GET", _) => agent.get(&to, &path).call(),
            ("DELETE", Some(b)) => agent.delete(&to, &path).force_send_body().send_json(b),
            (_, Some(b)) => agent.post(&to, &path).send_json(b),
            (_, None) => agent.post(&to, &path).send_empty(),
        };
        let mut r = resp.map_err(|e| e.to_string())?;
        let code = r.status().as_u16();
        let text = r.body_mut().read_to_string().map_err(|e| e.to_string())?;
        Ok((code, serde_json::from_str(&text).unwrap_or(Value::String(text))))
    })
    .await
    .map_err(|e| e.to_string())?
}

fn unknown(id: &str) -> Response {
    error(StatusCode::NOT_FOUND, format!("no MP server registered with instance_id={id:?}"))
}

#[derive(Debug, Deserialize)]
struct PrefetchBody {
    instance_id: String,
    model_name: String,
    world_size: u32,
    #[serde(default)]
    token_ids: Vec<u32>,
    #[serde(default)]
    cache_salt: String,
}

async fn prefetch(State(s): State<Shared>, Body(b): Body<PrefetchBody>) -> Response {
    let Some(to) = s.endpoint(&b.instance_id) else { return unknown(&b.instance_id) };
    let body = json!({"model_name": b.model_name, "world_size": b.world_size, "token_ids": b.token_ids, "cache_salt": b.cache_salt});
    match relay(&s, "POST", to, "/cache/prefetches".into(), Some(body)).await {
        Ok((code, v)) if (200..300).contains(&code) => json(json!({
            "instance_id": b.instance_id,
            "request_id": v.get("request_id").and_then(Value::as_str).unwrap_or(""),
            "chunks": v.get("chunks").and_then(Value::as_u64).unwrap_or(0),
            "status": v.get("status").and_then(Value::as_str).unwrap_or("submitted"),
        })),
        Ok((code, v)) => error(
            StatusCode::BAD_GATEWAY,
            format!("prefetch submit to {:?} failed: HTTP {code}: {v}", b.instance_id),
        ),
        Err(e) => error(
            StatusCode::BAD_GATEWAY,
            format!("prefetch submit to {:?} failed: {e}", b.instance_id),
        ),
    }
}

async fn prefetch_status(
    State(s): State<Shared>,
    Path((instance, request)): Path<(String, String)>,
) -> Response {
    let Some(to) = s.endpoint(&instance) else { return unknown(&instance) };
    let request = request
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "-_.".contains(*c))
        .collect::<String>();
    match relay(&s, "GET", to, format!("/cache/prefetches/{request}"), None).await {
        Ok((code, v)) => {
            (StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_GATEWAY), axum::Json(v))
                .into_response()
        }
        Err(e) => {
            error(StatusCode::BAD_GATEWAY, format!("prefetch status from {instance:?} failed: {e}"))
        }
    }
}

fn all() -> WireTier {
    WireTier::All
}

#[derive(Debug, Deserialize)]
struct DeleteBody {
    instance_id: String,
    model_name: String,
    world_size: u32,
    #[serde(default)]
    token_ids: Vec<u32>,
    #[serde(default)]
    cache_salt: String,
    #[serde(default = "all")]
    tier: WireTier,
    #[serde(default)]
    force: bool,
}

async fn delete(State(s): State<Shared>, Body(b): Body<DeleteBody>) -> Response {
    let Some(to) = s.endpoint(&b.instance_id) else { return unknown(&b.instance_id) };
    let (chunks, keys) =
        match s.resolve_tokens(&b.token_ids, &b.model_name, b.world_size, &b.cache_salt) {
            Ok((chunks, keys)) => (chunks, s.across_object_groups(keys)),
            Err(e) => return fail(&s, e),
        };
    if chunks == 0 {
        return json(
            json!({"instance_id": b.instance_id, "requested": 0, "affected": 0, "skipped": 0, "status": "noop"}),
        );
    }
    let touches_l2 = matches!(b.tier, WireTier::L2 | WireTier::All);
    let (keys, pin_skipped): (Vec<EncodedObjectKey>, usize) = if touches_l2 && !b.force {
        let kept = s
            .control(false, |c| {
                keys.iter().filter(|k| !c.is_pinned(k)).cloned().collect::<Vec<_>>()
            })
            .unwrap_or_default();
        let skipped = keys.len() - kept.len();
        (kept, skipped)
    } else {
        (keys, 0)
    };
    let (mut deleted, mut skipped) = (0, 0);
    if !keys.is_empty() {
        let body = json!({"keys": keys, "tier": b.tier, "force": b.force});
        match relay(&s, "DELETE", to, "/cache/objects".into(), Some(body)).await {
            Ok((code, v)) if (200..300).contains(&code) => {
                deleted = v.get("deleted").and_then(Value::as_u64).unwrap_or(0);
                skipped = v.get("skipped").and_then(Value::as_u64).unwrap_or(0);
            }
            Ok((code, v)) => {
                return error(
                    StatusCode::BAD_GATEWAY,
                    format!("delete to {:?} failed: HTTP {code}: {v}", b.instance_id),
                );
            }
            Err(e) => {
                return error(
                    StatusCode::BAD_GATEWAY,
                    format!("delete to {:?} failed: {e}", b.instance_id),
                );
            }
        }
    }
    if touches_l2 && b.force {
        if let Err(e) = s.control(true, |c| c.drop_pins(&keys)) {
            return fail(&s, e);
        }
    }
    json(json!({
        "instance_id": b.instance_id,
        "requested": chunks,
        "affected": deleted,
        "skipped": skipped + pin_skipped as u64,
        "status": "deleted",
    }))
}
