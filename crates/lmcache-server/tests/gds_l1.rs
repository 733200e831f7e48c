//! The slab-file L1 (`--gds-l1-path`) on CPU, over real ZMQ with LMCache's default chunk of
//! 32 MiB: a DRAM staging area smaller than what is stored, the slab in a file with O_DIRECT.
//! Every chunk stored comes back byte for byte, those evicted from staging read back from the
//! slab; a server restarted warm on the slab serves them all again, and a cold one serves none.

mod common;

use std::path::Path;
use std::time::Duration;

use common::chunks32::{CHUNK, CHUNKS, connect, holds, key, pattern, transfer};
use lmcache_client::Client;
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_server::{Server, ServerConfig};

const REQUESTS: u32 = 3;
/// DRAM staging: room for 5 of the 12 chunks stored.
const STAGING: u64 = 160 << 20;

fn server(slab_dir: &Path, warm: bool) -> Server {
    let mut config = ServerConfig {
        chunk_size: CHUNK,
        copy_threads: 2,
        ..ServerConfig::local(ArenaConfig {
            size: STAGING,
            backing: ArenaBacking::Anonymous,
            mlock: false,
        })
    };
    config.l2_adapters = vec![serde_json::json!({
        "type": "gds_slab",
        "path": slab_dir,
        "capacity_bytes": 1u64 << 30,
        "use_odirect": true,
        "warm_restart": warm,
    })];
    // Staging gives an object up only once the slab has it (as a slab L1 must).
    config.l2.write_behind_wait = Duration::from_secs(60);
    Server::start(config).unwrap()
}

fn fill(seg: &ForeignSegment, request: u32) {
    seg.write(0, &pattern(seg.len(), request)).unwrap();
}

/// The slab adapter's counters: (stored keys, loaded keys, corrupt blobs).
fn slab_counters(s: &Server) -> (u64, u64, u64) {
    let l2 = s.state().storage.describe_l2();
    assert_eq!(l2.len(), 1);
    assert_eq!(l2[0].kind, "gds_slab");
    let c = &l2[0].counters;
    (c.stored_keys, c.loaded_keys, c.corrupt_blobs)
}

/// Looks every request up (a chunk found only in the slab is read back into staging) and
/// retrieves it into a zeroed segment: each must come back whole and byte-exact.
fn retrieve_all(c: &mut Client, seg: &ForeignSegment) {
    for r in 0..REQUESTS {
        let k = key(r);
        assert_eq!(c.lookup(&k).unwrap(), CHUNKS as u64, "request {r}: lookup");
        seg.write(0, &vec![0u8; seg.len() as usize]).unwrap();
        assert!(transfer(c, 1, false, &k), "request {r}: retrieve");
        assert!(holds(seg, r), "request {r}: KV differs");
    }
}

#[test]
fn a_slab_l1_serves_more_than_its_staging_holds_and_restarts_warm() {
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let pid = std::process::id();
    let seg_name = format!("lmcache_rs_mp_test_gds_{pid}");
    {
        let s = server(dir.path(), false);
        let (mut c, _owner, seg) = connect(&s, 1, &seg_name);
        for r in 0..REQUESTS {
            fill(&seg, r);
            assert!(transfer(&mut c, 1, true, &key(r)), "request {r}: store");
        }
        // No wait for the slab writes: a lookup that needs room in staging while its chunks
        // are still on their way to the slab waits for them (it used to miss).
        retrieve_all(&mut c, &seg);
        let (stored, loaded, corrupt) = slab_counters(&s);
        assert_eq!(stored, u64::from(REQUESTS) * CHUNKS as u64, "every chunk reached the slab");
        assert!(loaded >= 7, "staging holds 5 of 12 chunks: {loaded} read back from the slab");
        assert_eq!(corrupt, 0);
        drop(c);
        s.shutdown();
    }
    // Warm: every chunk from the slab alone (staging starts empty).
    {
        let s = server(dir.path(), true);
        let (mut c, _owner, seg) = connect(&s, 1, &seg_name);
        retrieve_all(&mut c, &seg);
        let (_, loaded, corrupt) = slab_counters(&s);
        assert_eq!(loaded, u64::from(REQUESTS) * CHUNKS as u64);
        assert_eq!(corrupt, 0);
        drop(c);
        s.shutdown();
    }
    // Cold: the slab is cleared, as LMCache's is.
    let s = server(dir.path(), false);
    let (mut c, _owner, _seg) = connect(&s, 1, &seg_name);
    assert_eq!(c.lookup(&key(0)).unwrap(), 0);
    drop(c);
    s.shutdown();
}
