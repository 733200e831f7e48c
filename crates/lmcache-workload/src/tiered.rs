//! Replays through any chunk cache, and through two tiers: what `tool cache-simulator
//! simulate --eviction-policy P [--l2-capacity-gib G]` reports for the policies the server
//! ships (driven by their own code, behind [`ChunkCache`]) and for an L1 + L2 configuration.
//!
//! Per request, as the server serves it: the leading run L1 holds hits in L1; with an L2,
//! the run continues in L2 (a prefetch), and those chunks are loaded into L1; the L1 hits are
//! touched, the rest stored into L1 and written behind to L2. With LMCache's LRU and no L2
//! this is exactly [`crate::simulate`]'s replay (tested).

use crate::lookup_log::LookupLine;

/// A cache of unit-size chunks named by interned ids.
pub trait ChunkCache {
    /// The policy's name.
    fn name(&self) -> String;
    /// Whether `id` is cached.
    fn contains(&self, id: u32) -> bool;
    /// A request used these cached chunks (in request order; the cache picks its order).
    fn access(&mut self, ids: &[u32]);
    /// A request stored these chunks (in request order; present ones are left as they are
    /// or refreshed, as the cache does).
    fn insert(&mut self, ids: &[u32]);
    /// Chunks cached.
    fn len(&self) -> usize;
    /// True when nothing is cached.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Chunks evicted so far.
    fn evictions(&self) -> u64;
}

/// LMCache's simulator LRU as a [`ChunkCache`] (hits touched in order, stores refresh).
#[derive(Debug)]
pub struct LmcacheLru(crate::simulate::Lru);

impl LmcacheLru {
    /// An empty LRU of `capacity` chunks (at least one).
    pub fn new(capacity: usize) -> Self {
        Self(crate::simulate::Lru::new(capacity, 0))
    }
}

impl ChunkCache for LmcacheLru {
    fn name(&self) -> String {
        "LMCache LRU".into()
    }
    fn contains(&self, id: u32) -> bool {
        self.0.contains(id)
    }
    fn access(&mut self, ids: &[u32]) {
        for &k in ids {
            self.0.reference(k);
        }
    }
    fn insert(&mut self, ids: &[u32]) {
        for &k in ids {
            self.0.reference(k);
        }
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn evictions(&self) -> u64 {
        self.0.evictions()
    }
}

/// What a tiered replay found.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TierSimulation {
    /// Requests replayed.
    pub requests: u64,
    /// Their tokens (`seq_len`).
    pub total_tokens: u64,
    /// Tokens served from L1.
    pub l1_hit_tokens: u64,
    /// Tokens served from L2 (loaded into L1).
    pub l2_hit_tokens: u64,
    /// Chunks L1 evicted.
    pub l1_evictions: u64,
    /// Chunks L2 evicted.
    pub l2_evictions: u64,
    /// Chunks in L1 at the end.
    pub l1_chunks: u64,
    /// Chunks in L2 at the end.
    pub l2_chunks: u64,
}

impl TierSimulation {
    /// All hit tokens over all tokens.
    pub fn hit_rate(&self) -> f64 {
        rate(self.l1_hit_tokens + self.l2_hit_tokens, self.total_tokens)
    }

    /// L1 hit tokens over all tokens.
    pub fn l1_hit_rate(&self) -> f64 {
        rate(self.l1_hit_tokens, self.total_tokens)
    }

    /// L2 hit tokens over all tokens.
    pub fn l2_hit_rate(&self) -> f64 {
        rate(self.l2_hit_tokens, self.total_tokens)
    }
}

