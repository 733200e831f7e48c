//! The HTTP API (axum), LMCache's routes and JSON shapes, one file per resource:
//! - [`status`]: `/status`, `/version`, `/config`, `/config/adapters`, `/metrics`,
//!   `/metrics/reset`; [`history`]: `/status/history` (the status page's last minutes);
//! - [`cache`]: `POST /cache/clear`, `POST /cache/checksums`, `GET|DELETE /cache/objects`,
//!   `GET /cache/requests` (recent lookups), `GET /cache/requests/{request_id}/explain` (why
//!   a lookup missed);
//! - [`quota`]: `GET /quota`, `GET|PUT|DELETE /quota/{cache_salt}` (`_default` is the empty
//!   salt; `?tier=l1`, the default, or `?tier=l2`);
//! - [`l2`]: `/reconfigure/{backend}/l2/...` and `/cache/prefetches`;
//! - [`fleet`]: `GET /fleet/snapshot`, the resident keys a coordinator resyncs from;
//! - [`page`]: `GET /`, the status page for a browser (LMCache's JSON for anything else).
//!
//! Errors are `{"detail": ...}` with a 4xx status naming what was wrong. With
//! `--http-auth-token` (or `LMCACHE_RS_HTTP_TOKEN`) every route but `/healthcheck` requires
//! `Authorization: Bearer <token>`; there is no route that dumps the environment or runs code.
//!
//! A handler that panics answers 500 `{"detail": "internal error: ..."}`, is logged and counted
//! (`lmcache_rs_handler_panics`, `lmcache_rs_mp_request_errors{op="http",kind="panic"}`); the
//! server keeps serving.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Json, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lmcache_core::CacheSalt;
use lmcache_http::{Api, error};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::registry::Family;
use crate::state::ServerState;
use crate::transfer::{checksums, compress_ranges, kernel_transfers};

mod cache;
pub mod fleet;
pub mod history;
mod l2;
mod page;
mod quota;
mod status;

use cache::*;
use l2::*;
use quota::*;
use status::*;

type Shared = Arc<ServerState>;

/// Refuses requests without the configured bearer token (none configured: all pass).
async fn auth(
    State(s): State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    // The status page's shell holds no data (its script asks for it with the token), so a
    // browser can load it and be asked for the token; `GET /` for anything else is guarded.
    let page_shell = req.method() == axum::http::Method::GET
        && req.uri().path() == "/"
        && page::wants_html(req.headers());
    if let Some(token) = &s.config.http_auth_token
        && req.uri().path() != "/healthcheck"
        && !page_shell
        && !lmcache_http::bearer_ok(req.headers(), token)
    {
        return error(StatusCode::UNAUTHORIZED, "authorization: missing or wrong bearer token");
    }
    next.run(req).await
}

/// Every route of the API.
fn api() -> Api<Shared> {
    Api::new()
        .get("/", page::root)
        .get("/healthcheck", || async { Json(json!({"status": "healthy"})) })
        .get("/status", status)
        .get("/status/history", history::history)
        .get("/version", version)
        .get("/lmc_version", version)
        .get("/commit_id", || async {
            Json(json!({"commit_id": option_env!("LMCACHE_RS_COMMIT").unwrap_or("unknown")}))
        })
        .get("/config", config)
        .get("/config/adapters", config_adapters)
        .get("/reconfigure/{backend}/l2/status", reconfigure_status)
        .post("/reconfigure/{backend}/l2/{operation}", reconfigure)
        .get("/metrics", metrics)
        .post("/metrics/reset", metrics_reset)
        .post("/cache/prefetches", prefetch_submit)
        .get("/cache/prefetches/{request_id}", prefetch_status)
        .post("/cache/clear", clear)
        .get("/cache/objects", objects_list)
        .delete("/cache/objects", objects_delete)
        .post("/cache/checksums", cache_checksums)
        .get("/cache/requests", recent_requests)
        .get("/cache/requests/{request_id}/explain", explain_request)
        .get("/fleet/snapshot", fleet::snapshot)
        .get("/quota", quota_list)
        .get("/quota/{salt}", quota_get)
        .put("/quota/{salt}", quota_put)
        .delete("/quota/{salt}", quota_delete)
}

/// `(method, path)` of every route the router serves, in the order they were added.
pub fn route_list() -> Vec<(&'static str, &'static str)> {
    api().routes().to_vec()
}

/// The router. The bearer-token guard and the panic catcher are layered on the whole API
/// once every route is in it (routes are only added in [`api`]), so none is outside them.
pub fn router(state: Shared) -> Router {
    let guard = axum::middleware::from_fn_with_state(state.clone(), auth);
    api()
        .into_router()
        .layer(guard)
        .layer(lmcache_http::catch_panics("server", {
            let state = Arc::clone(&state);
            move || {
                state.metrics.handler_panics.inc();
                state.metrics.error("http", "panic");
            }
        }))
        .with_state(state)
}
