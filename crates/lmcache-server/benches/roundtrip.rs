//! Lookup + query_prefetch_status round trip from the Rust client over ZMQ TCP on 127.0.0.1,
//! against an in-process server whose L1 holds the prompt: the scheduler's per-request cost.
//! Prompts of 2 to 128 chunks (256 tokens each), all hits; p50 and p99 of 2000 round trips.
//! Target: <= 200 us p50 for 2 chunks, growing linearly.
//! Then the cost of observability: 2-chunk lookups with the event bus and KV event log on and
//! off (`--disable-observability`), alternating servers, 3 rounds; and the cost of "why was
//! this a miss?": 128-chunk lookups that miss every chunk (each one judged) and 2-chunk hits,
//! with `--explain-requests` 1024 and 0, alternating servers, 3 rounds.
//! Run: `cargo bench -p lmcache-server --bench roundtrip`.
#![expect(clippy::expect_used, reason = "a benchmark binary: any failure should abort it")]

use std::time::{Duration, Instant};

use lmcache_client::{CacheKey, Client};
use lmcache_core::{Dtype, ModelName};
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_protocol::types::EngineDrivenRegistration;
use lmcache_server::{Server, ServerConfig};

fn model_m() -> ModelName {
    ModelName::new("m").expect("model name")
}

/// An engine-driven registration of model `m` (float16, objects of one chunk).
fn registration(
    instance_id: u64,
    world_size: u32,
    block_size: u64,
    num_layers: u64,
    hidden_dim_size: u64,
) -> EngineDrivenRegistration {
    EngineDrivenRegistration {
        instance_id,
        model_name: model_m(),
        world_size,
        block_size,
        num_layers,
        hidden_dim_size,
        dtype: Dtype::Float16,
        use_mla: false,
        num_physical_slots: None,
    }
}

fn main() {
    let arena = ArenaConfig {
        size: 1 << 30,
        backing: ArenaBacking::SharedMemory {
            name: format!("lmcache_rs_rt_{}", std::process::id()),
        },
        mlock: false,
    };
    let cfg = ServerConfig { worker_reap_timeout: Duration::ZERO, ..ServerConfig::local(arena) };
    let server = Server::start(cfg).expect("server");
    let mut c = Client::connect(server.endpoint(), Duration::from_secs(5)).expect("client");
    // Small objects: the cost measured is the protocol and the index, not memory.
    let r = c.register_engine_driven(&registration(1, 1, 16, 1, 8)).expect("register");
    let pool = ForeignSegment::open(&r.shm_name, r.pool_size).expect("pool");
    // The floor: one noop round trip through the same client, socket and server thread.
    let mut noop = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let t = Instant::now();
        c.call(lmcache_protocol::Op::Noop, &[]).expect("noop");
        noop.push(t.elapsed().as_secs_f64() * 1e6);
    }
    noop.sort_by(f64::total_cmp);
    println!(
        "noop round trip (transport floor): p50 {:.1} us, p99 {:.1} us",
        noop[1000], noop[1980]
    );
    println!("lookup + query_prefetch_status = 2 round trips:");
    println!("{:>8} {:>10} {:>10} {:>12}", "chunks", "p50_us", "p99_us", "us/chunk");
    for chunks in [2usize, 8, 32, 128] {
        let tokens: Vec<u32> = (0..(chunks * 256) as u32).map(|t| t.wrapping_mul(7919)).collect();
        let key = CacheKey::whole(model_m(), "warm", tokens.clone(), 256);
        for (_, s) in c.prepare_store(&key.for_worker(0), 1).expect("prepare") {
            pool.write(s.offset, &vec![1u8; s.length as usize]).expect("write");
        }
        assert!(c.commit_store(&key.for_worker(0), 1).expect("commit"));
        let mut times = Vec::with_capacity(2000);
        for i in 0..2000 {
            // A new request id each time: every lookup hashes the prompt from scratch.
            let k = CacheKey { request_id: format!("q{i}"), ..key.clone() };
            let t = Instant::now();
            let hits = c.lookup(&k).expect("lookup");
            times.push(t.elapsed().as_secs_f64() * 1e6);
            assert_eq!(hits as usize, chunks);
            c.end_session(&k.request_id).expect("end");
        }
        times.sort_by(f64::total_cmp);
        let p50 = times[times.len() / 2];
        let p99 = times[times.len() * 99 / 100];
        println!("{chunks:>8} {p50:>10.1} {p99:>10.1} {:>12.2}", p50 / chunks as f64);
    }
    drop(c);
    drop(server);
    println!("observability on vs off, 2-chunk lookup + query, p50 of 2000:");
    for round in 1..=3 {
        let mut row = Vec::new();
        for on in [true, false] {
            row.push(lookup_p50(on, round));
        }
        println!(
            "  round {round}: on {:.1} us, off {:.1} us, on/off {:.3}",
            row[0],
            row[1],
            row[0] / row[1]
        );
    }
    println!("explain on vs off (--explain-requests 1024 / 0), lookup + query, p50 of 2000:");
    for round in 1..=3 {
        for (chunks, stored, what) in [(128, false, "128-chunk misses"), (2, true, "2-chunk hits")]
        {
            let on = explain_p50(true, round, chunks, stored);
            let off = explain_p50(false, round, chunks, stored);
            println!(
                "  round {round}, {what}: on {on:.1} us, off {off:.1} us, on/off {:.3}",
                on / off
            );
        }
    }
}

