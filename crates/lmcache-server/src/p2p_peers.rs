//! P2P discovery: the peers of this server's fleet, as the coordinator lists them, polled
//! each heartbeat (`GET /instances`, ours or LMCache's), as LMCache's `P2PController` does:
//! - this server counts as registered only when the list has its own id with its own
//!   advertise URL;
//! - a peer is an instance other than this one with an advertise URL, an ip and an MQ port;
//! - a peer missing from more than 3 polls in a row is dropped;
//! - a poll that fails leaves the state `disconnected` (timeout) or `unregistered` (an error)
//!   and drops no peer.
//!
//! The table also says who may take part in the NIXL handshake ([`Peers::knows`]): only a
//! host some peer registered, by its `ip` or its advertise URL.

use std::collections::BTreeMap;
use std::net::{IpAddr, ToSocketAddrs as _};
use std::time::{Duration, Instant};

use lmcache_protocol::coordinator::InstanceInfo;
use parking_lot::{Condvar, Mutex};
use serde::Serialize;

/// Polls a peer may miss before it is dropped.
pub const MAX_MISSED_POLLS: u32 = 3;

/// Where discovery stands (`/status`'s `p2p_state`, LMCache's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum P2pState {
    /// Not listed with its own advertise URL (yet), or the coordinator answered an error.
    Unregistered,
    /// Listed: peers are current.
    Registered,
    /// The coordinator did not answer in time.
    Disconnected,
}

/// One peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Peer {
    /// Its instance id.
    pub instance_id: String,
    /// Its MP server, `tcp://ip:mq_port`.
    pub mq_url: String,
    /// Its transfer-channel address.
    pub p2p_advertised_url: String,
    /// Polls in a row it was missing from.
    pub missed_polls: u32,
    /// Whether it registered lmcache-rs's native channel (the only one this server reads).
    pub native: bool,
    /// The host it registered as `ip`.
    #[serde(skip)]
    pub ip: String,
    /// Its L1 pool's segment and identity, when it registered them (see
    /// [`crate::p2p_same_host`]).
    #[serde(skip)]
    pub shm: Option<(String, String)>,
}

impl Peer {
    /// Whether a connection from `from` may be this peer: `from` is its registered ip or
    /// the host of its advertise URL (a name is resolved).
    pub fn is_at(&self, from: IpAddr) -> bool {
        [self.ip.as_str(), host_of(&self.p2p_advertised_url)].into_iter().any(|h| {
            match h.trim_matches(|c| c == '[' || c == ']').parse::<IpAddr>() {
                Ok(ip) => ip == from,
                Err(_) => {
                    (h, 0).to_socket_addrs().is_ok_and(|mut addrs| addrs.any(|a| a.ip() == from))
                }
            }
        })
    }
}

