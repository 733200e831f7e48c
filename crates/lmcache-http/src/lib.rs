//! The HTTP service shell of lmcache-rs: what the server's API and the coordinator's share,
//! so that each resource module of either only declares routes and handlers.
//!
//! - [`Api`]: a route table that records every `(method, path)` it serves as it builds the
//!   router, so tests walk the routes of the built router (never a source file).
//! - [`catch_panics`]: a handler that panics answers 500 `{"detail": "internal error: ..."}`,
//!   is logged and counted by the caller's hook, and the service keeps serving.
//! - [`bearer_ok`]: `Authorization: Bearer <token>` checked in constant time.
//! - [`error`] and [`JsonBody`]: errors are `{"detail": ...}`; a body that does not decode is a
//!   422 naming the problem (FastAPI's status, as LMCache's services answer); [`RawBody`],
//!   [`parse_json`] and [`parse_json_with`] do the same for a body decoded borrowing from its
//!   bytes ([`BadBody`] is that 422); [`json_bytes`] answers JSON a route wrote itself.
//! - [`panic_message`]: the text of a panic payload.
//! - [`page`]: the status pages' kit (shared style and script, assembly, the CSP answer).
#![forbid(unsafe_code)]

pub mod page;

use axum::Router;
use axum::extract::{FromRequest, Json, Request};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

/// A router under construction that lists what it serves.
#[derive(Debug)]
pub struct Api<S> {
    router: Router<S>,
    routes: Vec<(&'static str, &'static str)>,
}

macro_rules! method {
    ($name:ident, $verb:literal) => {
        #[doc = concat!("Serves `", $verb, " path` with `handler`.")]
        pub fn $name<H, T>(mut self, path: &'static str, handler: H) -> Self
        where
            H: axum::handler::Handler<T, S>,
            T: 'static,
        {
            self.router = self.router.route(path, axum::routing::$name(handler));
            self.routes.push(($verb, path));
            self
        }
    };
}

impl<S: Clone + Send + Sync + 'static> Default for Api<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Clone + Send + Sync + 'static> Api<S> {
    /// No routes yet.
    pub fn new() -> Self {
        Self { router: Router::new(), routes: Vec::new() }
    }

    method!(get, "GET");
    method!(post, "POST");
    method!(put, "PUT");
    method!(delete, "DELETE");

    /// Adds every route of `other` (a resource module's table).
    pub fn merge(mut self, other: Api<S>) -> Self {
        self.router = self.router.merge(other.router);
        self.routes.extend(other.routes);
        self
    }

    /// `(method, path)` of every route, in the order they were added.
    pub fn routes(&self) -> &[(&'static str, &'static str)] {
        &self.routes
    }

    /// The router (layers go on it, outside every route).
    pub fn into_router(self) -> Router<S> {
        self.router
    }
}

/// The text of a panic payload (`&str` or `String`, as `panic!` makes them).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Turns a handler panic into a 500 reply, logged, and counted by `count`.
pub fn catch_panics(
    service: &'static str,
    count: impl Fn() + Clone + Send + Sync + 'static,
) -> tower_http::catch_panic::CatchPanicLayer<
    impl Fn(Box<dyn std::any::Any + Send + 'static>) -> Response + Clone,
> {
    tower_http::catch_panic::CatchPanicLayer::custom(
        move |payload: Box<dyn std::any::Any + Send>| {
            let reason = panic_message(payload.as_ref());
            tracing::error!(service, error = %reason, "HTTP handler failed");
            count();
            error(StatusCode::INTERNAL_SERVER_ERROR, format!("internal error: {reason}"))
        },
    )
}

/// `{"detail": detail}` with `code`.
pub fn error(code: StatusCode, detail: impl Into<String>) -> Response {
    (code, Json(serde_json::json!({"detail": detail.into()}))).into_response()
}

/// Whether `headers` carry `Authorization: Bearer <token>`, compared in constant time so the
/// response's timing does not leak the token.
pub fn bearer_ok(headers: &HeaderMap, token: &str) -> bool {
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    given.is_some_and(|g| same(g.as_bytes(), token.as_bytes()))
}

fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A JSON body whose rejection is a 422 naming the problem (FastAPI's status for any
/// undecodable body), not axum's 400/415 split. Decoded with `serde_json::from_slice`
/// straight (axum's `Json` tracks every field's path, which costs on large bodies).
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let RawBody(bytes) = RawBody::from_request(req, state).await?;
        parse_json(&bytes).map(JsonBody).map_err(IntoResponse::into_response)
    }
}

/// A body's bytes, for a handler that decodes JSON borrowing from them ([`parse_json`]);
/// unreadable, it is refused as [`JsonBody`] refuses it.
#[derive(Debug)]
pub struct RawBody(pub axum::body::Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        axum::body::Bytes::from_request(req, state).await.map(RawBody).map_err(|e| {
            error(StatusCode::UNPROCESSABLE_ENTITY, format!("body: {}", e.body_text()))
        })
    }
}

