//! Quotas per cache_salt: `GET /quota`, `GET|PUT|DELETE /quota/{salt}`, `?tier=l1` (the
//! default) or `?tier=l2`.

use lmcache_storage::TierName;

use super::*;

pub(super) const GB: f64 = (1u64 << 30) as f64;

/// How paths and queries name the empty salt.
pub(super) const DEFAULT_SALT: &str = "_default";

/// `_default` in a path is the empty salt.
pub(super) fn salt_from_path(raw: &str) -> Result<CacheSalt, String> {
    let name = if raw == DEFAULT_SALT { "" } else { raw };
    CacheSalt::new(name).map_err(|e| format!("cache_salt: {e}"))
}

pub(super) fn salt_name(salt: &CacheSalt) -> String {
    if salt.is_empty() { "_default".into() } else { salt.as_str().to_owned() }
}

#[derive(Debug, Deserialize)]
pub(super) struct QuotaQuery {
    #[serde(default)]
    tier: Option<String>,
}

/// Which tier's quotas a request is about: `?tier=l1` (the default) or `?tier=l2`.
fn quota_tier(s: &ServerState, q: &QuotaQuery) -> Result<TierName, String> {
    match q.tier.as_deref().unwrap_or("l1") {
        "l1" => Ok(TierName::L1),
        "l2" if s.storage.has_l2() => Ok(TierName::L2),
        "l2" => Err("tier: l2 is not configured (start the server with --l2-adapter)".to_owned()),
        other => Err(format!("tier: {other:?} is not l1 or l2")),
    }
}

fn tier_name(t: TierName) -> &'static str {
    match t {
        TierName::L1 => "l1",
        TierName::L2 => "l2",
    }
}

pub(super) async fn quota_list(
    State(s): State<Shared>,
    axum::extract::Query(q): axum::extract::Query<QuotaQuery>,
) -> Response {
    let tier = match quota_tier(&s, &q) {
        Ok(t) => t,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let users: serde_json::Map<String, Value> = s
        .storage
        .quotas(tier)
        .unwrap_or_default()
        .into_iter()
        .map(|(salt, limit)| {
            let usage = s.storage.usage_of(tier, &salt).unwrap_or(0);
            (
                salt_name(&salt),
                json!({"limit_gb": limit as f64 / GB, "current_usage_gb": usage as f64 / GB}),
            )
        })
        .collect();
    Json(json!({"tier": tier_name(tier), "users": users})).into_response()
}

pub(super) async fn quota_get(
    State(s): State<Shared>,
    Path(raw): Path<String>,
    axum::extract::Query(q): axum::extract::Query<QuotaQuery>,
) -> Response {
    let (tier, salt) = match quota_tier(&s, &q).and_then(|t| Ok((t, salt_from_path(&raw)?))) {
        Ok(x) => x,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let limit = s.storage.quota(tier, &salt).unwrap_or(None);
    Json(json!({
        "cache_salt": salt_name(&salt),
        "tier": tier_name(tier),
        "limit_gb": limit.map_or(0.0, |l| l as f64 / GB),
        "current_usage_gb": s.storage.usage_of(tier, &salt).unwrap_or(0) as f64 / GB,
        "exists": limit.is_some(),
    }))
    .into_response()
}

#[derive(Debug, Deserialize)]
pub(super) struct QuotaBody {
    limit_gb: f64,
}

pub(super) async fn quota_put(
    State(s): State<Shared>,
    Path(raw): Path<String>,
    axum::extract::Query(q): axum::extract::Query<QuotaQuery>,
    body: axum::body::Bytes,
) -> Response {
    let (tier, salt) = match quota_tier(&s, &q).and_then(|t| Ok((t, salt_from_path(&raw)?))) {
        Ok(x) => x,
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
    if let Err(e) = s.storage.set_quota(tier, &salt, Some(bytes)) {
        return error(StatusCode::BAD_REQUEST, e.to_string());
    }
    Json(json!({"cache_salt": salt_name(&salt), "tier": tier_name(tier), "limit_gb": body.limit_gb,
                "status": "ok"}))
    .into_response()
}

pub(super) async fn quota_delete(
    State(s): State<Shared>,
    Path(raw): Path<String>,
    axum::extract::Query(q): axum::extract::Query<QuotaQuery>,
) -> Response {
    let (tier, salt) = match quota_tier(&s, &q).and_then(|t| Ok((t, salt_from_path(&raw)?))) {
        Ok(x) => x,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let existed = s.storage.quota(tier, &salt).ok().flatten().is_some();
    if let Err(e) = s.storage.set_quota(tier, &salt, None) {
        return error(StatusCode::BAD_REQUEST, e.to_string());
    }
    let status = if existed { "removed" } else { "not_found" };
    Json(json!({"cache_salt": salt_name(&salt), "tier": tier_name(tier), "status": status}))
        .into_response()
}
