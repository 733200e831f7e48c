//! An L1 of several members in write order (LMCache's tagged L1s, `--l1-manager` repeated):
//! writes fill the first and overflow to the next without evicting, reads find a key in
//! whichever member holds it, a key is written in one member only.

mod common;

use common::*;
use lmcache_core::ObjectKey;
use lmcache_l1::{
    EvictionPolicyKind, L1Cache, L1Config, L1ConfigError, L1Error, L1Member, WriteRequest,
};
use lmcache_memory::{Arena, ArenaAllocator, ArenaBacking, ArenaConfig};

fn store(c: &L1Cache, keys: &[ObjectKey], size: u64) -> Vec<Result<(), L1Error>> {
    let reqs: Vec<WriteRequest> = keys.iter().map(|k| WriteRequest::new(k.clone(), size)).collect();
    let mut ok = Vec::new();
    let mut out: Vec<Result<(), L1Error>> = Vec::new();
    for r in c.reserve_write(&reqs) {
        match r {
            Ok(mut w) => {
                let fill = w.key().chunk_hash.0[3];
                w.as_mut_slice().fill(fill);
                ok.push(w);
                out.push(Ok(()));
            }
            Err(e) => out.push(Err(e)),
        }
    }
    let mut committed = c.commit_batch(ok).into_iter();
    for r in &mut out {
        if r.is_ok() {
            *r = committed.next().unwrap_or(Err(L1Error::WrongState));
        }
    }
    out
}

/// What a listener heard.
#[derive(Debug, Default)]
struct Heard {
    removed: std::sync::Mutex<Vec<ObjectKey>>,
    committed: std::sync::Mutex<Vec<ObjectKey>>,
}

impl lmcache_l1::L1Listener for Heard {
    fn removed(&self, key: &ObjectKey) {
        self.removed.lock().unwrap().push(key.clone());
    }
    fn committed(&self, key: &ObjectKey, _bytes: u64) {
        self.committed.lock().unwrap().push(key.clone());
    }
}

fn held(c: &L1Cache) -> Vec<usize> {
    c.members().map(|(_, m)| m.usage().resident_objects).collect()
}

#[test]
fn writes_fill_the_first_member_then_overflow_to_the_next_without_evicting() {
    let c = members(&[8 * PAGE, 8 * PAGE], EvictionPolicyKind::Lru);
    let keys: Vec<ObjectKey> = (0..12).map(key).collect();
    // Two batches: the second is the one that meets a full first member.
    assert!(store(&c, &keys[..6], PAGE).iter().all(Result::is_ok));
    assert!(store(&c, &keys[6..], PAGE).iter().all(Result::is_ok));
    assert_eq!(held(&c), [8, 4], "the batch that did not fit was split: what fitted stayed");
    assert_eq!(c.usage().stats.evicted_objects, 0, "nothing evicted while a member had room");
    assert_eq!(c.usage().stats.oom_rejections, 0, "an overflow is not a refusal");
    for (k, lease) in keys.iter().zip(c.read_lock(&keys, 1)) {
        let lease = lease.expect("every stored key reads back");
        assert!(lease.bytes().iter().all(|&b| b == k.chunk_hash.0[3]), "{k}: its own bytes");
    }
    assert_eq!(c.prefix_hits(&keys), 12);
    assert_eq!(c.read_lock_prefix(&keys, 1).unwrap().len(), 12);
    let u = c.usage();
    assert_eq!((u.resident_objects, u.capacity), (12, 16 * PAGE), "usage sums the members");
    assert_eq!(c.resident_keys().len(), 12);
    c.check_invariants().unwrap();
}

#[test]
fn when_every_member_is_full_a_store_evicts_in_write_order() {
    let c = members(&[4 * PAGE, 4 * PAGE], EvictionPolicyKind::Lru);
    let old: Vec<ObjectKey> = (0..8).map(key).collect();
    assert!(store(&c, &old, PAGE).iter().all(Result::is_ok), "one batch over two members");
    assert_eq!(held(&c), [4, 4]);
    let new: Vec<ObjectKey> = (100..102).map(key).collect();
    assert!(store(&c, &new, PAGE).iter().all(Result::is_ok), "eviction made room");
    assert_eq!(held(&c), [4, 4]);
    assert_eq!(c.usage().stats.evicted_objects, 2);
    // The first member evicted its least recent objects for them (a batch's last chunks
    // leave first).
    let first = c.members().next().unwrap().1;
    assert!(new.iter().all(|k| first.contains(k)));
    assert!(!c.contains(&old[2]) && !c.contains(&old[3]));
    assert!(c.contains(&old[0]) && c.contains(&old[1]));
    assert!(c.contains(&old[4]) && c.contains(&old[7]), "the second member kept its own");
    c.check_invariants().unwrap();
}

#[test]
fn an_object_too_big_for_the_first_member_goes_to_one_that_fits() {
    let c = members(&[2 * PAGE, 8 * PAGE], EvictionPolicyKind::Lru);
    assert_eq!(store(&c, &[key(1)], 6 * PAGE), [Ok(())]);
    assert_eq!(held(&c), [0, 1]);
    assert_eq!(c.largest_object(), 8 * PAGE);
    // Too big for every member: the last member's refusal.
    assert!(matches!(store(&c, &[key(2)], 9 * PAGE)[0], Err(L1Error::InvalidSize { .. })));
    // A key no member can take, even by evicting (everything staged or locked), is one
    // refusal, counted once.
    let lease = c.read_lock(&[key(1)], 1).pop().unwrap().unwrap();
    let held: Vec<_> = [3, 5]
        .map(|k| c.reserve_write(&[WriteRequest::new(key(k), 2 * PAGE)]).pop().unwrap().unwrap())
        .into();
    assert!(matches!(store(&c, &[key(4)], 2 * PAGE)[0], Err(L1Error::OutOfMemory { .. })));
    assert_eq!(c.usage().stats.oom_rejections, 1);
    drop((lease, held));
}

