//! The NIXL P2P channel, LMCache 0.5.6's default (`--p2p-transfer-engine nixl`): how a
//! fleet that mixes LMCache's servers with ours moves L1 objects, both ways.
//!
//! As LMCache's `NixlTransferChannelContext` does, the server makes one NIXL agent (UCX),
//! registers its whole L1 arena as DRAM and lists it as `--l1-align-bytes` pages; a peer
//! reads objects by the `{offset, size}` that `p2p_query_lookup_results` answered, as page
//! indices into that list.
//! - Serving: a ZMQ REP socket on the listen URL answers LMCache's handshake (msgpack maps
//!   tagged by `type`): `InitReq {agent_name, agent_meta}` → `InitResp` with ours, then
//!   `MemRegReq {sender_agent_name, sender_advertise_url, xfer_descs}` → `MemRegResp
//!   {xfer_descs}` with our page list, pickled as NIXL's Python does (in the asker's module).
//!   The bytes then move without us: the peer's UCX reads the arena.
//! - Reading: per peer (by advertise URL) the same handshake over ZMQ REQ, once; then one
//!   READ per fetch of the peer's pages straight into our L1 reservations, bounded by
//!   `--p2p-load-timeout`. A failed or timed-out READ is released (aborted) before its
//!   reservations are dropped, and the peer's link is made afresh next time; one NIXL could
//!   not abort retires its reservations for good rather than reuse memory it may still
//!   write.
//!
//! Unlike the native channel, NIXL carries no checksum of ours: the bytes are what UCX
//! delivered (TCP's own checks on loopback and Ethernet), as in LMCache. And NIXL exposes the
//! whole registered arena to every agent that completed the handshake, as LMCache's does, so
//! unlike LMCache's the handshake is answered only for a host a registered peer of the fleet
//! has ([`HandshakeGate`]; an unknown one waits for a discovery poll, bounded, then is
//! refused and counted); docs/ARCHITECTURE.md's threat model says what that means.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lmcache_l1::{L1Cache, WriteReservation};
use lmcache_nixl::{Agent, DescList, L1Registration, Nixl, NixlError, Prepped};
use lmcache_protocol::types::TransferAddress;
use parking_lot::Mutex;
use rmpv::Value;

use crate::p2p_channel::ChannelError;

/// The most bytes one handshake message may carry (a page list of a 1 TiB arena in 4 KiB
/// pages is 6 GiB; LMCache's L1 sizes stay far below this).
const MAX_MESSAGE: i64 = 1 << 31;

/// A peer we read from: its agent and its prepped page list.
struct PeerLink {
    name: String,
    remote: Prepped,
}

/// Who may take part in the handshake: whether a connection from this address may be a peer
/// of the fleet (it may wait, bounded, for discovery to catch up).
pub type HandshakeGate = Arc<dyn Fn(IpAddr) -> bool + Send + Sync>;

/// The link to one peer URL, made by one thread at a time: a second fetch from a peer being
/// dialled waits for that handshake instead of loading the same agent twice.
#[derive(Default)]
struct LinkSlot(Mutex<Option<Arc<PeerLink>>>);

/// This server's NIXL side: its agent, the registered arena and the links to peers.
pub struct NixlChannel {
    // Drop order: the links' prepped lists, then our registration, then the agent.
    links: Mutex<HashMap<String, Arc<LinkSlot>>>,
    l1: L1Registration,
    agent: Arc<Agent>,
    /// The Python module our pickles name when we dial (the wheel we loaded).
    module: String,
    advertise: String,
}

impl std::fmt::Debug for NixlChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlChannel")
            .field("agent", &self.agent.name())
            .field("l1", &self.l1)
            .finish()
    }
}

impl NixlChannel {
    /// Loads NIXL from `library`, makes the agent (named after `instance`) and registers
    /// `l1`'s arena with it.
    pub fn start(
        library: &Path,
        l1: L1Cache,
        advertise: String,
        instance: &str,
    ) -> Result<Arc<Self>, NixlError> {
        let nixl = Nixl::load(library)?;
        let agent = nixl.agent(&format!("lmcache-rs-{instance}-{}", std::process::id()))?;
        let registration = agent.register_l1(&l1)?;
        let module = module_of(library);
        tracing::info!(
            agent = agent.name(),
            pages = registration.pages().descs.len(),
            page = registration.page(),
            library = %library.display(),
            "NIXL P2P channel: L1 registered"
        );
        Ok(Arc::new(Self {
            links: Mutex::new(HashMap::new()),
            l1: registration,
            agent,
            module,
            advertise,
        }))
    }

