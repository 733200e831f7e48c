//! A server's own CacheBlend matcher: the chunks its stores fingerprinted, found anywhere in a
//! new prompt, answering as LMCache 0.5.6's `BlendTokenRangeMatcher` answers and right where
//! it is wrong.
//!
//! What LMCache's server does, and this keeps:
//! - a store's chunks are fingerprinted in runs of committed chunks, from `start_chunk` on (a
//!   store from token 0 skips its chunk 0: the prefix lookup serves it), each at its absolute
//!   position; a chunk hash already fingerprinted is not again;
//! - a query finds each stored content once, at the first position it occurs, ascending;
//!   among chunks holding the same tokens the last fingerprinted wins, or, with
//!   `dedup_content`, the first (the others are never fingerprinted);
//! - a match that was stale at prefetch gets a strike; two strikes remove it; a match found
//!   clears its strikes.
//!
//! Where LMCache is wrong and this is not:
//! - its fingerprints ignore the model, world size and cache salt: a prompt of one tenant
//!   matches another's chunks, whose keys then miss (and strike them out for both); here
//!   each [`Namespace`] sees only its own stores;
//! - its direct-address table keeps one chunk per bucket: a later chunk whose fingerprint
//!   shares the bucket hides the earlier one, and removing either removes both; here every
//!   content stays findable and each match is verified token by token ([`BlendIndex`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::index::{BlendConfig, BlendIndex, BlendNs, BlendStats};

/// Strikes that remove a stale fingerprint (LMCache's `_STALE_STRIKE_THRESHOLD`).
pub const STALE_STRIKES: u8 = 2;

/// Whose stores a query may reuse: the model, the tensor-parallel world and the cache salt.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Namespace {
    /// The model.
    pub model: Arc<str>,
    /// Tensor-parallel world size.
    pub world_size: u32,
    /// The tenant's salt.
    pub cache_salt: Arc<str>,
}

/// A run of stored, committed chunks.
#[derive(Debug, Clone, Copy)]
pub struct StoredRun<'a> {
    /// The run's tokens: whole chunks (a short tail is ignored).
    pub tokens: &'a [u32],
    /// The chunk hash of each chunk of the run.
    pub hashes: &'a [[u8; 32]],
    /// The first chunk of the run to fingerprint.
    pub start_chunk: usize,
    /// Where the run's first token sits in its request.
    pub position: u64,
}

/// A stored chunk found in a query (LMCache's `CBMatchResult`, each end one chunk on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    /// The chunk's hash.
    pub hash: [u8; 32],
    /// Where it sat when stored.
    pub old_st: u64,
    /// Where its tokens start in the query.
    pub cur_st: u64,
}

/// The matcher.
#[derive(Debug)]
pub struct Matcher {
    index: BlendIndex,
    chunk_size: usize,
    dedup_content: bool,
    namespaces: HashMap<Namespace, BlendNs>,
    claimed: HashSet<([u8; 32], BlendNs)>,
    strikes: HashMap<([u8; 32], BlendNs), u8>,
}

impl Matcher {
    /// An empty matcher for chunks of `chunk_size` tokens.
    pub fn new(chunk_size: usize, dedup_content: bool) -> Self {
        Self::with_index(chunk_size, dedup_content, BlendIndex::new(Self::config(chunk_size)))
    }

    /// The same with a fixed polynomial base (tests).
    pub fn with_base(chunk_size: usize, dedup_content: bool, base: u64) -> Self {
        let index = BlendIndex::with_base(Self::config(chunk_size), base);
        Self::with_index(chunk_size, dedup_content, index)
    }

    fn config(chunk_size: usize) -> BlendConfig {
        BlendConfig { chunk_size: chunk_size.max(1), probe_stride: 1 }
    }

    fn with_index(chunk_size: usize, dedup_content: bool, index: BlendIndex) -> Self {
        Self {
            index,
            chunk_size: chunk_size.max(1),
            dedup_content,
            namespaces: HashMap::new(),
            claimed: HashSet::new(),
            strikes: HashMap::new(),
        }
    }

