//! A full /dev/shm: the lazily committed L1 pool cannot grow any more. Writing into a sparse
//! tmpfs page then would kill the process with SIGBUS; instead the allocation fails, L1
//! evicts what is already backed and reuses it, and writes go on.
//!
//! The test runs itself again in a private mount namespace (`unshare -m`, as root) whose
//! /dev/shm is a 64 MiB tmpfs, so filling it touches nothing else on the machine.

mod common;

use std::process::Command;

use common::*;
use lmcache_l1::{L1Cache, L1Config, WriteRequest};
use lmcache_memory::{AllocError, Arena, ArenaAllocator, ArenaBacking, ArenaConfig};

const INNER: &str = "LMCACHE_RS_SMALL_SHM_INNER";
const MIB: u64 = 1 << 20;

#[test]
fn a_full_dev_shm_fails_allocations_and_l1_evicts_instead_of_sigbus() {
    if std::env::var(INNER).is_err() {
        let exe = std::env::current_exe().unwrap();
        let script = "mount -t tmpfs -o size=64m lmcache-rs-test /dev/shm && exec \"$0\" \
                      --exact a_full_dev_shm_fails_allocations_and_l1_evicts_instead_of_sigbus \
                      --nocapture";
        let out = Command::new("unshare")
            .args(["-m", "sh", "-c", script])
            .arg(&exe)
            .env(INNER, "1")
            .output()
            .expect("unshare (util-linux) must be installed; the test needs a private /dev/shm");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // A SIGBUS shows as a signal exit, not a failed assertion.
        assert!(out.status.success(), "inner run failed ({:?}):\n{text}", out.status);
        assert!(text.contains("1 passed"), "the inner test did not run:\n{text}");
        return;
    }
    let df = nix::sys::statvfs::statvfs("/dev/shm").unwrap();
    let total = df.blocks() as u64 * df.fragment_size() as u64;
    assert_eq!(total, 64 * MIB, "not inside the private 64 MiB /dev/shm");

    // A 48 MiB pool fits the empty file system; then another program fills it to 40 MiB,
    // leaving 24 MiB.
    let name = format!("lmcache_rs_shmfull_{}", std::process::id());
    let arena = Arena::create(&ArenaConfig {
        size: 48 * MIB,
        backing: ArenaBacking::SharedMemory { name },
        mlock: false,
    })
    .unwrap();
    std::fs::write("/dev/shm/someone-elses-file", vec![1u8; 40 * MIB as usize]).unwrap();
    let memory = ArenaAllocator::new(arena, PAGE).unwrap();

    // The allocator refuses what cannot be backed, before anyone writes to it.
    let mut held = Vec::new();
    let err = loop {
        match memory.allocate(4 * MIB) {
            Ok(mut a) => {
                a.as_mut_slice().fill(0xab); // would SIGBUS without the backing
                held.push(a);
            }
            Err(e) => break e,
        }
        assert!(held.len() < 12, "allocated past what /dev/shm can hold");
    };
    assert!(matches!(err, AllocError::BackingFull { .. }), "{err:?}");
    assert!((4..=6).contains(&held.len()), "{} allocations of 4 MiB", held.len());
    let backed = held.len();
    drop(held);
    // Freed memory is backed already: it is reused.
    for _ in 0..backed {
        memory.allocate(4 * MIB).unwrap().as_mut_slice().fill(1);
    }

    // Through L1: stores keep succeeding by evicting older objects, and nothing crashes.
    let l1 = L1Cache::new(L1Config::default(), memory).unwrap();
    let mut stored = 0;
    for i in 0..40u32 {
        let mut w = match l1.reserve_write(&[WriteRequest::new(key(i), 4 * MIB)]).pop().unwrap() {
            Ok(w) => w,
            Err(e) => panic!("store {i} refused: {e:?}"),
        };
        w.as_mut_slice().fill(i as u8);
        w.commit().unwrap();
        stored += 1;
    }
    assert_eq!(stored, 40);
    let u = l1.usage();
    assert!(u.stats.evicted_objects >= 30, "{u:?}");
    assert!(u.used_bytes <= backed as u64 * 4 * MIB, "{u:?}");
    let newest = l1.read_lock(&[key(39)], 1).pop().unwrap().unwrap();
    assert!(newest.bytes().iter().all(|&b| b == 39));
    drop(newest);
    l1.check_invariants().unwrap();
    // Once the other program frees its file, the pool grows again.
    std::fs::remove_file("/dev/shm/someone-elses-file").unwrap();
    let big: Vec<_> = (100..110u32)
        .map(|i| l1.reserve_write(&[WriteRequest::new(key(i), 4 * MIB)]).pop().unwrap())
        .collect();
    assert!(big.iter().all(Result::is_ok), "{:?}", big.iter().filter(|r| r.is_err()).count());
}
