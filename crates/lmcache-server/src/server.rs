//! Wiring: build the L1, bind ZMQ and HTTP, start the background threads; shut them down in
//! order (stop reading requests, answer those in flight, stop HTTP, stop reapers, release the
//! L1 and unlink its shared-memory segment).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lmcache_core::TokenHasher;
use lmcache_memory::ArenaBacking;
use lmcache_memory::shm::{SHM_DIR, clean_stale_segments};
use thiserror::Error;

use crate::config::ServerConfig;
use crate::kv_events::KvEventLog;
use crate::metrics::Metrics;
use crate::registry::Registry;
use crate::session::Sessions;
use crate::state::{Pending, RequestState, ServerState};
use crate::transport::{Transport, TransportError};

/// Why the server could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServerError {
    /// A setting is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// ZMQ failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// Storage could not be built (the arena, L1's settings, an L2 adapter: the message says
    /// which).
    #[error(transparent)]
    Storage(#[from] lmcache_storage::BuildError),
    /// HTTP bind or thread start failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServerError {
    let what = what.into();
    move |source| ServerError::Io { what, source }
}

/// A running server. Dropping it shuts it down.
#[derive(Debug)]
pub struct Server {
    state: Arc<ServerState>,
    stop: Arc<AtomicBool>,
    endpoint: String,
    http_addr: Option<SocketAddr>,
    transport: Option<JoinHandle<Result<(), TransportError>>>,
    http: Option<(tokio::sync::oneshot::Sender<()>, JoinHandle<()>)>,
    reaper: Option<(Sender<()>, JoinHandle<()>)>,
    p2p_channel: Option<P2pChannel>,
    peer_reader: Option<Arc<crate::p2p_reader::PeerReader>>,
    reporter: Option<JoinHandle<()>>,
    handover: Option<crate::handover::Offer>,
    handed_over: Vec<crate::handover::Role>,
}

impl Server {
    /// Builds everything and starts serving.
    pub fn start(config: ServerConfig) -> Result<Self, ServerError> {
        Self::start_with(config, crate::handover::Listeners::default())
    }

