//! Cache events over HTTP: `POST /events` (off when they arrive through NATS JetStream).

use axum::extract::{Json, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lmcache_http::{Api, JsonBody as Body, error};
use lmcache_protocol::coordinator::CacheEventsRequest;

use super::{Shared, fail};

/// The routes.
pub(super) fn api() -> Api<Shared> {
    Api::new().post("/events", events)
}

async fn events(State(s): State<Shared>, Body(req): Body<CacheEventsRequest>) -> Response {
    if s.config().event_transport != crate::transport::EventTransport::Http {
        return error(
            StatusCode::NOT_FOUND,
            "POST /events is disabled: this coordinator consumes cache events from NATS JetStream (--event-transport jetstream)",
        );
    }
    match tokio::task::block_in_place(|| s.ingest(&req.batches)) {
        Ok(r) => Json(r).into_response(),
        Err(e) => fail(&s, e),
    }
}
