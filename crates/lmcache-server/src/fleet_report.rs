//! Reporting to a fleet coordinator (LMCache's `lmcache coordinator` or `lmcache-rs
//! coordinator`), as LMCache's MP server does with `--coordinator-url`:
//!
//! - **membership**: register (`POST /instances`), heartbeat every
//!   `--coordinator-heartbeat-interval`, re-register when the coordinator answers 404,
//!   deregister at shutdown;
//! - **capacity**: after every registration, one `config` batch per compartment (L1 `dram`,
//!   each L2 adapter by type, `shared` from the adapter's spec);
//! - **cache events** (with `--coordinator-event-reporting`): L1 commits and removals, L2
//!   writes, evictions and deletes, coalesced into batches of one (type, tier, backend) and
//!   sent every `--coordinator-event-flush-interval`. Store entries carry the chunk's tokens
//!   and position when the store path saw them (a bounded cache of 65,536 chunks, as
//!   LMCache's).
//!
//! Unlike LMCache's emitter, a failed `POST /events` loses nothing: the batches keep their
//! sequence numbers and are sent again (the coordinator drops what it already applied as
//! duplicates). Only past 65,536 queued entries are new events dropped, counted and logged,
//! which the coordinator then sees as a sequence gap.
//!
//! Listeners run under the L1 lock or on the L2 runtime: they only push onto a queue. All
//! HTTP happens on this module's own thread (`coordinator-report`).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lmcache_core::{ChunkHash, ObjectKey};
use lmcache_protocol::coordinator::{
    CacheEventBatch, CacheEventEntry, CacheEventType, CacheEventsRequest, EncodedObjectKey,
    RegisterRequest, RegisterResponse, WireTier,
};
use parking_lot::{Condvar, Mutex};

/// Entries queued at most; past it new events are dropped and counted.
const MAX_QUEUED: usize = 65_536;
/// Chunks whose tokens are remembered for stamping store entries.
const TOKEN_CACHE: usize = 65_536;
/// Entries in one batch at most.
const MAX_BATCH: usize = 4096;

/// How to report (LMCache's `--coordinator-*` flags).
#[derive(Debug, Clone)]
pub struct CoordinatorReporting {
    /// `--coordinator-url`.
    pub url: String,
    /// `--instance-id` (empty: the coordinator assigns one).
    pub instance_id: String,
    /// `--coordinator-advertise-ip` (empty: the address the server reaches the coordinator from).
    pub advertise_ip: String,
    /// `--coordinator-heartbeat-interval` (5 s).
    pub heartbeat_interval: Duration,
    /// `--coordinator-event-reporting`.
    pub event_reporting: bool,
    /// `--coordinator-event-flush-interval` (1 s).
    pub flush_interval: Duration,
    /// How event batches travel (registration and heartbeats are always HTTP).
    pub transport: ReportTransport,
    /// `--coordinator-auth-token`: the coordinator's own bearer token, sent on registration,
    /// heartbeats, event batches and deregistration. Only a server that registers with it is
    /// sent this fleet's server token by the coordinator.
    pub auth_token: Option<String>,
    /// `--p2p-advertise-url`: the transfer-channel address registered for peers, which also
    /// turns on P2P discovery (the coordinator's instance list, polled each heartbeat).
    pub p2p_advertised_url: Option<String>,
}

/// `--coordinator-event-transport`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ReportTransport {
    /// `POST /events` to the coordinator.
    #[default]
    Http,
    /// One NATS JetStream message per batch on `lmcache.cache_events.<instance>`, in the
    /// binary layout (`lmcache_protocol::coordinator_binary`; a coordinator older than it
    /// skips them, so upgrade the coordinator first), each acknowledged by the stream before
    /// the flush forgets it.
    JetStream {
        /// `nats://host:port`.
        url: String,
        /// Stream name (created when missing).
        stream: String,
    },
}

/// Batches a flush publishes ahead of their acks.
const ACKS_IN_FLIGHT: usize = 256;

/// A connected JetStream publisher, on its own small runtime (the reporter's thread is not
/// async).
struct JetStreamSink {
    rt: tokio::runtime::Runtime,
    js: Option<async_nats::jetstream::Context>,
}

impl JetStreamSink {
    fn new() -> std::io::Result<Self> {
        Ok(Self {
            rt: tokio::runtime::Builder::new_current_thread().enable_all().build()?,
            js: None,
        })
    }

