//! The chunk-fingerprint index for CacheBlend: which stored chunks does a request's token
//! sequence contain anywhere (not only as a prefix), and where did each sit when it was
//! stored, so the caller can re-position its KV.
//!
//! Its owner claims chunks (the coordinator's directory, from its token bindings; a server,
//! from its own stores): a chunk is indexed while it is claimed, its content is exactly
//! `chunk_size` tokens and its position is known. Each
//! *blend namespace* (model, cache salt, world size; not the object group, as LMCache's) that
//! holds a key of the chunk claims it; a query only sees chunks its own namespace claims.
//!
//! What LMCache's index gets wrong and this one does not:
//! - every content is kept with its own tokens and every match is verified token-exactly
//!   against the content its chunk actually holds (LMCache keeps only the first content of a
//!   fingerprint and can return a later occupant holding different tokens);
//! - fingerprint collisions never hide anything: a fingerprint lists every distinct content
//!   landing on it (up to [`MAX_CONTENTS_PER_FINGERPRINT`], counted beyond);
//! - the polynomial base is random per process, so colliding windows cannot be prepared
//!   offline;
//! - memory follows the live chunks: contents and chunks leave with their last claim, and
//!   content slots are recycled.

use std::collections::HashMap;
use std::sync::Arc;

use smallvec::SmallVec;

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Distinct contents one fingerprint may list; a further one is not indexed (counted). Only
/// an adversary who knew the process's random base could fill a fingerprint.
pub const MAX_CONTENTS_PER_FINGERPRINT: usize = 8;

/// Filter bits per live fingerprint, and the smallest filter (as powers of two). Each
/// fingerprint sets two bits of one 64-bit word (a blocked Bloom filter): one load tests a
/// position, and at most about one position in 100 that matches nothing gets past it (the
/// filter is rounded up to a power of two, so usually fewer). 16 bits measured faster than 32
/// (a smaller filter, whose loads stay in L2, against a few more table probes).
const FILTER_BITS_PER_FINGERPRINT: usize = 16;
const MIN_FILTER_LOG2: u32 = 10;

/// Query positions hashed side by side: the rolling hash is a chain of multiplies, so one
/// chain per lane keeps the multiplier busy instead of waiting on each result (the code rolls
/// exactly four).
const LANES: usize = 4;

/// How the index matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlendConfig {
    /// Tokens per indexed chunk, and the match window.
    pub chunk_size: usize,
    /// Query positions between probes; 1 finds every match.
    pub probe_stride: usize,
}

/// One stored chunk found inside a query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlendMatch {
    /// The chunk's hash.
    pub chunk_hash: [u8; 32],
    /// Where its first token sat in the sequence it was stored under.
    pub old_st: u64,
    /// Where the same tokens start in the query.
    pub cur_st: u64,
}

/// What the index holds (LMCache's `blend` stats, plus what it refused).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlendStats {
    /// Distinct contents.
    pub num_contents: u64,
    /// Chunks claimed by at least one namespace (indexed or not).
    pub num_chunks: u64,
    /// (chunk, namespace) claims.
    pub num_claims: u64,
    /// Namespaces holding at least one claim.
    pub num_namespaces: u64,
    /// Buckets of the occupancy filter (bits; LMCache's is one byte per bucket).
    pub table_size: u64,
    /// Contents not indexed because their fingerprint already listed the maximum.
    pub crowded: u64,
}

/// A blend namespace, interned by the caller (the fleet's: model, cache salt, world size).
pub type BlendNs = u32;

#[derive(Debug)]
struct Content {
    fingerprint: u64,
    tokens: Arc<[u32]>,
    /// Chunks holding exactly these tokens, in the order they were indexed.
    occupants: SmallVec<[[u8; 32]; 1]>,
}

#[derive(Debug, Default)]
struct Chunk {
    offset: u64,
    /// The content slot, when indexed.
    content: Option<u32>,
    /// Namespace → keys of this chunk it holds.
    claims: SmallVec<[(BlendNs, u32); 2]>,
}

