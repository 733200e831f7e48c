//! The directory's questions: `POST /directory/lookup`, `GET /directory/keys`,
//! `GET /directory/stats`, `GET /directory/digest`, `POST /directory/blend-lookup`,
//! `POST /directory/route` (ours), and Mooncake RFC #1403's `POST /query` and
//! `POST /query_by_hash`.

use std::collections::BTreeMap;

use axum::extract::{Json, Query, State};
use axum::response::{IntoResponse, Response};
use lmcache_directory::{KeyFilter, Tier};
use lmcache_http::{Api, JsonBody as Body, RawBody, json_bytes, parse_json};
use lmcache_protocol::coordinator::{DirectoryListResponse, WireTier};
use lmcache_protocol::coordinator_borrowed::{DirectoryLookupBody, EncodedObjectKeyRef};
use lmcache_protocol::coordinator_write::lookup_answer_json;
use serde::Deserialize;
use serde_json::json;

use super::{Shared, fail};
use crate::fleet::{FleetError, keys_of_chunks};

/// The routes.
pub(super) fn api() -> Api<Shared> {
    Api::new()
        .post("/directory/lookup", lookup)
        .get("/directory/keys", keys)
        .get("/directory/stats", stats)
        .get("/directory/digest", digest)
        .post("/directory/blend-lookup", blend_lookup)
        .post("/directory/route", route)
        .post("/query", rfc_query)
        .post("/query_by_hash", rfc_query)
}

/// The body is decoded borrowing its strings and the answer written straight to JSON
/// (`lookup_answer_json`): a 64-key lookup allocates no string per key either way.
async fn lookup(State(s): State<Shared>, RawBody(body): RawBody) -> Response {
    let req: DirectoryLookupBody<'_> = match parse_json(&body) {
        Ok(req) => req,
        Err(refused) => return refused.into_response(),
    };
    if req.keys.is_empty() == req.token_ids.is_empty() {
        return fail(&s, FleetError::Invalid("supply exactly one of 'keys' or 'token_ids'".into()));
    }
    let resolved;
    let (chunks, keys) = if req.keys.is_empty() {
        if req.model_name.is_empty() {
            return fail(
                &s,
                FleetError::Invalid("'model_name' is required with 'token_ids'".into()),
            );
        }
        match s.resolve_tokens(&req.token_ids, &req.model_name, req.world_size, &req.cache_salt) {
            Ok((chunks, keys)) => {
                resolved = s.across_object_groups(keys);
                (chunks, resolved.iter().map(EncodedObjectKeyRef::of).collect())
            }
            Err(e) => return fail(&s, e),
        }
    } else {
        (req.keys.len(), req.keys)
    };
    match s.lookup_answers(&keys) {
        Ok(answers) => json_bytes(lookup_answer_json(chunks as u64, &keys, &answers)),
        Err(e) => fail(&s, e),
    }
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    #[serde(default)]
    tier: WireTier,
    #[serde(default)]
    instance_id: String,
    #[serde(default)]
    backend: String,
    #[serde(default)]
    offset: usize,
    #[serde(default = "thousand")]
    limit: usize,
}

fn thousand() -> usize {
    1000
}

async fn keys(
    State(s): State<Shared>,
    q: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Query(q) = match q {
        Ok(q) => q,
        Err(e) => return fail(&s, FleetError::Invalid(e.body_text())),
    };
    if !(1..=10_000).contains(&q.limit) {
        return fail(&s, FleetError::Invalid(format!("limit: {} is not in 1..10000", q.limit)));
    }
    let filter = KeyFilter {
        tier: match q.tier {
            WireTier::L1 => Some(Tier::L1),
            WireTier::L2 => Some(Tier::L2),
            WireTier::All => None,
        },
        instance: (!q.instance_id.is_empty()).then_some(q.instance_id),
        backend: (!q.backend.is_empty()).then_some(q.backend),
    };
    let (total, keys) = tokio::task::block_in_place(|| s.list(&filter, q.offset, q.limit));
    Json(DirectoryListResponse { total, keys }).into_response()
}

async fn stats(State(s): State<Shared>) -> Response {
    Json(s.directory_stats()).into_response()
}

/// An order-independent digest of every placement (total and per instance) and the stream
/// position it reflects: replicas at one position must agree.
async fn digest(State(s): State<Shared>) -> Response {
    Json(tokio::task::block_in_place(|| s.digest())).into_response()
}

