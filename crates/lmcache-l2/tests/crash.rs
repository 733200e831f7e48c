//! Crash test: a child process stores (and deletes) objects on `fs` and `raw_block` and is
//! killed with SIGKILL at random points, many times; after each kill the adapter is reopened
//! (recovery) and every key the child reported committed (and did not delete) must load and
//! verify, and no key may ever load with wrong bytes.
//!
//! The eviction runs keep raw_block full (a few hundred slots for thousands of keys, so
//! nearly every store evicts) with a small journal (a checkpoint every 384 records), so kills
//! land inside evictions, deletes and checkpoint rotations; there a committed key may have
//! been evicted since, so only the round's last committed key must load, and every key that
//! loads must be right.
#![allow(missing_docs, clippy::allow_attributes)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use lmcache_core::ObjectKey;
use lmcache_l2::config;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

const CHILD_ENV: &str = "LMCACHE_RS_CRASH_CHILD";
const MAX_KEYS: u32 = 6000;

fn key(i: u32) -> ObjectKey {
    let mut h = [0u8; 32];
    h[..4].copy_from_slice(&i.to_le_bytes());
    ObjectKey::new(h, "m", 1, 0, 0, "").unwrap()
}

fn payload(i: u32) -> Vec<u8> {
    let len = 4096 + (i as usize * 977) % 12_000;
    (0..len).map(|j| (j as u32).wrapping_mul(7).wrapping_add(i.wrapping_mul(131)) as u8).collect()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Runs only as the child: stores keys from `start` on, printing each one committed.
#[test]
fn child_process_entry() {
    let Ok(arg) = std::env::var(CHILD_ENV) else { return };
    let v: Value = serde_json::from_str(&arg).unwrap();
    let start = v["start"].as_u64().unwrap() as u32;
    let delete_every = v["delete_every"].as_u64().unwrap_or(0) as u32;
    rt().block_on(async {
        let b = config::build(0, &v["spec"]).await.unwrap();
        let mut out = std::io::stdout().lock();
        for i in start..MAX_KEYS {
            let k = key(i);
            let blob = b.codec.encode(&k, Bytes::from(payload(i))).unwrap();
            if b.adapter.store(vec![(k, blob)]).await.pop().unwrap().is_ok() {
                writeln!(out, "ok {i}").unwrap();
                out.flush().unwrap();
            }
            // Now and then delete an earlier key; "del" only once the delete returned.
            if delete_every > 0 && i % delete_every == 0 && i >= delete_every {
                let victim = i - delete_every / 2;
                writeln!(out, "deleting {victim}").unwrap();
                out.flush().unwrap();
                if b.adapter.delete(&[key(victim)]).await.is_ok() {
                    writeln!(out, "del {victim}").unwrap();
                    out.flush().unwrap();
                }
            }
        }
        writeln!(out, "done").unwrap();
    });
}

/// How a crash loop runs.
#[derive(Clone, Copy, Default)]
struct Loop {
    /// The child deletes key `i - n/2` after storing key `i` when `i % n == 0`.
    delete_every: u32,
    /// The adapter evicts (is full): committed keys may be gone, never wrong.
    evicting: bool,
}

/// Kills a writer `rounds` times and checks what recovery finds.
fn crash_loop(spec: Value, rounds: usize, seed: u64) -> (usize, f64) {
    crash_loop_with(spec, rounds, seed, Loop::default())
}

fn crash_loop_with(spec: Value, rounds: usize, seed: u64, opts: Loop) -> (usize, f64) {
    let exe = std::env::current_exe().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut committed: Vec<u32> = Vec::new();
    let mut next = 0u32;
    let mut worst_recovery = 0f64;
    for round in 0..rounds {
        let arg =
            json!({"spec": spec, "start": next, "delete_every": opts.delete_every}).to_string();
        let mut child = Command::new(&exe)
            .args(["--exact", "child_process_entry", "--nocapture", "--test-threads", "1"])
            .env(CHILD_ENV, arg)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let (mut ok, mut deleting) = (Vec::new(), Vec::new());
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(n) = line.strip_prefix("ok ") {
                    ok.push(n.parse::<u32>().unwrap());
                } else if let Some(n) = line.strip_prefix("deleting ") {
                    // Gone or not after a crash: either way never again required.
                    deleting.push(n.parse::<u32>().unwrap());
                }
            }
            (ok, deleting)
        });
        std::thread::sleep(Duration::from_millis(rng.gen_range(30..250)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let (ok, deleting) = reader.join().unwrap();
        next = ok.last().map_or(next, |&l| l + 2); // skip the key that may have been in flight
        let last = ok.last().copied();
        committed.extend(ok);
        committed.retain(|k| !deleting.contains(k));
        // Recover and verify.
        let t0 = Instant::now();
        let wrong = rt().block_on(async {
            let b = config::build(0, &spec).await.unwrap();
            worst_recovery = worst_recovery.max(t0.elapsed().as_secs_f64());
            let all: Vec<ObjectKey> = (0..next).map(key).collect();
            let loaded = b.adapter.load(&all).await;
            let mut wrong = 0;
            for (i, r) in loaded.into_iter().enumerate() {
                let i = i as u32;
                match r.unwrap() {
                    Some(bytes) => match b.codec.decode(&key(i), &bytes) {
                        Ok(v) if v == payload(i) => {}
                        Ok(_) => wrong += 1,
                        Err(_) => {
                            assert!(!committed.contains(&i), "committed key {i} fails verification")
                        }
                    },
                    None => {
                        // With eviction only the newest committed key is sure to be there.
                        let required = if opts.evicting { last == Some(i) } else { true };
                        assert!(
                            !(required && committed.contains(&i)),
                            "round {round}: committed key {i} lost"
                        );
                    }
                }
            }
            wrong
        });
        assert_eq!(wrong, 0, "round {round}: wrong payloads served");
        if next >= MAX_KEYS - 100 {
            break;
        }
    }
    (committed.len(), worst_recovery)
}