/// The index. Driven by its owner (the directory's claims follow bound keys; a server's follow
/// its stores); read by [`Self::matches`].
#[derive(Debug)]
pub struct BlendIndex {
    config: BlendConfig,
    base: u64,
    /// `base^(chunk_size - 1)`, to roll the oldest token out.
    top: u64,
    by_fingerprint: FastMap<u64, SmallVec<[u32; 1]>>,
    /// A blocked Bloom filter of the live fingerprints (removals leave stale bits until a
    /// rebuild): a query position that matches nothing is refused from one word of a small
    /// array, without a table probe.
    filter: Vec<u64>,
    filter_log2: u32,
    /// Fingerprints added to the filter since its last rebuild (live or since removed).
    filter_set: usize,
    contents: Vec<Option<Content>>,
    free: Vec<u32>,
    chunks: FastMap<[u8; 32], Chunk>,
    claims_by_ns: FastMap<BlendNs, u64>,
    live_contents: u64,
    crowded: u64,
}

impl BlendIndex {
    /// An empty index with a polynomial base drawn at random for this process.
    pub fn new(config: BlendConfig) -> Self {
        use std::hash::BuildHasher as _;
        let base = foldhash::fast::RandomState::default().hash_one(0x0062_6c65_6e64_u64) | 1;
        Self::with_base(config, base)
    }

    /// An empty index with a given base (tests and reproducible benches).
    pub fn with_base(config: BlendConfig, base: u64) -> Self {
        let config = BlendConfig {
            chunk_size: config.chunk_size.max(1),
            probe_stride: config.probe_stride.max(1),
        };
        let mut top = 1u64;
        for _ in 1..config.chunk_size {
            top = top.wrapping_mul(base);
        }
        Self {
            config,
            base,
            top,
            by_fingerprint: FastMap::default(),
            filter: vec![0; (1 << MIN_FILTER_LOG2) / 64],
            filter_log2: MIN_FILTER_LOG2,
            filter_set: 0,
            contents: Vec::new(),
            free: Vec::new(),
            chunks: FastMap::default(),
            claims_by_ns: FastMap::default(),
            live_contents: 0,
            crowded: 0,
        }
    }

    /// The filter word of `fingerprint` and its two bits, from the high bits of a multiply (a
    /// polynomial hash's low bits depend only on the tokens' low bits).
    fn filter_slot(&self, fingerprint: u64) -> (usize, u64) {
        let m = fingerprint.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let word = (m >> (64 - (self.filter_log2 - 6))) as usize;
        let mask = 1u64 << (m >> 6 & 63) | 1u64 << (m & 63);
        (word, mask)
    }

    fn filter_has(&self, fingerprint: u64) -> bool {
        let (w, mask) = self.filter_slot(fingerprint);
        self.filter[w] & mask == mask
    }

    fn filter_set(&mut self, fingerprint: u64) {
        let (w, mask) = self.filter_slot(fingerprint);
        self.filter[w] |= mask;
        self.filter_set += 1;
    }

    /// Sizes the filter to the live fingerprints and sets exactly their bits.
    fn rebuild_filter(&mut self) {
        let want = (self.by_fingerprint.len() * FILTER_BITS_PER_FINGERPRINT).max(1);
        self.filter_log2 = want.next_power_of_two().trailing_zeros().max(MIN_FILTER_LOG2);
        self.filter = vec![0; (1usize << self.filter_log2) / 64];
        self.filter_set = 0;
        let fps: Vec<u64> = self.by_fingerprint.keys().copied().collect();
        for fp in fps {
            self.filter_set(fp);
        }
    }

    fn fingerprint(&self, tokens: &[u32]) -> u64 {
        tokens.iter().fold(0u64, |h, &t| h.wrapping_mul(self.base).wrapping_add(u64::from(t)))
    }

    /// `ns` holds one more key of chunk `hash`, whose binding is `tokens` at `offset` (-1:
    /// unknown). Brings the chunk's content up to date first.
    pub fn claim(&mut self, hash: &[u8; 32], ns: BlendNs, tokens: &Arc<[u32]>, offset: i64) {
        self.sync(hash, tokens, offset, true);
        let Some(chunk) = self.chunks.get_mut(hash) else { return };
        match chunk.claims.iter_mut().find(|(n, _)| *n == ns) {
            Some((_, c)) => *c += 1,
            None => {
                chunk.claims.push((ns, 1));
                *self.claims_by_ns.entry(ns).or_insert(0) += 1;
            }
        }
    }

