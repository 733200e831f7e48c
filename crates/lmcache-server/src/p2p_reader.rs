//! The reader side of P2P: storage's [`PeerSource`]. A lookup that L1 (then L2, when attached)
//! serves short asks the fleet's peers for the rest of its prefix, on one of this module's
//! threads, never on the socket thread:
//! 1. `p2p_lookup_and_lock` on the peer's MP port, then its answer (each RPC bounded by
//!    `--p2p-lookup-timeout`);
//! 2. the longest prefix locked on every shard is reserved in L1 and fetched over the native
//!    channel into the reservations, each object verified (bounded by `--p2p-load-timeout`);
//! 3. fetched objects are committed and read-locked for the reader, like an L2 load;
//! 4. everything the peer locked is unlocked, whether the load succeeded or not.
//!
//! Peers are asked in instance-id order until one serves a prefix, over this server's
//! channel: with the native one, the peers that registered it (metadata `p2p_channel:
//! lmcache-rs-native`); with NIXL (`p2p_nixl`), the others (LMCache's servers, and ours in
//! NIXL mode). A peer is never written to.

use std::net::{SocketAddr, ToSocketAddrs as _};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use lmcache_client::Client;
use lmcache_core::ObjectKey;
use lmcache_l1::{ReadLease, WriteRequest};
use lmcache_protocol::request::{Command, P2pLookupAndLock, P2pUnlockObjects};
use lmcache_protocol::types::{LayoutDesc, TransferAddress, WireObjectKey};
use lmcache_storage::{
    PeerDone, PeerFetch, PeerSource, PrefetchOutcome, PrefetchTrouble, StorageManager,
};
use parking_lot::Mutex;
use rmpv::Value;

use crate::p2p_peers::{Peer, Peers};

/// The metadata value a server registers when it serves the native channel.
pub const NATIVE_CHANNEL: &str = "lmcache-rs-native";
/// The metadata key it goes under.
pub const CHANNEL_KEY: &str = "p2p_channel";
/// Peer fetches queued before new ones are refused (each then a plain miss).
const QUEUE: usize = 64;
/// Fetch threads.
const THREADS: usize = 2;

/// `--p2p-lookup-timeout`, `--p2p-load-timeout`.
#[derive(Debug, Clone, Copy)]
pub struct ReaderTimeouts {
    /// Each RPC to a peer.
    pub lookup: Duration,
    /// One channel fetch.
    pub load: Duration,
}

/// What one fetch did (announced to storage's subscribers: the metrics).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FetchReport {
    /// Objects fetched, verified and committed.
    pub keys: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Objects a peer locked that could not be fetched (channel, checksum, timeout).
    pub failed: usize,
    /// Of `keys`, those copied straight out of a same-host peer's pool.
    pub same_host: usize,
}

/// The channel this server reads peers over.
#[derive(Debug, Clone)]
pub enum Channel {
    /// The native channel (`p2p_channel`), with its same-host path (`p2p_same_host`).
    Native(Arc<crate::p2p_same_host::SameHost>),
    /// NIXL (`p2p_nixl`).
    Nixl(Arc<crate::p2p_nixl::NixlChannel>),
}

impl Channel {
    /// Whether a peer speaks this channel.
    pub fn speaks(&self, peer: &Peer) -> bool {
        match self {
            Self::Native(_) => peer.native,
            Self::Nixl(_) => !peer.native,
        }
    }
}

/// The reader: a bounded queue to its threads.
#[derive(Debug)]
pub struct PeerReader {
    peers: Arc<Peers>,
    channel: Channel,
    jobs: SyncSender<(PeerFetch, PeerDone)>,
    stop: Arc<AtomicBool>,
}

impl PeerReader {
    /// Starts the fetch threads over `storage` (where fetched objects land) and `peers`.
    pub fn start(
        storage: StorageManager,
        peers: Arc<Peers>,
        timeouts: ReaderTimeouts,
        channel: Channel,
    ) -> std::io::Result<Arc<Self>> {
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let stop = Arc::new(AtomicBool::new(false));
        for i in 0..THREADS {
            let (storage, peers, rx) = (storage.clone(), Arc::clone(&peers), Arc::clone(&rx));
            let (stop, channel) = (Arc::clone(&stop), channel.clone());
            std::thread::Builder::new()
                .name(format!("p2p-read-{i}"))
                .spawn(move || work(&storage, &peers, &rx, &stop, timeouts, &channel))?;
        }
        Ok(Arc::new(Self { peers, channel, jobs: tx, stop }))
    }

    /// Stops the fetch threads (within a second; a fetch under way ends first).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl PeerSource for PeerReader {
    fn has_peers(&self) -> bool {
        self.peers.has_peer(|p| self.channel.speaks(p))
    }

