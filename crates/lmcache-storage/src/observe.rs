//! What storage tells its subscribers: one typed [`StorageEvent`] per thing that happened to a
//! request's KV (asked, looked up, settled, reserved, refused, committed, read, finished),
//! each carrying the [`RequestContext`] the caller handed storage.
//!
//! The request path calls storage and nothing else; metrics, KV events, the coordinator
//! reporter, trace recording and lookup-hash logs are [`StorageSubscriber`]s, in the spirit
//! of foyer's monitored engine. Storage operations publish their own events; the marks only
//! a caller knows (a request began, a request's copy ended) go through
//! [`crate::StorageManager::announce`].
//!
//! Subscribers run on the request's thread, in the order they were installed: each must be
//! cheap and must never block (queue, count, or drop).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use lmcache_core::{ChunkHash, ModelName, ObjectKey, ObjectShape};
use lmcache_l1::L1Error;

use crate::GroupLookupRequest;
use crate::lookup::Settled;

/// Who a storage call is for: the request, its model and shard, the chunk range it covers,
/// and the shapes of the model's objects. Borrowed for the call; storage keeps none of it.
#[derive(Debug, Clone, Copy)]
pub struct RequestContext<'a> {
    /// The request.
    pub request_id: &'a str,
    /// Its model.
    pub model: &'a ModelName,
    /// The engine worker (KV shard) the call is for.
    pub shard: u32,
    /// Tokens per chunk.
    pub chunk_size: usize,
    /// Index of the chunk `hashes[0]` is.
    pub first_chunk: usize,
    /// The chunk hashes of the range.
    pub hashes: &'a [ChunkHash],
    /// The hash of the chunk before the range (`None` at chunk 0).
    pub parent: Option<ChunkHash>,
    /// The request's tokens (all of them, from token 0).
    pub tokens: &'a [u32],
    /// The model's object groups, in order (empty when unknown).
    pub objects: &'a [ObjectShape],
}

impl RequestContext<'_> {
    /// The tokens of chunk `j` of the range, when the request carried them.
    pub fn chunk_tokens(&self, j: usize) -> Option<&[u32]> {
        let abs = self.first_chunk + j;
        self.tokens.get(abs * self.chunk_size..(abs + 1) * self.chunk_size)
    }

    /// The hash before chunk `j` of the range.
    pub fn parent_of(&self, j: usize) -> Option<ChunkHash> {
        if j == 0 { self.parent } else { self.hashes.get(j - 1).copied() }
    }
}

/// Something that happened to a request's KV.
#[derive(Debug)]
pub enum StorageEvent<'a> {
    /// A lookup of `chunks` whole chunks was asked for (also one that finds nothing to look
    /// up: an unregistered model, a prompt under one chunk).
    LookupAsked {
        /// The request.
        request_id: &'a str,
        /// Whole chunks asked for.
        chunks: usize,
    },
    /// A lookup goes to the tiers with these keys (every object group, every shard).
    LookupStarted {
        /// Who for.
        ctx: &'a RequestContext<'a>,
        /// What is looked up.
        request: &'a GroupLookupRequest,
    },
    /// A lookup answered from L1; `pending` when an L2 prefetch of the rest runs.
    LookedUp {
        /// Who for.
        ctx: &'a RequestContext<'a>,
        /// Shards looked up.
        shards: usize,
        /// Leading chunks L1 serves on every shard.
        l1_hits: usize,
        /// Whether a prefetch is still to settle.
        pending: bool,
    },
    /// A pending lookup's prefetch ended and was joined to it: chunks
    /// `settled.hits - settled.l2_hits..settled.hits` of the range came from L2 or the peers
    /// and are resident in L1 now.
    LookupSettled {
        /// Who for (the lookup's range, from chunk 0).
        ctx: &'a RequestContext<'a>,
        /// Whole chunks asked for.
        chunks: usize,
        /// What the prefetch added.
        settled: Settled,
    },
    /// A store (or an engine-driven prepare_store) began.
    StoreStarted {
        /// The request.
        request_id: &'a str,
    },
    /// L1 memory is being reserved for `keys` of object group `object_group`.
    WriteReserving {
        /// Who for.
        ctx: &'a RequestContext<'a>,
        /// The object group.
        object_group: u32,
        /// The keys asked for.
        keys: &'a [ObjectKey],
    },
    /// L1 refused one key of a store (out of memory, over quota, bad size).
    WriteRefused {
        /// Who for.
        ctx: &'a RequestContext<'a>,
        /// The key.
        key: &'a ObjectKey,
        /// Why.
        error: &'a L1Error,
    },
    /// Written objects were committed (`results[i]` is `keys[i]`'s).
    Committed {
        /// Who for.
        ctx: &'a RequestContext<'a>,
        /// The keys committed.
        keys: &'a [ObjectKey],
        /// Each one's result.
        results: &'a [Result<(), L1Error>],
    },
    /// A store ended: `committed` are the chunks of the range (indexes into `ctx.hashes`)
    /// now stored in every object group that holds data for them.
    StoreFinished {
        /// Who for.
        ctx: &'a RequestContext<'a>,
        /// The chunks stored.
        committed: &'a [usize],
        /// Bytes the server copied (0 when the client copied them).
        bytes: u64,
        /// How long the server's copy took (`None` when the client copied).
        copy_time: Option<Duration>,
    },
    /// A retrieve (or an engine-driven prepare_retrieve) began.
    RetrieveStarted {
        /// The request.
        request_id: &'a str,
    },
    /// A retrieve took read leases on `keys` to copy from.
    ReadLeased {
        /// Who for.
        ctx: &'a RequestContext<'a>,
        /// The keys.
        keys: &'a [ObjectKey],
    },
    /// A retrieve ended having copied `chunks` chunks out.
    RetrieveFinished {
        /// The request.
        request_id: &'a str,
        /// Chunks read.
        chunks: usize,
        /// Bytes the server copied (0 when the client copied them).
        bytes: u64,
        /// How long the server's copy took (`None` when the client copied).
        copy_time: Option<Duration>,
    },
    /// A peer of the fleet asked which of `keys` L1 holds; `found` of them were read-locked for
    /// it (once each, until it unlocks them or the read lease expires).
    PeerLocked {
        /// Keys asked for.
        keys: usize,
        /// Keys locked.
        found: usize,
    },
    /// A peer unlocked keys: `released` locks went back, `expired` had expired first.
    PeerUnlocked {
        /// Locks released.
        released: usize,
        /// Locks that had expired before the unlock came.
        expired: usize,
    },
    /// A fetch from the fleet's peers ended (P2P, the reader side).
    PeerFetched {
        /// Objects fetched, verified and committed into L1.
        keys: usize,
        /// Their bytes.
        bytes: u64,
        /// Objects a peer locked that did not arrive whole (channel, checksum, timeout).
        failed: usize,
        /// Of `keys`, those copied straight out of a same-host peer's pool.
        same_host: usize,
    },
    /// A request ended; `touched` are the keys it used (now first in line to stay in L1).
    SessionEnded {
        /// The request.
        request_id: &'a str,
        /// The keys it used.
        touched: &'a [ObjectKey],
    },
}

