//! An lmcache-rs server reporting to an lmcache-rs coordinator, both in this process:
//! registration, L1 store and removal events, deregistration at shutdown, and a coordinator
//! that is down for a while (events queue and arrive, with no gap, once it answers), and a
//! lossy path to it (1% of batches lost, a restart without deregistration) repaired to the
//! server's exact L1.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lmcache_coordinator::{Coordinator, CoordinatorConfig};
use lmcache_core::ObjectKey;
use lmcache_l1::WriteRequest;
use lmcache_memory::{ArenaBacking, ArenaConfig};
use lmcache_server::fleet_report::{CoordinatorReporting, ReportTransport};
use lmcache_server::{Server, ServerConfig};
use serde_json::{Value, json};

/// A port for a coordinator that stops and starts again on it: free now, and below the
/// kernel's ephemeral range, so that no outgoing connection of this process (the servers'
/// reports, the tests' own requests) can take it while the coordinator is down. (A port from
/// bind(0) is an ephemeral one: a restart on it once failed with EADDRINUSE.)
fn restartable_port() -> u16 {
    let start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let low = 20000.min(start.saturating_sub(1000));
    use rand::{Rng, SeedableRng};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(nanos ^ u64::from(std::process::id()));
    for _ in 0..1000 {
        let port = rng.gen_range(low..start);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {low}..{start}");
}

fn coordinator(port: u16) -> Coordinator {
    Coordinator::start(CoordinatorConfig {
        host: "127.0.0.1".into(),
        port,
        ..CoordinatorConfig::default()
    })
    .unwrap()
}

/// Reporting to the coordinator on `coordinator_port` as `id`: heartbeats every 100 ms,
/// events flushed every 50 ms over HTTP, no token, no P2P.
fn reporting(coordinator_port: u16, id: &str) -> CoordinatorReporting {
    CoordinatorReporting {
        url: format!("http://127.0.0.1:{coordinator_port}/"),
        instance_id: id.into(),
        advertise_ip: "127.0.0.1".into(),
        heartbeat_interval: Duration::from_millis(100),
        event_reporting: true,
        flush_interval: Duration::from_millis(50),
        transport: ReportTransport::Http,
        auth_token: None,
        p2p_advertised_url: None,
    }
}

fn server(coordinator_port: u16, id: &str) -> Server {
    let arena = ArenaConfig { size: 16 << 20, backing: ArenaBacking::Anonymous, mlock: false };
    Server::start(ServerConfig {
        http_port: Some(0),
        coordinator: Some(reporting(coordinator_port, id)),
        ..ServerConfig::local(arena)
    })
    .unwrap()
}

fn key(b: u8) -> ObjectKey {
    ObjectKey::new([b; 32], "m", 1, 0, 0, "").unwrap()
}

fn store(s: &Server, keys: &[u8]) {
    let reqs: Vec<WriteRequest> = keys.iter().map(|&b| WriteRequest::new(key(b), 4096)).collect();
    let res: Vec<_> = s.state().l1().reserve_write(&reqs).into_iter().map(Result::unwrap).collect();
    for r in s.state().l1().commit_batch(res) {
        r.unwrap();
    }
}

fn get(c: &Coordinator, path: &str) -> Value {
    let mut r = ureq::get(&format!("http://{}{path}", c.addr())).call().unwrap();
    serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap()
}

fn placed_on(c: &Coordinator, b: u8) -> Vec<String> {
    let body = json!({"keys": [{"chunk_hash_hex": format!("{b:02x}").repeat(32), "model_name": "m", "kv_rank": 0x0100_0100}]});
    let mut r =
        ureq::post(&format!("http://{}/directory/lookup", c.addr())).send_json(body).unwrap();
    let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
    v["results"][0]["placements"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["instance_id"].as_str().unwrap().to_string())
        .collect()
}

fn until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_server_registers_reports_its_l1_and_deregisters_at_shutdown() {
    let c = coordinator(0);
    let s = server(c.addr().port(), "rs-1");
    until("registered", || {
        get(&c, "/instances")["instances"].as_array().is_some_and(|a| a.len() == 1)
    });
    let inst = &get(&c, "/instances")["instances"][0];
    assert_eq!(inst["instance_id"], "rs-1");
    assert_eq!(inst["http_port"], s.http_addr().unwrap().port());
    store(&s, &[1, 2, 3]);
    until("stores placed", || (1..=3).all(|b| placed_on(&c, b) == ["rs-1"]));
    s.state().l1().delete(&[key(2)], true);
    until("delete reported", || placed_on(&c, 2).is_empty());
    let usage = get(&c, "/instances/rs-1/usage");
    assert_eq!(usage["declared_capacity"], true, "{usage}");
    assert_eq!(usage["modules"][0]["capacity_bytes"], 16 << 20);
    assert_eq!(usage["modules"][0]["used_bytes"], 2 * 4096);
    s.shutdown();
    assert_eq!(get(&c, "/instances")["instances"], json!([]), "deregistered at shutdown");
    assert!(placed_on(&c, 1).is_empty(), "and its L1 fenced");
}

#[test]
fn a_server_with_the_coordinators_token_registers_reports_and_deregisters_through_its_guard() {
    let c = Coordinator::start(CoordinatorConfig {
        host: "127.0.0.1".into(),
        port: 0,
        auth_token: Some("coord-token".into()),
        ..CoordinatorConfig::default()
    })
    .unwrap();
    let start = |token: Option<&str>, id: &str| {
        let arena = ArenaConfig { size: 16 << 20, backing: ArenaBacking::Anonymous, mlock: false };
        Server::start(ServerConfig {
            http_port: Some(0),
            coordinator: Some(CoordinatorReporting {
                auth_token: token.map(str::to_owned),
                ..reporting(c.addr().port(), id)
            }),
            ..ServerConfig::local(arena)
        })
        .unwrap()
    };
    let without = start(None, "no-token");
    let with = start(Some("coord-token"), "with-token");
    until("the server with the token registered", || {
        get(&c, "/instances")["instances"].as_array().is_some_and(|a| a.len() == 1)
    });
    store(&with, &[7]);
    until("its events accepted", || placed_on(&c, 7) == ["with-token"]);
    std::thread::sleep(Duration::from_millis(500));
    let ids: Vec<Value> = get(&c, "/instances")["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["instance_id"].clone())
        .collect();
    assert_eq!(ids, [json!("with-token")], "the server without the token was refused");
    without.shutdown();
    with.shutdown();
    assert_eq!(get(&c, "/instances")["instances"], json!([]), "deregistered with the token");
}

#[test]
fn p2p_servers_find_each_other_through_the_coordinator_and_drop_a_peer_that_left() {
    let c = coordinator(0);
    let start = |id: &str| {
        let arena = ArenaConfig { size: 16 << 20, backing: ArenaBacking::Anonymous, mlock: false };
        let channel: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        Server::start(ServerConfig {
            http_port: Some(0),
            p2p_channel: Some(channel),
            coordinator: Some(CoordinatorReporting {
                p2p_advertised_url: Some(format!("127.0.0.1:76{}", id.len())),
                ..reporting(c.addr().port(), id)
            }),
            ..ServerConfig::local(arena)
        })
        .unwrap()
    };
    let servers = [start("p-a"), start("p-bb"), start("p-ccc")];
    let status = |s: &Server| {
        let url = format!("http://{}/status", s.http_addr().unwrap());
        let mut r = ureq::get(&url).call().unwrap();
        serde_json::from_str::<Value>(&r.body_mut().read_to_string().unwrap()).unwrap()
    };
    let peer_ids = |s: &Server| -> Vec<String> {
        status(s)["p2p_peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["instance_id"].as_str().unwrap().to_owned())
            .collect()
    };
    until("every server sees the two others", || {
        servers.iter().all(|s| status(s)["p2p_state"] == "registered" && peer_ids(s).len() == 2)
    });
    assert_eq!(peer_ids(&servers[0]), ["p-bb", "p-ccc"]);
    // The registration carries the MP port peers call and the advertised channel.
    let st = status(&servers[0]);
    let bb =
        st["p2p_peers"].as_array().unwrap().iter().find(|p| p["instance_id"] == "p-bb").unwrap();
    let port = servers[1].endpoint().rsplit(':').next().unwrap();
    assert_eq!(bb["mq_url"], format!("tcp://127.0.0.1:{port}"));
    assert_eq!(bb["p2p_advertised_url"], "127.0.0.1:764");
    assert_eq!(st["p2p_enabled"], true);
    let [a, b, leaving] = servers;
    leaving.shutdown();
    until("a peer that left is dropped after its missed polls", || {
        peer_ids(&a) == ["p-bb"] && peer_ids(&b) == ["p-a"]
    });
}

/// A P2P server of the fleet at `c`, over a shm L1 (engine-driven clients map it).
fn p2p_server(c: &Coordinator, id: &str, advertise: &str) -> Server {
    p2p_server_on(c, id, advertise, lmcache_server::config::P2pEngine::Native, 4096)
}

/// As [`p2p_server`], on `engine`, with L1 objects aligned to `align` bytes.
fn p2p_server_on(
    c: &Coordinator,
    id: &str,
    advertise: &str,
    engine: lmcache_server::config::P2pEngine,
    align: u64,
) -> Server {
    p2p_server_with(c, id, advertise, engine, align, Vec::new())
}

/// As [`p2p_server_on`], with these L2 adapters.
fn p2p_server_with(
    c: &Coordinator,
    id: &str,
    advertise: &str,
    engine: lmcache_server::config::P2pEngine,
    align: u64,
    l2_adapters: Vec<Value>,
) -> Server {
    let arena = ArenaConfig {
        size: 32 << 20,
        backing: ArenaBacking::SharedMemory {
            name: format!("lmcache_rs_fleet_p2p_{id}_{}", std::process::id()),
        },
        mlock: false,
    };
    // `advertise` comes from `free_addr`: a port another test binding at the same moment can
    // take first. Then the server binds a fresh one (a few tries), as a restart would.
    let mut advertise = advertise.to_owned();
    for attempt in 0.. {
        let started = Server::start(ServerConfig {
            http_port: Some(0),
            chunk_size: 16,
            align,
            p2p_engine: engine.clone(),
            p2p_channel: Some(advertise.parse().unwrap()),
            p2p_lookup_timeout: Duration::from_secs(3),
            p2p_load_timeout: Duration::from_secs(3),
            coordinator: Some(CoordinatorReporting {
                p2p_advertised_url: Some(advertise.clone()),
                ..reporting(c.addr().port(), id)
            }),
            l2_adapters: l2_adapters.clone(),
            ..ServerConfig::local(arena.clone())
        });
        match started {
            Err(lmcache_server::server::ServerError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::AddrInUse && attempt < 5 =>
            {
                advertise = free_addr();
            }
            other => return other.unwrap(),
        }
    }
    unreachable!()
}

#[test]
fn a_reader_with_its_own_l2_asks_the_peers_for_what_l2_lacks_and_keeps_no_unwritten_copy() {
    use lmcache_client::{CacheKey, Client};
    use lmcache_core::ModelName;
    use lmcache_memory::ForeignSegment;
    let dir = tempfile::tempdir().unwrap();
    let c = coordinator(0);
    let native = lmcache_server::config::P2pEngine::Native;
    let holder = p2p_server_on(&c, "pl1-holder", &free_addr(), native.clone(), 4096);
    let l2 = vec![json!({"type": "fs", "base_path": dir.path().join("reader-l2")})];
    let reader = p2p_server_with(&c, "pl2-reader", &free_addr(), native, 4096, l2);
    until("the reader sees its peer", || {
        let url = format!("http://{}/status", reader.http_addr().unwrap());
        ureq::get(&url).call().unwrap().body_mut().read_to_string().unwrap().contains("pl1-holder")
    });
    let key = |rid: &str| CacheKey::whole(ModelName::new("m").unwrap(), rid, (0..64).collect(), 16);
    let mut h = Client::connect(holder.endpoint(), Duration::from_secs(5)).unwrap();
    let pool = h.register_engine_driven(&engine_driven(1)).unwrap();
    let hpool = ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap();
    let mut stored = Vec::new();
    for (i, s) in h.prepare_store(&key("w"), 1).unwrap() {
        let bytes: Vec<u8> = (0..s.length).map(|j| (j as u8).wrapping_mul(7) ^ i as u8).collect();
        hpool.write(s.offset, &bytes).unwrap();
        stored.push(bytes);
    }
    assert!(h.commit_store(&key("w"), 1).unwrap());
    // The reader's L1 and L2 lack the prefix; the peer has it.
    retrieve_and_verify(&reader, &key("q"), &stored, "L2 missed, so the peer is asked");
    assert_eq!(reader.state().metrics.p2p_fetched_keys.get(), 4);
    assert_eq!(reader.state().l1().unwritten(), 0, "a peer's objects are kept from eviction");
}

/// Looks `key` up on `reader` as a new engine-driven worker (expecting all 4 chunks: `why`),
/// retrieves it and checks every chunk against `stored`, byte for byte.
fn retrieve_and_verify(
    reader: &Server,
    key: &lmcache_client::CacheKey,
    stored: &[Vec<u8>],
    why: &str,
) {
    let mut r =
        lmcache_client::Client::connect(reader.endpoint(), Duration::from_secs(10)).unwrap();
    let pool = r.register_engine_driven(&engine_driven(2)).unwrap();
    let rpool = lmcache_memory::ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap();
    assert_eq!(r.lookup(key).unwrap(), 4, "{why}");
    let slots = r.prepare_retrieve(&key.for_worker(0), 2).unwrap().expect("retrieved");
    assert_eq!(slots.len(), stored.len());
    for (i, s) in slots.iter().enumerate() {
        let mut got = vec![0u8; s.length as usize];
        rpool.read(s.offset, &mut got).unwrap();
        assert!(got == stored[i], "chunk {i} differs from what the holder stored");
    }
    assert!(r.commit_retrieve(&key.for_worker(0), 2).unwrap());
}

/// One KV event record: kind, block hash, parent hash, tokens.
type KvRecord = (String, Vec<u8>, Option<Vec<u8>>, Vec<u32>);

/// The KV event log of `s` for model "m" from its start, as `subscribe_kv_events` (worker
/// `instance`, cursor 0) hands it out in its first batch: (kind, block hash, parent, tokens).
fn kv_events(s: &Server, instance: u64) -> Vec<KvRecord> {
    use lmcache_protocol::value;
    use rmpv::Value as V;
    let c = lmcache_client::Client::connect(s.endpoint(), Duration::from_secs(5)).unwrap();
    let frames: Vec<Vec<u8>> = [
        V::from(77),
        V::from("subscribe_kv_events"),
        V::from(instance),
        V::from("m"),
        V::from(0),
        V::from(64),
    ]
    .iter()
    .map(value::encode)
    .collect();
    c.send_frames(&frames).unwrap();
    let got = c.recv_frames().unwrap().expect("the first batch at once");
    let batch = value::decode(2, &got[2]).unwrap();
    let events = value::Fields::of("batch", &batch).unwrap().req("events").unwrap();
    value::array("events", events)
        .unwrap()
        .iter()
        .map(|e| {
            let f = value::Fields::of("event", e).unwrap();
            let hashes = value::array("block_hashes", f.req("block_hashes").unwrap()).unwrap();
            (
                value::str_("kind", f.req("kind").unwrap()).unwrap().to_owned(),
                value::bin("block_hashes[0]", &hashes[0]).unwrap().to_vec(),
                value::opt(f.req("parent_block_hash").unwrap(), |v| value::bin("parent", v))
                    .unwrap()
                    .map(<[u8]>::to_vec),
                value::array("token_ids", f.req("token_ids").unwrap())
                    .unwrap()
                    .iter()
                    .map(|t| value::u32_("token", t).unwrap())
                    .collect(),
            )
        })
        .collect()
}

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

#[test]
fn a_server_serves_a_prefix_another_computed_from_its_peers_l1_byte_for_byte() {
    use lmcache_client::{CacheKey, Client};
    use lmcache_core::ModelName;
    use lmcache_memory::ForeignSegment;
    let c = Coordinator::start(CoordinatorConfig {
        host: "127.0.0.1".into(),
        port: 0,
        chunk_size: 16,
        ..CoordinatorConfig::default()
    })
    .unwrap();
    // Peers are asked in id order: the empty one first, then the one holding the prefix.
    let empty = p2p_server(&c, "p1-empty", &free_addr());
    let holder = p2p_server(&c, "p2-holder", &free_addr());
    let reader = p2p_server(&c, "p3-reader", &free_addr());
    let status = |s: &Server| {
        let url = format!("http://{}/status", s.http_addr().unwrap());
        let mut r = ureq::get(&url).call().unwrap();
        serde_json::from_str::<Value>(&r.body_mut().read_to_string().unwrap()).unwrap()
    };
    until("the reader sees both peers", || {
        status(&reader)["p2p_peers"].as_array().is_some_and(|a| a.len() == 2)
    });
    let tokens: Vec<u32> = (0..64).collect();
    let key = |rid: &str| CacheKey::whole(ModelName::new("m").unwrap(), rid, tokens.clone(), 16);
    // The holder computes the prefix (4 chunks).
    let mut h = Client::connect(holder.endpoint(), Duration::from_secs(5)).unwrap();
    let pool = h.register_engine_driven(&engine_driven(1)).unwrap();
    let hpool = ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap();
    let mut stored = Vec::new();
    for (i, s) in h.prepare_store(&key("w"), 1).unwrap() {
        let bytes: Vec<u8> = (0..s.length).map(|j| (j as u8) ^ (i as u8 * 37)).collect();
        hpool.write(s.offset, &bytes).unwrap();
        stored.push(bytes);
    }
    assert!(h.commit_store(&key("w"), 1).unwrap());
    // The reader never stored it: its lookup is a full hit through the holder.
    retrieve_and_verify(&reader, &key("q"), &stored, "the peer's prefix is a hit");
    let rm = &reader.state().metrics;
    assert_eq!((rm.p2p_fetched_keys.get(), rm.p2p_fetch_failures.get()), (4, 0));
    // On one host, with pools in segments lmcache-rs made, the bytes came straight from the
    // holder's pool (the TCP path has its own tests: tests/mp_p2p.rs in lmcache-server).
    assert_eq!(rm.p2p_fetched_same_host_keys.get(), 4);
    // Every lock the holder took for the reader was released; the empty peer was asked.
    let hm = &holder.state().metrics;
    assert_eq!((hm.p2p_served_hits.get(), hm.p2p_unlocked_keys.get()), (4, 4));
    assert_eq!(empty.state().metrics.p2p_served_keys.get(), 4);
    // The fetched chunks are the reader's own now: its KV event stream announces them, with
    // their tokens and parents, like chunks it stored itself...
    let hashes = lmcache_core::TokenHasher::new(16).unwrap().hash_tokens(&tokens);
    let events = kv_events(&reader, 2);
    assert_eq!(events.len(), 4, "one stored record per fetched chunk: {events:?}");
    for (i, (kind, hash, parent, toks)) in events.iter().enumerate() {
        assert_eq!(kind, "stored");
        assert_eq!(hash, &hashes[i].0.to_vec(), "chunk {i}'s block hash");
        assert_eq!(parent.as_deref(), i.checked_sub(1).map(|p| &hashes[p].0[..]), "chunk {i}");
        assert_eq!(toks, &tokens[i * 16..(i + 1) * 16], "chunk {i}'s tokens");
    }
    // ...and the coordinator places them there too.
    until("the reader's copies reach the directory", || {
        let body = json!({"token_ids": tokens, "model_name": "m"});
        let mut resp =
            ureq::post(&format!("http://{}/directory/lookup", c.addr())).send_json(body).unwrap();
        let v: Value = serde_json::from_str(&resp.body_mut().read_to_string().unwrap()).unwrap();
        v.to_string().contains("p3-reader")
    });
    // A prompt no peer holds is a plain miss, after asking them.
    let other: Vec<u32> = (1000..1064).collect();
    let miss = CacheKey::whole(ModelName::new("m").unwrap(), "m", other, 16);
    let mut r = Client::connect(reader.endpoint(), Duration::from_secs(10)).unwrap();
    r.register_engine_driven(&engine_driven(3)).unwrap();
    assert_eq!(r.lookup(&miss).unwrap(), 0);
}

/// NIXL from the wheel in `LMCACHE_RS_TEST_NIXL_PYTHON`'s site-packages.
fn nixl() -> Option<lmcache_server::config::P2pEngine> {
    let python = external("LMCACHE_RS_TEST_NIXL_PYTHON")?;
    let library = lmcache_nixl::locate(None, &python).unwrap();
    Some(lmcache_server::config::P2pEngine::Nixl { library })
}

/// An engine-driven worker of model "m" (2 layers, fp16, blocks of 16) registered as `id`.
fn engine_driven(id: u64) -> lmcache_protocol::types::EngineDrivenRegistration {
    lmcache_protocol::types::EngineDrivenRegistration {
        instance_id: id,
        model_name: lmcache_core::ModelName::new("m").unwrap(),
        world_size: 1,
        block_size: 16,
        num_layers: 2,
        hidden_dim_size: 32,
        dtype: lmcache_core::Dtype::Float16,
        use_mla: false,
        num_physical_slots: None,
    }
}

#[test]
fn lmcache_rs_servers_serve_each_other_over_nixl_and_refuse_a_peer_of_other_pages() {
    use lmcache_client::{CacheKey, Client};
    use lmcache_core::ModelName;
    use lmcache_memory::ForeignSegment;
    let Some(engine) = nixl() else { return };
    let c = Coordinator::start(CoordinatorConfig {
        host: "127.0.0.1".into(),
        port: 0,
        chunk_size: 16,
        ..CoordinatorConfig::default()
    })
    .unwrap();
    // Asked in id order: first a peer whose pages are 8 KiB (its page list cannot be read
    // with ours: refused at the handshake, a miss), then the holder.
    let odd = p2p_server_on(&c, "n1-odd-pages", &free_addr(), engine.clone(), 8192);
    let holder = p2p_server_on(&c, "n2-holder", &free_addr(), engine.clone(), 4096);
    let reader = p2p_server_on(&c, "n3-reader", &free_addr(), engine, 4096);
    until("the reader sees both peers", || {
        let url = format!("http://{}/status", reader.http_addr().unwrap());
        let v: Value = serde_json::from_str(
            &ureq::get(&url).call().unwrap().body_mut().read_to_string().unwrap(),
        )
        .unwrap();
        v["p2p_peers"].as_array().is_some_and(|a| a.len() == 2)
    });
    let tokens: Vec<u32> = (0..64).collect();
    let key = |rid: &str| CacheKey::whole(ModelName::new("m").unwrap(), rid, tokens.clone(), 16);
    let mut stored = Vec::new();
    for (server, reg) in [(&odd, 7), (&holder, 1)] {
        let mut h = Client::connect(server.endpoint(), Duration::from_secs(5)).unwrap();
        let pool = h.register_engine_driven(&engine_driven(reg)).unwrap();
        let hpool = ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap();
        stored.clear();
        for (i, s) in h.prepare_store(&key("w"), reg).unwrap() {
            let bytes: Vec<u8> =
                (0..s.length).map(|j| (j as u8) ^ (i as u8 * 37) ^ (reg as u8)).collect();
            hpool.write(s.offset, &bytes).unwrap();
            stored.push(bytes);
        }
        assert!(h.commit_store(&key("w"), reg).unwrap());
    }
    retrieve_and_verify(&reader, &key("q"), &stored, "the holder's prefix, over NIXL");
    let rm = &reader.state().metrics;
    assert_eq!(rm.p2p_fetched_keys.get(), 4);
    // The odd peer locked its 4 keys for us, and we unlocked them after refusing its pages.
    let om = &odd.state().metrics;
    assert_eq!((om.p2p_served_hits.get(), om.p2p_unlocked_keys.get()), (4, 4));
    assert_eq!(rm.p2p_fetch_failures.get(), 4, "the odd peer's 4 objects were refused");
    let hm = &holder.state().metrics;
    assert_eq!((hm.p2p_served_hits.get(), hm.p2p_unlocked_keys.get()), (4, 4));
}

#[test]
fn a_nixl_peer_that_died_gives_a_miss_in_bounded_time_and_leaves_nothing_behind() {
    use lmcache_client::{CacheKey, Client};
    use lmcache_core::ModelName;
    use lmcache_memory::ForeignSegment;
    let Some(engine) = nixl() else { return };
    let c = coordinator(0);
    let holder = p2p_server_on(&c, "nd1-holder", &free_addr(), engine.clone(), 4096);
    let reader = p2p_server_on(&c, "nd2-reader", &free_addr(), engine, 4096);
    until("the reader sees its peer", || {
        let url = format!("http://{}/status", reader.http_addr().unwrap());
        ureq::get(&url).call().unwrap().body_mut().read_to_string().unwrap().contains("nd1-holder")
    });
    let key = |rid: &str| CacheKey::whole(ModelName::new("m").unwrap(), rid, (0..64).collect(), 16);
    let mut h = Client::connect(holder.endpoint(), Duration::from_secs(5)).unwrap();
    let pool = h.register_engine_driven(&engine_driven(1)).unwrap();
    let hpool = ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap();
    for (_, s) in h.prepare_store(&key("w"), 1).unwrap() {
        hpool.write(s.offset, &vec![9u8; s.length as usize]).unwrap();
    }
    assert!(h.commit_store(&key("w"), 1).unwrap());
    // The holder goes before the reader's polls notice: its agent and memory are gone.
    drop((h, hpool));
    holder.shutdown();
    let mut r = Client::connect(reader.endpoint(), Duration::from_secs(10)).unwrap();
    r.register_engine_driven(&engine_driven(2)).unwrap();
    let t = Instant::now();
    assert_eq!(r.lookup(&key("q")).unwrap(), 0, "a dead peer serves nothing");
    assert!(t.elapsed() < Duration::from_secs(8), "bounded: {:?}", t.elapsed());
    let u = reader.state().l1().usage();
    assert_eq!((u.staged_objects, u.resident_objects), (0, 0), "nothing left behind");
}

/// Sends LMCache's first handshake message to a NIXL channel, as anyone could, and returns
/// the answer's type and reason.
fn forged_handshake(url: &str) -> (String, String) {
    use rmpv::Value;
    let ctx = zmq::Context::new();
    let sock = ctx.socket(zmq::REQ).unwrap();
    sock.set_rcvtimeo(10_000).unwrap();
    sock.set_linger(0).unwrap();
    sock.connect(&format!("tcp://{url}")).unwrap();
    let ask = Value::Map(vec![
        (Value::from("type"), Value::from("InitReq")),
        (Value::from("agent_name"), Value::from("stranger")),
        (Value::from("agent_meta"), Value::Binary(b"not an agent".to_vec())),
    ]);
    sock.send(lmcache_protocol::value::encode(&ask), 0).unwrap();
    let got = lmcache_protocol::value::decode(0, &sock.recv_bytes(0).unwrap()).unwrap();
    let field = |k: &str| {
        got.as_map()
            .and_then(|m| m.iter().find(|(n, _)| n.as_str() == Some(k)))
            .and_then(|(_, v)| v.as_str())
            .unwrap_or_default()
            .to_owned()
    };
    (field("type"), field("reason"))
}

#[test]
fn a_nixl_handshake_from_a_host_no_peer_registered_is_refused_and_counted() {
    let Some(engine) = nixl() else { return };
    let c = coordinator(0);
    let alone = free_addr();
    let server = p2p_server_on(&c, "nh1-alone", &alone, engine.clone(), 4096);
    until("registered", || {
        let url = format!("http://{}/status", server.http_addr().unwrap());
        let body = ureq::get(&url).call().unwrap().body_mut().read_to_string().unwrap();
        serde_json::from_str::<Value>(&body).unwrap()["p2p_state"] == "registered"
    });
    // No peer in the fleet: a stranger (on loopback, as the test is) gets no agent metadata
    // and no page list, after a bounded wait for a discovery poll.
    let t = Instant::now();
    let (kind, reason) = forged_handshake(&alone);
    assert_eq!(kind, "Error", "a stranger was answered: {reason}");
    assert!(reason.contains("127.0.0.1 is no registered peer"), "{reason}");
    assert!(t.elapsed() < Duration::from_secs(8), "bounded: {:?}", t.elapsed());
    assert_eq!(server.state().metrics.p2p_handshakes_refused.get(), 1);
    // Once a server on this host registered as a peer, this host passes the gate (the
    // forged metadata is then refused by NIXL itself, not by the gate).
    let _peer = p2p_server_on(&c, "nh2-peer", &free_addr(), engine, 4096);
    let (kind, reason) = forged_handshake(&alone);
    assert_eq!(kind, "Error");
    assert!(!reason.contains("no registered peer"), "a registered host was refused: {reason}");
    assert_eq!(server.state().metrics.p2p_handshakes_refused.get(), 1);
}

#[test]
fn a_peer_that_died_gives_a_miss_in_bounded_time_and_leaves_nothing_behind() {
    use lmcache_client::{CacheKey, Client};
    use lmcache_core::ModelName;
    let c = coordinator(0);
    let dead = p2p_server(&c, "d1-dead", &free_addr());
    let reader = p2p_server(&c, "d2-reader", &free_addr());
    until("the reader sees its peer", || {
        let url = format!("http://{}/status", reader.http_addr().unwrap());
        let mut r = ureq::get(&url).call().unwrap();
        r.body_mut().read_to_string().unwrap().contains("d1-dead")
    });
    // The peer goes before the reader's next poll notices.
    dead.shutdown();
    let mut r = Client::connect(reader.endpoint(), Duration::from_secs(10)).unwrap();
    r.register_engine_driven(&engine_driven(2)).unwrap();
    let key = CacheKey::whole(ModelName::new("m").unwrap(), "q", (0..64).collect(), 16);
    let t = Instant::now();
    assert_eq!(r.lookup(&key).unwrap(), 0, "a dead peer serves nothing");
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "bounded by the lookup timeout: {:?}",
        t.elapsed()
    );
    let u = reader.state().l1().usage();
    assert_eq!((u.staged_objects, u.resident_objects), (0, 0), "nothing left behind");
    assert_eq!(reader.state().metrics.p2p_fetched_keys.get(), 0);
}

#[test]
fn events_wait_for_a_coordinator_that_is_down_and_arrive_without_a_gap() {
    let port = restartable_port();
    let s = server(port, "rs-2");
    store(&s, &[1, 2]);
    std::thread::sleep(Duration::from_millis(300));
    store(&s, &[3]);
    let c = coordinator(port);
    until("all placed once the coordinator is up", || {
        (1..=3).all(|b| placed_on(&c, b) == ["rs-2"])
    });
    let st = get(&c, "/directory/stats");
    assert_eq!(st["streams"][0]["gap_detected"], false, "{st}");
    // The coordinator restarts with nothing (no checkpoint): the server re-registers on the
    // 404, and its next batches (a store made at once, then its capacity declaration) are a
    // gap on a cold cursor. The repair waits for the registration instead of fencing, then
    // restores the whole L1 from the server's snapshot, the keys stored before the restart
    // included.
    c.stop();
    let c = coordinator(port);
    store(&s, &[4]);
    until("re-registered", || {
        get(&c, "/instances")["instances"].as_array().is_some_and(|a| a.len() == 1)
    });
    until("the whole L1 is back", || (1..=4).all(|b| placed_on(&c, b) == ["rs-2"]));
    s.shutdown();
}

#[test]
fn a_cold_coordinator_resyncs_a_servers_l2_placements_too() {
    let dir = tempfile::tempdir().unwrap();
    let port = restartable_port();
    let c = coordinator(port);
    let arena = ArenaConfig { size: 16 << 20, backing: ArenaBacking::Anonymous, mlock: false };
    let s = Server::start(ServerConfig {
        http_port: Some(0),
        coordinator: Some(reporting(port, "rs-l2")),
        l2_adapters: vec![json!({"type": "fs", "base_path": dir.path().join("l2")})],
        ..ServerConfig::local(arena)
    })
    .unwrap();
    // Through the storage manager: L1, then the write-behind into the fs L2.
    let commit = |keys: &[u8]| {
        let reqs: Vec<WriteRequest> =
            keys.iter().map(|&b| WriteRequest::new(key(b), 4096)).collect();
        let res: Vec<_> =
            s.state().storage.reserve_write(&reqs).into_iter().map(Result::unwrap).collect();
        for r in s.state().storage.commit(res) {
            r.unwrap();
        }
    };
    let l2_at = |c: &Coordinator| -> Vec<String> {
        let v = get(c, "/directory/keys?tier=l2&instance_id=rs-l2&limit=100");
        let mut k: Vec<String> = v["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["key"]["chunk_hash_hex"].as_str().unwrap()[..2].to_string())
            .collect();
        k.sort();
        k
    };
    commit(&[1, 2, 3]);
    until("all three in L2 at the coordinator", || l2_at(&c) == ["01", "02", "03"]);
    // A cold coordinator: the server's next batch is a gap; the repair lists its L1 and now
    // its L2 too, so the L2 placements made before the restart come back with the new one.
    c.stop();
    let c = coordinator(port);
    commit(&[4]);
    until("the whole L2 is back", || l2_at(&c) == ["01", "02", "03", "04"]);
    until("and the whole L1", || (1..=4).all(|b| placed_on(&c, b).contains(&"rs-l2".to_string())));
    let st = get(&c, "/directory/stats");
    assert_eq!(st["streams"][0]["gap_detected"], false, "{st}");
    s.shutdown();
}

/// An HTTP proxy in front of a coordinator that loses every 100th event batch (1%) and,
/// when told, the deregistration (as a crashed server never sends it).
struct LossyProxy {
    port: u16,
    dropped: Arc<AtomicU64>,
    lose_deregistration: Arc<AtomicBool>,
}

impl LossyProxy {
    fn start(upstream: std::net::SocketAddr) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let dropped = Arc::new(AtomicU64::new(0));
        let lose_deregistration = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(AtomicU64::new(0));
        let (d, l) = (Arc::clone(&dropped), Arc::clone(&lose_deregistration));
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                let (d, l, seen) = (Arc::clone(&d), Arc::clone(&l), Arc::clone(&seen));
                std::thread::spawn(move || Self::serve(conn, upstream, &d, &l, &seen));
            }
        });
        Self { port, dropped, lose_deregistration }
    }

    fn serve(
        conn: std::net::TcpStream,
        upstream: std::net::SocketAddr,
        dropped: &AtomicU64,
        lose: &AtomicBool,
        seen: &AtomicU64,
    ) {
        use std::io::{BufRead, BufReader, Read, Write};
        let agent: ureq::Agent =
            ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let mut out = conn.try_clone().unwrap();
        let mut r = BufReader::new(conn);
        loop {
            let mut line = String::new();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let mut parts = line.split_whitespace();
            let (method, path) =
                (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("").to_string());
            let mut len = 0usize;
            loop {
                let mut h = String::new();
                r.read_line(&mut h).unwrap();
                if h.trim().is_empty() {
                    break;
                }
                if let Some((k, v)) = h.split_once(':')
                    && k.eq_ignore_ascii_case("content-length")
                {
                    len = v.trim().parse().unwrap();
                }
            }
            let mut body = vec![0; len];
            r.read_exact(&mut body).unwrap();
            if method == "POST" && path == "/events" {
                let mut v: Value = serde_json::from_slice(&body).unwrap();
                let batches = v["batches"].as_array_mut().unwrap();
                batches.retain(|_| {
                    let keep = seen.fetch_add(1, Ordering::Relaxed) % 100 != 37;
                    if !keep {
                        dropped.fetch_add(1, Ordering::Relaxed);
                    }
                    keep
                });
                body = serde_json::to_vec(&v).unwrap();
            }
            let (status, text) = if method == "DELETE" && lose.load(Ordering::Relaxed) {
                (204, String::new())
            } else {
                let url = format!("http://{upstream}{path}");
                let resp = match method.as_str() {
                    "POST" => {
                        agent.post(&url).header("content-type", "application/json").send(&body[..])
                    }
                    "PUT" => agent.put(&url).send(&body[..]),
                    "DELETE" => agent.delete(&url).call(),
                    _ => agent.get(&url).call(),
                };
                let mut resp = resp.unwrap();
                (resp.status().as_u16(), resp.body_mut().read_to_string().unwrap_or_default())
            };
            let head = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                text.len()
            );
            if out.write_all(head.as_bytes()).and_then(|()| out.write_all(text.as_bytes())).is_err()
            {
                return;
            }
        }
    }
}

