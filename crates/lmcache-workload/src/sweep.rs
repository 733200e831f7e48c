//! The hit rate at many capacities in one pass. In an LRU, a chunk is cached at capacity `C`
//! exactly when fewer than `C` distinct chunks were referenced since its last reference (its
//! *stack distance*); so a request's leading run at `C` is the number of its chunks whose
//! running maximum distance is below `C`. Distances come from a Fenwick tree over reference
//! times holding one mark per chunk at its latest reference: O(references · log) for all
//! capacities together, where replaying once per capacity costs a pass each.

use std::collections::HashMap;

use crate::lookup_log::LookupLine;

/// Prefix sums over marks at reference times.
#[derive(Debug)]
pub(crate) struct Fenwick(Vec<i64>);

impl Fenwick {
    /// Room for marks at times `0..len - 1`.
    pub(crate) fn new(len: usize) -> Self {
        Self(vec![0; len])
    }

    pub(crate) fn add(&mut self, at: usize, v: i64) {
        let mut i = at + 1;
        while i < self.0.len() {
            self.0[i] += v;
            i += i & i.wrapping_neg();
        }
    }

    /// Sum of marks at times `< end`.
    pub(crate) fn prefix(&self, end: usize) -> i64 {
        let mut i = end;
        let mut s = 0;
        while i > 0 {
            s += self.0[i];
            i &= i - 1;
        }
        s
    }
}

/// Token hit rates of LMCache's replay at each capacity (in chunks), in one pass.
pub fn sweep(events: &[LookupLine], capacities_chunks: &[u64]) -> Vec<f64> {
    let ids = crate::simulate::intern(events);
    let refs: usize = ids.iter().map(Vec::len).sum();
    let mut tree = Fenwick(vec![0; refs + 1]);
    let mut last: HashMap<u32, usize> = HashMap::new();
    let mut order: Vec<usize> = (0..capacities_chunks.len()).collect();
    order.sort_by_key(|&i| capacities_chunks[i]);
    let sorted: Vec<u64> = order.iter().map(|&i| capacities_chunks[i].max(1)).collect();
    // hits[j]: hit tokens gained from capacity sorted[j] upwards.
    let mut gained = vec![0u64; sorted.len() + 1];
    let mut total_tokens = 0u64;
    let mut now = 0usize;
    for (e, ids) in events.iter().zip(&ids) {
        if ids.is_empty() && e.seq_len == 0 {
            continue;
        }
        total_tokens += e.seq_len;
        // Distances before the request touches anything (LMCache checks, then updates).
        let mut running = 0u64;
        for k in ids {
            let d = match last.get(k) {
                Some(&t) => (tree.prefix(now) - tree.prefix(t + 1)) as u64,
                None => u64::MAX,
            };
            running = running.max(d);
            if running == u64::MAX {
                break;
            }
            // Hit at every capacity above `running`.
            let j = sorted.partition_point(|&c| c <= running);
            gained[j] += e.chunk_size;
        }
        for k in ids {
            if let Some(t) = last.insert(*k, now) {
                tree.add(t, -1);
            }
            tree.add(now, 1);
            now += 1;
        }
    }
    let mut acc = 0u64;
    let mut by_sorted = Vec::with_capacity(sorted.len());
    for g in &gained[..sorted.len()] {
        acc += g;
        by_sorted.push(if total_tokens > 0 { acc as f64 / total_tokens as f64 } else { 0.0 });
    }
    let mut out = vec![0.0; capacities_chunks.len()];
    for (j, &i) in order.iter().enumerate() {
        out[i] = by_sorted[j];
    }
    out
}

/// LMCache's sweep points: `points` capacities log-spaced from `min_gib` to `max_gib` GiB, in
/// bytes, rounded (half to even) and deduplicated, ascending.
pub fn capacity_range_bytes(min_gib: f64, max_gib: f64, points: usize) -> Vec<u64> {
    let gib = (1u64 << 30) as f64;
    let lo = (min_gib * gib).log10();
    let hi = (max_gib * gib).log10();
    let step = (hi - lo) / (points.max(2) - 1) as f64;
    let mut v: Vec<u64> =
        (0..points).map(|i| 10f64.powf(lo + i as f64 * step).round_ties_even() as u64).collect();
    v.sort_unstable();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::simulate;
    use proptest::prelude::*;

    fn ev(hashes: Vec<String>, seq_len: u64) -> LookupLine {
        crate::lookup_log::test_event(16, hashes, seq_len)
    }

    proptest! {
        #[test]
        fn one_pass_equals_a_replay_per_capacity(
            reqs in prop::collection::vec(
                (prop::collection::vec(0u8..12, 0..7), 0u64..20), 1..60),
            caps in prop::collection::vec(1u64..15, 1..6),
        ) {
            // Prefix-chained like real hashes: a chunk's name carries its whole prefix.
            let events: Vec<LookupLine> = reqs.iter().map(|(path, tail)| {
                let mut prefix = String::new();
                let hashes = path.iter().map(|c| { prefix.push((b'a' + c) as char); prefix.clone() }).collect::<Vec<_>>();
                ev(hashes, path.len() as u64 * 16 + tail)
            }).collect();
            let fast = sweep(&events, &caps);
            for (c, rate) in caps.iter().zip(&fast) {
                let slow = simulate(&events, *c, 1).token_hit_rate();
                prop_assert!((rate - slow).abs() < 1e-12, "capacity {}: sweep {} replay {}", c, rate, slow);
            }
        }
    }

    #[test]
    fn sweep_points_are_lmcache_s() {
        let v = capacity_range_bytes(0.5, 500.0, 30);
        assert_eq!(v.len(), 30);
        assert_eq!(v[0], 1 << 29);
        assert_eq!(*v.last().unwrap(), 500 * (1u64 << 30));
    }
}