    /// `ns` holds one key fewer of `hash`; the chunk leaves with its last claim.
    pub fn release(&mut self, hash: &[u8; 32], ns: BlendNs) {
        let Some(chunk) = self.chunks.get_mut(hash) else { return };
        let Some(at) = chunk.claims.iter().position(|(n, _)| *n == ns) else { return };
        chunk.claims[at].1 -= 1;
        if chunk.claims[at].1 > 0 {
            return;
        }
        chunk.claims.swap_remove(at);
        if let Some(c) = self.claims_by_ns.get_mut(&ns) {
            *c -= 1;
            if *c == 0 {
                self.claims_by_ns.remove(&ns);
            }
        }
        if chunk.claims.is_empty() {
            let content = chunk.content;
            self.chunks.remove(hash);
            if let Some(id) = content {
                self.detach(hash, id);
            }
        }
    }

    /// The binding of `hash` now reads `tokens` at `offset`: re-index the chunk if its
    /// content changed. `create` makes the chunk entry when there is none.
    pub fn sync(&mut self, hash: &[u8; 32], tokens: &Arc<[u32]>, offset: i64, create: bool) {
        let indexable = tokens.len() == self.config.chunk_size && offset >= 0;
        let chunk = match self.chunks.get_mut(hash) {
            Some(c) => c,
            None if create => self.chunks.entry(*hash).or_default(),
            None => return,
        };
        let same = chunk.content.is_some_and(|id| {
            self.contents[id as usize].as_ref().is_some_and(|c| *c.tokens == **tokens)
        });
        if same || (!indexable && chunk.content.is_none()) {
            // Same tokens: only a known position moves (a store that lost it keeps the old).
            if same && offset >= 0 {
                chunk.offset = offset as u64;
            }
            return;
        }
        let old = chunk.content.take();
        if indexable {
            chunk.offset = offset as u64;
        }
        if let Some(id) = old {
            self.detach(hash, id);
        }
        if indexable {
            let id = self.attach(hash, tokens);
            if let Some(c) = self.chunks.get_mut(hash) {
                c.content = id;
            }
        }
    }

