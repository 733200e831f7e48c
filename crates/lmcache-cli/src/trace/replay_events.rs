//! `trace replay-events`: events-level traces (one per recorded server) delivered to a
//! coordinator (ours or LMCache's) as the fleet delivered them: a `start` mark registers the
//! server (`POST /instances`) and starts its heartbeats, each batch is one `POST /events`
//! exactly as recorded, a `stop` mark deregisters it; a stream that ends without `stop` only
//! stops heartbeating, so the coordinator's health sweep retires it as it would a crashed
//! server. Files are merged by wall clock (stable: no server's sequence is reordered).
//! `--speed` paces by the recording (1 = as recorded, 0 = as fast as the coordinator takes
//! it). A refused call stops the replay: a half-delivered stream would leave views that look
//! complete and are not.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lmcache_protocol::coordinator::{CacheEventsResponse, RegisterRequest, RegisterResponse};
use lmcache_workload::trace::codec::{self, EVENTS_BATCH, EVENTS_LIFECYCLE};
use lmcache_workload::trace::{Record, TraceReader};
use rmpv::Value;

/// The cache-event schema this build speaks.
const SCHEMA: i64 = 1;

/// A fleet's streams, merged.
#[derive(Debug, Default)]
pub struct EventsTrace {
    /// Records ascending by `t_wall`.
    pub records: Vec<Record>,
    /// The files read.
    pub files: Vec<PathBuf>,
}

impl EventsTrace {
    /// Reads `paths` (each an events-level trace) into one stream.
    pub fn load(paths: &[PathBuf]) -> anyhow::Result<Self> {
        let mut records = Vec::new();
        for p in paths {
            let f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
            let mut r = TraceReader::new(std::io::BufReader::new(f))
                .with_context(|| format!("reading {}", p.display()))?;
            if r.header().level != "events" {
                bail!(
                    "{} is a {:?}-level trace; only an \"events\" trace holds coordinator input",
                    p.display(),
                    r.header().level
                );
            }
            if let Some(v) = r.header().meta("cache_event_schema_version")
                && v.as_i64() != Some(SCHEMA)
            {
                bail!(
                    "{} holds cache_event_schema_version {v}; this build speaks {SCHEMA}",
                    p.display()
                );
            }
            records.extend(r.read_all().with_context(|| format!("reading {}", p.display()))?);
            if let Some(why) = r.truncated() {
                tracing::warn!(file = %p.display(), "{why}");
            }
        }
        records.sort_by(|a, b| a.t_wall.total_cmp(&b.t_wall));
        Ok(Self { records, files: paths.to_vec() })
    }

    /// The servers named, in first-appearance order.
    pub fn instances(&self) -> Vec<String> {
        let mut seen = Vec::new();
        for r in &self.records {
            if let Some(id) = instance_of(r)
                && !seen.contains(&id)
            {
                seen.push(id);
            }
        }
        seen
    }
}

fn instance_of(r: &Record) -> Option<String> {
    r.arg("instance_id").and_then(Value::as_str).filter(|s| !s.is_empty()).map(str::to_owned)
}

/// What a replay delivered (LMCache's summary fields).
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct EventsReplayResult {
    /// Records read.
    pub records: u64,
    /// Batches delivered.
    pub batches: u64,
    /// Of them, applied by the coordinator.
    pub applied: u64,
    /// Dropped as duplicates.
    pub duplicates: u64,
    /// Dropped as of an older incarnation.
    pub stale: u64,
    /// Start marks delivered.
    pub starts: u64,
    /// Stop marks delivered.
    pub stops: u64,
    /// Streams that ended without a stop mark.
    pub ended: u64,
    /// Records of an unknown kind, or marks naming no instance.
    pub skipped: u64,
    /// Seconds the replay took.
    pub duration_s: f64,
}

struct Heartbeat {
    stop: Arc<AtomicBool>,
    join: std::thread::JoinHandle<()>,
}

/// Delivers a stream to a coordinator over HTTP.
pub struct CoordinatorTarget {
    agent: ureq::Agent,
    base: String,
    interval: Duration,
    registered: HashSet<String>,
    beats: HashMap<String, Heartbeat>,
}

