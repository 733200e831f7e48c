//! LMCache's cache simulator replay: an LRU of `capacity` chunks keyed by chunk hash. Each
//! request hits the leading run of its chunks the cache holds before it; then its hit chunks
//! are touched and the others inserted, in order (the least recently used go when full). Hit
//! tokens are that run times the chunk size; the denominator is the request's `seq_len`,
//! partial last chunk included (the server's own hit-rate definition).

use std::collections::{BTreeMap, HashMap};

use crate::lookup_log::LookupLine;

/// What a replay found (LMCache's result fields of the same names).
#[derive(Debug, Clone, PartialEq)]
pub struct Simulation {
    /// Requests replayed.
    pub total_requests: u64,
    /// Their tokens.
    pub total_tokens: u64,
    /// Tokens served from the cache.
    pub total_hit_tokens: u64,
    /// Chunks evicted.
    pub eviction_count: u64,
    /// Chunks cached at the end.
    pub cache_size_at_end_chunks: u64,
    /// Capacity in chunks (`max(1, bytes / bytes per chunk)`).
    pub cache_capacity_chunks: u64,
    /// Capacity in bytes.
    pub cache_capacity_bytes: u64,
    /// Bytes per chunk.
    pub kv_bytes_per_chunk: u64,
    /// Per request: hit tokens / tokens.
    pub per_request_token_hit_rates: Vec<f64>,
    /// Per request: hit chunks.
    pub hit_prefix_lengths: Vec<u64>,
    /// Per request: `seq_len`.
    pub input_lengths: Vec<u64>,
    /// After each request: hit tokens / tokens so far.
    pub rolling_token_hit_rate: Vec<f64>,
    /// Per chunk hit at least once: how many times it was hit (ascending).
    pub chunk_reuse_counts: Vec<u64>,
    /// Per hit chunk: chunks referenced between its previous reference and this hit.
    pub global_span_distribution: Vec<u64>,
    /// Per hit chunk: its LRU position at the request's start (0 = most recently used).
    pub cache_position_distribution: Vec<u64>,
}

impl Simulation {
    /// Hit tokens / tokens.
    pub fn token_hit_rate(&self) -> f64 {
        if self.total_tokens > 0 {
            self.total_hit_tokens as f64 / self.total_tokens as f64
        } else {
            0.0
        }
    }
}

/// A least-recently-used set of interned chunk ids, with LRU ranks (a Fenwick tree over
/// reference stamps marks the live ones).
#[derive(Debug)]
pub(crate) struct Lru {
    capacity: usize,
    stamp_of: HashMap<u32, u64>,
    by_stamp: BTreeMap<u64, u32>,
    clock: u64,
    evictions: u64,
    /// Marks of the live stamps, when ranks are asked for.
    live: Option<crate::sweep::Fenwick>,
}

impl Lru {
    pub(crate) fn new(capacity: usize, references: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            stamp_of: HashMap::new(),
            by_stamp: BTreeMap::new(),
            clock: 0,
            evictions: 0,
            live: (references > 0).then(|| crate::sweep::Fenwick::new(references + 2)),
        }
    }

    pub(crate) fn contains(&self, k: u32) -> bool {
        self.stamp_of.contains_key(&k)
    }

    pub(crate) fn len(&self) -> usize {
        self.stamp_of.len()
    }

    pub(crate) fn evictions(&self) -> u64 {
        self.evictions
    }

    /// `k`'s rank: 0 for the most recently used, `len - 1` for the least.
    fn position(&self, k: u32) -> Option<u64> {
        let s = *self.stamp_of.get(&k)? as usize;
        let older_or_same = self.live.as_ref()?.prefix(s + 1) as u64;
        Some(self.stamp_of.len() as u64 - older_or_same)
    }

    /// Touches `k`, inserting it (and evicting the least recent past capacity) if absent.
    pub(crate) fn reference(&mut self, k: u32) {
        self.clock += 1;
        if let Some(old) = self.stamp_of.insert(k, self.clock) {
            self.by_stamp.remove(&old);
            if let Some(l) = &mut self.live {
                l.add(old as usize, -1);
            }
        }
        self.by_stamp.insert(self.clock, k);
        if let Some(l) = &mut self.live {
            l.add(self.clock as usize, 1);
        }
        while self.stamp_of.len() > self.capacity {
            let Some((s, victim)) = self.by_stamp.pop_first() else { break };
            self.stamp_of.remove(&victim);
            if let Some(l) = &mut self.live {
                l.add(s as usize, -1);
            }
            self.evictions += 1;
        }
    }
}

