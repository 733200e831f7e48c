//! Fleet trust: the coordinator never sends the servers' bearer token to an address an
//! unauthenticated caller registered, its write routes need its own token when it has one,
//! and an instance keeps trust only while its latest registration carried that token.

use std::io::{BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lmcache_coordinator::{Coordinator, CoordinatorConfig};
use serde_json::{Value, json};

const SERVER_TOKEN: &str = "server-s3cret";
const COORD_TOKEN: &str = "coordinator-s3cret";

/// A listener standing in for a registered "server": answers every request 200 with a
/// snapshot page and records each request's `Authorization` header (`""` when none).
struct Recorder {
    port: u16,
    seen: Arc<Mutex<Vec<(String, String)>>>,
}

impl Recorder {
    fn start() -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let log = Arc::clone(&seen);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let mut r = BufReader::new(conn.try_clone().unwrap());
                let (mut request, mut auth, mut len) = (String::new(), String::new(), 0usize);
                let _ = r.read_line(&mut request);
                let mut line = String::new();
                while r.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                    let lower = line.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("authorization:") {
                        auth = line[line.len() - v.len()..].trim().to_owned();
                    }
                    if let Some(v) = lower.strip_prefix("content-length:") {
                        len = v.trim().parse().unwrap_or(0);
                    }
                    line.clear();
                }
                let mut body = vec![0u8; len];
                let _ = r.read_exact(&mut body);
                log.lock().unwrap().push((request.trim().to_owned(), auth));
                let text = json!({"incarnation": 1, "backend": "dram", "next_page_token": null,
                    "entries": [], "request_id": "r", "chunks": 0, "deleted": 0, "skipped": 0})
                .to_string();
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                    text.len()
                );
            }
        });
        Self { port, seen }
    }

    /// Waits until `n` requests arrived; returns their `(request line, authorization)`.
    fn wait(&self, n: usize) -> Vec<(String, String)> {
        let t = Instant::now();
        loop {
            let seen = self.seen.lock().unwrap().clone();
            if seen.len() >= n || t.elapsed() > Duration::from_secs(10) {
                return seen;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

struct Api {
    c: Coordinator,
    agent: ureq::Agent,
}

impl Api {
    fn start(cfg: CoordinatorConfig) -> Self {
        let c = Coordinator::start(CoordinatorConfig {
            port: 0,
            server_http_auth_token: Some(SERVER_TOKEN.into()),
            ..cfg
        })
        .unwrap();
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(40)))
            .build()
            .into();
        Self { c, agent }
    }

    fn call(&self, method: &str, path: &str, body: Value, token: Option<&str>) -> u16 {
        let url = format!("http://{}{path}", self.c.addr());
        let auth = token.map(|t| format!("Bearer {t}"));
        let r = match method {
            "GET" => {
                let mut b = self.agent.get(&url);
                if let Some(a) = &auth {
                    b = b.header("Authorization", a);
                }
                b.call()
            }
            "PUT" | "POST" => {
                let mut b =
                    if method == "PUT" { self.agent.put(&url) } else { self.agent.post(&url) };
                if let Some(a) = &auth {
                    b = b.header("Authorization", a);
                }
                b.send_json(body)
            }
            _ => {
                let mut b = self.agent.delete(&url);
                if let Some(a) = &auth {
                    b = b.header("Authorization", a);
                }
                b.force_send_body().send_json(body)
            }
        };
        r.unwrap().status().as_u16()
    }

    fn register(&self, id: &str, port: u16, token: Option<&str>) -> u16 {
        let body = json!({"instance_id": id, "ip": "127.0.0.1", "http_port": port});
        self.call("POST", "/instances", body, token)
    }

    /// A prefetch relay to `id` and a delete relay: each one request to the instance.
    fn relay_to(&self, id: &str, token: Option<&str>) {
        let body = json!({"instance_id": id, "model_name": "m", "world_size": 1,
            "token_ids": (0..256).collect::<Vec<u32>>(), "cache_salt": ""});
        assert_eq!(self.call("POST", "/cache/prefetches", body.clone(), token), 200);
        assert_eq!(self.call("POST", "/cache/delete", body, token), 200);
    }
}

#[test]
fn a_registration_without_credentials_never_draws_the_servers_token() {
    // No --auth-token: the coordinator is open, so nobody who registers is trusted.
    let api = Api::start(CoordinatorConfig::default());
    let evil = Recorder::start();
    assert_eq!(api.register("evil", evil.port, None), 200);
    api.relay_to("evil", None);
    // A gap in its event stream makes the coordinator resync from the "server's" snapshot.
    let batch = json!({"instance_id": "evil", "incarnation": 1, "seq": 5, "event_type": "store",
        "tier": "l1", "backend": "dram", "entries": []});
    assert_eq!(api.call("POST", "/events", json!({"batches": [batch]}), None), 200);
    let seen = evil.wait(3);
    assert!(seen.len() >= 3, "the relays and the resync reached the listener: {seen:?}");
    assert!(seen.iter().any(|(r, _)| r.contains("/fleet/snapshot")), "{seen:?}");
    assert!(
        seen.iter().all(|(_, auth)| auth.is_empty()),
        "the servers' token went to an unauthenticated registration: {seen:?}"
    );
}

#[test]
fn with_its_own_token_every_write_needs_it_and_reads_do_not() {
    let api = Api::start(CoordinatorConfig {
        auth_token: Some(COORD_TOKEN.into()),
        ..CoordinatorConfig::default()
    });
    let mut writes = 0;
    for (method, path) in lmcache_coordinator::http::route_list() {
        let path = path
            .replace("{id}", "nobody")
            .replace("{salt}", "tenant")
            .replace("{instance}", "nobody")
            .replace("{request}", "r");
        let code = api.call(method, &path, json!({}), None);
        let wrong = api.call(method, &path, json!({}), Some("not-the-token"));
        if lmcache_coordinator::http::is_write(method, &path) {
            writes += 1;
            assert_eq!((code, wrong), (401, 401), "{method} {path} without the token");
            let with = api.call(method, &path, json!({}), Some(COORD_TOKEN));
            assert_ne!(with, 401, "{method} {path} with the token");
        } else {
            assert_ne!(code, 401, "{method} {path} is a read");
        }
    }
    assert!(writes >= 11, "the write routes look few: {writes}");
    let server = Recorder::start();
    assert_eq!(api.register("s", server.port, None), 401);
    assert_eq!(api.register("s", server.port, Some(COORD_TOKEN)), 200);
    api.relay_to("s", Some(COORD_TOKEN));
    let seen = server.wait(2);
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|(_, a)| a == &format!("Bearer {SERVER_TOKEN}")), "{seen:?}");
}

