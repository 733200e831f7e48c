//! The L1 file arena across process deaths: what a killed process sealed is adopted by the
//! next one only when its record and its bytes verify; nothing else is ever handed back.
//! The writer runs in a child process (this test binary run again) killed with SIGKILL, so
//! no destructor runs, as in a real crash.

use std::path::{Path, PathBuf};
use std::process::Command;

use lmcache_memory::{Arena, ArenaAllocator, ArenaBacking, ArenaConfig, FileBacking, MemoryError};

const SIZE: u64 = 64 << 20;
const CHILD_ENV: &str = "LMCACHE_RS_FILE_ARENA_CHILD";

fn open(path: &Path, adopt: bool, format: bool) -> Result<ArenaAllocator, MemoryError> {
    let cfg = ArenaConfig {
        size: SIZE,
        backing: ArenaBacking::File(FileBacking { path: path.to_owned(), format, adopt }),
        mlock: false,
    };
    ArenaAllocator::new(Arena::create(&cfg)?, 4096)
}

fn pattern(i: u8, len: usize) -> Vec<u8> {
    (0..len).map(|j| (j as u8).wrapping_mul(31).wrapping_add(i)).collect()
}

fn xxh3(b: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(b)
}

/// The child: writes six objects and dies by SIGKILL. Objects 0-2 are sealed as they should
/// be; 3 is never sealed (killed before its checksum); 4 is sealed with a checksum its bytes
/// do not have (a write that did not complete); 5 is sealed, then freed (its record must go).
fn child(path: &Path) {
    let mem = open(path, true, false).unwrap();
    let mut keep = Vec::new();
    for i in 0..6u8 {
        let len = 300_000 + i as usize * 4096;
        let mut a = mem.allocate(len as u64).unwrap();
        let bytes = pattern(i, len);
        a.as_mut_slice().copy_from_slice(&bytes);
        let key = format!("key-{i}");
        match i {
            3 => {}
            4 => assert!(a.persist(key.as_bytes(), xxh3(&bytes) ^ 1).unwrap()),
            _ => assert!(a.persist(key.as_bytes(), xxh3(&bytes)).unwrap()),
        }
        if i == 5 {
            drop(a);
        } else {
            keep.push(a);
        }
    }
    nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL).unwrap();
}

fn run_child(test: &str, path: &Path) {
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, path)
        .status()
        .unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "the writer must die by SIGKILL: {status:?}");
}

fn child_path() -> Option<PathBuf> {
    std::env::var_os(CHILD_ENV).map(PathBuf::from)
}

