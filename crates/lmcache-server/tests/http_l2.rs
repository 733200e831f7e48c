//! The HTTP API of the L2 tier: adapters in /status and /config, L2 listing and deletes,
//! prefetches, runtime add/remove of adapters, L2 metrics, /metrics/reset.

use std::time::{Duration, Instant};

use lmcache_core::ObjectKey;
use lmcache_l1::WriteRequest;
use lmcache_memory::{ArenaBacking, ArenaConfig};
use lmcache_server::{Server, ServerConfig};
use serde_json::{Value, json};

mod common;

fn server(dir: &std::path::Path) -> Server {
    let arena = ArenaConfig { size: 8 << 20, backing: ArenaBacking::Anonymous, mlock: false };
    Server::start(ServerConfig {
        http_port: Some(0),
        l2_adapters: vec![json!({"type": "fs", "base_path": dir})],
        ..ServerConfig::local(arena)
    })
    .unwrap()
}

fn http(s: &Server, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    let (status, text) = common::http_raw(s, method, path, body, Duration::from_secs(10));
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

fn key(i: u8) -> ObjectKey {
    ObjectKey::new([i; 32], "m", 1, 0, 0, "").unwrap()
}

/// Puts objects into L1 and waits until the write-behind has them in L2.
fn store(s: &Server, keys: &[ObjectKey]) {
    let st = s.state();
    for k in keys {
        let mut w =
            st.storage.reserve_write(&[WriteRequest::new(k.clone(), 4096)]).pop().unwrap().unwrap();
        w.as_mut_slice().fill(7);
        // Through the manager, as a store does: the commit queues the write-behind.
        assert!(st.storage.commit(vec![w]).pop().unwrap().is_ok());
    }
    let t0 = Instant::now();
    while st.storage.describe_l2()[0].counters.stored_keys < keys.len() as u64 {
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn adapters_show_in_status_config_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let (code, st) = http(&s, "GET", "/status", None);
    assert_eq!(code, 200);
    let a = &st["storage_manager"]["l2_adapters"][0];
    assert_eq!((a["type"].as_str(), a["is_healthy"].as_bool()), (Some("fs"), Some(true)), "{st}");
    let (_, cfg) = http(&s, "GET", "/config/adapters", None);
    assert_eq!(cfg["adapters"][0]["type_name"], "fs");
    assert_eq!(cfg["adapters"][0]["tier"], "l2");
    store(&s, &[key(1), key(2)]);
    let (_, m) = http(&s, "GET", "/metrics", None);
    let m = m.as_str().unwrap().to_owned();
    for name in [
        "lmcache_mp_l2_store_adapters{state=\"active\"} 1",
        "lmcache_mp_l2_store_completed_objects_total{l2_name=\"fs\",adapter_index=\"0\"} 2",
        "lmcache_rs_l2_healthy{l2_name=\"fs\",adapter_index=\"0\"} 1",
        "lmcache_mp_lookup_hit_l2_tokens_total",
    ] {
        assert!(m.contains(name), "metrics lack {name}");
    }
}

#[test]
fn l2_objects_list_delete_and_prefetch() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let keys: Vec<ObjectKey> = (1..=3).map(key).collect();
    store(&s, &keys);
    let (code, page) = http(&s, "GET", "/cache/objects?tier=l2&page_size=2", None);
    assert_eq!(code, 200, "{page}");
    assert_eq!(page["entries"].as_array().unwrap().len(), 2);
    let token = page["next_page_token"].as_str().unwrap().to_owned();
    let (_, page2) =
        http(&s, "GET", &format!("/cache/objects?tier=l2&page_size=2&page_token={token}"), None);
    assert_eq!(page2["entries"].as_array().unwrap().len(), 1);
    assert!(page2["next_page_token"].is_null());
    assert_eq!(http(&s, "GET", "/cache/objects?tier=l2&adapter=9", None).0, 404);
    assert_eq!(http(&s, "GET", "/cache/objects?tier=l3", None).0, 400);

    // Prefetch: evict from L1, warm it back over HTTP. The token ids hash to other keys than
    // the ones stored above, so first a miss...
    let body =
        json!({"model_name": "m", "world_size": 1, "token_ids": (0..256).collect::<Vec<i64>>()});
    let (code, r) = http(&s, "POST", "/cache/prefetches", Some(&body.to_string()));
    assert_eq!(code, 202, "{r}");
    let id = r["request_id"].as_str().unwrap().to_owned();
    let t0 = Instant::now();
    let done = loop {
        let (code, st) = http(&s, "GET", &format!("/cache/prefetches/{id}"), None);
        assert_eq!(code, 200);
        if st["status"] == "completed" {
            break st;
        }
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!((done["found_keys"].as_u64(), done["total_keys"].as_u64()), (Some(0), Some(1)));
    assert_eq!(http(&s, "GET", &format!("/cache/prefetches/{id}"), None).0, 404, "polled once");
    assert_eq!(http(&s, "POST", "/cache/prefetches", Some("{\"model_name\": 1}")).0, 400);
    let short = json!({"model_name": "m", "token_ids": [1, 2, 3]}).to_string();
    assert_eq!(http(&s, "POST", "/cache/prefetches", Some(&short)).1["status"], "noop");

    // Delete from L2 only.
    let del = json!({"keys": [{"chunk_hash_hex": "01".repeat(32), "model_name": "m", "kv_rank": 0x0100_0100u32}],
                     "tier": "l2"});
    let (code, r) = http(&s, "DELETE", "/cache/objects", Some(&del.to_string()));
    assert_eq!((code, r["deleted"].as_u64(), r["ok"].as_bool()), (200, Some(1), Some(true)), "{r}");
    let (_, page) = http(&s, "GET", "/cache/objects?tier=l2", None);
    assert_eq!(page["entries"].as_array().unwrap().len(), 2);
}

#[test]
fn adapters_are_added_and_removed_at_run_time() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let add = json!({"spec": {"type": "mock", "max_size_gb": 0.1}}).to_string();
    let (code, r) = http(&s, "POST", "/reconfigure/generic/l2/add", Some(&add));
    assert_eq!(code, 200, "{r}");
    let id = r["adapter_index"].as_u64().unwrap();
    let (_, st) = http(&s, "GET", "/reconfigure/generic/l2/status", None);
    assert_eq!(st["num_adapters"], 2);
    let bad = json!({"spec": {"type": "mock"}}).to_string();
    let (code, r) = http(&s, "POST", "/reconfigure/generic/l2/add", Some(&bad));
    assert_eq!(code, 400);
    assert!(r["detail"].as_str().unwrap().contains("max_size_gb"), "{r}");
    let rm = json!({"adapter_index": id}).to_string();
    assert_eq!(http(&s, "POST", "/reconfigure/generic/l2/remove", Some(&rm)).0, 200);
    assert_eq!(http(&s, "POST", "/reconfigure/generic/l2/remove", Some(&rm)).0, 404);
    assert_eq!(http(&s, "POST", "/reconfigure/generic/l2/resize", Some("{}")).0, 400);
    assert_eq!(http(&s, "GET", "/reconfigure/generic/l2/status", None).1["num_adapters"], 1);
}

#[test]
fn metrics_reset_clears_per_operation_series() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    s.state().metrics.request("lookup");
    let (_, m) = http(&s, "GET", "/metrics", None);
    assert!(m.as_str().unwrap().contains("lmcache_rs_mp_requests_total{op=\"lookup\"} 1"));
    assert_eq!(http(&s, "POST", "/metrics/reset", None).1["status"], "ok");
    let (_, m) = http(&s, "GET", "/metrics", None);
    assert!(!m.as_str().unwrap().contains("lmcache_rs_mp_requests_total{op=\"lookup\"}"));
}

