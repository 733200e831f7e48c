//! CacheBlend's sparse leg beyond L1, over real ZMQ: a matched chunk L1 lost is loaded back
//! from L2 (and scattered, and never struck); a chunk found nowhere is struck out.

use std::time::Duration;

use lmcache_client::Client;

mod common;
use common::blend::*;

#[test]
fn a_match_l1_lost_is_loaded_back_from_l2_scattered_and_never_struck() {
    let dir = tempfile::tempdir().unwrap();
    let s = server("l2", Some(dir.path()));
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(30)).unwrap();
    let _segs = worker(&mut c, "l2");
    let d = seq(4, CHUNK);
    store(&mut c, "p1", &[seq(1, CHUNK), d.clone()].concat());
    assert_eq!(s.state().storage.flush(Duration::from_secs(10)), 0, "write-behind unfinished");
    let engine = s.state().blend().unwrap();
    let fingerprints = engine.status()["fingerprinted_chunks"].as_u64().unwrap();
    let p2: Vec<u32> = [seq(2, CHUNK), seq(9, 4), d, seq(8, 12)].concat();
    // Twice with L1 emptied each time: D comes back from L2 both times, and is never struck.
    for round in 0..2 {
        s.state().l1().clear(true);
        let id = format!("q{round}");
        let (r, _) = unified(&mut c, &id, &p2);
        let got: Vec<_> = r.non_prefix_segments.iter().map(|m| (m.old_st, m.cur_st)).collect();
        assert_eq!(got, vec![(16, 20)], "round {round}: D not found past L1");
        assert_eq!(s.state().l1().usage().locked_objects, 1, "its object is locked");
        assert!(retrieve(&mut c, &id, &p2, &r, (20..32).collect()), "the scatter ran");
        c.end_session(&id).unwrap();
        assert_eq!(s.state().l1().usage().locked_objects, 0);
    }
    assert_eq!(engine.status()["fingerprinted_chunks"].as_u64().unwrap(), fingerprints);
    assert_eq!(metric(&s, "lmcache_blend_sparse_prefetch_l2_keys_total"), 2.0);
    assert_eq!(metric(&s, "lmcache_blend_sparse_prefetch_found_keys_total"), 2.0);
    assert_eq!(metric(&s, "lmcache_blend_sparse_prefetch_duration_milliseconds_count"), 2.0);
    assert_eq!(metric(&s, "lmcache_blend_lookup_stale_chunks_total"), 0.0);

    // Gone from L2 as well: a strike each lookup, the fingerprint removed at the second.
    s.state().l1().clear(true);
    for e in std::fs::read_dir(dir.path()).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            std::fs::remove_dir_all(p).unwrap()
        } else {
            std::fs::remove_file(p).unwrap()
        }
    }
    for round in 0..2 {
        let id = format!("gone{round}");
        let (r, _) = unified(&mut c, &id, &p2);
        assert!(r.non_prefix_segments.is_empty(), "{r:?}");
        c.end_session(&id).unwrap();
    }
    assert!(engine.status()["fingerprinted_chunks"].as_u64().unwrap() < fingerprints);
    assert_eq!(metric(&s, "lmcache_blend_lookup_stale_chunks_total"), 2.0);
    assert_eq!(metric(&s, "lmcache_blend_chunks_evicted_total"), 1.0);
}

#[test]
fn several_clients_reuse_the_same_chunk_at_once_and_leave_no_lock() {
    let s = server("conc", None);
    let mut c = Client::connect(s.endpoint(), Duration::from_secs(30)).unwrap();
    let _segs = worker(&mut c, "conc");
    let d = seq(4, CHUNK);
    store(&mut c, "p1", &[seq(1, CHUNK), d.clone()].concat());
    let p2: Vec<u32> = [seq(2, CHUNK), seq(9, 4), d, seq(8, 12)].concat();
    let endpoint = s.endpoint().to_owned();
    // Four clients, each its own requests, the same chunk, disjoint destination blocks; and a
    // fifth storing the same prompt again meanwhile (a no-op store of resident chunks).
    let handles: Vec<_> = (0..4u64)
        .map(|w| {
            let (endpoint, p2) = (endpoint.clone(), p2.clone());
            std::thread::spawn(move || {
                let mut c = Client::connect(&endpoint, Duration::from_secs(30)).unwrap();
                let mut got = Vec::new();
                for i in 0..10 {
                    let id = format!("c{w}-{i}");
                    let (r, _) = unified(&mut c, &id, &p2);
                    let table: Vec<u64> = (0..9).map(|b| 10 + w * 9 + b).collect();
                    let ok =
                        !r.non_prefix_segments.is_empty() && retrieve(&mut c, &id, &p2, &r, table);
                    got.push((r.non_prefix_segments.len(), ok));
                    c.end_session(&id).unwrap();
                }
                got
            })
        })
        .collect();
    for i in 0..5 {
        store(&mut c, &format!("again{i}"), &[seq(1, CHUNK), seq(4, CHUNK)].concat());
    }
    for h in handles {
        let got = h.join().unwrap();
        assert!(got.iter().all(|&g| g == (1, true)), "a lookup or scatter failed: {got:?}");
    }
    assert_eq!(s.state().l1().usage().locked_objects, 0, "a lock was left behind");
    assert_eq!(s.state().metrics.handler_panics.get(), 0);
    assert_eq!(metric(&s, "lmcache_blend_retrieve_requests_total"), 40.0);
    assert_eq!(metric(&s, "lmcache_blend_retrieve_failures_total"), 0.0);
}