    /// Publishes every batch in order, each acknowledged; stops at the first failure.
    fn send(&mut self, url: &str, stream: &str, batches: &[CacheEventBatch]) -> Result<(), String> {
        let Self { rt, js } = self;
        rt.block_on(async {
            if js.is_none() {
                let client =
                    async_nats::connect(url).await.map_err(|e| format!("connect {url}: {e}"))?;
                let ctx = async_nats::jetstream::new(client);
                let config = async_nats::jetstream::stream::Config {
                    name: stream.to_string(),
                    subjects: vec![lmcache_protocol::coordinator::jetstream_subjects(stream)],
                    storage: async_nats::jetstream::stream::StorageType::File,
                    ..Default::default()
                };
                ctx.get_or_create_stream(config)
                    .await
                    .map_err(|e| format!("stream {stream}: {e}"))?;
                *js = Some(ctx);
            }
            let Some(ctx) = js.as_ref() else { return Err("not connected".to_string()) };
            // Up to ACKS_IN_FLIGHT published ahead of their acks (one connection keeps them in
            // order): a flush waits for about one round trip per window, not one per batch,
            // and never for more acks than the client lets be in flight (it stalls past that).
            let mut acks = std::collections::VecDeque::with_capacity(ACKS_IN_FLIGHT);
            for b in batches {
                if acks.len() == ACKS_IN_FLIGHT {
                    if let Some(ack) = acks.pop_front() {
                        let ack: async_nats::jetstream::context::PublishAckFuture = ack;
                        ack.await.map_err(|e| format!("publish ack: {e}"))?;
                    }
                }
                let payload = lmcache_protocol::coordinator_binary::encode(std::slice::from_ref(b))
                    .map_err(|e| e.to_string())?;
                let subject =
                    lmcache_protocol::coordinator::jetstream_subject(stream, &b.instance_id);
                acks.push_back(
                    ctx.publish(subject, payload.into())
                        .await
                        .map_err(|e| format!("publish: {e}"))?,
                );
            }
            for ack in acks {
                ack.await.map_err(|e| format!("publish ack: {e}"))?;
            }
            Ok(())
        })
        .inspect_err(|_| self.js = None)
    }
}

/// One compartment's declared capacity.
#[derive(Debug, Clone, PartialEq)]
pub struct Compartment {
    /// Tier.
    pub tier: WireTier,
    /// Backend (`dram`, or the adapter type).
    pub backend: String,
    /// Capacity in bytes (0: undeclared).
    pub capacity: u64,
    /// Whether a pool other servers mount.
    pub shared: bool,
}

#[derive(Debug)]
struct Queued {
    event_type: CacheEventType,
    tier: WireTier,
    backend: String,
    shared: bool,
    entries: Vec<CacheEventEntry>,
}

#[derive(Debug, Default)]
struct Queue {
    batches: VecDeque<Queued>,
    entries: usize,
}

#[derive(Debug, Default)]
struct TokenCache {
    map: HashMap<[u8; 32], (Vec<u32>, i64)>,
    order: VecDeque<[u8; 32]>,
}

/// Counters for /metrics.
#[derive(Debug, Default)]
pub struct ReportStats {
    /// Batches the coordinator accepted (applied or duplicate).
    pub batches_sent: AtomicU64,
    /// Entries in them.
    pub entries_sent: AtomicU64,
    /// Entries dropped because the queue was full.
    pub entries_dropped: AtomicU64,
    /// Failed calls to the coordinator (registration, heartbeat, events).
    pub failures: AtomicU64,
    /// Registrations (first and re-registrations).
    pub registrations: AtomicU64,
}

/// The reporter: listeners push into it; its thread talks to the coordinator.
#[derive(Debug)]
pub struct Reporter {
    cfg: CoordinatorReporting,
    http_port: std::sync::atomic::AtomicU32,
    incarnation: u64,
    l2: Mutex<HashMap<u64, (String, bool)>>,
    capacities: Mutex<Vec<Compartment>>,
    queue: Mutex<Queue>,
    tokens: Mutex<TokenCache>,
    wake: Condvar,
    stop: AtomicBool,
    /// Counters.
    pub stats: ReportStats,
    /// The id the coordinator knows this server by, once registered.
    pub registered_as: Mutex<Option<String>>,
    /// An events-level trace: every batch is recorded as it is sent (or, with no coordinator,
    /// as it would have been).
    trace: Mutex<Option<Arc<crate::trace_record::TraceRecorder>>>,
    /// The MP port peers call (registered as `mq_port`).
    mq_port: std::sync::atomic::AtomicU32,
    /// P2P discovery, with `--p2p-advertise-url`.
    peers: Option<Arc<crate::p2p_peers::Peers>>,
    /// Whether the P2P channel is lmcache-rs's native one (registered in the metadata) or
    /// NIXL (registered as LMCache's servers do: no metadata).
    p2p_native: AtomicBool,
    /// The L1 pool's segment and identity, registered for same-host peers (native channel).
    p2p_shm: Mutex<Option<(String, String)>>,
    /// A P2P discovery poll asked for before the next heartbeat (a NIXL handshake from a host
    /// not yet known).
    poll_peers: AtomicBool,
}

