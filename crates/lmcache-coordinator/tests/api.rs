//! The coordinator's HTTP API over loopback: LMCache's routes, shapes and status codes, the
//! event gate, the directory's answers, usage, the routing answer and the health sweep.

use std::time::Duration;

use lmcache_coordinator::{Coordinator, CoordinatorConfig};
use serde_json::{Value, json};

struct Api {
    c: Coordinator,
    agent: ureq::Agent,
}

impl Api {
    fn start(cfg: CoordinatorConfig) -> Self {
        let c = Coordinator::start(CoordinatorConfig { host: "127.0.0.1".into(), port: 0, ..cfg })
            .unwrap();
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        Self { c, agent }
    }

    fn new() -> Self {
        Self::start(CoordinatorConfig::default())
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.c.addr())
    }

    fn read(mut r: ureq::http::Response<ureq::Body>) -> (u16, Value) {
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    fn get(&self, path: &str) -> (u16, Value) {
        Self::read(self.agent.get(&self.url(path)).call().unwrap())
    }

    fn post(&self, path: &str, body: Value) -> (u16, Value) {
        Self::read(self.agent.post(&self.url(path)).send_json(body).unwrap())
    }

    fn post_raw(&self, path: &str, body: &[u8]) -> (u16, Value) {
        Self::read(
            self.agent
                .post(&self.url(path))
                .header("Content-Type", "application/json")
                .send(body)
                .unwrap(),
        )
    }

    fn put(&self, path: &str) -> (u16, Value) {
        Self::read(self.agent.put(&self.url(path)).send_empty().unwrap())
    }

    fn delete(&self, path: &str) -> u16 {
        self.agent.delete(&self.url(path)).call().unwrap().status().as_u16()
    }

    fn register(&self, id: &str) {
        let (s, _) = self
            .post("/instances", json!({"instance_id": id, "ip": "127.0.0.1", "http_port": 8080}));
        assert_eq!(s, 200);
    }

    fn events(&self, batches: Value) -> Value {
        let (s, v) = self.post("/events", json!({ "batches": batches }));
        assert_eq!(s, 200, "{v}");
        v
    }
}

fn hex(b: u8) -> String {
    format!("{b:02x}").repeat(32)
}

fn key(b: u8) -> Value {
    json!({"chunk_hash_hex": hex(b), "model_name": "m", "kv_rank": 0x0100_0100})
}

fn batch(
    inst: &str,
    inc: u64,
    seq: u64,
    ty: &str,
    tier: &str,
    backend: &str,
    keys: &[u8],
) -> Value {
    json!({"instance_id": inst, "incarnation": inc, "seq": seq, "event_type": ty, "tier": tier,
           "backend": backend, "entries": keys.iter().map(|&k| json!({"key": key(k), "size_bytes": 100})).collect::<Vec<_>>()})
}

fn placements(api: &Api, k: u8) -> Vec<(String, String, String)> {
    let (s, v) = api.post("/directory/lookup", json!({"keys": [key(k)]}));
    assert_eq!(s, 200, "{v}");
    v["results"][0]["placements"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["instance_id"].as_str().unwrap().into(),
                p["tier"].as_str().unwrap().into(),
                p["backend"].as_str().unwrap().into(),
            )
        })
        .collect()
}