/// Hears storage events. Called on the request's thread: never block.
pub trait StorageSubscriber: Send + Sync + std::fmt::Debug {
    /// One event.
    fn on_event(&self, event: &StorageEvent<'_>);
}

/// The installed subscribers: set once, then read without a lock.
#[derive(Debug, Clone, Default)]
pub(crate) struct Subscribers(Arc<OnceLock<Vec<Arc<dyn StorageSubscriber>>>>);

impl Subscribers {
    /// Installs `subs`; false (and nothing changes) when some were installed before.
    pub(crate) fn install(&self, subs: Vec<Arc<dyn StorageSubscriber>>) -> bool {
        self.0.set(subs).is_ok()
    }

    /// Tells every subscriber, in order.
    pub(crate) fn publish(&self, event: &StorageEvent<'_>) {
        if let Some(subs) = self.0.get() {
            for s in subs {
                s.on_event(event);
            }
        }
    }

    /// Whether any subscriber is installed (callers skip building what nobody hears).
    pub(crate) fn any(&self) -> bool {
        self.0.get().is_some_and(|s| !s.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;

    #[derive(Debug, Default)]
    struct Log(Mutex<Vec<String>>);

    impl StorageSubscriber for Log {
        fn on_event(&self, event: &StorageEvent<'_>) {
            let line = match event {
                StorageEvent::StoreStarted { request_id } => format!("store {request_id}"),
                other => format!("{other:?}").split_whitespace().next().unwrap_or("").into(),
            };
            self.0.lock().push(line);
        }
    }

    #[test]
    fn subscribers_hear_events_in_order_and_install_once() {
        let subs = Subscribers::default();
        assert!(!subs.any());
        subs.publish(&StorageEvent::StoreStarted { request_id: "nobody hears" });
        let (a, b) = (Arc::new(Log::default()), Arc::new(Log::default()));
        assert!(subs.install(vec![a.clone(), b.clone()]));
        assert!(!subs.install(vec![Arc::new(Log::default())]), "a second install is refused");
        subs.publish(&StorageEvent::StoreStarted { request_id: "r1" });
        subs.publish(&StorageEvent::RetrieveStarted { request_id: "r1" });
        assert_eq!(*a.0.lock(), vec!["store r1".to_owned(), "RetrieveStarted".to_owned()]);
        assert_eq!(*a.0.lock(), *b.0.lock());
    }

    #[test]
    fn a_context_names_each_chunks_tokens_and_parent() {
        let model = ModelName::new("m").unwrap();
        let hashes = [ChunkHash([1; 32]), ChunkHash([2; 32])];
        let tokens: Vec<u32> = (0..12).collect();
        let ctx = RequestContext {
            request_id: "r",
            model: &model,
            shard: 0,
            chunk_size: 4,
            first_chunk: 1,
            hashes: &hashes,
            parent: Some(ChunkHash([9; 32])),
            tokens: &tokens,
            objects: &[],
        };
        assert_eq!(ctx.chunk_tokens(0), Some(&[4, 5, 6, 7][..]));
        assert_eq!(ctx.chunk_tokens(1), Some(&[8, 9, 10, 11][..]));
        assert_eq!(ctx.chunk_tokens(2), None, "past the tokens the request carried");
        assert_eq!(ctx.parent_of(0), Some(ChunkHash([9; 32])));
        assert_eq!(ctx.parent_of(1), Some(hashes[0]));
    }
}