    /// As [`Self::start`], serving on the listening sockets a server taken over handed over
    /// (`--take-over`) where they are bound at the ports asked for. A server whose L1 file
    /// restarts warm offers its own sockets in turn ([`crate::handover`]).
    pub fn start_with(
        config: ServerConfig,
        inherited: crate::handover::Listeners,
    ) -> Result<Self, ServerError> {
        let started = Instant::now();
        let hasher = TokenHasher::new(config.chunk_size)
            .map_err(|e| ServerError::Config(format!("--chunk-size: {e}")))?;
        if !config.more_l1.is_empty()
            && matches!(config.p2p_engine, crate::config::P2pEngine::Nixl { .. })
        {
            // NIXL reads and writes the one registered arena by offset: an object in another
            // L1 would be read from, or written to, the wrong bytes.
            return Err(ServerError::Config(
                "--p2p-transfer-engine nixl needs one L1 (several are listed)".into(),
            ));
        }
        // Stale segments of crashed runs (ours by their owner marker, locked by nobody) go
        // first: also before a warm restart in /dev/shm, whose name a crashed cold run may
        // have left behind (a warm-restart file carries no marker and is never removed).
        let in_shm = match &config.arena.backing {
            ArenaBacking::SharedMemory { .. } => true,
            ArenaBacking::File(f) => f.path.parent() == Some(std::path::Path::new(SHM_DIR)),
            _ => false,
        };
        if in_shm {
            let removed = clean_stale_segments(std::path::Path::new(SHM_DIR));
            if !removed.is_empty() {
                tracing::info!(segments = ?removed, "removed stale L1 segments of crashed runs");
            }
        }
        let storage = lmcache_storage::Storage::build(&config.storage_config())?;
        // Registrations go with the L1: kept beside its restart anchor when it restarts warm
        // (and taken back below), forgotten when it starts cold. So do the tokens behind an
        // L1 file's chunks (what a restart announces); a slab-file L1's DRAM staging adopts
        // nothing, so it has no tokens to keep.
        let l1_file = matches!(config.arena.backing, ArenaBacking::File(_));
        let anchor = config.restart_anchor();
        let (registry, saved, tokens) = match &anchor {
            Some((anchor, true)) => {
                let (file, saved) = crate::registry_file::RegistryFile::open(anchor);
                let tokens =
                    l1_file.then(|| crate::chunk_tokens_file::ChunkTokensFile::open(anchor));
                (Registry::persisted(file), saved, tokens)
            }
            Some((anchor, false)) => {
                crate::registry_file::RegistryFile::remove_for(anchor);
                crate::chunk_tokens_file::ChunkTokensFile::remove_for(anchor);
                (Registry::default(), Vec::new(), None)
            }
            None => (Registry::default(), Vec::new(), None),
        };
        let handover_name = match &anchor {
            Some((anchor, true)) => Some(crate::handover::socket_name(anchor)),
            _ => None,
        };
        // Where the sockets handed over listen: a role was handed over when the server ends
        // up bound there (a socket not asked for is closed, and its port is not ours).
        let inherited_at = |l: &Option<std::net::TcpListener>| {
            l.as_ref().and_then(|l| l.local_addr().ok()).filter(|a| a.port() != 0)
        };
        let (transport_was, http_was) =
            (inherited_at(&inherited.transport), inherited_at(&inherited.http));
        let (transport, transport_socket) =
            Transport::bind_held(&config, inherited.transport, handover_name.is_some())?;
        let endpoint = transport.endpoint().to_owned();
        let bound_port: Option<u16> = endpoint.rsplit(':').next().and_then(|p| p.parse().ok());
        let events = Arc::new(KvEventLog::new(config.kv_event_log_size));
        #[cfg(feature = "testing")]
        let faults = crate::state::Faults::default();
        #[cfg_attr(not(feature = "testing"), expect(unused_mut))]
        let mut bus_subscribers = vec![crate::event_bus::log_subscriber()];
        #[cfg(feature = "testing")]
        {
            let heard = Arc::clone(&faults.bus_heard);
            bus_subscribers.push(Box::new(move |e: &crate::event_bus::Event| {
                heard.lock().push(e.clone());
            }));
        }
        let bus = crate::event_bus::EventBus::start(config.event_bus_queue_size, bus_subscribers)
            .map_err(io("starting the event bus"))?;
        let trace = match &config.trace {
            None => None,
            Some(c) => {
                let meta = match c.level {
                    lmcache_workload::trace::Level::Events => vec![
                        ("instance_id".to_owned(), rmpv::Value::from(config.instance_id.as_str())),
                        ("cache_event_schema_version".to_owned(), rmpv::Value::from(1)),
                        (
                            "lmcache_version".to_owned(),
                            rmpv::Value::from(concat!("lmcache-rs ", env!("CARGO_PKG_VERSION"))),
                        ),
                    ],
                    lmcache_workload::trace::Level::Storage => Vec::new(),
                };
                Some(Arc::new(
                    crate::trace_record::TraceRecorder::start(
                        c,
                        &storage_config_json(&config),
                        meta,
                    )
                    .map_err(io("opening the --trace-output file"))?,
                ))
            }
        };
        let events_trace =
            trace.clone().filter(|t| t.level() == lmcache_workload::trace::Level::Events);
        let reporter = match (&config.coordinator, config.http_port) {
            (None, _) => events_trace.clone().map(|t| {
                crate::fleet_report::Reporter::trace_only(
                    config.instance_id.clone(),
                    String::new(),
                    Duration::from_secs(1),
                    t,
                )
            }),
            (Some(_), None) => {
                return Err(ServerError::Config(
                    "--coordinator-url needs the HTTP server (the coordinator calls it): set --http-port".into(),
                ));
            }
            (Some(c), Some(_)) => {
                let r = crate::fleet_report::Reporter::new(c.clone());
                if let Some(t) = &events_trace {
                    r.set_trace(t.clone());
                }
                Some(r)
            }
        };
        let metrics = Arc::new(Metrics::default());
        let explain = Arc::new(crate::explain::Explainer::new(
            storage.l1().clone(),
            config.chunk_size,
            config.explain_requests,
            metrics.lookup_miss_chunks.clone(),
        ));
        for a in storage.describe_l2() {
            let policy = a.eviction.map_or_else(|| "LRU".to_owned(), |e| format!("{:?}", e.policy));
            explain.name_adapter(a.id, &a.kind, &policy);
        }
        storage.set_observers(
            Arc::new(crate::event_bus::TierEvents(
                bus.publisher(),
                reporter.clone(),
                Arc::clone(&explain),
            )),
            Arc::new(crate::event_bus::L1Events {
                kv: events.clone(),
                bus: bus.publisher(),
                reporter: reporter.clone(),
                explain: Arc::clone(&explain),
            }),
        );
        // A restarted L1 file: the coordinator and the bus learn what it holds again, and the
        // KV events and the coordinator's token index the chunks whose tokens were kept.
        storage.l1().announce_resident();
        let tokens = tokens.map(|(file, saved)| {
            announce_tokens(storage.l1(), &saved, &file, &events, reporter.as_ref());
            Arc::new(file)
        });
        let lookup_log = match &config.lookup_hash_log {
            None => None,
            Some(c) => Some(Arc::new(
                crate::lookup_log::LookupHashLog::start(c.clone())
                    .map_err(io("starting the lookup-hash log"))?,
            )),
        };
        // P2P over NIXL: the agent and the registered arena come first (the reader reads
        // into them, and peers may read the arena as soon as they hold our metadata).
        let nixl = match (&config.p2p_engine, config.p2p_channel, reporter.as_ref()) {
            (crate::config::P2pEngine::Nixl { library }, Some(_), Some(r)) => Some(
                crate::p2p_nixl::NixlChannel::start(
                    library,
                    storage.l1().clone(),
                    r.peers().map(|p| p.advertised().to_owned()).unwrap_or_default(),
                    r.instance_id(),
                )
                .map_err(|e| io("--p2p-transfer-engine nixl")(std::io::Error::other(e)))?,
            ),
            _ => None,
        };
        match (&nixl, reporter.as_ref()) {
            (Some(_), Some(r)) => r.set_p2p_nixl(),
            // Native: a same-host peer may read this server's pool directly.
            (None, Some(r)) => {
                if let Some(shm) = crate::p2p_same_host::advertised(storage.l1().memory()) {
                    r.set_p2p_shm(shm);
                }
            }
            _ => {}
        }
        // P2P: with --p2p-advertise-url, what L1 lacks is asked of the fleet's peers.
        let peer_reader = match reporter.as_ref().and_then(|r| r.peers()) {
            Some(peers) => {
                let channel = match &nixl {
                    Some(n) => crate::p2p_reader::Channel::Nixl(Arc::clone(n)),
                    None => crate::p2p_reader::Channel::Native(Arc::new(
                        crate::p2p_same_host::SameHost::new(config.p2p_same_host),
                    )),
                };
                let timeouts = crate::p2p_reader::ReaderTimeouts {
                    lookup: config.p2p_lookup_timeout,
                    load: config.p2p_load_timeout,
                };
                let reader = crate::p2p_reader::PeerReader::start(
                    (*storage).clone(),
                    Arc::clone(peers),
                    timeouts,
                    channel,
                )
                .map_err(io("starting the P2P readers"))?;
                storage.set_peer_source(reader.clone());
                Some(reader)
            }
            None => None,
        };
        let mut subs = subscribers(
            &config,
            &metrics,
            &bus,
            &events,
            reporter.as_ref(),
            trace.as_ref(),
            lookup_log.as_ref(),
        );
        if explain.enabled() {
            subs.push(Arc::new(crate::explain::ExplainSubscriber(Arc::clone(&explain))));
        }
        if let Some(t) = tokens {
            let l1 = storage.l1().clone();
            subs.push(Arc::new(crate::observers::ChunkTokensSubscriber { file: t, l1 }));
        }
        storage.subscribe(subs);
        let state = Arc::new(ServerState {
            requests: RequestState {
                storage,
                sessions: Sessions::new(hasher, config.session_ttl),
                hasher,
                registry,
                pending: Pending::default(),
                peers: Arc::default(),
                blend: blend_engine(&config, &metrics, &bus)?,
                config,
            },
            bus,
            channels: crate::state::SideChannels {
                kv_events: events,
                reporter,
                lookup_log,
                trace,
                explain,
            },
            http: crate::state::HttpJobs::default(),
            metrics,
            started,
            #[cfg(feature = "testing")]
            faults,
        });
        if !saved.is_empty() {
            let (taken, dropped) = crate::handlers::replay_registrations(&state, saved);
            tracing::info!(taken, dropped, "warm restart: the previous process's registrations");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut http = match state.config.http_port {
            None => None,
            Some(port) => {
                Some(start_http(Arc::clone(&state), port, inherited.http, handover_name.is_some())?)
            }
        };
        let http_addr = http.as_ref().map(|(addr, _, _, _)| *addr);
        let handover = match handover_name {
            None => None,
            Some(name) => {
                let mut sockets = Vec::new();
                if let Some(l) = transport_socket {
                    sockets.push((crate::handover::Role::Transport, l));
                }
                if let Some(l) = http.as_mut().and_then(|h| h.3.take()) {
                    sockets.push((crate::handover::Role::Http, l));
                }
                match crate::handover::Offer::start(&name, sockets) {
                    Ok(offer) => Some(offer),
                    Err(e) => {
                        tracing::warn!(error = %e, "no port handover for a later --take-over");
                        None
                    }
                }
            }
        };
        let http = http.map(|(_, tx, j, _)| (tx, j));
        let mut handed_over = Vec::new();
        if transport_was.is_some() && transport_was.map(|a| a.port()) == bound_port {
            handed_over.push(crate::handover::Role::Transport);
        }
        if http_was.is_some() && http_was == http_addr {
            handed_over.push(crate::handover::Role::Http);
        }
        let transport = {
            let (state, stop) = (Arc::clone(&state), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("mp-socket".into())
                .spawn(move || transport.serve(state, stop))
                .map_err(io("starting the socket thread"))?
        };
        let reaper = start_reaper(Arc::clone(&state))?;
        let p2p_channel = match (state.config.p2p_channel, &nixl) {
            (None, _) => None,
            (Some(addr), Some(nixl)) => {
                let gate = handshake_gate(&state).ok_or_else(|| {
                    io("--p2p-transfer-engine nixl")(std::io::Error::other("no P2P peer table"))
                })?;
                let refused = state.metrics.p2p_handshakes_refused.clone();
                let join = nixl
                    .serve(addr, Arc::clone(&stop), gate, refused)
                    .map_err(io("starting the NIXL P2P channel"))?;
                Some(P2pChannel::Nixl(addr, join))
            }
            (Some(addr), None) => {
                let listener = std::net::TcpListener::bind(addr)
                    .map_err(io("binding the P2P transfer channel"))?;
                let (l1, peers) = (state.l1().clone(), Arc::clone(&state.peers));
                let listening = crate::p2p_channel::Listening::start(
                    listener,
                    l1,
                    peers,
                    Duration::from_secs(30),
                )
                .map_err(io("starting the P2P transfer channel"))?;
                Some(P2pChannel::Native(listening))
            }
        };
        let reporter = match &state.channels.reporter {
            Some(r) => {
                r.set_topology(compartments(&state), l2_identities(&state));
                let port = http_addr.map_or(0, |a| a.port());
                let mq_port = endpoint.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0);
                Some(r.start(port, mq_port).map_err(io("starting the coordinator reporter"))?)
            }
            None => None,
        };
        tracing::info!(
            endpoint = %endpoint,
            http = ?http_addr,
            ready_ms = started.elapsed().as_millis() as u64,
            "lmcache-rs server ready"
        );
        Ok(Self {
            state,
            stop,
            endpoint,
            http_addr,
            transport: Some(transport),
            http,
            reaper: Some(reaper),
            p2p_channel,
            peer_reader,
            reporter,
            handover,
            handed_over,
        })
    }

    /// The ports this server took from the server it took over, still listening with
    /// whatever connections were queued on them (empty after a plain start).
    pub fn handed_over(&self) -> &[crate::handover::Role] {
        &self.handed_over
    }

    /// The bound ZMQ endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The bound HTTP address, if HTTP is on.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// Where the native P2P transfer channel listens, if on.
    pub fn p2p_channel_addr(&self) -> Option<SocketAddr> {
        self.p2p_channel.as_ref().map(P2pChannel::addr)
    }

    /// The shared state (for tests and embedding).
    pub fn state(&self) -> &Arc<ServerState> {
        &self.state
    }

    /// Stops serving: in-flight requests are answered first.
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        let started = Instant::now();
        if self.stop.swap(true, Ordering::Relaxed) {
            return; // stopped already (shutdown, then drop)
        }
        // No more handovers: whoever took the ports has them already.
        drop(self.handover.take());
        if let Some(t) = self.transport.take() {
            match t.join() {
                Ok(Err(e)) => tracing::error!(error = %e, "transport stopped with an error"),
                Err(_) => tracing::error!("socket thread panicked"),
                Ok(Ok(())) => {}
            }
        }
        let transport_ms = started.elapsed().as_millis() as u64;
        if let Some((tx, j)) = self.http.take() {
            let _ = tx.send(());
            let _ = j.join();
        }
        let http_ms = started.elapsed().as_millis() as u64 - transport_ms;
        if let Some(r) = self.peer_reader.take() {
            r.stop();
        }
        match self.p2p_channel.take() {
            Some(P2pChannel::Native(l)) => l.stop(),
            Some(P2pChannel::Nixl(_, j)) => {
                let _ = j.join();
            }
            None => {}
        }
        if let Some((tx, j)) = self.reaper.take() {
            drop(tx);
            let _ = j.join();
        }
        let before_storage = started.elapsed();
        self.state.storage.shutdown();
        let storage_ms = (started.elapsed() - before_storage).as_millis() as u64;
        // After the write-behind flushed, so its last L2 events are reported; then deregister.
        if let (Some(r), Some(j)) = (&self.state.channels.reporter, self.reporter.take()) {
            r.stop();
            let _ = j.join();
        }
        // Last: the events trace's final batches and stop mark are queued by now.
        if let Some(t) = &self.state.channels.trace {
            t.close();
        }
        self.state.sessions.clear();
        // The segments' names go now (every L1's that has one), whatever still holds the
        // memory until exit.
        for (_, member) in self.state.l1().members() {
            member.memory().arena().unlink_name();
        }
        // Where a stop's time went (a hot upgrade's pause starts with it).
        tracing::info!(
            total_ms = started.elapsed().as_millis() as u64,
            transport_ms,
            http_ms,
            storage_ms,
            "server stopped"
        );
    }
}

