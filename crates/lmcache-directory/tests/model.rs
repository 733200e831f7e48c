//! The directory against a reference model on random traces: stores, replacements, deletes
//! (including of absent keys), accesses and fences, over private and shared sites, two ranks
//! and holes. After every step the placements of every key, the totals and the routing runs
//! of every prefix must equal the model's: zero over-credit, zero under-credit. The
//! checkpoint image of the final state restores to the same answers; damaged images never panic.

use std::collections::{BTreeMap, BTreeSet};

use lmcache_directory::{
    DirKey, Directory, DirectoryConfig, Entry, EventKind, InstanceId, Namespace, NsId, PrefixRun,
    RunQuery, Tier,
};
use proptest::prelude::*;

/// The trace's dimensions: instances, chunks per request, ranks per chunk.
#[derive(Debug, Clone, Copy)]
struct Shape {
    instances: u8,
    chunks: u8,
    ranks: u8,
}

/// Small: every key collides often (replacements, deletes, fences of shared keys).
const SMALL: Shape = Shape { instances: 3, chunks: 6, ranks: 2 };
/// Wide: requests of 24 chunks (runs that cross store batches) over 72
/// instances (a placement bitset's second word starts at instance 64).
const WIDE: Shape = Shape { instances: 72, chunks: 24, ranks: 2 };

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum SiteKind {
    L1,
    L2Private,
    L2Shared,
}

#[derive(Debug, Clone)]
enum Op {
    Store { inst: u8, site: SiteKind, keys: Vec<(u8, u8)>, size: u16 },
    Delete { inst: u8, site: SiteKind, keys: Vec<(u8, u8)> },
    Access { inst: u8, keys: Vec<(u8, u8)> },
    Fence { inst: u8 },
}

fn keys(sh: Shape) -> impl Strategy<Value = Vec<(u8, u8)>> {
    prop::collection::vec((0..sh.chunks, 0..sh.ranks), 1..8)
}

/// A request's run of chunks from `from`, every rank: what routing reads as a prefix.
fn run(sh: Shape) -> impl Strategy<Value = Vec<(u8, u8)>> {
    (0..sh.chunks, 1..=sh.chunks).prop_map(move |(from, len)| {
        (from..sh.chunks.min(from + len)).flat_map(|c| (0..sh.ranks).map(move |r| (c, r))).collect()
    })
}

fn site() -> impl Strategy<Value = SiteKind> {
    prop_oneof![Just(SiteKind::L1), Just(SiteKind::L2Private), Just(SiteKind::L2Shared)]
}

fn op(sh: Shape) -> impl Strategy<Value = Op> {
    let n = sh.instances;
    prop_oneof![
        5 => (0..n, site(), keys(sh), 1..1000u16).prop_map(|(inst, site, keys, size)| Op::Store { inst, site, keys, size }),
        4 => (0..n, site(), run(sh), 1..1000u16).prop_map(|(inst, site, keys, size)| Op::Store { inst, site, keys, size }),
        2 => (0..n, site(), keys(sh)).prop_map(|(inst, site, keys)| Op::Delete { inst, site, keys }),
        1 => (0..n, site(), run(sh)).prop_map(|(inst, site, keys)| Op::Delete { inst, site, keys }),
        1 => (0..n, keys(sh)).prop_map(|(inst, keys)| Op::Access { inst, keys }),
        1 => (0..n).prop_map(|inst| Op::Fence { inst }),
    ]
}

/// Placement identity in the model: (site kind, owner or none when shared).
type Ident = (SiteKind, Option<u8>);

struct Model {
    sh: Shape,
    /// (chunk, rank) → identity → (reporter, size)
    keys: BTreeMap<(u8, u8), BTreeMap<Ident, (u8, u64)>>,
    mounts: BTreeSet<u8>,
}

impl Model {
    fn new(sh: Shape) -> Self {
        Self { sh, keys: BTreeMap::new(), mounts: BTreeSet::new() }
    }

