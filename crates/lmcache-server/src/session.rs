//! Request sessions: the tokens and chunk hashes of one request, and the read locks its
//! lookup took. A session is created on demand, dropped by `end_session` or by the reaper
//! once older than the session TTL (counted from creation, as LMCache does). Dropping a
//! session drops its leases, which releases their locks.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lmcache_core::{ChunkHash, ObjectKey, PrefixHasher, TokenHasher};
use lmcache_l1::ReadLease;
use parking_lot::Mutex;

/// The read locks of one lookup: `locks[shard][chunk]`, each holding what is left of the
/// `num_kv_readers` locks taken.
#[derive(Debug, Default)]
pub struct LookupLocks {
    /// Per shard (worker id), per chunk of the hit prefix.
    pub locks: Vec<Vec<Option<ReadLease>>>,
}

impl LookupLocks {
    /// Releases one lock of shard `shard` on chunks `range`.
    pub fn release_one(&mut self, shard: usize, range: std::ops::Range<usize>) {
        let Some(chunks) = self.locks.get_mut(shard) else { return };
        for slot in chunks.iter_mut().skip(range.start).take(range.len()) {
            if let Some(lease) = slot {
                if lease.count() > 1 {
                    drop(lease.split(1));
                } else {
                    *slot = None;
                }
            }
        }
    }

    /// Releases every lock on chunks `range`, all shards.
    pub fn release_all(&mut self, range: std::ops::Range<usize>) {
        for chunks in &mut self.locks {
            for slot in chunks.iter_mut().skip(range.start).take(range.len()) {
                *slot = None;
            }
        }
    }
}

/// Where the last lookup of a request stands.
#[derive(Debug, Default)]
pub enum LookupState {
    /// No lookup, or its hits were handed out.
    #[default]
    Idle,
    /// The hit count of the last lookup, until `query_prefetch_status` takes it.
    Ready(usize),
    /// An L2 prefetch of the last lookup runs (a later lookup replaces it; dropping the handle
    /// abandons it, and its leases are released when it ends).
    Pending(PendingLookup),
}

/// A lookup waiting for its L2 prefetch.
#[derive(Debug)]
pub struct PendingLookup {
    /// The prefetch.
    pub handle: lmcache_storage::PrefetchHandle,
    /// Chunks L1 served.
    pub l1_hit: usize,
    /// Chunks asked for.
    pub chunks: usize,
    /// Shards looked up (their leases go to these slots).
    pub shards: Vec<u32>,
}

/// A prefetch that ended and was joined to its session: what the metrics and events report.
#[derive(Debug, Clone, Copy)]
pub struct Settled {
    /// Chunks asked for.
    pub chunks: usize,
    /// Chunks served in all (L1 then L2).
    pub hits: usize,
    /// Of those, chunks L2 added.
    pub l2_hits: usize,
    /// Objects loaded from L2.
    pub loaded_keys: usize,
}

/// One request's state.
#[derive(Debug)]
pub struct Session {
    created: Instant,
    base: TokenHasher,
    hasher: PrefixHasher,
    tokens: Vec<u32>,
    /// The last lookup: idle, its hits, or its prefetch.
    pub hits: LookupState,
    /// The last lookup's read locks.
    pub lookup: LookupLocks,
    /// Keys the request touched (for the LRU touch at `end_session`).
    pub touched: Vec<ObjectKey>,
}

impl Session {
    fn new(hasher: &TokenHasher) -> Self {
        Self {
            created: Instant::now(),
            base: *hasher,
            hasher: hasher.prefix_hasher(),
            tokens: Vec::new(),
            hits: LookupState::Idle,
            lookup: LookupLocks::default(),
            touched: Vec::new(),
        }
    }

    /// If the last lookup's prefetch has ended, joins its leases to the lookup's and makes its
    /// hits ready. Returns what it added, once.
    pub fn settle(&mut self) -> Option<Settled> {
        let LookupState::Pending(p) = &self.hits else { return None };
        let out = p.handle.poll()?;
        let LookupState::Pending(p) = std::mem::take(&mut self.hits) else { return None };
        for (&w, leases) in p.shards.iter().zip(out.leases) {
            if let Some(slots) = self.lookup.locks.get_mut(w as usize) {
                slots.extend(leases.into_iter().map(Some));
            }
        }
        let hits = p.l1_hit + out.hits;
        self.hits = LookupState::Ready(hits);
        Some(Settled { chunks: p.chunks, hits, l2_hits: out.hits, loaded_keys: out.loaded_keys })
    }

