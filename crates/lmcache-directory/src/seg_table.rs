//! The key table: slot numbers by key hash, in segments that grow one at a time.
//!
//! One flat hash table doubles when it fills, and a doubling rehashes every key at once: at
//! 7.3 M keys that took 340 ms of a coordinator's ingest (and its temporary arrays 268 MB of
//! fresh memory), about a quarter of all the time ingest spent. Here the table is extendible
//! hashing over small open-addressed segments: a directory of `2^depth` entries, indexed by
//! bits 32 and up of the key hash, names the segment each key lives in; a full segment grows
//! in place by a third, or, at [`SEG_LINES`], splits in two by its next directory bit,
//! re-filing its own keys only. Growth is spread evenly over ingest and never pauses it.
//!
//! An entry is 8 bytes: the slot number and 32 bits of the key hash (its *fingerprint*). A
//! split or a growth re-files entries from their fingerprints alone, without reading the arena
//! (re-reading each key there, a cache miss per key, made ingest slower than the flat table's
//! doublings), and a probe compares fingerprints before it asks the caller to compare keys.
//!
//! A segment is linear probing over entries whose home is the start of a 64-byte line of eight:
//! a key's probe reads its home line first, and that line's address follows from the key hash
//! alone, so a store batch asks for the lines of the keys a few ahead of the one it stores
//! ([`SegTable::prefetch`]). Its entries sit in that line (no separate control bytes, as
//! hashbrown's table has: one cache miss per probe, not two). Segments are kept between 7/10
//! and 15/16 full (hashbrown's segments were 7/16 to 7/8): the table costs about 10 bytes per
//! key, not 14.7. A removal shifts later entries of its cluster back (no tombstones).

/// Entries per line: one 64-byte cache line.
const LINE: usize = 8;
/// A segment splits when it holds 15/16 of this many lines' entries (15,360 keys, 128 KiB).
const SEG_LINES: usize = 2048;
/// Directory bits at most (16 M segments; far more than 2^32 slots need). A segment at this
/// depth grows in place instead of splitting.
const MAX_DEPTH: u32 = 24;
/// `slot` of an empty entry (never a slot number: the arena hands out fewer than 2^32 - 1).
const EMPTY: u32 = u32::MAX;

/// The fingerprint of key hash `h`.
fn fingerprint(h: u64) -> u32 {
    (h >> 32) as u32
}

/// Directory entry of fingerprint `fp` at `depth` bits.
fn dir_index(fp: u32, depth: u32) -> usize {
    (fp as usize) & ((1usize << depth) - 1)
}

/// murmur3's 64-bit finaliser over the fingerprint, so a segment's line depends on all 32
/// bits, not only those above the directory's.
fn spread(fp: u32) -> u64 {
    let mut z = u64::from(fp);
    z ^= z >> 33;
    z = z.wrapping_mul(0xff51_afd7_ed55_8ccd);
    z ^= z >> 33;
    z = z.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    z ^ (z >> 33)
}

/// Lines a segment takes for `n` keys: 7/10 full, at least 2.
fn lines_for(n: usize) -> usize {
    (n * 10).div_ceil(LINE * 7).max(2)
}

/// A slot number and its key's fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    slot: u32,
    fp: u32,
}

const VACANT: Entry = Entry { slot: EMPTY, fp: 0 };

/// Eight entries on one cache line.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Line([Entry; LINE]);

#[derive(Debug)]
struct Segment {
    /// Directory bits this segment's keys share.
    depth: u32,
    /// Their value: the low `depth` bits of every directory entry naming this segment.
    pattern: usize,
    lines: Box<[Line]>,
    len: usize,
}

impl Segment {
    fn new(depth: u32, pattern: usize, lines: usize) -> Self {
        Self { depth, pattern, lines: vec![Line([VACANT; LINE]); lines].into_boxed_slice(), len: 0 }
    }

    /// Entries in all.
    fn capacity(&self) -> usize {
        self.lines.len() * LINE
    }

    /// Whether one more key keeps the segment at most 15/16 full (one entry always stays empty,
    /// so a probe ends).
    fn has_room(&self) -> bool {
        (self.len + 1) * 16 <= self.capacity() * 15
    }

    /// The first entry of fingerprint `fp`'s home line.
    fn home(&self, fp: u32) -> usize {
        // Lemire's multiply-shift: a line in 0..len for any number of lines.
        (((spread(fp) >> 32) * self.lines.len() as u64) >> 32) as usize * LINE
    }

    fn at(&self, p: usize) -> Entry {
        self.lines[p / LINE].0[p % LINE]
    }

    fn set(&mut self, p: usize, e: Entry) {
        self.lines[p / LINE].0[p % LINE] = e;
    }