fn encoded(k: &ObjectKey) -> EncodedObjectKey {
    EncodedObjectKey {
        chunk_hash_hex: k.chunk_hash.to_hex(),
        model_name: k.model_name.as_str().to_owned(),
        kv_rank: k.kv_rank.packed(),
        object_group_id: k.object_group_id,
        cache_salt: k.cache_salt.as_str().to_owned(),
    }
}

impl Reporter {
    /// A reporter; [`Reporter::start`] begins reporting.
    pub fn new(cfg: CoordinatorReporting) -> Arc<Self> {
        // Milliseconds (LMCache uses seconds): a restart within the same second still gets a
        // higher incarnation, so the coordinator fences the old one instead of dropping the
        // new stream's first batches as duplicates.
        let incarnation =
            SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let peers =
            cfg.p2p_advertised_url.clone().map(|u| Arc::new(crate::p2p_peers::Peers::new(u)));
        Arc::new(Self {
            cfg,
            mq_port: std::sync::atomic::AtomicU32::new(0),
            peers,
            http_port: std::sync::atomic::AtomicU32::new(0),
            incarnation,
            l2: Mutex::default(),
            capacities: Mutex::default(),
            queue: Mutex::default(),
            tokens: Mutex::default(),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            stats: ReportStats::default(),
            registered_as: Mutex::new(None),
            trace: Mutex::new(None),
            p2p_native: AtomicBool::new(true),
            poll_peers: AtomicBool::new(false),
            p2p_shm: Mutex::new(None),
        })
    }

    /// Registers the P2P channel as NIXL (LMCache's default) rather than the native one.
    pub fn set_p2p_nixl(&self) {
        self.p2p_native.store(false, Ordering::Relaxed);
    }

    /// The instance id this server registers as.
    pub fn instance_id(&self) -> &str {
        &self.cfg.instance_id
    }

    /// A reporter that only records the stream to an events-level trace (no coordinator):
    /// LMCache records what it would have reported the same way.
    pub fn trace_only(
        instance_id: String,
        advertise_ip: String,
        flush_interval: Duration,
        trace: Arc<crate::trace_record::TraceRecorder>,
    ) -> Arc<Self> {
        let me = Self::new(CoordinatorReporting {
            url: String::new(),
            instance_id,
            advertise_ip,
            heartbeat_interval: Duration::from_secs(5),
            event_reporting: true,
            flush_interval,
            transport: ReportTransport::Http,
            auth_token: None,
            p2p_advertised_url: None,
        });
        me.set_trace(trace);
        me
    }

    /// Records every batch to `trace` from now on.
    pub fn set_trace(&self, trace: Arc<crate::trace_record::TraceRecorder>) {
        *self.trace.lock() = Some(trace);
    }

    fn traced(&self, batches: &[CacheEventBatch]) {
        let Some(t) = self.trace.lock().clone() else { return };
        for b in batches {
            match serde_json::to_value(b) {
                Ok(j) => t.record(
                    lmcache_workload::trace::codec::EVENTS_BATCH,
                    lmcache_workload::trace::codec::from_json(&j),
                ),
                Err(e) => tracing::warn!(error = %e, "events trace: batch not encodable"),
            }
        }
    }

    fn lifecycle(&self, start: bool, instance_id: &str) {
        let Some(t) = self.trace.lock().clone() else { return };
        use rmpv::Value;
        let mut args = vec![
            ("phase", Value::from(if start { "start" } else { "stop" })),
            ("instance_id", Value::from(instance_id)),
        ];
        if start {
            let port = self.http_port.load(Ordering::Relaxed);
            args.push(("incarnation", Value::from(self.incarnation)));
            args.push(("ip", Value::from(self.cfg.advertise_ip.as_str())));
            args.push(("http_port", Value::from(port)));
            args.push(("mq_port", Value::from(0)));
        }
        t.record(
            lmcache_workload::trace::codec::EVENTS_LIFECYCLE,
            lmcache_workload::trace::codec::args(args),
        );
    }

    /// Sets the compartments to declare and the L2 adapters' (type, shared) by id.
    pub fn set_topology(&self, capacities: Vec<Compartment>, l2: HashMap<u64, (String, bool)>) {
        *self.capacities.lock() = capacities;
        *self.l2.lock() = l2;
    }