    fn ns(&mut self, ns: &Namespace) -> BlendNs {
        let next = self.namespaces.len() as BlendNs;
        *self.namespaces.entry(ns.clone()).or_insert(next)
    }

    /// Fingerprints a run of `ns`'s stored chunks; returns how many were newly indexed.
    pub fn register(&mut self, ns: &Namespace, run: StoredRun<'_>) -> usize {
        let id = self.ns(ns);
        let n = self.chunk_size;
        let chunks = (run.tokens.len() / n).min(run.hashes.len());
        let mut added = 0;
        for i in run.start_chunk..chunks {
            let hash = run.hashes[i];
            if self.claimed.contains(&(hash, id)) {
                continue;
            }
            let tokens = &run.tokens[i * n..(i + 1) * n];
            if self.dedup_content && !self.index.matches(tokens, id).is_empty() {
                continue;
            }
            let offset = run.position + (i * n) as u64;
            self.index.claim(&hash, id, &Arc::from(tokens), offset as i64);
            self.claimed.insert((hash, id));
            added += 1;
        }
        added
    }

    /// Every content of `ns`'s fingerprinted chunks that occurs in `query`, once, at its
    /// first position, ascending.
    pub fn find(&self, ns: &Namespace, query: &[u32]) -> Vec<Found> {
        let Some(&id) = self.namespaces.get(ns) else { return Vec::new() };
        let n = self.chunk_size;
        let all = if self.dedup_content {
            self.index.matches(query, id)
        } else {
            self.index.matches_newest_first(query, id)
        };
        let mut contents: HashSet<&[u32]> = HashSet::new();
        all.into_iter()
            .filter(|m| {
                let at = m.cur_st as usize;
                query.get(at..at + n).is_some_and(|w| contents.insert(w))
            })
            .map(|m| Found { hash: m.chunk_hash, old_st: m.old_st, cur_st: m.cur_st })
            .collect()
    }

    /// `hash` was found at prefetch: its strikes go.
    pub fn found(&mut self, ns: &Namespace, hash: &[u8; 32]) {
        if let Some(&id) = self.namespaces.get(ns) {
            self.strikes.remove(&(*hash, id));
        }
    }

    /// `hash` was stale at prefetch (its KV is gone): one strike; at [`STALE_STRIKES`] its
    /// fingerprint is removed. Returns whether it was.
    pub fn stale(&mut self, ns: &Namespace, hash: &[u8; 32]) -> bool {
        let Some(&id) = self.namespaces.get(ns) else { return false };
        let strikes = self.strikes.entry((*hash, id)).or_insert(0);
        *strikes += 1;
        if *strikes < STALE_STRIKES {
            return false;
        }
        self.strikes.remove(&(*hash, id));
        self.remove(id, hash)
    }

    fn remove(&mut self, id: BlendNs, hash: &[u8; 32]) -> bool {
        if !self.claimed.remove(&(*hash, id)) {
            return false;
        }
        self.index.release(hash, id);
        true
    }

