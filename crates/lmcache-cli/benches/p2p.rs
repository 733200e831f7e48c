//! P2P retrieve from a peer over loopback, end to end: LMCache's default bench request (1024
//! tokens, 32 layers, 8 heads, head size 128, fp16: four 32 MiB chunk objects, 128 MiB) stored
//! on one server through its engine-driven store (prepare_store, copy, commit_store), then looked up and retrieved on another that never stored it, both in this
//! process with our coordinator between them. The reader's lookup includes the fetch (RPCs,
//! the native channel, verification, commit); its retrieve is prepare_retrieve, the client's
//! copy of the 128 MiB out of the shared pool, and commit_retrieve. Then a lookup of a prompt
//! no peer holds on the reader, against the same lookup on a server without P2P, and a plain
//! loopback TCP transfer of the same bytes. Medians of 10 rounds (a new prompt each).
//! Run: `cargo bench -p lmcache-cli --bench p2p`; over NIXL (LMCache's channel, the wheel's
//! library found as the server finds it): `LMCACHE_RS_BENCH_P2P_ENGINE=nixl cargo bench ...`.
//! The native channel reads a peer on this host out of its pool segment; over TCP instead:
//! `LMCACHE_RS_BENCH_P2P_SAME_HOST=false`.
#![expect(clippy::expect_used, reason = "a benchmark binary: any failure should abort it")]

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use lmcache_client::{CacheKey, Client};
use lmcache_coordinator::{Coordinator, CoordinatorConfig};
use lmcache_core::{Dtype, ModelName};
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_protocol::types::EngineDrivenRegistration;
use lmcache_server::fleet_report::{CoordinatorReporting, ReportTransport};
use lmcache_server::{Server, ServerConfig};

const CHUNK: usize = 256;
const CHUNKS: usize = 4;
const LAYERS: u64 = 32;
const HIDDEN: u64 = 8 * 128;
const OBJECT: u64 = 2 * LAYERS * CHUNK as u64 * HIDDEN * 2;
const ROUNDS: usize = 10;

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").to_string()
}

fn server(tag: &str, coordinator: Option<&Coordinator>) -> Server {
    let arena = ArenaConfig {
        size: 1 << 30,
        backing: ArenaBacking::SharedMemory {
            name: format!("lmcache_rs_bench_p2p_{tag}_{}", std::process::id()),
        },
        mlock: false,
    };
    let mut config = ServerConfig { http_port: Some(0), ..ServerConfig::local(arena) };
    if let Some(c) = coordinator {
        let advertise = free_addr();
        config.p2p_channel = Some(advertise.parse().expect("addr"));
        config.p2p_engine = engine();
        config.p2p_same_host = same_host();
        config.coordinator = Some(CoordinatorReporting {
            url: format!("http://{}/", c.addr()),
            instance_id: tag.into(),
            advertise_ip: "127.0.0.1".into(),
            heartbeat_interval: Duration::from_millis(200),
            event_reporting: false,
            flush_interval: Duration::from_secs(1),
            transport: ReportTransport::Http,
            auth_token: None,
            p2p_advertised_url: Some(advertise),
        });
    }
    Server::start(config).expect("server")
}

/// The channel: native unless `LMCACHE_RS_BENCH_P2P_ENGINE=nixl`.
/// The native channel's same-host path: on unless `LMCACHE_RS_BENCH_P2P_SAME_HOST=false`.
fn same_host() -> bool {
    std::env::var("LMCACHE_RS_BENCH_P2P_SAME_HOST").as_deref() != Ok("false")
}

fn engine() -> lmcache_server::config::P2pEngine {
    match std::env::var("LMCACHE_RS_BENCH_P2P_ENGINE").as_deref() {
        Ok("nixl") => lmcache_server::config::P2pEngine::Nixl {
            library: lmcache_nixl::locate(None, "python3").expect("the nixl wheel"),
        },
        _ => lmcache_server::config::P2pEngine::Native,
    }
}

