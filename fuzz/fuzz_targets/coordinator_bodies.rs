//! The coordinator's JSON bodies, queries and path parameters on every route it serves (the
//! built router's own list: `/events`, `/directory/*`, `/instances`, quotas, pins, relays,
//! RFC #1403 queries). Bad input gets a 4xx naming it; a handler panic would answer 500
//! (caught), and the target fails on it.
#![no_main]

#[path = "common.rs"]
mod common;

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use libfuzzer_sys::fuzz_target;
use lmcache_coordinator::CoordinatorConfig;
use lmcache_coordinator::fleet::Fleet;
use tower::ServiceExt;

struct Fixture {
    rt: tokio::runtime::Runtime,
    fleet: Arc<Fleet>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let config = CoordinatorConfig {
            enable_blend_lookup: true,
            ..CoordinatorConfig::default()
        };
        let fleet = Arc::new(Fleet::new(config).expect("fleet"));
        // Something for lookups to find: one registered instance.
        let reg: lmcache_protocol::coordinator::RegisterRequest = serde_json::from_value(
            serde_json::json!({"instance_id": "fuzz-1", "ip": "127.0.0.1", "http_port": 1}),
        )
        .expect("registration");
        fleet.register(reg, false).expect("register");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        Fixture { rt, fleet }
    })
}

fuzz_target!(|input: (u8, String, String, Vec<u8>)| {
    let (which, param, query, body) = input;
    let f = fixture();
    let routes = lmcache_coordinator::http::route_list();
    let (method, path) = routes[which as usize % routes.len()];
    // Relays reach out to the registered server: not from a fuzzer.
    if path.starts_with("/cache/prefetches") || path == "/cache/delete" {
        return;
    }
    let path = common::fill(path, &param);
    let query = common::clean(&query, 200);
    let uri = if query.is_empty() { path.clone() } else { format!("{path}?{query}") };
    let Ok(req) = Request::builder()
        .method(Method::from_bytes(method.as_bytes()).expect("method"))
        .uri(uri)
        .header("content-type", "application/json")
        .body(Body::from(body))
    else {
        return;
    };
    let app = lmcache_coordinator::http::router(Arc::clone(&f.fleet));
    let resp = f.rt.block_on(app.oneshot(req)).expect("infallible");
    assert_ne!(
        resp.status(),
        StatusCode::INTERNAL_SERVER_ERROR,
        "{method} {path}: a handler panicked"
    );
});
