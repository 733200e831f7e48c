//! Registration, heartbeats and usage: `POST|GET /instances`, `PUT /instances/{id}/heartbeat`,
//! `DELETE /instances/{id}`, `GET /instances/usage`, `GET /instances/{id}/usage`, and ours:
//! `GET /instances/liveness` (seconds since each heartbeat).

use axum::extract::{Json, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lmcache_http::{Api, JsonBody as Body, error};
use lmcache_protocol::coordinator::RegisterRequest;
use serde_json::json;

use super::{Shared, fail};

/// The routes.
pub(super) fn api() -> Api<Shared> {
    Api::new()
        .post("/instances", register)
        .get("/instances", instances)
        .get("/instances/usage", usage)
        .get("/instances/liveness", liveness)
        .get("/instances/{id}/usage", instance_usage)
        .put("/instances/{id}/heartbeat", heartbeat)
        .delete("/instances/{id}", deregister)
}

async fn register(
    State(s): State<Shared>,
    headers: axum::http::HeaderMap,
    Body(req): Body<RegisterRequest>,
) -> Response {
    match s.register(req, super::trusted(&s, &headers)) {
        Ok(r) => Json(r).into_response(),
        Err(e) => fail(&s, e),
    }
}

async fn heartbeat(State(s): State<Shared>, Path(id): Path<String>) -> Response {
    if s.heartbeat(&id) {
        Json(json!({"instance_id": id})).into_response()
    } else {
        (
            StatusCode::NOT_FOUND,
            Json(json!({"error": format!("unknown instance {id}; re-register")})),
        )
            .into_response()
    }
}

async fn deregister(State(s): State<Shared>, Path(id): Path<String>) -> StatusCode {
    tokio::task::block_in_place(|| s.deregister(&id));
    StatusCode::NO_CONTENT
}

async fn instances(State(s): State<Shared>) -> Response {
    Json(json!({"instances": s.instances()})).into_response()
}

/// Ours (LMCache has none): seconds since each instance's last heartbeat, for the fleet page.
async fn liveness(State(s): State<Shared>) -> Response {
    let (ages, timeout) = s.liveness();
    let rows: Vec<serde_json::Value> = ages
        .into_iter()
        .map(|(id, age)| json!({"instance_id": id, "seconds_since_heartbeat": age}))
        .collect();
    Json(json!({"instances": rows, "instance_timeout_seconds": timeout})).into_response()
}

async fn usage(State(s): State<Shared>) -> Response {
    Json(s.usage()).into_response()
}

async fn instance_usage(State(s): State<Shared>, Path(id): Path<String>) -> Response {
    match s.usage().instances.into_iter().find(|i| i.instance_id == id) {
        Some(i) => Json(i).into_response(),
        None => error(StatusCode::NOT_FOUND, format!("unknown instance {id}")),
    }
}
