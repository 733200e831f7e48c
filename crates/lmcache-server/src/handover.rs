//! The hot upgrade's port handover. A server whose L1 restarts warm (an L1 file with
//! `--l1-warm-restart`) offers its listening sockets (the transport's port and the HTTP
//! port) on a Unix socket named after its L1 file. A new server started with `--take-over`
//! receives them (`SCM_RIGHTS`) before it asks the old one to stop and serves on the same
//! sockets: a connection that arrives while the old server drains and the new one adopts the
//! L1 waits in the listen queue instead of being refused.
//!
//! Trust: the socket lives in the abstract namespace, so anyone on the host can connect. The
//! offering side hands the sockets only to a process of its own user; the receiving side takes
//! them only from the process that holds the L1 file (the pid `--take-over` found), and only
//! listening TCP sockets bound where the header says. A socket the new server's flags do not
//! ask for is closed, not used.

use std::io::{IoSlice, IoSliceMut};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, sockopt};
use serde::{Deserialize, Serialize};
use thiserror::Error;

const VERSION: u32 = 1;
/// At most this many sockets in one handover (the roles below, with room to grow).
const MAX_FDS: usize = 8;

/// What a handed-over socket serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The request transport's port (ZMQ or gRPC, `--port`).
    Transport,
    /// The HTTP API's port (`--http-port`).
    Http,
}

/// Listening sockets received from the server taken over, by role.
#[derive(Debug, Default)]
pub struct Listeners {
    /// The transport's port.
    pub transport: Option<TcpListener>,
    /// The HTTP port.
    pub http: Option<TcpListener>,
}

impl Listeners {
    /// The roles received.
    pub fn roles(&self) -> Vec<Role> {
        let mut r = Vec::new();
        if self.transport.is_some() {
            r.push(Role::Transport);
        }
        if self.http.is_some() {
            r.push(Role::Http);
        }
        r
    }
}

/// Why no sockets were received.
#[derive(Debug, Error)]
pub enum HandoverError {
    /// Nothing listens on the handover socket (a server of an older version, or one whose
    /// L1 does not restart warm).
    #[error("the old server offers no port handover ({0})")]
    NotOffered(std::io::Error),
    /// The process at the other end is not the one that holds the L1 file.
    #[error("the handover socket is held by pid {found:?}, not by the L1 file's holder {want}")]
    NotTheHolder {
        /// The pid `--take-over` signals.
        want: u32,
        /// The pid at the other end of the handover socket.
        found: Option<u32>,
    },
    /// The message was not a handover this version understands.
    #[error("the handover message is malformed: {0}")]
    Malformed(String),
    /// A socket call failed.
    #[error("handover: {0}")]
    Io(#[from] std::io::Error),
}

#[derive(Serialize, Deserialize)]
struct Header {
    version: u32,
    sockets: Vec<(Role, SocketAddr)>,
}

/// The abstract socket name of the L1 file at `l1_path` (its canonical path, hashed).
pub fn socket_name(l1_path: &Path) -> String {
    let path = std::fs::canonicalize(l1_path).unwrap_or_else(|_| l1_path.to_path_buf());
    let hash = twox_hash::XxHash3_64::oneshot(path.as_os_str().as_encoded_bytes());
    format!("lmcache-rs-handover-{hash:016x}")
}

/// The offering side: a thread that hands duplicates of the listening sockets to each
/// process of this user that connects. Dropping it stops the thread and closes the
/// duplicates.
#[derive(Debug)]
pub struct Offer {
    name: String,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Offer {
    /// Offers `sockets` under `name`. Fails when the name is taken (another process offers
    /// under it: that one keeps it).
    pub fn start(name: &str, sockets: Vec<(Role, TcpListener)>) -> std::io::Result<Self> {
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        let listener = UnixListener::bind_addr(&addr)?;
        let mut header = Header { version: VERSION, sockets: Vec::new() };
        for (role, l) in &sockets {
            header.sockets.push((*role, l.local_addr()?));
        }
        let header = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new().name("handover".into()).spawn(move || {
            let fds: Vec<&TcpListener> = sockets.iter().map(|(_, l)| l).collect();
            for conn in listener.incoming() {
                if stopping.load(Ordering::Acquire) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                if let Err(e) = hand_to(&conn, &header, &fds) {
                    tracing::warn!(error = %e, "port handover refused or failed");
                }
            }
        })?;
        Ok(Self { name: name.to_owned(), stop, thread: Some(thread) })
    }
}

impl Drop for Offer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept with a connection of our own, and join the thread once it is
        // woken; should that connection fail, the thread is left to the process's exit
        // rather than a shutdown hung on it.
        let woken = std::os::unix::net::SocketAddr::from_abstract_name(self.name.as_bytes())
            .and_then(|addr| UnixStream::connect_addr(&addr))
            .is_ok();
        if let Some(t) = self.thread.take()
            && woken
        {
            let _ = t.join();
        }
    }
}

