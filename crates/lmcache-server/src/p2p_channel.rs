//! The native P2P transfer channel between lmcache-rs servers: after `p2p_lookup_and_lock`, a
//! reader fetches the locked objects' bytes over TCP straight into its own L1 reservations.
//!
//! Wire (all integers big-endian):
//! - request: magic `LMRSP2P1`, a `u32` length, then a msgpack array of `ObjectKey` maps (as
//!   the P2P RPCs carry them);
//! - answer, per key in order: a status byte (0: the object follows; 1: not served), then for
//!   0 a `u64` length, the bytes, and their xxh3-64 (the L2 blob format's checksum). The
//!   sender's is L1's, computed once per object, piece by piece during its first send
//!   ([`lmcache_l1::ReadLease::hash_pieces`]); the receiver hashes each piece as it arrives.
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
use std::thread::JoinHandle;
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

/// The channel's accept thread, started on a bound listener. Accepts block: stopping wakes
/// the thread with a connection of its own, so a reader's connection is taken at once (an
/// accept that polled would keep every fetch waiting for its next poll).
#[derive(Debug)]
pub struct Listening {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    join: Option<JoinHandle<()>>,
}

impl Listening {
    /// Serves the channel on `listener`, one thread per connection, each bounded by
    /// `timeout` per socket step, until [`Listening::stop`] (or drop).
    pub fn start(
        listener: TcpListener,
        l1: L1Cache,
        peers: Arc<PeerLocks>,
        timeout: Duration,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let join = std::thread::Builder::new()
            .name("p2p-listen".into())
            .spawn(move || accept_loop(&listener, &l1, &peers, &flag, timeout))?;
        Ok(Self { addr, stop, join: Some(join) })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and waits for the accept thread (connections being served finish on
    /// their own threads, each bounded by its timeout).
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let Some(join) = self.join.take() else { return };
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept. A listener on an unspecified address takes loopback.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        match TcpStream::connect_timeout(&wake, Duration::from_secs(1)) {
            Ok(_) => {
                let _ = join.join();
            }
            // Nothing to wake it with: leave the thread (it holds no lock, only the listener).
            Err(e) => tracing::warn!(error = %e, "cannot wake the P2P channel's accept"),
        }
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.stop_now();
    }
}

fn accept_loop(
    listener: &TcpListener,
    l1: &L1Cache,
    peers: &Arc<PeerLocks>,
    stop: &AtomicBool,
    timeout: Duration,
) {
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::Acquire) {
            return;
        }
        match accepted {
            Ok((conn, from)) => {
                let (l1, peers) = (l1.clone(), Arc::clone(peers));
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
            Err(e) => {
                // EMFILE and the like: back off instead of spinning on the error.
                tracing::warn!(error = %e, "p2p channel accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn serve_one(
    mut conn: TcpStream,
    l1: &L1Cache,
    peers: &PeerLocks,
    timeout: Duration,
) -> Result<(), ChannelError> {
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
                // L1 hashes each object once, on its first send, piece by piece as the
                // bytes go; a later send of it only copies.
                let sum = lease.hash_pieces(PIECE, |piece| conn.write_all(piece)).map_err(io)?;
                conn.write_all(&sum.to_be_bytes()).map_err(io)?;
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
    // Fresh L1 pages in one call, not one fault per 4 KiB page as the socket fills them.
    w.prefault();
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

#[cfg(test)]
mod tests {
    use super::*;
    use lmcache_l1::{L1Config, WriteRequest};
    use lmcache_memory::{Arena, ArenaAllocator, ArenaBacking, ArenaConfig};
    use std::time::Instant;

    fn l1() -> L1Cache {
        let config = ArenaConfig { size: 8 << 20, backing: ArenaBacking::Anonymous, mlock: false };
        let arena = Arena::create(&config).unwrap();
        L1Cache::new(L1Config::default(), ArenaAllocator::new(arena, 4096).unwrap()).unwrap()
    }

    fn key(i: u8) -> ObjectKey {
        ObjectKey::new([i; 32], "m", 1, 0, 0, "").unwrap()
    }

    /// A holder serving one committed, peer-locked object of 4 KiB, and a reader's L1.
    fn holder_and_reader() -> (L1Cache, Listening, L1Cache) {
        let holder = l1();
        let mut w =
            holder.reserve_write(&[WriteRequest::new(key(1), 4096)]).pop().unwrap().unwrap();
        w.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = (i * 3) as u8);
        let lease = w.commit_and_read_lock(1).unwrap();
        let peers = Arc::new(PeerLocks::default());
        peers.add_task(Vec::new(), vec![(key(1), holder.park_read(lease))]);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let serving =
            Listening::start(listener, holder.clone(), peers, Duration::from_secs(5)).unwrap();
        (holder, serving, l1())
    }

    fn reserve(l1: &L1Cache) -> WriteReservation {
        l1.reserve_write(&[WriteRequest::new(key(1), 4096)]).pop().unwrap().unwrap()
    }

    #[test]
    fn a_locked_object_arrives_verified_byte_for_byte() {
        let (holder, serving, reader) = holder_and_reader();
        let got = fetch(serving.addr(), vec![reserve(&reader)], Duration::from_secs(5));
        let w = got.into_iter().next().unwrap().unwrap();
        let lease = holder.read_lock(&[key(1)], 1).pop().unwrap().unwrap();
        assert_eq!(w.as_slice(), lease.bytes());
    }

    #[test]
    fn each_fetch_is_accepted_at_once_not_at_a_poll() {
        // A polling accept (the first version slept 100 ms between polls) held back every
        // fetch that came while it slept: 20 fetches in a row took about 2 s. Accepted at
        // once, they take a few ms; 1 s leaves a wide margin on a loaded machine.
        let (_holder, serving, reader) = holder_and_reader();
        let t = Instant::now();
        for _ in 0..20 {
            let got = fetch(serving.addr(), vec![reserve(&reader)], Duration::from_secs(5));
            assert!(got[0].is_ok(), "{:?}", got[0]);
        }
        let took = t.elapsed();
        assert!(took < Duration::from_secs(1), "20 fetches took {took:?}");
    }

    #[test]
    fn stopping_ends_the_accept_thread_and_closes_the_port() {
        let (_holder, serving, _reader) = holder_and_reader();
        let addr = serving.addr();
        serving.stop();
        let refused = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
        assert!(refused.is_err(), "the port still accepts after stop");
    }
}
