//! Against the real nixl-cu12 wheel: a Rust agent and a Python agent on LMCache's own calls
//! read each other's memory over UCX on loopback, each through the other's pickled
//! descriptor list. Needs `LMCACHE_RS_TEST_NIXL_PYTHON`, a Python with nixl-cu12 1.5.1
//! (scripts/test sets it); a failure under `LMCACHE_RS_REQUIRE_SERVICES=1` when missing.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_nixl::{DescList, Finished, Nixl};

fn python() -> Option<String> {
    match std::env::var("LMCACHE_RS_TEST_NIXL_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ if std::env::var("LMCACHE_RS_REQUIRE_SERVICES").is_ok_and(|v| v == "1") => {
            panic!("LMCACHE_RS_TEST_NIXL_PYTHON is not set, but LMCACHE_RS_REQUIRE_SERVICES=1")
        }
        _ => {
            eprintln!("skipped: LMCACHE_RS_TEST_NIXL_PYTHON is not set");
            None
        }
    }
}

fn pattern(i: usize) -> u8 {
    ((i * 7 + 3) % 251) as u8
}

#[test]
fn rust_and_python_agents_read_each_other() {
    let Some(py) = python() else { return };
    let lib = lmcache_nixl::locate(None, &py).expect("the wheel's library");
    let nixl = Nixl::load(&lib).expect("load NIXL");
    let agent = nixl.agent("rs-peer").expect("agent");

    const PAGE: usize = 4096;
    // Ours: 4 pages, page p filled with p * 16 + 1.
    let mut mine: Vec<u8> = (0..4 * PAGE).map(|i| ((i / PAGE) * 16 + 1) as u8).collect();
    let base = mine.as_mut_ptr() as usize;
    // SAFETY: `mine` outlives the registration (dropped at the end of the test, after it).
    let reg = unsafe { agent.register_dram(base, mine.len()) }.expect("register");
    let pages = DescList::pages(base as u64, mine.len() as u64, PAGE as u64).unwrap();
    let local = agent.prep_local(&pages).expect("prep local");

    let mut child = Command::new(&py)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/nixl_peer.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let theirs = json_line(&mut out, &mut line);
    let name =
        agent.add_remote(&hex(theirs["md"].as_str().unwrap())).expect("load python's metadata");
    assert_eq!(name, "py-peer");
    let (remote_list, module) =
        DescList::from_pickle(&hex(theirs["descs"].as_str().unwrap())).expect("unpickle");
    assert!(module.ends_with("._bindings"), "{module}");
    assert_eq!(remote_list.descs.len(), 8);
    let remote = agent.prep_remote(&name, &remote_list).expect("prep remote");

    // Tell Python about us (our pickle, in its module's name), then read its pages 5 and 3
    // into our pages 1 and 2 meanwhile.
    let hello = format!(
        "{{\"md\": \"{}\", \"descs\": \"{}\"}}\n",
        to_hex(&agent.metadata().unwrap()),
        to_hex(&pages.to_pickle(&module))
    );
    child.stdin.as_mut().unwrap().write_all(hello.as_bytes()).unwrap();
    // SAFETY: `mine` stays alive and unread until the transfer ends.
    let x = unsafe { agent.read(&local, &[1, 2], &remote, &[5, 3]) }.expect("post READ");
    match x.wait(Instant::now() + Duration::from_secs(20)) {
        Finished::Done => {}
        other => panic!("READ from Python: {other:?}"),
    }
    for (page, theirs) in [(1usize, 5usize), (2, 3)] {
        for k in 0..PAGE {
            assert_eq!(mine[page * PAGE + k], pattern(theirs * PAGE + k), "page {page} byte {k}");
        }
    }

    // Python read our pages 2 and 0 (their contents before ours changed: page 2 was
    // overwritten above, possibly before or after; page 0 is stable).
    let done = json_line(&mut out, &mut line);
    assert_eq!(done["state"], "DONE", "Python's READ of our memory");
    let got = hex(done["got"].as_str().unwrap());
    assert_eq!(got.len(), 2 * PAGE);
    assert!(got[PAGE..].iter().all(|&b| b == 1), "our page 0, read by Python");
    child.stdin.as_mut().unwrap().write_all(b"bye\n").unwrap();
    assert!(child.wait().unwrap().success());
    drop((local, remote, reg));
    drop(Arc::clone(&agent));
}

#[test]
fn a_read_from_a_peer_that_died_fails_in_bounded_time_and_leaves_nothing_staged() {
    use lmcache_l1::{L1Cache, L1Config, WriteRequest};
    use lmcache_memory::{Arena, ArenaAllocator, ArenaBacking, ArenaConfig};
    let Some(py) = python() else { return };
    let lib = lmcache_nixl::locate(None, &py).expect("the wheel's library");
    let agent = Nixl::load(&lib).expect("load NIXL").agent("rs-reader").expect("agent");
    let arena = Arena::create(&ArenaConfig {
        size: 1 << 20,
        backing: ArenaBacking::Anonymous,
        mlock: false,
    })
    .unwrap();
    let l1 = L1Cache::new(L1Config::default(), ArenaAllocator::new(arena, 4096).unwrap()).unwrap();
    let reg = agent.register_l1(&l1).expect("register L1");

    // The peer hands out its metadata and pages, then dies before we read them.
    let mut child = Command::new(&py)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/nixl_peer.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let theirs = json_line(&mut out, &mut String::new());
    let name = agent.add_remote(&hex(theirs["md"].as_str().unwrap())).expect("metadata");
    let (list, _) = DescList::from_pickle(&hex(theirs["descs"].as_str().unwrap())).unwrap();
    let remote = agent.prep_remote(&name, &list).expect("prep remote");
    child.kill().unwrap();
    child.wait().unwrap();

    let key = |i: u8| lmcache_core::ObjectKey::new([i; 32], "m", 1, 0, 0, "").unwrap();
    let reqs: Vec<WriteRequest> = (0..2).map(|i| WriteRequest::new(key(i), 4096)).collect();
    let objects: Vec<_> = l1
        .reserve_write(&reqs)
        .into_iter()
        .zip([0u64, 8192])
        .map(|(w, at)| (w.unwrap(), at))
        .collect();
    let t = Instant::now();
    let got = agent.read_into(&reg, &remote, objects, Instant::now() + Duration::from_secs(5));
    assert!(got.is_err(), "a READ from a dead peer succeeded");
    assert!(t.elapsed() < Duration::from_secs(15), "unbounded: {:?}", t.elapsed());
    let u = l1.usage();
    assert_eq!((u.staged_objects, u.resident_objects), (0, 0), "{:?}", got.err());
    drop((remote, reg));
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The helper's next JSON line (NIXL may log on stdout too).
fn json_line(out: &mut impl BufRead, line: &mut String) -> serde_json::Value {
    loop {
        line.clear();
        assert!(out.read_line(line).unwrap() > 0, "the Python peer ended early");
        if line.starts_with('{') {
            return serde_json::from_str(line).unwrap();
        }
    }
}