fn metric(api: &Api, name: &str) -> f64 {
    let text =
        api.agent.get(&api.url("/metrics")).call().unwrap().body_mut().read_to_string().unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn registration_heartbeat_and_deregistration_follow_lmcache() {
    let api = Api::new();
    assert_eq!(api.get("/healthz"), (200, json!({"status": "healthy"})));
    let (s, v) = api.post("/instances", json!({"ip": " 10.0.0.1 ", "http_port": 8080}));
    assert_eq!(s, 200);
    let id = v["instance_id"].as_str().unwrap().to_string();
    assert!(id.starts_with("mp-") && id.len() == 35, "{id}");
    assert_eq!(v["re_registered"], false);
    let (_, again) =
        api.post("/instances", json!({"instance_id": id, "ip": "10.0.0.1", "http_port": 8080}));
    assert_eq!(again["re_registered"], true);
    let (_, list) = api.get("/instances");
    assert_eq!(list["instances"][0]["ip"], "10.0.0.1", "the ip is trimmed");
    assert_eq!(list["instances"][0]["mq_port"], 0);
    assert_eq!(api.put(&format!("/instances/{id}/heartbeat")), (200, json!({"instance_id": id})));
    let (s, v) = api.put("/instances/nobody/heartbeat");
    assert_eq!(s, 404);
    assert_eq!(v["error"], "unknown instance nobody; re-register");
    for bad in [
        json!({"ip": "x", "http_port": 0}),
        json!({"ip": "  ", "http_port": 1}),
        json!({"http_port": 1}),
        json!("["),
    ] {
        let (s, v) = api.post("/instances", bad.clone());
        assert_eq!(s, 422, "{bad} → {v}");
    }
    assert_eq!(api.delete(&format!("/instances/{id}")), 204);
    assert_eq!(api.delete(&format!("/instances/{id}")), 204, "idempotent");
    assert_eq!(api.get("/instances").1["instances"], json!([]));
}

#[test]
fn events_are_gated_per_emitter_and_restarts_fence_l1_only() {
    let api = Api::new();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (s, _) =
        api.post("/instances", json!({"instance_id": "a", "ip": "127.0.0.1", "http_port": closed}));
    assert_eq!(s, 200);
    let v = api.events(json!([
        batch("a", 5, 1, "store", "l1", "dram", &[1, 2]),
        batch("a", 5, 2, "store", "l2", "fs", &[1])
    ]));
    assert_eq!(v, json!({"applied": 2, "duplicates": 0, "stale": 0}));
    assert_eq!(
        api.events(json!([batch("a", 5, 2, "store", "l1", "dram", &[3])])),
        json!({"applied": 0, "duplicates": 1, "stale": 0})
    );
    assert!(placements(&api, 3).is_empty(), "a duplicate is not applied");
    // A gap is admitted, counted and repaired: a's registered address serves no snapshot, so
    // its L1 placements are fenced (short until new events, never over-credited).
    api.events(json!([batch("a", 5, 5, "store", "l1", "dram", &[3])]));
    let (_, st) = api.get("/directory/stats");
    assert_eq!(st["streams"][0]["missing_batches"], 2);
    assert_eq!(metric(&api, "lmcache_rs_coordinator_missing_batches_total"), 2.0);
    let t = std::time::Instant::now();
    while metric(&api, "lmcache_rs_coordinator_repairs_total") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(10), "no repair");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(placements(&api, 1), vec![("a".into(), "l2".into(), "fs".into())]);
    assert!(placements(&api, 3).is_empty());
    let (_, st) = api.get("/directory/stats");
    assert_eq!(
        (st["streams"][0]["gap_detected"].as_bool(), st["streams"][0]["repairs"].as_u64()),
        (Some(false), Some(1))
    );
    assert_eq!(api.events(json!([batch("a", 4, 9, "store", "l1", "dram", &[4])]))["stale"], 1);
    // A new incarnation fences a's L1 placements; its L2 placement stays.
    api.events(json!([batch("a", 5, 6, "store", "l1", "dram", &[1, 2])]));
    assert_eq!(placements(&api, 1).len(), 2);
    api.events(json!([batch("a", 6, 1, "store", "l1", "dram", &[9])]));
    assert_eq!(placements(&api, 1), vec![("a".into(), "l2".into(), "fs".into())]);
    assert!(placements(&api, 2).is_empty());
    assert_eq!(placements(&api, 9).len(), 1);
    let (_, st) = api.get("/directory/stats");
    assert_eq!(
        (st["num_keys"].as_u64(), st["l1_count"].as_u64(), st["l2_count"].as_u64()),
        (Some(2), Some(1), Some(1))
    );
    assert_eq!(st["l1_size_bytes"], 100);
    // Deletes and accesses.
    api.events(json!([
        batch("a", 6, 2, "access", "l1", "", &[9]),
        batch("a", 6, 3, "delete", "l2", "fs", &[1])
    ]));
    let (_, v) = api.post("/directory/lookup", json!({"keys": [key(9), key(1)]}));
    assert_eq!(v["results"][0]["access_count"], 1);
    assert_eq!(v["results"][1]["placements"], json!([]));
    // One bad batch refuses the whole request: nothing of it applies.
    let bad = json!({"batches": [batch("a", 6, 4, "store", "l1", "dram", &[7]),
        {"instance_id": "a", "incarnation": 6, "seq": 5, "event_type": "store", "tier": "l1", "backend": "dram",
         "entries": [{"key": {"chunk_hash_hex": "zz", "model_name": "m", "kv_rank": 16777472}}]}]});
    let (s, v) = api.post("/events", bad);
    assert_eq!(s, 422);
    assert!(
        v["detail"].as_str().unwrap().contains("batches[1]: entries[0].key: chunk_hash_hex"),
        "{v}"
    );
    assert!(placements(&api, 7).is_empty());
    for (field, value) in [
        ("seq", json!(0)),
        ("tier", json!("all")),
        ("backend", json!("")),
        ("incarnation", json!(-1)),
    ] {
        let mut b = batch("a", 6, 4, "store", "l1", "dram", &[7]);
        b[field] = value;
        let (s, v) = api.post("/events", json!({ "batches": [b] }));
        assert_eq!(s, 422, "{field}: {v}");
    }
    // The body is read in one pass when it has the usual shape and by serde otherwise: an
    // escaped string, an unknown field and a duplicate key all take the second way, with
    // serde's answer.
    let escaped = batch("a", 6, 4, "store", "l1", "dram", &[7])
        .to_string()
        .replace(r#""backend":"dram""#, r#""backend":"dr\u0061m","extra":[null]"#);
    assert!(escaped.contains(r"\u0061"), "{escaped}");
    let (s, v) = api.post_raw("/events", format!(r#"{{"batches": [{escaped}]}}"#).as_bytes());
    assert_eq!((s, &v["applied"]), (200, &json!(1)), "{v}");
    assert_eq!(placements(&api, 7), vec![("a".into(), "l1".into(), "dram".into())]);
    for (body, says) in [
        (&br#"{"batches": [], "batches": []}"#[..], "duplicate field `batches`"),
        (b"{\"batches\": [\"\xff\"]}", "not UTF-8"),
        (b"[1, 2", "body: "),
    ] {
        let (s, v) = api.post_raw("/events", body);
        assert_eq!(s, 422, "{v}");
        assert!(v["detail"].as_str().unwrap().contains(says), "{v}");
    }
}

#[test]
fn lookups_resolve_tokens_like_lmcache_and_refuse_bad_forms() {
    let api = Api::new();
    let tokens: Vec<u32> = (0..600).collect();
    let hashes = lmcache_core::TokenHasher::new(256).unwrap().hash_tokens(&tokens);
    assert_eq!(hashes.len(), 2, "a trailing partial chunk is ignored");
    // World size 2: chunk-major, one key per rank.
    let entries: Vec<Value> = hashes
        .iter()
        .flat_map(|h| {
            [0x0200_0200u32, 0x0201_0201].map(|r| {
                json!({"key": {"chunk_hash_hex": h.to_hex(), "model_name": "m", "kv_rank": r, "cache_salt": "t"},
                       "size_bytes": 7, "token_ids": [1, 2, 3], "token_offset": 0})
            })
        })
        .collect();
    api.events(
        json!([{"instance_id": "a", "incarnation": 1, "seq": 1, "event_type": "store", "tier": "l1",
                       "backend": "dram", "entries": entries}]),
    );
    let (s, v) = api.post(
        "/directory/lookup",
        json!({"token_ids": tokens, "model_name": "m", "world_size": 2, "cache_salt": "t"}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["chunks"], 2);
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 4);
    assert_eq!(results[1]["key"]["kv_rank"], 0x0201_0201);
    assert_eq!(results[2]["key"]["chunk_hash_hex"], hashes[1].to_hex());
    assert!(results.iter().all(|r| r["placements"][0]["instance_id"] == "a" && r["token_ids"] == json!([1, 2, 3])));
    let (_, other_salt) = api.post(
        "/directory/lookup",
        json!({"token_ids": tokens, "model_name": "m", "world_size": 2}),
    );
    assert!(
        other_salt["results"].as_array().unwrap().iter().all(|r| r["placements"] == json!([])),
        "salts never mix"
    );
    for (body, code) in [
        (json!({}), 422),
        (json!({"keys": [key(1)], "token_ids": [1]}), 422),
        (json!({"token_ids": [1]}), 422),
        (json!({"keys": [{"chunk_hash_hex": "00", "model_name": "m", "kv_rank": 16777472}]}), 422),
        (json!({"token_ids": [1], "model_name": "m", "world_size": 0}), 422),
        (json!({"token_ids": vec![1u32; 1_000_001], "model_name": "m"}), 400),
    ] {
        let (s, v) = api.post("/directory/lookup", body);
        assert_eq!(s, code, "{v}");
        assert!(v["detail"].is_string(), "{v}");
    }
}

#[test]
fn listings_filter_and_page() {
    let api = Api::new();
    api.events(json!([
        batch("a", 1, 1, "store", "l1", "dram", &[1, 2, 3]),
        batch("a", 1, 2, "store", "l2", "s3", &[3, 4])
    ]));
    api.events(json!([batch("b", 1, 1, "store", "l1", "dram", &[4])]));
    let total = |q: &str| api.get(&format!("/directory/keys{q}")).1["total"].as_u64().unwrap();
    assert_eq!(total(""), 4);
    assert_eq!(total("?tier=l1"), 4);
    assert_eq!(total("?tier=l2"), 2);
    assert_eq!(total("?instance_id=b"), 1);
    assert_eq!(total("?backend=s3&instance_id=a"), 2);
    assert_eq!(total("?instance_id=nobody"), 0);
    let (_, page) = api.get("/directory/keys?limit=3&offset=2");
    assert_eq!(page["total"], 4);
    assert_eq!(page["keys"].as_array().unwrap().len(), 2);
    let (_, one) = api.get("/directory/keys?tier=l2&backend=s3&limit=1");
    assert_eq!(one["keys"][0]["placements"][0]["backend"], "s3");
    assert_eq!(
        one["keys"][0]["placements"].as_array().unwrap().len(),
        1,
        "placements are filtered too"
    );
    for q in ["?limit=0", "?limit=10001", "?tier=l3", "?offset=-1"] {
        assert_eq!(api.get(&format!("/directory/keys{q}")).0, 422, "{q}");
    }
}

#[test]
fn the_routing_answer_weighs_tiers_and_load_and_skips_unregistered_servers() {
    let api = Api::new();
    for id in ["a", "b"] {
        api.register(id);
    }
    // a: chunks 0,1 in L1. b: chunk 0 in L1, chunks 0..4 in a shared pool. c (unregistered): all.
    api.events(json!([batch("a", 1, 1, "store", "l1", "dram", &[0, 1])]));
    let mut pool = batch("b", 1, 2, "store", "l2", "s3", &[0, 1, 2, 3]);
    pool["shared"] = json!(true);
    api.events(json!([batch("b", 1, 1, "store", "l1", "dram", &[0]), pool]));
    api.events(json!([batch("c", 1, 1, "store", "l1", "dram", &[0, 1, 2, 3])]));
    let hashes: Vec<String> = (0..4).map(hex).collect();
    let route = |extra: Value| {
        let mut body = json!({"chunk_hashes": hashes, "model_name": "m"});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (s, v) = api.post("/directory/route", body);
        assert_eq!(s, 200, "{v}");
        v
    };
    let v = route(json!({}));
    assert_eq!(v["chunks"], 4);
    assert_eq!(v["instances"].as_array().unwrap().len(), 2, "c is not registered: {v}");
    // b: 1 + 0.5 * 3 = 2.5 beats a: 2.
    assert_eq!(v["best"], "b");
    assert_eq!(v["instances"][0]["l1_chunks"], 1);
    assert_eq!(v["instances"][0]["l1_l2_chunks"], 4);
    assert_eq!(v["instances"][0]["l1_l2_tokens"], 1024);
    assert_eq!(v["instances"][1]["l1_chunks"], 2);
    assert_eq!(route(json!({"l2_weight": 0.1}))["best"], "a", "cheap L2 chunks: L1 wins");
    assert_eq!(route(json!({"loads": {"b": 1.0}}))["best"], "a", "load counts against b");
    // a mounts the pool too once it reports to it: then a reaches all 4 chunks.
    let mut a_pool = batch("a", 1, 2, "store", "l2", "s3", &[0]);
    a_pool["shared"] = json!(true);
    api.events(json!([a_pool]));
    assert_eq!(route(json!({}))["best"], "a");
    let (s, _) = api.post("/directory/route", json!({"chunk_hashes": hashes}));
    assert_eq!(s, 422, "model_name is required");
    let (s, _) = api.post("/directory/route", json!({"chunk_hashes": ["zz"], "model_name": "m"}));
    assert_eq!(s, 422);
    let (s, v) = api.post(
        "/directory/route",
        json!({"token_ids": (0..512).collect::<Vec<u32>>(), "model_name": "m"}),
    );
    assert_eq!((s, v["best"].clone()), (200, Value::Null), "unknown tokens: nobody");
}

#[test]
fn usage_joins_placements_and_capacity_declarations() {
    let api = Api::new();
    api.register("a");
    let config = |seq: u64, rev: u64, tier: &str, backend: &str, cap: u64, shared: bool| {
        json!({"instance_id": "a", "incarnation": 1, "seq": seq, "event_type": "config", "tier": tier, "backend": backend,
               "capacity_bytes": cap, "capacity_revision": rev, "shared": shared})
    };
    api.events(json!([
        config(1, 1, "l1", "dram", 1000, false),
        config(2, 1, "l2", "fs", 5000, false),
        batch("a", 1, 3, "store", "l1", "dram", &[1, 2])
    ]));
    let (_, u) = api.get("/instances/usage");
    let a = &u["instances"][0];
    assert_eq!(a["instance_id"], "a");
    assert_eq!(
        (a["registered"].as_bool(), a["declared_capacity"].as_bool()),
        (Some(true), Some(true))
    );
    assert_eq!(
        a["modules"][0],
        json!({"tier": "l1", "backend": "dram", "shared": false, "used_bytes": 200,
                                        "capacity_bytes": 1000, "usage_ratio": 0.2})
    );
    assert_eq!(a["modules"][1]["usage_ratio"], 0.0);
    // A newer revision replaces the whole declaration (fs retired).
    api.events(json!([config(4, 2, "l1", "dram", 2000, false)]));
    let (s, one) = api.get("/instances/a/usage");
    assert_eq!(s, 200);
    assert_eq!(one["modules"].as_array().unwrap().len(), 1, "{one}");
    assert_eq!(one["modules"][0]["capacity_bytes"], 2000);
    assert_eq!(api.get("/instances/nobody/usage").0, 404);
    // Shared pools: reported once; capacity only when the declarers agree.
    api.events(json!([{"instance_id": "b", "incarnation": 1, "seq": 1, "event_type": "config", "tier": "l2", "backend": "s3",
                       "capacity_bytes": 9000, "capacity_revision": 1, "shared": true}]));
    api.events(json!([config(5, 2, "l2", "s3", 9000, true)]));
    let (_, u) = api.get("/instances/usage");
    assert_eq!(u["shared_modules"][0]["capacity_bytes"], 9000);
    api.events(json!([config(6, 2, "l2", "s3", 1, true)]));
    let (_, u) = api.get("/instances/usage");
    assert_eq!(u["shared_modules"][0]["capacity_bytes"], 0, "disagreeing declarers: undeclared");
    assert_eq!(u["shared_modules"][0]["usage_ratio"], Value::Null);
    // Deregistration forgets the declaration; the instance stays listed while it holds bytes.
    assert_eq!(api.delete("/instances/a"), 204);
    assert!(placements(&api, 1).is_empty(), "L1 fenced at deregistration");
}

#[test]
fn silent_instances_are_dropped_by_the_health_sweep() {
    let api = Api::start(CoordinatorConfig {
        instance_timeout: Duration::from_millis(300),
        health_check_interval: Duration::from_millis(100),
        ..CoordinatorConfig::default()
    });
    api.register("quiet");
    api.register("alive");
    api.events(json!([
        batch("quiet", 1, 1, "store", "l1", "dram", &[1]),
        batch("quiet", 1, 2, "store", "l2", "fs", &[1])
    ]));
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(api.put("/instances/alive/heartbeat").0, 200);
    }
    let (_, list) = api.get("/instances");
    assert_eq!(list["instances"].as_array().unwrap().len(), 1);
    assert_eq!(list["instances"][0]["instance_id"], "alive");
    assert_eq!(
        placements(&api, 1),
        vec![("quiet".into(), "l2".into(), "fs".into())],
        "L1 fenced, L2 kept"
    );
    assert_eq!(api.put("/instances/quiet/heartbeat").0, 404, "so the server re-registers");
    assert_eq!(metric(&api, "lmcache_rs_coordinator_expired_instances_total"), 1.0);
}

#[test]
fn metrics_carry_lmcache_names() {
    let api = Api::new();
    api.events(json!([
        batch("a", 1, 1, "store", "l1", "dram", &[1, 2]),
        batch("a", 1, 2, "store", "l2", "fs", &[1])
    ]));
    assert_eq!(metric(&api, "lmcache_coordinator_key_directory_placements"), 3.0);
    assert_eq!(metric(&api, "lmcache_coordinator_key_directory_placement_bytes"), 300.0);
    assert_eq!(metric(&api, "lmcache_mp_key_directory_placement_count"), 3.0);
    assert_eq!(metric(&api, "lmcache_rs_coordinator_event_batches_total"), 2.0);
    let off =
        Api::start(CoordinatorConfig { metrics_enabled: false, ..CoordinatorConfig::default() });
    assert_eq!(off.get("/metrics").0, 404);
}

#[test]
fn mooncake_rfc_1403_queries_answer_per_tenant_and_instance() {
    let api = Api::new();
    api.register("a");
    api.register("b");
    let tokens: Vec<u32> = (0..768).collect();
    let hashes = lmcache_core::TokenHasher::new(256).unwrap().hash_tokens(&tokens);
    let store = |inst: &str, tier: &str, backend: &str, n: usize| {
        let entries: Vec<Value> = hashes[..n]
            .iter()
            .map(|h| json!({"key": {"chunk_hash_hex": h.to_hex(), "model_name": "m", "kv_rank": 0x0100_0100}, "size_bytes": 1}))
            .collect();
        json!({"instance_id": inst, "incarnation": 1, "seq": 1, "event_type": "store", "tier": tier, "backend": backend, "entries": entries})
    };
    api.events(json!([store("a", "l1", "dram", 3)]));
    api.events(json!([store("b", "l2", "fs", 2)]));
    let (s, v) = api.post("/query", json!({"model": "m", "token_ids": tokens, "block_size": 256}));
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["default"]["a"],
        json!({"longest_matched": 768, "GPU": 0, "CPU": 768, "DISK": 768, "DP": {"0": 768}})
    );
    assert_eq!(v["default"]["b"]["CPU"], 0);
    assert_eq!(v["default"]["b"]["longest_matched"], 512);
    let hex: Vec<String> = hashes.iter().map(|h| h.to_hex()).collect();
    let (s, v) = api.post("/query_by_hash", json!({"model": "m", "seq_hashes": hex, "block_size": 256, "tenant_id": "t1", "instance_id": "b"}));
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v,
        json!({"t1": {"b": {"longest_matched": 512, "GPU": 0, "CPU": 0, "DISK": 512, "DP": {"0": 512}}}})
    );
    for (path, body) in [
        ("/query", json!({"model": "m", "token_ids": [1], "block_size": 16})),
        ("/query", json!({"model": "m", "token_ids": [1], "block_size": 256, "lora_name": "x"})),
        ("/query_by_hash", json!({"model": "m", "seq_hashes": [12345], "block_size": 256})),
    ] {
        let (s, v) = api.post(path, body);
        assert_eq!(s, 400, "{v}");
    }
    assert_eq!(
        api.post("/query", json!({"token_ids": [1]})).0,
        422,
        "model and block_size are required"
    );
}

#[test]
fn a_restart_resumes_from_the_checkpoint_and_a_damaged_one_starts_cold() {
    let dir = std::env::temp_dir().join(format!("lmcache-rs-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("coordinator.ckpt");
    let cfg = || CoordinatorConfig {
        checkpoint_path: Some(path.clone()),
        checkpoint_interval: Duration::ZERO,
        ..CoordinatorConfig::default()
    };
    let api = Api::start(cfg());
    api.register("a");
    let mut b = batch("a", 7, 1, "store", "l1", "dram", &[1, 2]);
    b["entries"][0]["token_ids"] = json!([5, 6, 7]);
    b["entries"][0]["token_offset"] = json!(256);
    api.events(json!([b, batch("a", 7, 2, "store", "l2", "s3", &[2]),
        {"instance_id": "a", "incarnation": 7, "seq": 3, "event_type": "config", "tier": "l1", "backend": "dram",
         "capacity_bytes": 1000, "capacity_revision": 1}]));
    let before = (
        api.get("/directory/stats").1,
        api.get("/instances/usage").1,
        api.post("/directory/lookup", json!({"keys": [key(1), key(2)]})).1,
    );
    api.c.stop();
    assert!(path.exists());
    let api = Api::start(cfg());
    let mut after_stats = api.get("/directory/stats").1;
    let mut before_stats = before.0.clone();
    for s in [&mut after_stats, &mut before_stats] {
        s["streams"][0]["seconds_since_last_batch"] = json!(0);
    }
    assert_eq!(after_stats, before_stats);
    assert_eq!(api.get("/instances/usage").1, before.1);
    assert_eq!(
        api.post("/directory/lookup", json!({"keys": [key(1), key(2)]})).1,
        before.2,
        "tokens and placements back"
    );
    assert_eq!(api.get("/instances").1["instances"][0]["instance_id"], "a");
    assert_eq!(metric(&api, "lmcache_rs_coordinator_checkpoint_restores_total"), 1.0);
    // The stream resumes where the checkpoint left it: seq 3 is a replay, seq 4 applies.
    assert_eq!(api.events(json!([batch("a", 7, 3, "store", "l1", "dram", &[3])]))["duplicates"], 1);
    assert_eq!(api.events(json!([batch("a", 7, 4, "store", "l1", "dram", &[3])]))["applied"], 1);
    api.c.stop();
    // One flipped byte: the file is not used; the coordinator starts cold and the emitter's
    // next batch is a gap that gets repaired (here: fenced, nobody serves a snapshot).
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let api = Api::start(cfg());
    assert_eq!(
        api.get("/directory/stats").1["num_keys"],
        0,
        "a damaged checkpoint gives no answers, not wrong ones"
    );
    let m =
        api.agent.get(&api.url("/metrics")).call().unwrap().body_mut().read_to_string().unwrap();
    assert!(
        m.contains("lmcache_rs_coordinator_checkpoint_restores_total{result=\"corrupt\"} 1"),
        "{m}"
    );
    api.events(json!([batch("a", 7, 9, "store", "l1", "dram", &[4])]));
    let (_, st) = api.get("/directory/stats");
    assert_eq!(st["streams"][0]["missing_batches"], 8, "the cold start sees the gap: {st}");
    drop(api);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A one-route HTTP server answering every request with `body` (a server's /fleet/snapshot).
fn snapshot_server(body: Value) -> u16 {
    snapshot_server_with(body, None)
}

/// As [`snapshot_server`], answering 401 to requests without `Authorization: Bearer <token>`.
fn snapshot_server_with(body: Value, token: Option<&'static str>) -> u16 {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut r = BufReader::new(conn.try_clone().unwrap());
            let mut line = String::new();
            let mut authorized = token.is_none();
            while r.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                if let Some(t) = token
                    && line.trim().eq_ignore_ascii_case(&format!("authorization: Bearer {t}"))
                {
                    authorized = true;
                }
                line.clear();
            }
            let (status, text) = if authorized {
                ("200 OK", body.to_string())
            } else {
                ("401 Unauthorized", "{}".to_owned())
            };
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                text.len()
            );
        }
    });
    port
}