    /// The L2 adapters' (type, shared) by id, as events name them.
    pub fn l2_topology(&self) -> HashMap<u64, (String, bool)> {
        self.l2.lock().clone()
    }

    /// This process's incarnation (start time, milliseconds).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    fn push(
        &self,
        event_type: CacheEventType,
        tier: WireTier,
        backend: &str,
        shared: bool,
        entries: impl Iterator<Item = CacheEventEntry>,
    ) {
        if !self.cfg.event_reporting {
            return;
        }
        let mut q = self.queue.lock();
        for e in entries {
            if q.entries >= MAX_QUEUED {
                self.stats.entries_dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let same = q.batches.back().is_some_and(|b| {
                b.event_type == event_type
                    && b.tier == tier
                    && b.shared == shared
                    && b.backend == backend
                    && b.entries.len() < MAX_BATCH
            });
            if !same {
                q.batches.push_back(Queued {
                    event_type,
                    tier,
                    backend: backend.to_owned(),
                    shared,
                    entries: Vec::new(),
                });
            }
            if let Some(b) = q.batches.back_mut() {
                b.entries.push(e);
                q.entries += 1;
            }
        }
    }

    fn entry(k: &ObjectKey, size: u64) -> CacheEventEntry {
        CacheEventEntry {
            key: encoded(k),
            size_bytes: size,
            token_ids: Vec::new(),
            token_offset: -1,
        }
    }

    /// L1 committed `key`.
    pub fn l1_stored(&self, key: &ObjectKey, bytes: u64) {
        self.push(
            CacheEventType::Store,
            WireTier::L1,
            "dram",
            false,
            std::iter::once(Self::entry(key, bytes)),
        );
    }

    /// A request that used `keys` ended (LMCache's L1 `touch_keys`: an `access` batch, tier
    /// l1, no backend, no sizes; the coordinator updates recency and counts, no placement).
    pub fn l1_accessed(&self, keys: &[ObjectKey]) {
        self.push(
            CacheEventType::Access,
            WireTier::L1,
            "",
            false,
            keys.iter().map(|k| Self::entry(k, 0)),
        );
    }

    /// `key` left L1.
    pub fn l1_removed(&self, key: &ObjectKey) {
        self.push(
            CacheEventType::Delete,
            WireTier::L1,
            "dram",
            false,
            std::iter::once(Self::entry(key, 0)),
        );
    }

    fn adapter(&self, id: u64) -> (String, bool) {
        self.l2.lock().get(&id).cloned().unwrap_or_else(|| (format!("l2-{id}"), false))
    }

    /// An L2 adapter now holds `keys`.
    pub fn l2_stored(&self, adapter: u64, keys: &[(ObjectKey, u64)]) {
        let (kind, shared) = self.adapter(adapter);
        self.push(
            CacheEventType::Store,
            WireTier::L2,
            &kind,
            shared,
            keys.iter().map(|(k, n)| Self::entry(k, *n)),
        );
    }

    /// `keys` left an L2 adapter.
    pub fn l2_removed(&self, adapter: u64, keys: &[ObjectKey]) {
        let (kind, shared) = self.adapter(adapter);
        self.push(
            CacheEventType::Delete,
            WireTier::L2,
            &kind,
            shared,
            keys.iter().map(|k| Self::entry(k, 0)),
        );
    }

    /// The store path saw chunk `hash`'s tokens, starting at token `offset` of its sequence.
    pub fn bind_tokens(&self, hash: &ChunkHash, tokens: &[u32], offset: usize) {
        if !self.cfg.event_reporting {
            return;
        }
        let mut t = self.tokens.lock();
        if t.map.insert(hash.0, (tokens.to_vec(), offset as i64)).is_none() {
            t.order.push_back(hash.0);
            while t.order.len() > TOKEN_CACHE {
                if let Some(old) = t.order.pop_front() {
                    t.map.remove(&old);
                }
            }
        }
    }

    /// P2P discovery's peer table, when `--p2p-advertise-url` is set.
    pub fn peers(&self) -> Option<&Arc<crate::p2p_peers::Peers>> {
        self.peers.as_ref()
    }

    /// Starts the reporting thread, registering the HTTP API at `http_port` and the MP server
    /// at `mq_port`.
    pub fn start(
        self: &Arc<Self>,
        http_port: u16,
        mq_port: u16,
    ) -> std::io::Result<JoinHandle<()>> {
        self.http_port.store(u32::from(http_port), Ordering::Relaxed);
        self.mq_port.store(u32::from(mq_port), Ordering::Relaxed);
        let me = Arc::clone(self);
        std::thread::Builder::new().name("coordinator-report".into()).spawn(move || me.run())
    }

    /// Registers the L1 pool's segment `(name, identity)` for same-host peers (before
    /// [`Self::start`]).
    pub fn set_p2p_shm(&self, shm: (String, String)) {
        *self.p2p_shm.lock() = Some(shm);
    }

    /// Asks for a P2P discovery poll now rather than at the next heartbeat.
    pub fn poll_peers_now(&self) {
        self.poll_peers.store(true, Ordering::Release);
        let _g = self.queue.lock();
        self.wake.notify_all();
    }

    /// Asks the thread to flush, deregister and exit.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let _g = self.queue.lock();
        self.wake.notify_all();
    }

    /// `r` with the coordinator's bearer token, when one is configured.
    fn authed<B>(&self, r: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.cfg.auth_token {
            Some(t) => r.header("Authorization", format!("Bearer {t}")),
            None => r,
        }
    }

    fn run(&self) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(2)))
            .http_status_as_error(false)
            .build()
            .into();
        let base = self.cfg.url.trim_end_matches('/').to_owned();
        // No coordinator: the stream is only recorded, under the configured id.
        let trace_only = base.is_empty();
        let mut id: Option<String> = None;
        let mut revision = 0u64;
        let mut next_seq = 1u64;
        let mut inflight: Vec<CacheEventBatch> = Vec::new();
        self.lifecycle(true, &self.cfg.instance_id);
        if trace_only {
            id = Some(self.cfg.instance_id.clone());
            revision = 1;
            let decl = self.declarations(&self.cfg.instance_id, revision, &mut next_seq);
            self.traced(&decl);
        }
        let mut next_beat = Instant::now();
        let mut next_flush = Instant::now() + self.cfg.flush_interval;
        let mut sink = match &self.cfg.transport {
            ReportTransport::Http => None,
            ReportTransport::JetStream { .. } => match JetStreamSink::new() {
                Ok(s) => Some(s),
                Err(e) => {
                    self.failed(
                        "event report",
                        &format!("cannot start the JetStream runtime: {e}"),
                    );
                    None
                }
            },
        };
        loop {
            let stopping = self.stop.load(Ordering::Acquire);
            let now = Instant::now();
            if now >= next_beat && !stopping && !trace_only {
                next_beat = now + self.cfg.heartbeat_interval;
                match &id {
                    None => {
                        if let Some(new) = self.register(&agent, &base) {
                            *self.registered_as.lock() = Some(new.clone());
                            id = Some(new.clone());
                            revision += 1;
                            let decl = self.declarations(&new, revision, &mut next_seq);
                            self.traced(&decl);
                            inflight.extend(decl);
                        }
                    }
                    Some(cur) => match self
                        .authed(agent.put(&format!("{base}/instances/{cur}/heartbeat")))
                        .send_empty()
                    {
                        Ok(r) if r.status() == 404 => {
                            tracing::info!(instance = %cur, "the coordinator no longer knows this server; re-registering");
                            id = None;
                            next_beat = now;
                        }
                        Ok(r) if r.status().is_success() => {}
                        Ok(r) => self.failed("heartbeat", &format!("HTTP {}", r.status().as_u16())),
                        Err(e) => self.failed("heartbeat", &e.to_string()),
                    },
                }
                if let Some(peers) = &self.peers {
                    self.poll_peers.store(false, Ordering::Release);
                    self.discover(&agent, &base, id.as_deref(), peers);
                }
            } else if let (Some(peers), false) = (&self.peers, stopping || trace_only) {
                if self.poll_peers.swap(false, Ordering::AcqRel) {
                    self.discover(&agent, &base, id.as_deref(), peers);
                }
            }
            if let (Some(cur), true) = (&id, now >= next_flush || stopping) {
                next_flush = now + self.cfg.flush_interval;
                let before = inflight.len();
                self.take_batches(cur, &mut next_seq, &mut inflight);
                self.traced(&inflight[before..]);
                if trace_only
                    || (!inflight.is_empty()
                        && self.deliver(&agent, &base, sink.as_mut(), &inflight))
                {
                    inflight.clear();
                }
            }
            if stopping {
                self.lifecycle(false, &self.cfg.instance_id);
                if trace_only {
                    return;
                }
                if let Some(cur) = id {
                    match self.authed(agent.delete(&format!("{base}/instances/{cur}"))).call() {
                        Ok(_) => {
                            tracing::info!(instance = %cur, "deregistered from the coordinator")
                        }
                        Err(e) => self.failed("deregistration", &e.to_string()),
                    }
                }
                return;
            }
            let wait = next_beat
                .min(next_flush)
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(5));
            let mut q = self.queue.lock();
            if !self.stop.load(Ordering::Acquire) && !self.poll_peers.load(Ordering::Acquire) {
                self.wake.wait_for(&mut q, wait);
            }
        }
    }

    /// One P2P discovery poll: the coordinator's instance list.
    fn discover(
        &self,
        agent: &ureq::Agent,
        base: &str,
        me: Option<&str>,
        peers: &crate::p2p_peers::Peers,
    ) {
        #[derive(serde::Deserialize)]
        struct List {
            instances: Vec<lmcache_protocol::coordinator::InstanceInfo>,
        }
        match agent.get(&format!("{base}/instances")).call() {
            Ok(mut r) if r.status().is_success() => match r.body_mut().read_json::<List>() {
                Ok(list) => peers.apply(me, &list.instances),
                Err(e) => {
                    self.failed("P2P discovery", &format!("bad instance list: {e}"));
                    peers.poll_failed(false);
                }
            },
            Ok(r) => {
                self.failed("P2P discovery", &format!("HTTP {}", r.status().as_u16()));
                peers.poll_failed(false);
            }
            Err(e) => {
                let timed_out = matches!(e, ureq::Error::Timeout(_));
                self.failed("P2P discovery", &e.to_string());
                peers.poll_failed(timed_out);
            }
        }
    }

    fn failed(&self, what: &str, why: &str) {
        self.stats.failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(coordinator = %self.cfg.url, "coordinator {what} failed: {why}");
    }

    fn register(&self, agent: &ureq::Agent, base: &str) -> Option<String> {
        let ip = if self.cfg.advertise_ip.is_empty() {
            outbound_ip(base)
        } else {
            self.cfg.advertise_ip.clone()
        };
        let body = RegisterRequest {
            instance_id: self.cfg.instance_id.clone(),
            ip,
            http_port: self.http_port.load(Ordering::Relaxed),
            metadata: match self.peers {
                Some(_) if self.p2p_native.load(Ordering::Relaxed) => {
                    let mut m: std::collections::BTreeMap<String, String> = [(
                        crate::p2p_reader::CHANNEL_KEY.to_owned(),
                        crate::p2p_reader::NATIVE_CHANNEL.to_owned(),
                    )]
                    .into();
                    if let Some((name, id)) = self.p2p_shm.lock().clone() {
                        m.insert(crate::p2p_same_host::SHM_KEY.to_owned(), name);
                        m.insert(crate::p2p_same_host::SHM_ID_KEY.to_owned(), id);
                    }
                    m
                }
                _ => Default::default(),
            },
            p2p_advertised_url: self.cfg.p2p_advertised_url.clone().unwrap_or_default(),
            mq_port: if self.peers.is_some() { self.mq_port.load(Ordering::Relaxed) } else { 0 },
        };
        match self.authed(agent.post(&format!("{base}/instances"))).send_json(&body) {
            Ok(mut r) if r.status().is_success() => {
                match r.body_mut().read_json::<RegisterResponse>() {
                    Ok(reg) => {
                        self.stats.registrations.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(instance = %reg.instance_id, coordinator = %base, "registered with the coordinator");
                        Some(reg.instance_id)
                    }
                    Err(e) => {
                        self.failed("registration", &format!("bad reply: {e}"));
                        None
                    }
                }
            }
            Ok(mut r) => {
                let text = r.body_mut().read_to_string().unwrap_or_default();
                self.failed("registration", &format!("HTTP {}: {text}", r.status().as_u16()));
                None
            }
            Err(e) => {
                self.failed("registration", &e.to_string());
                None
            }
        }
    }

    fn declarations(&self, id: &str, revision: u64, next_seq: &mut u64) -> Vec<CacheEventBatch> {
        if !self.cfg.event_reporting {
            return Vec::new();
        }
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        self.capacities
            .lock()
            .iter()
            .map(|c| {
                let seq = *next_seq;
                *next_seq += 1;
                CacheEventBatch {
                    instance_id: id.to_owned(),
                    incarnation: self.incarnation,
                    seq,
                    event_type: CacheEventType::Config,
                    tier: c.tier,
                    backend: c.backend.clone(),
                    entries: Vec::new(),
                    shared: c.shared,
                    ts,
                    capacity_bytes: c.capacity,
                    capacity_revision: revision,
                }
            })
            .collect()
    }

    fn take_batches(&self, id: &str, next_seq: &mut u64, out: &mut Vec<CacheEventBatch>) {
        let drained: Vec<Queued> = {
            let mut q = self.queue.lock();
            q.entries = 0;
            q.batches.drain(..).collect()
        };
        if drained.is_empty() {
            return;
        }
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let tokens = self.tokens.lock();
        for mut b in drained {
            if b.event_type == CacheEventType::Store {
                for e in &mut b.entries {
                    if let Ok(h) = e.key.chunk_hash()
                        && let Some((t, off)) = tokens.map.get(&h)
                    {
                        e.token_ids.clone_from(t);
                        e.token_offset = *off;
                    }
                }
            }
            let seq = *next_seq;
            *next_seq += 1;
            out.push(CacheEventBatch {
                instance_id: id.to_owned(),
                incarnation: self.incarnation,
                seq,
                event_type: b.event_type,
                tier: b.tier,
                backend: b.backend,
                entries: b.entries,
                shared: b.shared,
                ts,
                capacity_bytes: 0,
                capacity_revision: 0,
            });
        }
    }

    /// Sends `batches` over the configured transport; true when they need not be sent again.
    fn deliver(
        &self,
        agent: &ureq::Agent,
        base: &str,
        sink: Option<&mut JetStreamSink>,
        batches: &[CacheEventBatch],
    ) -> bool {
        match (&self.cfg.transport, sink) {
            (ReportTransport::JetStream { url, stream }, Some(sink)) => {
                match sink.send(url, stream, batches) {
                    Ok(()) => {
                        self.stats.batches_sent.fetch_add(batches.len() as u64, Ordering::Relaxed);
                        let n: usize = batches.iter().map(|b| b.entries.len()).sum();
                        self.stats.entries_sent.fetch_add(n as u64, Ordering::Relaxed);
                        true
                    }
                    Err(why) => {
                        // Batches already acknowledged are sent again with the rest: the
                        // coordinator drops them as duplicates by seq.
                        self.failed("event publish", &why);
                        false
                    }
                }
            }
            (ReportTransport::JetStream { .. }, None) => false,
            (ReportTransport::Http, _) => self.send(agent, base, batches),
        }
    }

    fn send(&self, agent: &ureq::Agent, base: &str, batches: &[CacheEventBatch]) -> bool {
        let body = CacheEventsRequest { batches: batches.to_vec() };
        match self.authed(agent.post(&format!("{base}/events"))).send_json(&body) {
            Ok(r) if r.status().is_success() => {
                self.stats.batches_sent.fetch_add(batches.len() as u64, Ordering::Relaxed);
                let n: usize = batches.iter().map(|b| b.entries.len()).sum();
                self.stats.entries_sent.fetch_add(n as u64, Ordering::Relaxed);
                true
            }
            Ok(mut r) => {
                let status = r.status().as_u16();
                let text = r.body_mut().read_to_string().unwrap_or_default();
                self.failed("event report", &format!("HTTP {status}: {text}"));
                // A refused body will be refused again: drop it rather than block the stream.
                (400..500).contains(&status)
            }
            Err(e) => {
                self.failed("event report", &e.to_string());
                false
            }
        }
    }
}