    fn next(&self, p: usize) -> usize {
        if p + 1 == self.capacity() { 0 } else { p + 1 }
    }

    /// Walks `fp`'s probe from its home, a line at a time: `Ok(p)` at the entry of fingerprint
    /// `fp` that `hit` accepts, `Err(p)` at the first empty entry (where the key would go).
    /// A line's empty entries and fingerprint matches are found as two masks, without a branch
    /// per entry (at 7/10 to 15/16 full, one per entry mispredicts).
    fn probe(&self, fp: u32, mut hit: impl FnMut(Entry) -> bool) -> Result<usize, usize> {
        let n = self.lines.len();
        let mut l = self.home(fp) / LINE;
        for _ in 0..n {
            let line = &self.lines[l].0;
            let (mut empty, mut same) = (0u32, 0u32);
            for (k, e) in line.iter().enumerate() {
                empty |= u32::from(e.slot == EMPTY) << k;
                same |= u32::from(e.fp == fp) << k;
            }
            // Only the entries before the line's first empty one are on the probe.
            let stop = empty.trailing_zeros();
            let mut cand = same & !empty & (1u64 << stop).wrapping_sub(1) as u32;
            while cand != 0 {
                let k = cand.trailing_zeros() as usize;
                if hit(line[k]) {
                    return Ok(l * LINE + k);
                }
                cand &= cand - 1;
            }
            if empty != 0 {
                return Err(l * LINE + stop as usize);
            }
            l = if l + 1 == n { 0 } else { l + 1 };
        }
        // Unreachable while one entry stays empty (`has_room`); a full walk finds nothing.
        Err(usize::MAX)
    }

    /// Adds `e`, known absent, at the end of its probe.
    fn insert_new(&mut self, e: Entry) {
        if let Err(p) = self.probe(e.fp, |_| false)
            && p != usize::MAX
        {
            self.set(p, e);
            self.len += 1;
        }
    }

    /// Empties entry `p` and shifts back the entries after it whose probe passed through it
    /// (Knuth's algorithm R), so every probe still ends at its key or at a real gap.
    fn remove_at(&mut self, mut hole: usize) {
        let mut j = hole;
        loop {
            j = self.next(j);
            let e = self.at(j);
            if e.slot == EMPTY || j == hole {
                break;
            }
            let k = self.home(e.fp);
            // `e` may stay when its home lies cyclically in (hole, j].
            let stays = if hole <= j { hole < k && k <= j } else { hole < k || k <= j };
            if !stays {
                self.set(hole, e);
                hole = j;
            }
        }
        self.set(hole, VACANT);
        self.len -= 1;
    }

    fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        self.lines.iter().flat_map(|l| l.0).filter(|e| e.slot != EMPTY)
    }

    /// A segment of `lines` lines holding `entries` (distinct keys, at most 15/16 of its
    /// capacity), filed by a counting sort on their home lines and one forward pass: each goes
    /// to the first free entry at or after its home, which in home order is the later of its
    /// home and the entry after the last one placed. The few that run past the end wrap round
    /// by a probe. A re-filing costs a few nanoseconds per entry, a probe per entry several
    /// times that.
    fn filled(
        depth: u32,
        pattern: usize,
        lines: usize,
        entries: &[Entry],
        sc: &mut Sorter,
    ) -> Self {
        let mut seg = Segment::new(depth, pattern, lines);
        sc.starts.clear();
        sc.starts.resize(lines + 1, 0);
        for e in entries {
            sc.starts[seg.home(e.fp) / LINE + 1] += 1;
        }
        for l in 1..=lines {
            sc.starts[l] += sc.starts[l - 1];
        }
        sc.sorted.clear();
        sc.sorted.resize(entries.len(), VACANT);
        for &e in entries {
            let l = seg.home(e.fp) / LINE;
            sc.sorted[sc.starts[l] as usize] = e;
            sc.starts[l] += 1;
        }
        let cap = seg.capacity();
        let mut next = 0;
        let mut past_end = 0;
        for i in 0..sc.sorted.len() {
            let e = sc.sorted[i];
            let at = seg.home(e.fp).max(next);
            if at < cap {
                seg.set(at, e);
                seg.len += 1;
                next = at + 1;
            } else {
                sc.sorted[past_end] = e;
                past_end += 1;
            }
        }
        for i in 0..past_end {
            seg.insert_new(sc.sorted[i]);
        }
        seg
    }
}

/// The counting sort's buffers of [`Segment::filled`].
#[derive(Debug, Default)]
struct Sorter {
    sorted: Vec<Entry>,
    starts: Vec<u32>,
}

/// Buffers a re-filing reuses, so growth allocates only the new segments: the entries of the
/// segment (or of each half of it) being re-filed, and the sort's.
#[derive(Debug, Default)]
struct Scratch {
    low: Vec<Entry>,
    high: Vec<Entry>,
    sort: Sorter,
}