/// The P2P transfer channel a server serves.
#[derive(Debug)]
enum P2pChannel {
    /// The native channel's accept thread.
    Native(crate::p2p_channel::Listening),
    /// NIXL's handshake socket (bound address), stopped by the server's stop flag.
    Nixl(SocketAddr, JoinHandle<()>),
}

impl P2pChannel {
    fn addr(&self) -> SocketAddr {
        match self {
            Self::Native(l) => l.addr(),
            Self::Nixl(a, _) => *a,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// What the server declares to a coordinator: L1 `dram` at its size, each L2 adapter by type
/// (capacity when bounded; `shared` from its spec).
/// How long a NIXL handshake from a host no peer has waits for a discovery poll (asked for
/// at once) to list it.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(3);

/// The NIXL handshake's gate: a connection from the host of a registered peer (after a
/// discovery poll, for a server that registered since the last one).
fn handshake_gate(state: &ServerState) -> Option<crate::p2p_nixl::HandshakeGate> {
    let reporter = Arc::clone(state.channels.reporter.as_ref()?);
    let peers = Arc::clone(reporter.peers()?);
    Some(Arc::new(move |from| {
        peers.knows(from, Duration::ZERO) || {
            reporter.poll_peers_now();
            peers.knows(from, HANDSHAKE_WAIT)
        }
    }))
}

fn compartments(state: &ServerState) -> Vec<crate::fleet_report::Compartment> {
    use lmcache_protocol::coordinator::WireTier;
    let mut out = vec![crate::fleet_report::Compartment {
        tier: WireTier::L1,
        backend: "dram".into(),
        capacity: state.l1().usage().capacity,
        shared: false,
    }];
    for a in state.storage.describe_l2() {
        out.push(crate::fleet_report::Compartment {
            tier: WireTier::L2,
            shared: a.spec.get("shared").and_then(serde_json::Value::as_bool).unwrap_or(false),
            backend: a.kind,
            capacity: a.capacity.unwrap_or(0),
        });
    }
    out
}

fn l2_identities(state: &ServerState) -> std::collections::HashMap<u64, (String, bool)> {
    state
        .storage
        .describe_l2()
        .into_iter()
        .map(|a| {
            (
                a.id,
                (
                    a.kind,
                    a.spec.get("shared").and_then(serde_json::Value::as_bool).unwrap_or(false),
                ),
            )
        })
        .collect()
}

/// The bound address, the shutdown sender, the thread, and a duplicate of the listening
/// socket when one was asked for (to offer to a later `--take-over`).
type HttpParts =
    (SocketAddr, tokio::sync::oneshot::Sender<()>, JoinHandle<()>, Option<std::net::TcpListener>);

fn start_http(
    state: Arc<ServerState>,
    port: u16,
    inherited: Option<std::net::TcpListener>,
    offer: bool,
) -> Result<HttpParts, ServerError> {
    let addr = format!("{}:{}", state.config.http_host, port);
    let listener = match crate::handover::take_if_at(inherited, &addr) {
        Some(l) => l,
        None => {
            std::net::TcpListener::bind(&addr).map_err(io(format!("binding HTTP on {addr}")))?
        }
    };
    let dup = if offer { listener.try_clone().ok() } else { None };
    listener.set_nonblocking(true).map_err(io("HTTP listener"))?;
    let local = listener.local_addr().map_err(io("HTTP listener"))?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let join = std::thread::Builder::new()
        .name("http".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(error = %e, "HTTP runtime failed to start");
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, "HTTP listener failed");
                        return;
                    }
                };
                // The status page's last minutes, sampled on this runtime (ends with it).
                tokio::spawn(crate::http::history::run(Arc::clone(&state)));
                serve_http(listener, crate::http::router(state), rx).await;
            });
        })
        .map_err(io("starting the HTTP thread"))?;
    Ok((local, tx, join, dup))
}