/// Interns the events' chunk hashes as dense ids (per event, in order).
pub(crate) fn intern(events: &[LookupLine]) -> Vec<Vec<u32>> {
    let mut ids: HashMap<&str, u32> = HashMap::new();
    events
        .iter()
        .map(|e| {
            e.chunk_hashes
                .iter()
                .map(|h| {
                    let n = ids.len() as u32;
                    *ids.entry(h.as_str()).or_insert(n)
                })
                .collect()
        })
        .collect()
}

/// Replays `events` (in order) through an LRU of `capacity_bytes / kv_bytes_per_chunk`
/// chunks (at least one).
pub fn simulate(events: &[LookupLine], capacity_bytes: u64, kv_bytes_per_chunk: u64) -> Simulation {
    let capacity_chunks = (capacity_bytes / kv_bytes_per_chunk.max(1)).max(1);
    let interned = intern(events);
    let references: usize = interned.iter().map(Vec::len).sum();
    let mut lru = Lru::new(usize::try_from(capacity_chunks).unwrap_or(usize::MAX), references);
    let mut s = Simulation {
        total_requests: 0,
        total_tokens: 0,
        total_hit_tokens: 0,
        eviction_count: 0,
        cache_size_at_end_chunks: 0,
        cache_capacity_chunks: capacity_chunks,
        cache_capacity_bytes: capacity_bytes,
        kv_bytes_per_chunk,
        per_request_token_hit_rates: Vec::new(),
        hit_prefix_lengths: Vec::new(),
        input_lengths: Vec::new(),
        rolling_token_hit_rate: Vec::new(),
        chunk_reuse_counts: Vec::new(),
        global_span_distribution: Vec::new(),
        cache_position_distribution: Vec::new(),
    };
    let mut reuse: HashMap<u32, u64> = HashMap::new();
    let mut last_seen: HashMap<u32, u64> = HashMap::new();
    let mut global = 0u64;
    for (e, ids) in events.iter().zip(interned) {
        if ids.is_empty() && e.seq_len == 0 {
            continue;
        }
        let hit = ids.iter().take_while(|&&k| lru.contains(k)).count() as u64;
        let hit_tokens = hit * e.chunk_size;
        s.total_requests += 1;
        s.total_tokens += e.seq_len;
        s.total_hit_tokens += hit_tokens;
        s.per_request_token_hit_rates.push(if e.seq_len > 0 {
            hit_tokens as f64 / e.seq_len as f64
        } else {
            0.0
        });
        s.hit_prefix_lengths.push(hit);
        s.input_lengths.push(e.seq_len);
        s.rolling_token_hit_rate.push(if s.total_tokens > 0 {
            s.total_hit_tokens as f64 / s.total_tokens as f64
        } else {
            0.0
        });
        for (i, &k) in ids.iter().enumerate().take(hit as usize) {
            *reuse.entry(k).or_default() += 1;
            if let Some(&seen) = last_seen.get(&k) {
                s.global_span_distribution.push(global + i as u64 - seen);
            }
            if let Some(p) = lru.position(k) {
                s.cache_position_distribution.push(p);
            }
        }
        for (i, &k) in ids.iter().enumerate() {
            last_seen.insert(k, global + i as u64);
            lru.reference(k);
        }
        global += ids.len() as u64;
    }
    let mut counts: Vec<u64> = reuse.into_values().collect();
    counts.sort_unstable();
    s.chunk_reuse_counts = counts;
    s.eviction_count = lru.evictions;
    s.cache_size_at_end_chunks = lru.stamp_of.len() as u64;
    s
}

/// LMCache's nearest-rank percentile: the `ceil(p * n / 100)`-th smallest (at least the first).
pub fn percentile(sorted: &[f64], p: u64) -> Option<f64> {
    let n = sorted.len() as u64;
    if n == 0 {
        return None;
    }
    let rank = ((p * n).div_ceil(100)).clamp(1, n);
    sorted.get(rank as usize - 1).copied()
}

/// `1234567` as `1,234,567` (Python's `{:,}`).
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `x` as Python's `{:.{prec}%}`.
pub fn percent(x: f64, prec: usize) -> String {
    format!("{:.prec$}%", x * 100.0)
}

