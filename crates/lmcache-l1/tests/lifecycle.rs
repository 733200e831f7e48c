//! The object lifecycle, one rule per test.

mod common;

use common::*;
use lmcache_core::CacheSalt;
use lmcache_l1::{EvictionPolicyKind, L1Error, L1Status, ReserveMode, WriteRequest};

fn reserve_one(c: &lmcache_l1::L1Cache, i: u32, size: u64) -> lmcache_l1::WriteReservation {
    c.reserve_write(&[WriteRequest::new(key(i), size)]).pop().unwrap().unwrap()
}

#[test]
fn store_then_read_round_trips_bytes() {
    let c = cache(1 << 20);
    let mut w = reserve_one(&c, 1, 10_000);
    w.as_mut_slice().fill(0x5a);
    w.write_at(9_998, &[1, 2]).unwrap();
    assert!(w.write_at(9_999, &[1, 2]).is_err(), "write past the object accepted");
    w.commit().unwrap();
    let r = c.read_lock(&[key(1)], 1).pop().unwrap().unwrap();
    assert_eq!(r.len(), 10_000);
    assert!(r.bytes()[..9_998].iter().all(|&b| b == 0x5a));
    assert_eq!(&r.bytes()[9_998..], &[1, 2]);
    c.check_invariants().unwrap();
}

#[test]
fn an_objects_checksum_is_its_bytes_xxh3_and_a_rewritten_key_gets_its_own() {
    let c = cache(1 << 20);
    let mut w = reserve_one(&c, 1, 10_000);
    w.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = (i * 7) as u8);
    w.commit().unwrap();
    let a = c.read_lock(&[key(1)], 1).pop().unwrap().unwrap();
    let b = c.read_lock(&[key(1)], 1).pop().unwrap().unwrap();
    let expected = twox_hash::XxHash3_64::oneshot(a.bytes());
    assert_eq!(b.known_checksum(), None, "computed only when asked for");
    assert_eq!(a.checksum(), expected);
    assert_eq!(b.known_checksum(), Some(expected), "computed once for the object");
    assert_eq!(b.checksum(), expected, "every lease of the object sees the same sum");
    drop((a, b));
    // Hashed while sent in pieces: a send that fails keeps no sum; one that ends does, and
    // it is the object's xxh3 (a later send only copies).
    let mut w = reserve_one(&c, 2, 10_000);
    w.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = (i * 11) as u8);
    w.commit().unwrap();
    let r = c.read_lock(&[key(2)], 1).pop().unwrap().unwrap();
    let mut sent = 0;
    let failed = r.hash_pieces(4096, |p| {
        sent += p.len();
        if sent > 4096 { Err("the peer hung up") } else { Ok(()) }
    });
    assert_eq!(failed, Err("the peer hung up"));
    assert_eq!(r.known_checksum(), None, "a sum of bytes not all sent is not kept");
    let mut copy = Vec::new();
    let sum = r.hash_pieces(4096, |p| -> Result<(), ()> {
        copy.extend_from_slice(p);
        Ok(())
    });
    assert_eq!(copy, r.bytes());
    assert_eq!(sum, Ok(twox_hash::XxHash3_64::oneshot(r.bytes())));
    assert_eq!(r.known_checksum(), sum.ok());
    assert_eq!(r.hash_pieces(3000, |_| -> Result<(), ()> { Ok(()) }), sum);
    drop(r);
    // Deleted and written again with other bytes: a new object, a new sum (never the cached
    // one of the old object).
    assert!(c.delete(&[key(1)], false)[0].is_ok());
    let mut w = reserve_one(&c, 1, 10_000);
    w.as_mut_slice().fill(0x33);
    w.commit().unwrap();
    let r = c.read_lock(&[key(1)], 1).pop().unwrap().unwrap();
    assert_eq!(r.checksum(), twox_hash::XxHash3_64::oneshot(&[0x33; 10_000]));
    assert_ne!(r.checksum(), expected);
}

