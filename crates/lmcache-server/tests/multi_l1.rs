//! Several L1s in write order (LMCache's `--l1-manager`, repeated), over real ZMQ with
//! LMCache's default chunk of 32 MiB: a small first L1 in DRAM or a file, a second in a file.
//! Stores fill the first and overflow to the second without evicting; every chunk reads back
//! byte for byte from whichever holds it, with two clients storing the same requests at once;
//! both files restart warm together (on disk, and in /dev/shm as named DRAM L1s are);
//! engine-driven transfer (one mapped pool) is refused by name, and `/status` reports each L1
//! by its tag.

mod common;

use std::path::Path;
use std::time::Duration;

use common::chunks32::{CHUNK, CHUNKS, connect, holds, key, pattern, transfer};
use lmcache_client::Client;
use lmcache_memory::{ArenaBacking, ArenaConfig, FileBacking, ForeignSegment};
use lmcache_server::{Server, ServerConfig};

const REQUESTS: u32 = 3;
const MIB: u64 = 1 << 20;
/// The first L1: room for 3 of the 12 chunks (and a little more, so that the watermark,
/// here 1.0, never fires).
const FIRST: u64 = 100 * MIB;
/// The second: room for the other 9, and some.
const SECOND: u64 = 320 * MIB;

fn file(path: &Path, warm: bool) -> ArenaBacking {
    ArenaBacking::File(FileBacking { path: path.to_owned(), format: false, adopt: warm })
}

fn server(first: ArenaBacking, second: ArenaBacking) -> Server {
    let arena = |size, backing| ArenaConfig { size, backing, mlock: false };
    // Eviction only when a store needs room: what each L1 holds is then exactly what overflow
    // put there.
    let l1 = lmcache_l1::L1Config { trigger_watermark: 1.0, ..lmcache_l1::L1Config::default() };
    Server::start(ServerConfig {
        chunk_size: CHUNK,
        copy_threads: 2,
        http_port: Some(0),
        l1_tag: "dram".into(),
        more_l1: vec![lmcache_storage::L1MemberConfig {
            tag: "dax".into(),
            arena: arena(SECOND, second),
            align: lmcache_memory::DEFAULT_ALIGN,
            l1: l1.clone(),
        }],
        l1,
        ..ServerConfig::local(arena(FIRST, first))
    })
    .unwrap()
}

/// Every request looked up and retrieved into a zeroed segment: whole and byte-exact.
fn retrieve_all(c: &mut Client, id: u64, seg: &ForeignSegment) {
    for r in 0..REQUESTS {
        let k = key(r);
        assert_eq!(c.lookup(&k).unwrap(), CHUNKS as u64, "request {r}: lookup");
        seg.write(0, &vec![0u8; seg.len() as usize]).unwrap();
        assert!(transfer(c, id, false, &k), "request {r}: retrieve");
        assert!(holds(seg, r), "request {r}: KV differs");
    }
}

/// Resident chunks per L1, in write order.
fn held(s: &Server) -> Vec<usize> {
    s.state().l1().members().map(|(_, m)| m.usage().resident_objects).collect()
}