fn rate(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// Replays `events` through `l1` and, when given, `l2` under it.
pub fn simulate_tiers(
    events: &[LookupLine],
    l1: &mut dyn ChunkCache,
    mut l2: Option<&mut dyn ChunkCache>,
) -> TierSimulation {
    let mut s = TierSimulation::default();
    for (e, ids) in events.iter().zip(crate::simulate::intern(events)) {
        if ids.is_empty() && e.seq_len == 0 {
            continue;
        }
        let h1 = ids.iter().take_while(|&&k| l1.contains(k)).count();
        let h2 = match &l2 {
            Some(l2) => ids[h1..].iter().take_while(|&&k| l2.contains(k)).count(),
            None => 0,
        };
        s.requests += 1;
        s.total_tokens += e.seq_len;
        s.l1_hit_tokens += h1 as u64 * e.chunk_size;
        s.l2_hit_tokens += h2 as u64 * e.chunk_size;
        l1.access(&ids[..h1]);
        if let Some(l2) = l2.as_deref_mut() {
            l2.access(&ids[h1..h1 + h2]);
        }
        // Loaded from L2, then stored: both enter L1; only the stored ones go down to L2.
        l1.insert(&ids[h1..]);
        if let Some(l2) = l2.as_deref_mut() {
            l2.insert(&ids[h1 + h2..]);
        }
    }
    s.l1_evictions = l1.evictions();
    s.l1_chunks = l1.len() as u64;
    if let Some(l2) = l2 {
        s.l2_evictions = l2.evictions();
        s.l2_chunks = l2.len() as u64;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ev(hashes: Vec<String>, seq_len: u64) -> LookupLine {
        crate::lookup_log::test_event(4, hashes, seq_len)
    }

    fn events() -> impl Strategy<Value = Vec<LookupLine>> {
        prop::collection::vec(
            (prop::collection::vec(0u8..24, 0..8), 0u64..4).prop_map(|(hs, tail)| {
                let n = hs.len() as u64;
                ev(hs.into_iter().map(|h| format!("0x{h:02x}")).collect(), n * 4 + tail)
            }),
            1..60,
        )
    }

    proptest! {
        /// One tier of LMCache's LRU is LMCache's replay.
        #[test]
        fn one_lru_tier_is_lmcaches_replay(evs in events(), cap in 1u64..20) {
            let want = crate::simulate(&evs, cap, 1);
            let got = simulate_tiers(&evs, &mut LmcacheLru::new(cap as usize), None);
            prop_assert_eq!(got.l1_hit_tokens, want.total_hit_tokens);
            prop_assert_eq!(got.total_tokens, want.total_tokens);
            prop_assert_eq!(got.l1_evictions, want.eviction_count);
            prop_assert_eq!(got.l2_hit_tokens, 0);
        }

        /// An L2 under L1 never loses hits: every request hits at least as many chunks as
        /// with L1 alone.
        #[test]
        fn an_l2_never_lowers_the_hit_rate(evs in events(), cap in 1u64..10, extra in 0u64..20) {
            let alone = simulate_tiers(&evs, &mut LmcacheLru::new(cap as usize), None);
            let mut l2 = LmcacheLru::new((cap + extra) as usize);
            let tiered = simulate_tiers(&evs, &mut LmcacheLru::new(cap as usize), Some(&mut l2));
            prop_assert!(tiered.l1_hit_tokens + tiered.l2_hit_tokens >= alone.l1_hit_tokens);
        }
    }

    #[test]
    fn a_chunk_evicted_from_l1_is_served_by_l2() {
        let e = |h: &[&str]| ev(h.iter().map(|s| (*s).to_owned()).collect(), h.len() as u64 * 4);
        let evs = [e(&["a", "b"]), e(&["c", "d"]), e(&["a", "b"])];
        let mut l2 = LmcacheLru::new(8);
        let s = simulate_tiers(&evs, &mut LmcacheLru::new(2), Some(&mut l2));
        assert_eq!((s.l1_hit_tokens, s.l2_hit_tokens), (0, 8));
        assert!((s.hit_rate() - 8.0 / 24.0).abs() < 1e-12);
        assert_eq!(s.l2_chunks, 4);
    }
}