#[test]
fn staged_objects_are_invisible_and_exclusive() {
    let c = cache(1 << 20);
    let w = reserve_one(&c, 1, 100);
    assert!(!c.contains(&key(1)));
    assert_eq!(c.read_lock(&[key(1)], 1)[0].as_ref().unwrap_err(), &L1Error::NotFound);
    let again = c.reserve_write(&[WriteRequest::new(key(1), 100)]);
    assert_eq!(again[0].as_ref().unwrap_err(), &L1Error::NotWritable);
    w.commit().unwrap();
    assert!(c.contains(&key(1)));
    // Resident keys are never rewritten.
    let again = c.reserve_write(&[WriteRequest::new(key(1), 100)]);
    assert_eq!(again[0].as_ref().unwrap_err().status(), L1Status::NotWritable);
}

fn shadow(c: &lmcache_l1::L1Cache, i: u32) -> Result<lmcache_l1::WriteReservation, L1Error> {
    let mode = ReserveMode { supersede_staged: true, ..ReserveMode::default() };
    c.reserve_with(&[WriteRequest::new(key(i), 100)], mode).pop().unwrap()
}

#[test]
fn a_second_writer_of_a_staged_key_never_depends_on_the_first() {
    // The shadow commits first: its bytes are visible, the first writer's commit succeeds
    // and changes nothing.
    let c = cache(1 << 20);
    let mut first = reserve_one(&c, 1, 100);
    let mut second = shadow(&c, 1).unwrap();
    first.as_mut_slice().fill(1);
    second.as_mut_slice().fill(2);
    second.commit().unwrap();
    assert!(c.contains(&key(1)));
    first.commit().unwrap();
    let r = c.read_lock(&[key(1)], 1).pop().unwrap().unwrap();
    assert!(r.bytes().iter().all(|&b| b == 2), "the late commit replaced visible bytes");
    drop(r);
    let u = c.usage();
    assert_eq!((u.resident_objects, u.staged_objects, u.stats.superseded), (1, 0, 1));
    c.check_invariants().unwrap();
    // The first writer commits first: the shadow's commit finds the key visible.
    let first = reserve_one(&c, 2, 100);
    let second = shadow(&c, 2).unwrap();
    first.commit().unwrap();
    second.commit_and_read_lock(1).unwrap();
    assert_eq!(c.usage().stats.superseded, 2);
    // The first writer dies (discard, as an expired lease does): the shadow still commits.
    let first = reserve_one(&c, 3, 100);
    let second = shadow(&c, 3).unwrap();
    first.discard();
    assert!(!c.contains(&key(3)));
    second.commit().unwrap();
    assert!(c.contains(&key(3)));
    // A shadow that dies leaves the first writer alone.
    let first = reserve_one(&c, 4, 100);
    shadow(&c, 4).unwrap().discard();
    first.commit().unwrap();
    assert!(c.contains(&key(4)));
    // Resident keys are never shadowed; a force-deleted writer still never becomes visible.
    assert_eq!(shadow(&c, 4).unwrap_err(), L1Error::NotWritable);
    let w = reserve_one(&c, 5, 100);
    c.delete(&[key(5)], true);
    assert_eq!(w.commit().unwrap_err(), L1Error::WrongState);
    assert_eq!(c.usage().staged_objects, 0);
    c.check_invariants().unwrap();
}

#[test]
fn duplicate_keys_in_one_batch_get_one_reservation() {
    let c = cache(1 << 20);
    let r = c.reserve_write(&[WriteRequest::new(key(1), 100), WriteRequest::new(key(1), 100)]);
    assert!(r[0].is_ok());
    assert_eq!(r[1].as_ref().unwrap_err(), &L1Error::NotWritable);
}

