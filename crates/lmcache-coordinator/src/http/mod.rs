//! LMCache's coordinator HTTP API (axum), its routes, JSON shapes and status codes, plus
//! `POST /directory/route` (the routing answer LMCache leaves to routers) and the
//! Mooncake RFC #1403 indexer queries `POST /query` and `POST /query_by_hash` that Dynamo's
//! and Mooncake's routers speak. One module per resource, each a route table over the shared
//! service shell ([`lmcache_http`]); they import only from here, never from each other:
//! - [`registry`]: registration, heartbeats, usage;
//! - [`events`]: `POST /events`;
//! - [`directory`]: lookups, listings, stats, digests, blend lookups, routing, RFC #1403;
//! - [`control`]: quotas, pins, prefetch and delete relays;
//! - `page`: `GET /`, the fleet's page for a browser.
//!
//! Errors are `{"detail": ...}`: 422 for a body LMCache's models would refuse, 400 for a
//! request that cannot be served (too many tokens), 404 for an unknown instance. A handler
//! that panics answers 500 and the coordinator keeps serving.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Json, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lmcache_http::{Api, error};
use serde_json::json;

use crate::fleet::{Fleet, FleetError};

pub mod control;
pub mod directory;
pub mod events;
mod page;
pub mod registry;

type Shared = Arc<Fleet>;

/// The largest request body accepted (bytes).
pub const MAX_BODY: usize = 64 << 20;

pub(crate) fn fail(s: &Fleet, e: FleetError) -> Response {
    let code = match &e {
        FleetError::Invalid(_) => StatusCode::UNPROCESSABLE_ENTITY,
        FleetError::BadRequest(_) => StatusCode::BAD_REQUEST,
        FleetError::UnknownInstance(_) => StatusCode::NOT_FOUND,
        FleetError::Directory(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    if code != StatusCode::NOT_FOUND {
        s.metrics.invalid_requests.inc();
        tracing::warn!(error = %e, status = code.as_u16(), "coordinator request refused");
    }
    error(code, e.to_string())
}

/// Every route of the API.
fn api() -> Api<Shared> {
    Api::new()
        .get("/", page::root)
        .get("/healthz", || async { Json(json!({"status": "healthy"})) })
        .get("/metrics", metrics)
        .merge(registry::api())
        .merge(events::api())
        .merge(directory::api())
        .merge(control::api())
}

/// `(method, path)` of every route the router serves, in the order they were added.
pub fn route_list() -> Vec<(&'static str, &'static str)> {
    api().routes().to_vec()
}

/// Whether `method path` changes the coordinator's state: every PUT and DELETE, and every
/// POST but the directory's queries (lookups, routing, RFC #1403), which only read.
pub fn is_write(method: &str, path: &str) -> bool {
    match method {
        "GET" | "HEAD" => false,
        "POST" => !(path.starts_with("/directory/") || path.starts_with("/query")),
        _ => true,
    }
}

/// Whether a write route is one a cache server calls about itself (registration, heartbeats,
/// deregistration, event reports): what `--allow-unauthenticated-registration` opens.
fn is_instance_route(path: &str) -> bool {
    path == "/instances" || path == "/events" || path.starts_with("/instances/")
}

/// With `--auth-token`, refuses writes without it (instance routes pass when unauthenticated
/// registration is allowed: the instance is then untrusted).
async fn auth(
    State(s): State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(token) = &s.config().auth_token
        && is_write(req.method().as_str(), req.uri().path())
        && !lmcache_http::bearer_ok(req.headers(), token)
        && !(s.config().allow_unauthenticated_registration && is_instance_route(req.uri().path()))
    {
        s.metrics.invalid_requests.inc();
        tracing::warn!(method = %req.method(), path = req.uri().path(), "write without the coordinator's token refused");
        return lmcache_http::error(
            StatusCode::UNAUTHORIZED,
            "authorization: this route needs the coordinator's bearer token (--auth-token)",
        );
    }
    next.run(req).await
}

/// Whether `headers` carry the coordinator's token (never, when it has none).
pub(crate) fn trusted(s: &Fleet, headers: &axum::http::HeaderMap) -> bool {
    s.config().auth_token.as_deref().is_some_and(|t| lmcache_http::bearer_ok(headers, t))
}

/// The router: the API, under the write guard, the body limit and the panic catcher.
pub fn router(state: Shared) -> Router {
    let metrics = Arc::clone(&state.metrics);
    let guard = axum::middleware::from_fn_with_state(Arc::clone(&state), auth);
    api()
        .into_router()
        .layer(guard)
        // Bodies of LMCache's sizes: a 1,000,000-token lookup, or event batches with tokens.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .layer(lmcache_http::catch_panics("coordinator", move || {
            metrics.handler_panics.inc();
        }))
        .with_state(state)
}

async fn metrics(State(s): State<Shared>) -> Response {
    if !s.config().metrics_enabled {
        return error(StatusCode::NOT_FOUND, "metrics are disabled");
    }
    let (l1, l2, keys) = s.totals();
    s.metrics.set_tiers(l1, l2);
    s.metrics.keys.set(keys as i64);
    s.metrics.instances.set(s.instances().len() as i64);
    for st in s.streams() {
        let l = crate::metrics::InstanceLabel { instance_id: st.instance_id };
        s.metrics.stream_gap.get_or_create(&l).set(i64::from(st.gap_detected));
        s.metrics.stream_staleness.get_or_create(&l).set(st.seconds_since_last_batch);
    }
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        s.metrics.encode(),
    )
        .into_response()
}
