//! CacheBlend's coordinator leg: a prompt's tokens sent to the fleet coordinator's
//! `POST /directory/blend-lookup` (ours or LMCache's), which answers the chunks stored on any
//! server of the fleet whose tokens occur in it, so a server can reuse a document another
//! server computed (loaded from the shared L2, or from the peer's L1 over P2P).
//!
//! As LMCache's client: submit once per request, poll on each lookup call, never block a
//! worker on the round trip; at most `--coordinator-blend-match-concurrency` queries in
//! flight (the rest queue), each bounded by `--coordinator-blend-timeout`, which the lookup
//! also uses as its deadline: past it the lookup goes on without the fleet's matches. A
//! failed or malformed answer is no matches, logged.
//!
//! Unlike LMCache's, the coordinator's matches add to this server's own fingerprint matches
//! instead of replacing them: what this server stored is found even while the coordinator
//! is slow, away or behind on events.

use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use base64::Engine as _;
use lmcache_blend::Namespace;
use parking_lot::{Condvar, Mutex};

/// One chunk the coordinator matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FleetMatch {
    /// The chunk's hash (its object keys' chunk hash under the stored request's chain).
    pub chunk_hash: [u8; 32],
    /// Where it sat when stored.
    pub old_st: u64,
    /// Where its tokens sit in the prompt.
    pub cur_st: u64,
}

/// How to reach the coordinator (LMCache's `--coordinator-blend-*` flags).
#[derive(Debug, Clone)]
pub struct FleetMatchConfig {
    /// `--coordinator-url`.
    pub url: String,
    /// `--coordinator-auth-token`, sent as LMCache's reporter sends it.
    pub auth_token: Option<String>,
    /// `--coordinator-blend-timeout`: the HTTP timeout and the lookup's deadline.
    pub timeout: Duration,
    /// `--coordinator-blend-match-concurrency`: queries in flight at most.
    pub concurrency: usize,
}

type Answer = Result<Vec<FleetMatch>, String>;

#[derive(Debug, Default)]
struct Slot {
    answer: Mutex<Option<Answer>>,
    done: Condvar,
}

/// A submitted query: poll it until it answers.
#[derive(Debug, Clone)]
pub struct FleetQuery {
    slot: Arc<Slot>,
}

impl FleetQuery {
    /// The answer once it has come (taken once: later polls see `None` again).
    pub fn poll(&self) -> Option<Answer> {
        self.slot.answer.lock().take()
    }

    /// Blocks until it answers or `timeout` passes; whether it answered (tests).
    pub fn wait(&self, timeout: Duration) -> bool {
        let mut a = self.slot.answer.lock();
        if a.is_none() {
            self.slot.done.wait_for(&mut a, timeout);
        }
        a.is_some()
    }
}

struct Job {
    body: serde_json::Value,
    slot: Arc<Slot>,
}

/// The client: a queue and `concurrency` threads sending queries.
#[derive(Debug)]
pub struct FleetMatcher {
    config: FleetMatchConfig,
    queue: Option<mpsc::Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Job")
    }
}

impl FleetMatcher {
    /// Starts the client's threads.
    pub fn start(config: FleetMatchConfig) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(config.timeout))
            .http_status_as_error(false)
            .build()
            .into();
        let url = format!("{}/directory/blend-lookup", config.url.trim_end_matches('/'));
        let mut threads = Vec::new();
        for i in 0..config.concurrency.max(1) {
            let (rx, agent, url) = (Arc::clone(&rx), agent.clone(), url.clone());
            let token = config.auth_token.clone();
            threads.push(std::thread::Builder::new().name(format!("cb-coord-match-{i}")).spawn(
                move || loop {
                    let job = rx.lock().recv();
                    let Ok(job) = job else { return };
                    let answer = query(&agent, &url, token.as_deref(), &job.body);
                    if let Err(e) = &answer {
                        tracing::warn!(error = %e, "CB coordinator match failed; no fleet matches");
                    }
                    *job.slot.answer.lock() = Some(answer);
                    job.slot.done.notify_all();
                },
            )?);
        }
        Ok(Self { config, queue: Some(tx), threads })
    }

    /// The lookup's deadline for an answer.
    pub fn budget(&self) -> Duration {
        self.config.timeout
    }

    /// Queues a query for `tokens` in `ns` (the requester's model, world size and salt: the
    /// coordinator answers only chunks this server's keys can reach).
    pub fn submit(&self, tokens: &[u32], ns: &Namespace) -> FleetQuery {
        let slot = Arc::new(Slot::default());
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let body = serde_json::json!({
            "tokens_b64": base64::engine::general_purpose::STANDARD.encode(bytes),
            "model_name": &*ns.model,
            "cache_salt": &*ns.cache_salt,
            "world_size": ns.world_size,
        });
        let sent =
            self.queue.as_ref().is_some_and(|q| q.send(Job { body, slot: slot.clone() }).is_ok());
        if !sent {
            *slot.answer.lock() = Some(Err("the coordinator client has stopped".into()));
        }
        FleetQuery { slot }
    }
}