#[test]
fn a_gap_from_an_instance_not_registered_yet_waits_for_its_registration_then_resyncs() {
    let api = Api::new();
    // A coordinator that lost its state sees the server's next batch as a gap, before the
    // server has noticed (on its next heartbeat) that it must register again.
    api.events(json!([batch("late", 3, 7, "store", "l1", "dram", &[5])]));
    std::thread::sleep(Duration::from_millis(500));
    let snapshot = json!({"incarnation": 3, "backend": "dram", "next_page_token": null,
        "entries": [{"key": key(1), "size_bytes": 10}, {"key": key(2), "size_bytes": 10}, {"key": key(5), "size_bytes": 100}]});
    let port = snapshot_server(snapshot);
    let (s, _) = api
        .post("/instances", json!({"instance_id": "late", "ip": "127.0.0.1", "http_port": port}));
    assert_eq!(s, 200);
    let t = std::time::Instant::now();
    while placements(&api, 1).is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the repair never ran after the registration"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(placements(&api, 2).len(), 1, "the snapshot's keys are placed");
    let (_, v) = api.post("/directory/lookup", json!({"keys": [key(5)]}));
    assert_eq!(
        v["results"][0]["placements"][0]["size_bytes"], 100,
        "the event's placement, not fenced away"
    );
    let (_, st) = api.get("/directory/stats");
    assert_eq!(
        (st["streams"][0]["gap_detected"].as_bool(), st["streams"][0]["repairs"].as_u64()),
        (Some(false), Some(1))
    );
}

