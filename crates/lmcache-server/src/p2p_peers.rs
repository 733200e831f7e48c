//! P2P discovery: the peers of this server's fleet, as the coordinator lists them, polled
//! each heartbeat (`GET /instances`, ours or LMCache's), as LMCache's `P2PController` does:
//! - this server counts as registered only when the list has its own id with its own
//!   advertise URL;
//! - a peer is an instance other than this one with an advertise URL, an ip and an MQ port;
//! - a peer missing from more than 3 polls in a row is dropped;
//! - a poll that fails leaves the state `disconnected` (timeout) or `unregistered` (an error)
//!   and drops no peer.

use std::collections::BTreeMap;

use lmcache_protocol::coordinator::InstanceInfo;
use parking_lot::Mutex;
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
}

#[derive(Debug)]
struct Inner {
    state: P2pState,
    peers: BTreeMap<String, Peer>,
}

/// The peer table.
#[derive(Debug)]
pub struct Peers {
    /// This server's advertise URL.
    advertised: String,
    inner: Mutex<Inner>,
}

impl Peers {
    /// An empty table for a server advertising `advertised`.
    pub fn new(advertised: String) -> Self {
        Self {
            advertised,
            inner: Mutex::new(Inner { state: P2pState::Unregistered, peers: BTreeMap::new() }),
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
}