/// The chunk hashes the coordinator places in `id`'s L1.
fn coordinator_l1(c: &Coordinator, id: &str) -> std::collections::BTreeSet<String> {
    let v = get(c, &format!("/directory/keys?instance_id={id}&tier=l1&limit=10000"));
    v["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key"]["chunk_hash_hex"].as_str().unwrap().to_string())
        .collect()
}

/// What the server holds in L1: the reference the coordinator must converge to.
fn server_l1(s: &Server) -> std::collections::BTreeSet<String> {
    s.state().l1().resident_keys().into_iter().map(|(k, _)| k.chunk_hash.to_hex()).collect()
}

fn churn(s: &Server, rounds: usize, seed: u64) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    for _ in 0..rounds {
        // A wide key space: most keys are stored once and later evicted once, so a lost
        // batch is never corrected by a later event for the same key.
        let wide = |n: u32| {
            let mut h = [0u8; 32];
            h[..4].copy_from_slice(&n.to_le_bytes());
            ObjectKey::new(h, "m", 1, 0, 0, "").unwrap()
        };
        let reqs: Vec<WriteRequest> =
            (0..6).map(|_| WriteRequest::new(wide(rng.gen_range(0..100_000)), 64 << 10)).collect();
        let res: Vec<_> =
            s.state().l1().reserve_write(&reqs).into_iter().filter_map(Result::ok).collect();
        s.state().l1().commit_batch(res);
        let resident = s.state().l1().resident_keys();
        if !resident.is_empty() {
            let victim = resident[rng.gen_range(0..resident.len())].0.clone();
            s.state().l1().delete(&[victim], true);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn lost_batches_and_a_restart_mid_stream_are_repaired_to_exactly_the_servers_l1() {
    let c = coordinator(0);
    let proxy = LossyProxy::start(c.addr());
    // 4 MiB of L1 holds 64 objects of 64 KiB: stores evict, deletes remove; every change is
    // an event.
    let start = |id: &str| {
        let arena = ArenaConfig { size: 4 << 20, backing: ArenaBacking::Anonymous, mlock: false };
        Server::start(ServerConfig {
            http_port: Some(0),
            coordinator: Some(CoordinatorReporting {
                url: format!("http://127.0.0.1:{}", proxy.port),
                instance_id: id.into(),
                advertise_ip: "127.0.0.1".into(),
                heartbeat_interval: Duration::from_millis(200),
                event_reporting: true,
                flush_interval: Duration::from_millis(5),
                transport: ReportTransport::Http,
                auth_token: None,
                p2p_advertised_url: None,
            }),
            ..ServerConfig::local(arena)
        })
        .unwrap()
    };
    let s = start("lossy");
    until("registered", || {
        get(&c, "/instances")["instances"].as_array().is_some_and(|a| a.len() == 1)
    });
    churn(&s, 400, 1);
    let stopped = Instant::now();
    until("the coordinator's view equals the server's L1", || {
        coordinator_l1(&c, "lossy") == server_l1(&s)
    });
    let converged = stopped.elapsed();
    assert!(proxy.dropped.load(Ordering::Relaxed) >= 2, "the proxy lost batches");
    let st = get(&c, "/directory/stats");
    let stream = &st["streams"][0];
    assert!(stream["repairs"].as_u64().unwrap() >= 1, "{st}");
    assert_eq!(stream["gap_detected"], false, "every gap repaired: {st}");
    assert!(converged < Duration::from_secs(2), "converged {converged:?} after the last change");
    eprintln!(
        "lossy stream: {} of {} batches lost, {} repairs (last {:.3} s), view exact {converged:?} after the last change",
        proxy.dropped.load(Ordering::Relaxed),
        stream["last_seq"],
        stream["repairs"],
        stream["last_repair_seconds"].as_f64().unwrap_or(0.0)
    );
    // A crash-like restart mid-stream: no deregistration reaches the coordinator; the new
    // incarnation's stream fences the old L1 placements.
    churn(&s, 50, 2);
    proxy.lose_deregistration.store(true, Ordering::Relaxed);
    s.shutdown();
    let s = start("lossy");
    churn(&s, 100, 3);
    until("the restarted server's L1 only", || coordinator_l1(&c, "lossy") == server_l1(&s));
    s.shutdown();
}

#[test]
fn query_coordinator_reads_every_api_as_tables_and_json() {
    let c = coordinator(0);
    let url = format!("http://{}", c.addr());
    let s = server(c.addr().port(), "rs-q");
    store(&s, &[1, 2]);
    until("placed", || (1..=2).all(|b| placed_on(&c, b) == ["rs-q"]));
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lmcache-rs"))
            .args(["query", "coordinator", "--url", &url])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (ok, text, _) = run(&["--api", "instances"]);
    assert!(ok && text.contains("rs-q") && text.contains("127.0.0.1:"), "{text}");
    let (ok, text, _) = run(&["--api", "usage"]);
    assert!(ok && text.contains("rs-q l1/dram") && text.contains("8.0 KiB of 16.0 MiB"), "{text}");
    let (ok, text, _) = run(&["--api", "keys", "--format", "json"]);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(ok && v["total"] == 2, "{text}");
    let (ok, text, _) = run(&["--api", "directory"]);
    assert!(ok && text.contains("Stream rs-q"), "{text}");
    let (ok, text, _) = run(&["--api", "health"]);
    assert!(ok && text.contains("healthy"), "{text}");
    let (ok, text, _) = run(&["--api", "metrics"]);
    assert!(ok && text.contains("lmcache_coordinator_key_directory_placements"), "{text}");
    let (ok, _, err) = run(&["--api", "prefetch"]);
    assert!(!ok && err.contains("--instance and --request-id"), "{err}");
    let (ok, text, _) = run(&["--api", "quota"]);
    assert!(ok && text.contains("Total usage (GiB)"), "{text}");
    let (ok, text, _) = run(&["--api", "quota-config", "--format", "json"]);
    assert!(ok && text.contains("default_limit_gb"), "{text}");
    let (ok, _, err) = run(&["--api", "prefetch", "--instance", "nobody", "--request-id", "x"]);
    assert!(!ok && err.contains("404"), "{err}");
    s.shutdown();
}

fn post(c: &Coordinator, path: &str, body: Value) -> (u16, Value) {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut r = agent.post(&format!("http://{}{path}", c.addr())).send_json(body).unwrap();
    let code = r.status().as_u16();
    (code, serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap_or(Value::Null))
}

fn put(c: &Coordinator, path: &str, body: Value) -> (u16, Value) {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut r = agent.put(&format!("http://{}{path}", c.addr())).send_json(body).unwrap();
    let code = r.status().as_u16();
    (code, serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap_or(Value::Null))
}

#[test]
fn quotas_pins_fleet_eviction_and_relays_work_end_to_end() {
    let dir = std::env::temp_dir().join(format!("lmcache-rs-fleet-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("l2")).unwrap();
    let meta = dir.join("metadata.json");
    let ccfg = |port: u16| CoordinatorConfig {
        host: "127.0.0.1".into(),
        port,
        metadata_path: Some(meta.clone()),
        eviction_check_interval: Duration::from_millis(100),
        ..CoordinatorConfig::default()
    };
    let c = Coordinator::start(ccfg(0)).unwrap();
    let arena = ArenaConfig { size: 16 << 20, backing: ArenaBacking::Anonymous, mlock: false };
    let s = Server::start(ServerConfig {
        http_port: Some(0),
        l2_adapters: vec![json!({"type": "fs", "base_path": dir.join("l2")})],
        coordinator: Some(CoordinatorReporting {
            url: format!("http://{}", c.addr()),
            instance_id: "rs-e".into(),
            advertise_ip: "127.0.0.1".into(),
            heartbeat_interval: Duration::from_millis(100),
            event_reporting: true,
            flush_interval: Duration::from_millis(20),
            transport: ReportTransport::Http,
            auth_token: None,
            p2p_advertised_url: None,
        }),
        ..ServerConfig::local(arena)
    })
    .unwrap();
    until("registered", || {
        get(&c, "/instances")["instances"].as_array().is_some_and(|a| a.len() == 1)
    });
    // Four chunks of one prompt, salt "t", through the storage manager (L1 + write-behind).
    let tokens: Vec<u32> = (0..1024).collect();
    let hashes = lmcache_core::TokenHasher::new(256).unwrap().hash_tokens(&tokens);
    let keys: Vec<ObjectKey> =
        hashes.iter().map(|h| ObjectKey::new(*h.as_bytes(), "m", 1, 0, 0, "t").unwrap()).collect();
    let reqs: Vec<WriteRequest> = keys.iter().map(|k| WriteRequest::new(k.clone(), 4096)).collect();
    let res: Vec<_> =
        s.state().storage.reserve_write(&reqs).into_iter().map(Result::unwrap).collect();
    for r in s.state().storage.commit(res) {
        r.unwrap();
    }
    let l2_count = || get(&c, "/directory/keys?tier=l2")["total"].as_u64().unwrap_or(0);
    until("all four in L2 at the coordinator", || l2_count() == 4);
    let q = get(&c, "/quota?tier=l2");
    assert_eq!(q["by_cache_salt"][0]["cache_salt"], "t", "{q}");
    assert!(q["by_cache_salt"][0]["usage_gb"].as_f64().unwrap() > 0.0);
    // Pin the first chunk, then give "t" a zero quota: the fleet eviction deletes the three
    // unpinned chunks from the server's L2 and learns it from the server's delete events.
    let pin =
        json!({"model_name": "m", "world_size": 1, "token_ids": &tokens[..256], "cache_salt": "t"});
    assert_eq!(
        post(&c, "/cache/pins", pin.clone()).1,
        json!({"requested": 1, "affected": 1, "status": "pinned"})
    );
    assert_eq!(
        put(&c, "/quota/t", json!({"limit_gb": 0.0})).1,
        json!({"cache_salt": "t", "limit_gb": 0.0, "status": "ok"})
    );
    until("evicted down to the pinned chunk", || l2_count() == 1);
    let left = get(&c, "/directory/keys?tier=l2");
    assert_eq!(
        left["keys"][0]["key"]["chunk_hash_hex"],
        hashes[0].to_hex(),
        "the pinned chunk stays"
    );
    assert_eq!(
        put(&c, "/quota/t", json!({"limit_gb": 1.0, "tier": "l1"})).0,
        400,
        "quotas are L2 only"
    );
    // Relays: a delete of the whole prompt from L1 through the coordinator.
    let del = json!({"instance_id": "rs-e", "model_name": "m", "world_size": 1, "token_ids": tokens, "cache_salt": "t", "tier": "l1"});
    let (code, v) = post(&c, "/cache/delete", del);
    assert_eq!(
        (code, v["requested"].as_u64(), v["status"].as_str()),
        (200, Some(4), Some("deleted")),
        "{v}"
    );
    assert_eq!(v["affected"], 4, "{v}");
    until("L1 forgotten", || get(&c, "/directory/keys?tier=l1")["total"] == 0);
    let pf = json!({"instance_id": "rs-e", "model_name": "m", "world_size": 1, "token_ids": &tokens[..256], "cache_salt": "t"});
    let (code, v) = post(&c, "/cache/prefetches", pf);
    assert_eq!((code, v["status"].as_str()), (200, Some("submitted")), "{v}");
    let rid = v["request_id"].as_str().unwrap().to_string();
    until("prefetch status relayed", || {
        get(&c, &format!("/cache/prefetches/rs-e/{rid}")).get("status").is_some()
    });
    assert_eq!(
        post(
            &c,
            "/cache/prefetches",
            json!({"instance_id": "nobody", "model_name": "m", "world_size": 1})
        )
        .0,
        404
    );
    // Pins and quotas survive a coordinator restart through the metadata document.
    c.stop();
    let doc: Value = serde_json::from_slice(&std::fs::read(&meta).unwrap()).unwrap();
    assert_eq!(doc["components"]["quotas"]["limits"]["t"], 0);
    let c = Coordinator::start(ccfg(0)).unwrap();
    let pins = get(&c, "/cache/pins?cache_salt=t");
    assert_eq!(
        (pins["total"].as_u64(), pins["pins"][0]["pin_count"].as_u64()),
        (Some(1), Some(1)),
        "{pins}"
    );
    assert_eq!(get(&c, "/quota/t")["quota_exists"], true);
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut r = agent
        .delete(&format!("http://{}/cache/pins", c.addr()))
        .force_send_body()
        .send_json(pin)
        .unwrap();
    let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
    assert_eq!(v["status"], "unpinned");
    assert_eq!(get(&c, "/cache/pins?cache_salt=t")["total"], 0);
    s.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A service's address from the environment: required under LMCACHE_RS_REQUIRE_SERVICES=1
/// (scripts/test), else the test says it skips.
fn external(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ if std::env::var("LMCACHE_RS_REQUIRE_SERVICES").is_ok_and(|v| v == "1") => {
            panic!(
                "{var} is not set, but LMCACHE_RS_REQUIRE_SERVICES=1: start scripts/test-services"
            )
        }
        _ => {
            eprintln!("{var} not set: skipping (scripts/test starts the service and sets it)");
            None
        }
    }
}

/// A server registered with `c` as `id` (heartbeats every 200 ms), publishing its cache
/// events to JetStream stream `stream` at `nats`.
fn jetstream_server(c: &Coordinator, id: &str, nats: &str, stream: &str) -> Server {
    let arena = ArenaConfig { size: 4 << 20, backing: ArenaBacking::Anonymous, mlock: false };
    Server::start(ServerConfig {
        http_port: Some(0),
        coordinator: Some(CoordinatorReporting {
            url: format!("http://{}", c.addr()),
            instance_id: id.into(),
            advertise_ip: "127.0.0.1".into(),
            heartbeat_interval: Duration::from_millis(200),
            event_reporting: true,
            flush_interval: Duration::from_millis(10),
            transport: ReportTransport::JetStream { url: nats.into(), stream: stream.into() },
            auth_token: None,
            p2p_advertised_url: None,
        }),
        ..ServerConfig::local(arena)
    })
    .unwrap()
}

#[test]
fn jetstream_replicas_converge_and_a_restarted_replica_resumes_without_loss() {
    let Some(nats) = external("LMCACHE_RS_TEST_NATS") else { return };
    // A stream of this run's own (its own subjects too): nothing another run or fleet on
    // the same NATS holds is read, and only it is deleted at the end.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let stream_name = format!("LMCACHE_RS_TEST_{}_{}", std::process::id(), nanos.as_nanos());
    let stream = stream_name.as_str();
    let delete_stream = || {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(
            async {
                let js = async_nats::jetstream::new(async_nats::connect(&nats).await.unwrap());
                // The replicas' registry stream too (crate::replication).
                let _ =
                    js.delete_stream(lmcache_coordinator::replication::bucket_name(stream)).await;
                js.delete_stream(stream).await.map(|_| ()).map_err(|e| e.to_string())
            },
        )
    };
    let dir = std::env::temp_dir().join(format!("lmcache-rs-js-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let replica = |name: &str| {
        Coordinator::start(CoordinatorConfig {
            host: "127.0.0.1".into(),
            port: 0,
            checkpoint_path: Some(dir.join(format!("{name}.ckpt"))),
            checkpoint_interval: Duration::ZERO,
            event_transport: lmcache_coordinator::transport::EventTransport::JetStream {
                url: nats.clone(),
                stream: stream.into(),
            },
            ..CoordinatorConfig::default()
        })
        .unwrap()
    };
    let a = replica("a");
    let b = replica("b");
    let s = jetstream_server(&a, "js-1", &nats, stream);
    let digest = |c: &Coordinator| get(c, "/directory/digest");
    let converged = |c: &Coordinator, s: &Server| coordinator_l1(c, "js-1") == server_l1(s);
    churn(&s, 150, 4);
    until("replica a equals the server", || converged(&a, &s));
    until("replica b equals the server", || converged(&b, &s));
    until("digests agree", || digest(&a)["total"] == digest(&b)["total"]);
    let (_, v) = post(&a, "/events", json!({"batches": []}));
    assert_eq!(
        v["detail"].as_str().map(|d| d.contains("JetStream")),
        Some(true),
        "POST /events is off: {v}"
    );
    // Replica b stops (its checkpoint holds its stream position); events go on; it restarts
    // and catches up from the stream, losing nothing and seeing no gap.
    let b_at = digest(&b)["stream_sequence"].as_u64().unwrap();
    b.stop();
    churn(&s, 150, 5);
    let b = replica("b");
    until("restarted replica b equals the server", || converged(&b, &s));
    until("digests agree again", || {
        let (da, db) = (digest(&a), digest(&b));
        da["total"] == db["total"] && da["stream_sequence"] == db["stream_sequence"]
    });
    let after = digest(&b)["stream_sequence"].as_u64().unwrap();
    assert!(after > b_at, "b resumed from {b_at} and read on to {after}");
    let metrics = ureq::get(&format!("http://{}/metrics", b.addr()))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    let sample = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert_eq!(sample("lmcache_rs_coordinator_checkpoint_restores_total{result=\"restored\"}"), 1);
    assert_eq!(
        sample("lmcache_rs_coordinator_event_batches_total{result=\"applied\"}"),
        after - b_at,
        "only what came after"
    );
    assert_eq!(
        sample("lmcache_rs_coordinator_event_batches_total{result=\"duplicate\"}"),
        0,
        "nothing read twice"
    );
    let st = get(&b, "/directory/stats");
    assert_eq!(st["streams"][0]["gap_detected"], false, "{st}");
    assert_eq!(st["streams"][0]["missing_batches"], 0, "no batch lost across the restart: {st}");
    eprintln!(
        "jetstream: 2 replicas, replica b restarted at stream seq {b_at}, resumed to {after}, digests equal"
    );
    s.shutdown();
    a.stop();
    b.stop();
    delete_stream().expect("this run's stream was created, and is deleted");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn jetstream_replicas_share_registrations_heartbeats_and_quotas() {
    let Some(nats) = external("LMCACHE_RS_TEST_NATS") else { return };
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let stream_name = format!("LMCACHE_RS_TEST_REG_{}_{}", std::process::id(), nanos.as_nanos());
    let stream = stream_name.as_str();
    let replica = || {
        Coordinator::start(CoordinatorConfig {
            host: "127.0.0.1".into(),
            port: 0,
            // Silent for 1 s: dropped (and the drop replicated) unless heartbeats travel.
            instance_timeout: Duration::from_secs(1),
            health_check_interval: Duration::from_millis(100),
            event_transport: lmcache_coordinator::transport::EventTransport::JetStream {
                url: nats.clone(),
                stream: stream.into(),
            },
            ..CoordinatorConfig::default()
        })
        .unwrap()
    };
    let a = replica();
    let b = replica();
    let instances = |c: &Coordinator| {
        let mut v: Vec<Value> = get(c, "/instances")["instances"].as_array().unwrap().clone();
        v.sort_by_key(|i| i["instance_id"].as_str().unwrap_or("").to_string());
        v
    };
    // Both servers register with replica a only; b learns them from a.
    let s1 = jetstream_server(&a, "reg-1", &nats, stream);
    let s2 = jetstream_server(&a, "reg-2", &nats, stream);
    until("b lists what a lists", || {
        let (x, y) = (instances(&a), instances(&b));
        x.len() == 2 && x == y
    });
    // Quotas set at a are b's too.
    assert_eq!(put(&a, "/quota/t", json!({"limit_gb": 2.0})).0, 200);
    until("the quota reached b", || get(&b, "/quota/t")["quota_exists"] == true);
    assert_eq!(get(&b, "/quota/t")["limit_gb"], get(&a, "/quota/t")["limit_gb"]);
    // A deregistration at a is one at b.
    s2.shutdown();
    until("reg-2 gone from b", || instances(&b).len() == 1);
    // reg-1 heartbeats to a only: b holds it past b's 1 s timeout only if they reach b.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(instances(&b).len(), 1, "b kept reg-1 alive through a's heartbeats");
    // a goes; b answers /instances as a did.
    let before = instances(&a);
    a.stop();
    assert_eq!(instances(&b), before, "the replica that takes over answers /instances alike");
    s1.shutdown();
    b.stop();
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(&nats).await.unwrap());
        js.delete_stream(lmcache_coordinator::replication::bucket_name(stream)).await.unwrap();
        let _ = js.delete_stream(stream).await;
    });
}
