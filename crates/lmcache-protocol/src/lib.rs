//! LMCache 0.5.6's multiprocess (MP) wire format, as its Python clients speak it.
//!
//! # Motivation
//! A user swaps `lmcache server` for `lmcache-rs server` and LMCache's own clients (vLLM's MP
//! connector, `lmcache bench server`) must keep working unchanged. This crate is that
//! contract, byte for byte, with no sockets: frames in, typed requests out; typed replies in,
//! frames out.
//!
//! # Components
//! - [`op`]: the operation table (integer ids and names).
//! - [`frame`]: the multipart layout of requests, replies and stream control messages.
//! - [`request`]: one typed request per operation ([`request::Command`]), decoded once at
//!   dispatch and encoded by clients, one module per op family.
//! - [`value`]: strict msgpack readers (a `bool` must be a msgpack bool, `bytes` a bin...),
//!   each failure naming the field and what was found.
//! - [`types`]: the payload types (`IPCCacheServerKey`, registration payloads, IPC
//!   descriptors, transfer responses) with their decoders and encoders.
//! - [`coordinator`]: the JSON contract with LMCache's coordinator (registration, cache-event
//!   batches, directory answers).
//! - [`coordinator_borrowed`]: `POST /events` bodies decoded in place (strings borrowed from
//!   the body, chunk hashes decoded once), what the coordinator ingests.
//! - [`coordinator_write`]: the directory's lookup answer written straight to JSON bytes (the
//!   bytes serde writes, faster).
//! - [`coordinator_binary`]: cache-event batches in a binary layout, for the JetStream feed
//!   between lmcache-rs's own servers and coordinator.
//! - [`grpc`]: the same operations as LMCache's gRPC services (`--transport grpc`): the
//!   method table, the protobuf messages, and their conversion to and from the msgpack
//!   parameters and replies above.
//! - [`error`]: [`ProtocolError`], each naming the field and what was wrong, and its kind
//!   for metrics.
#![forbid(unsafe_code)]

pub mod coordinator;
pub mod coordinator_binary;
pub mod coordinator_borrowed;
pub mod coordinator_write;
pub mod error;
pub mod frame;
pub mod grpc;
pub mod op;
pub mod request;
pub mod types;
pub mod value;

pub use error::ProtocolError;
pub use frame::{Control, Incoming, Reply, Request};
pub use op::Op;