/// Serves `app` on `listener` until `stop` fires, then stops taking connections and answers
/// the requests of those it took ([`DrainingListener`]).
async fn serve_http(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    let (listener, drain) = DrainingListener::new(listener);
    let shutdown = async move {
        let _ = stop.await;
        drain.stop_accepting().await;
    };
    // Handlers may name the caller (adapters added at run time are logged with it); `tap_io`
    // is what gives a listener of our own the caller's address.
    let listener = axum::serve::ListenerExt::tap_io(listener, |_| {});
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
        tracing::error!(error = %e, "HTTP server failed");
    }
}

/// How long a connection the HTTP listener took just before a stop gets to send its request
/// before the graceful shutdown closes the connections that are idle.
const HTTP_DRAIN: Duration = Duration::from_millis(100);

/// The HTTP listener, which stops taking connections before the server's graceful shutdown
/// starts. That shutdown closes every connection with no request in progress at once, and a
/// connection taken a moment before, whose request is still on its way or unread, is then
/// reset: a client's request dropped across a hot upgrade, where a connection the kernel
/// queued instead waits for the next server, which shares the listening socket. So a stop
/// first stops the accepting, then, when a connection was taken within [`HTTP_DRAIN`], waits
/// out the rest of it: by then its request is in progress, and the graceful shutdown answers
/// it before it closes the connection.
struct DrainingListener {
    inner: tokio::net::TcpListener,
    stop: tokio::sync::watch::Receiver<bool>,
    /// When the last connection was taken (none yet: `None`).
    last_accept: Arc<parking_lot::Mutex<Option<Instant>>>,
}

