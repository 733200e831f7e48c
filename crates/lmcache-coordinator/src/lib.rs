//! The lmcache-rs fleet coordinator: a drop-in for LMCache 0.5.6's `lmcache coordinator`.
//!
//! Cache servers (LMCache's or ours) register, heartbeat and report cache events
//! (`POST /events`); the coordinator keeps the fleet's key directory
//! ([`lmcache_directory::Directory`]) and answers where each chunk lives
//! (`/directory/lookup`, `/directory/keys`) and which server holds the longest prefix of a
//! request (`/directory/route`, which LMCache does not have).
//!
//! Modules, one question each:
//! - [`fleet`]: the state and every operation on it, no HTTP (tests and benches drive it).
//! - [`http`]: the routes, one module per resource over the shared service shell
//!   (`lmcache-http`).
//! - [`control`]: operator intent (quotas, pins) and the metadata document it persists in.
//! - [`checkpoint`]: the checkpoint file (restored at start, written every interval and at
//!   stop; never written over a file that is not one).
//! - [`transport`]: where cache events come from (HTTP, or NATS JetStream).
//! - [`replication`]: with JetStream, the registry, heartbeats and the metadata document
//!   (quotas, pins) shared between replicas through a NATS key-value bucket.
//! - [`vllm_events`]: admitted events re-published in vLLM's KV-event format on ZMQ
//!   (`--vllm-kv-events-endpoint`), for routers that consume vLLM's events.
//! - `repair`: the repair thread (a stream gap resynced from the server's snapshot).
//! - `server_client`: the calls made to servers (snapshot pages, relays, eviction orders).
//! - `periodic`: tasks run every period on a thread woken by its stop channel.
//! - [`config`]: [`CoordinatorConfig`]; [`metrics`]: the coordinator's Prometheus names.
//! - [`Coordinator`]: the running service (its own thread and tokio runtime, the health sweep,
//!   the repair, checkpoint, eviction and vLLM KV-event threads).
#![forbid(unsafe_code)]

pub mod checkpoint;
pub mod config;
pub mod control;
pub mod fleet;
pub mod http;
pub mod metrics;
mod periodic;
mod repair;
pub mod replication;
mod server_client;
pub mod transport;
pub mod vllm_events;

use periodic::Periodic;

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

pub use config::CoordinatorConfig;
pub use fleet::{Fleet, FleetError};

/// Errors starting the service.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// The settings cannot be served.
    #[error("{0}")]
    Config(#[from] FleetError),
    /// Binding or starting a thread failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
}

/// A running coordinator. Dropping it (or [`Coordinator::stop`]) stops the HTTP server and
/// the health sweep.
#[derive(Debug)]
pub struct Coordinator {
    fleet: Arc<Fleet>,
    addr: SocketAddr,
    stop: Option<tokio::sync::watch::Sender<bool>>,
    thread: Option<JoinHandle<()>>,
    repair_stop: Arc<std::sync::atomic::AtomicBool>,
    repair: Option<JoinHandle<()>>,
    checkpointer: Option<Periodic>,
    evictor: Option<Periodic>,
    vllm_events: Option<JoinHandle<()>>,
}

/// Loads the checkpoint at `path` into a fresh fleet; a missing or damaged one leaves it cold
/// (logged and counted), and the emitters' next batches resync it.
fn restore(fleet: &Fleet, path: &std::path::Path) {
    let t = std::time::Instant::now();
    let result = std::fs::read(path)
        .map_err(checkpoint::CheckpointError::from)
        .and_then(|b| fleet.restore(&b));
    match result {
        Ok(st) => {
            tracing::info!(path = %path.display(), keys = st.keys, placements = st.placements, instances = st.instances,
                ms = t.elapsed().as_millis() as u64, "checkpoint restored");
            fleet.metrics.restores("restored");
        }
        Err(checkpoint::CheckpointError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::info!(path = %path.display(), "no checkpoint yet: starting cold");
            fleet.metrics.restores("missing");
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "checkpoint not used: starting cold; emitters resync");
            fleet.metrics.restores("corrupt");
        }
    }
}

/// Writes a checkpoint of `fleet` to `path` (logged on failure; the old file stays).
fn save(fleet: &Fleet, path: &std::path::Path) {
    let t = std::time::Instant::now();
    let bytes = fleet.checkpoint();
    match checkpoint::write_checkpoint(path, &bytes) {
        Ok(()) => {
            tracing::debug!(path = %path.display(), bytes = bytes.len(), ms = t.elapsed().as_millis() as u64, "checkpoint written");
            fleet.metrics.checkpoints_written.inc();
        }
        Err(e) => {
            tracing::error!(path = %path.display(), error = %e, "checkpoint write failed");
            fleet.metrics.checkpoint_failures.inc();
        }
    }
}