#[test]
fn stores_overflow_into_the_second_l1_and_every_chunk_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let pid = std::process::id();
    let s = server(ArenaBacking::Anonymous, file(&dir.path().join("second"), false));
    // Two clients, each with its own segment, store the same requests at once.
    let mut owners = Vec::new();
    let mut clients: Vec<(Client, u64, ForeignSegment)> = Vec::new();
    for id in 1..=2 {
        let (c, owner, seg) = connect(&s, id, &format!("lmcache_rs_multi_{pid}_{id}"));
        owners.push(owner);
        clients.push((c, id, seg));
    }
    std::thread::scope(|scope| {
        for (c, id, seg) in clients.iter_mut() {
            scope.spawn(move || {
                for r in 0..REQUESTS {
                    seg.write(0, &pattern(seg.len(), r)).unwrap();
                    assert!(transfer(c, *id, true, &key(r)), "request {r}: store");
                }
            });
        }
    });
    let counts = held(&s);
    assert_eq!(counts.iter().sum::<usize>(), REQUESTS as usize * CHUNKS, "{counts:?}");
    assert_eq!(counts[0], 3, "the first L1 filled up: {counts:?}");
    let usage = s.state().l1().usage();
    assert_eq!(usage.stats.evicted_objects, 0, "nothing evicted while the second had room");
    for (c, id, seg) in clients.iter_mut() {
        retrieve_all(c, *id, seg);
    }
    // Engine-driven transfer maps one pool: refused by name (an empty pool in the reply,
    // the reason in /status), and the server goes on.
    let (c, _, _) = &mut clients[0];
    let reg = common::small_registration(7, "m", lmcache_core::Dtype::Float16);
    assert_eq!(c.register_engine_driven(&reg).unwrap().pool_size, 0);
    assert_eq!(c.lookup(&key(0)).unwrap(), CHUNKS as u64);
    // /status: each L1 by its tag.
    let (code, body) = common::http_raw(&s, "GET", "/status", None, Duration::from_secs(5));
    assert_eq!(code, 200, "{body}");
    let st: serde_json::Value = serde_json::from_str(&body).unwrap();
    let l1s = &st["storage_manager"]["l1_manager"]["l1s"];
    assert_eq!(l1s[0]["tag"], "dram", "{l1s}");
    assert_eq!(l1s[1]["tag"], "dax", "{l1s}");
    assert_eq!(l1s[0]["resident_objects"], 3, "{l1s}");
    assert_eq!(l1s[1]["type"], "DEVDAX", "{l1s}");
    // /metrics: each L1 by its tag.
    let (code, m) = common::http_raw(&s, "GET", "/metrics", None, Duration::from_secs(5));
    assert_eq!(code, 200);
    for line in [
        "lmcache_rs_l1_tier_objects{tag=\"dram\"} 3".to_owned(),
        format!("lmcache_rs_l1_tier_capacity_bytes{{tag=\"dax\"}} {}", l1s[1]["capacity_bytes"]),
    ] {
        assert!(m.lines().any(|l| l == line), "{line} not in:\n{m}");
    }
    let refused = &st["refused_instances"][0];
    assert_eq!(refused["instance_id"], 7, "{refused}");
    assert!(refused["reason"].as_str().unwrap().contains("runs 2 L1s"), "{refused}");
    drop(clients);
    s.shutdown();
}

#[test]
fn two_l1_files_restart_warm_together() {
    let dir = tempfile::tempdir().unwrap();
    restart_warm_together(&dir.path().join("first"), &dir.path().join("second"), "file");
}

/// Two DRAM L1s that each name a segment (`shm_name`), restarted warm: the CLI makes each a
/// file in /dev/shm, and each adopts what it held there.
#[test]
fn two_named_dram_l1s_restart_warm_together_in_dev_shm() {
    let pid = std::process::id();
    let shm = Path::new(lmcache_memory::shm::SHM_DIR);
    let (first, second) = (
        shm.join(format!("lmcache_rs_multi_a_{pid}")),
        shm.join(format!("lmcache_rs_multi_b_{pid}")),
    );
    /// Removes what the test made in /dev/shm (the two files and the first's sidecars).
    struct Made(Vec<std::path::PathBuf>);
    impl Drop for Made {
        fn drop(&mut self) {
            for p in &self.0 {
                for suffix in ["", ".lmcache-rs-workers", ".lmcache-rs-tokens"] {
                    let mut name = p.clone().into_os_string();
                    name.push(suffix);
                    let _ = std::fs::remove_file(name);
                }
            }
        }
    }
    let _made = Made(vec![first.clone(), second.clone()]);
    restart_warm_together(&first, &second, "shm");
}

fn restart_warm_together(first: &Path, second: &Path, what: &str) {
    let pid = std::process::id();
    let seg_name = format!("lmcache_rs_multi_warm_{what}_{pid}");
    let before = {
        let s = server(file(first, true), file(second, true));
        let (mut c, _owner, seg) = connect(&s, 1, &seg_name);
        for r in 0..REQUESTS {
            seg.write(0, &pattern(seg.len(), r)).unwrap();
            assert!(transfer(&mut c, 1, true, &key(r)), "request {r}: store");
        }
        let before = held(&s);
        assert!(before[0] > 0 && before[1] > 0, "{before:?}");
        drop(c);
        s.shutdown();
        before
    };
    let s = server(file(first, true), file(second, true));
    assert_eq!(held(&s), before, "each file adopted what it held");
    let (mut c, _owner, seg) = connect(&s, 1, &seg_name);
    retrieve_all(&mut c, 1, &seg);
    drop(c);
    s.shutdown();
}