/// The stopping end of a [`DrainingListener`].
struct Drain {
    stop: tokio::sync::watch::Sender<bool>,
    last_accept: Arc<parking_lot::Mutex<Option<Instant>>>,
}

impl DrainingListener {
    fn new(inner: tokio::net::TcpListener) -> (Self, Drain) {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let last_accept = Arc::new(parking_lot::Mutex::new(None));
        let drain = Drain { stop: tx, last_accept: Arc::clone(&last_accept) };
        (Self { inner, stop: rx, last_accept }, drain)
    }
}

impl Drain {
    /// Stops the accepting, then waits until the last connection taken has had
    /// [`HTTP_DRAIN`] since.
    async fn stop_accepting(self) {
        let _ = self.stop.send(true);
        let last = *self.last_accept.lock();
        if let Some(left) = last.and_then(|t| HTTP_DRAIN.checked_sub(t.elapsed())) {
            tokio::time::sleep(left).await;
        }
    }
}

impl axum::serve::Listener for DrainingListener {
    type Io = tokio::net::TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            if *self.stop.borrow() {
                // Taken by nothing any more: what the kernel queues now is the next server's.
                std::future::pending::<()>().await;
            }
            tokio::select! {
                // A stop that comes with a connection ready wins: the stop has already read
                // when the last connection was taken.
                biased;
                changed = self.stop.changed() => {
                    if changed.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
                taken = self.inner.accept() => match taken {
                    Ok((io, addr)) => {
                        *self.last_accept.lock() = Some(Instant::now());
                        return (io, addr);
                    }
                    // As axum's own listener: a connection that went before it was taken is
                    // passed over; any other failure (out of descriptors) is logged and
                    // retried a moment later.
                    Err(e) if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionAborted
                            | std::io::ErrorKind::ConnectionReset
                            | std::io::ErrorKind::ConnectionRefused
                    ) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "HTTP accept failed; retrying");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// Announces the adopted chunks whose tokens the previous process kept: a KV event `stored`
/// record for each chunk of shard 0 (parents first) and the coordinator's token binding; then
/// keeps only those in the tokens file.
fn announce_tokens(
    l1: &lmcache_l1::L1Cache,
    saved: &crate::chunk_tokens_file::Saved,
    file: &crate::chunk_tokens_file::ChunkTokensFile,
    events: &KvEventLog,
    reporter: Option<&Arc<crate::fleet_report::Reporter>>,
) {
    let mut adopted: std::collections::HashMap<(String, lmcache_core::ChunkHash), bool> =
        std::collections::HashMap::new();
    for (key, _) in l1.resident_keys() {
        let k = (key.model_name.as_str().to_owned(), key.chunk_hash);
        if saved.contains_key(&k) {
            *adopted.entry(k).or_default() |= key.kv_rank.worker_id() == 0;
        }
    }
    let mut chunks: Vec<_> =
        adopted.iter().filter_map(|(k, shard0)| Some((saved.get(k)?, *shard0))).collect();
    chunks.sort_by_key(|(c, _)| c.position);
    for (c, shard0) in &chunks {
        if *shard0 {
            events.stored(&c.model, c.hash, c.parent, &c.tokens);
        }
        if let Some(r) = reporter {
            r.bind_tokens(&c.hash, &c.tokens, c.position as usize);
        }
    }
    file.keep(chunks.iter().map(|(c, _)| *c));
    if !saved.is_empty() {
        tracing::info!(
            announced = chunks.len(),
            kept_tokens = saved.len(),
            "warm restart: adopted chunks announced with their tokens"
        );
    }
}

/// Reaps sessions past their TTL, dead workers and abandoned engine-driven transfers.
fn start_reaper(state: Arc<ServerState>) -> Result<(Sender<()>, JoinHandle<()>), ServerError> {
    let (tx, rx) = mpsc::channel::<()>();
    let c = &state.config;
    let period = [c.session_ttl / 10, c.worker_reap_timeout / 4, Duration::from_secs(60)]
        .into_iter()
        .filter(|d| !d.is_zero())
        .min()
        .unwrap_or(Duration::from_secs(60))
        .max(Duration::from_millis(50));
    let join = std::thread::Builder::new()
        .name("reaper".into())
        .spawn(move || {
            while let Err(RecvTimeoutError::Timeout) = rx.recv_timeout(period) {
                let now = Instant::now();
                let c = &state.config;
                let sessions = state.sessions.reap(now);
                let workers =
                    state.registry.reap(now, c.worker_reap_timeout, c.worker_registration_grace);
                state.pending.reap(now, c.l1.write_ttl.max(c.l1.read_ttl));
                state.peers.reap(now, c.l1.read_ttl);
                if sessions + workers > 0 {
                    tracing::info!(sessions, workers, "reaped");
                }
            }
        })
        .map_err(io("starting the reaper"))?;
    Ok((tx, join))
}

/// The storage configuration a trace header records (as LMCache records its
/// `StorageManagerConfig`): L1 size and eviction, the L2 adapters and tier settings.
/// Credentials are redacted by the recorder.
pub fn storage_config_json(config: &ServerConfig) -> serde_json::Value {
    serde_json::json!({
        "server": "lmcache-rs",
        "chunk_size": config.chunk_size,
        "l1": {
            "size_in_bytes": config.arena.size,
            "align_bytes": config.align,
            "eviction_policy": config.l1.eviction_policy.to_string(),
            "trigger_watermark": config.l1.trigger_watermark,
            "eviction_ratio": config.l1.eviction_ratio,
            "read_ttl_seconds": config.l1.read_ttl.as_secs(),
            "write_ttl_seconds": config.l1.write_ttl.as_secs(),
        },
        "l2_adapters": config.l2_adapters,
        "l2": {
            "store_queue_keys": config.l2.store_queue_keys,
            "prefetch_max_in_flight": config.l2.max_in_flight,
            "prefetch_timeout_seconds": config.l2.prefetch_deadline.as_secs_f64(),
        },
    })
}

/// The side channels, as storage subscribers, in the order they hear each event: metrics
/// first, then the bus, KV events, the coordinator reporter, the storage trace and the
/// lookup-hash log (each only when configured).
/// The CacheBlend engine (`--engine-type blend`), with its coordinator leg when the server
/// reports cache events to a coordinator (the fleet directory is built from them).
fn blend_engine(
    config: &ServerConfig,
    metrics: &Arc<Metrics>,
    bus: &crate::event_bus::EventBus,
) -> Result<Option<Arc<crate::blend::BlendEngine>>, ServerError> {
    let Some(options) = config.blend else { return Ok(None) };
    let telemetry =
        crate::blend_telemetry::BlendTelemetry::new(Arc::clone(metrics), Some(bus.publisher()));
    let fleet = match &config.coordinator {
        Some(c) if !c.url.is_empty() && c.event_reporting => {
            let f = crate::blend_fleet::FleetMatcher::start(crate::blend_fleet::FleetMatchConfig {
                url: c.url.clone(),
                auth_token: c.auth_token.clone(),
                timeout: options.coordinator_timeout,
                concurrency: options.coordinator_match_concurrency,
            })
            .map_err(io("starting the CacheBlend coordinator client"))?;
            tracing::info!(url = %c.url, "CacheBlend coordinator leg enabled");
            Some(f)
        }
        Some(c) if !c.url.is_empty() => {
            tracing::warn!(
                "a coordinator URL is set but cache-event reporting is off, so the coordinator \
                 has no chunks to match: CacheBlend matches locally only (pass \
                 --coordinator-event-reporting)"
            );
            None
        }
        _ => None,
    };
    Ok(Some(Arc::new(crate::blend::BlendEngine::new(options, config.chunk_size, telemetry, fleet))))
}

fn subscribers(
    config: &ServerConfig,
    metrics: &Arc<Metrics>,
    bus: &crate::event_bus::EventBus,
    kv_events: &Arc<KvEventLog>,
    reporter: Option<&Arc<crate::fleet_report::Reporter>>,
    trace: Option<&Arc<crate::trace_record::TraceRecorder>>,
    lookup_log: Option<&Arc<crate::lookup_log::LookupHashLog>>,
) -> Vec<Arc<dyn lmcache_storage::StorageSubscriber>> {
    use crate::observers::*;
    let mut subs: Vec<Arc<dyn lmcache_storage::StorageSubscriber>> = vec![
        Arc::new(MetricsSubscriber { metrics: Arc::clone(metrics), chunk_size: config.chunk_size }),
        Arc::new(BusSubscriber(bus.publisher())),
    ];
    if kv_events.enabled() {
        subs.push(Arc::new(KvEventsSubscriber(Arc::clone(kv_events))));
    }
    if let Some(r) = reporter {
        subs.push(Arc::new(ReporterSubscriber(Arc::clone(r))));
    }
    if let Some(t) = trace.filter(|t| t.level() == lmcache_workload::trace::Level::Storage) {
        subs.push(Arc::new(TraceSubscriber(Arc::clone(t))));
    }
    if let Some(l) = lookup_log {
        subs.push(Arc::new(LookupLogSubscriber(Arc::clone(l))));
    }
    subs
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::time::Duration;

    use super::serve_http;

    fn get(c: &mut std::net::TcpStream, close: bool) -> std::io::Result<()> {
        let conn = if close { "Connection: close\r\n" } else { "" };
        write!(c, "GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\n{conn}\r\n")
    }

    /// Reads one response whose body is `body` (its length known), leaving the connection open.
    fn answer(c: &mut std::net::TcpStream, body: &str) -> String {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&got).ends_with(&format!("\r\n\r\n{body}")) {
            match c.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => return format!("{}[{e}]", String::from_utf8_lossy(&got)),
            }
        }
        String::from_utf8_lossy(&got).into_owned()
    }