    /// Serves LMCache's handshake on `listen` until `stop` is set (checked every 100 ms), to
    /// connections `gate` admits; `refused` counts the others.
    pub fn serve(
        self: &Arc<Self>,
        listen: SocketAddr,
        stop: Arc<AtomicBool>,
        gate: HandshakeGate,
        refused: prometheus_client::metrics::counter::Counter,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::REP).map_err(std::io::Error::other)?;
        sock.set_linger(0).map_err(std::io::Error::other)?;
        sock.set_rcvtimeo(100).map_err(std::io::Error::other)?;
        sock.set_maxmsgsize(MAX_MESSAGE).map_err(std::io::Error::other)?;
        bind_handshake(&sock, listen)?;
        let this = Arc::clone(self);
        std::thread::Builder::new().name("p2p-nixl".into()).spawn(move || {
            let _ctx = ctx;
            while !stop.load(Ordering::Acquire) {
                let mut msg = match sock.recv_msg(0) {
                    Ok(m) => m,
                    Err(zmq::Error::EAGAIN) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "NIXL handshake socket failed");
                        continue;
                    }
                };
                let from = msg.gets("Peer-Address").and_then(|a| a.parse::<IpAddr>().ok());
                let reply = match from {
                    Some(ip) if gate(ip) => this.answer(&msg),
                    other => {
                        refused.inc();
                        Err(match other {
                            Some(ip) => format!("{ip} is no registered peer of this fleet"),
                            None => "the connection's address is unknown".to_owned(),
                        })
                    }
                };
                let reply = reply.unwrap_or_else(|why| {
                    tracing::warn!(error = %why, "NIXL handshake refused");
                    tagged("Error", vec![("reason", Value::from(why))])
                });
                if let Err(e) = sock.send(lmcache_protocol::value::encode(&reply), 0) {
                    tracing::warn!(error = %e, "NIXL handshake reply failed");
                }
            }
        })
    }

    fn answer(&self, msg: &[u8]) -> Result<Value, String> {
        let v = lmcache_protocol::value::decode(0, msg).map_err(|e| e.to_string())?;
        match field(&v, "type").and_then(Value::as_str) {
            Some("InitReq") => {
                let meta = bin(&v, "agent_meta")?;
                let peer = self.agent.add_remote(meta).map_err(|e| e.to_string())?;
                tracing::info!(peer, "NIXL peer connected");
                let ours = self.agent.metadata().map_err(|e| e.to_string())?;
                Ok(tagged(
                    "InitResp",
                    vec![
                        ("agent_name", Value::from(self.agent.name())),
                        ("agent_meta", Value::Binary(ours)),
                    ],
                ))
            }
            Some("MemRegReq") => {
                // Read (and so validate) the asker's list; we dial it ourselves to read.
                let (list, module) =
                    DescList::from_pickle(bin(&v, "xfer_descs")?).map_err(|e| e.to_string())?;
                tracing::debug!(pages = list.descs.len(), module, "NIXL peer listed its L1");
                Ok(tagged("MemRegResp", vec![("xfer_descs", Value::Binary(self.pickle(&module)))]))
            }
            other => Err(format!("unexpected handshake message {other:?}")),
        }
    }

    fn pickle(&self, module: &str) -> Vec<u8> {
        self.l1.pages().to_pickle(module)
    }

    /// The link to the peer at `url` (handshake on first use, one at a time per URL).
    fn link(&self, url: &str, timeout: Duration) -> Result<Arc<PeerLink>, String> {
        let slot = Arc::clone(self.links.lock().entry(url.to_owned()).or_default());
        let mut link = slot.0.lock();
        if let Some(l) = link.as_ref() {
            return Ok(Arc::clone(l));
        }
        let made = Arc::new(self.connect(url, timeout)?);
        *link = Some(Arc::clone(&made));
        Ok(made)
    }

    /// Drops the link to `url` (a READ failed): the next fetch dials afresh.
    fn forget(&self, url: &str) {
        let slot = self.links.lock().remove(url);
        if let Some(l) = slot.and_then(|s| s.0.lock().take()) {
            self.agent.remove_remote(&l.name);
        }
    }

    fn connect(&self, url: &str, timeout: Duration) -> Result<PeerLink, String> {
        let bare = url.strip_prefix("tcp://").unwrap_or(url);
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::REQ).map_err(|e| e.to_string())?;
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        sock.set_linger(0).map_err(|e| e.to_string())?;
        sock.set_rcvtimeo(ms).map_err(|e| e.to_string())?;
        sock.set_sndtimeo(ms).map_err(|e| e.to_string())?;
        sock.set_maxmsgsize(MAX_MESSAGE).map_err(|e| e.to_string())?;
        sock.connect(&format!("tcp://{bare}")).map_err(|e| format!("connect {bare}: {e}"))?;
        let ask = |v: Value, want: &str| -> Result<Value, String> {
            sock.send(lmcache_protocol::value::encode(&v), 0)
                .map_err(|e| format!("sending the handshake to {bare}: {e}"))?;
            let bytes = sock
                .recv_bytes(0)
                .map_err(|e| format!("no handshake answer from {bare} in {timeout:?}: {e}"))?;
            let r = lmcache_protocol::value::decode(0, &bytes).map_err(|e| e.to_string())?;
            match field(&r, "type").and_then(Value::as_str) {
                Some(t) if t == want => Ok(r),
                other => Err(format!("{bare} answered {other:?}, not {want}")),
            }
        };
        let meta = self.agent.metadata().map_err(|e| e.to_string())?;
        let init = ask(
            tagged(
                "InitReq",
                vec![
                    ("agent_name", Value::from(self.agent.name())),
                    ("agent_meta", Value::Binary(meta)),
                ],
            ),
            "InitResp",
        )?;
        let name = self.agent.add_remote(bin(&init, "agent_meta")?).map_err(|e| e.to_string())?;
        let memreg = ask(
            tagged(
                "MemRegReq",
                vec![
                    ("sender_agent_name", Value::from(self.agent.name())),
                    ("sender_advertise_url", Value::from(self.advertise.as_str())),
                    ("xfer_descs", Value::Binary(self.pickle(&self.module))),
                ],
            ),
            "MemRegResp",
        )?;
        let (list, _) =
            DescList::from_pickle(bin(&memreg, "xfer_descs")?).map_err(|e| e.to_string())?;
        // Offsets become page indices with our alignment, as LMCache's reader does: the
        // peer's pages must be ours.
        if let Some(d) = list.descs.first().filter(|d| d.len != self.l1.page()) {
            return Err(format!(
                "{bare} lists {}-byte pages; ours are {} (--l1-align-bytes must match)",
                d.len,
                self.l1.page()
            ));
        }
        let remote = self.agent.prep_remote(&name, &list).map_err(|e| e.to_string())?;
        tracing::info!(peer = %bare, agent = name, pages = list.descs.len(), "NIXL peer linked");
        Ok(PeerLink { name, remote })
    }

    /// Reads the objects at `from` (the peer's answer for each reservation) from the peer
    /// whose channel is at `url` into `into`, in one READ. Returns, in order, each
    /// reservation filled, or why not (then dropped: nothing stays staged).
    pub fn fetch(
        &self,
        url: &str,
        into: Vec<WriteReservation>,
        from: &[TransferAddress],
        lookup_timeout: Duration,
        load_timeout: Duration,
    ) -> Vec<Result<WriteReservation, ChannelError>> {
        let n = into.len();
        let fail = |e: String| (0..n).map(|_| Err(ChannelError::Io(e.clone()))).collect();
        let link = match self.link(url, lookup_timeout) {
            Ok(l) => l,
            Err(e) => return fail(format!("NIXL link to {url}: {e}")),
        };
        // Objects whose answer does not fit their reservation are refused alone.
        let mut out: Vec<Option<Result<WriteReservation, ChannelError>>> = Vec::with_capacity(n);
        let mut objects = Vec::new();
        let mut slots = Vec::new();
        for (i, (w, a)) in into.into_iter().zip(from).enumerate() {
            match u64::try_from(a.offset) {
                _ if a.size != w.len() => {
                    out.push(Some(Err(ChannelError::Length { expected: w.len(), got: a.size })))
                }
                Ok(off) => {
                    out.push(None);
                    objects.push((w, off));
                    slots.push(i);
                }
                Err(_) => out.push(Some(Err(ChannelError::NotServed))),
            }
        }
        match self.agent.read_into(&self.l1, &link.remote, objects, Instant::now() + load_timeout) {
            Ok(filled) => {
                for (i, w) in slots.into_iter().zip(filled) {
                    if let Some(slot) = out.get_mut(i) {
                        *slot = Some(Ok(w));
                    }
                }
            }
            Err(e) => {
                self.forget(url);
                let why = format!("NIXL READ from {url}: {e}");
                for i in slots {
                    if let Some(slot) = out.get_mut(i) {
                        *slot = Some(Err(ChannelError::Io(why.clone())));
                    }
                }
            }
        }
        out.into_iter().map(|r| r.unwrap_or(Err(ChannelError::NotServed))).collect()
    }
}

