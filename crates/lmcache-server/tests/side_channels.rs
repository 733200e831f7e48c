//! The side channels hear requests through storage's events, not through the handlers: one
//! engine-driven store, lookup and retrieve over real ZMQ, then the metrics, the storage
//! trace, the lookup-hash log and the event bus each show exactly what happened.

use std::sync::Arc;
use std::time::Duration;

use lmcache_client::{CacheKey, Client};
use lmcache_core::ModelName;
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_server::event_bus::Event;
use lmcache_server::lookup_log::LookupHashLogConfig;
use lmcache_server::trace_record::TraceConfig;
use lmcache_server::{Server, ServerConfig};
use lmcache_workload::trace::codec;
use lmcache_workload::trace::{Level, TraceReader};

mod common;

const CHUNK: usize = 16;
const CHUNKS: usize = 3;

#[test]
fn metrics_trace_lookup_log_and_bus_each_hear_a_request_once() {
    let dir = std::env::temp_dir().join(format!("lmcrs-side-channels-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let trace_path = dir.join("storage.lct");
    let log_dir = dir.join("lookups");
    let arena = ArenaConfig {
        size: 32 << 20,
        backing: ArenaBacking::SharedMemory {
            name: format!("lmcache_rs_side_channels_{}", std::process::id()),
        },
        mlock: false,
    };
    let config = ServerConfig {
        chunk_size: CHUNK,
        trace: Some(TraceConfig { level: Level::Storage, path: trace_path.clone() }),
        lookup_hash_log: Some(LookupHashLogConfig::new(log_dir.clone())),
        ..ServerConfig::local(arena)
    };
    let server = Server::start(config).unwrap();
    let heard = Arc::clone(&server.state().faults.bus_heard);
    let mut c = Client::connect(server.endpoint(), Duration::from_secs(5)).unwrap();
    let reg = common::small_registration(7, "m", lmcache_core::Dtype::Float16);
    let pool = c.register_engine_driven(&reg).unwrap();
    let pool = ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap();
    let tokens: Vec<u32> = (0..(CHUNKS * CHUNK) as u32).collect();
    let model = ModelName::new("m").unwrap();

    // Store every chunk.
    let store = CacheKey::whole(model.clone(), "w", tokens.clone(), CHUNK);
    let slots = c.prepare_store(&store, 7).unwrap();
    assert_eq!(slots.len(), CHUNKS);
    for (i, s) in &slots {
        pool.write(s.offset, &vec![*i as u8 + 1; s.length as usize]).unwrap();
    }
    assert!(c.commit_store(&store, 7).unwrap());
    c.end_session("w").unwrap();

    // Look the prompt up, retrieve it, end the request.
    let read = CacheKey::whole(model, "r", tokens, CHUNK);
    assert_eq!(c.lookup(&read).unwrap(), CHUNKS as u64);
    let got = c.prepare_retrieve(&read, 7).unwrap().expect("retrieve prepared");
    assert_eq!(got.len(), CHUNKS);
    assert!(c.commit_retrieve(&read, 7).unwrap());
    c.end_session("r").unwrap();

    // Metrics: one store of CHUNKS chunks, one lookup hitting all of them, one retrieve.
    let m = &server.state().metrics;
    assert_eq!(m.submitted_stores.get(), 1);
    assert_eq!(m.finished_stores.get(), 1);
    assert_eq!(m.l1_write_chunks.get(), CHUNKS as u64);
    assert_eq!(m.lookups.get(), 1);
    assert_eq!(m.lookup_requested_tokens.get(), (CHUNKS * CHUNK) as u64);
    assert_eq!(m.lookup_hit_tokens.get(), (CHUNKS * CHUNK) as u64);
    assert_eq!(m.lookup_hit_l1_keys.get(), CHUNKS as u64);
    assert_eq!(m.submitted_retrieves.get(), 1);
    assert_eq!(m.finished_retrieves.get(), 1);
    assert_eq!(m.l1_read_chunks.get(), CHUNKS as u64);

    // The bus (drained every 10 ms) heard the request's milestones in order.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let milestones = loop {
        let got: Vec<String> = heard
            .lock()
            .iter()
            .filter_map(|e| match e {
                Event::Stored { request_id, chunks, .. } => {
                    Some(format!("stored {request_id} {chunks}"))
                }
                Event::Lookup { request_id, hits, .. } => {
                    Some(format!("lookup {request_id} {hits}"))
                }
                Event::Retrieved { request_id, chunks } => {
                    Some(format!("retrieved {request_id} {chunks}"))
                }
                Event::SessionEnded { request_id } => Some(format!("ended {request_id}")),
                _ => None,
            })
            .collect();
        if got.len() >= 5 || std::time::Instant::now() > deadline {
            break got;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        milestones,
        ["stored w 3", "ended w", "lookup r 3", "retrieved r 3", "ended r"].map(str::to_owned),
    );

    drop(c);
    server.shutdown();

    // The storage trace: LMCache's storage-manager calls, in order, each once.
    let mut r = TraceReader::new(std::fs::File::open(&trace_path).unwrap()).unwrap();
    let names: Vec<String> = r.read_all().unwrap().into_iter().map(|rec| rec.qualname).collect();
    assert_eq!(
        names,
        vec![
            codec::RESERVE_WRITE.to_owned(),
            codec::FINISH_WRITE.to_owned(),
            codec::SUBMIT_PREFETCH.to_owned(),
            codec::FINISH_READ.to_owned(),
        ],
    );

    // The lookup-hash log: one line, for the lookup, naming its three chunk hashes.
    let mut lines = Vec::new();
    for f in std::fs::read_dir(&log_dir).unwrap() {
        let text = std::fs::read_to_string(f.unwrap().path()).unwrap();
        lines.extend(text.lines().map(str::to_owned));
    }
    assert_eq!(lines.len(), 1, "{lines:?}");
    let line: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(line["request_id"], "r");
    assert_eq!(line["chunk_hashes"].as_array().map(Vec::len), Some(CHUNKS));
    assert_eq!(line["shapes"], serde_json::json!([[2, 2, 16, 32]]));
    std::fs::remove_dir_all(&dir).unwrap();
}