#[test]
fn a_killed_writers_sealed_objects_are_adopted_and_nothing_else() {
    if let Some(p) = child_path() {
        child(&p);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l1.dax");
    run_child("a_killed_writers_sealed_objects_are_adopted_and_nothing_else", &path);

    let mem = open(&path, true, false).unwrap();
    let report = mem.adopt_report().unwrap();
    let mut got = mem.take_adopted();
    got.sort_by(|a, b| a.key.cmp(&b.key));
    let keys: Vec<_> = got.iter().map(|a| String::from_utf8(a.key.clone()).unwrap()).collect();
    assert_eq!(keys, ["key-0", "key-1", "key-2"], "only sealed objects whose bytes verify");
    for (i, a) in got.iter().enumerate() {
        let len = 300_000 + i * 4096;
        assert_eq!(a.alloc.as_slice(), pattern(i as u8, len), "object {i} byte for byte");
        assert_eq!(a.checksum, xxh3(a.alloc.as_slice()));
        assert!(a.alloc.is_persisted());
    }
    assert_eq!((report.records, report.adopted, report.corrupt, report.misplaced), (4, 3, 1, 0));
    assert!(mem.take_adopted().is_empty(), "handed over once");
    // The adopted ranges are taken: new allocations never overlap them.
    let fresh: Vec<_> = (0..20).map(|_| mem.allocate(1 << 20).unwrap()).collect();
    for f in &fresh {
        for a in &got {
            let (s, e) = (a.alloc.offset(), a.alloc.offset() + a.alloc.physical_len());
            assert!(f.offset() + f.physical_len() <= s || e <= f.offset(), "overlap");
        }
    }
    // Dropping an adopted object zeroes its record; a shutdown keeps the others' records
    // (`detach_catalog`), so a third process adopts exactly those.
    got.remove(0);
    drop(fresh);
    mem.detach_catalog();
    drop(got);
    drop(mem);
    let mem = open(&path, true, false).unwrap();
    let mut again = mem.take_adopted();
    again.sort_by(|a, b| a.key.cmp(&b.key));
    let keys: Vec<_> = again.iter().map(|a| a.key.clone()).collect();
    assert_eq!(keys, [b"key-1".to_vec(), b"key-2".to_vec()]);
    // Without the detach, dropping everything forgets everything.
    drop(again);
    drop(mem);
    let mem = open(&path, true, false).unwrap();
    assert_eq!(mem.adopt_report().unwrap().records, 0);
}

#[test]
fn a_cold_start_forgets_the_catalog() {
    if let Some(p) = child_path() {
        child(&p);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l1.dax");
    run_child("a_cold_start_forgets_the_catalog", &path);
    let mem = open(&path, false, false).unwrap();
    assert!(mem.take_adopted().is_empty());
    assert_eq!(mem.catalog_usage(), Some((0, 1024)));
    drop(mem);
    // And a warm start after the cold one finds nothing either: the records were zeroed.
    let mem = open(&path, true, false).unwrap();
    assert_eq!(mem.adopt_report().unwrap().records, 0);
}

#[test]
fn foreign_files_are_left_alone_unless_formatting_is_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("not-ours");
    std::fs::write(&path, b"somebody's data").unwrap();
    assert!(matches!(open(&path, true, false), Err(MemoryError::FileNotOurs { .. })));
    assert_eq!(std::fs::read(&path).unwrap(), b"somebody's data", "untouched");
    // An empty file, or an explicit format, is fine.
    let empty = dir.path().join("empty");
    std::fs::write(&empty, b"").unwrap();
    drop(open(&empty, true, false).unwrap());
    assert!(lmcache_memory::file_arena::is_l1_file(&empty));
    drop(open(&path, false, true).unwrap());
    assert!(lmcache_memory::file_arena::is_l1_file(&path));
}

/// /dev/zero maps like a device (shared anonymous memory) but is no device-dax one: taken as
/// an L1 it used to "work", an L1 that no restart could find. It is refused by name, even
/// with formatting asked for. (A real /dev/dax device's alignment and size checks are unit
/// tests of `dax_device`, with a sysfs tree of their own.)
#[test]
fn a_character_device_that_is_not_device_dax_is_refused_by_name() {
    for format in [false, true] {
        match open(Path::new("/dev/zero"), true, format) {
            Err(MemoryError::FileNotUsable { path, reason }) => {
                assert_eq!(path, Path::new("/dev/zero"));
                assert!(reason.contains("is not a device-dax device"), "{reason}");
            }
            other => panic!("format {format}: {:?}", other.map(|_| ())),
        }
    }
}

#[test]
fn one_process_at_a_time_and_a_warm_restart_keeps_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l1.dax");
    let mem = open(&path, true, false).unwrap();
    assert!(matches!(open(&path, true, false), Err(MemoryError::FileInUse { .. })));
    assert_eq!(lmcache_memory::file_arena::lock_holder(&path).unwrap(), Some(std::process::id()));
    // A shutdown lets the file go before unmapping it.
    mem.detach_catalog();
    mem.release_file();
    assert_eq!(lmcache_memory::file_arena::lock_holder(&path).unwrap(), None);
    drop(open(&path, true, false).unwrap());
    drop(mem);
    let cfg = ArenaConfig {
        size: 2 * SIZE,
        backing: ArenaBacking::File(FileBacking { path: path.clone(), format: false, adopt: true }),
        mlock: false,
    };
    let err = Arena::create(&cfg).unwrap_err();
    assert!(matches!(err, MemoryError::FileGeometry { .. }), "{err}");
    assert!(err.to_string().contains("--l1-size-gb"), "{err}");
    // A cold start may resize it (the file is ours).
    let cfg = ArenaConfig {
        backing: ArenaBacking::File(FileBacking {
            path: path.clone(),
            format: false,
            adopt: false,
        }),
        ..cfg
    };
    let mem = ArenaAllocator::new(Arena::create(&cfg).unwrap(), 4096).unwrap();
    assert_eq!(mem.capacity(), 2 * SIZE);
}

#[test]
fn damaged_records_and_ranges_are_dropped() {
    if let Some(p) = child_path() {
        child(&p);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l1.dax");
    run_child("damaged_records_and_ranges_are_dropped", &path);
    // Flip one bit in the first record (its checksum then fails) and overwrite the second's
    // offset with a valid-looking but out-of-range one, its checksum fixed up.
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mut recs = Vec::new();
    for i in 0..1024u64 {
        let mut b = [0u8; 256];
        f.read_exact_at(&mut b, 4096 + i * 256).unwrap();
        if b.iter().any(|&x| x != 0) {
            recs.push((i, b));
        }
    }
    assert_eq!(recs.len(), 4);
    let (i0, mut r0) = recs[0];
    r0[20] ^= 4;
    f.write_all_at(&r0, 4096 + i0 * 256).unwrap();
    let (i1, mut r1) = recs[1];
    r1[16..24].copy_from_slice(&(SIZE - 4096).to_le_bytes());
    let sum = xxh3(&r1[..248]);
    r1[248..].copy_from_slice(&sum.to_le_bytes());
    f.write_all_at(&r1, 4096 + i1 * 256).unwrap();
    drop(f);
    let mem = open(&path, true, false).unwrap();
    let r = mem.adopt_report().unwrap();
    assert_eq!((r.records, r.misplaced, r.corrupt, r.adopted), (3, 1, 1, 1), "{r:?}");
    let got = mem.take_adopted();
    assert_eq!(got.len(), 1);
    let i: u8 = String::from_utf8(got[0].key.clone()).unwrap()[4..].parse().unwrap();
    assert_eq!(got[0].alloc.as_slice(), pattern(i, 300_000 + i as usize * 4096));
}
