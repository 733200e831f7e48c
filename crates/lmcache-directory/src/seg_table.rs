//! The key table: slot numbers by key hash, in segments that grow one at a time.
//!
//! One flat hash table doubles when it fills, and a doubling rehashes every key at once: at
//! 7.3 M keys that took 340 ms of a coordinator's ingest (and its temporary arrays 268 MB of
//! fresh memory), about a quarter of all the time ingest spent. Here the table is extendible
//! hashing over small [`HashTable`]s: a directory of `2^depth` entries, indexed by bits 32 and
//! up of the key hash, names the segment each key lives in; a full segment splits in two by
//! its next directory bit, re-inserting its own keys only. A split touches about 80 KB, which
//! stay in cache, so growth is spread evenly over ingest and never pauses it, and the memory a
//! split frees is what the next split allocates.
//!
//! An entry is 8 bytes: the slot number and 32 bits of the key hash (its *fingerprint*). A
//! split or a small segment's growth re-files entries from their fingerprints alone, without
//! reading the arena (re-reading each key there, a cache miss per key, made ingest slower than
//! the flat table's doublings), and a probe compares fingerprints before it asks the caller to
//! compare keys. The directory indexes by the fingerprint's low bits; within a segment,
//! hashbrown places and tags an entry by a mix of all 32.

use hashbrown::HashTable;

/// A segment splits when it holds this many keys (hashbrown's capacity for 2^14 buckets, at
/// most 7/8 full): 64 KiB of slot numbers and 16 KiB of control bytes.
const SEG_KEYS: usize = 14_336;
/// Directory bits at most (16 M segments; far more than 2^32 slots need). A segment at this
/// depth grows in place instead of splitting.
const MAX_DEPTH: u32 = 24;
/// The fingerprint of key hash `h`.
fn fingerprint(h: u64) -> u32 {
    (h >> 32) as u32
}

/// Directory entry of fingerprint `fp` at `depth` bits.
fn dir_index(fp: u32, depth: u32) -> usize {
    (fp as usize) & ((1usize << depth) - 1)
}

/// The hash hashbrown places an entry by: murmur3's 64-bit finaliser over the fingerprint, so
/// its low bits (the bucket) and its top bits (the tag) each depend on all 32.
fn spread(fp: u32) -> u64 {
    let mut z = u64::from(fp);
    z ^= z >> 33;
    z = z.wrapping_mul(0xff51_afd7_ed55_8ccd);
    z ^= z >> 33;
    z = z.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    z ^ (z >> 33)
}

/// A slot number and its key's fingerprint.
#[derive(Debug, Clone, Copy)]
struct Entry {
    slot: u32,
    fp: u32,
}

fn rehash(e: &Entry) -> u64 {
    spread(e.fp)
}

#[derive(Debug)]
struct Segment {
    /// Directory bits this segment's keys share.
    depth: u32,
    /// Their value: the low `depth` bits of every directory entry naming this segment.
    pattern: usize,
    table: HashTable<Entry>,
}

/// Slot numbers by key hash. See the module docs.
#[derive(Debug)]
pub(crate) struct SegTable {
    /// `2^depth` segment numbers.
    dir: Vec<u32>,
    depth: u32,
    segs: Vec<Segment>,
    len: usize,
}

impl Default for SegTable {
    fn default() -> Self {
        Self {
            dir: vec![0],
            depth: 0,
            segs: vec![Segment { depth: 0, pattern: 0, table: HashTable::new() }],
            len: 0,
        }
    }
}

