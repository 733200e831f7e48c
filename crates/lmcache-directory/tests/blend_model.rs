//! The fingerprint (CacheBlend) index against a reference model on random traces: stores with
//! and without tokens and positions, content changes under one chunk hash, deletes and
//! fences, over two blend namespaces with two ranks and two object groups each. Contents are
//! drawn from a tiny alphabet so windows repeat and overlap. After every step every query
//! must match exactly what the model allows: each match token-exact, claimed by the
//! requester's namespace, at its stored position; every probed position with a claimable
//! chunk answered unless all such chunks were already matched. The restored checkpoint
//! image answers the same.

use std::collections::{BTreeMap, BTreeSet};

use lmcache_directory::{
    BlendConfig, DirKey, Directory, DirectoryConfig, Entry, EventKind, InstanceId, Namespace, NsId,
    Tier,
};
use proptest::prelude::*;

const CS: usize = 3;
const INSTANCES: u8 = 2;
const CHUNKS: u8 = 5;
/// Key namespaces: (salt 0/1) × (rank 0/1) × (object group 0/1).
const KEY_NS: u8 = 8;

/// Contents: most are one chunk long; the last two are not indexable (wrong length).
const CONTENTS: &[&[u32]] = &[&[1, 2, 1], &[2, 1, 2], &[1, 1, 1], &[2, 1, 1], &[1, 2], &[]];

fn salt_of(ns: u8) -> u8 {
    ns >> 2
}

#[derive(Debug, Clone)]
enum Op {
    Store { inst: u8, l2: bool, keys: Vec<(u8, u8)>, content: usize, offset: i64 },
    Delete { inst: u8, l2: bool, keys: Vec<(u8, u8)> },
    Fence { inst: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    let keys = prop::collection::vec((0..CHUNKS, 0..KEY_NS), 1..5);
    prop_oneof![
        5 => (0..INSTANCES, any::<bool>(), keys.clone(), 0..CONTENTS.len(), prop_oneof![Just(-1i64), 0..40i64])
            .prop_map(|(inst, l2, keys, content, offset)| Op::Store { inst, l2, keys, content, offset }),
        2 => (0..INSTANCES, any::<bool>(), keys).prop_map(|(inst, l2, keys)| Op::Delete { inst, l2, keys }),
        1 => (0..INSTANCES).prop_map(|inst| Op::Fence { inst }),
    ]
}

/// A key's placements (instance, in L2) and whether it is bound to its chunk's tokens.
type KeyState = (BTreeSet<(u8, bool)>, bool);

#[derive(Default)]
struct Model {
    /// (chunk, key ns) → its state.
    keys: BTreeMap<(u8, u8), KeyState>,
    /// chunk → (tokens, offset) while some key of it is bound.
    bindings: BTreeMap<u8, (Vec<u32>, i64)>,
}

impl Model {
    fn apply(&mut self, op: &Op) {
        match op {
            Op::Store { inst, l2, keys, content, offset } => {
                let tokens = CONTENTS[*content];
                for &(c, n) in keys {
                    let binding_exists = self.bindings.contains_key(&c);
                    let rec = self.keys.entry((c, n)).or_default();
                    rec.0.insert((*inst, *l2));
                    if !rec.1 && (!tokens.is_empty() || binding_exists) {
                        rec.1 = true;
                    }
                    if rec.1 && !tokens.is_empty() {
                        let b = self.bindings.entry(c).or_insert((tokens.to_vec(), *offset));
                        if b.0 != tokens {
                            *b = (tokens.to_vec(), *offset);
                        } else if *offset >= 0 {
                            b.1 = *offset;
                        }
                    }
                }
            }
            Op::Delete { inst, l2, keys } => {
                for k in keys {
                    if let Some(rec) = self.keys.get_mut(k) {
                        rec.0.remove(&(*inst, *l2));
                    }
                }
                self.gc();
            }
            Op::Fence { inst } => {
                for rec in self.keys.values_mut() {
                    rec.0.remove(&(*inst, false));
                }
                self.gc();
            }
        }
    }

