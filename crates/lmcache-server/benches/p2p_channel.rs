//! The native P2P channel against a plain loopback TCP transfer of the same bytes: LMCache's
//! default bench request (1024 tokens, 32 layers, 8 heads, head size 128, fp16: four 32 MiB
//! chunk objects, 128 MiB) locked on one in-process server and fetched into another's L1
//! reservations, verified (xxh3-64 on both sides, piece by piece as the bytes go). Also the channel's lookup half: the
//! `p2p_lookup_and_lock` + `p2p_query_lookup_results` round trip for four keys, and for four
//! keys the peer does not hold. Medians of 10 rounds after one warm-up, one run.
//! Run: `cargo bench -p lmcache-server --bench p2p_channel`.
#![expect(clippy::expect_used, reason = "a benchmark binary: any failure should abort it")]

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use lmcache_client::Client;
use lmcache_core::ObjectKey;
use lmcache_l1::WriteRequest;
use lmcache_memory::{ArenaBacking, ArenaConfig};
use lmcache_protocol::request::{Command, P2pLookupAndLock, P2pUnlockObjects};
use lmcache_protocol::types::{LayoutDesc, WireObjectKey};
use lmcache_server::{Server, ServerConfig};

const OBJECT: u64 = 2 * 32 * 256 * 1024 * 2;
const CHUNKS: usize = 4;
const ROUNDS: usize = 10;

fn server(channel: bool) -> Server {
    let arena = ArenaConfig { size: 1 << 30, backing: ArenaBacking::Anonymous, mlock: false };
    let mut config = ServerConfig::local(arena);
    if channel {
        config.p2p_channel = Some("127.0.0.1:0".parse().expect("addr"));
    }
    Server::start(config).expect("server")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn layout() -> Vec<(u32, LayoutDesc)> {
    vec![(0, LayoutDesc { shapes: vec![vec![2, 32, 256, 1024]], dtypes: vec!["float16".into()] })]
}

/// Lock `keys` on the peer (lookup and its answer); returns the hits.
fn lock(c: &mut Client, keys: &[ObjectKey]) -> usize {
    let req = P2pLookupAndLock {
        keys: keys.iter().cloned().map(|k| WireObjectKey(Some(k))).collect(),
        group_layout_descs: layout(),
    };
    let task = c.send(&Command::P2pLookupAndLock(req)).expect("lookup").expect("task");
    let task = task.as_u64().expect("task id");
    let answer = c.send(&Command::P2pQueryLookupResults(task)).expect("query").expect("answer");
    answer
        .as_array()
        .expect("addresses")
        .iter()
        .filter(|a| a.as_map().is_some_and(|m| m[0].1.as_i64().is_some_and(|o| o >= 0)))
        .count()
}

fn unlock(c: &mut Client, keys: &[ObjectKey]) {
    let keys = keys.iter().cloned().map(|k| WireObjectKey(Some(k))).collect();
    c.send(&Command::P2pUnlockObjects(P2pUnlockObjects { keys })).expect("unlock");
}

/// Plain loopback TCP: `bytes` sent by one thread, received into a reused buffer.
fn plain_tcp(bytes: &[u8]) -> f64 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let payload = bytes.to_vec();
    let sender = std::thread::spawn(move || {
        for _ in 0..=ROUNDS {
            let (mut conn, _) = listener.accept().expect("accept");
            conn.write_all(&payload).expect("send");
        }
    });
    let mut buf = vec![0u8; bytes.len()];
    let mut times = Vec::new();
    for round in 0..=ROUNDS {
        let t = Instant::now();
        let mut conn = std::net::TcpStream::connect(addr).expect("connect");
        conn.read_exact(&mut buf).expect("receive");
        if round > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    sender.join().expect("sender");
    median(times)
}

fn main() {
    let peer = server(true);
    let reader = server(false);
    let keys: Vec<ObjectKey> = (0..CHUNKS as u8)
        .map(|i| ObjectKey::new([i + 1; 32], "m", 1, 0, 0, "").expect("key"))
        .collect();
    let mut fill = 1u8;
    for k in &keys {
        let mut w = peer
            .state()
            .l1()
            .reserve_write(&[WriteRequest::new(k.clone(), OBJECT)])
            .pop()
            .expect("one")
            .expect("reserved");
        for (i, b) in w.as_mut_slice().iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(fill);
        }
        fill = fill.wrapping_add(2);
        w.commit().expect("commit");
    }
    let mut c = Client::connect(peer.endpoint(), Duration::from_secs(10)).expect("client");
    let addr = peer.p2p_channel_addr().expect("channel");
    let total = OBJECT * CHUNKS as u64;

    let mut channel = Vec::new();
    for round in 0..=ROUNDS {
        assert_eq!(lock(&mut c, &keys), CHUNKS);
        let reqs: Vec<_> = keys.iter().map(|k| WriteRequest::new(k.clone(), OBJECT)).collect();
        let into: Vec<_> = reader
            .state()
            .l1()
            .reserve_write(&reqs)
            .into_iter()
            .map(|r| r.expect("reserved"))
            .collect();
        let t = Instant::now();
        let got = lmcache_server::p2p_channel::fetch(addr, into, Duration::from_secs(30));
        let dt = t.elapsed().as_secs_f64();
        assert!(got.iter().all(Result::is_ok), "a fetch failed");
        drop(got);
        unlock(&mut c, &keys);
        if round > 0 {
            channel.push(dt);
        }
    }
    let channel = median(channel);
    let mut all = vec![0u8; total as usize];
    for (i, b) in all.iter_mut().enumerate() {
        *b = i as u8;
    }
    let plain = plain_tcp(&all);
    let hash = {
        let mut v = Vec::new();
        for _ in 0..ROUNDS {
            let t = Instant::now();
            std::hint::black_box(twox_hash::XxHash3_64::oneshot(&all));
            v.push(t.elapsed().as_secs_f64());
        }
        median(v)
    };

    let lookup = |keys: &[ObjectKey], c: &mut Client| {
        let mut v = Vec::new();
        for _ in 0..200 {
            let t = Instant::now();
            let hits = lock(c, keys);
            v.push(t.elapsed().as_secs_f64() * 1e3);
            if hits > 0 {
                unlock(c, keys);
            }
        }
        median(v)
    };
    let hit_ms = lookup(&keys, &mut c);
    let absent: Vec<ObjectKey> = (0..CHUNKS as u8)
        .map(|i| ObjectKey::new([0xa0 + i; 32], "m", 1, 0, 0, "").expect("key"))
        .collect();
    let miss_ms = lookup(&absent, &mut c);

    let gbs = |s: f64| total as f64 / s / 1e9;
    println!(
        "P2P native channel, {CHUNKS} objects of {} MiB ({} MiB), median of {ROUNDS}:",
        OBJECT >> 20,
        total >> 20
    );
    println!("  channel fetch (verified)  {:8.1} ms  {:5.2} GB/s", channel * 1e3, gbs(channel));
    println!("  plain loopback TCP        {:8.1} ms  {:5.2} GB/s", plain * 1e3, gbs(plain));
    println!("  channel / plain           {:8.2}x", channel / plain);
    println!(
        "  xxh3-64 of {} MiB (1 side) {:8.1} ms  {:5.2} GB/s",
        total >> 20,
        hash * 1e3,
        gbs(hash)
    );
    println!("  lookup+answer, 4 held     {hit_ms:8.3} ms (median of 200)");
    println!("  lookup+answer, 4 absent   {miss_ms:8.3} ms (median of 200)");
}