#[test]
fn token_lookups_reach_the_other_object_groups_the_directory_holds() {
    let api = Api::new();
    let tokens: Vec<u32> = (0..512).collect();
    let hashes = lmcache_core::TokenHasher::new(256).unwrap().hash_tokens(&tokens);
    // Chunk 0 stored in groups 0 and 2, chunk 1 in group 0 only.
    let entry = |h: &lmcache_core::ChunkHash, g: u32| json!({"key": {"chunk_hash_hex": h.to_hex(), "model_name": "m", "kv_rank": 0x0100_0100, "object_group_id": g}, "size_bytes": 1});
    api.events(json!([{"instance_id": "a", "incarnation": 1, "seq": 1, "event_type": "store", "tier": "l1", "backend": "dram",
        "entries": [entry(&hashes[0], 0), entry(&hashes[0], 2), entry(&hashes[1], 0)]}]));
    let (_, v) = api.post("/directory/lookup", json!({"token_ids": tokens, "model_name": "m"}));
    assert_eq!(v["chunks"], 2);
    let got: Vec<(String, u64)> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["key"]["chunk_hash_hex"].as_str().unwrap().to_string(),
                r["key"]["object_group_id"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![(hashes[0].to_hex(), 0), (hashes[0].to_hex(), 2), (hashes[1].to_hex(), 0)]
    );
    assert!(
        v["results"].as_array().unwrap().iter().all(|r| r["placements"][0]["instance_id"] == "a")
    );
}

