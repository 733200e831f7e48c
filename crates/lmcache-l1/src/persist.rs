//! Restart warm: the objects of an L1 that lives in a file arena (`--l1-devdax-path`)
//! outlive the process.
//!
//! - **Seal.** Each object committed (not temporary ones) is queued; the [`Sealer`] thread
//!   hashes its bytes (xxh3-64, the checksum L2 blobs carry too, so it is computed once) and
//!   records key, place and checksum in the arena's catalog
//!   ([`lmcache_memory::Allocation::persist`]). Off the request path: a store's reply never
//!   waits for it. An object killed before its seal is simply not adopted.
//! - **Adopt.** At start, [`L1Cache::adopt`] makes every object the arena verified resident
//!   again (newest record first when two name the same key), oldest first into the eviction
//!   policy; [`L1Cache::announce_resident`] then tells the listener (the coordinator, KV
//!   events) about them once it is installed.
//! - **Shut down warm.** [`L1Cache::drain_seals`] waits for queued seals, then the arena's
//!   [`lmcache_memory::ArenaAllocator::detach_catalog`] keeps every record as its object
//!   drops.
//!
//! Keys are stored in a compact binary form ([`encode_key`]); one that does not fit a record
//! (a model name and salt of more than about 150 bytes together) is served but not kept.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lmcache_core::{CacheSalt, ChunkHash, KvRank, ModelName, ObjectKey};
use parking_lot::{Condvar, Mutex};

use crate::entry::ObjectMemory;
use crate::set::L1Cache;

const KEY_VERSION: u8 = 1;

/// `key` in the catalog's binary form: version, hash, kv rank, group, model, salt.
pub fn encode_key(key: &ObjectKey) -> Vec<u8> {
    let (model, salt) = (key.model_name.as_str().as_bytes(), key.cache_salt.as_str().as_bytes());
    let mut b = Vec::with_capacity(45 + model.len() + salt.len());
    b.push(KEY_VERSION);
    b.extend_from_slice(&key.chunk_hash.0);
    b.extend_from_slice(&key.kv_rank.packed().to_le_bytes());
    b.extend_from_slice(&key.object_group_id.to_le_bytes());
    for part in [model, salt] {
        b.extend_from_slice(&(part.len().min(u16::MAX as usize) as u16).to_le_bytes());
        b.extend_from_slice(part);
    }
    b
}

/// The key [`encode_key`] wrote; `None` for anything else (every field validated again).
pub fn decode_key(b: &[u8]) -> Option<ObjectKey> {
    let mut r = b;
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, rest) = r.split_at_checked(n)?;
        r = rest;
        Some(head)
    };
    if take(1)? != [KEY_VERSION] {
        return None;
    }
    let hash = ChunkHash::from_slice(take(32)?).ok()?;
    let rank = u32::from_le_bytes(take(4)?.try_into().ok()?);
    let group = u32::from_le_bytes(take(4)?.try_into().ok()?);
    let mut string = || -> Option<String> {
        let n = u16::from_le_bytes(take(2)?.try_into().ok()?) as usize;
        String::from_utf8(take(n)?.to_vec()).ok()
    };
    let (model, salt) = (string()?, string()?);
    if !r.is_empty() {
        return None;
    }
    Some(ObjectKey {
        chunk_hash: hash,
        model_name: ModelName::new(&model).ok()?,
        kv_rank: KvRank::from_packed(rank).ok()?,
        object_group_id: group,
        cache_salt: CacheSalt::new(&salt).ok()?,
    })
}

/// Counters of sealing and adoption.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PersistStats {
    /// Objects recorded in the catalog.
    pub sealed: u64,
    /// Objects that could not be recorded (catalog full, key too long): served, not kept.
    pub seal_failed: u64,
    /// Objects gone before their turn to be sealed.
    pub seal_skipped: u64,
    /// Objects waiting to be sealed.
    pub pending: u64,
    /// Objects adopted at start.
    pub adopted: u64,
    /// Bytes adopted at start.
    pub adopted_bytes: u64,
    /// Adopted objects dropped by L1: a key that does not decode, or a second record of a
    /// key (the newest is kept).
    pub adopt_refused: u64,
}

/// The queue of committed objects to seal, shared by the L1 and its [`Sealer`].
#[derive(Debug, Default)]
pub(crate) struct SealQueue {
    queue: Mutex<Queue>,
    /// Signalled when work arrives, when the queue empties, and at stop.
    changed: Condvar,
    sealed: AtomicU64,
    failed: AtomicU64,
    skipped: AtomicU64,
}

#[derive(Debug, Default)]
struct Queue {
    items: VecDeque<(Weak<ObjectMemory>, ObjectKey)>,
    /// Items taken and not finished.
    busy: u64,
    stop: bool,
}

