//! Request sessions: the tokens and chunk hashes of one request, and the read locks its
//! lookup took. A session is created on demand, dropped by `end_session` or by the reaper
//! once older than the session TTL (counted from creation, as LMCache does). Dropping a
//! session drops its leases, which releases their locks.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lmcache_core::{ChunkHash, ModelName, ObjectKey, PrefixHasher, TokenHasher};
use lmcache_storage::{Lookup, LookupLeases};
use parking_lot::Mutex;

/// Where the last lookup of a request stands.
#[derive(Debug, Default)]
pub enum LookupState {
    /// No lookup yet.
    #[default]
    Idle,
    /// The last lookup: its leases (and, while pending, its prefetch). A later lookup
    /// replaces it; dropping it releases its locks and abandons its prefetch.
    Active {
        /// The lookup, from [`lmcache_storage::StorageManager::lookup`].
        lookup: Lookup,
        /// Chunks asked for.
        chunks: usize,
        /// Whether `query_prefetch_status` has handed its hits out (they are answered once).
        answered: bool,
        /// The lookup's model and the shard it speaks for (what its settle is announced
        /// with: chunks a prefetch made resident are KV events and the coordinator's).
        model: ModelName,
        /// The engine worker (KV shard) of the lookup's context.
        shard: u32,
        /// The chunk hashes looked up.
        hashes: Vec<ChunkHash>,
    },
}

impl LookupState {
    /// The last lookup's leases, if any.
    pub fn leases_mut(&mut self) -> Option<&mut LookupLeases> {
        match self {
            Self::Idle => None,
            Self::Active { lookup, .. } => Some(lookup.leases_mut()),
        }
    }

    /// Whether its prefetch still runs.
    pub fn is_pending(&self) -> bool {
        matches!(self, Self::Active { lookup, .. } if lookup.is_pending())
    }
}

/// One request's state.
#[derive(Debug)]
pub struct Session {
    created: Instant,
    base: TokenHasher,
    hasher: PrefixHasher,
    tokens: Vec<u32>,
    /// The last lookup: its locks, its hits, its prefetch.
    pub lookup: LookupState,
    /// Keys the request touched (for the LRU touch at `end_session`).
    pub touched: Vec<ObjectKey>,
    /// CacheBlend: a unified lookup waiting for its prefix leg, and the read locks on the
    /// matched chunks a retrieve will scatter (released with the session).
    pub blend: crate::blend::BlendSession,
}

impl Session {
    fn new(hasher: &TokenHasher) -> Self {
        Self {
            created: Instant::now(),
            base: *hasher,
            hasher: hasher.prefix_hasher(),
            tokens: Vec::new(),
            lookup: LookupState::Idle,
            touched: Vec::new(),
            blend: crate::blend::BlendSession::default(),
        }
    }

    /// If the last lookup's prefetch has ended, joins its leases to the lookup's and makes its
    /// hits ready; `storage` announces what it added, once.
    pub fn settle(&mut self, storage: &lmcache_storage::StorageManager, request_id: &str) {
        let LookupState::Active { lookup, chunks, model, shard, hashes, .. } = &mut self.lookup
        else {
            return;
        };
        if !lookup.is_pending() {
            return;
        }
        // The tokens are the lookup's while the session still hashes the same sequence (a
        // request that switched sequences since gets no tokens: nothing is bound to them).
        let same = self.hasher.hashes().starts_with(hashes);
        let ctx = lmcache_storage::RequestContext {
            request_id,
            model,
            shard: *shard,
            chunk_size: self.base.chunk_size(),
            first_chunk: 0,
            hashes,
            parent: None,
            tokens: if same { &self.tokens } else { &[] },
            objects: &[],
        };
        storage.scope(&ctx).settle(*chunks, lookup);
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