    fn ident(inst: u8, site: SiteKind) -> Ident {
        (site, (site != SiteKind::L2Shared).then_some(inst))
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Store { inst, site, keys, size } => {
                if *site == SiteKind::L2Shared {
                    self.mounts.insert(*inst);
                }
                for k in keys {
                    self.keys
                        .entry(*k)
                        .or_default()
                        .insert(Self::ident(*inst, *site), (*inst, u64::from(*size)));
                }
            }
            Op::Delete { inst, site, keys } => {
                if *site == SiteKind::L2Shared {
                    self.mounts.insert(*inst);
                }
                for k in keys {
                    if let Some(p) = self.keys.get_mut(k) {
                        p.remove(&Self::ident(*inst, *site));
                        if p.is_empty() {
                            self.keys.remove(k);
                        }
                    }
                }
            }
            Op::Access { .. } => {}
            Op::Fence { inst } => {
                for p in self.keys.values_mut() {
                    p.remove(&(SiteKind::L1, Some(*inst)));
                }
                self.keys.retain(|_, p| !p.is_empty());
            }
        }
    }

    fn runs(&self, from: u8) -> Vec<(u8, u32, u32)> {
        let mut out = Vec::new();
        let sh = self.sh;
        for inst in 0..sh.instances {
            let l1_ok = |c: u8| {
                (0..sh.ranks).all(|r| {
                    self.keys
                        .get(&(c, r))
                        .is_some_and(|p| p.contains_key(&(SiteKind::L1, Some(inst))))
                })
            };
            let any_ok = |c: u8| {
                (0..sh.ranks).all(|r| {
                    self.keys.get(&(c, r)).is_some_and(|p| {
                        p.keys().any(|(kind, owner)| {
                            *owner == Some(inst)
                                || (*kind == SiteKind::L2Shared && self.mounts.contains(&inst))
                        })
                    })
                })
            };
            let l1 = (from..sh.chunks).take_while(|&c| l1_ok(c)).count() as u32;
            let any = (from..sh.chunks).take_while(|&c| any_ok(c)).count() as u32;
            if any > 0 {
                out.push((inst, l1, any));
            }
        }
        out.sort_by(|a, b| b.2.cmp(&a.2).then(b.1.cmp(&a.1)).then(a.0.cmp(&b.0)));
        out
    }
}

struct Subject {
    d: Directory,
    ns: Vec<NsId>,
    inst: Vec<InstanceId>,
}

impl Subject {
    fn new(sh: Shape) -> Self {
        let mut d = Directory::new(DirectoryConfig::default());
        let ns = (0..sh.ranks)
            .map(|r| {
                let r = u32::from(r);
                let ns = Namespace {
                    model: "m".into(),
                    kv_rank: 2 << 24 | r << 16 | 2 << 8 | r,
                    object_group: 0,
                    cache_salt: "t".into(),
                };
                d.namespace(&ns).unwrap()
            })
            .collect();
        let inst = (0..sh.instances).map(|i| d.instance(&format!("i{i}")).unwrap()).collect();
        Self { d, ns, inst }
    }

    fn key(&self, (c, r): (u8, u8)) -> DirKey {
        DirKey { hash: [c; 32], ns: self.ns[r as usize] }
    }

    fn site(&mut self, inst: u8, site: SiteKind) -> lmcache_directory::SiteId {
        let (tier, backend, shared) = match site {
            SiteKind::L1 => (Tier::L1, "dram", false),
            SiteKind::L2Private => (Tier::L2, "fs", false),
            SiteKind::L2Shared => (Tier::L2, "s3", true),
        };
        self.d.site(self.inst[inst as usize], tier, backend, shared).unwrap()
    }

