//! The server side of `POST /events`, in process: the same trace as
//! `scripts/bench-coordinator` (16 servers x 200 sequences of 64 chunks, 16 batches of 64
//! entries per request body, LMCache's JSON), decoded as the HTTP route decodes it and
//! ingested into a fresh coordinator, twice: into the owned batch types and decoded in place
//! (`decode_body`: one pass, borrowed strings, hashes decoded while parsing), as the route
//! does. Reports ns per chunk
//! event for the decode and for the ingest (gate + directory + usage), median of the
//! repetitions. No HTTP or client here: this
//! is what `scripts/bench-coordinator`'s end-to-end figure is made of on the server's side.
//! Then, on the loaded directory, `/directory/lookup`'s work for 2,000 requests of one stored
//! sequence's 64 keys (decode, lookup, encode the answer), median µs per request.
//!
//! The same batches as the JetStream feed carries them (the binary layout, one message per
//! batch) are decoded alone and decoded + ingested into another fresh coordinator.
//!
//! `cargo bench -p lmcache-coordinator --bench ingest -- [repetitions]`

use std::time::{Duration, Instant};

use lmcache_coordinator::{Coordinator, CoordinatorConfig};
use lmcache_protocol::coordinator::CacheEventsRequest;
use lmcache_protocol::coordinator_binary;
use lmcache_protocol::coordinator_borrowed::{CacheEventsBody, DirectoryLookupBody, decode_body};
use lmcache_protocol::coordinator_write::lookup_answer_json;

fn h(parts: &[u64]) -> String {
    let mut x = blake3::Hasher::new();
    for p in parts {
        x.update(&p.to_le_bytes());
    }
    x.finalize().to_hex().to_string()
}

fn bodies() -> (Vec<String>, usize, Vec<String>) {
    let mut batches = Vec::new();
    let mut lookups = Vec::new();
    for w in 0..16u64 {
        for s in 0..200u64 {
            let pool = (w * 7919 + s * 104_729) % 1000;
            let keys: Vec<serde_json::Value> = (0..64u64)
                .map(|i| {
                    let k = if i < 16 { h(&[1, pool, i]) } else { h(&[2, w, s, i]) };
                    serde_json::json!({"chunk_hash_hex": k, "model_name": "m",
                        "kv_rank": 16777472, "object_group_id": 0, "cache_salt": ""})
                })
                .collect();
            if (w * 200 + s) % 97 == 0 {
                lookups.push(serde_json::to_string(&serde_json::json!({"keys": keys})).unwrap());
            }
            let entries: Vec<serde_json::Value> = keys
                .into_iter()
                .map(|k| serde_json::json!({"key": k, "size_bytes": 33554432}))
                .collect();
            batches.push(serde_json::json!({"instance_id": format!("server-{w}"),
                "incarnation": 1, "seq": s + 1, "event_type": "store", "tier": "l1",
                "backend": "dram", "shared": false, "ts": 1.0, "entries": entries}));
        }
    }
    let n = batches.len() * 64;
    let out = batches
        .chunks(16)
        .map(|c| serde_json::to_string(&serde_json::json!({"batches": c})).unwrap())
        .collect();
    (out, n, lookups)
}

/// A coordinator on a loopback port with its background passes off.
fn fresh_coordinator() -> Coordinator {
    Coordinator::start(CoordinatorConfig {
        host: "127.0.0.1".into(),
        port: 0,
        health_check_interval: Duration::ZERO,
        eviction_check_interval: Duration::ZERO,
        ..CoordinatorConfig::default()
    })
    .unwrap()
}

