//! p2p_lookup_and_lock, p2p_query_lookup_results, p2p_unlock_objects: what this server
//! answers a peer of its fleet about its L1, as LMCache's `P2PController` does.
//!
//! - A lookup read-locks, once per key, every key resident in L1 (L1 only, gaps allowed) and
//!   answers a task id. Keys are bucketed by object group: when the groups got different key
//!   counts, or a group has no layout, every key is a miss (logged), as in LMCache.
//! - The task's answer is given exactly once, in request order: `{offset, size}` of each
//!   locked object in the L1 pool (offset from its base), `{offset: -1, size: 0}` for a miss.
//!   An unknown or consumed task id answers nil.
//! - An unlock releases one lock per key. A lock the peer never releases expires with the L1
//!   read TTL. A peer is never written to, and never writes here.

use std::collections::BTreeMap;

use lmcache_core::ObjectKey;
use lmcache_protocol::ProtocolError;
use lmcache_protocol::request::{Command, P2pLookupAndLock, P2pUnlockObjects};
use lmcache_protocol::types::TransferAddress;
use rmpv::Value;

use crate::state::RequestState;

pub(super) fn handle(state: &RequestState, cmd: Command) -> Result<Option<Value>, ProtocolError> {
    match cmd {
        Command::P2pLookupAndLock(req) => Ok(Some(Value::from(lookup_and_lock(state, req)))),
        Command::P2pQueryLookupResults(id) => Ok(Some(match state.peers.take_answer(id) {
            Some(answer) => Value::Array(answer.iter().map(TransferAddress::encode).collect()),
            None => {
                tracing::warn!(task_id = id, "P2P lookup task unknown or already answered");
                Value::Nil
            }
        })),
        Command::P2pUnlockObjects(P2pUnlockObjects { keys }) => {
            let keys: Vec<ObjectKey> = keys.into_iter().filter_map(|k| k.0).collect();
            let ids = state.peers.take_leases(&keys);
            let leases = ids.into_iter().map(|id| state.l1().take_read(id)).collect();
            state.storage.unlock_for_peer(leases);
            Ok(None)
        }
        other => Err(ProtocolError::UnsupportedOp(other.encode().0.name())),
    }
}

/// The keys LMCache's controller would look up: all of them, unless the object groups got
/// different key counts or one has no layout (then none).
fn servable(req: &P2pLookupAndLock) -> bool {
    let mut counts: BTreeMap<u32, usize> = BTreeMap::new();
    for k in req.keys.iter().filter_map(|k| k.0.as_ref()) {
        *counts.entry(k.object_group_id).or_default() += 1;
    }
    let mut sizes = counts.values();
    let first = sizes.next().copied();
    if sizes.any(|&n| Some(n) != first) {
        tracing::error!(?counts, "P2P lookup: object groups got different key counts; all miss");
        return false;
    }
    if let Some(g) = counts.keys().find(|g| !req.group_layout_descs.iter().any(|(id, _)| id == *g))
    {
        tracing::error!(object_group = g, "P2P lookup: no layout for an object group; all miss");
        return false;
    }
    true
}

fn lookup_and_lock(state: &RequestState, req: P2pLookupAndLock) -> u64 {
    let mut answer = vec![TransferAddress::MISS; req.keys.len()];
    let mut parked = Vec::new();
    if !servable(&req) {
        let keys = req.keys.len();
        state.storage.announce(&lmcache_storage::StorageEvent::PeerLocked { keys, found: 0 });
    } else {
        let (positions, keys): (Vec<usize>, Vec<ObjectKey>) =
            req.keys.iter().enumerate().filter_map(|(i, k)| Some((i, k.0.clone()?))).unzip();
        let locked = state.storage.lock_for_peer(&keys);
        for ((i, key), lease) in positions.into_iter().zip(keys).zip(locked) {
            let Some(lease) = lease else { continue };
            if let (Some(slot), Ok(offset)) = (answer.get_mut(i), i64::try_from(lease.offset())) {
                *slot = TransferAddress { offset, size: lease.len() };
                parked.push((key, state.l1().park_read(lease)));
            }
        }
    }
    state.peers.add_task(answer, parked)
}
