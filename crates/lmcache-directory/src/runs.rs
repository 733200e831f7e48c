//! The routing answer: each instance's longest leading run of a request's chunks.
//!
//! A chunk counts for an instance when *every* rank key of the chunk is there: in the
//! instance's own L1 for the L1 run; in its L1, its own L2 or a shared pool it mounts for the
//! L1+L2 run. Chunk hashes are prefix-chained, so a run stops at the first chunk missing.

use crate::directory::Directory;
use crate::ids::{DirKey, InstanceId, Tier};

/// A request's keys, chunk-major: chunk `i`'s rank keys are `keys[i*per_chunk..][..per_chunk]`.
#[derive(Debug, Clone, Copy)]
pub struct RunQuery<'a> {
    /// The keys.
    pub keys: &'a [DirKey],
    /// Keys per chunk (the world size times object groups); at least 1.
    pub per_chunk: usize,
}

/// One instance's runs, in chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixRun {
    /// The instance.
    pub instance: InstanceId,
    /// Leading chunks in its L1.
    pub l1: u32,
    /// Leading chunks in its L1, its L2 or a shared pool it mounts (≥ `l1`).
    pub any: u32,
}

/// A set of instances as a bitset over their dense ids: a fixed array of words for fleets up
/// to 1,024 instances (the scan's loops then have constant bounds), a vector beyond.
trait Bits: Clone {
    fn words(&self) -> &[u64];
    fn words_mut(&mut self) -> &mut [u64];
}

impl<const W: usize> Bits for [u64; W] {
    fn words(&self) -> &[u64] {
        self
    }
    fn words_mut(&mut self) -> &mut [u64] {
        self
    }
}

impl Bits for Vec<u64> {
    fn words(&self) -> &[u64] {
        self
    }
    fn words_mut(&mut self) -> &mut [u64] {
        self
    }
}

/// Sets instance `i` in `bits`, which hold words `lo..` of a set (bits outside are dropped:
/// the scan only tracks words where someone is still alive).
fn set(bits: &mut [u64], lo: usize, i: InstanceId) {
    let (w, b) = ((i.index() / 64) as usize, i.index() % 64);
    if let Some(word) = w.checked_sub(lo).and_then(|w| bits.get_mut(w)) {
        *word |= 1 << b;
    }
}

fn or(into: &mut [u64], from: &[u64]) {
    into.iter_mut().zip(from).for_each(|(c, k)| *c |= k);
}

fn and(into: &mut [u64], from: &[u64]) {
    into.iter_mut().zip(from).for_each(|(c, k)| *c &= k);
}

/// The words of `bits` from the first nonzero one to the last (empty when all are zero).
fn live_range(bits: &[u64]) -> (usize, usize) {
    match bits.iter().position(|w| *w != 0) {
        Some(lo) => (lo, bits.iter().rposition(|w| *w != 0).map_or(lo, |h| h) + 1),
        None => (0, 0),
    }
}

/// Calls `f(instance)` for every instance in `before` but not in `after` (words `lo..`).
fn dropped(before: &[u64], after: &[u64], lo: usize, mut f: impl FnMut(usize)) {
    for (w, (b, a)) in before.iter().zip(after).enumerate() {
        let mut gone = b & !a;
        while gone != 0 {
            let bit = gone.trailing_zeros() as usize;
            gone &= gone - 1;
            f((lo + w) * 64 + bit);
        }
    }
}

impl Directory {
    /// Every instance with a run of at least one chunk (in L1 or anywhere), longest `any`
    /// first, then longest `l1`, then by id.
    ///
    /// Per chunk, each rank key's placements set bits in two bitsets over instance ids (its
    /// L1 holders; everyone who can load it), the chunk's sets are their AND, and the alive
    /// sets shrink by AND too; an instance's run is the chunk where its bit went. A chunk whose
    /// rank keys each name the placements (the same head, or the same shared list) their keys
    /// in the chunk before named is passed over without the bitsets: its sets are that chunk's
    /// (a request's chunks stored in one batch share one head, and a prefix that several
    /// servers stored shares one list, so most of a walk is such chunks). The scan stops
    /// when nobody is left. It allocates the answer and one L1 run per instance; the bitsets
    /// are on the stack up to 1,024 instances, the chunk's slots and heads up to 8 rank keys.
    pub fn prefix_runs(&self, q: RunQuery<'_>) -> Vec<PrefixRun> {
        match self.instance_count().div_ceil(64) {
            0 | 1 => self.scan::<_, false>(q, [0u64; 1]),
            2 => self.scan::<_, false>(q, [0u64; 2]),
            3 | 4 => self.scan::<_, true>(q, [0u64; 4]),
            5..=8 => self.scan::<_, true>(q, [0u64; 8]),
            9..=16 => self.scan::<_, true>(q, [0u64; 16]),
            words => self.scan::<_, true>(q, vec![0u64; words]),
        }
    }

