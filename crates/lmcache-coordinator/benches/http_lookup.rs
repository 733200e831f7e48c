//! G6: the routing answer over loopback HTTP/1.1 keep-alive, client and coordinator in one
//! process on this machine's two cores. The directory is loaded with W servers × S sequences
//! of 64 chunks (the anchors' trace shape) through `Fleet::ingest`; then K client threads,
//! each on its own keep-alive connection, send `POST /directory/route` (64 chunk hashes) back
//! to back for a few seconds. Reports the achieved rate and the latency percentiles, for
//! K = 1, 2, 4. Also `/healthz` with K = 1, the HTTP floor.
//!
//! `cargo bench -p lmcache-coordinator --bench http_lookup -- [servers] [sequences]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_coordinator::{Coordinator, CoordinatorConfig};
use lmcache_protocol::coordinator::{
    CacheEventBatch, CacheEventEntry, CacheEventType, EncodedObjectKey, WireTier,
};

fn hex(parts: &[u64]) -> String {
    let mut h = blake3::Hasher::new();
    for p in parts {
        h.update(&p.to_le_bytes());
    }
    h.finalize().to_hex().to_string()
}

fn run(url: &str, body: Option<&[u8]>, clients: usize, secs: f64) -> (f64, Vec<u64>) {
    let url = Arc::new(url.to_string());
    let body: Option<Arc<Vec<u8>>> = body.map(|b| Arc::new(b.to_vec()));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let handles: Vec<_> = (0..clients)
        .map(|_| {
            let (url, body) = (Arc::clone(&url), body.clone());
            std::thread::spawn(move || {
                let agent: ureq::Agent =
                    ureq::Agent::config_builder().http_status_as_error(false).build().into();
                let mut lat = Vec::new();
                while Instant::now() < deadline {
                    let t = Instant::now();
                    let mut r = match &body {
                        Some(b) => agent
                            .post(url.as_str())
                            .header("content-type", "application/json")
                            .send(&b[..]),
                        None => agent.get(url.as_str()).call(),
                    }
                    .unwrap();
                    let _ = r.body_mut().read_to_vec().unwrap();
                    lat.push(t.elapsed().as_nanos() as u64);
                }
                lat
            })
        })
        .collect();
    let mut all: Vec<u64> = handles.into_iter().flat_map(|h| h.join().unwrap()).collect();
    all.sort_unstable();
    (all.len() as f64 / secs, all)
}

fn pct(v: &[u64], q: f64) -> f64 {
    v[((v.len() as f64 * q) as usize).min(v.len() - 1)] as f64 / 1000.0
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (servers, seqs) =
        (args.first().copied().unwrap_or(64), args.get(1).copied().unwrap_or(500));
    let c = Coordinator::start(CoordinatorConfig {
        host: "127.0.0.1".into(),
        port: 0,
        health_check_interval: Duration::ZERO,
        eviction_check_interval: Duration::ZERO,
        ..CoordinatorConfig::default()
    })
    .unwrap();
    let mut sequences = Vec::new();
    for w in 0..servers {
        let mut batches = Vec::with_capacity(seqs);
        for s in 0..seqs {
            let pool = ((w * 7919 + s * 104_729) % 1000) as u64;
            let keys: Vec<String> = (0..64u64)
                .map(|i| if i < 16 { hex(&[1, pool, i]) } else { hex(&[2, w as u64, s as u64, i]) })
                .collect();
            batches.push(CacheEventBatch {
                instance_id: format!("server-{w}"),
                incarnation: 1,
                seq: s as u64 + 1,
                event_type: CacheEventType::Store,
                tier: WireTier::L1,
                backend: "dram".into(),
                entries: keys
                    .iter()
                    .map(|k| CacheEventEntry {
                        key: EncodedObjectKey {
                            chunk_hash_hex: k.clone(),
                            model_name: "m".into(),
                            kv_rank: 0x0100_0100,
                            object_group_id: 0,
                            cache_salt: String::new(),
                        },
                        size_bytes: 1,
                        token_ids: Vec::new(),
                        token_offset: -1,
                    })
                    .collect(),
                shared: false,
                ts: 1.0,
                capacity_bytes: 0,
                capacity_revision: 0,
            });
            if s % 97 == 0 {
                sequences.push(keys);
            }
        }
        c.fleet().ingest(&batches).unwrap();
        let reg = lmcache_protocol::coordinator::RegisterRequest {
            instance_id: format!("server-{w}"),
            ip: "127.0.0.1".into(),
            http_port: 1,
            metadata: Default::default(),
            p2p_advertised_url: String::new(),
            mq_port: 0,
        };
        c.fleet().register(reg, false).unwrap();
    }
    let body =
        serde_json::to_vec(&serde_json::json!({"chunk_hashes": sequences[0], "model_name": "m"}))
            .unwrap();
    let base = format!("http://{}", c.addr());
    println!(
        "directory: {servers} servers x {seqs} sequences x 64 chunks; route body {} bytes",
        body.len()
    );
    let (rate, lat) = run(&format!("{base}/healthz"), None, 1, 3.0);
    println!(
        "GET /healthz, 1 client: {rate:8.0} req/s, p50 {:.0} us, p99 {:.0} us",
        pct(&lat, 0.5),
        pct(&lat, 0.99)
    );
    for clients in [1, 2, 4] {
        let (rate, lat) = run(&format!("{base}/directory/route"), Some(&body), clients, 4.0);
        println!(
            "POST /directory/route, {clients} client(s): {rate:8.0} req/s, p50 {:.0} us, p99 {:.0} us, p99.9 {:.0} us",
            pct(&lat, 0.5),
            pct(&lat, 0.99),
            pct(&lat, 0.999)
        );
    }
}
