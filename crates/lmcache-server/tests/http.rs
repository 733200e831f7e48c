//! The HTTP API over a real socket: shapes LMCache's tools read, and 4xx with the field named.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use lmcache_memory::{ArenaBacking, ArenaConfig};
use lmcache_server::{Server, ServerConfig};

mod common;

fn server() -> Server {
    let arena = ArenaConfig { size: 8 << 20, backing: ArenaBacking::Anonymous, mlock: false };
    Server::start(ServerConfig {
        http_port: Some(0),
        kv_event_log_size: 16,
        ..ServerConfig::local(arena)
    })
    .unwrap()
}

/// One request; returns (status, body).
fn http(s: &Server, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    common::http_raw(s, method, path, body, Duration::from_secs(5))
}

#[test]
fn info_routes_answer_like_lmcache() {
    let s = server();
    let (code, body) = http(&s, "GET", "/", None);
    assert_eq!(code, 200);
    assert!(body.contains("\"status\":\"ok\"") && body.contains("LMCache HTTP API"), "{body}");
    let (code, body) = http(&s, "GET", "/healthcheck", None);
    assert_eq!((code, body.as_str()), (200, "{\"status\":\"healthy\"}"));
    let (code, body) = http(&s, "GET", "/status", None);
    assert_eq!(code, 200);
    for field in [
        "is_healthy",
        "chunk_size",
        "hash_algorithm",
        "active_sessions",
        "storage_manager",
        "capacity_bytes",
    ] {
        assert!(body.contains(field), "/status lacks {field}: {body}");
    }
    let (code, body) = http(&s, "GET", "/metrics", None);
    assert_eq!(code, 200);
    assert!(body.contains("lmcache_rs_l1_capacity_bytes"), "{body}");
    assert_eq!(http(&s, "GET", "/no/such/route", None).0, 404);
    let (code, body) = http(&s, "GET", "/version", None);
    assert_eq!(code, 200);
    assert!(body.contains(env!("CARGO_PKG_VERSION")), "{body}");
    let (_, body) = http(&s, "GET", "/config", None);
    for field in ["chunk_size", "eviction_policy", "l1_size_bytes", "kv_event_log_size"] {
        assert!(body.contains(field), "/config lacks {field}: {body}");
    }
    assert!(!body.contains("s3cret"), "a token must never be shown");
    assert_eq!(http(&s, "GET", "/config/adapters", None).1, "{\"adapters\":[]}");
}

#[test]
fn clear_and_checksums_validate_their_input() {
    let s = server();
    let (code, body) = http(&s, "POST", "/cache/clear", None);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"cleared\"") && body.contains("\"l1\""), "{body}");
    let (code, body) = http(&s, "POST", "/cache/clear", Some("{\"tier\": \"l9\"}"));
    assert_eq!(code, 400);
    assert!(body.contains("tier"), "{body}");
    let (code, body) = http(
        &s,
        "POST",
        "/cache/checksums",
        Some("{\"block_ids\": [1], \"chunk_size\": 16, \"instance_id\": 77}"),
    );
    assert_eq!(code, 404);
    assert!(body.contains("instance_id 77"), "{body}");
    let (code, _) = http(&s, "POST", "/cache/checksums", Some("not json"));
    assert!((400..500).contains(&code), "bad JSON must be a 4xx, got {code}");
}

#[test]
fn quota_routes_crud_with_default_salt_and_validation() {
    let s = server();
    let (code, body) = http(&s, "PUT", "/quota/tenant-a", Some("{\"limit_gb\": 0.5}"));
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"status\":\"ok\"") && body.contains("tenant-a"), "{body}");
    let (_, body) = http(&s, "GET", "/quota/tenant-a", None);
    assert!(body.contains("\"exists\":true") && body.contains("\"limit_gb\":0.5"), "{body}");
    http(&s, "PUT", "/quota/_default", Some("{\"limit_gb\": 1}"));
    let (_, body) = http(&s, "GET", "/quota", None);
    assert!(
        body.contains("\"users\"") && body.contains("tenant-a") && body.contains("_default"),
        "{body}"
    );
    let (_, body) = http(&s, "DELETE", "/quota/tenant-a", None);
    assert!(body.contains("\"removed\""), "{body}");
    let (_, body) = http(&s, "DELETE", "/quota/tenant-a", None);
    assert!(body.contains("\"not_found\""), "{body}");
    let (_, body) = http(&s, "GET", "/quota/tenant-a", None);
    assert!(body.contains("\"exists\":false"), "{body}");
    for bad in ["{\"limit_gb\": -1}", "{\"limit_gb\": \"x\"}", "{}", "nope"] {
        let (code, body) = http(&s, "PUT", "/quota/t", Some(bad));
        assert_eq!(code, 400, "{bad} accepted: {body}");
        assert!(body.contains("limit_gb"), "error must name the field: {body}");
    }
    let (code, body) =
        http(&s, "PUT", &format!("/quota/{}", "x".repeat(200)), Some("{\"limit_gb\": 1}"));
    assert_eq!(code, 400);
    assert!(body.contains("cache_salt"), "{body}");
}