    /// With `NARROW`, bitset work shrinks to the words where someone is alive (worth it past
    /// two words; below, whole fixed-size arrays are cheaper than the bounds).
    fn scan<B: Bits, const NARROW: bool>(&self, q: RunQuery<'_>, zero: B) -> Vec<PrefixRun> {
        let per = q.per_chunk.max(1);
        let (mut l1_alive, mut any_alive) = (zero.clone(), zero.clone());
        let (mut c_l1, mut c_any, mut k_l1, mut k_any) =
            (zero.clone(), zero.clone(), zero.clone(), zero.clone());
        // Words where someone may still be alive: all of them for the first chunk, then the
        // span of `any_alive`, which only shrinks. Outside it every set below is zero.
        let (mut narrow_lo, mut narrow_hi) = (0, zero.words().len());
        // Per instance (by id), its L1 run once it dropped out of L1; filled as they drop.
        let mut l1_run: Vec<u32> = Vec::new();
        let mut out: Vec<PrefixRun> = Vec::new();
        let mut done = 0u32;
        // A request's keys were stored in one batch, so they sit in consecutive slots: each
        // key is tried in the slot after the previous one's before the table is probed.
        let usable = q.keys.len() - q.keys.len() % per;
        let mut prev: Option<u32> = None;
        let width = zero.words().len();
        // The chunk's slots, and what each rank key's slot named in the chunk before (a head or
        // a list; `None`: no key).
        let mut slots: smallvec::SmallVec<[Option<u32>; 8]> = smallvec::SmallVec::new();
        let mut heads: smallvec::SmallVec<[Option<u32>; 8]> = smallvec::smallvec![None; per];
        for chunk in q.keys[..usable].chunks(per) {
            // Constant bounds when not narrowing, so fixed-size arrays keep fixed-size loops.
            let (lo, hi) = if NARROW { (narrow_lo, narrow_hi) } else { (0, width) };
            slots.clear();
            let mut same = done > 0;
            for (key, head) in chunk.iter().zip(heads.iter_mut()) {
                let slot = self.slot_after(prev, key);
                prev = slot.or(prev);
                slots.push(slot);
                let now = slot.and_then(|i| self.held_at(i));
                same &= now.is_some() && now == *head;
                *head = now;
            }
            if same {
                // Every rank key names the placements its key in the chunk before named: the
                // chunk's sets are the chunk before's, so nobody drops out here.
                done += 1;
                continue;
            }
            for (j, &slot) in slots.iter().enumerate() {
                let kl = &mut k_l1.words_mut()[lo..hi];
                let ka = &mut k_any.words_mut()[lo..hi];
                kl.fill(0);
                ka.fill(0);
                let Some(i) = slot else {
                    // A key nobody holds: the chunk ends every run.
                    c_l1.words_mut()[lo..hi].fill(0);
                    c_any.words_mut()[lo..hi].fill(0);
                    continue;
                };
                let mounted = |ka: &mut [u64], site_id| {
                    for &m in self.mounts(site_id) {
                        set(ka, lo, m);
                    }
                };
                match self.spill_at(i) {
                    Some(sp) => {
                        // Private owners come precomputed; only shared pools are read.
                        or(kl, sp.l1.get(lo..).unwrap_or_default());
                        or(ka, sp.any.get(lo..).unwrap_or_default());
                        if sp.shared != 0 {
                            for p in self.placements_at(i) {
                                if self.site_owner(p.site()).is_none() {
                                    mounted(ka, p.site());
                                }
                            }
                        }
                    }
                    None => {
                        // One placement, the slot's head.
                        for p in self.placements_at(i) {
                            match self.site_owner(p.site()) {
                                Some((owner, tier)) => {
                                    if tier == Tier::L1 {
                                        set(kl, lo, owner);
                                    }
                                    set(ka, lo, owner);
                                }
                                None => mounted(ka, p.site()),
                            }
                        }
                    }
                }
                let (cl, ca) = (&mut c_l1.words_mut()[lo..hi], &mut c_any.words_mut()[lo..hi]);
                if j == 0 {
                    cl.copy_from_slice(kl);
                    ca.copy_from_slice(ka);
                } else {
                    and(cl, kl);
                    and(ca, ka);
                }
            }
            if done == 0 {
                l1_alive = c_l1.clone();
                any_alive = c_any.clone();
                if any_alive.words().iter().all(|w| *w == 0) {
                    return Vec::new();
                }
                l1_run = vec![0; any_alive.words().len() * 64];
                let alive = any_alive.words().iter().map(|w| w.count_ones() as usize).sum();
                out.reserve_exact(alive);
            } else {
                let (cl, ca) = (&mut c_l1.words_mut()[lo..hi], &mut c_any.words_mut()[lo..hi]);
                let (al, aa) =
                    (&mut l1_alive.words_mut()[lo..hi], &mut any_alive.words_mut()[lo..hi]);
                and(cl, al);
                and(ca, aa);
                dropped(al, cl, lo, |i| l1_run[i] = done);
                // An instance leaves `any` at or after it left L1 (L1 holders are a subset).
                dropped(aa, ca, lo, |i| {
                    out.push(PrefixRun { instance: InstanceId(i as u32), l1: l1_run[i], any: done })
                });
                al.copy_from_slice(cl);
                aa.copy_from_slice(ca);
            }
            done += 1;
            let (l, h) = live_range(&any_alive.words()[lo..hi]);
            if l == h {
                break;
            }
            if NARROW {
                (narrow_lo, narrow_hi) = (lo + l, lo + h);
            }
        }
        let (lo, hi) = (narrow_lo, narrow_hi);
        if done > 0 {
            let empty = &zero.words()[lo..hi];
            dropped(&l1_alive.words()[lo..hi], empty, lo, |i| l1_run[i] = done);
            dropped(&any_alive.words()[lo..hi], empty, lo, |i| {
                out.push(PrefixRun { instance: InstanceId(i as u32), l1: l1_run[i], any: done })
            });
        }
        ordered(&mut out);
        out
    }
}