    fn gc(&mut self) {
        self.keys.retain(|_, rec| !rec.0.is_empty());
        let bound: BTreeSet<u8> = self.keys.iter().filter(|(_, r)| r.1).map(|(k, _)| k.0).collect();
        self.bindings.retain(|c, _| bound.contains(c));
    }

    /// Chunks salt `salt` may be served: claimed (a bound key of that salt) and indexable.
    fn servable(&self, salt: u8) -> BTreeMap<u8, (Vec<u32>, u64)> {
        self.bindings
            .iter()
            .filter(|(c, (t, off))| {
                t.len() == CS
                    && *off >= 0
                    && self.keys.iter().any(|((kc, n), r)| kc == *c && r.1 && salt_of(*n) == salt)
            })
            .map(|(c, (t, off))| (*c, (t.clone(), *off as u64)))
            .collect()
    }
}

struct Subject {
    d: Directory,
    ns: Vec<NsId>,
    inst: Vec<InstanceId>,
}

fn config(stride: usize) -> DirectoryConfig {
    DirectoryConfig {
        blend: Some(BlendConfig { chunk_size: CS, probe_stride: stride }),
        ..DirectoryConfig::default()
    }
}

impl Subject {
    fn new(stride: usize) -> Self {
        let mut d = Directory::new(config(stride));
        let ns = (0..KEY_NS)
            .map(|n| {
                let rank = u32::from(n >> 1 & 1);
                d.namespace(&Namespace {
                    model: "m".into(),
                    kv_rank: 2 << 24 | rank << 16 | 2 << 8 | rank,
                    object_group: u32::from(n & 1),
                    cache_salt: format!("s{}", salt_of(n)).into(),
                })
                .unwrap()
            })
            .collect();
        let inst = (0..INSTANCES).map(|i| d.instance(&format!("i{i}")).unwrap()).collect();
        Self { d, ns, inst }
    }

    fn key(&self, (c, n): (u8, u8)) -> DirKey {
        DirKey { hash: [c; 32], ns: self.ns[n as usize] }
    }