#[test]
fn fs_survives_repeated_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let (n, rec) = crash_loop(json!({"type": "fs", "base_path": dir.path()}), 12, 1);
    assert!(n > 50, "the child committed only {n} keys");
    eprintln!("fs: {n} committed keys survived 12 kills; worst reopen {rec:.3} s");
}

/// fs with `fsync: file` and deletes in the mix: a kill inside a delete or a store loses
/// nothing committed and serves nothing wrong.
#[test]
fn fs_with_fsync_file_survives_kill_9_during_stores_and_deletes() {
    let dir = tempfile::tempdir().unwrap();
    let spec = json!({"type": "fs", "base_path": dir.path(), "fsync": "file"});
    let (n, _) = crash_loop_with(spec, 10, 3, Loop { delete_every: 4, evicting: false });
    assert!(n > 30, "the child committed only {n} keys");
}

/// raw_block kept full (200 slots, so nearly every store evicts the oldest) with a journal of
/// 384 records (a checkpoint rotation every 384 puts and deletes), deletes in the mix, a
/// synced journal: kills land in evictions, deletes and rotations.
#[test]
fn raw_block_survives_kill_9_during_eviction_deletes_and_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let spec = json!({"type": "raw_block", "device_path": dir.path().join("dev"),
        "slot_bytes": 20480, "capacity_bytes": (96 << 10) + 200 * 20480,
        "meta_total_bytes": 96 << 10, "sync_journal": true});
    let (n, rec) = crash_loop_with(spec.clone(), 16, 4, Loop { delete_every: 5, evicting: true });
    assert!(n > 300, "the child committed only {n} keys: eviction never ran");
    // The device is full and consistent: what is there verifies, and it holds many keys.
    let present = rt().block_on(async {
        let b = config::build(0, &spec).await.unwrap();
        let all: Vec<ObjectKey> = (0..MAX_KEYS).map(key).collect();
        b.adapter.lookup(&all).await.unwrap().into_iter().filter(|&f| f).count()
    });
    assert!((100..=200).contains(&present), "{present} keys after the last recovery");
    eprintln!("raw_block full: {n} commits, {present} keys at the end; worst recovery {rec:.3} s");
}

#[test]
fn raw_block_survives_repeated_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let spec = json!({"type": "raw_block", "device_path": dir.path().join("dev"),
        "slot_bytes": 20480, "capacity_bytes": (2 << 20) + 6200 * 20480,
        "meta_total_bytes": 2 << 20, "use_odirect": true});
    let (n, rec) = crash_loop(spec, 20, 2);
    assert!(n > 50, "the child committed only {n} keys");
    eprintln!("raw_block: {n} committed keys survived 20 kills; worst recovery {rec:.3} s");
}
