//! Cache events over HTTP: `POST /events` (off when they arrive through NATS JetStream).

use axum::extract::{Json, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lmcache_http::{Api, RawBody, error, parse_json_with};
use lmcache_protocol::coordinator_borrowed::{CacheEventsBody, decode_body};

use super::{Shared, fail};

/// The routes.
pub(super) fn api() -> Api<Shared> {
    Api::new().post("/events", events)
}

/// The body is decoded in place ([`decode_body`]: one pass over the usual shape, strings
/// borrowed from it, each hash decoded once), then ingested as
/// [`crate::fleet::Fleet::ingest`] would the owned batches.
async fn events(State(s): State<Shared>, RawBody(body): RawBody) -> Response {
    if s.config().event_transport != crate::transport::EventTransport::Http {
        return error(
            StatusCode::NOT_FOUND,
            "POST /events is disabled: this coordinator consumes cache events from NATS JetStream (--event-transport jetstream)",
        );
    }
    let req: CacheEventsBody<'_> = match parse_json_with(&body, decode_body) {
        Ok(req) => req,
        Err(refused) => return refused.into_response(),
    };
    match tokio::task::block_in_place(|| s.ingest_borrowed(&req.batches)) {
        Ok(r) => Json(r).into_response(),
        Err(e) => fail(&s, e),
    }
}