/// Puts `runs` in the answer's order (longest `any` first, then longest `l1`, then by id),
/// in place, from the order the scan pushes them: `any` never decreasing, and each `any` one
/// drop event whose instances ascend. Reversed, the groups come longest first with their ids
/// descending; each group is reversed back, and only a group whose `l1`s differ is then
/// sorted (stably): linear for the usual answer, where a shared prefix ends every run but one
/// at the same chunk with the same `l1`.
fn ordered(runs: &mut [PrefixRun]) {
    use std::cmp::Reverse;
    runs.reverse();
    for group in runs.chunk_by_mut(|a, b| a.any == b.any) {
        group.reverse();
        if !group.is_sorted_by_key(|r| Reverse(r.l1)) {
            group.sort_by_key(|r| Reverse(r.l1));
        }
    }
    debug_assert!(runs.is_sorted_by_key(|r| (Reverse(r.any), Reverse(r.l1), r.instance)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DirectoryConfig, Entry, EventKind, Namespace, NsId};

    /// Model "m"'s namespace at `kv_rank` in `d`.
    fn ns(d: &mut Directory, kv_rank: u32) -> NsId {
        let ns = Namespace { model: "m".into(), kv_rank, object_group: 0, cache_salt: "".into() };
        d.namespace(&ns).unwrap()
    }

    /// Every bitset width the scan picks (1, 2, 4, 8 and 16 words, and a vector past 1,024
    /// instances) gives the same answer: the last instances hold runs of 5, 3 (1 in L1) and,
    /// through a shared pool they mount, 2 chunks; a key in the middle of a chunk is held by
    /// one instance only.
    #[test]
    fn every_fleet_size_gives_the_same_runs() {
        for n in [3u32, 70, 200, 300, 600, 1100] {
            let mut d = Directory::new(DirectoryConfig::default());
            let ns = ns(&mut d, 0x0100_0100);
            let ids: Vec<InstanceId> =
                (0..n).map(|i| d.instance(&format!("i{i}")).unwrap()).collect();
            let (a, b, c) = (ids[n as usize - 1], ids[n as usize - 2], ids[n as usize - 3]);
            let k = |c: u8| DirKey { hash: [c; 32], ns };
            let e = |key| Entry { key, size: 1, tokens: &[], token_offset: -1 };
            let l1 = |d: &mut Directory, i| d.site(i, Tier::L1, "dram", false).unwrap();
            let (a1, b1) = (l1(&mut d, a), l1(&mut d, b));
            let b2 = d.site(b, Tier::L2, "fs", false).unwrap();
            let pool = d.site(c, Tier::L2, "s3", true).unwrap();
            d.apply(a, 1, EventKind::Store, a1, 0.0, &(0..5).map(|i| e(k(i))).collect::<Vec<_>>())
                .unwrap();
            d.apply(b, 1, EventKind::Store, b1, 0.0, &[e(k(0))]).unwrap();
            d.apply(b, 1, EventKind::Store, b2, 0.0, &[e(k(1)), e(k(2)), e(k(4))]).unwrap();
            d.apply(c, 1, EventKind::Store, pool, 0.0, &[e(k(0)), e(k(1))]).unwrap();
            let q: Vec<DirKey> = (0..6).map(k).collect();
            let got = d.prefix_runs(RunQuery { keys: &q, per_chunk: 1 });
            assert_eq!(
                got,
                vec![
                    PrefixRun { instance: a, l1: 5, any: 5 },
                    PrefixRun { instance: b, l1: 1, any: 3 },
                    PrefixRun { instance: c, l1: 0, any: 2 },
                ],
                "{n} instances"
            );
        }
    }

    /// Chunks whose keys have the placement of the chunk before (one store batch's) skip the
    /// bitsets; a chunk held more widely, a missing one, or another placement does not.
    #[test]
    fn chunks_of_one_batch_keep_the_runs_and_the_rest_change_them() {
        let mut d = Directory::new(DirectoryConfig::default());
        let ns = ns(&mut d, 0x0100_0100);
        let (a, b) = (d.instance("a").unwrap(), d.instance("b").unwrap());
        let (a1, b1) = (
            d.site(a, Tier::L1, "dram", false).unwrap(),
            d.site(b, Tier::L1, "dram", false).unwrap(),
        );
        let a2 = d.site(a, Tier::L2, "fs", false).unwrap();
        let k = |c: u8| DirKey { hash: [c; 32], ns };
        let e = |key| Entry { key, size: 1, tokens: &[], token_offset: -1 };
        let batch = |cs: std::ops::Range<u8>| cs.map(|c| e(k(c))).collect::<Vec<_>>();
        d.apply(a, 1, EventKind::Store, a1, 0.0, &batch(0..12)).unwrap();
        d.apply(b, 1, EventKind::Store, b1, 0.0, &batch(0..4)).unwrap();
        let q: Vec<DirKey> = (0..12).map(k).collect();
        // a's runs (l1, any); b's stay 4 chunks in L1.
        let a_has = |d: &Directory, l1, any| {
            let got = d.prefix_runs(RunQuery { keys: &q, per_chunk: 1 });
            let b_has = PrefixRun { instance: b, l1: 4, any: 4 };
            assert_eq!(got, vec![PrefixRun { instance: a, l1, any }, b_has]);
        };
        a_has(&d, 12, 12);
        // Chunk 9 moves to a's L2 (another placement): a's L1 run ends there, its any-run not.
        d.apply(a, 1, EventKind::Delete, a1, 0.0, &[e(k(9))]).unwrap();
        d.apply(a, 1, EventKind::Store, a2, 0.0, &[e(k(9))]).unwrap();
        a_has(&d, 9, 12);
        // Chunk 6 gone: every run ends there.
        d.apply(a, 1, EventKind::Delete, a1, 0.0, &[e(k(6))]).unwrap();
        a_has(&d, 6, 6);
    }

    #[test]
    fn runs_need_every_rank_and_stop_at_the_first_gap() {
        let mut d = Directory::new(DirectoryConfig::default());
        let (r0, r1) = (ns(&mut d, 0x0200_0200), ns(&mut d, 0x0201_0201));
        let a = d.instance("a").unwrap();
        let b = d.instance("b").unwrap();
        let a1 = d.site(a, Tier::L1, "dram", false).unwrap();
        let b1 = d.site(b, Tier::L1, "dram", false).unwrap();
        let s3 = d.site(b, Tier::L2, "s3", true).unwrap();
        d.site(a, Tier::L2, "s3", true).unwrap();
        let k = |ns, c: u8| DirKey { hash: [c; 32], ns };
        let e = |key| Entry { key, size: 1, tokens: &[], token_offset: -1 };
        // a: chunks 0,1 on both ranks, chunk 2 only rank 0.
        d.apply(
            a,
            1,
            EventKind::Store,
            a1,
            0.0,
            &[e(k(r0, 0)), e(k(r1, 0)), e(k(r0, 1)), e(k(r1, 1)), e(k(r0, 2))],
        )
        .unwrap();
        // b: chunk 0 in L1; chunks 0..3 in the shared pool (both ranks).
        d.apply(b, 1, EventKind::Store, b1, 0.0, &[e(k(r0, 0)), e(k(r1, 0))]).unwrap();
        let pool: Vec<_> = (0..3).flat_map(|c| [e(k(r0, c)), e(k(r1, c))]).collect();
        d.apply(b, 1, EventKind::Store, s3, 0.0, &pool).unwrap();
        let q: Vec<DirKey> = (0..4).flat_map(|c| [k(r0, c), k(r1, c)]).collect();
        let runs = d.prefix_runs(RunQuery { keys: &q, per_chunk: 2 });
        assert_eq!(
            runs,
            vec![
                PrefixRun { instance: a, l1: 2, any: 3 },
                PrefixRun { instance: b, l1: 1, any: 3 }
            ],
            "a mounts the pool too, so its any-run reaches chunk 2 through it"
        );
        assert!(d.prefix_runs(RunQuery { keys: &q[2..], per_chunk: 2 }).iter().all(|r| r.l1 <= 1));
    }
}
