//! Quotas per cache_salt: `GET /quota`, `GET|PUT|DELETE /quota/{salt}`, `?tier=l1` (the
//! default) or `?tier=l2`.

use super::*;

pub(super) const GB: f64 = (1u64 << 30) as f64;

/// `_default` in a path is the empty salt.
pub(super) fn salt_from_path(raw: &str) -> Result<CacheSalt, String> {
    let name = if raw == "_default" { "" } else { raw };
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
pub(super) enum QuotaTier {
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

pub(super) async fn quota_list(
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

pub(super) async fn quota_get(
    State(s): State<Shared>,
    Path(raw): Path<String>,
    axum::extract::Query(q): axum::extract::Query<QuotaQuery>,
) -> Response {
    let (tier, salt) = match QuotaTier::of(&s, &q).and_then(|t| Ok((t, salt_from_path(&raw)?))) {
        Ok(x) => x,
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
pub(super) struct QuotaBody {
    limit_gb: f64,
}

pub(super) async fn quota_put(
    State(s): State<Shared>,
    Path(raw): Path<String>,
    axum::extract::Query(q): axum::extract::Query<QuotaQuery>,
    body: axum::body::Bytes,
) -> Response {
    let (tier, salt) = match QuotaTier::of(&s, &q).and_then(|t| Ok((t, salt_from_path(&raw)?))) {
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
    tier.set(&s, &salt, Some(bytes));
    Json(json!({"cache_salt": salt_name(&salt), "tier": tier.name(), "limit_gb": body.limit_gb,
                "status": "ok"}))
    .into_response()
}

pub(super) async fn quota_delete(
    State(s): State<Shared>,
    Path(raw): Path<String>,
    axum::extract::Query(q): axum::extract::Query<QuotaQuery>,
) -> Response {
    let (tier, salt) = match QuotaTier::of(&s, &q).and_then(|t| Ok((t, salt_from_path(&raw)?))) {
        Ok(x) => x,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let existed = tier.quota(&s, &salt).is_some();
    tier.set(&s, &salt, None);
    let status = if existed { "removed" } else { "not_found" };
    Json(json!({"cache_salt": salt_name(&salt), "tier": tier.name(), "status": status}))
        .into_response()
}