/// p50 of `chunks`-chunk lookups with the explainer on or off: misses (`stored` false: every
/// chunk judged), or hits.
fn explain_p50(on: bool, round: u32, chunks: usize, stored: bool) -> f64 {
    let arena = ArenaConfig {
        size: 64 << 20,
        backing: ArenaBacking::SharedMemory {
            name: format!("lmcache_rs_rt_x_{on}_{round}_{chunks}_{}", std::process::id()),
        },
        mlock: false,
    };
    let cfg =
        ServerConfig { explain_requests: if on { 1024 } else { 0 }, ..ServerConfig::local(arena) };
    let server = Server::start(cfg).expect("server");
    let mut c = Client::connect(server.endpoint(), Duration::from_secs(5)).expect("client");
    let r = c.register_engine_driven(&registration(1, 1, 16, 1, 8)).expect("register");
    let pool = ForeignSegment::open(&r.shm_name, r.pool_size).expect("pool");
    let tokens: Vec<u32> = (0..(chunks * 256) as u32).collect();
    let key = CacheKey::whole(model_m(), "warm", tokens, 256);
    if stored {
        for (_, s) in c.prepare_store(&key.for_worker(0), 1).expect("prepare") {
            pool.write(s.offset, &vec![1u8; s.length as usize]).expect("write");
        }
        assert!(c.commit_store(&key.for_worker(0), 1).expect("commit"));
    }
    let mut times = Vec::with_capacity(2000);
    for i in 0..2000 {
        let k = CacheKey { request_id: format!("x{i}"), ..key.clone() };
        let t = Instant::now();
        let hits = c.lookup(&k).expect("lookup");
        times.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(hits as usize, if stored { chunks } else { 0 });
        c.end_session(&k.request_id).expect("end");
    }
    times.sort_by(f64::total_cmp);
    times[1000]
}

fn lookup_p50(observability: bool, round: u32) -> f64 {
    let arena = ArenaConfig {
        size: 64 << 20,
        backing: ArenaBacking::SharedMemory {
            name: format!("lmcache_rs_rt_obs_{observability}_{round}_{}", std::process::id()),
        },
        mlock: false,
    };
    let (bus, log) = if observability { (10_000, 32_768) } else { (0, 0) };
    let cfg = ServerConfig {
        event_bus_queue_size: bus,
        kv_event_log_size: log,
        ..ServerConfig::local(arena)
    };
    let server = Server::start(cfg).expect("server");
    let mut c = Client::connect(server.endpoint(), Duration::from_secs(5)).expect("client");
    let r = c.register_engine_driven(&registration(1, 1, 16, 1, 8)).expect("register");
    let pool = ForeignSegment::open(&r.shm_name, r.pool_size).expect("pool");
    let tokens: Vec<u32> = (0..512u32).collect();
    let key = CacheKey::whole(model_m(), "warm", tokens, 256);
    for (_, s) in c.prepare_store(&key.for_worker(0), 1).expect("prepare") {
        pool.write(s.offset, &vec![1u8; s.length as usize]).expect("write");
    }
    assert!(c.commit_store(&key.for_worker(0), 1).expect("commit"));
    let mut times = Vec::with_capacity(2000);
    for i in 0..2000 {
        let k = CacheKey { request_id: format!("o{i}"), ..key.clone() };
        let t = Instant::now();
        assert_eq!(c.lookup(&k).expect("lookup"), 2);
        times.push(t.elapsed().as_secs_f64() * 1e6);
        c.end_session(&k.request_id).expect("end");
    }
    times.sort_by(f64::total_cmp);
    times[1000]
}
