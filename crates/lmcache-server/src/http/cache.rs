//! Cached objects: `POST /cache/clear`, `POST /cache/checksums`, `GET|DELETE /cache/objects`
//! (`tier=l1|l2|all`), and `GET /cache/requests/{request_id}/explain`: why a request's last
//! lookup missed, chunk by chunk ([`crate::explain`]).

use lmcache_storage::{DeleteScope, L2Listing, StorageError};

use super::*;

#[derive(Debug, Deserialize, Default)]
pub(super) struct ClearBody {
    #[serde(default)]
    tier: Option<String>,
    #[serde(default)]
    force: bool,
}

pub(super) async fn clear(State(s): State<Shared>, raw: axum::body::Bytes) -> Response {
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
    let r = s.l1().clear(body.force);
    Json(json!({"status": "ok", "cleared": {"tier": tier, "removed": r.removed, "skipped": r.skipped}}))
        .into_response()
}

#[derive(Debug, Deserialize)]
pub(super) struct ChecksumBody {
    #[serde(default)]
    block_ids: Vec<u64>,
    #[serde(default)]
    chunk_size: i64,
    #[serde(default)]
    instance_id: u64,
    #[serde(default)]
    layerwise: bool,
}

pub(super) async fn cache_checksums(
    State(s): State<Shared>,
    Json(b): Json<ChecksumBody>,
) -> Response {
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
    let Some((groups, layers)) = kernel_transfers(&inst, 1) else {
        return error(StatusCode::NOT_IMPLEMENTED, "checksum not supported for this registration");
    };
    let sums = match checksums(&groups, &layers, &b.block_ids, b.chunk_size as usize, b.layerwise) {
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

#[derive(Debug, Deserialize)]
pub(super) struct ObjectsQuery {
    #[serde(default)]
    tier: Option<String>,
    #[serde(default)]
    adapter: Option<u64>,
    #[serde(default)]
    model_name: Option<String>,
    /// Only objects of this cache salt (`_default`, or an empty value: the unsalted ones).
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    page_size: Option<usize>,
    #[serde(default)]
    page_token: Option<String>,
}

impl ObjectsQuery {
    fn filter(&self) -> lmcache_l2::KeyFilter {
        lmcache_l2::KeyFilter {
            model: self.model_name.clone(),
            cache_salt: self
                .cache_salt
                .as_ref()
                .map(|s| if s == super::quota::DEFAULT_SALT { String::new() } else { s.clone() }),
        }
    }
}

pub(super) fn check_tier(s: &ServerState, tier: Option<&str>) -> Result<(), String> {
    match tier.unwrap_or("l1") {
        "l1" | "all" => Ok(()),
        "l2" if s.storage.has_l2() => Ok(()),
        "l2" => Err("tier: l2 is not configured (start the server with --l2-adapter)".into()),
        other => Err(format!("tier: {other:?} is not l1, l2 or all")),
    }
}

pub(super) fn encode_key(k: &lmcache_core::ObjectKey) -> Value {
    json!({
        "chunk_hash_hex": k.chunk_hash.to_hex(),
        "model_name": k.model_name.as_str(),
        "kv_rank": k.kv_rank.packed(),
        "object_group_id": k.object_group_id,
        "cache_salt": k.cache_salt.as_str(),
    })
}

/// `GET /cache/objects`: resident L1 objects, paginated (`page_size` <= 5000, default 500).
pub(super) async fn objects_list(
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
    let filter = q.filter();
    let all = s.l1().resident_keys();
    let matching: Vec<_> = all.into_iter().filter(|(k, _)| filter.matches(k)).collect();
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
    let shown = skip.saturating_add(entries.len());
    let next = (shown < total).then(|| shown.to_string());
    Json(json!({"tier": "l1", "shared": false, "total": total, "entries": entries, "next_page_token": next}))
        .into_response()
}

#[derive(Debug, Deserialize)]
pub(super) struct DeleteKey {
    chunk_hash_hex: String,
    model_name: String,
    kv_rank: u32,
    #[serde(default)]
    object_group_id: u32,
    #[serde(default)]
    cache_salt: String,
}

#[derive(Debug, Deserialize)]
pub(super) struct DeleteBody {
    keys: Vec<DeleteKey>,
    #[serde(default)]
    tier: Option<String>,
    #[serde(default)]
    adapter: Option<u64>,
    #[serde(default)]
    force: bool,
}

/// `DELETE /cache/objects`: delete keys from L1 (`force` also drops locked ones once released).
pub(super) async fn objects_delete(State(s): State<Shared>, raw: axum::body::Bytes) -> Response {
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
    let scope = match body.tier.as_deref().unwrap_or("l1") {
        "l1" => DeleteScope::L1,
        "l2" => DeleteScope::L2,
        _ => DeleteScope::All,
    };
    match s.storage.delete(scope, body.adapter, keys, body.force).await {
        Ok(r) => Json(json!({"deleted": r.deleted, "skipped": r.skipped, "ok": true})),
        Err(e @ StorageError::NoSuchAdapter { .. }) => {
            return error(StatusCode::NOT_FOUND, e.to_string());
        }
        Err(e) => Json(json!({"deleted": 0, "skipped": 0, "ok": false,
                               "error": format!("L2 delete failed: {e}")})),
    }
    .into_response()
}

/// `GET /cache/objects?tier=l2[&adapter=N]`: one adapter's keys, a page at a time.
pub(super) async fn l2_objects_list(s: &ServerState, q: ObjectsQuery, size: usize) -> Response {
    let listing = s.storage.list_l2(q.adapter, q.filter(), q.page_token.clone(), size);
    match listing.await {
        Ok(L2Listing { adapter, kind, page }) => {
            let entries: Vec<Value> = page
                .keys
                .iter()
                .map(|(k, n)| {
                    let mut v = encode_key(k);
                    v["size_bytes"] = json!(n);
                    v
                })
                .collect();
            Json(json!({"tier": "l2", "adapter": adapter, "type": kind,
                        "shared": false, "entries": entries, "next_page_token": page.next}))
            .into_response()
        }
        Err(e @ StorageError::NoSuchAdapter { .. }) => error(StatusCode::NOT_FOUND, e.to_string()),
        Err(e @ StorageError::NoL2) => error(StatusCode::BAD_REQUEST, e.to_string()),
        Err(StorageError::Adapter {
            id,
            kind,
            source: lmcache_l2::L2Error::Unsupported { operation: what },
        }) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("adapter {id} ({kind}) does not support {what}"),
        ),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

pub(super) async fn explain_request(
    State(s): State<Shared>,
    Path(request_id): Path<String>,
) -> Response {
    let x = &s.channels.explain;
    if !x.enabled() {
        return error(
            StatusCode::NOT_FOUND,
            "explain: off (--explain-requests 0 or --disable-observability)",
        );
    }
    match x.explain(&request_id) {
        Some(e) => Json(e.to_json()).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            format!(
                "request_id: no lookup of {request_id:?} is remembered (never seen, or older than \
                 the last --explain-requests requests)"
            ),
        ),
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct RecentQuery {
    #[serde(default)]
    limit: Option<usize>,
}

/// `GET /cache/requests?limit=N`: the most recent lookups (newest first), each summarised.
pub(super) async fn recent_requests(
    State(s): State<Shared>,
    axum::extract::Query(q): axum::extract::Query<RecentQuery>,
) -> Response {
    let limit = q.limit.unwrap_or(50).min(1000);
    let rows: Vec<Value> = s
        .channels
        .explain
        .recent(limit)
        .iter()
        .map(|e| {
            let j = e.to_json();
            json!({"request_id": j["request_id"], "seconds_ago": j["seconds_ago"],
                   "model": j["model"], "cache_salt": j["cache_salt"], "chunks": j["chunks"],
                   "hit_chunks": j["hit_chunks"], "pending": j["pending"],
                   "first_miss": j["first_miss"]})
        })
        .collect();
    Json(json!({"requests": rows})).into_response()
}
