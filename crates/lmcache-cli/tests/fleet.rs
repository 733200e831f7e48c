//! An lmcache-rs server reporting to an lmcache-rs coordinator, both in this process:
//! registration, L1 store and removal events, deregistration at shutdown, and a coordinator
//! that is down for a while (events queue and arrive, with no gap, once it answers).

use std::time::{Duration, Instant};

use lmcache_coordinator::{Coordinator, CoordinatorConfig};
use lmcache_core::ObjectKey;
use lmcache_l1::WriteRequest;
use lmcache_memory::{ArenaBacking, ArenaConfig};
use lmcache_server::fleet_report::CoordinatorReporting;
use lmcache_server::{Server, ServerConfig};
use serde_json::{Value, json};

fn coordinator(port: u16) -> Coordinator {
    Coordinator::start(CoordinatorConfig {
        host: "127.0.0.1".into(),
        port,
        ..CoordinatorConfig::default()
    })
    .unwrap()
}

fn server(coordinator_port: u16, id: &str) -> Server {
    let arena = ArenaConfig { size: 16 << 20, backing: ArenaBacking::Anonymous, mlock: false };
    Server::start(ServerConfig {
        http_port: Some(0),
        coordinator: Some(CoordinatorReporting {
            url: format!("http://127.0.0.1:{coordinator_port}/"),
            instance_id: id.into(),
            advertise_ip: "127.0.0.1".into(),
            heartbeat_interval: Duration::from_millis(100),
            event_reporting: true,
            flush_interval: Duration::from_millis(50),
        }),
        ..ServerConfig::local(arena)
    })
    .unwrap()
}

fn key(b: u8) -> ObjectKey {
    ObjectKey::new([b; 32], "m", 1, 0, 0, "").unwrap()
}

fn store(s: &Server, keys: &[u8]) {
    let reqs: Vec<WriteRequest> = keys.iter().map(|&b| WriteRequest::new(key(b), 4096)).collect();
    let res: Vec<_> = s.state().l1().reserve_write(&reqs).into_iter().map(Result::unwrap).collect();
    for r in s.state().l1().commit_batch(res) {
        r.unwrap();
    }
}

fn get(c: &Coordinator, path: &str) -> Value {
    let mut r = ureq::get(&format!("http://{}{path}", c.addr())).call().unwrap();
    serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap()
}

fn placed_on(c: &Coordinator, b: u8) -> Vec<String> {
    let body = json!({"keys": [{"chunk_hash_hex": format!("{b:02x}").repeat(32), "model_name": "m", "kv_rank": 0x0100_0100}]});
    let mut r =
        ureq::post(&format!("http://{}/directory/lookup", c.addr())).send_json(body).unwrap();
    let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
    v["results"][0]["placements"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["instance_id"].as_str().unwrap().to_string())
        .collect()
}

fn until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_server_registers_reports_its_l1_and_deregisters_at_shutdown() {
    let c = coordinator(0);
    let s = server(c.addr().port(), "rs-1");
    until("registered", || {
        get(&c, "/instances")["instances"].as_array().is_some_and(|a| a.len() == 1)
    });
    let inst = &get(&c, "/instances")["instances"][0];
    assert_eq!(inst["instance_id"], "rs-1");
    assert_eq!(inst["http_port"], s.http_addr().unwrap().port());
    store(&s, &[1, 2, 3]);
    until("stores placed", || (1..=3).all(|b| placed_on(&c, b) == ["rs-1"]));
    s.state().l1().delete(&[key(2)], true);
    until("delete reported", || placed_on(&c, 2).is_empty());
    let usage = get(&c, "/instances/rs-1/usage");
    assert_eq!(usage["declared_capacity"], true, "{usage}");
    assert_eq!(usage["modules"][0]["capacity_bytes"], 16 << 20);
    assert_eq!(usage["modules"][0]["used_bytes"], 2 * 4096);
    s.shutdown();
    assert_eq!(get(&c, "/instances")["instances"], json!([]), "deregistered at shutdown");
    assert!(placed_on(&c, 1).is_empty(), "and its L1 fenced");
}

#[test]
fn events_wait_for_a_coordinator_that_is_down_and_arrive_without_a_gap() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let s = server(port, "rs-2");
    store(&s, &[1, 2]);
    std::thread::sleep(Duration::from_millis(300));
    store(&s, &[3]);
    let c = coordinator(port);
    until("all placed once the coordinator is up", || {
        (1..=3).all(|b| placed_on(&c, b) == ["rs-2"])
    });
    let st = get(&c, "/directory/stats");
    assert_eq!(st["streams"][0]["gap_detected"], false, "{st}");
    // The coordinator restarts (state lost): the server re-registers on the 404.
    c.stop();
    let c = coordinator(port);
    until("re-registered", || {
        get(&c, "/instances")["instances"].as_array().is_some_and(|a| a.len() == 1)
    });
    s.shutdown();
}