    fn apply(&mut self, op: &Op) {
        let (inst, l2, kind, keys, content, offset) = match op {
            Op::Store { inst, l2, keys, content, offset } => {
                (*inst, *l2, EventKind::Store, keys, CONTENTS[*content], *offset)
            }
            Op::Delete { inst, l2, keys } => (*inst, *l2, EventKind::Delete, keys, &[][..], -1),
            Op::Fence { inst } => {
                self.d.fence_l1(self.inst[*inst as usize]);
                return;
            }
        };
        let who = self.inst[inst as usize];
        let site = if l2 {
            self.d.site(who, Tier::L2, "fs", false).unwrap()
        } else {
            self.d.site(who, Tier::L1, "dram", false).unwrap()
        };
        let e: Vec<Entry<'_>> = keys
            .iter()
            .map(|k| Entry { key: self.key(*k), size: 1, tokens: content, token_offset: offset })
            .collect();
        self.d.apply(who, 1, kind, site, 0.0, &e).unwrap();
    }
}

fn check(m: &Model, d: &Directory, queries: &[Vec<u32>], stride: usize) {
    for salt in 0..2u8 {
        let servable = m.servable(salt);
        for q in queries {
            let got = d.blend_matches(q, "m", &format!("s{salt}"), 2);
            let mut matched_before: BTreeSet<u8> = BTreeSet::new();
            let mut by_pos: BTreeMap<u64, u8> = BTreeMap::new();
            for w in got.windows(2) {
                assert!(w[0].cur_st < w[1].cur_st, "ascending, one per position: {got:?}");
            }
            for mt in &got {
                let c = mt.chunk_hash[0];
                let (tokens, off) = servable
                    .get(&c)
                    .unwrap_or_else(|| panic!("salt {salt} served chunk {c} it may not: {got:?}"));
                let at = mt.cur_st as usize;
                assert_eq!(&q[at..at + CS], &tokens[..], "token-exact");
                assert_eq!(mt.old_st, *off, "stored position");
                assert_eq!(at % stride, 0);
                by_pos.insert(mt.cur_st, c);
            }
            if q.len() < CS {
                assert!(got.is_empty());
                continue;
            }
            for p in (0..=q.len() - CS).step_by(stride) {
                let candidates: BTreeSet<u8> = servable
                    .iter()
                    .filter(|(_, (t, _))| t[..] == q[p..p + CS])
                    .map(|(c, _)| *c)
                    .collect();
                match by_pos.get(&(p as u64)) {
                    Some(c) => {
                        assert!(!matched_before.contains(c), "chunk {c} matched twice: {got:?}");
                        matched_before.insert(*c);
                    }
                    None => assert!(
                        candidates.is_subset(&matched_before),
                        "position {p} of {q:?} left unanswered for salt {salt}: {candidates:?}, got {got:?}"
                    ),
                }
            }
        }
    }
}

fn queries() -> impl Strategy<Value = Vec<Vec<u32>>> {
    prop::collection::vec(prop::collection::vec(1..3u32, 0..12), 1..4)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn blend_matches_equal_the_reference_model(
        ops in prop::collection::vec(op(), 1..40),
        queries in queries(),
        stride in 1..3usize,
    ) {
        let mut m = Model::default();
        let mut s = Subject::new(stride);
        for op in &ops {
            m.apply(op);
            s.apply(op);
            check(&m, &s.d, &queries, stride);
        }
        // The index is not saved: a restore re-derives it from the bindings.
        let mut image = Vec::new();
        s.d.encode(&mut image);
        let restored = Directory::decode(&image, config(stride)).unwrap();
        check(&m, &restored, &queries, stride);
        prop_assert_eq!(restored.blend_stats().num_chunks, s.d.blend_stats().num_chunks);
        prop_assert_eq!(restored.blend_stats().num_claims, s.d.blend_stats().num_claims);
        prop_assert_eq!(restored.blend_stats().num_contents, s.d.blend_stats().num_contents);
    }
}

#[test]
fn churn_keeps_the_index_bounded() {
    // 30 rounds, each storing 2,000 fresh chunks and deleting the previous round's.
    let mut d = Directory::new(DirectoryConfig {
        blend: Some(BlendConfig { chunk_size: 16, probe_stride: 1 }),
        ..DirectoryConfig::default()
    });
    let ns = d
        .namespace(&Namespace {
            model: "m".into(),
            kv_rank: 1 << 24 | 1 << 8,
            object_group: 0,
            cache_salt: "".into(),
        })
        .unwrap();
    let a = d.instance("a").unwrap();
    let l1 = d.site(a, Tier::L1, "dram", false).unwrap();
    let mut peak_table = 0;
    for round in 0..30u32 {
        let tokens: Vec<Vec<u32>> = (0..2000u32)
            .map(|i| (0..16).map(|t| round * 1_000_000 + i * 16 + t).collect())
            .collect();
        let key = |i: u32| {
            let mut h = [0u8; 32];
            h[..4].copy_from_slice(&round.to_le_bytes());
            h[4..8].copy_from_slice(&i.to_le_bytes());
            DirKey { hash: h, ns }
        };
        let e: Vec<Entry<'_>> = (0..2000u32)
            .map(|i| Entry {
                key: key(i),
                size: 1,
                tokens: &tokens[i as usize],
                token_offset: i64::from(i) * 16,
            })
            .collect();
        d.apply(a, 1, EventKind::Store, l1, 0.0, &e).unwrap();
        let st = d.blend_stats();
        assert_eq!((st.num_contents, st.num_chunks, st.num_claims), (2000, 2000, 2000));
        if round == 0 {
            peak_table = st.table_size;
        }
        assert!(st.table_size <= peak_table, "the filter grew under churn: {st:?}");
        let q: Vec<u32> = tokens[7].iter().chain(&tokens[1999]).copied().collect();
        let m = d.blend_matches(&q, "m", "", 1);
        assert_eq!(m.len(), 2, "round {round}");
        assert_eq!((m[0].old_st, m[1].old_st, m[1].cur_st), (7 * 16, 1999 * 16, 16));
        d.apply(a, 1, EventKind::Delete, l1, 0.0, &e).unwrap();
        let st = d.blend_stats();
        assert_eq!((st.num_contents, st.num_chunks, st.num_claims), (0, 0, 0));
        assert!(st.table_size <= 1024, "an empty index keeps the smallest filter: {st:?}");
    }
}