    /// Fingerprinted chunks (over every namespace) and what the index holds.
    pub fn stats(&self) -> (usize, BlendStats) {
        (self.claimed.len(), self.index.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const N: usize = 4;

    fn ns(salt: &str) -> Namespace {
        Namespace { model: "m".into(), world_size: 1, cache_salt: salt.into() }
    }

    fn h(i: u8) -> [u8; 32] {
        [i; 32]
    }

    #[test]
    fn lmcaches_rules_for_a_store_and_a_lookup() {
        let mut m = Matcher::with_base(N, false, 0x9E37_79B9);
        // A store from token 0 of chunks A, D: chunk 0 is the prefix leg's, not fingerprinted.
        let a = [1, 2, 3, 4];
        let d = [5, 6, 7, 8];
        let tokens: Vec<u32> = a.iter().chain(&d).copied().collect();
        let run = StoredRun { tokens: &tokens, hashes: &[h(1), h(2)], start_chunk: 1, position: 0 };
        assert_eq!(m.register(&ns(""), run), 1);
        assert_eq!(m.register(&ns(""), run), 0, "a chunk hash is fingerprinted once");
        // The query holds A at 0 and D at 6 (and D again at 11): D once, at 6, from 4.
        let q = [1, 2, 3, 4, 9, 9, 5, 6, 7, 8, 0, 5, 6, 7, 8];
        assert_eq!(m.find(&ns(""), &q), vec![Found { hash: h(2), old_st: 4, cur_st: 6 }]);
        // Another salt never sees it (LMCache's matcher would).
        assert!(m.find(&ns("other"), &q).is_empty());
        // Stale twice: removed; found in between clears the strike.
        assert!(!m.stale(&ns(""), &h(2)));
        m.found(&ns(""), &h(2));
        assert!(!m.stale(&ns(""), &h(2)));
        assert!(m.stale(&ns(""), &h(2)));
        assert!(m.find(&ns(""), &q).is_empty());
        assert_eq!(m.stats().0, 0);
    }

    #[test]
    fn the_same_tokens_behind_two_prefixes_give_the_newest_or_with_dedup_the_first() {
        for (dedup, want) in [(false, h(2)), (true, h(1))] {
            let mut m = Matcher::with_base(N, dedup, 31);
            let t = [7, 7, 8, 8];
            let one = StoredRun { tokens: &t, hashes: &[h(1)], start_chunk: 0, position: 256 };
            let two = StoredRun { tokens: &t, hashes: &[h(2)], start_chunk: 0, position: 512 };
            assert_eq!(m.register(&ns(""), one), 1);
            assert_eq!(m.register(&ns(""), two), usize::from(!dedup));
            let got = m.find(&ns(""), &[0, 7, 7, 8, 8, 7, 7, 8, 8]);
            assert_eq!(got.len(), 1, "one match per content: {got:?}");
            assert_eq!((got[0].hash, got[0].cur_st), (want, 1), "dedup {dedup}");
            // Removing the newest leaves the other findable (LMCache's table loses both).
            if !dedup {
                assert!(m.stale(&ns(""), &h(2)) || m.stale(&ns(""), &h(2)));
                assert_eq!(m.find(&ns(""), &t)[0].hash, h(1));
            }
        }
    }

    /// The reference: every registered (hash, tokens, position) of the namespace, still
    /// claimed; per content the newest; each content at its first occurrence in the query.
    fn reference(stored: &[([u8; 32], Vec<u32>, u64)], q: &[u32]) -> Vec<Found> {
        let mut newest: Vec<(Vec<u32>, [u8; 32], u64)> = Vec::new();
        for (hash, toks, pos) in stored {
            match newest.iter_mut().find(|(t, _, _)| t == toks) {
                Some(e) => (e.1, e.2) = (*hash, *pos),
                None => newest.push((toks.clone(), *hash, *pos)),
            }
        }
        let mut out: Vec<Found> = newest
            .iter()
            .filter_map(|(toks, hash, pos)| {
                q.windows(N).position(|w| w == &toks[..]).map(|p| Found {
                    hash: *hash,
                    old_st: *pos,
                    cur_st: p as u64,
                })
            })
            .collect();
        out.sort_by_key(|f| f.cur_st);
        out
    }

    proptest! {
        #[test]
        fn finds_what_a_brute_force_search_finds(
            stores in prop::collection::vec(
                (prop::collection::vec(0u32..3, N * 3), 0usize..3, 0u64..4), 1..8),
            query in prop::collection::vec(0u32..3, 0..40),
        ) {
            let mut m = Matcher::with_base(N, false, 0x5bd1_e995);
            let mut stored: Vec<([u8; 32], Vec<u32>, u64)> = Vec::new();
            let mut next = 0u8;
            for (tokens, start, at) in &stores {
                let hashes: Vec<[u8; 32]> = (0..3).map(|_| { next += 1; h(next) }).collect();
                let position = at * 256;
                m.register(&ns(""), StoredRun { tokens, hashes: &hashes, start_chunk: *start, position });
                for i in *start..3 {
                    stored.push((hashes[i], tokens[i * N..(i + 1) * N].to_vec(), position + (i * N) as u64));
                }
            }
            prop_assert_eq!(m.find(&ns(""), &query), reference(&stored, &query));
        }
    }
}