#[test]
fn dropped_reservation_discards_and_frees() {
    let c = cache(1 << 20);
    drop(reserve_one(&c, 1, 100_000));
    assert_eq!(c.usage().used_bytes, 0);
    assert_eq!(c.usage().stats.discarded, 1);
    // The key is writable again.
    reserve_one(&c, 1, 100).commit().unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn read_locks_count_and_release_on_drop() {
    let c = cache(1 << 20);
    reserve_one(&c, 1, 100).commit().unwrap();
    let mut lease = c.read_lock(&[key(1)], 3).pop().unwrap().unwrap();
    assert_eq!(c.delete(&[key(1)], false)[0], Err(L1Error::Locked));
    let one = lease.split(1).unwrap();
    assert_eq!((lease.count(), one.count()), (2, 1));
    assert!(lease.split(2).is_none() && lease.split(0).is_none());
    drop(lease);
    assert_eq!(c.usage().locked_objects, 1, "one lock still held");
    one.release();
    assert_eq!(c.usage().locked_objects, 0);
    assert_eq!(c.delete(&[key(1)], false)[0], Ok(()));
    assert!(!c.contains(&key(1)));
}

#[test]
fn lock_count_is_validated() {
    let c = cache(1 << 20);
    reserve_one(&c, 1, 100).commit().unwrap();
    assert!(matches!(c.read_lock(&[key(1)], 0)[0], Err(L1Error::InvalidLockCount { .. })));
    assert!(matches!(c.read_lock(&[key(1)], 129)[0], Err(L1Error::InvalidLockCount { .. })));
    assert!(c.read_lock(&[key(1)], 128)[0].is_ok());
}

#[test]
fn temporary_objects_go_with_their_last_read_lock() {
    let c = cache(1 << 20);
    let req = WriteRequest { key: key(1), size: 100, temporary: true };
    let w = c.reserve_write(&[req]).pop().unwrap().unwrap();
    let mut lease = w.commit_and_read_lock(2).unwrap();
    let other = lease.split(1).unwrap();
    drop(lease);
    assert!(c.contains(&key(1)));
    drop(other);
    assert!(!c.contains(&key(1)));
    assert_eq!(c.usage().used_bytes, 0);
    c.check_invariants().unwrap();
}

#[test]
fn forced_delete_never_frees_memory_under_a_reader() {
    let c = cache(1 << 20);
    let mut w = reserve_one(&c, 1, 4096);
    w.as_mut_slice().fill(7);
    w.commit().unwrap();
    let lease = c.read_lock(&[key(1)], 1).pop().unwrap().unwrap();
    assert_eq!(c.delete(&[key(1)], true)[0], Ok(()));
    assert!(!c.contains(&key(1)));
    // New writes cannot be given the reader's memory.
    let mut w2 = reserve_one(&c, 2, 4096);
    w2.as_mut_slice().fill(9);
    assert_ne!(w2.offset(), lease.offset());
    assert!(lease.bytes().iter().all(|&b| b == 7), "reader saw foreign bytes");
    assert_eq!(c.usage().used_bytes, 2 * 4096);
    drop(lease);
    assert_eq!(c.usage().used_bytes, 4096);
    drop(w2);
    c.check_invariants().unwrap();
}

#[test]
fn forced_delete_of_a_staged_object_fails_its_commit() {
    let c = cache(1 << 20);
    let w = reserve_one(&c, 1, 100);
    assert_eq!(c.delete(&[key(1)], false)[0], Err(L1Error::Locked));
    assert_eq!(c.clear(true).removed, 1);
    assert_eq!(w.commit(), Err(L1Error::WrongState));
    assert!(!c.contains(&key(1)));
    assert_eq!(c.usage().used_bytes, 0);
    c.check_invariants().unwrap();
}

#[test]
fn allocation_evicts_synchronously_instead_of_failing() {
    let c = cache(16 * PAGE);
    for i in 0..16 {
        reserve_one(&c, i, PAGE).commit().unwrap();
    }
    // Full. LMCache would fail this write until its 1 s eviction loop ran.
    reserve_one(&c, 100, 4 * PAGE).commit().unwrap();
    let u = c.usage();
    assert_eq!(u.stats.sync_evictions, 1);
    assert_eq!(u.stats.evicted_objects, 4);
    // LRU: the oldest four went.
    for i in 0..4 {
        assert!(!c.contains(&key(i)));
    }
    assert!(c.contains(&key(4)));
    c.check_invariants().unwrap();
}

#[test]
fn locked_and_staged_objects_are_never_evicted() {
    let c = cache(8 * PAGE);
    reserve_one(&c, 0, PAGE).commit().unwrap();
    let _lease = c.read_lock(&[key(0)], 1).pop().unwrap().unwrap();
    let _staged = reserve_one(&c, 1, PAGE);
    for i in 2..8 {
        reserve_one(&c, i, PAGE).commit().unwrap();
    }
    // Needs 7 pages; only 6 are evictable.
    let r = c.reserve_write(&[WriteRequest::new(key(50), 7 * PAGE)]);
    assert!(matches!(r[0], Err(L1Error::OutOfMemory { .. })));
    assert!(c.contains(&key(0)));
    assert_eq!(c.usage().staged_objects, 1);
    // 6 pages fit after evicting the 6 unlocked ones.
    reserve_one(&c, 51, 6 * PAGE).commit().unwrap();
    assert!(c.contains(&key(0)));
    c.check_invariants().unwrap();
}

#[test]
fn batch_allocation_is_all_or_nothing() {
    let c = cache(8 * PAGE);
    let _pin = {
        reserve_one(&c, 0, 4 * PAGE).commit().unwrap();
        c.read_lock(&[key(0)], 1).pop().unwrap().unwrap()
    };
    let reqs: Vec<_> = (1..=5).map(|i| WriteRequest::new(key(i), PAGE)).collect();
    let r = c.reserve_write(&reqs);
    assert!(r.iter().all(|x| matches!(x, Err(L1Error::OutOfMemory { .. }))));
    assert_eq!(c.usage().used_bytes, 4 * PAGE, "a failed batch left memory behind");
    assert_eq!(c.usage().stats.oom_rejections, 5);
}

#[test]
fn lru_evicts_a_requests_suffix_before_its_prefix() {
    let c = cache(8 * PAGE);
    let reqs: Vec<_> = (0..8).map(|i| WriteRequest::new(key(i), PAGE)).collect();
    let ws: Vec<_> = c.reserve_write(&reqs).into_iter().map(Result::unwrap).collect();
    c.commit_batch(ws).into_iter().for_each(|r| r.unwrap());
    assert_eq!(c.evict(None, 3 * PAGE), 3 * PAGE);
    assert_eq!(c.prefix_hits(&(0..8).map(key).collect::<Vec<_>>()), 5);
    // A touch in request order keeps the same property.
    let keys: Vec<_> = (0..5).map(key).collect();
    c.touch(&keys);
    c.evict(None, PAGE);
    assert_eq!(c.prefix_hits(&keys), 4);
}

#[test]
fn quota_is_enforced_at_admission_by_evicting_the_tenant_only() {
    let a = CacheSalt::new("a").unwrap();
    // Tenant a: commit 4, then a fifth evicts a's oldest, never b's.
    let c = cache(64 * PAGE);
    c.set_quota(&a, Some(4 * PAGE));
    for i in 0..4 {
        reserve_one_salted(&c, i, "b");
    }
    for i in 0..5 {
        reserve_one_salted(&c, i, "a");
    }
    assert_eq!(c.usage_of(&a), 4 * PAGE);
    assert!(!c.contains(&key_salted(0, "a")));
    for i in 0..4 {
        assert!(c.contains(&key_salted(i, "b")));
    }
    // Nothing evictable in a: pin everything, then a write is refused with the quota named.
    let _pins = c.read_lock(&(1..5).map(|i| key_salted(i, "a")).collect::<Vec<_>>(), 1);
    let r = c.reserve_write(&[WriteRequest::new(key_salted(9, "a"), PAGE)]);
    match &r[0] {
        Err(L1Error::QuotaExceeded { cache_salt, limit, .. }) => {
            assert_eq!(cache_salt, &a);
            assert_eq!(*limit, 4 * PAGE);
        }
        other => panic!("expected a quota error, got {other:?}"),
    }
    assert_eq!(r[0].as_ref().unwrap_err().status(), L1Status::OutOfMemory);
    c.check_invariants().unwrap();
}

fn reserve_one_salted(c: &lmcache_l1::L1Cache, i: u32, salt: &str) {
    c.reserve_write(&[WriteRequest::new(key_salted(i, salt), PAGE)])
        .pop()
        .unwrap()
        .unwrap()
        .commit()
        .unwrap();
}

#[test]
fn lowered_quota_is_enforced_by_maintenance() {
    let c = cache_with(64 * PAGE, EvictionPolicyKind::IsolatedLru);
    for i in 0..10 {
        reserve_one_salted(&c, i, "t");
    }
    let t = CacheSalt::new("t").unwrap();
    c.set_quota(&t, Some(3 * PAGE));
    let report = c.run_maintenance();
    assert_eq!(report.quota_evicted_bytes, 7 * PAGE);
    assert_eq!(c.usage_of(&t), 3 * PAGE);
    assert!(c.contains(&key_salted(9, "t")) && !c.contains(&key_salted(0, "t")));
}

#[test]
fn watermark_pass_evicts_the_ratio_in_bytes() {
    let c = cache(100 * PAGE);
    for i in 0..79 {
        reserve_one(&c, i, PAGE).commit().unwrap();
    }
    assert_eq!(c.run_maintenance().watermark_evicted_bytes, 0, "below 0.8: nothing");
    reserve_one(&c, 79, PAGE).commit().unwrap();
    let r = c.run_maintenance();
    assert_eq!(r.watermark_evicted_bytes, 16 * PAGE, "0.2 of 80 pages");
    assert_eq!(c.usage().used_bytes, 64 * PAGE);
}

#[test]
fn parked_leases_expire_and_release_their_locks() {
    use std::time::Duration;
    let arena = lmcache_memory::Arena::create(&lmcache_memory::ArenaConfig {
        size: 1 << 20,
        backing: lmcache_memory::ArenaBacking::Anonymous,
        mlock: false,
    })
    .unwrap();
    let memory = lmcache_memory::ArenaAllocator::new(arena, PAGE).unwrap();
    let cfg = lmcache_l1::L1Config {
        read_ttl: Duration::from_millis(1),
        write_ttl: Duration::from_millis(1),
        ..Default::default()
    };
    let c = lmcache_l1::L1Cache::new(cfg, memory).unwrap();
    reserve_one(&c, 1, 100).commit().unwrap();
    let lease = c.read_lock(&[key(1)], 1).pop().unwrap().unwrap();
    let read_id = c.park_read(lease);
    let write_id = c.park_write(reserve_one(&c, 2, 100));
    assert_eq!(c.parked_leases(), (1, 1));
    std::thread::sleep(Duration::from_millis(5));
    let r = c.run_maintenance();
    assert_eq!((r.expired_read_leases, r.expired_write_leases), (1, 1));
    let stats = c.usage().stats;
    assert_eq!((stats.expired_read_leases, stats.expired_write_leases), (1, 1));
    assert_eq!(stats.maintenance_passes, 1);
    assert!(c.take_read(read_id).is_none() && c.take_write(write_id).is_none());
    assert_eq!(c.usage().locked_objects, 0);
    assert_eq!(c.usage().staged_objects, 0);
    assert_eq!(c.delete(&[key(1)], false)[0], Ok(()));
    c.check_invariants().unwrap();
}

#[test]
fn invalid_sizes_are_typed_errors() {
    let c = cache(1 << 20);
    let r = c.reserve_write(&[WriteRequest::new(key(1), 0), WriteRequest::new(key(2), 1 << 40)]);
    assert!(matches!(r[0], Err(L1Error::InvalidSize { size: 0, .. })));
    assert!(matches!(r[1], Err(L1Error::InvalidSize { .. })));
}

#[test]
fn noop_policy_never_evicts() {
    let c = cache_with(4 * PAGE, EvictionPolicyKind::Noop);
    for i in 0..4 {
        reserve_one(&c, i, PAGE).commit().unwrap();
    }
    let r = c.reserve_write(&[WriteRequest::new(key(9), PAGE)]);
    assert!(matches!(r[0], Err(L1Error::OutOfMemory { .. })));
    assert_eq!(c.clear(false).removed, 4);
    c.check_invariants().unwrap();
}

#[test]
fn background_maintenance_runs_and_stops_on_drop() {
    use std::time::Duration;
    let arena = lmcache_memory::Arena::create(&lmcache_memory::ArenaConfig {
        size: 10 * PAGE,
        backing: lmcache_memory::ArenaBacking::Anonymous,
        mlock: false,
    })
    .unwrap();
    let memory = lmcache_memory::ArenaAllocator::new(arena, PAGE).unwrap();
    let cfg = lmcache_l1::L1Config {
        maintenance_interval: Duration::from_millis(5),
        ..Default::default()
    };
    let c = lmcache_l1::L1Cache::new(cfg, memory).unwrap();
    for i in 0..9 {
        reserve_one(&c, i, PAGE).commit().unwrap();
    }
    let m = lmcache_l1::Maintenance::spawn(c.clone()).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while c.usage().used_bytes >= 8 * PAGE && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(m);
    assert!(c.usage().used_bytes < 8 * PAGE, "watermark pass never ran");
}

/// Hears removals with their causes.
#[derive(Debug, Default)]
struct Causes(std::sync::Mutex<Vec<(u32, lmcache_l1::RemovalCause)>>);

impl lmcache_l1::L1Listener for Causes {
    fn removed(&self, _key: &lmcache_core::ObjectKey) {
        panic!("L1 calls removed_because, with the cause");
    }
    fn removed_because(&self, key: &lmcache_core::ObjectKey, cause: lmcache_l1::RemovalCause) {
        let i = (0..64).find(|&i| &common::key(i) == key).unwrap_or(u32::MAX);
        self.0.lock().unwrap().push((i, cause));
    }
}

#[test]
fn a_probe_tells_resident_from_being_written_and_removals_carry_their_cause() {
    use lmcache_l1::{RemovalCause, Residency};
    let c = cache(3 * PAGE);
    let heard = std::sync::Arc::new(Causes::default());
    c.set_listener(heard.clone());
    reserve_one(&c, 1, PAGE).commit().unwrap();
    let staged = reserve_one(&c, 2, PAGE);
    assert_eq!(
        c.probe(&[key(1), key(2), key(3)]),
        vec![Residency::Resident, Residency::BeingWritten, Residency::Absent]
    );
    staged.commit().unwrap();
    reserve_one(&c, 3, PAGE).commit().unwrap();
    // A fourth object needs room: the policy evicts the oldest.
    reserve_one(&c, 4, PAGE).commit().unwrap();
    c.delete(&[key(2)], false).pop().unwrap().unwrap();
    c.clear(false);
    let mut got = heard.0.lock().unwrap().clone();
    got.sort_by_key(|(i, _)| *i);
    assert_eq!(
        got,
        vec![
            (1, RemovalCause::Evicted),
            (2, RemovalCause::Deleted),
            (3, RemovalCause::Cleared),
            (4, RemovalCause::Cleared)
        ]
    );
    assert_eq!(c.probe(&[key(1)]), vec![Residency::Absent]);
}
