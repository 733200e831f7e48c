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
        Ok(match config.transport {
            TransportKind::Zmq => Self::Zmq(ZmqTransport::bind(&config.endpoint())?),
            TransportKind::Grpc { server_workers } => {
                Self::Grpc(GrpcTransport::bind(&config.host, config.port, server_workers)?)
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