#[test]
fn status_has_the_fields_lmcache_describe_reads() {
    let s = server();
    let (_, body) = http(&s, "GET", "/status", None);
    for field in [
        "l1_manager",
        "memory_total_bytes",
        "memory_used_bytes",
        "memory_usage_ratio",
        "total_object_count",
        "eviction_controller",
        "eviction_policy",
        "l2_adapters",
        "cache_context_meta",
    ] {
        assert!(body.contains(field), "/status lacks {field}");
    }
}

/// `cache_size_per_token` is bytes per logical token (what `lmcache bench engine` sizes its
/// workloads by): an engine-driven worker that packs a chunk's 256 tokens into 32 physical
/// slots (vLLM's adapter does, for blocks of 16) still has 2 x 2 layers x 32 x 2 bytes of KV
/// per token, not eight times that.
#[test]
fn status_counts_kv_bytes_per_logical_token() {
    let arena = ArenaConfig {
        size: 8 << 20,
        backing: ArenaBacking::SharedMemory {
            name: format!("lmcache_rs_http_per_token_{}", std::process::id()),
        },
        mlock: false,
    };
    let s =
        Server::start(ServerConfig { http_port: Some(0), ..ServerConfig::local(arena) }).unwrap();
    let mut c = lmcache_client::Client::connect(s.endpoint(), Duration::from_secs(5)).unwrap();
    let mut packed = common::small_registration(7, "m", lmcache_core::Dtype::Float16);
    packed.num_physical_slots = Some(32);
    packed.hidden_dim_size = 32 * 256 / 32; // each slot holds 8 tokens' 32 elements
    c.register_engine_driven(&packed).unwrap();
    let plain = common::small_registration(8, "m2", lmcache_core::Dtype::Float16);
    c.register_engine_driven(&plain).unwrap();
    let (_, body) = http(&s, "GET", "/status", None);
    let st: serde_json::Value = serde_json::from_str(&body).unwrap();
    let per_token =
        |id: &str| st["cache_context_meta"][id]["kv_cache_layout"]["cache_size_per_token"].clone();
    assert_eq!(per_token("7"), serde_json::json!(2 * 2 * 32 * 2), "{body}");
    assert_eq!(per_token("8"), serde_json::json!(2 * 2 * 32 * 2), "{body}");
}

/// LMCache 0.5.6 metric names (from its /metrics) that lmcache-rs serves with the same
/// meaning. Dashboards built on LMCache keep working for these.
const LMCACHE_METRICS: &[&str] = &[
    "lmcache_mp_lookups_requests_total",
    "lmcache_mp_lookup_requested_tokens_total",
    "lmcache_mp_lookup_hit_tokens_total",
    "lmcache_mp_lookup_hit_l1_tokens_total",
    "lmcache_mp_lookup_hit_l2_tokens_total",
    "lmcache_mp_lookup_hit_l1_keys_total",
    "lmcache_mp_l1_write_chunks_total",
    "lmcache_mp_l1_read_chunks_total",
    "lmcache_mp_num_submitted_stores_total",
    "lmcache_mp_num_finished_stores_total",
    "lmcache_mp_num_submitted_retrieves_total",
    "lmcache_mp_num_finished_retrieves_total",
    "lmcache_mp_num_chunks_loaded_total",
    "lmcache_mp_l0_l1_store_throughput_GB_per_second",
    "lmcache_mp_l0_l1_load_throughput_GB_per_second",
    "lmcache_mp_l1_memory_usage_bytes",
    "lmcache_mp_l1_usage_ratio",
    "lmcache_mp_l1_staging_bytes",
    "lmcache_mp_kv_events_log_depth",
    "lmcache_mp_event_bus_queue_depth",
    "lmcache_mp_l1_eviction_loop_ticks_total",
    "lmcache_mp_event_bus_dropped_events_total",
    "lmcache_mp_active_prefetch_jobs",
    "process_resident_memory_bytes",
];