impl SealQueue {
    /// Queues a committed object (called under the L1 lock: only a push).
    pub(crate) fn push(&self, memory: &Arc<ObjectMemory>, key: &ObjectKey) {
        self.queue.lock().items.push_back((Arc::downgrade(memory), key.clone()));
        self.changed.notify_all();
    }

    pub(crate) fn stats(&self) -> (u64, u64, u64, u64) {
        let q = self.queue.lock();
        (
            self.sealed.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.skipped.load(Ordering::Relaxed),
            q.items.len() as u64 + q.busy,
        )
    }

    /// Waits until nothing is queued or being sealed, at most `timeout`; returns how many
    /// objects were still waiting.
    pub(crate) fn drain(&self, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        let mut q = self.queue.lock();
        while !(q.items.is_empty() && q.busy == 0) {
            if self.changed.wait_until(&mut q, deadline).timed_out() {
                break;
            }
        }
        q.items.len() as u64 + q.busy
    }

    fn run(&self) {
        loop {
            let (memory, key) = {
                let mut q = self.queue.lock();
                loop {
                    if q.stop {
                        return;
                    }
                    if let Some(item) = q.items.pop_front() {
                        q.busy += 1;
                        break item;
                    }
                    self.changed.wait(&mut q);
                }
            };
            self.seal(&memory, &key);
            let mut q = self.queue.lock();
            q.busy -= 1;
            drop(q);
            self.changed.notify_all();
        }
    }

    fn seal(&self, memory: &Weak<ObjectMemory>, key: &ObjectKey) {
        let Some(memory) = memory.upgrade() else {
            self.skipped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let sum = memory.checksum();
        match memory.persist(&encode_key(key), sum) {
            Ok(_) => {
                self.sealed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                if self.failed.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!(%key, error = %e, "an L1 object will not survive a restart");
                }
            }
        }
    }
}

/// Owns the sealing thread of an L1 in a file arena; dropping it stops the thread (what is
/// still queued then is not sealed: call [`L1Cache::drain_seals`] first).
#[derive(Debug)]
pub struct Sealer {
    /// One thread per member in a file arena.
    threads: Vec<(Arc<SealQueue>, Option<JoinHandle<()>>)>,
}

impl Sealer {
    /// Starts a thread for each member whose memory keeps a catalog; `None` when none does.
    pub fn spawn(cache: &L1Cache) -> std::io::Result<Option<Self>> {
        let mut this = Self { threads: Vec::new() };
        for (tag, member) in cache.members() {
            let Some(queue) = member.seal_queue() else { continue };
            let q = Arc::clone(&queue);
            let name = if cache.member_count() == 1 {
                "l1-sealer".into()
            } else {
                format!("l1-sealer-{tag}")
            };
            // A failed spawn drops `this`, which stops the threads already started.
            let thread = std::thread::Builder::new().name(name).spawn(move || q.run())?;
            this.threads.push((queue, Some(thread)));
        }
        Ok((!this.threads.is_empty()).then_some(this))
    }
}

impl Drop for Sealer {
    fn drop(&mut self) {
        for (queue, _) in &self.threads {
            queue.queue.lock().stop = true;
            queue.changed.notify_all();
        }
        for (_, thread) in &mut self.threads {
            if let Some(t) = thread.take()
                && t.join().is_err()
            {
                tracing::error!("l1 sealer thread panicked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn keys_round_trip(
            hash in any::<[u8; 32]>(),
            world in 1u32..64,
            worker in 0u32..64,
            group in any::<u32>(),
            model in "[a-zA-Z0-9/_.-]{1,60}",
            salt in "[a-z0-9]{0,40}",
        ) {
            let key = ObjectKey {
                chunk_hash: ChunkHash(hash),
                model_name: ModelName::new(&model).unwrap(),
                kv_rank: KvRank::new(world, worker % world).unwrap(),
                object_group_id: group,
                cache_salt: CacheSalt::new(&salt).unwrap(),
            };
            let b = encode_key(&key);
            prop_assert_eq!(decode_key(&b), Some(key));
            // Any truncation or extension is refused, never misread.
            for cut in 0..b.len() {
                prop_assert_eq!(decode_key(&b[..cut]), None);
            }
            let mut longer = b.clone();
            longer.push(0);
            prop_assert_eq!(decode_key(&longer), None);
        }
    }

    #[test]
    fn invalid_fields_are_refused() {
        let key = ObjectKey {
            chunk_hash: ChunkHash([7; 32]),
            model_name: ModelName::new("m").unwrap(),
            kv_rank: KvRank::new(1, 0).unwrap(),
            object_group_id: 0,
            cache_salt: CacheSalt::EMPTY,
        };
        let b = encode_key(&key);
        let mut at = b.clone();
        let model_at = 1 + 32 + 8 + 2;
        at[model_at] = b'@';
        assert_eq!(decode_key(&at), None, "a model name with @");
        let mut v = b.clone();
        v[0] = 9;
        assert_eq!(decode_key(&v), None, "another version");
    }
}