fn hand_to(conn: &UnixStream, header: &[u8], fds: &[&TcpListener]) -> std::io::Result<()> {
    let peer = nix::sys::socket::getsockopt(conn, sockopt::PeerCredentials)?;
    let me = nix::unistd::geteuid().as_raw();
    if peer.uid() != me {
        return Err(std::io::Error::other(format!(
            "pid {} runs as uid {}, not this server's {me}",
            peer.pid(),
            peer.uid()
        )));
    }
    let raw: Vec<_> = fds.iter().map(|l| l.as_raw_fd()).collect();
    nix::sys::socket::sendmsg::<()>(
        conn.as_raw_fd(),
        &[IoSlice::new(header)],
        &[ControlMessage::ScmRights(&raw)],
        MsgFlags::empty(),
        None,
    )?;
    tracing::info!(pid = peer.pid(), sockets = fds.len(), "handed the listening ports over");
    Ok(())
}

/// The receiving side: takes the sockets offered under `name` by process `from_pid`.
pub fn receive(name: &str, from_pid: u32, timeout: Duration) -> Result<Listeners, HandoverError> {
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let conn = UnixStream::connect_addr(&addr).map_err(HandoverError::NotOffered)?;
    let peer = nix::sys::socket::getsockopt(&conn, sockopt::PeerCredentials)
        .map_err(std::io::Error::from)?;
    if u32::try_from(peer.pid()).ok() != Some(from_pid) {
        return Err(HandoverError::NotTheHolder {
            want: from_pid,
            found: u32::try_from(peer.pid()).ok(),
        });
    }
    conn.set_read_timeout(Some(timeout))?;
    let mut buf = vec![0u8; 4096];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; MAX_FDS]);
    let (len, raw) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = nix::sys::socket::recvmsg::<()>(
            conn.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(std::io::Error::from)?;
        let mut raw = Vec::new();
        for c in msg.cmsgs().map_err(std::io::Error::from)? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                raw.extend(fds);
            }
        }
        (msg.bytes, raw)
    };
    // Owned first, so that every descriptor received is closed on any error below.
    let fds = crate::fd_passing::own_received(raw);
    let header: Header =
        serde_json::from_slice(&buf[..len]).map_err(|e| HandoverError::Malformed(e.to_string()))?;
    if header.version != VERSION {
        return Err(HandoverError::Malformed(format!("version {}", header.version)));
    }
    if header.sockets.len() != fds.len() {
        return Err(HandoverError::Malformed(format!(
            "{} sockets announced, {} received",
            header.sockets.len(),
            fds.len()
        )));
    }
    let mut out = Listeners::default();
    for ((role, addr), fd) in header.sockets.into_iter().zip(fds) {
        let listener = listening_at(fd, addr)?;
        let slot = match role {
            Role::Transport => &mut out.transport,
            Role::Http => &mut out.http,
        };
        *slot = Some(listener);
    }
    Ok(out)
}

