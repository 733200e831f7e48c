//! The JetStream feed end to end: the ingest bench's trace, four times longer (16 servers x 800
//! sequences of 64 chunks, one message per batch) published into a stream of a real nats-server, then a
//! fresh coordinator consuming it from the start; timed from the coordinator's start until its
//! stream position reaches the last message. Once with the binary layout lmcache-rs servers
//! publish, once with LMCache's JSON batches, each in its own stream (deleted after).
//!
//! `LMCACHE_RS_TEST_NATS=nats://127.0.0.1:4222 cargo bench -p lmcache-coordinator --bench jetstream`
//! (nats-server with JetStream: `nats-server -js`).

use std::time::{Duration, Instant};

use lmcache_coordinator::transport::EventTransport;
use lmcache_coordinator::{Coordinator, CoordinatorConfig};
use lmcache_protocol::coordinator::{
    CacheEventBatch, CacheEventEntry, CacheEventType, EncodedObjectKey, WireTier, jetstream_subject,
};
use lmcache_protocol::coordinator_binary;

fn h(parts: &[u64]) -> String {
    let mut x = blake3::Hasher::new();
    for p in parts {
        x.update(&p.to_le_bytes());
    }
    x.finalize().to_hex().to_string()
}

fn batches() -> Vec<CacheEventBatch> {
    let mut out = Vec::new();
    for w in 0..16u64 {
        for s in 0..800u64 {
            let pool = (w * 7919 + s * 104_729) % 1000;
            out.push(CacheEventBatch {
                instance_id: format!("server-{w}"),
                incarnation: 1,
                seq: s + 1,
                event_type: CacheEventType::Store,
                tier: WireTier::L1,
                backend: "dram".into(),
                entries: (0..64u64)
                    .map(|i| CacheEventEntry {
                        key: EncodedObjectKey {
                            chunk_hash_hex: if i < 16 {
                                h(&[1, pool, i])
                            } else {
                                h(&[2, w, s, i])
                            },
                            model_name: "m".into(),
                            kv_rank: 0x0100_0100,
                            object_group_id: 0,
                            cache_salt: String::new(),
                        },
                        size_bytes: 32 << 20,
                        token_ids: Vec::new(),
                        token_offset: -1,
                    })
                    .collect(),
                shared: false,
                ts: 1.0,
                capacity_bytes: 0,
                capacity_revision: 0,
            });
        }
    }
    out
}

fn main() {
    let Ok(nats) = std::env::var("LMCACHE_RS_TEST_NATS") else {
        eprintln!("set LMCACHE_RS_TEST_NATS=nats://host:port (a nats-server started with -js)");
        std::process::exit(2);
    };
    let batches = batches();
    let events = batches.len() * 64;
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    for (label, encode) in [
        (
            "binary",
            (|b: &CacheEventBatch| coordinator_binary::encode(std::slice::from_ref(b)).unwrap())
                as fn(&CacheEventBatch) -> Vec<u8>,
        ),
        ("JSON", |b: &CacheEventBatch| serde_json::to_vec(b).unwrap()),
    ] {
        let stream = format!("LMCACHE_RS_BENCH_{}_{}", std::process::id(), label);
        let js = rt.block_on(async {
            let js = async_nats::jetstream::new(async_nats::connect(&nats).await.unwrap());
            lmcache_coordinator::transport::ensure_stream(&js, &stream).await.unwrap();
            // A window of acks in flight, as the servers publish (the client stalls past its
            // own limit).
            let mut acks = std::collections::VecDeque::new();
            for b in &batches {
                if acks.len() == 256 {
                    let a: async_nats::jetstream::context::PublishAckFuture =
                        acks.pop_front().unwrap();
                    a.await.unwrap();
                }
                let subject = jetstream_subject(&stream, &b.instance_id);
                acks.push_back(js.publish(subject, encode(b).into()).await.unwrap());
            }
            for a in acks {
                a.await.unwrap();
            }
            js
        });
        let bytes: usize = batches.iter().map(|b| encode(b).len()).sum();
        let t = Instant::now();
        let c = Coordinator::start(CoordinatorConfig {
            host: "127.0.0.1".into(),
            port: 0,
            health_check_interval: Duration::ZERO,
            eviction_check_interval: Duration::ZERO,
            event_transport: EventTransport::JetStream {
                url: nats.clone(),
                stream: stream.clone(),
            },
            ..CoordinatorConfig::default()
        })
        .unwrap();
        while c.fleet().stream_position() == 0 {
            std::thread::sleep(Duration::from_micros(100));
        }
        let (first, from) = (t.elapsed(), c.fleet().stream_position());
        while c.fleet().stream_position() < batches.len() as u64 {
            std::thread::sleep(Duration::from_micros(100));
        }
        let secs = t.elapsed().as_secs_f64();
        let rest = (batches.len() as u64 - from) as f64 * 64.0;
        println!(
            "{label}: {events} chunk events in {} messages ({:.0} bytes per event) consumed in {secs:.3} s from the coordinator's start: {:.2} M events/s; after its first message ({:.0} ms in): {:.2} M events/s",
            batches.len(),
            bytes as f64 / events as f64,
            events as f64 / secs / 1e6,
            first.as_secs_f64() * 1e3,
            rest / (secs - first.as_secs_f64()) / 1e6
        );
        drop(c);
        rt.block_on(async { js.delete_stream(&stream).await.map(drop).unwrap_or(()) });
    }
}