fn b64_tokens(tokens: &[u32]) -> String {
    use base64::Engine as _;
    let raw: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(raw)
}

#[test]
fn blend_lookups_find_stored_chunks_anywhere_token_exactly_and_per_namespace() {
    let api = Api::start(CoordinatorConfig {
        chunk_size: 4,
        enable_blend_lookup: true,
        ..CoordinatorConfig::default()
    });
    api.register("a");
    let stored = |salt: &str, b: u8, rank: u32, tokens: &[u32], offset: i64| {
        json!({"key": {"chunk_hash_hex": hex(b), "model_name": "m", "kv_rank": 2 << 24 | rank << 16 | 2 << 8 | rank, "cache_salt": salt},
               "size_bytes": 100, "token_ids": tokens, "token_offset": offset})
    };
    let store = |seq: u64, ty: &str, entries: Vec<Value>| {
        api.events(json!([{"instance_id": "a", "incarnation": 1, "seq": seq, "event_type": ty,
                           "tier": "l1", "backend": "dram", "entries": entries}]));
    };
    // Two ranks of chunk 1 under salt t, chunk 2 under salt u, chunk 3 with no position.
    store(
        1,
        "store",
        vec![
            stored("t", 1, 0, &[10, 11, 12, 13], 4),
            stored("t", 1, 1, &[10, 11, 12, 13], 4),
            stored("u", 2, 0, &[20, 21, 22, 23], 8),
            stored("t", 3, 0, &[30, 31, 32, 33], -1),
        ],
    );
    let lookup = |salt: &str, q: &[u32]| {
        let (s, v) = api.post(
            "/directory/blend-lookup",
            json!({"tokens_b64": b64_tokens(q), "model_name": "m", "world_size": 2, "cache_salt": salt}),
        );
        assert_eq!(s, 200, "{v}");
        v["matches"].as_array().unwrap().clone()
    };
    let q = [7, 20, 21, 22, 23, 10, 11, 12, 13, 30, 31, 32, 33, 10, 11, 12, 13];
    assert_eq!(
        lookup("t", &q),
        vec![json!({"chunk_hash": hex(1), "old_st": 4, "cur_st": 5})],
        "salt t: its chunk once, not u's, not the one without a position"
    );
    assert_eq!(lookup("u", &q), vec![json!({"chunk_hash": hex(2), "old_st": 8, "cur_st": 1})]);
    assert!(lookup("t", &[10, 11, 12, 14, 10]).is_empty(), "a near miss is no match");
    let (_, st) = api.get("/directory/stats");
    assert_eq!(st["blend"]["num_contents"], 2, "{st}");
    assert_eq!(st["blend"]["num_claims"], 3, "{st}");
    assert_eq!(st["blend"]["num_namespaces"], 2, "{st}");
    // One rank leaving keeps the claim; the last one drops it.
    store(2, "delete", vec![stored("t", 1, 0, &[], -1)]);
    assert_eq!(lookup("t", &q).len(), 1);
    store(3, "delete", vec![stored("t", 1, 1, &[], -1)]);
    assert!(lookup("t", &q).is_empty());
    for (body, what) in [
        (json!({"tokens_b64": "***", "model_name": "m"}), "base64"),
        (json!({"tokens_b64": "AAA=", "model_name": "m"}), "multiple of 4"),
        (json!({"tokens_b64": b64_tokens(&[1]), "model_name": ""}), "model_name"),
        (json!({"tokens_b64": b64_tokens(&[1]), "model_name": "m", "world_size": 0}), "world_size"),
    ] {
        let (s, v) = api.post("/directory/blend-lookup", body);
        assert_eq!(s, 422, "{what}: {v}");
        assert!(v.to_string().contains(what), "{what}: {v}");
    }
}