    fn apply(&mut self, op: &Op, step: usize) {
        let ts = step as f64;
        match op {
            Op::Store { inst, site, keys, size } => {
                let s = self.site(*inst, *site);
                let e: Vec<Entry<'_>> = keys
                    .iter()
                    .map(|k| Entry {
                        key: self.key(*k),
                        size: u64::from(*size),
                        tokens: &[],
                        token_offset: -1,
                    })
                    .collect();
                self.d.apply(self.inst[*inst as usize], 1, EventKind::Store, s, ts, &e).unwrap();
            }
            Op::Delete { inst, site, keys } => {
                let s = self.site(*inst, *site);
                let e: Vec<Entry<'_>> = keys
                    .iter()
                    .map(|k| Entry { key: self.key(*k), size: 0, tokens: &[], token_offset: -1 })
                    .collect();
                self.d.apply(self.inst[*inst as usize], 1, EventKind::Delete, s, ts, &e).unwrap();
            }
            Op::Access { inst, keys } => {
                let s = self.site(*inst, SiteKind::L1);
                let e: Vec<Entry<'_>> = keys
                    .iter()
                    .map(|k| Entry { key: self.key(*k), size: 0, tokens: &[], token_offset: -1 })
                    .collect();
                self.d.apply(self.inst[*inst as usize], 1, EventKind::Access, s, ts, &e).unwrap();
            }
            Op::Fence { inst } => {
                self.d.fence_l1(self.inst[*inst as usize]);
            }
        }
    }
}

fn check(m: &Model, s: &Subject) {
    let sh = m.sh;
    let mut want_keys = 0;
    let (mut l1, mut l2) = ((0u64, 0u64), (0u64, 0u64));
    for c in 0..sh.chunks {
        for r in 0..sh.ranks {
            let got: BTreeSet<(String, Tier, String, u64, bool)> = s
                .d
                .placements(&s.key((c, r)))
                .into_iter()
                .map(|p| (p.instance.to_string(), p.tier, p.backend.to_string(), p.size, p.shared))
                .collect();
            let want: BTreeSet<(String, Tier, String, u64, bool)> = m
                .keys
                .get(&(c, r))
                .into_iter()
                .flatten()
                .map(|((kind, _), (reporter, size))| {
                    let (tier, backend) = match kind {
                        SiteKind::L1 => (Tier::L1, "dram"),
                        SiteKind::L2Private => (Tier::L2, "fs"),
                        SiteKind::L2Shared => (Tier::L2, "s3"),
                    };
                    if tier == Tier::L1 {
                        l1 = (l1.0 + 1, l1.1 + size);
                    } else {
                        l2 = (l2.0 + 1, l2.1 + size);
                    }
                    (
                        format!("i{reporter}"),
                        tier,
                        backend.to_string(),
                        *size,
                        *kind == SiteKind::L2Shared,
                    )
                })
                .collect();
            assert_eq!(got, want, "placements of chunk {c} rank {r}");
            want_keys += u64::from(!want.is_empty());
        }
    }
    let st = s.d.stats();
    assert_eq!(st.keys, want_keys);
    assert_eq!((st.l1.count, st.l1.bytes), l1);
    assert_eq!((st.l2.count, st.l2.bytes), l2);
    for from in 0..sh.chunks {
        let q: Vec<DirKey> = (from..sh.chunks)
            .flat_map(|c| (0..sh.ranks).map(move |r| (c, r)))
            .map(|k| s.key(k))
            .collect();
        let got: Vec<(u8, u32, u32)> =
            s.d.prefix_runs(RunQuery { keys: &q, per_chunk: sh.ranks as usize })
                .into_iter()
                .map(|PrefixRun { instance, l1, any }| (instance.index() as u8, l1, any))
                .collect();
        assert_eq!(got, m.runs(from), "runs from chunk {from}");
    }
}