/// Our own, beside LMCache's.
const OWN_METRICS: &[&str] = &[
    "lmcache_rs_l1_capacity_bytes",
    "lmcache_rs_active_sessions",
    "lmcache_rs_l1_evicted_objects_total",
    "lmcache_rs_l1_sync_evictions_total",
    "lmcache_rs_l1_expired_read_leases_total",
    "lmcache_rs_l1_expired_write_leases_total",
];

#[test]
fn metrics_use_lmcache_names() {
    let s = server();
    let (code, body) = http(&s, "GET", "/metrics", None);
    assert_eq!(code, 200);
    for name in LMCACHE_METRICS.iter().chain(OWN_METRICS) {
        let sample = body.lines().any(|l| l.starts_with(name) && !l.starts_with('#'));
        assert!(sample, "/metrics has no sample of {name}");
    }
    let rss = body
        .lines()
        .find(|l| l.starts_with("process_resident_memory_bytes "))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap();
    assert!(rss > 1e6, "implausible RSS {rss}");
}

/// `(method, path)` of every route the built router serves, path parameters filled in.
fn declared_routes() -> Vec<(String, String)> {
    lmcache_server::http::route_list()
        .into_iter()
        .map(|(method, path)| {
            let path = path
                .replace("{backend}", "lmcache")
                .replace("{operation}", "add")
                .replace("{salt}", "tenant")
                .replace("{request_id}", "x");
            (method.to_owned(), path)
        })
        .collect()
}

#[test]
fn bearer_token_guards_every_route_but_healthcheck() {
    let arena = ArenaConfig { size: 8 << 20, backing: ArenaBacking::Anonymous, mlock: false };
    let s = Server::start(ServerConfig {
        http_port: Some(0),
        http_auth_token: Some("s3cret".into()),
        ..ServerConfig::local(arena)
    })
    .unwrap();
    assert_eq!(http(&s, "GET", "/healthcheck", None).0, 200, "health must stay open");
    // Every route the router serves (listed by the builder that built it, so a new route is
    // covered the day it is added), every method of it, with a body that would do something.
    let key = lmcache_core::ObjectKey::new([9; 32], "m", 1, 0, 0, "").unwrap();
    let w = s.state().l1().reserve_write(&[lmcache_l1::WriteRequest::new(key.clone(), 4096)]);
    w.into_iter().next().unwrap().unwrap().commit().unwrap();
    let routes = declared_routes();
    assert!(routes.len() >= 20, "the route list looks wrong: {routes:?}");
    let body = |path: &str| -> Option<String> {
        Some(match path {
            p if p.starts_with("/cache/objects") => format!(
                r#"{{"keys": [{{"chunk_hash_hex": "{}", "model_name": "m", "kv_rank": {}, "object_group_id": 0, "cache_salt": ""}}], "force": true}}"#,
                key.chunk_hash.to_hex(),
                key.kv_rank.packed()
            ),
            p if p.starts_with("/quota/") => r#"{"limit_gb": 1}"#.into(),
            p if p.contains("/l2/") => r#"{"type": "mock", "max_size_gb": 1}"#.into(),
            _ => "{}".into(),
        })
    };
    for (method, path) in &routes {
        if path == "/healthcheck" {
            continue;
        }
        let (code, text) = http(&s, method, path, body(path).as_deref());
        assert_eq!(code, 401, "{method} {path} open without a token: {text}");
        assert!(text.contains("authorization"), "{text}");
    }
    // The status page's shell opens for a browser without the token: it holds no figure, and
    // its script asks for the token (every figure comes from the guarded routes above).
    let mut c = TcpStream::connect(s.http_addr().unwrap()).unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAccept: text/html\r\n\r\n")
        .unwrap();
    let mut page = String::new();
    c.read_to_string(&mut page).unwrap();
    assert_eq!(&page[9..12], "200", "{page}");
    assert!(page.contains("id=\"auth\"") && page.contains("content-security-policy"), "{page}");
    assert!(!page.contains(&key.chunk_hash.to_hex()) && !page.contains("s3cret"));
    // Nothing any of them asked for happened.
    assert!(s.state().l1().contains(&key), "an unauthorized delete or clear removed an object");
    let quotas = s.state().storage.quotas(lmcache_storage::TierName::L1).unwrap();
    assert!(quotas.is_empty(), "an unauthorized caller set a quota");
    assert!(s.state().storage.describe_l2().is_empty(), "an unauthorized caller added an adapter");
    // With the token every route answers (whatever it answers, it is not 401).
    for (method, path) in &routes {
        let b = body(path).unwrap_or_default();
        let mut c = TcpStream::connect(s.http_addr().unwrap()).unwrap();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer s3cret\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
            b.len()
        );
        c.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        assert_ne!(&out[9..12], "401", "{method} {path} refused the right token: {out}");
    }
    let addr = s.http_addr().unwrap();
    for (token, want) in [("s3cret", "200"), ("s3cres", "401"), ("s3cret2", "401")] {
        let mut c = TcpStream::connect(addr).unwrap();
        let req = format!(
            "GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {token}\r\n\r\n"
        );
        c.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        assert_eq!(&out[9..12], want, "token {token}");
    }
}

