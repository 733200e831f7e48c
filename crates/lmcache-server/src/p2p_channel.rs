//! The native P2P transfer channel between lmcache-rs servers: after `p2p_lookup_and_lock`, a
//! reader fetches the locked objects' bytes over TCP straight into its own L1 reservations.
//!
//! Wire (all integers big-endian):
//! - request: magic `LMRSP2P1`, a `u32` length, then a msgpack array of `ObjectKey` maps (as
//!   the P2P RPCs carry them);
//! - answer, per key in order: a status byte (0: the object follows; 1: not served), then for
//!   0 a `u64` length, the bytes, and their xxh3-64 (the L2 blob format's checksum), which
//!   both sides compute piece by piece as the bytes go, overlapping the transfer.
//!
//! The serving side sends only objects a peer holds a P2P lock on ([`PeerLocks`]), reading
//! each under a read lease of its own for the time of the send (the peer's unlock can come
//! meanwhile: nothing is freed under a reader). The reading side receives each object into a
//! reservation of exactly its size with no copy beyond the socket's, hashes it and refuses it
//! when the hash differs: a damaged or truncated transfer is a miss, never wrong KV. (The
//! hash is the sender's: it proves the bytes arrived as sent, not that a peer that lies about
//! its own KV is honest; peers are trusted as MP clients are.) Every socket
//! step has a timeout; a peer that dies mid-read fails the objects not yet complete, and
//! their reservations are dropped (nothing is left locked or staged on either side).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lmcache_core::ObjectKey;
use lmcache_l1::{L1Cache, WriteReservation};
use lmcache_protocol::types::WireObjectKey;
use lmcache_protocol::types::p2p::decode_keys;
use rmpv::Value;
use std::hash::Hasher as _;
use twox_hash::XxHash3_64;

use crate::peer_locks::PeerLocks;

const MAGIC: &[u8; 8] = b"LMRSP2P1";
/// Bytes hashed and sent (or received) per step.
const PIECE: usize = 4 << 20;
/// The most keys one request may name.
pub const MAX_KEYS: usize = 65_536;
const MAX_REQUEST: u32 = 64 << 20;

/// Why an object was not fetched.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ChannelError {
    /// The socket failed or timed out.
    #[error("p2p channel I/O: {0}")]
    Io(String),
    /// The peer did not serve the object (not locked there, or gone).
    #[error("the peer did not serve the object")]
    NotServed,
    /// The peer sent another length than the reservation's.
    #[error("the peer sent {got} bytes for an object of {expected}")]
    Length {
        /// The reservation's size.
        expected: u64,
        /// What the peer announced.
        got: u64,
    },
    /// The bytes do not hash to what the peer announced.
    #[error("checksum mismatch: the object arrived damaged")]
    Checksum,
    /// The request was malformed or too large.
    #[error("bad request: {0}")]
    BadRequest(String),
}

fn io(e: std::io::Error) -> ChannelError {
    ChannelError::Io(e.to_string())
}

/// Serves the channel on `listener` until `stop` is set (polled every 100 ms), one thread per
/// connection, each bounded by `timeout` per socket step.
pub fn serve(
    listener: TcpListener,
    l1: L1Cache,
    peers: Arc<PeerLocks>,
    stop: Arc<AtomicBool>,
    timeout: Duration,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((conn, from)) => {
                let (l1, peers) = (l1.clone(), Arc::clone(&peers));
                let spawned = std::thread::Builder::new().name("p2p-channel".into()).spawn(
                    move || {
                        if let Err(e) = serve_one(conn, &l1, &peers, timeout) {
                            tracing::debug!(peer = %from, error = %e, "p2p channel connection ended");
                        }
                    },
                );
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "cannot start a p2p channel thread");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => tracing::warn!(error = %e, "p2p channel accept failed"),
        }
    }
    Ok(())
}

fn serve_one(
    mut conn: TcpStream,
    l1: &L1Cache,
    peers: &PeerLocks,
    timeout: Duration,
) -> Result<(), ChannelError> {
    conn.set_nonblocking(false).map_err(io)?;
    conn.set_read_timeout(Some(timeout)).map_err(io)?;
    conn.set_write_timeout(Some(timeout)).map_err(io)?;
    conn.set_nodelay(true).map_err(io)?;
    let keys = read_request(&mut conn)?;
    for key in keys {
        // Only what a peer locked, read under a lease of our own while it is sent.
        let lease = key
            .filter(|k| peers.holds(k))
            .and_then(|k| l1.read_lock(std::slice::from_ref(&k), 1).pop())
            .and_then(Result::ok);
        match lease {
            Some(lease) => {
                let bytes = lease.bytes();
                let mut head = [0u8; 9];
                head[1..].copy_from_slice(&(bytes.len() as u64).to_be_bytes());
                conn.write_all(&head).map_err(io)?;
                let mut hasher = XxHash3_64::new();
                for piece in bytes.chunks(PIECE) {
                    hasher.write(piece);
                    conn.write_all(piece).map_err(io)?;
                }
                conn.write_all(&hasher.finish().to_be_bytes()).map_err(io)?;
            }
            None => conn.write_all(&[1u8]).map_err(io)?,
        }
    }
    conn.flush().map_err(io)
}