/// Applies `ops` to the model and the directory, checking them equal every `every` steps and
/// at the end, then that the checkpoint image restores the same directory.
fn trace(sh: Shape, ops: &[Op], every: usize) -> Result<(), TestCaseError> {
    let mut m = Model::new(sh);
    let mut s = Subject::new(sh);
    for (i, op) in ops.iter().enumerate() {
        m.apply(op);
        s.apply(op, i);
        if i % every == 0 || i + 1 == ops.len() {
            check(&m, &s);
        }
    }
    let mut image = Vec::new();
    s.d.encode(&mut image);
    let restored = Subject {
        d: Directory::decode(&image, DirectoryConfig::default()).unwrap(),
        ns: s.ns.clone(),
        inst: s.inst.clone(),
    };
    check(&m, &restored);
    let mut again = Vec::new();
    restored.d.encode(&mut again);
    prop_assert_eq!(again.len(), image.len());
    prop_assert_eq!(restored.d.digest(), s.d.digest(), "equal directories have equal digests");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn directory_equals_the_reference_model(ops in prop::collection::vec(op(SMALL), 1..60)) {
        trace(SMALL, &ops, 1)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Long requests (24 chunks: runs that cross stored batches, so the routing scan's
    /// next-slot guess both hits and misses) on instances past 64 (a bitset's second word).
    #[test]
    fn a_wide_fleet_of_long_requests_equals_the_reference_model(ops in prop::collection::vec(op(WIDE), 1..120)) {
        trace(WIDE, &ops, 4)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn damaged_images_are_refused_or_decoded_never_a_panic(
        ops in prop::collection::vec(op(SMALL), 1..30),
        cuts in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        truncate in any::<prop::sample::Index>(),
    ) {
        let mut s = Subject::new(SMALL);
        for (i, op) in ops.iter().enumerate() {
            s.apply(op, i);
        }
        let mut image = Vec::new();
        s.d.encode(&mut image);
        let mut bad = image.clone();
        for (at, byte) in &cuts {
            let i = at.index(bad.len());
            bad[i] ^= byte | 1;
        }
        let _ = Directory::decode(&bad, DirectoryConfig::default());
        let _ = Directory::decode(&image[..truncate.index(image.len())], DirectoryConfig::default());
    }
}

#[test]
fn a_truncated_or_foreign_image_names_the_problem() {
    let mut s = Subject::new(SMALL);
    s.apply(&Op::Store { inst: 0, site: SiteKind::L1, keys: vec![(1, 0)], size: 5 }, 0);
    let mut image = Vec::new();
    s.d.encode(&mut image);
    assert!(Directory::decode(&image, DirectoryConfig::default()).is_ok());
    assert_eq!(
        Directory::decode(b"NOTADIR!....", DirectoryConfig::default()).unwrap_err(),
        lmcache_directory::DecodeError::Magic
    );
    assert!(matches!(
        Directory::decode(&image[..image.len() - 3], DirectoryConfig::default()),
        Err(lmcache_directory::DecodeError::Truncated(_)
            | lmcache_directory::DecodeError::Invalid { .. })
    ));
    let mut long = image.clone();
    long.push(0);
    assert_eq!(
        Directory::decode(&long, DirectoryConfig::default()).unwrap_err(),
        lmcache_directory::DecodeError::Trailing(1)
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// An image built in steps while events apply between them (the coordinator's checkpoint
    /// that does not pause ingest) decodes, and with the events since its start replayed onto
    /// it equals the directory those events made: no key saved twice, none lost for good.
    #[test]
    fn a_stepped_image_plus_the_events_since_its_start_equals_the_directory(
        before in prop::collection::vec(op(SMALL), 0..40),
        during in prop::collection::vec((op(SMALL), 0..4usize), 1..40),
    ) {
        let mut m = Model::new(SMALL);
        let mut s = Subject::new(SMALL);
        for (i, op) in before.iter().enumerate() {
            m.apply(op);
            s.apply(op, i);
        }
        let mut b = s.d.image_builder();
        for (i, (op, slots)) in during.iter().enumerate() {
            s.d.image_step(&mut b, *slots);
            m.apply(op);
            s.apply(op, before.len() + i);
        }
        let image = s.d.image_finish(b).concat();
        let decoded = Directory::decode(&image, DirectoryConfig::default());
        prop_assert!(decoded.is_ok(), "{:?}", decoded.err());
        let mut r = Subject { d: decoded.unwrap(), ns: s.ns.clone(), inst: s.inst.clone() };
        for (i, (op, _)) in during.iter().enumerate() {
            r.apply(op, before.len() + i);
        }
        check(&m, &r);
        prop_assert_eq!(r.d.digest(), s.d.digest());
        // Once the build finished, a one-shot image of the live directory round-trips.
        check(&m, &s);
        let mut again = Vec::new();
        s.d.encode(&mut again);
        prop_assert!(Directory::decode(&again, DirectoryConfig::default()).is_ok());
    }
}