#[test]
fn cache_objects_list_pages_and_deletes() {
    let s = server();
    let l1 = s.state().l1();
    for (i, model) in [(1u8, "m"), (2, "m"), (3, "other")] {
        let key = lmcache_core::ObjectKey::new([i; 32], model, 1, 0, 0, "").unwrap();
        let w =
            l1.reserve_write(&[lmcache_l1::WriteRequest::new(key, 4096)]).pop().unwrap().unwrap();
        w.commit().unwrap();
    }
    let (code, body) = http(&s, "GET", "/cache/objects?page_size=2", None);
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["entries"].as_array().unwrap().len(), 2);
    assert_eq!(v["total"], 3);
    let token = v["next_page_token"].as_str().unwrap().to_owned();
    let (_, body) =
        http(&s, "GET", &format!("/cache/objects?page_size=2&page_token={token}"), None);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["entries"].as_array().unwrap().len(), 1);
    assert!(v["next_page_token"].is_null());
    let (_, body) = http(&s, "GET", "/cache/objects?model_name=other", None);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["total"], 1);
    let entry = v["entries"][0].clone();
    assert_eq!(entry["chunk_hash_hex"], "03".repeat(32));
    let del = serde_json::json!({"keys": [entry], "tier": "l1"}).to_string();
    let (code, body) = http(&s, "DELETE", "/cache/objects", Some(&del));
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"deleted\":1"), "{body}");
    assert_eq!(l1.usage().resident_objects, 2);
    for (bad, field) in [
        (r#"{"keys":[{"chunk_hash_hex":"zz","model_name":"m","kv_rank":16777472}]}"#, "keys[0]"),
        (r#"{"keys":[],"tier":"l2"}"#, "tier"),
        ("[]", "body"),
    ] {
        let (code, body) = http(&s, "DELETE", "/cache/objects", Some(bad));
        assert_eq!(code, 400, "{bad}");
        assert!(body.contains(field), "{body}");
    }
    assert_eq!(http(&s, "GET", "/cache/objects?page_size=0", None).0, 400);
    assert_eq!(http(&s, "GET", "/cache/objects?page_token=abc", None).0, 400);
}

#[test]
fn fleet_snapshot_pages_come_from_one_frozen_list() {
    let s = server();
    let l1 = s.state().l1();
    let store = |b: u8| {
        let key = lmcache_core::ObjectKey::new([b; 32], "m", 1, 0, 0, "").unwrap();
        let w =
            l1.reserve_write(&[lmcache_l1::WriteRequest::new(key, 4096)]).pop().unwrap().unwrap();
        w.commit().unwrap();
    };
    for b in 1..=5 {
        store(b);
    }
    let page = |q: &str| -> serde_json::Value {
        let (code, body) = http(&s, "GET", &format!("/fleet/snapshot{q}"), None);
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    };
    let first = page("?page_size=2");
    assert_eq!((first["total"].as_u64(), first["tier"].as_str()), (Some(5), Some("l1")));
    // Changes after the first page do not reach the later ones.
    store(6);
    let mut seen: Vec<String> = Vec::new();
    let mut p = first;
    loop {
        for e in p["entries"].as_array().unwrap() {
            assert_eq!(e["size_bytes"], 4096);
            seen.push(e["key"]["chunk_hash_hex"].as_str().unwrap().to_string());
        }
        match p["next_page_token"].as_str() {
            Some(t) => p = page(&format!("?page_size=2&page_token={t}")),
            None => break,
        }
    }
    seen.sort();
    let want: Vec<String> = (1..=5u8).map(|b| format!("{b:02x}").repeat(32)).collect();
    assert_eq!(seen, want, "every key of the frozen list once, none added later");
    assert_eq!(page("")["total"], 6, "a new snapshot sees the new key");
    for (q, code) in [
        ("?page_token=zz", 400),
        ("?page_token=99:0", 410),
        ("?page_size=0", 400),
        ("?tier=l3", 400),
    ] {
        assert_eq!(http(&s, "GET", &format!("/fleet/snapshot{q}"), None).0, code, "{q}");
    }
}