impl Coordinator {
    /// Binds `host:port` and serves.
    pub fn start(config: CoordinatorConfig) -> Result<Self, CoordinatorError> {
        let fleet = Arc::new(Fleet::new(config)?);
        fleet.load_metadata().map_err(|e| {
            CoordinatorError::Config(FleetError::BadRequest(format!("metadata: {e}")))
        })?;
        if let Some(path) = &fleet.config().checkpoint_path {
            checkpoint::check_replaceable(path).map_err(|e| {
                CoordinatorError::Config(FleetError::BadRequest(format!("--checkpoint-path: {e}")))
            })?;
            restore(&fleet, path);
        }
        // Bound before anything serves, so that a bad endpoint fails the start.
        let vllm_bound = match fleet.config().vllm_kv_events.clone() {
            Some(c) => {
                let (publisher, run) = vllm_events::bind(&c).map_err(|e| {
                    CoordinatorError::Config(FleetError::BadRequest(format!("vLLM KV events: {e}")))
                })?;
                let (endpoint, replay) = publisher.endpoints();
                tracing::info!(endpoint, replay = ?replay,
                    "re-publishing cache events as vLLM KV events");
                fleet.set_vllm_publisher(publisher);
                Some(run)
            }
            None => None,
        };
        let c = fleet.config();
        let addr = format!("{}:{}", c.host, c.port);
        let io = |what: String| move |source| CoordinatorError::Io { what, source };
        let listener = std::net::TcpListener::bind(&addr).map_err(io(format!("binding {addr}")))?;
        listener.set_nonblocking(true).map_err(io("listener".into()))?;
        let local = listener.local_addr().map_err(io("listener".into()))?;
        let (stop, mut rx) = tokio::sync::watch::channel(false);
        // With JetStream, registry changes go to the other replicas (set before serving).
        let replication_rx = match &fleet.config().event_transport {
            transport::EventTransport::JetStream { .. } => {
                let (tx, changes) = tokio::sync::mpsc::unbounded_channel();
                fleet.set_replicator(tx);
                Some(changes)
            }
            transport::EventTransport::Http => None,
        };
        let f = Arc::clone(&fleet);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("coordinator")
            .enable_all()
            .build()
            .map_err(io("starting the runtime".into()))?;
        let thread = std::thread::Builder::new()
            .name("coordinator-http".into())
            .spawn(move || {
                rt.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, "coordinator listener failed");
                            return;
                        }
                    };
                    if let Some(period) = f.sweep_period() {
                        let f = Arc::clone(&f);
                        let mut rx = rx.clone();
                        tokio::spawn(async move {
                            let mut tick = tokio::time::interval(period);
                            tick.tick().await;
                            loop {
                                tokio::select! {
                                    _ = tick.tick() => {
                                        let f = Arc::clone(&f);
                                        let _ = tokio::task::spawn_blocking(move || f.sweep(std::time::Instant::now())).await;
                                    }
                                    _ = rx.changed() => break,
                                }
                            }
                        });
                    }
                    if let transport::EventTransport::JetStream { url, stream } = &f.config().event_transport {
                        let source = Box::new(transport::JetStreamSource { url: url.clone(), stream: stream.clone() });
                        tokio::spawn(transport::CacheEventSource::run(source, Arc::clone(&f), rx.clone()));
                        if let Some(changes) = replication_rx {
                            tokio::spawn(replication::run(url.clone(), stream.clone(), Arc::clone(&f), changes, rx.clone()));
                        }
                    }
                    let app = http::router(f);
                    let shutdown = async move {
                        let _ = rx.changed().await;
                    };
                    if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                        tracing::error!(error = %e, "coordinator HTTP server failed");
                    }
                });
            })
            .map_err(io("starting the HTTP thread".into()))?;
        let vllm_events = match vllm_bound {
            Some(run) => Some(
                std::thread::Builder::new()
                    .name("coordinator-vllm-events".into())
                    .spawn(run)
                    .map_err(io("starting the vLLM KV-event thread".into()))?,
            ),
            None => None,
        };
        let (repair_tx, repair_rx) = std::sync::mpsc::channel();
        fleet.set_repairer(repair_tx);
        let repair_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let repair = {
            let (f, stop) = (Arc::clone(&fleet), Arc::clone(&repair_stop));
            std::thread::Builder::new()
                .name("coordinator-repair".into())
                .spawn(move || repair::run(f, repair_rx, stop))
                .map_err(io("starting the repair thread".into()))?
        };
        let checkpointer = match fleet.config().checkpoint_path.clone() {
            Some(path) if !fleet.config().checkpoint_interval.is_zero() => {
                let f = Arc::clone(&fleet);
                let every = fleet.config().checkpoint_interval;
                Some(
                    Periodic::spawn("coordinator-checkpoint", every, move || save(&f, &path))
                        .map_err(io("starting the checkpoint thread".into()))?,
                )
            }
            _ => None,
        };
        let evictor = if fleet.config().eviction_check_interval.is_zero() {
            None
        } else {
            let f = Arc::clone(&fleet);
            let every = fleet.config().eviction_check_interval;
            Some(
                Periodic::spawn("coordinator-evict", every, move || {
                    let (ratio, wm) = (f.config().eviction_ratio, f.config().trigger_watermark);
                    server_client::send_evictions(&f, f.eviction_plan(ratio, wm));
                })
                .map_err(io("starting the eviction thread".into()))?,
            )
        };
        tracing::info!(addr = %local, "coordinator listening");
        Ok(Self {
            evictor,
            fleet,
            addr: local,
            stop: Some(stop),
            thread: Some(thread),
            repair_stop,
            repair: Some(repair),
            checkpointer,
            vllm_events,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its state.
    pub fn fleet(&self) -> &Arc<Fleet> {
        &self.fleet
    }

    /// Stops serving and waits for the thread.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(true);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.repair_stop.store(true, std::sync::atomic::Ordering::Release);
        self.fleet.close_repairer();
        if let Some(t) = self.repair.take() {
            let _ = t.join();
        }
        // The publisher's thread ends once its sender is gone.
        self.fleet.close_vllm_publisher();
        if let Some(t) = self.vllm_events.take() {
            let _ = t.join();
        }
        // Periodic tasks stop (and are waited for) as their handles go.
        drop(self.checkpointer.take());
        drop(self.evictor.take());
        if let Some(path) = self.fleet.config().checkpoint_path.clone() {
            save(&self.fleet, &path);
        }
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.shutdown();
    }
}