impl Drop for FleetMatcher {
    fn drop(&mut self) {
        drop(self.queue.take());
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn query(agent: &ureq::Agent, url: &str, token: Option<&str>, body: &serde_json::Value) -> Answer {
    let mut req = agent.post(url);
    if let Some(t) = token {
        req = req.header("Authorization", format!("Bearer {t}"));
    }
    let mut resp = req.send_json(body).map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    if !(200..300).contains(&status) {
        return Err(format!("HTTP {status}"));
    }
    let v: serde_json::Value = resp.body_mut().read_json().map_err(|e| e.to_string())?;
    parse(&v)
}

/// LMCache's answer, `{"matches": [{"chunk_hash": hex, "old_st": n, "cur_st": n}]}`, each
/// entry checked (a 32-byte hash, positions within u32).
pub fn parse(v: &serde_json::Value) -> Answer {
    let Some(list) = v.get("matches").and_then(|m| m.as_array()) else {
        return Err("no 'matches' list in the answer".into());
    };
    list.iter()
        .map(|m| {
            let hex = m.get("chunk_hash").and_then(|h| h.as_str()).unwrap_or_default();
            let chunk_hash: [u8; 32] = hex::decode(hex)
                .ok()
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| format!("chunk_hash {hex:?}: not 32 hex bytes"))?;
            let pos = |f: &str| {
                m.get(f)
                    .and_then(serde_json::Value::as_u64)
                    .filter(|&p| p <= u64::from(u32::MAX))
                    .ok_or_else(|| format!("{f}: not a position"))
            };
            Ok(FleetMatch { chunk_hash, old_st: pos("old_st")?, cur_st: pos("cur_st")? })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_parsed_and_checked() {
        let h = "ab".repeat(32);
        let ok = serde_json::json!({"matches": [{"chunk_hash": h, "old_st": 256, "cur_st": 300}]});
        assert_eq!(
            parse(&ok).unwrap(),
            vec![FleetMatch { chunk_hash: [0xab; 32], old_st: 256, cur_st: 300 }]
        );
        assert!(parse(&serde_json::json!({})).is_err());
        let short =
            serde_json::json!({"matches": [{"chunk_hash": "abcd", "old_st": 0, "cur_st": 0}]});
        assert!(parse(&short).is_err());
        let neg = serde_json::json!({"matches": [{"chunk_hash": h, "old_st": -1, "cur_st": 0}]});
        assert!(parse(&neg).is_err());
        let big =
            serde_json::json!({"matches": [{"chunk_hash": h, "old_st": 0, "cur_st": 1u64 << 40}]});
        assert!(parse(&big).is_err());
    }

    #[test]
    fn an_unreachable_coordinator_answers_no_matches_within_the_timeout() {
        // A port nothing listens on: refused at once, an error, not a hang.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let m = FleetMatcher::start(FleetMatchConfig {
            url: format!("http://127.0.0.1:{port}"),
            auth_token: None,
            timeout: Duration::from_millis(500),
            concurrency: 2,
        })
        .unwrap();
        let ns = Namespace { model: "m".into(), world_size: 1, cache_salt: "".into() };
        let q = m.submit(&[1, 2, 3], &ns);
        assert!(q.wait(Duration::from_secs(5)));
        assert!(q.poll().unwrap().is_err());
        assert!(q.poll().is_none(), "taken once");
    }
}
