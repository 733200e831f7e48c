//! How requests reach the handlers: LMCache's two transports, chosen by `--transport`.
//!
//! - [`zmq`]: the ZMQ ROUTER socket (LMCache's default, and vLLM's).
//! - [`grpc`]: LMCache's gRPC services (`--transport grpc`), the same operations as protobuf
//!   messages over HTTP/2.
//!
//! Both hand every request to [`crate::handlers`] on the same lanes (cheap operations
//! inline, lookups and management on a shared pool, transfers on a pool where one client
//! always lands on the same thread: [`lanes`]), and both drain in-flight requests on shutdown.

pub mod grpc;
mod lanes;
pub mod zmq;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use thiserror::Error;

pub use self::grpc::GrpcTransport;
pub use self::zmq::ZmqTransport;
use crate::config::{ServerConfig, TransportKind};
use crate::state::ServerState;

/// Why the transport could not start or stopped.
#[derive(Debug, Error)]
pub enum TransportError {
    /// A ZMQ call failed.
    #[error("zmq {op} failed: {source}")]
    Zmq {
        /// What was being done.
        op: &'static str,
        /// The ZMQ error.
        #[source]
        source: ::zmq::Error,
    },
    /// A worker thread could not start.
    #[error("could not start thread {name}: {source}")]
    Spawn {
        /// Thread name.
        name: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The gRPC listener could not be bound, or its runtime not started.
    #[error("gRPC transport: {what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The gRPC server stopped with an error.
    #[error("gRPC server failed: {0}")]
    Grpc(String),
}

/// The error of a failed socket or runtime call, naming `what` was being done.
pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> TransportError {
    let what = what.into();
    move |source| TransportError::Io { what, source }
}

/// A bound transport, ready to serve.
#[derive(Debug)]
pub enum Transport {
    /// `--transport zmq`.
    Zmq(ZmqTransport),
    /// `--transport grpc`.
    Grpc(GrpcTransport),
}

impl Transport {
    /// Binds the transport the configuration names, on its host and port.
    pub fn bind(config: &ServerConfig) -> Result<Self, TransportError> {
        Ok(Self::bind_held(config, None, false)?.0)
    }

    /// As [`Self::bind`], serving on `inherited` (a port handed over by the server taken over)
    /// when it is bound where the configuration asks. With `hold`, also returns a duplicate of
    /// the listening socket, to hand over in turn (`None` for a ZMQ endpoint that is not TCP).
    pub fn bind_held(
        config: &ServerConfig,
        inherited: Option<std::net::TcpListener>,
        hold: bool,
    ) -> Result<(Self, Option<std::net::TcpListener>), TransportError> {
        Ok(match config.transport {
            TransportKind::Zmq => {
                let endpoint = config.endpoint();
                let socket = match (hold, inherited) {
                    (false, None) => None,
                    (_, inherited) => crate::handover::zmq_listener(&endpoint, inherited)
                        .map_err(io(format!("binding {endpoint}")))?,
                };
                (Self::Zmq(ZmqTransport::bind(&endpoint, socket.as_ref())?), socket)
            }
            TransportKind::Grpc { server_workers } => {
                let t = GrpcTransport::bind(&config.host, config.port, server_workers, inherited)?;
                let socket =
                    if hold { Some(t.listener_clone().map_err(io("the listener"))?) } else { None };
                (Self::Grpc(t), socket)
            }
        })
    }

    /// The endpoint actually bound (`tcp://…` or `grpc://…`, with the port chosen for
    /// port 0): what a client of this transport connects to.
    pub fn endpoint(&self) -> &str {
        match self {
            Self::Zmq(t) => t.endpoint(),
            Self::Grpc(t) => t.endpoint(),
        }
    }

    /// Serves until `stop` is set, then drains. Runs on the calling thread.
    pub fn serve(
        self,
        state: Arc<ServerState>,
        stop: Arc<AtomicBool>,
    ) -> Result<(), TransportError> {
        match self {
            Self::Zmq(t) => t.serve(state, stop),
            Self::Grpc(t) => t.serve(state, stop),
        }
    }
}