/// The host of `host:port` or `tcp://host:port` (brackets kept off an IPv6 literal).
fn host_of(url: &str) -> &str {
    let bare = url.strip_prefix("tcp://").unwrap_or(url);
    let host = bare.rsplit_once(':').map_or(bare, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

#[derive(Debug)]
struct Inner {
    state: P2pState,
    peers: BTreeMap<String, Peer>,
    /// Successful polls so far.
    polls: u64,
}

/// The peer table.
#[derive(Debug)]
pub struct Peers {
    /// This server's advertise URL.
    advertised: String,
    inner: Mutex<Inner>,
    /// Signalled after every successful poll.
    polled: Condvar,
}

impl Peers {
    /// An empty table for a server advertising `advertised`.
    pub fn new(advertised: String) -> Self {
        Self {
            advertised,
            inner: Mutex::new(Inner {
                state: P2pState::Unregistered,
                peers: BTreeMap::new(),
                polls: 0,
            }),
            polled: Condvar::new(),
        }
    }

    /// This server's advertise URL.
    pub fn advertised(&self) -> &str {
        &self.advertised
    }

    /// Applies one successful poll of `GET /instances`; `me` is the id this server
    /// registered as, if it has.
    pub fn apply(&self, me: Option<&str>, instances: &[InstanceInfo]) {
        let listed = me.is_some_and(|me| {
            instances.iter().any(|i| i.instance_id == me && i.p2p_advertised_url == self.advertised)
        });
        let mut g = self.inner.lock();
        g.polls += 1;
        self.polled.notify_all();
        if !listed {
            g.state = P2pState::Unregistered;
            g.peers.clear();
            return;
        }
        g.state = P2pState::Registered;
        let seen: BTreeMap<String, Peer> = instances
            .iter()
            .filter(|i| Some(i.instance_id.as_str()) != me)
            .filter(|i| !i.p2p_advertised_url.is_empty() && !i.ip.is_empty() && i.mq_port > 0)
            .map(|i| {
                let host = if i.ip.contains(':') { format!("[{}]", i.ip) } else { i.ip.clone() };
                let peer = Peer {
                    instance_id: i.instance_id.clone(),
                    mq_url: format!("tcp://{host}:{}", i.mq_port),
                    p2p_advertised_url: i.p2p_advertised_url.clone(),
                    missed_polls: 0,
                    native: i.metadata.get(crate::p2p_reader::CHANNEL_KEY).map(String::as_str)
                        == Some(crate::p2p_reader::NATIVE_CHANNEL),
                    ip: i.ip.clone(),
                    shm: i
                        .metadata
                        .get(crate::p2p_same_host::SHM_KEY)
                        .cloned()
                        .zip(i.metadata.get(crate::p2p_same_host::SHM_ID_KEY).cloned()),
                };
                (i.instance_id.clone(), peer)
            })
            .collect();
        for (id, p) in g.peers.iter_mut() {
            if !seen.contains_key(id) {
                p.missed_polls += 1;
            }
        }
        g.peers.retain(|_, p| p.missed_polls <= MAX_MISSED_POLLS);
        for (id, p) in seen {
            g.peers.insert(id, p);
        }
    }

    /// A poll failed: `timed_out` when the coordinator did not answer in time.
    pub fn poll_failed(&self, timed_out: bool) {
        self.inner.lock().state =
            if timed_out { P2pState::Disconnected } else { P2pState::Unregistered };
    }

    /// The state.
    pub fn state(&self) -> P2pState {
        self.inner.lock().state
    }

    /// Whether this server is registered and has a peer for which `reads` holds (one it
    /// can read from over its channel).
    pub fn has_peer(&self, reads: impl Fn(&Peer) -> bool) -> bool {
        let g = self.inner.lock();
        g.state == P2pState::Registered && g.peers.values().any(reads)
    }

    /// Whether `from` is the host of a current peer (a registered instance other than this
    /// one). When it is not, waits up to `wait` for the polls to come (each signals), so a
    /// server that registered just now is admitted once this one has seen it.
    pub fn knows(&self, from: IpAddr, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        loop {
            // Checked off the lock: a name in an advertise URL may take a DNS lookup, and
            // every short lookup asks this table.
            let (peers, seen) = {
                let g = self.inner.lock();
                (g.peers.values().cloned().collect::<Vec<_>>(), g.polls)
            };
            if peers.iter().any(|p| p.is_at(from)) {
                return true;
            }
            let mut g = self.inner.lock();
            while g.polls == seen {
                if self.polled.wait_until(&mut g, deadline).timed_out() {
                    return false;
                }
            }
        }
    }

    /// The current peers, by instance id.
    pub fn peers(&self) -> Vec<Peer> {
        self.inner.lock().peers.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: &str, url: &str, port: u32) -> InstanceInfo {
        InstanceInfo {
            instance_id: id.into(),
            ip: "10.0.0.1".into(),
            http_port: 8080,
            registration_time: 0.0,
            metadata: Default::default(),
            p2p_advertised_url: url.into(),
            mq_port: port,
        }
    }

    #[test]
    fn registered_only_when_listed_with_its_own_url_and_peers_drop_after_missed_polls() {
        let p = Peers::new("me:7600".into());
        let me = info("me", "me:7600", 5555);
        let a = info("a", "a:7600", 5556);
        // Not listed yet, or listed with another URL: unregistered, no peers.
        p.apply(Some("me"), std::slice::from_ref(&a));
        assert_eq!((p.state(), p.peers().len()), (P2pState::Unregistered, 0));
        p.apply(Some("me"), &[info("me", "other:1", 5555), a.clone()]);
        assert_eq!(p.state(), P2pState::Unregistered);
        // Listed: `a` is a peer; an instance without a URL or MQ port is not.
        p.apply(Some("me"), &[me.clone(), a.clone(), info("b", "", 5557), info("c", "c:1", 0)]);
        assert_eq!(p.state(), P2pState::Registered);
        let peers = p.peers();
        assert_eq!(peers.len(), 1);
        assert_eq!(peers[0].mq_url, "tcp://10.0.0.1:5556");
        // `a` missing: kept for 3 polls, dropped at the 4th.
        for missed in 1..=MAX_MISSED_POLLS {
            p.apply(Some("me"), std::slice::from_ref(&me));
            assert_eq!(p.peers()[0].missed_polls, missed);
        }
        p.apply(Some("me"), std::slice::from_ref(&me));
        assert!(p.peers().is_empty());
        // A failed poll changes the state, not the peers.
        p.apply(Some("me"), &[me, a]);
        p.poll_failed(true);
        assert_eq!((p.state(), p.peers().len()), (P2pState::Disconnected, 1));
    }

    #[test]
    fn only_a_registered_peers_host_is_known_and_a_poll_can_admit_one_late() {
        let p = std::sync::Arc::new(Peers::new("me:7600".into()));
        let me = info("me", "me:7600", 5555);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let a = InstanceInfo { ip: "10.0.0.7".into(), ..info("a", "127.0.0.1:7600", 5556) };
        p.apply(Some("me"), &[me.clone(), a]);
        let no_wait = Duration::ZERO;
        assert!(p.knows(ip("10.0.0.7"), no_wait), "its registered ip");
        assert!(p.knows(ip("127.0.0.1"), no_wait), "its advertise URL's host");
        assert!(!p.knows(ip("10.0.0.8"), no_wait), "a host no peer registered");
        assert!(!p.knows(ip("10.0.0.1"), no_wait), "this server's own registration is no peer");
        // A host that registers while a handshake waits is admitted at the next poll.
        let waiter = {
            let p = std::sync::Arc::clone(&p);
            std::thread::spawn(move || p.knows(ip("10.0.0.9"), Duration::from_secs(10)))
        };
        std::thread::sleep(Duration::from_millis(50));
        let b = info("b", "10.0.0.9:7600", 5557);
        p.apply(Some("me"), &[me, b]);
        assert!(waiter.join().unwrap());
        let t0 = Instant::now();
        assert!(!p.knows(ip("10.0.0.10"), Duration::from_millis(100)));
        assert!(t0.elapsed() >= Duration::from_millis(100), "the wait is bounded, not skipped");
        assert_eq!(host_of("tcp://[::1]:7600"), "::1");
        assert_eq!(host_of("node-3:7600"), "node-3");
    }
}
