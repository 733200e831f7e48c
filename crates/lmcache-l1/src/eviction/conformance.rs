//! One suite every policy passes (the contract in the module docs).

use std::collections::HashSet;

use lmcache_core::CacheSalt;
use proptest::prelude::*;
use slotmap::SlotMap;

use super::{EntryMeta, EvictionPolicyKind};
use crate::entry::EntryId;

#[derive(Debug, Clone)]
enum Op {
    Insert { salt: u8 },
    Access(usize),
    Remove(usize),
    Lock(usize),
    Unlock(usize),
    Evict { target: u64, scoped: Option<u8> },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3).prop_map(|salt| Op::Insert { salt }),
        2 => any::<usize>().prop_map(Op::Access),
        1 => any::<usize>().prop_map(Op::Remove),
        1 => any::<usize>().prop_map(Op::Lock),
        1 => any::<usize>().prop_map(Op::Unlock),
        2 => (1u64..6, proptest::option::of(0u8..3))
            .prop_map(|(target, scoped)| Op::Evict { target, scoped }),
    ]
}

fn salt(i: u8) -> CacheSalt {
    CacheSalt::new(&format!("s{i}")).unwrap()
}

fn check(kind: EvictionPolicyKind, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut ids: SlotMap<EntryId, (CacheSalt, u64)> = SlotMap::with_key();
    let mut policy = kind.build();
    let mut tracked: Vec<EntryId> = Vec::new();
    let mut locked: HashSet<EntryId> = HashSet::new();
    for op in ops {
        let pick = |i: usize| (!tracked.is_empty()).then(|| tracked[i % tracked.len()]);
        match op {
            Op::Insert { salt: s } => {
                let bytes = 1 + (ids.len() as u64 % 3);
                let id = ids.insert((salt(s), bytes));
                let (sa, b) = &ids[id];
                policy
                    .on_insert(id, EntryMeta { key_hash: id_hash(id), cache_salt: sa, bytes: *b });
                tracked.push(id);
            }
            Op::Access(i) => {
                if let Some(id) = pick(i) {
                    policy.on_access(id);
                }
            }
            Op::Remove(i) => {
                if let Some(id) = pick(i) {
                    policy.on_remove(id);
                    tracked.retain(|&t| t != id);
                    locked.remove(&id);
                }
            }
            Op::Lock(i) => {
                if let Some(id) = pick(i) {
                    locked.insert(id);
                }
            }
            Op::Unlock(i) => {
                if let Some(id) = pick(i) {
                    locked.remove(&id);
                }
            }
            Op::Evict { target, scoped } => {
                let scope = scoped.map(salt);
                let in_scope = |id: EntryId| scope.as_ref().is_none_or(|s| &ids[id].0 == s);
                let available: u64 = tracked
                    .iter()
                    .filter(|&&id| !locked.contains(&id) && in_scope(id))
                    .map(|&id| ids[id].1)
                    .sum();
                let mut out = Vec::new();
                let chosen = policy.evict(
                    scope.as_ref(),
                    target,
                    &mut |id| (!locked.contains(&id) && in_scope(id)).then(|| ids[id].1),
                    &mut out,
                );
                let sum: u64 = out.iter().map(|&id| ids[id].1).sum();
                prop_assert_eq!(chosen, sum);
                for id in &out {
                    prop_assert!(!locked.contains(id), "{} evicted a locked entry", kind);
                    prop_assert!(in_scope(*id), "{} evicted outside the scope", kind);
                    prop_assert!(tracked.contains(id), "{} returned an untracked id", kind);
                }
                let unique: HashSet<_> = out.iter().collect();
                prop_assert_eq!(unique.len(), out.len(), "duplicate victims");
                if kind != EvictionPolicyKind::Noop {
                    prop_assert!(
                        chosen >= target.min(available),
                        "{} chose {} of {} wanted with {} available",
                        kind,
                        chosen,
                        target,
                        available
                    );
                }
                // Stops as soon as the target is met: the last victim was needed.
                if let Some(last) = out.last() {
                    prop_assert!(chosen - ids[*last].1 < target, "{} over-evicted", kind);
                }
                tracked.retain(|id| !out.contains(id));
            }
        }
        let expect = if kind == EvictionPolicyKind::Noop { 0 } else { tracked.len() };
        prop_assert_eq!(policy.len(), expect, "{} lost track of entries", kind);
    }
    Ok(())
}

fn id_hash(id: EntryId) -> u64 {
    use slotmap::Key;
    id.data().as_ffi().wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn every_policy_honours_the_contract(ops in proptest::collection::vec(op(), 1..150)) {
        for kind in EvictionPolicyKind::ALL {
            check(kind, ops.clone())?;
        }
    }
}

#[test]
fn names_parse_back() {
    for kind in EvictionPolicyKind::ALL {
        assert_eq!(kind.as_str().parse::<EvictionPolicyKind>().unwrap(), kind);
        assert_eq!(kind.build().name(), kind.as_str());
    }
    assert_eq!("lru".parse::<EvictionPolicyKind>().unwrap(), EvictionPolicyKind::Lru);
    assert_eq!("s3-fifo".parse::<EvictionPolicyKind>().unwrap(), EvictionPolicyKind::S3Fifo);
    assert!("mru".parse::<EvictionPolicyKind>().is_err());
}

#[test]
fn recency_policies_evict_least_recent_first() {
    for kind in [EvictionPolicyKind::Lru, EvictionPolicyKind::IsolatedLru] {
        let mut ids: SlotMap<EntryId, ()> = SlotMap::with_key();
        let mut p = kind.build();
        let s = CacheSalt::EMPTY;
        let all: Vec<EntryId> = (0..5).map(|_| ids.insert(())).collect();
        for &id in &all {
            p.on_insert(id, EntryMeta { key_hash: 0, cache_salt: &s, bytes: 1 });
        }
        p.on_access(all[0]);
        let mut out = Vec::new();
        p.evict(None, 2, &mut |_| Some(1), &mut out);
        assert_eq!(out, vec![all[1], all[2]], "{kind}");
    }
}

#[test]
fn isolated_lru_global_pressure_takes_globally_oldest() {
    let mut ids: SlotMap<EntryId, ()> = SlotMap::with_key();
    let mut p = EvictionPolicyKind::IsolatedLru.build();
    let (a, b) = (salt(0), salt(1));
    let order = [(&a, 0), (&b, 1), (&a, 2), (&b, 3)];
    let mut made = Vec::new();
    for (s, _) in order {
        let id = ids.insert(());
        p.on_insert(id, EntryMeta { key_hash: 0, cache_salt: s, bytes: 1 });
        made.push(id);
    }
    let mut out = Vec::new();
    p.evict(None, 3, &mut |_| Some(1), &mut out);
    assert_eq!(out, made[..3].to_vec());
    let mut out = Vec::new();
    p.evict(Some(&a), 5, &mut |_| Some(1), &mut out);
    assert!(out.is_empty(), "tenant a has nothing left");
}
