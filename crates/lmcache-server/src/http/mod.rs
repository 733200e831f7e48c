//! The HTTP API (axum), LMCache's routes and JSON shapes, one file per resource:
//! - [`status`]: `/status`, `/version`, `/config`, `/config/adapters`, `/metrics`,
//!   `/metrics/reset`;
//! - [`cache`]: `POST /cache/clear`, `POST /cache/checksums`, `GET|DELETE /cache/objects`;
//! - [`quota`]: `GET /quota`, `GET|PUT|DELETE /quota/{cache_salt}` (`_default` is the empty
//!   salt; `?tier=l1`, the default, or `?tier=l2`);
//! - [`l2`]: `/reconfigure/{backend}/l2/...` and `/cache/prefetches`;
//! - [`fleet`]: `GET /fleet/snapshot`, the resident keys a coordinator resyncs from.
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
use serde::Deserialize;
use serde_json::{Value, json};

use crate::registry::Family;
use crate::state::ServerState;
use crate::transfer::{checksums, compress_ranges, kernel_transfers};

mod cache;
pub mod fleet;
mod l2;
mod quota;
mod status;

use cache::*;
use l2::*;
use quota::*;
use status::*;

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

/// The API's routes, recorded as they are added: the router serves exactly what
/// [`route_list`] lists, so a test can walk every route of the built router.
struct Api {
    router: Router<Shared>,
    routes: Vec<(&'static str, &'static str)>,
}

macro_rules! method {
    ($name:ident, $verb:literal) => {
        fn $name<H, T>(mut self, path: &'static str, handler: H) -> Self
        where
            H: axum::handler::Handler<T, Shared>,
            T: 'static,
        {
            self.router = self.router.route(path, axum::routing::$name(handler));
            self.routes.push(($verb, path));
            self
        }
    };
}

impl Api {
    fn new() -> Self {
        Self { router: Router::new(), routes: Vec::new() }
    }
    method!(get, "GET");
    method!(post, "POST");
    method!(put, "PUT");
    method!(delete, "DELETE");
}

/// Every route of the API.
fn api() -> Api {
    Api::new()
        .get("/", || async { Json(json!({"status": "ok", "service": "LMCache HTTP API"})) })
        .get("/healthcheck", || async { Json(json!({"status": "healthy"})) })
        .get("/status", status)
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
        .get("/fleet/snapshot", fleet::snapshot)
        .get("/quota", quota_list)
        .get("/quota/{salt}", quota_get)
        .put("/quota/{salt}", quota_put)
        .delete("/quota/{salt}", quota_delete)
}

/// `(method, path)` of every route the router serves, in the order they were added.
pub fn route_list() -> Vec<(&'static str, &'static str)> {
    api().routes
}

/// The router. The bearer-token guard and the panic catcher wrap the whole API as one
/// service (an outer router), so no route can be added outside them.
pub fn router(state: Shared) -> Router {
    let guard = axum::middleware::from_fn_with_state(state.clone(), auth);
    Router::new()
        .merge(api().router)
        .layer(guard)
        .layer(catch_panics({
            let state = Arc::clone(&state);
            move || {
                state.metrics.handler_panics.inc();
                state.metrics.error("http", "panic");
            }
        }))
        .with_state(state)
}

/// Turns a handler panic into a 500 reply, logged and counted by `count`.
fn catch_panics(
    count: impl Fn() + Clone + Send + Sync + 'static,
) -> tower_http::catch_panic::CatchPanicLayer<
    impl Fn(Box<dyn std::any::Any + Send + 'static>) -> Response + Clone,
> {
    tower_http::catch_panic::CatchPanicLayer::custom(
        move |payload: Box<dyn std::any::Any + Send>| {
            let reason = crate::handlers::panic_message(payload.as_ref());
            tracing::error!(error = %reason, "HTTP handler failed");
            count();
            error(StatusCode::INTERNAL_SERVER_ERROR, format!("internal error: {reason}"))
        },
    )
}

fn error(code: StatusCode, detail: impl Into<String>) -> Response {
    (code, Json(json!({"detail": detail.into()}))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tower::ServiceExt;

    async fn boom() -> &'static str {
        panic!("exploded on purpose")
    }

    #[tokio::test]
    async fn a_panicking_route_answers_500_and_the_router_keeps_serving() {
        let panics = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&panics);
        let app = Router::new()
            .route("/boom", get(boom))
            .route("/ok", get(|| async { "fine" }))
            .layer(catch_panics(move || {
                counted.fetch_add(1, Ordering::Relaxed);
            }));
        let call = |path: &str| {
            let req = axum::http::Request::get(path).body(axum::body::Body::empty());
            app.clone().oneshot(req.unwrap())
        };
        let r = call("/boom").await.unwrap();
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["detail"], "internal error: exploded on purpose");
        assert_eq!(panics.load(Ordering::Relaxed), 1);
        assert_eq!(call("/ok").await.unwrap().status(), StatusCode::OK);
        assert_eq!(panics.load(Ordering::Relaxed), 1);
    }
}