impl CoordinatorTarget {
    /// A target at `base`, heartbeating every `interval` (zero: none).
    pub fn new(base: &str, interval: Duration) -> Self {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(30)))
            .http_status_as_error(false)
            .build()
            .into();
        Self {
            agent,
            base: base.trim_end_matches('/').to_owned(),
            interval,
            registered: HashSet::new(),
            beats: HashMap::new(),
        }
    }

    fn check(what: &str, r: &mut ureq::http::Response<ureq::Body>) -> anyhow::Result<()> {
        if r.status().is_success() {
            return Ok(());
        }
        let text = r.body_mut().read_to_string().unwrap_or_default();
        bail!("{what}: HTTP {}: {}", r.status().as_u16(), text.trim())
    }

    fn start(&mut self, args: &Value) -> anyhow::Result<bool> {
        let id = codec_str(args, "instance_id");
        let port = args_u64(args, "http_port");
        if port == 0 || port > 65535 {
            tracing::warn!(instance = %id, "the start mark recorded no HTTP port; not registering it");
            return Ok(false);
        }
        let ip = codec_str(args, "ip");
        let body = RegisterRequest {
            instance_id: id.clone(),
            ip: if ip.is_empty() { "127.0.0.1".into() } else { ip },
            http_port: port as u32,
            metadata: Default::default(),
            p2p_advertised_url: String::new(),
            mq_port: args_u64(args, "mq_port") as u32,
        };
        let mut r = self
            .agent
            .post(&format!("{}/instances", self.base))
            .send_json(&body)
            .with_context(|| format!("registering {id}"))?;
        Self::check(&format!("registering {id}"), &mut r)?;
        let reg: RegisterResponse = r.body_mut().read_json().context("registration reply")?;
        self.registered.insert(reg.instance_id.clone());
        if !self.interval.is_zero() && !self.beats.contains_key(&id) {
            let stop = Arc::new(AtomicBool::new(false));
            let (agent, url, every, flag) = (
                self.agent.clone(),
                format!("{}/instances/{id}/heartbeat", self.base),
                self.interval,
                Arc::clone(&stop),
            );
            let join = std::thread::Builder::new().name("replay-heartbeat".into()).spawn(move || {
                let mut next = Instant::now() + every;
                while !flag.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(50));
                    if Instant::now() < next {
                        continue;
                    }
                    next = Instant::now() + every;
                    match agent.put(&url).send_empty() {
                        Ok(r) if r.status() == 404 => {
                            tracing::warn!(url = %url, "the coordinator no longer knows this server; heartbeats end");
                            return;
                        }
                        Ok(_) => {}
                        Err(e) => tracing::warn!(error = %e, "replayed heartbeat failed"),
                    }
                }
            })?;
            self.beats.insert(id, Heartbeat { stop, join });
        }
        Ok(true)
    }

    fn stop_beat(&mut self, id: &str) {
        if let Some(h) = self.beats.remove(id) {
            h.stop.store(true, Ordering::Release);
            let _ = h.join.join();
        }
    }

    fn stop(&mut self, id: &str) -> anyhow::Result<()> {
        self.stop_beat(id);
        if !self.registered.remove(id) {
            return Ok(());
        }
        let mut r = self
            .agent
            .delete(&format!("{}/instances/{id}", self.base))
            .call()
            .with_context(|| format!("deregistering {id}"))?;
        Self::check(&format!("deregistering {id}"), &mut r)
    }

    fn batch(&mut self, args: &Value) -> anyhow::Result<CacheEventsResponse> {
        let body = serde_json::json!({ "batches": [codec::to_json(args)] });
        let mut r = self
            .agent
            .post(&format!("{}/events", self.base))
            .send_json(&body)
            .context("POST /events")?;
        Self::check("POST /events", &mut r)?;
        r.body_mut().read_json().context("POST /events reply")
    }
}

impl Drop for CoordinatorTarget {
    fn drop(&mut self) {
        let ids: Vec<String> = self.beats.keys().cloned().collect();
        for id in ids {
            self.stop_beat(&id);
        }
    }
}

fn codec_str(args: &Value, name: &str) -> String {
    lmcache_workload::trace::format::map_get(args, name)
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned()
}

fn args_u64(args: &Value, name: &str) -> u64 {
    lmcache_workload::trace::format::map_get(args, name).and_then(Value::as_u64).unwrap_or(0)
}

/// Delivers `trace` to `target`, pacing by `speed` (0: unpaced); `progress` hears each record.
pub fn replay(
    trace: &EventsTrace,
    target: &mut CoordinatorTarget,
    speed: f64,
    mut progress: impl FnMut(usize, usize),
) -> anyhow::Result<EventsReplayResult> {
    if !(speed.is_finite() && speed >= 0.0) {
        bail!("--speed must be a number >= 0, got {speed}");
    }
    let started = Instant::now();
    let origin = trace.records.first().map_or(0.0, |r| r.t_wall);
    let mut last: HashMap<String, usize> = HashMap::new();
    for (i, r) in trace.records.iter().enumerate() {
        if let Some(id) = instance_of(r) {
            last.insert(id, i);
        }
    }
    let mut out = EventsReplayResult::default();
    let total = trace.records.len();
    for (i, r) in trace.records.iter().enumerate() {
        if speed > 0.0 {
            let due = started + Duration::from_secs_f64(((r.t_wall - origin) / speed).max(0.0));
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
        }
        out.records += 1;
        let id = instance_of(r);
        let mut is_stop = false;
        match r.qualname.as_str() {
            EVENTS_BATCH => {
                let got = target.batch(&r.args)?;
                out.batches += 1;
                out.applied += got.applied;
                out.duplicates += got.duplicates;
                out.stale += got.stale;
            }
            EVENTS_LIFECYCLE => match (codec_str(&r.args, "phase").as_str(), &id) {
                (_, None) => {
                    out.skipped += 1;
                    tracing::warn!("skipping a lifecycle mark naming no instance");
                }
                ("start", Some(_)) => {
                    target.start(&r.args)?;
                    out.starts += 1;
                }
                ("stop", Some(id)) => {
                    target.stop(id)?;
                    out.stops += 1;
                    is_stop = true;
                }
                (other, Some(_)) => {
                    out.skipped += 1;
                    tracing::warn!(phase = other, "skipping an unknown lifecycle phase");
                }
            },
            other => {
                out.skipped += 1;
                tracing::warn!(qualname = other, "skipping an unknown record");
            }
        }
        if let Some(id) = &id
            && last.get(id) == Some(&i)
            && !is_stop
        {
            target.stop_beat(id);
            out.ended += 1;
        }
        progress(i + 1, total);
    }
    out.duration_s = started.elapsed().as_secs_f64();
    Ok(out)
}