fn registration(id: u64) -> EngineDrivenRegistration {
    EngineDrivenRegistration {
        instance_id: id,
        model_name: ModelName::new("bench").expect("model"),
        world_size: 1,
        block_size: 16,
        num_layers: LAYERS,
        hidden_dim_size: HIDDEN,
        dtype: Dtype::Float16,
        use_mla: false,
        num_physical_slots: None,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn tokens(round: usize) -> Vec<u32> {
    (0..(CHUNK * CHUNKS) as u32).map(|i| i ^ ((round as u32 + 1) << 20)).collect()
}

fn main() {
    let coordinator = Coordinator::start(CoordinatorConfig {
        host: "127.0.0.1".into(),
        port: 0,
        ..CoordinatorConfig::default()
    })
    .expect("coordinator");
    let holder = server("holder", Some(&coordinator));
    let reader = server("reader", Some(&coordinator));
    let plain = server("plain", None);
    let t = Instant::now();
    while !ureq::get(&format!("http://{}/status", reader.http_addr().expect("http")))
        .call()
        .expect("status")
        .body_mut()
        .read_to_string()
        .expect("body")
        .contains("\"holder\"")
    {
        assert!(t.elapsed() < Duration::from_secs(20), "the reader never saw the holder");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut h = Client::connect(holder.endpoint(), Duration::from_secs(30)).expect("client");
    let pool = h.register_engine_driven(&registration(1)).expect("register");
    let hpool = ForeignSegment::open(&pool.shm_name, pool.pool_size).expect("pool");
    let mut r = Client::connect(reader.endpoint(), Duration::from_secs(30)).expect("client");
    let pool = r.register_engine_driven(&registration(2)).expect("register");
    let rpool = ForeignSegment::open(&pool.shm_name, pool.pool_size).expect("pool");
    let mut p = Client::connect(plain.endpoint(), Duration::from_secs(30)).expect("client");
    p.register_engine_driven(&registration(3)).expect("register");
    let model = ModelName::new("bench").expect("model");

    let (mut lookups, mut retrieves, mut misses, mut local_misses) =
        (vec![], vec![], vec![], vec![]);
    let mut buf = vec![0u8; OBJECT as usize];
    for round in 0..=ROUNDS {
        let toks = tokens(round);
        // Stored as an engine stores: prepare_store, the engine's copy into the holder's
        // pool, commit_store (storage's commit, with everything it announces).
        let stored = CacheKey::whole(model.clone(), &format!("s{round}"), toks.clone(), CHUNK);
        for (i, s) in h.prepare_store(&stored.for_worker(0), 1).expect("prepare store") {
            buf[..s.length as usize].fill(i as u8 + round as u8);
            hpool.write(s.offset, &buf[..s.length as usize]).expect("copy in");
        }
        assert!(h.commit_store(&stored.for_worker(0), 1).expect("commit store"));
        h.end_session(&format!("s{round}")).expect("end");
        let key = CacheKey::whole(model.clone(), &format!("r{round}"), toks, CHUNK);
        let t = Instant::now();
        let hits = r.lookup(&key).expect("lookup");
        let lookup = t.elapsed().as_secs_f64();
        assert_eq!(hits, CHUNKS as u64, "the peer's prefix is a hit");
        let t = Instant::now();
        let w = key.for_worker(0);
        let slots = r.prepare_retrieve(&w, 2).expect("prepare").expect("slots");
        for s in &slots {
            rpool.read(s.offset, &mut buf[..s.length as usize]).expect("copy");
        }
        assert!(r.commit_retrieve(&w, 2).expect("commit"));
        let retrieve = t.elapsed().as_secs_f64();
        r.end_session(&format!("r{round}")).expect("end");
        // A prompt nobody holds: the reader asks its peer; the plain server does not.
        let none =
            CacheKey::whole(model.clone(), &format!("m{round}"), tokens(1000 + round), CHUNK);
        let t = Instant::now();
        assert_eq!(r.lookup(&none).expect("lookup"), 0);
        let miss = t.elapsed().as_secs_f64();
        let t = Instant::now();
        assert_eq!(p.lookup(&none).expect("lookup"), 0);
        let local = t.elapsed().as_secs_f64();
        if round > 0 {
            lookups.push(lookup);
            retrieves.push(retrieve);
            misses.push(miss);
            local_misses.push(local);
        }
        // Room for the next round.
        holder.state().l1().clear(true);
        reader.state().l1().clear(true);
    }
    // Plain loopback TCP of the same 128 MiB.
    let total = OBJECT as usize * CHUNKS;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let payload = vec![7u8; total];
    let sender = std::thread::spawn(move || {
        for _ in 0..=ROUNDS {
            let (mut c, _) = listener.accept().expect("accept");
            c.write_all(&payload).expect("send");
        }
    });
    let mut into = vec![0u8; total];
    let mut tcp = vec![];
    for round in 0..=ROUNDS {
        let t = Instant::now();
        std::net::TcpStream::connect(addr).expect("connect").read_exact(&mut into).expect("recv");
        if round > 0 {
            tcp.push(t.elapsed().as_secs_f64());
        }
    }
    sender.join().expect("sender");
    let (l, rt, m, lm, tc) =
        (median(lookups), median(retrieves), median(misses), median(local_misses), median(tcp));
    println!(
        "P2P ({:?}, same-host path {}) from a peer over loopback, {CHUNKS} x {} MiB (1024 tokens, LMCache's default model), median of {ROUNDS}:",
        engine(),
        if same_host() { "on" } else { "off" },
        OBJECT >> 20
    );
    println!(
        "  reader lookup (fetch included)   {:8.1} ms   vs LMCache's pair 73 ms: {:.1}x",
        l * 1e3,
        0.073 / l
    );
    println!(
        "  reader retrieve (copy included)  {:8.1} ms   vs LMCache's pair 236 ms: {:.1}x",
        rt * 1e3,
        0.236 / rt
    );
    println!(
        "  plain loopback TCP, 128 MiB      {:8.1} ms   lookup / TCP: {:.2}x",
        tc * 1e3,
        l / tc
    );
    println!("  miss, peers asked                {:8.3} ms", m * 1e3);
    println!(
        "  miss, no P2P                     {:8.3} ms   difference {:+.3} ms",
        lm * 1e3,
        (m - lm) * 1e3
    );
}