    /// Chunk hashes of the first `chunks` chunks of `tokens`. Incremental: when `tokens`
    /// extends what the session saw before, only the new chunks are hashed.
    pub fn chunk_hashes(&mut self, tokens: &[u32], chunks: usize) -> Vec<ChunkHash> {
        // Reset unless one sequence extends the other (a prefix of what was hashed needs no
        // new work; an extension needs only its new chunks).
        if !self.tokens.starts_with(tokens) && !tokens.starts_with(&self.tokens) {
            self.hasher = self.base.prefix_hasher();
            self.tokens.clear();
        }
        if tokens.len() > self.tokens.len() {
            let new = &tokens[self.tokens.len()..];
            self.hasher.extend(new);
            self.tokens.extend_from_slice(new);
        }
        self.hasher.hashes().iter().take(chunks).copied().collect()
    }
}

/// All sessions.
#[derive(Debug)]
pub struct Sessions {
    hasher: TokenHasher,
    ttl: Duration,
    map: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    /// An empty table.
    pub fn new(hasher: TokenHasher, ttl: Duration) -> Self {
        Self { hasher, ttl, map: Mutex::new(HashMap::new()) }
    }

    /// Runs `f` on the session of `request_id`, creating it if needed.
    pub fn with<R>(&self, request_id: &str, f: impl FnOnce(&mut Session) -> R) -> R {
        let mut map = self.map.lock();
        let s = map.entry(request_id.to_owned()).or_insert_with(|| Session::new(&self.hasher));
        f(s)
    }

    /// Runs `f` on an existing session.
    pub fn with_existing<R>(
        &self,
        request_id: &str,
        f: impl FnOnce(&mut Session) -> R,
    ) -> Option<R> {
        self.map.lock().get_mut(request_id).map(f)
    }

    /// Removes a session, returning it (its locks are released when it is dropped).
    pub fn remove(&self, request_id: &str) -> Option<Session> {
        self.map.lock().remove(request_id)
    }

    /// Drops sessions older than the TTL; returns how many.
    pub fn reap(&self, now: Instant) -> usize {
        let expired: Vec<Session> = {
            let mut map = self.map.lock();
            let ids: Vec<String> = map
                .iter()
                .filter(|(_, s)| now.duration_since(s.created) >= self.ttl)
                .map(|(k, _)| k.clone())
                .collect();
            ids.iter().filter_map(|k| map.remove(k)).collect()
        };
        expired.len()
    }

    /// Live sessions.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every session.
    pub fn clear(&self) {
        let all: Vec<Session> = self.map.lock().drain().map(|(_, s)| s).collect();
        drop(all);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_incremental_and_reset_on_divergence() {
        let h = TokenHasher::new(4).unwrap();
        let sessions = Sessions::new(h, Duration::from_secs(600));
        let toks: Vec<u32> = (0..12).collect();
        let a = sessions.with("r", |s| s.chunk_hashes(&toks[..8], 2));
        let b = sessions.with("r", |s| s.chunk_hashes(&toks, 3));
        assert_eq!(a[..], b[..2]);
        assert_eq!(b, h.hash_tokens(&toks));
        let other: Vec<u32> = (100..112).collect();
        let c = sessions.with("r", |s| s.chunk_hashes(&other, 3));
        assert_eq!(c, h.hash_tokens(&other), "stale chain reused after divergence");
    }

    #[test]
    fn reap_counts_from_creation() {
        let sessions = Sessions::new(TokenHasher::default(), Duration::from_millis(1));
        sessions.with("a", |_| ());
        std::thread::sleep(Duration::from_millis(3));
        assert_eq!(sessions.reap(Instant::now()), 1);
        assert!(sessions.is_empty());
    }
}