    fn attach(&mut self, hash: &[u8; 32], tokens: &Arc<[u32]>) -> Option<u32> {
        let fingerprint = self.fingerprint(tokens);
        if !self.by_fingerprint.contains_key(&fingerprint) {
            self.filter_set(fingerprint);
            if self.by_fingerprint.len() * FILTER_BITS_PER_FINGERPRINT >= 1 << self.filter_log2 {
                self.by_fingerprint.insert(fingerprint, SmallVec::new());
                self.rebuild_filter();
            }
        }
        let ids = self.by_fingerprint.entry(fingerprint).or_default();
        for &id in ids.iter() {
            if let Some(c) = self.contents[id as usize].as_mut()
                && *c.tokens == **tokens
            {
                c.occupants.push(*hash);
                return Some(id);
            }
        }
        if ids.len() >= MAX_CONTENTS_PER_FINGERPRINT {
            self.crowded += 1;
            return None;
        }
        let content = Content {
            fingerprint,
            tokens: tokens.clone(),
            occupants: SmallVec::from_elem(*hash, 1),
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.contents[id as usize] = Some(content);
                id
            }
            None => {
                self.contents.push(Some(content));
                (self.contents.len() - 1) as u32
            }
        };
        ids.push(id);
        self.live_contents += 1;
        Some(id)
    }

    fn detach(&mut self, hash: &[u8; 32], id: u32) {
        let Some(content) = self.contents.get_mut(id as usize).and_then(Option::as_mut) else {
            return;
        };
        if let Some(at) = content.occupants.iter().position(|h| h == hash) {
            content.occupants.remove(at);
        }
        if !content.occupants.is_empty() {
            return;
        }
        let fingerprint = content.fingerprint;
        self.contents[id as usize] = None;
        self.free.push(id);
        self.live_contents -= 1;
        if let Some(ids) = self.by_fingerprint.get_mut(&fingerprint) {
            ids.retain(|x| *x != id);
            if ids.is_empty() {
                self.by_fingerprint.remove(&fingerprint);
                // The bit stays (another fingerprint may share it) until stale bits dominate.
                if self.filter_set > 2 * self.by_fingerprint.len()
                    && self.filter_log2 > MIN_FILTER_LOG2
                {
                    self.rebuild_filter();
                }
            }
        }
    }

    /// Every chunk `ns` claims whose tokens occur in `query` at a probed position, ascending
    /// by position: at most one chunk per position and each chunk once (matches may
    /// overlap; the caller resolves them).
    pub fn matches(&self, query: &[u32], ns: BlendNs) -> Vec<BlendMatch> {
        self.matches_by(query, ns, false)
    }

    /// [`Self::matches`], where chunks holding the same tokens are tried newest first (the
    /// last indexed): the one a matcher that keeps one chunk per content, the latest, finds.
    pub fn matches_newest_first(&self, query: &[u32], ns: BlendNs) -> Vec<BlendMatch> {
        self.matches_by(query, ns, true)
    }

    fn matches_by(&self, query: &[u32], ns: BlendNs, newest_first: bool) -> Vec<BlendMatch> {
        let n = self.config.chunk_size;
        let stride = self.config.probe_stride;
        let mut out = Vec::new();
        if query.len() < n || self.by_fingerprint.is_empty() || !self.claims_by_ns.contains_key(&ns)
        {
            return out;
        }
        // The positions the filter lets through, with their hashes, ascending.
        let candidates = self.candidates(query, stride);
        let mut seen: SmallVec<[[u8; 32]; 8]> = SmallVec::new();
        for (p, h) in candidates {
            let p = p as usize;
            let Some(ids) = self.by_fingerprint.get(&h) else { continue };
            let window = &query[p..p + n];
            'contents: for &id in ids {
                let Some(content) = self.contents[id as usize].as_ref() else { continue };
                if *content.tokens != *window {
                    continue;
                }
                let order: &mut dyn Iterator<Item = &[u8; 32]> = if newest_first {
                    &mut content.occupants.iter().rev()
                } else {
                    &mut content.occupants.iter()
                };
                for occ in order {
                    if seen.contains(occ) {
                        continue;
                    }
                    let Some(chunk) = self.chunks.get(occ) else { continue };
                    if chunk.claims.iter().any(|(c, _)| *c == ns) {
                        seen.push(*occ);
                        out.push(BlendMatch {
                            chunk_hash: *occ,
                            old_st: chunk.offset,
                            cur_st: p as u64,
                        });
                        break 'contents;
                    }
                }
            }
        }
        out
    }

    /// Every probed position of `query` (a multiple of `stride`) whose window hash passes the
    /// filter, with that hash, ascending. The window hashes are computed first, the positions
    /// split into [`LANES`] runs rolled side by side (each from its own first window), then
    /// tested against the filter in one pass of independent loads.
    fn candidates(&self, query: &[u32], stride: usize) -> Vec<(u32, u64)> {
        let n = self.config.chunk_size;
        let positions = query.len() - n + 1;
        let mut hs = vec![0u64; positions];
        let per = positions / LANES;
        if per > 1 {
            let (top, base) = (self.top, self.base);
            let mut lanes = hs[..LANES * per].chunks_exact_mut(per);
            let mut lane = |k: usize| {
                let out = lanes.next().unwrap_or_default();
                let start = k * per;
                out[0] = self.fingerprint(&query[start..start + n]);
                // Rolling from position start + j - 1 to start + j: out goes
                // query[start + j - 1], in comes query[start + j + n - 1].
                let olds = &query[start..start + per - 1];
                let news = &query[start + n..start + n + per - 1];
                (out, olds, news)
            };
            let (a, b, c, d) = (lane(0), lane(1), lane(2), lane(3));
            let (mut ha, mut hb, mut hc, mut hd) = (a.0[0], b.0[0], c.0[0], d.0[0]);
            let roll = |h: u64, old: u32, new: u32| {
                h.wrapping_sub(u64::from(old).wrapping_mul(top))
                    .wrapping_mul(base)
                    .wrapping_add(u64::from(new))
            };
            let outs = a.0[1..].iter_mut().zip(&mut b.0[1..]).zip(&mut c.0[1..]).zip(&mut d.0[1..]);
            let ins =
                a.1.iter()
                    .zip(a.2)
                    .zip(b.1.iter().zip(b.2))
                    .zip(c.1.iter().zip(c.2).zip(d.1.iter().zip(d.2)));
            for ((((oa, ob), oc), od), (((ao, an), (bo, bn)), ((co, cn), (do_, dn)))) in
                outs.zip(ins)
            {
                ha = roll(ha, *ao, *an);
                hb = roll(hb, *bo, *bn);
                hc = roll(hc, *co, *cn);
                hd = roll(hd, *do_, *dn);
                (*oa, *ob, *oc, *od) = (ha, hb, hc, hd);
            }
        }
        // The rest (or all of a short query), one chain.
        let done = if per > 1 { LANES * per } else { 0 };
        if done < positions {
            let mut h = self.fingerprint(&query[done..done + n]);
            hs[done] = h;
            for p in done + 1..positions {
                h = h
                    .wrapping_sub(u64::from(query[p - 1]).wrapping_mul(self.top))
                    .wrapping_mul(self.base)
                    .wrapping_add(u64::from(query[p + n - 1]));
                hs[p] = h;
            }
        }
        let mut found = Vec::new();
        for (p, &h) in hs.iter().enumerate().step_by(stride) {
            if self.filter_has(h) {
                found.push((p as u32, h));
            }
        }
        found
    }

    /// What the index holds.
    pub fn stats(&self) -> BlendStats {
        BlendStats {
            num_contents: self.live_contents,
            num_chunks: self.chunks.len() as u64,
            num_claims: self.claims_by_ns.values().sum(),
            num_namespaces: self.claims_by_ns.len() as u64,
            table_size: 1 << self.filter_log2,
            crowded: self.crowded,
        }
    }

    /// Content slots allocated (live or free): what churn must not grow.
    #[cfg(test)]
    pub(crate) fn slots(&self) -> usize {
        self.contents.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(seed: u32, n: usize) -> Arc<[u32]> {
        (0..n as u32).map(|i| seed.wrapping_mul(7919).wrapping_add(i)).collect()
    }

    #[test]
    fn rolling_hash_agrees_with_the_window_hash() {
        let ix = BlendIndex::with_base(BlendConfig { chunk_size: 4, probe_stride: 1 }, 0x9E37);
        let q: Vec<u32> = (0..20).map(|i| i * 31 + 5).collect();
        let mut b = BlendIndex::with_base(BlendConfig { chunk_size: 4, probe_stride: 1 }, 0x9E37);
        let w: Arc<[u32]> = q[9..13].into();
        b.claim(&[1; 32], 0, &w, 100);
        let m = b.matches(&q, 0);
        assert_eq!(m, vec![BlendMatch { chunk_hash: [1; 32], old_st: 100, cur_st: 9 }]);
        assert_eq!(ix.fingerprint(&q[9..13]), b.fingerprint(&w));
    }

    #[test]
    fn a_colliding_fingerprint_hides_nothing_and_never_serves_other_tokens() {
        // Base 1 makes the fingerprint a plain sum: [1,2] and [2,1] collide.
        let mut b = BlendIndex::with_base(BlendConfig { chunk_size: 2, probe_stride: 1 }, 1);
        b.claim(&[1; 32], 0, &Arc::from([1u32, 2]), 0);
        b.claim(&[2; 32], 0, &Arc::from([2u32, 1]), 2);
        assert_eq!(b.stats().num_contents, 2);
        let m = b.matches(&[9, 2, 1, 9], 0);
        assert_eq!(m, vec![BlendMatch { chunk_hash: [2; 32], old_st: 2, cur_st: 1 }]);
        let m = b.matches(&[1, 2, 1, 2], 0);
        let got: Vec<_> = m.iter().map(|m| (m.chunk_hash[0], m.cur_st)).collect();
        assert_eq!(got, vec![(1, 0), (2, 1)], "one chunk per position, each chunk once");
    }

    #[test]
    fn namespaces_see_only_their_claims_and_content_changes_move_the_chunk() {
        let mut b = BlendIndex::with_base(BlendConfig { chunk_size: 3, probe_stride: 1 }, 99);
        let t = toks(1, 3);
        b.claim(&[1; 32], 0, &t, 0);
        assert!(b.matches(&t, 1).is_empty(), "namespace 1 never stored it");
        b.claim(&[1; 32], 1, &t, 0);
        assert_eq!(b.matches(&t, 1).len(), 1);
        let u = toks(2, 3);
        b.sync(&[1; 32], &u, 6, false);
        assert!(b.matches(&t, 0).is_empty(), "old content no longer served");
        assert_eq!(b.matches(&u, 0)[0].old_st, 6);
        assert_eq!(b.stats().num_contents, 1);
        b.release(&[1; 32], 0);
        b.release(&[1; 32], 1);
        assert_eq!(
            b.stats(),
            BlendStats { table_size: b.stats().table_size, ..BlendStats::default() }
        );
    }

    #[test]
    fn unknown_offsets_and_wrong_lengths_are_not_indexed_but_claims_wait() {
        let mut b = BlendIndex::with_base(BlendConfig { chunk_size: 3, probe_stride: 1 }, 5);
        let t = toks(3, 3);
        b.claim(&[1; 32], 0, &t, -1);
        b.claim(&[2; 32], 0, &toks(4, 2), 0);
        assert!(b.matches(&t, 0).is_empty());
        assert_eq!(b.stats().num_contents, 0);
        b.sync(&[1; 32], &t, 12, false);
        assert_eq!(b.matches(&t, 0)[0].old_st, 12, "the earlier claim counts once indexed");
    }

    #[test]
    fn churn_reuses_content_slots() {
        let mut b = BlendIndex::with_base(BlendConfig { chunk_size: 4, probe_stride: 1 }, 77);
        for round in 0..50u32 {
            for i in 0..20u32 {
                let h = [(i as u8).wrapping_add(round as u8); 32];
                b.claim(&h, 0, &toks(round * 100 + i, 4), 0);
            }
            for i in 0..20u32 {
                let h = [(i as u8).wrapping_add(round as u8); 32];
                b.release(&h, 0);
            }
        }
        assert!(b.slots() <= 20, "slots {}", b.slots());
        assert_eq!(b.stats().num_contents, 0);
        assert_eq!(b.stats().num_chunks, 0);
    }

    #[test]
    fn every_probed_window_is_found_whatever_the_query_length_and_stride() {
        // Queries of every length around the lanes' splits; each stored chunk planted once.
        for stride in 1..=3 {
            let mut b =
                BlendIndex::with_base(BlendConfig { chunk_size: 3, probe_stride: stride }, 0x5bd1);
            let chunks: Vec<Arc<[u32]>> =
                (0..6u32).map(|c| Arc::from([c * 10 + 1, c * 10 + 2, c * 10 + 3])).collect();
            for (c, t) in chunks.iter().enumerate() {
                b.claim(&[c as u8; 32], 0, t, c as i64 * 3);
            }
            for len in 3..60usize {
                let mut q: Vec<u32> = (0..len as u32).map(|i| 1000 + i).collect();
                let mut want = Vec::new();
                for (c, t) in chunks.iter().enumerate() {
                    let at = (c * 7 + len) % (len - 2);
                    if q[at..at + 3].iter().all(|&x| x >= 1000) {
                        q[at..at + 3].copy_from_slice(t);
                    }
                }
                for p in (0..=len - 3).step_by(stride) {
                    if let Some(c) = chunks.iter().position(|t| **t == q[p..p + 3])
                        && !want.iter().any(|m: &BlendMatch| m.chunk_hash == [c as u8; 32])
                    {
                        want.push(BlendMatch {
                            chunk_hash: [c as u8; 32],
                            old_st: c as u64 * 3,
                            cur_st: p as u64,
                        });
                    }
                }
                assert_eq!(b.matches(&q, 0), want, "stride {stride}, length {len}");
            }
        }
    }

    #[test]
    fn stride_probes_only_its_positions() {
        let mut b = BlendIndex::with_base(BlendConfig { chunk_size: 2, probe_stride: 2 }, 3);
        b.claim(&[1; 32], 0, &Arc::from([5u32, 6]), 0);
        assert!(b.matches(&[0, 5, 6, 0], 0).is_empty());
        assert_eq!(b.matches(&[0, 0, 5, 6], 0)[0].cur_st, 2);
    }
}