    fn start(&self, req: PeerFetch, done: PeerDone) {
        match self.jobs.try_send((req, done)) {
            Ok(()) => {}
            // Dropping `done` answers the lookup with what L1 had.
            Err(TrySendError::Full(_)) => tracing::debug!("P2P fetch queue full: a miss"),
            Err(TrySendError::Disconnected(_)) => {}
        }
    }
}

fn work(
    storage: &StorageManager,
    peers: &Peers,
    rx: &Mutex<Receiver<(PeerFetch, PeerDone)>>,
    stop: &AtomicBool,
    timeouts: ReaderTimeouts,
    channel: &Channel,
) {
    // One MP client per peer, kept between fetches (a connection costs more than a miss may).
    let mut clients: std::collections::HashMap<String, Client> = std::collections::HashMap::new();
    while !stop.load(Ordering::Acquire) {
        let next = rx.lock().recv_timeout(Duration::from_secs(1));
        let (req, done) = match next {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let mut outcome = PrefetchOutcome::default();
        let mut report = FetchReport::default();
        // The first peer that failed, for "why was this a miss?".
        let mut trouble = None;
        let current = peers.peers();
        clients.retain(|id, _| current.iter().any(|p| &p.instance_id == id));
        for peer in current.iter().filter(|p| channel.speaks(p)) {
            let client = match clients.entry(peer.instance_id.clone()) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    match Client::connect(&peer.mq_url, timeouts.lookup) {
                        Ok(c) => e.insert(c),
                        Err(err) => {
                            tracing::warn!(peer = %peer.instance_id, error = %err, "P2P peer unreachable: a miss");
                            trouble.get_or_insert_with(|| PrefetchTrouble::Peer {
                                peer: peer.instance_id.clone(),
                                error: format!("unreachable: {err}"),
                            });
                            continue;
                        }
                    }
                }
            };
            match fetch_from(storage, client, peer, &req, timeouts, channel, &mut report) {
                Ok(Some(o)) => {
                    outcome = o;
                    break;
                }
                Ok(None) => {}
                Err(e) => {
                    // A client whose request failed may be out of step: a new one next time.
                    clients.remove(&peer.instance_id);
                    tracing::warn!(peer = %peer.instance_id, error = %e, "P2P fetch failed: a miss");
                    trouble.get_or_insert_with(|| PrefetchTrouble::Peer {
                        peer: peer.instance_id.clone(),
                        error: e.to_string(),
                    });
                }
            }
        }
        let asked = req.shards.iter().map(Vec::len).min().unwrap_or(0);
        if outcome.hits < asked && outcome.trouble.is_none() {
            outcome.trouble = trouble;
        }
        storage.announce(&lmcache_storage::StorageEvent::PeerFetched {
            keys: report.keys,
            bytes: report.bytes,
            failed: report.failed,
            same_host: report.same_host,
        });
        done.complete(outcome);
    }
}

fn layout(req: &PeerFetch) -> Vec<(u32, LayoutDesc)> {
    vec![(0, LayoutDesc::of_object(req.object.as_ref(), ""))]
}

