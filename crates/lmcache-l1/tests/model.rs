//! Random operation sequences against a simple model of the L1 lifecycle.
//!
//! Checked after every step:
//! - bytes accounted equal bytes allocated, per tenant and in total (`check_invariants`);
//! - live allocations never overlap: every object is filled with a pattern unique to its
//!   reservation, and every read of a held lease must still see it;
//! - a locked object is never evicted or freed, and a staged one never becomes visible;
//! - a quota is never exceeded by an admission;
//! - per-key results agree with the model (NotWritable exactly when the key is known, a read
//!   lock succeeds exactly when the key is resident);
//! - the same holds for an L1 of two members in write order (LMCache's tagged L1s), where a
//!   key is written once across both and read from whichever holds it;
//! - at the end, once every handle is gone, every reservation has ended (nothing staged, no
//!   memory held) and a non-forced clear empties the cache.

mod common;

use std::collections::HashMap;

use common::*;
use lmcache_core::{CacheSalt, ObjectKey};
use lmcache_l1::{EvictionPolicyKind, L1Cache, L1Error, ReadLease, WriteRequest, WriteReservation};
use proptest::prelude::*;

const KEYS: u32 = 24;
const SALTS: [&str; 3] = ["", "a", "b"];

#[derive(Debug, Clone)]
enum Op {
    Reserve(Vec<(u32, u8, bool)>),
    Commit(usize),
    CommitAndLock(usize, u32),
    Discard(usize),
    ReadLock(u32, u32),
    Split(usize),
    Release(usize),
    Delete(u32, bool),
    Clear(bool),
    Touch(Vec<u32>),
    SetQuota(usize, Option<u8>),
    Maintenance,
}

fn op() -> impl Strategy<Value = Op> {
    let k = 0..KEYS;
    prop_oneof![
        6 => proptest::collection::vec((k.clone(), 1u8..4, proptest::bool::weighted(0.1)), 1..5)
            .prop_map(Op::Reserve),
        4 => any::<usize>().prop_map(Op::Commit),
        2 => (any::<usize>(), 1u32..4).prop_map(|(i, n)| Op::CommitAndLock(i, n)),
        1 => any::<usize>().prop_map(Op::Discard),
        4 => (k.clone(), 1u32..4).prop_map(|(k, n)| Op::ReadLock(k, n)),
        1 => any::<usize>().prop_map(Op::Split),
        3 => any::<usize>().prop_map(Op::Release),
        1 => (k.clone(), any::<bool>()).prop_map(|(k, f)| Op::Delete(k, f)),
        1 => any::<bool>().prop_map(Op::Clear),
        1 => proptest::collection::vec(k, 1..4).prop_map(Op::Touch),
        1 => (0usize..3, proptest::option::of(2u8..12)).prop_map(|(s, l)| Op::SetQuota(s, l)),
        1 => Just(Op::Maintenance),
    ]
}

fn key_of(k: u32) -> ObjectKey {
    // Three tenants share the key space.
    key_salted(k, SALTS[(k % 3) as usize])
}

/// What the model knows about a key, with the incarnation (one per successful reservation):
/// a key deleted by force and written again is a different object, and handles of the old
/// one must not count for the new one.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Known {
    Staged(u64),
    Resident(u64),
}

impl Known {
    fn incarnation(self) -> u64 {
        match self {
            Known::Staged(i) | Known::Resident(i) => i,
        }
    }
}

struct Held {
    lease: ReadLease,
    pattern: u8,
    incarnation: u64,
}

fn run(policy: EvictionPolicyKind, ops: Vec<Op>) -> Result<(), TestCaseError> {
    run_on(cache_with(40 * PAGE, policy), ops)
}

/// The same 40 pages as two members in write order (16 then 24 pages).
fn run_two(policy: EvictionPolicyKind, ops: Vec<Op>) -> Result<(), TestCaseError> {
    run_on(members(&[16 * PAGE, 24 * PAGE], policy), ops)
}

