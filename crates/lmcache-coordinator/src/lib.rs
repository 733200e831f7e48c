//! The lmcache-rs fleet coordinator: a drop-in for LMCache 0.5.6's `lmcache coordinator`.
//!
//! Cache servers (LMCache's or ours) register, heartbeat and report cache events
//! (`POST /events`); the coordinator keeps the fleet's key directory
//! ([`lmcache_directory::Directory`]) and answers where each chunk lives
//! (`/directory/lookup`, `/directory/keys`) and which server holds the longest prefix of a
//! request (`/directory/route`, which LMCache does not have).
//!
//! - [`fleet`]: the state and every operation on it, no HTTP (tests and benches drive it).
//! - [`http`]: the routes.
//! - [`Coordinator`]: the running service (its own thread and tokio runtime, the health sweep).

pub mod config;
pub mod fleet;
pub mod http;
pub mod metrics;
mod repair;

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
}

impl Coordinator {
    /// Binds `host:port` and serves.
    pub fn start(config: CoordinatorConfig) -> Result<Self, CoordinatorError> {
        let fleet = Arc::new(Fleet::new(config)?);
        let c = fleet.config();
        let addr = format!("{}:{}", c.host, c.port);
        let io = |what: String| move |source| CoordinatorError::Io { what, source };
        let listener = std::net::TcpListener::bind(&addr).map_err(io(format!("binding {addr}")))?;
        listener.set_nonblocking(true).map_err(io("listener".into()))?;
        let local = listener.local_addr().map_err(io("listener".into()))?;
        let (stop, mut rx) = tokio::sync::watch::channel(false);
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
        tracing::info!(addr = %local, "coordinator listening");
        Ok(Self {
            fleet,
            addr: local,
            stop: Some(stop),
            thread: Some(thread),
            repair_stop,
            repair: Some(repair),
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
        if let Some(t) = self.repair.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.shutdown();
    }
}