#[test]
fn blend_lookups_match_nothing_unless_enabled() {
    let api = Api::start(CoordinatorConfig { chunk_size: 4, ..CoordinatorConfig::default() });
    api.register("a");
    api.events(json!([{"instance_id": "a", "incarnation": 1, "seq": 1, "event_type": "store",
        "tier": "l1", "backend": "dram", "entries": [{"key": key(1), "size_bytes": 1,
        "token_ids": [1, 2, 3, 4], "token_offset": 0}]}]));
    let (s, v) = api.post(
        "/directory/blend-lookup",
        json!({"tokens_b64": b64_tokens(&[1, 2, 3, 4]), "model_name": "m"}),
    );
    assert_eq!((s, v), (200, json!({"matches": []})));
}

#[test]
fn a_server_behind_a_token_is_resynced_with_it_and_fenced_without_it() {
    for (token, resynced) in [(Some("s3cret"), true), (None, false)] {
        // The token goes only to a server that registered with the coordinator's own.
        let api = Api::start(CoordinatorConfig {
            server_http_auth_token: token.map(str::to_owned),
            auth_token: Some("coord".into()),
            // Its event batches come without the token here.
            allow_unauthenticated_registration: true,
            ..CoordinatorConfig::default()
        });
        let snapshot = json!({"incarnation": 3, "backend": "dram", "next_page_token": null,
            "entries": [{"key": key(1), "size_bytes": 10}]});
        let port = snapshot_server_with(snapshot, Some("s3cret"));
        let r = api
            .agent
            .post(&api.url("/instances"))
            .header("Authorization", "Bearer coord")
            .send_json(json!({"instance_id": "t", "ip": "127.0.0.1", "http_port": port}))
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        // A first batch past seq 1 is a gap: the coordinator resyncs from the snapshot.
        api.events(json!([batch("t", 3, 5, "store", "l1", "dram", &[2])]));
        let t = std::time::Instant::now();
        loop {
            let (_, st) = api.get("/directory/stats");
            if st["streams"][0]["repairs"].as_u64() == Some(1) {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "no repair ran: {st}");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(!placements(&api, 1).is_empty(), resynced, "token {token:?}");
    }
}

/// Every route the built router lists is served by its handler: no 405, and a 404 only with
/// a handler's JSON (the router's own 404 has no body).
#[test]
fn every_listed_route_reaches_its_handler() {
    let api = Api::new();
    let routes = lmcache_coordinator::http::route_list();
    assert!(routes.len() >= 29, "the route list looks short: {routes:?}");
    for (method, path) in routes {
        let path = path
            .replace("{id}", "nobody")
            .replace("{salt}", "tenant")
            .replace("{instance}", "nobody")
            .replace("{request}", "r");
        let url = api.url(&path);
        let r = match method {
            "GET" => api.agent.get(&url).call(),
            "DELETE" => api.agent.delete(&url).force_send_body().send_json(json!({})),
            "PUT" => api.agent.put(&url).send_json(json!({})),
            _ => api.agent.post(&url).send_json(json!({})),
        };
        let (status, body) = Api::read(r.unwrap());
        assert_ne!(status, 405, "{method} {path}: method not routed");
        if status == 404 {
            assert!(body.is_object(), "{method} {path}: the router's 404, not a handler's: {body}");
        }
    }
}