/// The local address this host reaches `base` from (what LMCache's `get_ip` finds), or
/// 127.0.0.1.
fn outbound_ip(base: &str) -> String {
    let host = base.split("://").nth(1).unwrap_or(base).split('/').next().unwrap_or("");
    std::net::UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| {
            let target = if host.contains(':') { host.to_owned() } else { format!("{host}:80") };
            s.connect(target)?;
            s.local_addr()
        })
        .map_or_else(|_| "127.0.0.1".to_owned(), |a| a.ip().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reporter(events: bool) -> Arc<Reporter> {
        Reporter::new(CoordinatorReporting {
            url: "http://127.0.0.1:1".into(),
            instance_id: "me".into(),
            advertise_ip: "127.0.0.1".into(),
            heartbeat_interval: Duration::from_secs(5),
            event_reporting: events,
            flush_interval: Duration::from_secs(1),
            transport: ReportTransport::Http,
            auth_token: None,
            p2p_advertised_url: None,
        })
    }

    fn key(b: u8) -> ObjectKey {
        ObjectKey::new([b; 32], "m", 1, 0, 0, "").unwrap()
    }

    /// A flush of more batches than the NATS client lets wait for acks (5,000) is published
    /// whole and in order: publishing everything before awaiting any ack stalled there for
    /// good. Needs nats-server (`LMCACHE_RS_TEST_NATS`; scripts/test starts one).
    #[test]
    fn a_flush_past_the_clients_ack_limit_is_published_in_order() {
        let url = match std::env::var("LMCACHE_RS_TEST_NATS") {
            Ok(u) if !u.is_empty() => u,
            _ if std::env::var("LMCACHE_RS_REQUIRE_SERVICES").is_ok_and(|v| v == "1") => {
                panic!("LMCACHE_RS_TEST_NATS is not set, but LMCACHE_RS_REQUIRE_SERVICES=1")
            }
            _ => {
                eprintln!("LMCACHE_RS_TEST_NATS not set: skipping (scripts/test sets it)");
                return;
            }
        };
        let stream = format!("LMCACHE_RS_TEST_SINK_{}", std::process::id());
        let batches: Vec<CacheEventBatch> = (1..=5_100u64)
            .map(|seq| CacheEventBatch {
                instance_id: "sink".into(),
                incarnation: 1,
                seq,
                event_type: CacheEventType::Store,
                tier: WireTier::L1,
                backend: "dram".into(),
                entries: vec![Reporter::entry(&key((seq % 251) as u8), seq)],
                shared: false,
                ts: 1.0,
                capacity_bytes: 0,
                capacity_revision: 0,
            })
            .collect();
        let (tx, rx) = std::sync::mpsc::channel();
        let (u, s) = (url.clone(), stream.clone());
        std::thread::spawn(move || {
            let mut sink = JetStreamSink::new().unwrap();
            let _ = tx.send(sink.send(&u, &s, &batches));
        });
        let sent = rx.recv_timeout(Duration::from_secs(120)).expect("the flush never finished");
        assert_eq!(sent, Ok(()));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let js = async_nats::jetstream::new(async_nats::connect(&url).await.unwrap());
            let mut st = js.get_stream(&stream).await.unwrap();
            assert_eq!(st.info().await.unwrap().state.messages, 5_100);
            let last = st.get_raw_message(5_100).await.unwrap();
            let b = lmcache_protocol::coordinator_binary::decode(&last.payload).unwrap();
            assert_eq!(b[0].seq, 5_100, "in order");
            js.delete_stream(&stream).await.unwrap();
        });
    }

    #[test]
    fn events_coalesce_per_kind_and_carry_the_tokens_seen() {
        let r = reporter(true);
        r.l1_stored(&key(1), 10);
        r.l1_stored(&key(2), 10);
        r.l1_removed(&key(1));
        r.l1_stored(&key(3), 10);
        r.bind_tokens(&ChunkHash([2; 32]), &[5, 6], 256);
        let mut seq = 1;
        let mut out = Vec::new();
        r.take_batches("me", &mut seq, &mut out);
        let kinds: Vec<(CacheEventType, usize)> =
            out.iter().map(|b| (b.event_type, b.entries.len())).collect();
        assert_eq!(
            kinds,
            vec![
                (CacheEventType::Store, 2),
                (CacheEventType::Delete, 1),
                (CacheEventType::Store, 1)
            ]
        );
        assert_eq!(out.iter().map(|b| b.seq).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(out[0].entries[1].token_ids, vec![5, 6]);
        assert_eq!(out[0].entries[1].token_offset, 256);
        assert_eq!(out[0].entries[0].token_offset, -1);
        assert!(out.iter().all(|b| b.validate().is_ok()), "every batch passes LMCache's checks");
    }

    #[test]
    fn accesses_are_reported_as_lmcache_reports_touched_keys() {
        let r = reporter(true);
        r.l1_accessed(&[key(1), key(2)]);
        r.l1_stored(&key(3), 10);
        let (mut seq, mut out) = (1, Vec::new());
        r.take_batches("me", &mut seq, &mut out);
        assert_eq!(out[0].event_type, CacheEventType::Access);
        assert_eq!((out[0].entries.len(), out[0].backend.as_str()), (2, ""));
        assert_eq!(out[0].entries[0].size_bytes, 0);
        assert_eq!(out[1].event_type, CacheEventType::Store);
        assert!(out.iter().all(|b| b.validate().is_ok()));
        // Reporting off: nothing queued.
        let off = reporter(false);
        off.l1_accessed(&[key(1)]);
        let mut none = Vec::new();
        off.take_batches("me", &mut seq, &mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn a_full_queue_drops_and_counts_and_reporting_off_queues_nothing() {
        let r = reporter(true);
        for i in 0..(MAX_QUEUED + 5) {
            r.l1_removed(&ObjectKey::new([(i % 251) as u8; 32], "m", 1, 0, 0, "").unwrap());
        }
        assert_eq!(r.stats.entries_dropped.load(Ordering::Relaxed), 5);
        let off = reporter(false);
        off.l1_stored(&key(1), 1);
        let mut out = Vec::new();
        off.take_batches("me", &mut 1, &mut out);
        assert!(out.is_empty());
    }
}