fn main() {
    let reps: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(7);
    let (bodies, events, lookups) = bodies();
    let bytes: usize = bodies.iter().map(String::len).sum();
    let (mut decode, mut ingest) = (Vec::new(), Vec::new());
    let (mut in_place_decode, mut in_place_ingest) = (Vec::new(), Vec::new());
    // The same batches in the JetStream feed's binary layout, one message per batch as the
    // servers publish them.
    let messages: Vec<Vec<u8>> = bodies
        .iter()
        .flat_map(|b| serde_json::from_str::<CacheEventsRequest>(b).unwrap().batches)
        .map(|b| coordinator_binary::encode(std::slice::from_ref(&b)).unwrap())
        .collect();
    let message_bytes: usize = messages.iter().map(Vec::len).sum();
    let (mut bin_decode, mut bin_total) = (Vec::new(), Vec::new());
    let mut lookup_us = Vec::new();
    for rep in 0..reps {
        let c = fresh_coordinator();
        let (mut d, mut i) = (Duration::ZERO, Duration::ZERO);
        for b in &bodies {
            let t = Instant::now();
            let req: CacheEventsRequest = serde_json::from_str(b).unwrap();
            d += t.elapsed();
            let t = Instant::now();
            c.fleet().ingest(&req.batches).unwrap();
            i += t.elapsed();
            drop(req);
        }
        decode.push(d.as_nanos() as f64 / events as f64);
        ingest.push(i.as_nanos() as f64 / events as f64);
        let p = fresh_coordinator();
        let (mut d, mut i) = (Duration::ZERO, Duration::ZERO);
        for b in &bodies {
            let t = Instant::now();
            let req: CacheEventsBody<'_> = decode_body(b).unwrap();
            d += t.elapsed();
            let t = Instant::now();
            p.fleet().ingest_borrowed(&req.batches).unwrap();
            i += t.elapsed();
            drop(req);
        }
        in_place_decode.push(d.as_nanos() as f64 / events as f64);
        in_place_ingest.push(i.as_nanos() as f64 / events as f64);
        let t = Instant::now();
        for m in &messages {
            std::hint::black_box(coordinator_binary::decode(m).unwrap());
        }
        bin_decode.push(t.elapsed().as_nanos() as f64 / events as f64);
        let b = fresh_coordinator();
        let t = Instant::now();
        for m in &messages {
            b.fleet().ingest_binary(m).unwrap();
        }
        bin_total.push(t.elapsed().as_nanos() as f64 / events as f64);
        if rep == 0 {
            for n in 0..2000 {
                let body = &lookups[n % lookups.len()];
                let t = Instant::now();
                let req: DirectoryLookupBody<'_> = serde_json::from_str(body).unwrap();
                let answers = c.fleet().lookup_answers(&req.keys).unwrap();
                let out = lookup_answer_json(64, &req.keys, &answers);
                std::hint::black_box(out);
                lookup_us.push(t.elapsed().as_nanos() as f64 / 1e3);
            }
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (d, i) = (med(&mut decode), med(&mut ingest));
    println!(
        "{events} chunk events in {} bodies ({:.0} bytes per event), owned types: decode {d:.0} ns, ingest {i:.0} ns, total {:.0} ns per event ({:.2} M events/s on one core)",
        bodies.len(),
        bytes as f64 / events as f64,
        d + i,
        1e3 / (d + i)
    );
    let (d, i) = (med(&mut in_place_decode), med(&mut in_place_ingest));
    println!(
        "the same decoded in place (POST /events): decode {d:.0} ns, ingest {i:.0} ns, total {:.0} ns per event ({:.2} M events/s on one core)",
        d + i,
        1e3 / (d + i)
    );
    let (bd, bt) = (med(&mut bin_decode), med(&mut bin_total));
    println!(
        "binary JetStream messages ({:.0} bytes per event): decode {bd:.0} ns, decode + ingest {bt:.0} ns per event ({:.2} M events/s on one core)",
        message_bytes as f64 / events as f64,
        1e3 / bt
    );
    let l = med(&mut lookup_us);
    println!(
        "/directory/lookup of 64 keys, server side (decode, lookup, encode): {l:.1} us median"
    );
}
