//! Crash test: a child process stores objects to `fs` and to `raw_block` and is killed with
//! SIGKILL at random points, many times; after each kill the adapter is reopened (recovery)
//! and every key the child reported committed must load and verify, and no key may ever load
//! with wrong bytes.
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
        }
        writeln!(out, "done").unwrap();
    });
}

/// Kills a writer `rounds` times and checks what recovery finds.
fn crash_loop(spec: Value, rounds: usize, seed: u64) -> (usize, f64) {
    let exe = std::env::current_exe().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut committed: Vec<u32> = Vec::new();
    let mut next = 0u32;
    let mut worst_recovery = 0f64;
    for round in 0..rounds {
        let arg = json!({"spec": spec, "start": next}).to_string();
        let mut child = Command::new(&exe)
            .args(["--exact", "child_process_entry", "--nocapture", "--test-threads", "1"])
            .env(CHILD_ENV, arg)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut ok = Vec::new();
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(n) = line.strip_prefix("ok ") {
                    ok.push(n.parse::<u32>().unwrap());
                }
            }
            ok
        });
        std::thread::sleep(Duration::from_millis(rng.gen_range(30..250)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let ok = reader.join().unwrap();
        next = ok.last().map_or(next, |&l| l + 2); // skip the key that may have been in flight
        committed.extend(ok);
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
                        assert!(!committed.contains(&i), "round {round}: committed key {i} lost")
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