#[test]
fn l1_removals_and_l2_batches_reach_the_event_bus() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let before = s.state().bus.published();
    store(&s, &[key(7), key(8)]);
    let after_store = s.state().bus.published();
    assert!(after_store > before, "the L2 store batch was not published");
    s.state().l1().clear(true);
    assert!(s.state().bus.published() >= after_store + 2, "L1 removals were not published");
}

#[test]
fn l2_quotas_are_served_per_tier_and_usage_shows_in_status_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    store(&s, &[key(1), key(2)]);
    // L2 quota: set, read back with its usage, listed, and apart from L1's.
    let (code, r) = http(&s, "PUT", "/quota/tenant-q?tier=l2", Some(r#"{"limit_gb": 0.5}"#));
    assert_eq!((code, r["tier"].as_str()), (200, Some("l2")), "{r}");
    let (_, r) = http(&s, "GET", "/quota/tenant-q?tier=l2", None);
    assert_eq!((r["exists"].as_bool(), r["limit_gb"].as_f64()), (Some(true), Some(0.5)), "{r}");
    let (_, r) = http(&s, "GET", "/quota/tenant-q", None);
    assert_eq!(r["exists"].as_bool(), Some(false), "an L2 quota leaked into L1: {r}");
    let (_, r) = http(&s, "GET", "/quota?tier=l2", None);
    assert!(r["users"]["tenant-q"].is_object(), "{r}");
    let (_, r) = http(&s, "GET", "/quota/_default?tier=l2", None);
    assert!(r["current_usage_gb"].as_f64().unwrap() > 0.0, "L2 usage of the default salt: {r}");
    let (code, r) = http(&s, "DELETE", "/quota/tenant-q?tier=l2", None);
    assert_eq!((code, r["status"].as_str()), (200, Some("removed")), "{r}");
    let (code, r) = http(&s, "GET", "/quota?tier=l3", None);
    assert_eq!(code, 400, "{r}");
    assert!(r["detail"].as_str().unwrap().contains("tier"), "{r}");
    // Used bytes and keys per adapter.
    let (_, st) = http(&s, "GET", "/status", None);
    let a = &st["storage_manager"]["l2_adapters"][0];
    let detail = if a["used_bytes"].is_null() { &a["detail"] } else { a };
    assert_eq!(detail["keys"].as_u64(), Some(2), "{a}");
    assert!(detail["used_bytes"].as_u64().unwrap() > 2 * 4096, "{a}");
    let (_, m) = http(&s, "GET", "/metrics", None);
    let m = m.as_str().unwrap().to_owned();
    assert!(m.contains("lmcache_rs_l2_keys{"), "no L2 key gauge");
    assert!(m.contains("lmcache_rs_l2_evicted_objects_total{"), "no L2 eviction counter");
    assert!(m.contains("lmcache_rs_l2_quota_rejections_total{"), "no L2 quota counter");
}

#[test]
fn l2_quota_without_l2_is_refused_by_name() {
    let arena = ArenaConfig { size: 8 << 20, backing: ArenaBacking::Anonymous, mlock: false };
    let s =
        Server::start(ServerConfig { http_port: Some(0), ..ServerConfig::local(arena) }).unwrap();
    let (code, r) = http(&s, "PUT", "/quota/t?tier=l2", Some(r#"{"limit_gb": 1}"#));
    assert_eq!(code, 400, "{r}");
    assert!(r["detail"].as_str().unwrap().contains("l2 is not configured"), "{r}");
}

#[test]
fn the_l1_segment_name_goes_at_shutdown_even_while_a_handle_outlives_the_server() {
    // An L2 tier (its runtime holds L1 handles that may outlive the server) and an extra
    // handle of our own: the name must still be gone when shutdown returns.
    let name = format!("lmcache_rs_test_unlink_{}", std::process::id());
    let path = std::path::Path::new("/dev/shm").join(&name);
    let dir = tempfile::tempdir().unwrap();
    let arena = ArenaConfig {
        size: 8 << 20,
        backing: ArenaBacking::SharedMemory { name: name.clone() },
        mlock: false,
    };
    let s = Server::start(ServerConfig {
        l2_adapters: vec![json!({"type": "fs", "base_path": dir.path()})],
        ..ServerConfig::local(arena)
    })
    .unwrap();
    assert!(path.exists());
    let handle = s.state().l1().clone();
    s.shutdown();
    assert!(!path.exists(), "the L1 segment outlived the server");
    drop(handle);
}

/// With `--l2-allowed-root`, fs and raw_block adapters live inside the roots, at start and when
/// added over HTTP; a path the server cannot open is refused without echoing the OS's words
/// about it, and a foreign file is left as it was.
#[test]
fn adapters_stay_inside_the_allowed_roots_and_errors_do_not_echo_the_os() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let arena = || ArenaConfig { size: 8 << 20, backing: ArenaBacking::Anonymous, mlock: false };
    let l2 = lmcache_storage::TierConfig {
        allowed_roots: vec![root.path().to_path_buf()],
        ..lmcache_storage::TierConfig::default()
    };
    // At start.
    let refused = Server::start(ServerConfig {
        http_port: Some(0),
        l2_adapters: vec![json!({"type": "fs", "base_path": outside.path()})],
        l2: l2.clone(),
        ..ServerConfig::local(arena())
    });
    let Err(e) = refused else { panic!("an fs adapter outside the roots started") };
    let e = e.to_string();
    assert!(e.contains("outside the allowed roots"), "{e}");
    let s = Server::start(ServerConfig {
        http_port: Some(0),
        l2_adapters: vec![json!({"type": "fs", "base_path": root.path().join("kv")})],
        l2,
        ..ServerConfig::local(arena())
    })
    .unwrap();
    // At run time.
    let add = |spec: Value| {
        http(&s, "POST", "/reconfigure/generic/l2/add", Some(&json!({"spec": spec}).to_string()))
    };
    let (code, r) = add(json!({"type": "fs", "base_path": outside.path().join("x")}));
    assert_eq!(code, 400, "{r}");
    assert!(r["detail"].as_str().unwrap().contains("outside the allowed roots"), "{r}");
    assert!(!outside.path().join("x").exists(), "a refused adapter created its directory");
    let (code, r) =
        add(json!({"type": "raw_block", "device_path": "/etc/passwd", "slot_bytes": 4096}));
    assert_eq!(code, 400, "{r}");
    // Inside a root, but not ours: refused, unchanged, and the reply says nothing about it.
    let foreign = root.path().join("someone-elses.img");
    std::fs::write(&foreign, vec![5u8; 64 * 1024]).unwrap();
    let (code, r) = add(json!({"type": "raw_block", "device_path": foreign, "slot_bytes": 4096,
                               "capacity_bytes": 1 << 20, "meta_total_bytes": 65536, "use_odirect": false}));
    assert_eq!(code, 400, "{r}");
    let detail = r["detail"].as_str().unwrap();
    assert!(detail.contains("cannot be opened"), "{detail}");
    assert!(!detail.contains("os error") && !detail.contains("holds data"), "{detail}");
    assert_eq!(std::fs::read(&foreign).unwrap(), vec![5u8; 64 * 1024], "a foreign file changed");
    let (code, r) = add(json!({"type": "fs", "base_path": root.path().join("more")}));
    assert_eq!(code, 200, "{r}");
}