/// `fd` as a listener, if it is a listening TCP socket bound at `addr`.
fn listening_at(fd: OwnedFd, addr: SocketAddr) -> Result<TcpListener, HandoverError> {
    let listening = nix::sys::socket::getsockopt(&fd.as_fd(), sockopt::AcceptConn)
        .map_err(|e| HandoverError::Malformed(format!("a socket for {addr}: {e}")))?;
    let listener = TcpListener::from(fd);
    let bound = listener.local_addr().ok();
    if !listening || bound != Some(addr) {
        return Err(HandoverError::Malformed(format!(
            "the socket announced for {addr} is {bound:?}, listening: {listening}"
        )));
    }
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// `listener` if it listens on one of the addresses `target` (`host:port`) resolves to;
/// `None` (it is closed) otherwise, or when the port is 0 (any free port: nothing to keep).
pub fn take_if_at(listener: Option<TcpListener>, target: &str) -> Option<TcpListener> {
    let listener = listener?;
    let have = listener.local_addr().ok()?;
    let wanted: Vec<SocketAddr> = target.to_socket_addrs().map(|a| a.collect()).unwrap_or_default();
    if have.port() != 0 && wanted.contains(&have) {
        Some(listener)
    } else {
        tracing::info!(
            inherited = %have,
            asked = target,
            "a port handed over is not the one asked for: closed, binding afresh"
        );
        None
    }
}

/// A listening socket for the ZMQ `endpoint` (`tcp://host:port`) that this process holds,
/// so it can hand it over later: `inherited` when it is bound there, else a new one. `None`
/// for an endpoint that is not TCP or does not resolve (ZMQ then binds it itself).
pub fn zmq_listener(
    endpoint: &str,
    inherited: Option<TcpListener>,
) -> std::io::Result<Option<TcpListener>> {
    let Some(addr) = zmq_tcp_addr(endpoint) else { return Ok(None) };
    if let Some(l) = take_if_at(inherited, &addr.to_string()) {
        return Ok(Some(l));
    }
    let l = TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    Ok(Some(l))
}

/// ZMQ's spelling of "every interface" as the socket API's.
fn host_for_resolve(host: &str) -> &str {
    match host {
        "*" => "0.0.0.0",
        h => h.trim_start_matches('[').trim_end_matches(']'),
    }
}

/// The address a `tcp://host:port` ZMQ endpoint binds: IPv4 first, as ZMQ (IPv6 off)
/// resolves it. `None` for other transports or an address that does not resolve.
pub fn zmq_tcp_addr(endpoint: &str) -> Option<SocketAddr> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let port: u16 = if port == "*" { 0 } else { port.parse().ok()? };
    let mut addrs = (host_for_resolve(host), port).to_socket_addrs().ok()?;
    addrs.find(SocketAddr::is_ipv4)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(tag: &str) -> String {
        format!("lmcache-rs-handover-test-{tag}-{}", std::process::id())
    }

    fn listener() -> TcpListener {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        l
    }

    #[test]
    fn the_sockets_offered_are_received_listening_at_the_same_ports() {
        let (t, h) = (listener(), listener());
        let (ta, ha) = (t.local_addr().unwrap(), h.local_addr().unwrap());
        let n = name("ok");
        let offer = Offer::start(&n, vec![(Role::Transport, t), (Role::Http, h)]).unwrap();
        let got = receive(&n, std::process::id(), Duration::from_secs(5)).unwrap();
        assert_eq!(got.roles(), vec![Role::Transport, Role::Http]);
        let (t2, h2) = (got.transport.unwrap(), got.http.unwrap());
        assert_eq!((t2.local_addr().unwrap(), h2.local_addr().unwrap()), (ta, ha));
        // The offer closes its copies; the received ones keep the ports, and a connection
        // made now is accepted by them.
        drop(offer);
        let _c = std::net::TcpStream::connect(ha).unwrap();
        t2.set_nonblocking(false).unwrap();
        h2.set_nonblocking(false).unwrap();
        assert!(h2.accept().is_ok());
    }

    #[test]
    fn sockets_are_taken_only_from_the_l1_files_holder() {
        let n = name("pid");
        let _offer = Offer::start(&n, vec![(Role::Http, listener())]).unwrap();
        let err = receive(&n, std::process::id() + 1, Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(err, HandoverError::NotTheHolder { found: Some(p), .. } if p == std::process::id()),
            "{err}"
        );
        let err = receive(&name("nobody"), 1, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, HandoverError::NotOffered(_)), "{err}");
    }

    #[test]
    fn a_name_already_offered_is_not_taken_over() {
        let n = name("dup");
        let _first = Offer::start(&n, vec![(Role::Http, listener())]).unwrap();
        assert!(Offer::start(&n, vec![(Role::Http, listener())]).is_err());
    }

    #[test]
    fn an_inherited_listener_is_kept_only_at_the_port_asked_for() {
        let l = listener();
        let port = l.local_addr().unwrap().port();
        assert!(take_if_at(Some(l), &format!("127.0.0.1:{port}")).is_some());
        let l = listener();
        let port = l.local_addr().unwrap().port();
        assert!(take_if_at(Some(l), &format!("127.0.0.1:{}", port.wrapping_add(1))).is_none());
        let l = listener();
        assert!(take_if_at(Some(l), "127.0.0.1:0").is_none(), "port 0 asks for a fresh port");
        assert!(take_if_at(None, "127.0.0.1:1").is_none());
        // A ZMQ endpoint keeps the inherited socket at its port, else binds its own.
        let l = listener();
        let at = l.local_addr().unwrap();
        let kept = zmq_listener(&format!("tcp://127.0.0.1:{}", at.port()), Some(l)).unwrap();
        assert_eq!(kept.unwrap().local_addr().unwrap(), at);
        let fresh = zmq_listener("tcp://127.0.0.1:0", Some(listener())).unwrap().unwrap();
        assert_ne!(fresh.local_addr().unwrap(), at);
        assert!(zmq_listener("ipc:///tmp/x", None).unwrap().is_none());
    }

    #[test]
    fn zmq_endpoints_resolve_as_zmq_binds_them() {
        assert_eq!(zmq_tcp_addr("tcp://*:5555"), Some("0.0.0.0:5555".parse().unwrap()));
        assert_eq!(zmq_tcp_addr("tcp://127.0.0.1:7"), Some("127.0.0.1:7".parse().unwrap()));
        assert_eq!(zmq_tcp_addr("tcp://localhost:7"), Some("127.0.0.1:7".parse().unwrap()));
        assert_eq!(zmq_tcp_addr("tcp://127.0.0.1:*"), Some("127.0.0.1:0".parse().unwrap()));
        assert_eq!(zmq_tcp_addr("ipc:///tmp/x"), None);
        assert_eq!(zmq_tcp_addr("tcp://127.0.0.1:notaport"), None);
    }

    #[test]
    fn socket_names_follow_the_canonical_l1_path() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("l1");
        std::fs::write(&f, b"").unwrap();
        let dotted = dir.path().join(".").join("l1");
        assert_eq!(socket_name(&f), socket_name(&dotted));
        assert_ne!(socket_name(&f), socket_name(&dir.path().join("other")));
    }
}