    /// A hot upgrade's HTTP side, with a successor sharing the listening socket: a request on
    /// a connection the old server took just before its stop is answered by it (the graceful
    /// shutdown alone closed that connection, idle at the stop, and reset the request), and a
    /// connection made after the stop is the successor's.
    #[test]
    fn a_stop_answers_a_connection_it_just_took_and_leaves_new_ones_to_the_successor() {
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let shared = std_listener.try_clone().unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let addr = std_listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let old = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
                let app = axum::Router::new().route("/ok", axum::routing::get(|| async { "old" }));
                serve_http(listener, app, rx).await;
            });
        });
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        get(&mut c, false).unwrap();
        let first = answer(&mut c, "old");
        assert!(first.starts_with("HTTP/1.1 200"), "{first}");
        // The stop; the connection, taken a moment ago, is idle; its next request comes.
        tx.send(()).unwrap();
        std::thread::sleep(Duration::from_millis(10));
        let second = get(&mut c, true).map(|()| answer(&mut c, "old"));
        assert!(
            second.as_ref().is_ok_and(|a| a.starts_with("HTTP/1.1 200")),
            "the request after the stop was dropped: {second:?}"
        );
        // The successor takes what is queued from now on (the socket is one, as after a
        // handover); the old server takes nothing more.
        let successor = std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            loop {
                match shared.accept() {
                    Ok((mut s, _)) => {
                        let mut buf = [0u8; 1024];
                        s.set_nonblocking(false).unwrap();
                        let _ = s.read(&mut buf);
                        let _ = s.write_all(
                            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nnew",
                        );
                        return;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        assert!(t0.elapsed() < Duration::from_secs(10), "nothing came");
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        });
        let mut d = std::net::TcpStream::connect(addr).unwrap();
        d.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        get(&mut d, true).unwrap();
        let third = answer(&mut d, "new");
        assert!(third.ends_with("new"), "a connection after the stop: {third:?}");
        successor.join().unwrap();
        old.join().unwrap();
    }
}