#[test]
fn only_the_latest_registration_with_the_token_is_trusted() {
    let api = Api::start(CoordinatorConfig {
        auth_token: Some(COORD_TOKEN.into()),
        allow_unauthenticated_registration: true,
        ..CoordinatorConfig::default()
    });
    let (ours, lmcache) = (Recorder::start(), Recorder::start());
    assert_eq!(api.register("ours", ours.port, Some(COORD_TOKEN)), 200);
    // An LMCache server sends no token: accepted, never trusted.
    assert_eq!(api.register("lmcache", lmcache.port, None), 200);
    assert_eq!(api.call("PUT", "/instances/lmcache/heartbeat", json!({}), None), 200);
    // Control routes still need the token.
    let body = json!({"instance_id": "lmcache", "model_name": "m", "world_size": 1,
        "token_ids": [1], "cache_salt": ""});
    assert_eq!(api.call("POST", "/cache/prefetches", body, None), 401);
    api.relay_to("ours", Some(COORD_TOKEN));
    api.relay_to("lmcache", Some(COORD_TOKEN));
    let trusted = ours.wait(2);
    assert!(trusted.iter().all(|(_, a)| a == &format!("Bearer {SERVER_TOKEN}")), "{trusted:?}");
    assert!(lmcache.wait(2).iter().all(|(_, a)| a.is_empty()), "token sent to an LMCache server");
    // Someone re-registers "ours" without the token, at another address: trust goes with it.
    let thief = Recorder::start();
    assert_eq!(api.register("ours", thief.port, None), 200);
    api.relay_to("ours", Some(COORD_TOKEN));
    let stolen = thief.wait(2);
    assert_eq!(stolen.len(), 2);
    assert!(stolen.iter().all(|(_, a)| a.is_empty()), "a re-registration stole trust: {stolen:?}");
}
