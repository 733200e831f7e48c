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

/// A set of instances as a bitset over their dense ids (four words inline: 256 instances
/// without allocating).
type Bits = smallvec::SmallVec<[u64; 4]>;

fn set(bits: &mut Bits, i: InstanceId) {
    let (w, b) = ((i.index() / 64) as usize, i.index() % 64);
    if let Some(word) = bits.get_mut(w) {
        *word |= 1 << b;
    }
}

/// Records `run` for every instance in `before` but not in `after`.
fn dropped(before: &Bits, after: &Bits, run: u32, into: &mut [u32]) {
    for (w, (b, a)) in before.iter().zip(after).enumerate() {
        let mut gone = b & !a;
        while gone != 0 {
            let bit = gone.trailing_zeros() as usize;
            gone &= gone - 1;
            if let Some(slot) = into.get_mut(w * 64 + bit) {
                *slot = run;
            }
        }
    }
}

impl Directory {
    /// Every instance with a run of at least one chunk (in L1 or anywhere), longest `any`
    /// first, then longest `l1`, then by id.
    ///
    /// Per chunk, each rank key's placements set bits in two bitsets over instance ids (its
    /// L1 holders; everyone who can load it), the chunk's sets are their AND, and the alive
    /// sets shrink by AND too; an instance's run is the chunk where its bit went. The scan
    /// stops when nobody is left. No allocation below 256 instances.
    pub fn prefix_runs(&self, q: RunQuery<'_>) -> Vec<PrefixRun> {
        let per = q.per_chunk.max(1);
        let n = self.instance_count();
        let words = n.div_ceil(64);
        let zero: Bits = smallvec::smallvec![0; words];
        let (mut l1_alive, mut any_alive) = (zero.clone(), zero.clone());
        let mut l1_run = vec![0u32; 0];
        let mut any_run = vec![0u32; 0];
        let mut started = false;
        let mut done = 0u32;
        let (mut c_l1, mut c_any, mut k_l1, mut k_any) =
            (zero.clone(), zero.clone(), zero.clone(), zero.clone());
        // A request's keys were stored in one batch, so they sit in consecutive slots: each
        // key is tried in the slot after the previous one's before the table is probed.
        let usable = q.keys.len() - q.keys.len() % per;
        let mut prev: Option<u32> = None;
        for chunk in q.keys[..usable].chunks(per) {
            for (j, key) in chunk.iter().enumerate() {
                k_l1.iter_mut().for_each(|w| *w = 0);
                k_any.iter_mut().for_each(|w| *w = 0);
                let slot = self.slot_after(prev, key);
                prev = slot.or(prev);
                let spill = slot.and_then(|i| self.spill_at(i));
                if let Some(sp) = spill {
                    // Private owners come precomputed; only shared pools are read below.
                    k_l1.iter_mut().zip(&sp.l1).for_each(|(k, b)| *k |= b);
                    k_any.iter_mut().zip(&sp.any).for_each(|(k, b)| *k |= b);
                }
                let found = match (slot, spill) {
                    (_, Some(sp)) if sp.shared == 0 => &[],
                    (Some(i), _) => self.placements_at(i),
                    (None, _) => &[],
                };
                for p in found {
                    let site_id = p.site();
                    if spill.is_some() && self.site_owner(site_id).is_some() {
                        continue;
                    }
                    match self.site_owner(site_id) {
                        Some((owner, tier)) => {
                            if tier == Tier::L1 {
                                set(&mut k_l1, owner);
                            }
                            set(&mut k_any, owner);
                        }
                        None => {
                            for &m in self.mounts(site_id) {
                                set(&mut k_any, m);
                            }
                        }
                    }
                }
                if j == 0 {
                    c_l1.copy_from_slice(&k_l1);
                    c_any.copy_from_slice(&k_any);
                } else {
                    c_l1.iter_mut().zip(&k_l1).for_each(|(c, k)| *c &= k);
                    c_any.iter_mut().zip(&k_any).for_each(|(c, k)| *c &= k);
                }
            }
            if !started {
                started = true;
                l1_alive.copy_from_slice(&c_l1);
                any_alive.copy_from_slice(&c_any);
                if any_alive.iter().all(|w| *w == 0) {
                    return Vec::new();
                }
                l1_run = vec![0; n];
                any_run = vec![0; n];
            } else {
                c_l1.iter_mut().zip(&l1_alive).for_each(|(c, a)| *c &= a);
                c_any.iter_mut().zip(&any_alive).for_each(|(c, a)| *c &= a);
                dropped(&l1_alive, &c_l1, done, &mut l1_run);
                dropped(&any_alive, &c_any, done, &mut any_run);
                l1_alive.copy_from_slice(&c_l1);
                any_alive.copy_from_slice(&c_any);
            }
            done += 1;
            if any_alive.iter().all(|w| *w == 0) {
                break;
            }
        }
        let empty: Bits = zero;
        dropped(&l1_alive, &empty, done, &mut l1_run);
        dropped(&any_alive, &empty, done, &mut any_run);
        let mut out: Vec<PrefixRun> = any_run
            .iter()
            .zip(&l1_run)
            .enumerate()
            .filter(|(_, (any, _))| **any > 0)
            .map(|(i, (&any, &l1))| PrefixRun { instance: InstanceId(i as u32), l1, any })
            .collect();
        out.sort_by(|a, b| {
            b.any.cmp(&a.any).then(b.l1.cmp(&a.l1)).then(a.instance.cmp(&b.instance))
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DirectoryConfig, Entry, EventKind, Namespace};

    #[test]
    fn runs_need_every_rank_and_stop_at_the_first_gap() {
        let mut d = Directory::new(DirectoryConfig::default());
        let r0 = d
            .namespace(&Namespace {
                model: "m".into(),
                kv_rank: 0x0200_0200,
                object_group: 0,
                cache_salt: "".into(),
            })
            .unwrap();
        let r1 = d
            .namespace(&Namespace {
                model: "m".into(),
                kv_rank: 0x0201_0201,
                object_group: 0,
                cache_salt: "".into(),
            })
            .unwrap();
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