impl SegTable {
    /// Keys held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn seg_of(&self, fp: u32) -> usize {
        self.dir[dir_index(fp, self.depth)] as usize
    }

    /// The slot number under key hash `h` that `eq` accepts.
    pub(crate) fn find(&self, h: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let fp = fingerprint(h);
        let seg = &self.segs[self.seg_of(fp)];
        seg.table.find(spread(fp), |e| e.fp == fp && eq(e.slot)).map(|e| e.slot)
    }

    /// The slot number under key hash `h` that `eq` accepts, or, when there is none, `v`
    /// added under `h` (`None`): one probe for both.
    pub(crate) fn find_or_insert(
        &mut self,
        h: u64,
        mut eq: impl FnMut(u32) -> bool,
        v: u32,
    ) -> Option<u32> {
        let fp = fingerprint(h);
        // Room first (a full segment splits even when the key turns out to be held: harmless).
        let s = self.make_room(fp);
        match self.segs[s].table.entry(spread(fp), |e| e.fp == fp && eq(e.slot), rehash) {
            hashbrown::hash_table::Entry::Occupied(o) => Some(o.get().slot),
            hashbrown::hash_table::Entry::Vacant(e) => {
                e.insert(Entry { slot: v, fp });
                self.len += 1;
                None
            }
        }
    }

    /// The segment fingerprint `fp` files into, with room for one more entry (split or grown).
    fn make_room(&mut self, fp: u32) -> usize {
        loop {
            let s = self.seg_of(fp);
            let seg = &self.segs[s];
            if seg.table.len() < seg.table.capacity() {
                return s;
            }
            if seg.table.len() < SEG_KEYS || seg.depth >= MAX_DEPTH {
                // A small segment (the table's first) grows in place, as does one that can
                // split no further.
                let want = (seg.table.len() * 2).clamp(16, SEG_KEYS.max(seg.table.len() + 1));
                let seg = &mut self.segs[s];
                seg.table.reserve(want - seg.table.len(), rehash);
                return s;
            }
            self.split(s);
        }
    }

    /// Splits segment `s` by its next directory bit, doubling the directory first when the
    /// segment uses all of its bits.
    fn split(&mut self, s: usize) {
        let d = self.segs[s].depth;
        if d == self.depth {
            // Entry i + 2^depth names the same segment as entry i until a split tells them
            // apart.
            self.dir.extend_from_within(..);
            self.depth += 1;
        }
        let bit = 1usize << d;
        let old = std::mem::replace(&mut self.segs[s].table, HashTable::new());
        let mut low = HashTable::with_capacity(SEG_KEYS);
        let mut high = HashTable::with_capacity(SEG_KEYS);
        for e in old {
            let to = if dir_index(e.fp, d + 1) & bit == 0 { &mut low } else { &mut high };
            to.insert_unique(spread(e.fp), e, rehash);
        }
        let t = self.segs.len() as u32;
        let pattern = self.segs[s].pattern;
        self.segs[s] = Segment { depth: d + 1, pattern, table: low };
        self.segs.push(Segment { depth: d + 1, pattern: pattern | bit, table: high });
        // The entries that named `s` share its pattern; those with bit `d` set move.
        let mut i = pattern | bit;
        while i < self.dir.len() {
            self.dir[i] = t;
            i += bit << 1;
        }
    }

    /// Removes slot number `v` from under key hash `h`; false when it was not there.
    pub(crate) fn remove(&mut self, h: u64, v: u32) -> bool {
        let fp = fingerprint(h);
        let s = self.seg_of(fp);
        match self.segs[s].table.find_entry(spread(fp), |e| e.slot == v) {
            Ok(e) => {
                e.remove();
                self.len -= 1;
                true
            }
            Err(_) => false,
        }
    }

    /// A table over `entries` (key hash, slot number), built segment by segment from the
    /// entries sorted by segment, each segment's inserts staying in cache. `same(a, b)`: whether
    /// two slot numbers hold one key; `None` when two entries do.
    pub(crate) fn build(
        mut entries: Vec<(u64, u32)>,
        same: impl Fn(u32, u32) -> bool,
    ) -> Option<Self> {
        // Segments about 5/8 full: room to grow before the first splits.
        let want = entries.len().div_ceil(SEG_KEYS * 5 / 8).max(1);
        let depth = want.next_power_of_two().trailing_zeros().min(MAX_DEPTH);
        let n = 1usize << depth;
        // A counting sort by directory entry.
        let mut starts = vec![0usize; n + 1];
        for &(h, _) in &entries {
            starts[dir_index(fingerprint(h), depth) + 1] += 1;
        }
        for i in 1..=n {
            starts[i] += starts[i - 1];
        }
        let mut sorted = vec![Entry { slot: 0, fp: 0 }; entries.len()];
        let mut at = starts.clone();
        for &(h, v) in &entries {
            let fp = fingerprint(h);
            let b = dir_index(fp, depth);
            sorted[at[b]] = Entry { slot: v, fp };
            at[b] += 1;
        }
        entries.clear();
        drop(at);
        let mut segs = Vec::with_capacity(n);
        for b in 0..n {
            let part = &sorted[starts[b]..starts[b + 1]];
            let mut table = HashTable::with_capacity(SEG_KEYS.max(part.len()));
            for &e in part {
                let h = spread(e.fp);
                if table.find(h, |o: &Entry| o.fp == e.fp && same(o.slot, e.slot)).is_some() {
                    return None;
                }
                table.insert_unique(h, e, rehash);
            }
            segs.push(Segment { depth, pattern: b, table });
        }
        Some(Self { dir: (0..n as u32).collect(), depth, segs, len: sorted.len() })
    }

    /// Bytes held: directory, slot numbers and control bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.dir.capacity() * 4
            + self.segs.capacity() * std::mem::size_of::<Segment>()
            + self
                .segs
                .iter()
                .map(|s| {
                    let c = s.table.capacity();
                    // hashbrown holds buckets (capacity * 8 / 7, a power of two) of one entry
                    // plus one control byte each.
                    let entry = std::mem::size_of::<Entry>() + 1;
                    if c == 0 { 0 } else { (c * 8 / 7).next_power_of_two() * entry }
                })
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hash that spreads `v` over all 64 bits (splitmix64's finaliser).
    fn mix(v: u32) -> u64 {
        let mut z = u64::from(v).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn add(t: &mut SegTable, h: u64, v: u32) {
        assert_eq!(t.find_or_insert(h, |j| j == v, v), None, "{v} was new");
    }

    fn check(t: &SegTable, live: impl Iterator<Item = u32>, gone: impl Iterator<Item = u32>) {
        for v in live {
            assert_eq!(t.find(mix(v), |j| j == v), Some(v), "slot {v} lost");
        }
        for v in gone {
            assert_eq!(t.find(mix(v), |j| j == v), None, "slot {v} still held");
        }
        // Every directory entry names a segment whose keys all index back to it.
        for (i, &s) in t.dir.iter().enumerate() {
            let seg = &t.segs[s as usize];
            let mask = (1usize << seg.depth) - 1;
            assert_eq!(i & mask, seg.pattern, "entry {i} names a segment of another pattern");
            for e in seg.table.iter() {
                assert_eq!(e.fp, fingerprint(mix(e.slot)), "slot {} keeps its fingerprint", e.slot);
                assert_eq!(dir_index(e.fp, t.depth) & mask, i & mask, "slot {} misfiled", e.slot);
            }
        }
    }

    #[test]
    fn keys_survive_splits_and_removals() {
        let mut t = SegTable::default();
        let n = 200_000u32;
        for v in 0..n {
            add(&mut t, mix(v), v);
        }
        assert_eq!(t.len(), n as usize);
        assert!(t.segs.len() >= 16, "the table split ({} segments)", t.segs.len());
        assert!(t.segs.iter().all(|s| s.table.len() <= SEG_KEYS), "no segment outgrew a split");
        for v in (0..n).step_by(3) {
            assert!(t.remove(mix(v), v));
            assert!(!t.remove(mix(v), v), "removed twice");
        }
        check(&t, (0..n).filter(|v| v % 3 != 0), (0..n).step_by(3));
        // Refilled after removals, the directory still agrees with every segment.
        for v in n..n + 50_000 {
            add(&mut t, mix(v), v);
        }
        check(&t, (0..n + 50_000).filter(|v| *v >= n || v % 3 != 0), std::iter::empty());
    }

    #[test]
    fn find_or_insert_finds_a_held_key_and_adds_a_new_one() {
        let mut t = SegTable::default();
        for v in 0..40_000u32 {
            assert_eq!(t.find_or_insert(mix(v), |j| j == v, v), None, "{v} is new");
        }
        for v in (0..40_000u32).step_by(7) {
            // Held: found, and the slot number offered is not added.
            assert_eq!(t.find_or_insert(mix(v), |j| j == v, 99_999), Some(v));
        }
        assert_eq!(t.len(), 40_000);
        check(&t, 0..40_000, 99_999..100_000);
    }

    #[test]
    fn keys_no_split_can_separate_grow_their_segment() {
        let mut t = SegTable::default();
        // Every fingerprint shares its 24 directory bits (only the top 8 differ), so splits
        // move nothing: the directory splits as far as it may, then the segment grows.
        let h = |v: u32| (u64::from(v % 256) << 56) | (7 << 32) | u64::from(v);
        for v in 0..15_000u32 {
            add(&mut t, h(v), v);
        }
        assert_eq!(t.depth, MAX_DEPTH, "the directory split as far as it may");
        let seg = &t.segs[t.seg_of(fingerprint(h(0)))];
        assert_eq!(seg.table.len(), 15_000, "one segment holds them all");
        for v in 0..15_000u32 {
            assert_eq!(t.find(h(v), |j| j == v), Some(v));
        }
        assert!(t.remove(h(5), 5));
        assert_eq!(t.find(h(5), |j| j == 5), None);
        assert_eq!(t.len(), 14_999);
    }

    #[test]
    fn a_built_table_finds_every_key_and_refuses_a_duplicate() {
        let entries: Vec<(u64, u32)> = (0..100_000u32).map(|v| (mix(v), v)).collect();
        let t = SegTable::build(entries.clone(), |a, b| a == b).unwrap();
        assert_eq!(t.len(), 100_000);
        check(&t, 0..100_000, 100_000..100_100);
        let mut t = t;
        for v in 100_000..200_000 {
            add(&mut t, mix(v), v);
        }
        check(&t, 0..200_000, std::iter::empty());
        // Slots 10 and 99 hold one key.
        let same = |a: u32, b: u32| a == b || (a.min(b), a.max(b)) == (10, 99);
        let mut dup = entries;
        dup.push((mix(10), 99));
        assert!(SegTable::build(dup, same).is_none());
        assert!(SegTable::build(Vec::new(), |a, b| a == b).is_some_and(|t| t.len() == 0));
    }
}
