//! HTTP request bodies and queries on every route of the server's API (the built router's own
//! list, so a new route is fuzzed the day it is added), path parameters fuzzed too. A handler
//! panic would answer 500 (caught); the target fails on it. Adapters the fuzzer adds may only
//! use paths inside one temporary root.
#![no_main]

#[path = "common.rs"]
mod common;

use std::sync::OnceLock;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use libfuzzer_sys::fuzz_target;
use lmcache_memory::{ArenaBacking, ArenaConfig};
use lmcache_server::{Server, ServerConfig};
use tower::ServiceExt;

struct Fixture {
    rt: tokio::runtime::Runtime,
    server: Server,
    _root: tempfile::TempDir,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let root = tempfile::tempdir().unwrap();
        // Adapters added by the fuzzer may only use paths inside `root`.
        let l2 = lmcache_storage::TierConfig {
            allowed_roots: vec![root.path().to_path_buf()],
            ..Default::default()
        };
        let server = Server::start(ServerConfig {
            l2_adapters: vec![serde_json::json!({"type": "mock", "max_size_gb": 0.01})],
            l2,
            ..ServerConfig::local(ArenaConfig {
                size: 8 << 20,
                backing: ArenaBacking::Anonymous,
                mlock: false,
            })
        })
        .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        Fixture { rt, server, _root: root }
    })
}

fuzz_target!(|input: (u8, String, String, Vec<u8>)| {
    let (which, param, query, body) = input;
    let f = fixture();
    let routes = lmcache_server::http::route_list();
    let (method, path) = routes[which as usize % routes.len()];
    let path = common::fill(path, &param);
    let query = common::clean(&query, 200);
    let uri = if query.is_empty() { path.clone() } else { format!("{path}?{query}") };
    let Ok(mut req) = Request::builder()
        .method(Method::from_bytes(method.as_bytes()).unwrap())
        .uri(uri)
        .header("content-type", "application/json")
        .body(Body::from(body))
    else {
        return;
    };
    // What the real listener adds to every request (the caller's address).
    let peer = std::net::SocketAddr::from(([127, 0, 0, 1], 40000));
    req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
    let app = lmcache_server::http::router(std::sync::Arc::clone(f.server.state()));
    let resp = f.rt.block_on(app.oneshot(req)).unwrap();
    assert_ne!(
        resp.status(),
        StatusCode::INTERNAL_SERVER_ERROR,
        "{method} {path}: a handler panicked"
    );
});