fn read_request(conn: &mut TcpStream) -> Result<Vec<Option<ObjectKey>>, ChannelError> {
    let mut head = [0u8; 12];
    conn.read_exact(&mut head).map_err(io)?;
    if &head[..8] != MAGIC {
        return Err(ChannelError::BadRequest("not an lmcache-rs p2p channel request".into()));
    }
    let len = u32::from_be_bytes([head[8], head[9], head[10], head[11]]);
    if len > MAX_REQUEST {
        return Err(ChannelError::BadRequest(format!("a request of {len} bytes")));
    }
    let mut body = vec![0u8; len as usize];
    conn.read_exact(&mut body).map_err(io)?;
    let v = lmcache_protocol::value::decode(0, &body)
        .map_err(|e| ChannelError::BadRequest(e.to_string()))?;
    let keys = decode_keys("keys", &v).map_err(|e| ChannelError::BadRequest(e.to_string()))?;
    if keys.len() > MAX_KEYS {
        return Err(ChannelError::BadRequest(format!("{} keys, more than {MAX_KEYS}", keys.len())));
    }
    Ok(keys.into_iter().map(|k| k.0).collect())
}

/// Fetches the objects of `into` (reservations, each keyed and sized as the object it is
/// for) from the peer channel at `addr`. Returns, in order, each reservation filled and
/// verified, or why not (its reservation is then dropped: nothing stays staged).
pub fn fetch(
    addr: SocketAddr,
    into: Vec<WriteReservation>,
    timeout: Duration,
) -> Vec<Result<WriteReservation, ChannelError>> {
    let n = into.len();
    let mut conn = match connect(addr, &into, timeout) {
        Ok(c) => c,
        Err(e) => return (0..n).map(|_| Err(e.clone())).collect(),
    };
    let mut out = Vec::with_capacity(n);
    let mut broken: Option<ChannelError> = None;
    for mut w in into {
        if let Some(e) = &broken {
            out.push(Err(e.clone()));
            continue;
        }
        match receive(&mut conn, &mut w) {
            Ok(()) => out.push(Ok(w)),
            // The stream is still in step after a refusal; not after a short or bad read.
            Err(e @ ChannelError::NotServed) => out.push(Err(e)),
            Err(e) => {
                broken = Some(e.clone());
                out.push(Err(e));
            }
        }
    }
    out
}

fn connect(
    addr: SocketAddr,
    into: &[WriteReservation],
    timeout: Duration,
) -> Result<TcpStream, ChannelError> {
    let mut conn = TcpStream::connect_timeout(&addr, timeout).map_err(io)?;
    conn.set_read_timeout(Some(timeout)).map_err(io)?;
    conn.set_write_timeout(Some(timeout)).map_err(io)?;
    conn.set_nodelay(true).map_err(io)?;
    let keys = Value::Array(into.iter().map(|w| WireObjectKey::encode(w.key())).collect());
    let body = lmcache_protocol::value::encode(&keys);
    let len =
        u32::try_from(body.len()).map_err(|_| ChannelError::BadRequest("too many keys".into()))?;
    let mut req = Vec::with_capacity(12 + body.len());
    req.extend_from_slice(MAGIC);
    req.extend_from_slice(&len.to_be_bytes());
    req.extend_from_slice(&body);
    conn.write_all(&req).map_err(io)?;
    Ok(conn)
}

fn receive(conn: &mut TcpStream, w: &mut WriteReservation) -> Result<(), ChannelError> {
    let mut status = [0u8; 1];
    conn.read_exact(&mut status).map_err(io)?;
    if status[0] != 0 {
        return Err(ChannelError::NotServed);
    }
    let mut len = [0u8; 8];
    conn.read_exact(&mut len).map_err(io)?;
    let got = u64::from_be_bytes(len);
    if got != w.len() {
        return Err(ChannelError::Length { expected: w.len(), got });
    }
    let mut hasher = XxHash3_64::new();
    for piece in w.as_mut_slice().chunks_mut(PIECE) {
        conn.read_exact(piece).map_err(io)?;
        hasher.write(piece);
    }
    let mut sum = [0u8; 8];
    conn.read_exact(&mut sum).map_err(io)?;
    if u64::from_be_bytes(sum) != hasher.finish() {
        return Err(ChannelError::Checksum);
    }
    Ok(())
}