fn run_on(c: L1Cache, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut model: HashMap<u32, Known> = HashMap::new();
    // incarnation → the byte its object is filled with.
    let mut patterns: HashMap<u64, u8> = HashMap::new();
    let mut writers: Vec<(u32, u64, WriteReservation)> = Vec::new();
    let mut next_incarnation: u64 = 0;
    let mut readers: Vec<(u32, Held)> = Vec::new();
    let mut next_pattern: u8 = 1;

    for op in ops {
        match op {
            Op::Reserve(batch) => {
                let reqs: Vec<WriteRequest> = batch
                    .iter()
                    .map(|&(k, pages, temporary)| WriteRequest {
                        key: key_of(k),
                        size: pages as u64 * PAGE - 100,
                        temporary,
                    })
                    .collect();
                // A quota applies within each member.
                let usage = |c: &L1Cache| -> Vec<Vec<u64>> {
                    c.members()
                        .map(|(_, m)| {
                            SALTS.iter().map(|s| m.usage_of(&CacheSalt::new(s).unwrap())).collect()
                        })
                        .collect()
                };
                let before = usage(&c);
                let results = c.reserve_write(&reqs);
                let mut seen = Vec::new();
                let mut oom = 0;
                let mut attempted = 0;
                for (&(k, _, _), r) in batch.iter().zip(results) {
                    let known = model.contains_key(&k) || seen.contains(&k);
                    seen.push(k);
                    match r {
                        Ok(mut w) => {
                            prop_assert!(!known, "key {k} reserved twice");
                            attempted += 1;
                            w.as_mut_slice().fill(next_pattern);
                            patterns.insert(next_incarnation + 1, next_pattern);
                            next_pattern = next_pattern.wrapping_add(1).max(1);
                            next_incarnation += 1;
                            model.insert(k, Known::Staged(next_incarnation));
                            writers.push((k, next_incarnation, w));
                        }
                        Err(L1Error::NotWritable) => prop_assert!(known, "key {k} refused"),
                        Err(L1Error::OutOfMemory { .. }) => {
                            prop_assert!(!known);
                            attempted += 1;
                            oom += 1;
                        }
                        Err(L1Error::QuotaExceeded { .. }) => prop_assert!(!known),
                        Err(e) => return Err(TestCaseError::fail(format!("unexpected {e}"))),
                    }
                }
                // One member allocates a batch all or nothing; several may split it.
                prop_assert!(
                    oom == 0 || oom == attempted || c.member_count() > 1,
                    "batch allocation was partial"
                );
                for (m, after) in usage(&c).into_iter().enumerate() {
                    for (i, s) in SALTS.iter().enumerate() {
                        if let Some(limit) = c.quota(&CacheSalt::new(s).unwrap()) {
                            prop_assert!(
                                after[i] <= limit.max(before[m][i]),
                                "tenant {s:?} at {} over quota {limit} in member {m}",
                                after[i]
                            );
                        }
                    }
                }
            }
            Op::Commit(i) | Op::CommitAndLock(i, _) | Op::Discard(i) if !writers.is_empty() => {
                let (k, inc, w) = writers.swap_remove(i % writers.len());
                let force_deleted = model.get(&k) != Some(&Known::Staged(inc));
                match op {
                    Op::Commit(_) => {
                        let r = w.commit();
                        if force_deleted {
                            prop_assert_eq!(r, Err(L1Error::WrongState));
                        } else {
                            prop_assert_eq!(r, Ok(()));
                            model.insert(k, Known::Resident(inc));
                        }
                    }
                    Op::CommitAndLock(_, n) => match w.commit_and_read_lock(n) {
                        Ok(lease) => {
                            prop_assert!(!force_deleted);
                            model.insert(k, Known::Resident(inc));
                            let pattern = patterns[&inc];
                            readers.push((k, Held { lease, pattern, incarnation: inc }));
                        }
                        Err(e) => {
                            prop_assert!(force_deleted, "commit failed: {e}");
                        }
                    },
                    _ => {
                        w.discard();
                        if !force_deleted {
                            model.remove(&k);
                        }
                    }
                }
            }
            Op::ReadLock(k, n) => {
                let r = c.read_lock(&[key_of(k)], n).pop().unwrap();
                let resident = matches!(model.get(&k), Some(Known::Resident(_)));
                match (model.get(&k).copied(), r) {
                    (Some(Known::Resident(inc)), Ok(lease)) => {
                        let pattern = patterns[&inc];
                        readers.push((k, Held { lease, pattern, incarnation: inc }))
                    }
                    (_, Err(L1Error::NotFound)) if !resident => {}
                    (m, r) => {
                        return Err(TestCaseError::fail(format!(
                            "read lock of {k} in state {m:?} gave {:?}",
                            r.map(|_| ())
                        )));
                    }
                }
            }
            Op::Split(i) if !readers.is_empty() => {
                let idx = i % readers.len();
                let k = readers[idx].0;
                let (pattern, incarnation) = (readers[idx].1.pattern, readers[idx].1.incarnation);
                if let Some(part) = readers[idx].1.lease.split(1) {
                    readers.push((k, Held { lease: part, pattern, incarnation }));
                }
            }
            Op::Release(i) if !readers.is_empty() => {
                // A temporary object leaves with its last lock; the sync below learns it.
                drop(readers.swap_remove(i % readers.len()));
            }
            Op::Delete(k, force) => {
                let r = c.delete(&[key_of(k)], force).pop().unwrap();
                let locked = is_locked(&readers, &model, k);
                match model.get(&k) {
                    None => prop_assert_eq!(r, Err(L1Error::NotFound)),
                    Some(Known::Staged(_)) if !force => prop_assert_eq!(r, Err(L1Error::Locked)),
                    Some(Known::Resident(_)) if locked && !force => {
                        prop_assert_eq!(r, Err(L1Error::Locked))
                    }
                    Some(_) => {
                        prop_assert_eq!(r, Ok(()));
                        model.remove(&k);
                    }
                }
            }
            Op::Clear(force) => {
                c.clear(force);
                let keep: Vec<u32> = model
                    .iter()
                    .filter(|(k, state)| {
                        !force
                            && (matches!(state, Known::Staged(_))
                                || is_locked(&readers, &model, **k))
                    })
                    .map(|(k, _)| *k)
                    .collect();
                model.retain(|k, _| keep.contains(k));
            }
            Op::Touch(keys) => c.touch(&keys.into_iter().map(key_of).collect::<Vec<_>>()),
            Op::SetQuota(s, pages) => {
                c.set_quota(&CacheSalt::new(SALTS[s]).unwrap(), pages.map(|p| p as u64 * PAGE))
            }
            Op::Maintenance => {
                c.run_maintenance();
            }
            _ => {}
        }

        // Learn what eviction (and temporary-object release) removed; check it was allowed.
        let mut gone = Vec::new();
        for (&k, &state) in &model {
            let visible = c.contains(&key_of(k));
            match state {
                Known::Staged(_) => prop_assert!(!visible, "staged key {k} is visible"),
                Known::Resident(_) if !visible => {
                    prop_assert!(
                        !is_locked(&readers, &model, k),
                        "read-locked key {k} was evicted"
                    );
                    gone.push(k);
                }
                Known::Resident(_) => {}
            }
        }
        for k in gone {
            model.remove(&k);
        }
        // Held leases still see their own bytes: no allocation overlapped theirs.
        for (k, held) in &readers {
            prop_assert!(
                held.lease.bytes().iter().all(|&b| b == held.pattern),
                "bytes of key {k} changed under a reader"
            );
        }
        if let Err(msg) = c.check_invariants() {
            return Err(TestCaseError::fail(msg));
        }
    }
    drop(readers);
    drop(writers);
    let u = c.usage();
    prop_assert_eq!(u.staged_objects, 0, "a reservation outlived its handle");
    prop_assert_eq!(u.locked_objects, 0, "a read lock outlived its lease");
    c.clear(false);
    prop_assert_eq!(c.usage().used_bytes, 0);
    for (_, m) in c.members() {
        prop_assert_eq!(m.memory().usage().allocator.allocated_bytes, 0);
    }
    if let Err(msg) = c.check_invariants() {
        return Err(TestCaseError::fail(msg));
    }
    Ok(())
}