impl Scratch {
    fn bytes(&self) -> usize {
        (self.low.capacity() + self.high.capacity() + self.sort.sorted.capacity()) * 8
            + self.sort.starts.capacity() * 4
    }
}

/// Slot numbers by key hash. See the module docs.
#[derive(Debug)]
pub(crate) struct SegTable {
    /// `2^depth` segment numbers.
    dir: Vec<u32>,
    depth: u32,
    segs: Vec<Segment>,
    len: usize,
    scratch: Scratch,
}

impl Default for SegTable {
    fn default() -> Self {
        Self {
            dir: vec![0],
            depth: 0,
            segs: vec![Segment::new(0, 0, 2)],
            len: 0,
            scratch: Scratch::default(),
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

    /// Asks the cache for key hash `h`'s home line, where its probe starts: a batch prefetches
    /// a few keys ahead, so their misses overlap.
    pub(crate) fn prefetch(&self, h: u64) {
        let fp = fingerprint(h);
        let seg = &self.segs[self.seg_of(fp)];
        crate::prefetch::prefetch(&seg.lines[seg.home(fp) / LINE]);
    }

    /// The slot number under key hash `h` that `eq` accepts.
    pub(crate) fn find(&self, h: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let fp = fingerprint(h);
        let seg = &self.segs[self.seg_of(fp)];
        seg.probe(fp, |e| e.fp == fp && eq(e.slot)).ok().map(|p| seg.at(p).slot)
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
        // Room first (a full segment grows even when the key turns out to be held: harmless).
        let s = self.make_room(fp);
        let seg = &mut self.segs[s];
        match seg.probe(fp, |e| e.fp == fp && eq(e.slot)) {
            Ok(p) => Some(seg.at(p).slot),
            Err(p) => {
                if p != usize::MAX {
                    seg.set(p, Entry { slot: v, fp });
                    seg.len += 1;
                    self.len += 1;
                }
                None
            }
        }
    }

    /// The segment fingerprint `fp` files into, with room for one more entry (grown or split).
    fn make_room(&mut self, fp: u32) -> usize {
        loop {
            let s = self.seg_of(fp);
            let seg = &self.segs[s];
            if seg.has_room() {
                return s;
            }
            let lines = seg.lines.len();
            if lines < SEG_LINES || seg.depth >= MAX_DEPTH {
                // Small segments double; larger ones grow by a third, up to the split size
                // (past it only at the deepest level, where a split separates nothing).
                let grown = if lines < 256 { lines * 2 } else { lines + lines / 3 };
                // (Within a fifth of the split size, straight to it: one re-filing, not two.)
                let grown = if seg.depth < MAX_DEPTH && grown * 5 > SEG_LINES * 4 {
                    SEG_LINES
                } else {
                    grown
                };
                let sc = &mut self.scratch;
                sc.low.clear();
                sc.low.extend(seg.entries());
                let refiled = Segment::filled(seg.depth, seg.pattern, grown, &sc.low, &mut sc.sort);
                self.segs[s] = refiled;
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
        let old = &self.segs[s];
        let pattern = old.pattern;
        let sc = &mut self.scratch;
        sc.low.clear();
        sc.high.clear();
        for e in old.entries() {
            if dir_index(e.fp, d + 1) & bit == 0 { sc.low.push(e) } else { sc.high.push(e) }
        }
        let size = |n: usize| lines_for(n).min(SEG_LINES);
        let low = Segment::filled(d + 1, pattern, size(sc.low.len()), &sc.low, &mut sc.sort);
        let high =
            Segment::filled(d + 1, pattern | bit, size(sc.high.len()), &sc.high, &mut sc.sort);
        let t = self.segs.len() as u32;
        self.segs[s] = low;
        self.segs.push(high);
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
        let seg = &mut self.segs[s];
        match seg.probe(fp, |e| e.fp == fp && e.slot == v) {
            Ok(p) => {
                seg.remove_at(p);
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
        // Segments 5/8 full of their split size: room to grow before the first splits.
        let want = entries.len().div_ceil(SEG_LINES * LINE * 5 / 8).max(1);
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
        let mut sorted = vec![VACANT; entries.len()];
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
            let mut seg = Segment::new(depth, b, lines_for(part.len()));
            for &e in part {
                if seg.probe(e.fp, |o| o.fp == e.fp && same(o.slot, e.slot)).is_ok() {
                    return None;
                }
                seg.insert_new(e);
            }
            segs.push(seg);
        }
        Some(Self {
            dir: (0..n as u32).collect(),
            depth,
            segs,
            len: sorted.len(),
            scratch: Scratch::default(),
        })
    }

    /// Bytes held: directory, segments and their lines.
    pub(crate) fn bytes(&self) -> usize {
        self.dir.capacity() * 4
            + self.segs.capacity() * std::mem::size_of::<Segment>()
            + self.segs.iter().map(|s| s.lines.len() * std::mem::size_of::<Line>()).sum::<usize>()
            + self.scratch.bytes()
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
            for e in seg.entries() {
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
        assert!(
            t.segs.iter().all(|s| s.len * 16 <= s.capacity() * 15 && s.lines.len() <= SEG_LINES),
            "no segment outgrew a split"
        );
        let load = t.len() as f64 / t.segs.iter().map(Segment::capacity).sum::<usize>() as f64;
        assert!(load > 0.6, "segments stay well filled ({load:.2})");
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
        for v in 0..16_000u32 {
            add(&mut t, h(v), v);
        }
        assert_eq!(t.depth, MAX_DEPTH, "the directory split as far as it may");
        let seg = &t.segs[t.seg_of(fingerprint(h(0)))];
        assert_eq!(seg.len, 16_000, "one segment holds them all");
        for v in 0..16_000u32 {
            assert_eq!(t.find(h(v), |j| j == v), Some(v));
        }
        assert!(t.remove(h(5), 5));
        assert_eq!(t.find(h(5), |j| j == 5), None);
        assert_eq!(t.len(), 15_999);
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

    /// Entries of segment `s` sit where a probe from their home finds them: no empty entry
    /// between home and entry.
    fn probes_reach_every_entry(seg: &Segment) {
        for p in 0..seg.capacity() {
            let e = seg.at(p);
            if e.slot == EMPTY {
                continue;
            }
            let mut q = seg.home(e.fp);
            while q != p {
                assert_ne!(seg.at(q).slot, EMPTY, "a gap before slot {} at {p}", e.slot);
                q = seg.next(q);
            }
        }
    }

    #[test]
    fn a_refiled_segment_wraps_a_cluster_past_its_end() {
        // Twenty keys homed on the last of four lines: twelve run past the end and wrap.
        let probe = Segment::new(0, 0, 4);
        let fps: Vec<u32> = (0u32..).filter(|&fp| probe.home(fp) == 24).take(20).collect();
        let entries: Vec<Entry> =
            fps.iter().enumerate().map(|(i, &fp)| Entry { slot: i as u32, fp }).collect();
        let seg = Segment::filled(0, 0, 4, &entries, &mut Sorter::default());
        assert_eq!(seg.len, 20);
        probes_reach_every_entry(&seg);
        for e in &entries {
            let at = seg.probe(e.fp, |o| o.slot == e.slot);
            assert!(at.is_ok_and(|p| seg.at(p) == *e), "slot {} is found", e.slot);
        }
        assert!((0..12).all(|p| seg.at(p).slot != EMPTY), "the wrapped entries lead the segment");
    }

    proptest::proptest! {
        /// Inserts and removals under a few fingerprints (long clusters that wrap around a
        /// segment's end) agree with a map, and every entry stays reachable from its home.
        #[test]
        fn a_segment_table_agrees_with_a_map(
            ops in proptest::collection::vec((0u32..600, proptest::bool::ANY, 0u64..24), 1..2_000)
        ) {
            let mut t = SegTable::default();
            let mut model = std::collections::HashMap::new();
            // Few distinct hashes: many slots share a fingerprint and a home.
            let h = |k: u64| mix(k as u32) & 0xffff_fff0_ffff_ffff;
            for (v, add, k) in ops {
                if add {
                    let held = model.get(&v).copied();
                    let got = t.find_or_insert(h(k), |j| j == v && held == Some(k), v);
                    if held.is_none() {
                        // A slot number is one key: a new one under its hash.
                        proptest::prop_assert_eq!(got, None);
                        model.insert(v, k);
                    } else if held == Some(k) {
                        proptest::prop_assert_eq!(got, Some(v));
                    } else {
                        // Under another hash than its own: not found there, and added
                        // twice; take it straight out again to keep one entry per slot.
                        proptest::prop_assert!(t.remove(h(k), v));
                    }
                } else {
                    let held = model.remove(&v);
                    let removed = held.is_some_and(|k| t.remove(h(k), v));
                    proptest::prop_assert_eq!(removed, held.is_some());
                }
                proptest::prop_assert_eq!(t.len(), model.len());
            }
            for (&v, &k) in &model {
                proptest::prop_assert_eq!(t.find(h(k), |j| j == v), Some(v));
            }
            for seg in &t.segs {
                probes_reach_every_entry(seg);
                proptest::prop_assert_eq!(seg.entries().count(), seg.len);
            }
        }
    }
}
