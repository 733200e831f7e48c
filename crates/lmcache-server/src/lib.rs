//! The lmcache-rs MP cache server: LMCache 0.5.6's multiprocess protocol over ZMQ or gRPC, on
//! the L1 tier.
//!
//! # Components
//! - [`transport`]: how requests arrive: the ZMQ ROUTER thread ([`transport::zmq`]) or
//!   LMCache's gRPC services ([`transport::grpc`]), each with the same worker pools.
//! - [`handlers`]: one module per operation family; every request gets exactly one reply.
//! - [`session`]: request sessions (hash chains, lookup locks).
//! - [`registry`]: registered workers, their layouts and KV memory, liveness.
//! - [`chunk_tokens_file`]: the tokens behind an L1 file's chunks, so a warm restart announces
//!   what it adopted.
//! - [`l1_sidecar`]: files kept beside a warm-restarting L1 file, replaced whole.
//! - [`registry_file`]: the registrations a warm restart takes back, in a file beside the L1
//!   file.
//! - [`transfer`]: gather/scatter between paged KV and L1 objects (CPU backend).
//! - [`event_bus`]: typed events to subscribers through a bounded, counted queue.
//! - [`kv_events`]: the KV event log behind `subscribe_kv_events`.
//! - [`http`]: the HTTP API (health, status, clear, checksums, metrics).
//! - [`server`]: wiring, background reapers, shutdown; [`config`]: [`ServerConfig`].
//! - [`state`]: [`state::RequestState`], all a handler sees (storage, sessions, registry),
//!   inside [`state::ServerState`], which adds the side channels.
//! - [`observers`]: the side channels as subscribers of storage's events.
//! - [`p2p_channel`]: the native transfer channel: locked objects' bytes to a peer's L1.
//! - [`p2p_nixl`]: the NIXL channel (LMCache's default): LMCache's handshake on ZMQ, the
//!   registered L1 arena, READs of a peer's pages into L1 reservations.
//! - [`p2p_peers`]: P2P discovery: the fleet's peers from the coordinator's instance list.
//! - [`p2p_reader`]: the reader side of P2P: a short lookup's rest fetched from peers.
//! - [`p2p_same_host`]: the native channel's same-host path: a peer's pool segment read
//!   directly.
//! - [`peer_locks`]: P2P lookup answers and the L1 locks held for the fleet's peers.
//! - [`kv_groups`]: a registration's KV groups as kernel groups and object groups.
//! - [`blend`]: CacheBlend's state (`--engine-type blend`): rope state, the matcher.
//! - [`blend_fleet`]: CacheBlend's coordinator leg (`/directory/blend-lookup`).
//! - [`blend_telemetry`]: CacheBlend's typed events, `lmcache_blend_*` metrics and `cb.*`
//!   spans, through one door.
//! - [`metrics`]: LMCache's Prometheus names and ours.
//! - [`fleet_report`]: registration, heartbeats and cache events to a coordinator.
//! - [`lookup_log`]: LMCache's lookup-hash JSONL logs, from a writer thread.
//! - [`explain`]: "why was this a miss?": each recent lookup judged chunk by chunk.
//! - [`trace_record`]: LMCache's `.lct` traces (storage calls, cache events).
//! - [`handover`]: the hot upgrade's port handover: listening sockets passed to the server
//!   that takes over; [`fd_passing`]: its two system calls without a safe API (the crate's
//!   only unsafe code).
#![deny(unsafe_code)]

pub mod blend;
pub mod blend_fleet;
pub mod blend_telemetry;
pub mod chunk_tokens_file;
pub mod config;
pub mod event_bus;
pub mod explain;
#[expect(unsafe_code, reason = "ZMQ_USE_FD and SCM_RIGHTS descriptors: see the module")]
mod fd_passing;
pub mod fleet_report;
pub mod handlers;
pub mod handover;
pub mod http;
pub mod kv_events;
pub mod kv_groups;
pub mod l1_sidecar;
pub mod lookup_log;
pub mod metrics;
pub mod observers;
pub mod p2p_channel;
pub mod p2p_nixl;
pub mod p2p_peers;
pub mod p2p_reader;
pub mod p2p_same_host;
pub mod peer_locks;
pub mod registry;
pub mod registry_file;
pub mod server;
pub mod session;
pub mod state;
pub mod trace_record;
pub mod transfer;
pub mod transport;

pub use config::ServerConfig;
pub use server::Server;