/// True when a held lease locks the current incarnation of `k`.
fn is_locked(readers: &[(u32, Held)], model: &HashMap<u32, Known>, k: u32) -> bool {
    let Some(inc) = model.get(&k).map(|s| s.incarnation()) else {
        return false;
    };
    readers.iter().any(|(rk, h)| *rk == k && h.incarnation == inc)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn lifecycle_model_lru(ops in proptest::collection::vec(op(), 1..150)) {
        run(EvictionPolicyKind::Lru, ops)?;
    }

    #[test]
    fn lifecycle_model_arc(ops in proptest::collection::vec(op(), 1..150)) {
        run(EvictionPolicyKind::Arc, ops)?;
    }

    #[test]
    fn lifecycle_model_s3fifo(ops in proptest::collection::vec(op(), 1..150)) {
        run(EvictionPolicyKind::S3Fifo, ops)?;
    }

    #[test]
    fn lifecycle_model_isolated_lru(ops in proptest::collection::vec(op(), 1..150)) {
        run(EvictionPolicyKind::IsolatedLru, ops)?;
    }

    #[test]
    fn lifecycle_model_noop(ops in proptest::collection::vec(op(), 1..150)) {
        run(EvictionPolicyKind::Noop, ops)?;
    }

    #[test]
    fn lifecycle_model_two_members_lru(ops in proptest::collection::vec(op(), 1..150)) {
        run_two(EvictionPolicyKind::Lru, ops)?;
    }

    #[test]
    fn lifecycle_model_two_members_s3fifo(ops in proptest::collection::vec(op(), 1..150)) {
        run_two(EvictionPolicyKind::S3Fifo, ops)?;
    }

    #[test]
    fn lifecycle_model_two_members_noop(ops in proptest::collection::vec(op(), 1..150)) {
        run_two(EvictionPolicyKind::Noop, ops)?;
    }
}