/// `bytes` decoded as JSON (strings may borrow from them), or [`JsonBody`]'s 422 naming
/// what did not decode. The body's UTF-8 is checked once, in one pass, before the parse:
/// `serde_json::from_slice` checks each string on its own, which cost a quarter of the
/// decode of a cache-event batch (`cargo bench -p lmcache-coordinator --bench ingest`).
pub fn parse_json<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, BadBody> {
    parse_json_with(bytes, serde_json::from_str)
}

/// [`parse_json`] with a decoder of the route's own (one that reads the usual shape of its
/// body in one pass, say), refused as [`parse_json`] refuses.
pub fn parse_json_with<'a, T, E: std::fmt::Display>(
    bytes: &'a [u8],
    decode: impl FnOnce(&'a str) -> Result<T, E>,
) -> Result<T, BadBody> {
    let text =
        std::str::from_utf8(bytes).map_err(|e| BadBody(format!("body: not UTF-8 JSON: {e}")))?;
    decode(text).map_err(|e| BadBody(format!("body: {e}")))
}

/// A 200 whose body is JSON already written (by a route's own writer).
pub fn json_bytes(body: Vec<u8>) -> Response {
    ([(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// A body that did not decode: answered 422 `{"detail": "body: ..."}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadBody(pub String);

impl IntoResponse for BadBody {
    fn into_response(self) -> Response {
        error(StatusCode::UNPROCESSABLE_ENTITY, self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tower::ServiceExt;

    async fn boom() -> &'static str {
        panic!("exploded on purpose")
    }

    async fn echo(JsonBody(v): JsonBody<serde_json::Value>) -> Json<serde_json::Value> {
        Json(v)
    }

    #[tokio::test]
    async fn routes_are_listed_panics_answer_500_and_bad_bodies_422() {
        let panics = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&panics);
        let api = Api::<()>::new()
            .get("/boom", boom)
            .merge(Api::new().post("/echo", echo).get("/ok", || async { "fine" }));
        assert_eq!(api.routes(), &[("GET", "/boom"), ("POST", "/echo"), ("GET", "/ok")]);
        let app = api.into_router().layer(catch_panics("test", move || {
            counted.fetch_add(1, Ordering::Relaxed);
        }));
        let call = |method: &str, path: &str, body: &'static str| {
            let req = axum::http::Request::builder().method(method).uri(path);
            app.clone().oneshot(req.body(axum::body::Body::from(body)).unwrap())
        };
        let r = call("GET", "/boom", "").await.unwrap();
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["detail"], "internal error: exploded on purpose");
        assert_eq!(panics.load(Ordering::Relaxed), 1);
        assert_eq!(call("GET", "/ok", "").await.unwrap().status(), StatusCode::OK);
        let r = call("POST", "/echo", "{not json").await.unwrap();
        assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(call("POST", "/echo", "[1]").await.unwrap().status(), StatusCode::OK);
    }

    #[test]
    fn bearer_tokens_must_match_exactly() {
        let mut h = HeaderMap::new();
        assert!(!bearer_ok(&h, "s3cret"));
        h.insert(axum::http::header::AUTHORIZATION, "Bearer s3cre".parse().unwrap());
        assert!(!bearer_ok(&h, "s3cret"));
        h.insert(axum::http::header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert!(bearer_ok(&h, "s3cret"));
        h.insert(axum::http::header::AUTHORIZATION, "Basic s3cret".parse().unwrap());
        assert!(!bearer_ok(&h, "s3cret"));
    }
}