#[test]
fn a_key_one_member_holds_is_written_nowhere_else_and_deleted_everywhere() {
    let c = members(&[2 * PAGE, 8 * PAGE], EvictionPolicyKind::Lru);
    assert!(store(&c, &[key(1), key(2)], PAGE).iter().all(Result::is_ok));
    assert!(store(&c, &[key(3)], PAGE).iter().all(Result::is_ok));
    assert_eq!(held(&c), [2, 1], "key 3 overflowed to the second member");
    // The first member has room again; key 3 is still the second's.
    assert_eq!(c.delete(&[key(1)], false), [Ok(())]);
    assert_eq!(store(&c, &[key(3)], PAGE), [Err(L1Error::NotWritable)]);
    // Being written in the second member: not writable in the first either.
    let w = c.reserve_write(&[WriteRequest::new(key(4), 4 * PAGE)]).pop().unwrap().unwrap();
    assert_eq!(store(&c, &[key(4)], PAGE), [Err(L1Error::NotWritable)]);
    drop(w);
    assert_eq!(held(&c), [1, 1]);
    // Peers read by offset in the mapped (first) member only.
    assert!(c.read_lock_mapped(&[key(3)], 1).pop().unwrap().is_err());
    assert!(c.read_lock(&[key(3)], 1).pop().unwrap().is_ok());
    assert_eq!(c.delete(&[key(3), key(9)], true), [Ok(()), Err(L1Error::NotFound)]);
    assert!(!c.contains(&key(3)));
    c.check_invariants().unwrap();
}

#[test]
fn a_member_list_needs_distinct_non_empty_tags() {
    let member = || {
        let arena = Arena::create(&ArenaConfig {
            size: 4 * PAGE,
            backing: ArenaBacking::Anonymous,
            mlock: false,
        })
        .unwrap();
        L1Member::new(L1Config::default(), ArenaAllocator::new(arena, PAGE).unwrap()).unwrap()
    };
    let refused = |list: Vec<(String, L1Member)>| match L1Cache::from_members(list) {
        Err(L1ConfigError::Members { reason }) => reason,
        other => panic!("accepted: {other:?}"),
    };
    assert_eq!(refused(vec![]), "no L1 at all");
    assert_eq!(refused(vec![(" ".into(), member())]), "an empty tag");
    assert_eq!(refused(vec![("a".into(), member()), ("a".into(), member())]), "tag \"a\" twice");
    let c = L1Cache::from_members(vec![("a".into(), member()), ("b".into(), member())]).unwrap();
    assert_eq!(c.members().map(|(t, _)| t).collect::<Vec<_>>(), ["a", "b"]);
}

#[test]
fn the_watermark_of_a_member_with_a_next_one_moves_objects_down_instead_of_evicting() {
    let c = members(&[8 * PAGE, 16 * PAGE], EvictionPolicyKind::Lru);
    let keys: Vec<ObjectKey> = (0..8).map(key).collect();
    // One store at a time: each its own batch, key 0 the least recently used.
    for k in &keys {
        assert_eq!(store(&c, std::slice::from_ref(k), PAGE), [Ok(())]);
    }
    assert_eq!(held(&c), [8, 0]);
    c.set_write_behind(true);
    let heard = std::sync::Arc::new(Heard::default());
    c.set_listener(heard.clone());
    let r = c.run_maintenance();
    // The fleet and the KV events hear no removal: the objects are still in L1.
    assert_eq!(heard.removed.lock().unwrap().len(), 0, "a move is not a removal");
    let mut committed = heard.committed.lock().unwrap().clone();
    committed.sort_by_key(|k| k.chunk_hash.0);
    assert_eq!(committed, [keys[0].clone(), keys[1].clone()], "their commits there are");
    // 8 of 8 pages used >= 0.8: a fifth of them (2 pages) moves down.
    assert_eq!((r.demoted_bytes, r.watermark_evicted_bytes), (2 * PAGE, 0));
    assert_eq!(held(&c), [6, 2]);
    let second = c.members().nth(1).unwrap().1;
    assert!(second.contains(&keys[0]) && second.contains(&keys[1]), "the least recent went");
    assert_eq!(c.unwritten(), 0, "a moved object is as written as it was");
    for (k, lease) in keys.iter().zip(c.read_lock(&keys, 1)) {
        let lease = lease.expect("nothing was lost");
        assert!(lease.bytes().iter().all(|&b| b == k.chunk_hash.0[3]), "{k}: its own bytes");
    }
    let u = c.usage();
    assert_eq!((u.stats.demoted_objects, u.stats.evicted_objects), (2, 0));
    c.check_invariants().unwrap();
    // The last member's watermark evicts.
    let more: Vec<ObjectKey> = (100..112).map(key).collect();
    assert!(store(&c, &more, PAGE).iter().all(Result::is_ok));
    c.run_maintenance();
    assert!(c.usage().stats.evicted_objects > 0, "the last member discards");
    assert!(!heard.removed.lock().unwrap().is_empty(), "an eviction is heard");
    c.check_invariants().unwrap();
}