fn channel_addr(peer: &Peer) -> Result<SocketAddr, String> {
    let url = peer.p2p_advertised_url.strip_prefix("tcp://").unwrap_or(&peer.p2p_advertised_url);
    url.to_socket_addrs()
        .map_err(|e| format!("channel address {url:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("channel address {url:?} resolves to nothing"))
}

/// Asks one peer. `Ok(None)`: it served nothing.
fn fetch_from(
    storage: &StorageManager,
    c: &mut Client,
    peer: &Peer,
    req: &PeerFetch,
    timeouts: ReaderTimeouts,
    channel: &Channel,
    report: &mut FetchReport,
) -> Result<Option<PrefetchOutcome>, String> {
    let keys: Vec<ObjectKey> = req.shards.iter().flatten().cloned().collect();
    let n = req.shards.first().map_or(0, Vec::len);
    if n == 0 || keys.is_empty() {
        return Ok(None);
    }
    let wire = |ks: &[ObjectKey]| ks.iter().cloned().map(|k| WireObjectKey(Some(k))).collect();
    let ask = P2pLookupAndLock { keys: wire(&keys), group_layout_descs: layout(req) };
    let task = c
        .send(&Command::P2pLookupAndLock(ask))
        .map_err(|e| e.to_string())?
        .and_then(|v| v.as_u64())
        .ok_or("no task id")?;
    let deadline = Instant::now() + timeouts.lookup;
    let answer = loop {
        match c.send(&Command::P2pQueryLookupResults(task)).map_err(|e| e.to_string())? {
            Some(Value::Array(a)) => break a,
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => return Err("the peer's lookup timed out".into()),
        }
    };
    let addrs: Vec<TransferAddress> = answer
        .iter()
        .map(|v| TransferAddress::decode("answer", v).unwrap_or(TransferAddress::MISS))
        .collect();
    let locked: Vec<ObjectKey> =
        keys.iter().zip(&addrs).filter(|(_, a)| a.is_hit()).map(|(k, _)| k.clone()).collect();
    // The prefix every shard holds on the peer.
    let shards = req.shards.len();
    let prefix = (0..shards)
        .map(|s| {
            addrs.get(s * n..(s + 1) * n).map_or(0, |r| r.iter().take_while(|a| a.is_hit()).count())
        })
        .min()
        .unwrap_or(0);
    let outcome = if prefix == 0 {
        None
    } else {
        load(storage, peer, req, &addrs, n, prefix, timeouts, channel, report)
    };
    // Whatever happened, the peer's locks go.
    if !locked.is_empty() {
        let unlock = Command::P2pUnlockObjects(P2pUnlockObjects { keys: wire(&locked) });
        if let Err(e) = c.send(&unlock) {
            tracing::warn!(peer = %peer.instance_id, error = %e, "P2P unlock failed (the peer's read TTL frees them)");
        }
    }
    Ok(outcome.filter(|o| o.hits > 0))
}

/// Reserves, fetches, verifies and commits the first `prefix` chunks of every shard.
#[expect(clippy::too_many_arguments, reason = "one step of one fetch, named in full")]
fn load(
    storage: &StorageManager,
    peer: &Peer,
    req: &PeerFetch,
    addrs: &[TransferAddress],
    n: usize,
    prefix: usize,
    timeouts: ReaderTimeouts,
    channel: &Channel,
    report: &mut FetchReport,
) -> Option<PrefetchOutcome> {
    let mut wanted = Vec::new();
    for (s, keys) in req.shards.iter().enumerate() {
        for (i, k) in keys.iter().take(prefix).enumerate() {
            let size = addrs.get(s * n + i).map_or(0, |a| a.size);
            wanted.push((s, i, WriteRequest::new(k.clone(), size)));
        }
    }
    let reqs: Vec<WriteRequest> = wanted.iter().map(|(_, _, r)| r.clone()).collect();
    let mut into = Vec::new();
    let mut slots = Vec::new();
    let mut from = Vec::new();
    for ((s, i, _), r) in wanted.iter().zip(storage.reserve_write(&reqs)) {
        if let Ok(w) = r {
            into.push(w);
            slots.push((*s, *i));
            from.push(addrs.get(s * n + i).copied().unwrap_or(TransferAddress::MISS));
        }
    }
    let fetched = match channel {
        Channel::Native(same_host) => match same_host.fetch(peer, into, &from) {
            Ok(copied) => {
                report.same_host += copied.iter().filter(|r| r.is_ok()).count();
                copied
            }
            Err(into) => match channel_addr(peer) {
                Ok(addr) => crate::p2p_channel::fetch(addr, into, timeouts.load),
                Err(e) => {
                    tracing::warn!(peer = %peer.instance_id, "{e}");
                    return None;
                }
            },
        },
        Channel::Nixl(nixl) => {
            nixl.fetch(&peer.p2p_advertised_url, into, &from, timeouts.lookup, timeouts.load)
        }
    };
    // Per shard, the leases of its leading chunks that arrived whole.
    let mut per_shard: Vec<Vec<Option<ReadLease>>> =
        (0..req.shards.len()).map(|_| (0..prefix).map(|_| None).collect()).collect();
    let mut committed = Vec::new();
    for ((s, i), got) in slots.into_iter().zip(fetched) {
        match got.map(|w| (w.len(), w.commit_and_read_lock(req.readers.max(1)))) {
            Ok((len, Ok(lease))) => {
                report.keys += 1;
                report.bytes += len;
                committed.push(lease.key().clone());
                if let Some(slot) = per_shard.get_mut(s).and_then(|v| v.get_mut(i)) {
                    *slot = Some(lease);
                }
            }
            Ok((_, Err(e))) => tracing::debug!(error = %e, "a fetched object was not committed"),
            Err(e) => {
                report.failed += 1;
                tracing::warn!(peer = %peer.instance_id, error = %e, "P2P object refused: a miss");
            }
        }
    }
    // Like an L2 load, a peer's object is nothing for this server's write-behind: without
    // this, with L2 attached, it would stay "unwritten" (kept from eviction) for good.
    storage.l1().mark_written(&committed);
    let hits = per_shard.iter().map(|v| v.iter().take_while(|l| l.is_some()).count()).min()?;
    let leases =
        per_shard.into_iter().map(|v| v.into_iter().take(hits).flatten().collect()).collect();
    Some(PrefetchOutcome {
        leases,
        hits,
        loaded_keys: report.keys,
        loaded_bytes: report.bytes,
        expired: false,
        trouble: None,
    })
}