#[derive(Debug, Deserialize)]
struct BlendLookupRequest {
    #[serde(default)]
    tokens_b64: String,
    #[serde(default)]
    model_name: String,
    #[serde(default = "one_u")]
    world_size: u32,
    #[serde(default)]
    cache_salt: String,
}

/// The most tokens one blend query may carry (LMCache's lookup cap).
const MAX_BLEND_TOKENS: usize = 1_000_000;

/// `tokens_b64` as LMCache packs it: base64 of little-endian `u32` token ids.
fn decode_tokens(b64: &str) -> Result<Vec<u32>, String> {
    use base64::Engine as _;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| format!("tokens_b64 is not valid base64: {e}"))?;
    if raw.len() % 4 != 0 {
        return Err(format!(
            "tokens_b64 byte length {} is not a multiple of 4 (malformed uint32 token buffer)",
            raw.len()
        ));
    }
    if raw.len() / 4 > MAX_BLEND_TOKENS {
        return Err(format!("tokens_b64: {} tokens, more than {MAX_BLEND_TOKENS}", raw.len() / 4));
    }
    Ok(raw.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// CacheBlend's fragment lookup: the stored chunks of the caller's namespace whose tokens
/// occur anywhere in the query, each verified token-exactly, with where each sat when stored
/// (`old_st`) and where it sits in the query (`cur_st`). Empty unless the coordinator runs
/// with `--enable-blend-lookup`, as LMCache's.
async fn blend_lookup(State(s): State<Shared>, Body(req): Body<BlendLookupRequest>) -> Response {
    let tokens = match decode_tokens(&req.tokens_b64) {
        Ok(t) => t,
        Err(e) => return fail(&s, FleetError::Invalid(e)),
    };
    if !req.tokens_b64.is_empty() && req.model_name.is_empty() {
        return fail(&s, FleetError::Invalid("'model_name' is required with 'tokens_b64'".into()));
    }
    if req.world_size < 1 {
        return fail(&s, FleetError::Invalid("world_size: must be >= 1".into()));
    }
    let matches = tokio::task::block_in_place(|| {
        s.blend_matches(&tokens, &req.model_name, &req.cache_salt, req.world_size)
    });
    let matches: Vec<serde_json::Value> = matches
        .iter()
        .map(|m| json!({"chunk_hash": hex::encode(m.chunk_hash), "old_st": m.old_st, "cur_st": m.cur_st}))
        .collect();
    Json(json!({"matches": matches})).into_response()
}

fn half() -> f64 {
    0.5
}

fn one_f() -> f64 {
    1.0
}

fn one_u() -> u32 {
    1
}

/// `POST /directory/route` body: a request's tokens (its whole sequence from position 0) or
/// its chunk hashes, and how to weigh L2 and load.
#[derive(Debug, Deserialize)]
struct RouteRequest {
    #[serde(default)]
    token_ids: Vec<u32>,
    /// Hex chunk hashes, in prefix order (instead of `token_ids`).
    #[serde(default)]
    chunk_hashes: Vec<String>,
    #[serde(default)]
    model_name: String,
    #[serde(default = "one_u")]
    world_size: u32,
    #[serde(default)]
    cache_salt: String,
    /// Value of a chunk loaded from L2 relative to one in L1.
    #[serde(default = "half")]
    l2_weight: f64,
    /// Cost of one unit of `loads` in chunks.
    #[serde(default = "one_f")]
    load_weight: f64,
    /// The router's view of each instance's load (e.g. queued prefill chunks).
    #[serde(default)]
    loads: BTreeMap<String, f64>,
}

async fn route(State(s): State<Shared>, Body(req): Body<RouteRequest>) -> Response {
    if req.model_name.is_empty() {
        return fail(&s, FleetError::Invalid("'model_name' is required".into()));
    }
    if req.token_ids.is_empty() == req.chunk_hashes.is_empty() {
        return fail(
            &s,
            FleetError::Invalid("supply exactly one of 'token_ids' or 'chunk_hashes'".into()),
        );
    }
    if ![req.l2_weight, req.load_weight].iter().all(|w| w.is_finite())
        || req.loads.values().any(|l| !l.is_finite())
    {
        return fail(&s, FleetError::Invalid("weights and loads must be finite numbers".into()));
    }
    let (chunks, keys) = if req.chunk_hashes.is_empty() {
        match s.resolve_tokens(&req.token_ids, &req.model_name, req.world_size, &req.cache_salt) {
            Ok(r) => r,
            Err(e) => return fail(&s, e),
        }
    } else {
        match keys_of_chunks(&req.chunk_hashes, &req.model_name, req.world_size, &req.cache_salt) {
            Ok(keys) => (req.chunk_hashes.len(), keys),
            Err(e) => return fail(&s, e),
        }
    };
    let per_chunk = req.world_size.max(1) as usize;
    match s.route(&keys, per_chunk, req.l2_weight, req.load_weight, &req.loads) {
        Ok(cands) => {
            let best = cands.first().map(|c| c.instance_id.clone());
            Json(json!({"chunks": chunks, "best": best, "instances": cands})).into_response()
        }
        Err(e) => fail(&s, e),
    }
}

fn default_tenant() -> String {
    "default".into()
}

/// Mooncake RFC #1403 `POST /query` (`token_ids`) and `POST /query_by_hash` (`seq_hashes`, or
/// the older `block_hash`). LMCache chunk hashes are 32-byte BLAKE3 prefix chains, so hashes
/// are taken as 64-hex strings; `block_size` must be the fleet's chunk size. `world_size`
/// (an lmcache-rs extension, default 1) selects the rank fan-out. Media: `CPU` is the L1 run,
/// `DISK` the run reachable from L1 or L2 (cumulative, as Dynamo's indexer reports tiers),
/// `GPU` 0 (engine memory is not reported to this coordinator).
#[derive(Debug, Deserialize)]
struct RfcQuery {
    model: String,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    token_ids: Vec<u32>,
    #[serde(default)]
    seq_hashes: Vec<serde_json::Value>,
    #[serde(default)]
    block_hash: Vec<serde_json::Value>,
    #[serde(default = "default_tenant")]
    tenant_id: String,
    #[serde(default)]
    instance_id: Option<String>,
    block_size: usize,
    #[serde(default)]
    cache_salt: String,
    #[serde(default = "one_u")]
    world_size: u32,
}

async fn rfc_query(State(s): State<Shared>, Body(req): Body<RfcQuery>) -> Response {
    if req.lora_name.as_deref().is_some_and(|l| !l.is_empty()) {
        return fail(&s, FleetError::BadRequest(
            "lora_name: LoRA adapters are not part of LMCache's chunk keys; query the adapter's own model name".into(),
        ));
    }
    let chunk = s.config().chunk_size;
    if req.block_size != chunk {
        return fail(
            &s,
            FleetError::BadRequest(format!(
                "block_size: {} differs from the fleet's chunk size {chunk}",
                req.block_size
            )),
        );
    }
    let hashes: Vec<serde_json::Value> =
        if req.seq_hashes.is_empty() { req.block_hash } else { req.seq_hashes };
    let keys = if hashes.is_empty() {
        match s.resolve_tokens(&req.token_ids, &req.model, req.world_size, &req.cache_salt) {
            Ok((_, keys)) => keys,
            Err(e) => return fail(&s, e),
        }
    } else {
        let mut hex = Vec::with_capacity(hashes.len());
        for (i, h) in hashes.iter().enumerate() {
            let Some(h) = h.as_str() else {
                return fail(
                    &s,
                    FleetError::BadRequest(format!(
                        "seq_hashes[{i}]: LMCache chunk hashes are 32-byte BLAKE3 values; give them as 64 hex digits (or query by token_ids)"
                    )),
                );
            };
            hex.push(h.to_string());
        }
        match keys_of_chunks(&hex, &req.model, req.world_size, &req.cache_salt) {
            Ok(keys) => keys,
            Err(e) => return fail(&s, e),
        }
    };
    let per_chunk = req.world_size.max(1) as usize;
    match s.route(&keys, per_chunk, 1.0, 0.0, &BTreeMap::new()) {
        Ok(cands) => {
            let instances: serde_json::Map<String, serde_json::Value> = cands
                .into_iter()
                .filter(|c| req.instance_id.as_deref().is_none_or(|i| i == c.instance_id))
                .map(|c| {
                    let answer = json!({
                        "longest_matched": c.l1_l2_tokens,
                        "GPU": 0,
                        "CPU": c.l1_tokens,
                        "DISK": c.l1_l2_tokens,
                        "DP": {"0": c.l1_l2_tokens},
                    });
                    (c.instance_id, answer)
                })
                .collect();
            Json(json!({ req.tenant_id: instances })).into_response()
        }
        Err(e) => fail(&s, e),
    }
}