/// The Python module a pickle names for the wheel `library` came from.
fn module_of(library: &Path) -> String {
    let dir = library.parent().and_then(Path::file_name).and_then(|d| d.to_str()).unwrap_or("");
    let package = dir.strip_prefix('.').and_then(|d| d.strip_suffix(".mesonpy.libs"));
    format!("{}._bindings", package.unwrap_or("nixl_cu12"))
}

fn tagged(kind: &str, fields: Vec<(&str, Value)>) -> Value {
    let mut m = vec![(Value::from("type"), Value::from(kind))];
    m.extend(fields.into_iter().map(|(k, v)| (Value::from(k), v)));
    Value::Map(m)
}

fn field<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.as_map()?.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v)
}

fn bin<'a>(v: &'a Value, name: &str) -> Result<&'a [u8], String> {
    match field(v, name) {
        Some(Value::Binary(b)) => Ok(b),
        _ => Err(format!("handshake field {name:?} missing or not bytes")),
    }
}

/// Binds the handshake socket on `listen`. A port already taken keeps its kind
/// ([`std::io::ErrorKind::AddrInUse`]), so a caller that picked the port can pick another.
fn bind_handshake(sock: &zmq::Socket, listen: SocketAddr) -> std::io::Result<()> {
    sock.bind(&format!("tcp://{listen}")).map_err(|e| {
        let kind = match e {
            zmq::Error::EADDRINUSE => std::io::ErrorKind::AddrInUse,
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, format!("binding the NIXL handshake socket on {listen}: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handshake_port_already_taken_says_so_by_its_kind() {
        let ctx = zmq::Context::new();
        let first = ctx.socket(zmq::REP).unwrap();
        first.set_linger(0).unwrap();
        first.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = first.get_last_endpoint().unwrap().unwrap();
        let taken: SocketAddr = endpoint.trim_start_matches("tcp://").parse().unwrap();
        let second = ctx.socket(zmq::REP).unwrap();
        second.set_linger(0).unwrap();
        let err = bind_handshake(&second, taken).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");
        assert!(err.to_string().contains(&taken.to_string()), "{err}");
    }

    #[test]
    fn pickles_name_the_wheel_the_library_came_from() {
        let m = |p: &str| module_of(Path::new(p));
        assert_eq!(
            m("/v/site-packages/.nixl_cu12.mesonpy.libs/libnixl_capi.so"),
            "nixl_cu12._bindings"
        );
        assert_eq!(m("/v/site-packages/.nixl.mesonpy.libs/libnixl_capi.so"), "nixl._bindings");
        assert_eq!(m("/opt/nixl/lib/libnixl_capi.so"), "nixl_cu12._bindings");
    }

    #[test]
    fn handshake_messages_are_tagged_maps() {
        let v = tagged(
            "InitReq",
            vec![("agent_name", Value::from("a")), ("agent_meta", Value::Binary(vec![1]))],
        );
        let bytes = lmcache_protocol::value::encode(&v);
        // msgspec's tagged struct: a map whose first key is "type".
        assert_eq!(&bytes[..14], b"\x83\xa4type\xa7InitReq");
        let back = lmcache_protocol::value::decode(0, &bytes).unwrap();
        assert_eq!(bin(&back, "agent_meta").unwrap(), &[1]);
        assert!(bin(&back, "agent_name").unwrap_err().contains("not bytes"));
    }
}