impl Simulation {
    /// LMCache's text report: the aggregate, the per-request hit rate distribution and the
    /// hit prefix lengths (its first three sections, line for line).
    pub fn report(&self) -> String {
        use std::fmt::Write as _;
        let sep = "=".repeat(60);
        let mut o = String::new();
        let gib = self.cache_capacity_bytes as f64 / (1u64 << 30) as f64;
        let _ = writeln!(o, "{sep}\nAggregate\n{sep}");
        let _ = writeln!(o, "  Requests processed  : {}", thousands(self.total_requests));
        let _ = writeln!(o, "  Total tokens        : {}", thousands(self.total_tokens));
        let _ = writeln!(o, "  Hit tokens          : {}", thousands(self.total_hit_tokens));
        let _ = writeln!(
            o,
            "  Miss tokens         : {}",
            thousands(self.total_tokens - self.total_hit_tokens)
        );
        let _ = writeln!(o, "  Token hit rate      : {}", percent(self.token_hit_rate(), 2));
        let _ = writeln!(
            o,
            "  Cache capacity      : {gib:.2} GiB  ({} chunks × {} bytes/chunk)",
            thousands(self.cache_capacity_chunks),
            thousands(self.kv_bytes_per_chunk)
        );
        let _ = writeln!(
            o,
            "  Cache occupancy     : {} / {} chunks",
            thousands(self.cache_size_at_end_chunks),
            thousands(self.cache_capacity_chunks)
        );
        let rates = &self.per_request_token_hit_rates;
        if !rates.is_empty() {
            let n = rates.len() as f64;
            let zero = rates.iter().filter(|&&r| r == 0.0).count();
            let full = rates.iter().filter(|&&r| r == 1.0).count();
            let mut sorted = rates.clone();
            sorted.sort_by(f64::total_cmp);
            let _ = writeln!(o, "\n{sep}\nStat 1 — Per-request token hit rate distribution\n{sep}");
            let _ = writeln!(
                o,
                "  Requests with 0% hit rate   : {} ({})",
                thousands(zero as u64),
                percent(zero as f64 / n, 1)
            );
            let _ = writeln!(
                o,
                "  Requests with 100% hit rate : {} ({})",
                thousands(full as u64),
                percent(full as f64 / n, 1)
            );
            let mean = rates.iter().sum::<f64>() / n;
            let _ = writeln!(o, "  Mean                        : {}", percent(mean, 2));
            for p in [25, 50, 75, 90, 99] {
                if let Some(v) = percentile(&sorted, p) {
                    let _ = writeln!(
                        o,
                        "  {:4}                        : {}",
                        format!("p{p}"),
                        percent(v, 2)
                    );
                }
            }
        }
        let lengths = &self.hit_prefix_lengths;
        if !lengths.is_empty() {
            let mut sorted: Vec<f64> = lengths.iter().map(|&x| x as f64).collect();
            sorted.sort_by(f64::total_cmp);
            let mean = lengths.iter().sum::<u64>() as f64 / lengths.len() as f64;
            let _ = writeln!(o, "\n{sep}\nStat 2 — Hit prefix length per request (chunks)\n{sep}");
            let _ = writeln!(o, "  Mean               : {mean:.1}");
            for p in [25, 50, 75, 90, 99] {
                if let Some(v) = percentile(&sorted, p) {
                    let _ = writeln!(o, "  {:4}               : {v:.0}", format!("p{p}"));
                }
            }
        }
        let pcts = |o: &mut String, values: &[u64], pad: &str| {
            let mut sorted: Vec<f64> = values.iter().map(|&x| x as f64).collect();
            sorted.sort_by(f64::total_cmp);
            for p in [25, 50, 75, 90, 99] {
                if let Some(v) = percentile(&sorted, p) {
                    let _ = writeln!(o, "  {:4}{pad}: {v:.0}", format!("p{p}"));
                }
            }
        };
        let mean = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len() as f64;
        let reuse = &self.chunk_reuse_counts;
        if let Some(&max) = reuse.iter().max() {
            let _ = writeln!(o, "\n{sep}\nStat 3 — Chunk reuse count distribution\n{sep}");
            let _ = writeln!(
                o,
                "  Unique chunks hit at least once : {}",
                thousands(reuse.len() as u64)
            );
            let _ = writeln!(o, "  Mean reuse count                : {:.1}", mean(reuse));
            let _ = writeln!(o, "  Max reuse count                 : {}", thousands(max));
            pcts(&mut o, reuse, &" ".repeat(28));
        }
        let rolling = &self.rolling_token_hit_rate;
        if !rolling.is_empty() {
            let _ = writeln!(
                o,
                "\n{sep}\nStat 4 — Rolling (cumulative) token hit rate over time\n{sep}"
            );
            let n = rolling.len();
            for frac in [0.1, 0.25, 0.5, 0.75, 1.0] {
                let idx = ((n as f64 * frac) as i64 - 1).clamp(0, n as i64 - 1) as usize;
                let _ = writeln!(
                    o,
                    "  After request {:>6} : {}",
                    thousands(idx as u64 + 1),
                    percent(rolling[idx], 2)
                );
            }
        }
        let _ = writeln!(o, "\n{sep}\nStat 5 — Evictions\n{sep}");
        let _ = writeln!(o, "  Total evictions    : {}", thousands(self.eviction_count));
        let spans = &self.global_span_distribution;
        if let Some(&max) = spans.iter().max() {
            let _ = writeln!(
                o,
                "\n{sep}\nStat 6 — Global span distribution (chunks between last store and hit)\n{sep}"
            );
            let _ = writeln!(o, "  Total hit chunks   : {}", thousands(spans.len() as u64));
            let _ = writeln!(o, "  Mean span          : {:.1}", mean(spans));
            let _ = writeln!(o, "  Max span           : {}", thousands(max));
            pcts(&mut o, spans, &" ".repeat(15));
        }
        let pos = &self.cache_position_distribution;
        if let Some(&max) = pos.iter().max() {
            let _ =
                writeln!(o, "\n{sep}\nStat 7 — Cache position at hit (0 = MRU, max = LRU)\n{sep}");
            let _ = writeln!(o, "  Mean position      : {:.1}", mean(pos));
            let _ = writeln!(o, "  Max position       : {}", thousands(max));
            pcts(&mut o, pos, &" ".repeat(15));
        }
        let _ = writeln!(o, "{sep}");
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn ev(hashes: &[&str], seq_len: u64) -> LookupLine {
        crate::lookup_log::test_event(10, hashes.iter().map(|s| (*s).to_owned()).collect(), seq_len)
    }

    #[test]
    fn the_leading_run_hits_and_the_least_recent_goes() {
        let events =
            [ev(&["a", "b"], 25), ev(&["a", "b", "c"], 35), ev(&["x", "y"], 20), ev(&["a"], 10)];
        let s = simulate(&events, 3, 1);
        assert_eq!(s.cache_capacity_chunks, 3);
        assert_eq!(s.hit_prefix_lengths, vec![0, 2, 0, 0], "a was evicted by x, y");
        assert_eq!((s.total_tokens, s.total_hit_tokens), (90, 20));
        assert_eq!(s.eviction_count, 3);
        assert_eq!(s.cache_size_at_end_chunks, 3);
        assert!(s.report().contains("  Token hit rate      : 22.22%"), "{}", s.report());
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 25), Some(1.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 99), Some(4.0));
    }

    #[test]
    fn reuse_spans_and_lru_positions_follow_lmcaches_definitions() {
        // a b | a b c | b | x y | a
        let events = [
            ev(&["a", "b"], 20),
            ev(&["a", "b", "c"], 30),
            ev(&["b"], 10),
            ev(&["x", "y"], 20),
            ev(&["a"], 10),
        ];
        let s = simulate(&events, 4, 1);
        // y's insertion evicts a (the least recent of a c b x): the last request misses.
        assert_eq!(s.hit_prefix_lengths, vec![0, 2, 1, 0, 0]);
        // a hit once, b twice.
        assert_eq!(s.chunk_reuse_counts, vec![1, 2]);
        // Global chunk indices: a0 b1 | a2 b3 c4 | b5 | x6 y7 | a8.
        // Spans: a at 2 (seen 0), b at 3 (seen 1), b at 5 (seen 3).
        assert_eq!(s.global_span_distribution, vec![2, 2, 2]);
        // Positions at the request's start: before request 2, b (MRU) a -> a=1, b=0; before
        // request 3, c b a -> b=1.
        assert_eq!(s.cache_position_distribution, vec![1, 0, 1]);
        assert_eq!(s.input_lengths, vec![20, 30, 10, 20, 10]);
        assert!((s.rolling_token_hit_rate[1] - 20.0 / 50.0).abs() < 1e-12);
        let r = s.report();
        for line in [
            "Stat 3 — Chunk reuse count distribution",
            "  Unique chunks hit at least once : 2",
            "  After request      5 : ",
            "  Total evictions    : 2",
            "  Max span           : 2",
            "  Max position       : 1",
        ] {
            assert!(r.contains(line), "{line:?} not in\n{r}");
        }
    }
}
