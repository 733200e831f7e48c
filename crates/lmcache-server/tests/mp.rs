//! The MP server over real ZMQ, driven by the Rust client as LMCache's clients drive it.

use std::time::Duration;

use lmcache_client::{CacheKey, Client};
use lmcache_core::{CacheSalt, Dtype, ModelName};
use lmcache_memory::{ArenaBacking, ArenaConfig, ForeignSegment};
use lmcache_protocol::types::EngineDrivenRegistration;
use lmcache_protocol::{Op, value};
use lmcache_server::{Server, ServerConfig};
use rmpv::Value;

const CHUNK: usize = 16;
/// [2, L=2, S=16, H=32] float16 = 4 KiB per chunk object.
const LAYERS: u64 = 2;
const HIDDEN: u64 = 32;

fn server(tag: &str) -> Server {
    server_with(tag, |_| {})
}

/// A server over a 64 MiB shm L1 with two transfer threads, after `tweak`.
fn server_with(tag: &str, tweak: impl FnOnce(&mut ServerConfig)) -> Server {
    let arena = ArenaConfig {
        size: 64 << 20,
        backing: ArenaBacking::SharedMemory {
            name: format!("lmcache_rs_mp_test_{tag}_{}", std::process::id()),
        },
        mlock: false,
    };
    let mut config =
        ServerConfig { chunk_size: CHUNK, max_gpu_workers: 2, ..ServerConfig::local(arena) };
    tweak(&mut config);
    Server::start(config).unwrap()
}

fn model_m() -> ModelName {
    ModelName::new("m").unwrap()
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

fn client(s: &Server) -> Client {
    Client::connect(s.endpoint(), Duration::from_secs(5)).unwrap()
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Stores every chunk of `key` for `worker` through the shared pool, filling chunk `i` with
/// `fill(i)`. Returns the chunks written.
fn store(
    c: &mut Client,
    pool: &ForeignSegment,
    key: &CacheKey,
    id: u64,
    fill: impl Fn(u64) -> u8,
) -> usize {
    let slots = c.prepare_store(key, id).unwrap();
    for (i, s) in &slots {
        pool.write(s.offset, &vec![fill(*i); s.length as usize]).unwrap();
    }
    assert!(c.commit_store(key, id).unwrap());
    slots.len()
}

fn register(c: &mut Client, id: u64, world: u32) -> ForeignSegment {
    let pool = c.register_engine_driven(&registration(id, world, 16, LAYERS, HIDDEN)).unwrap();
    assert!(!pool.shm_name.is_empty() && pool.pool_size > 0, "no SHM pool advertised");
    ForeignSegment::open(&pool.shm_name, pool.pool_size).unwrap()
}

#[test]
fn management_replies_have_lmcache_types() {
    let s = server("mgmt");
    let mut c = client(&s);
    assert_eq!(c.get_chunk_size().unwrap(), CHUNK as u64);
    assert!(c.ping(None).unwrap());
    assert_eq!(c.call(Op::Noop, &[]).unwrap(), Some(Value::from("OK")));
    assert_eq!(
        c.call(Op::GetExperimental, &[]).unwrap(),
        Some(Value::Array(vec![Value::from("kv_event_stream")]))
    );
    assert_eq!(c.call(Op::Clear, &[Value::Boolean(false)]).unwrap(), None, "clear is void");
}

#[test]
fn zero_hits_until_a_worker_registers_and_status_is_exactly_once() {
    let s = server("zero");
    let mut c = client(&s);
    let key = CacheKey::whole(model_m(), "r1", tokens(1, 40), CHUNK);
    assert_eq!(c.lookup(&key).unwrap(), 0);
    let pool = register(&mut c, 7, 1);
    assert_eq!(store(&mut c, &pool, &key.for_worker(0), 7, |i| i as u8 + 1), 2);
    // Visible to the very next lookup (LMCache replies before committing).
    assert_eq!(c.lookup(&key).unwrap(), 2);
    let again = c.call(Op::QueryPrefetchStatus, &[Value::from("r1")]).unwrap();
    assert_eq!(again, Some(Value::from(0)), "hit count must be handed out once");
    // A resident key is never rewritten: a second prepare offers no slots.
    assert!(c.prepare_store(&key.for_worker(0), 7).unwrap().is_empty());
}

#[test]
fn engine_driven_round_trip_is_byte_exact() {
    let s = server("rt");
    let mut c = client(&s);
    let pool = register(&mut c, 9, 1);
    let key = CacheKey::whole(model_m(), "r", tokens(5, 64), CHUNK);
    assert_eq!(store(&mut c, &pool, &key.for_worker(0), 9, |i| 0x40 + i as u8), 4);
    assert_eq!(c.lookup(&key).unwrap(), 4);
    let slots = c.prepare_retrieve(&key.for_worker(0), 9).unwrap().expect("all chunks present");
    assert_eq!(slots.len(), 4);
    for (i, slot) in slots.iter().enumerate() {
        let mut buf = vec![0u8; slot.length as usize];
        pool.read(slot.offset, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0x40 + i as u8), "chunk {i} came back wrong");
        assert_eq!(slot.length, 2 * LAYERS * CHUNK as u64 * HIDDEN * 2);
    }
    assert!(c.commit_retrieve(&key.for_worker(0), 9).unwrap());
    c.end_session("r").unwrap();
    let m = s.state().metrics.encode();
    for line in [
        "lmcache_mp_l1_write_chunks_total 4",
        "lmcache_mp_l1_read_chunks_total 4",
        "lmcache_mp_lookup_hit_tokens_total 64",
        "lmcache_mp_num_finished_stores_total 1",
    ] {
        assert!(m.lines().any(|l| l == line), "{line} missing in:\n{m}");
    }
    // A prefix of the same tokens hits; a different prefix does not.
    let prefix = CacheKey::whole(model_m(), "p", tokens(5, 32), CHUNK);
    assert_eq!(c.lookup(&prefix).unwrap(), 2);
    let other = CacheKey::whole(model_m(), "o", tokens(6, 64), CHUNK);
    assert_eq!(c.lookup(&other).unwrap(), 0);
    // Another tenant does not see it.
    let mut salted = CacheKey::whole(model_m(), "s", tokens(5, 64), CHUNK);
    salted.cache_salt = CacheSalt::new("tenant-b").unwrap();
    assert_eq!(c.lookup(&salted).unwrap(), 0);
}

#[test]
fn a_chunk_hits_only_when_every_shard_has_it() {
    let s = server("shards");
    let mut c = client(&s);
    let pool = register(&mut c, 1, 2);
    register(&mut c, 2, 2);
    let mut key = CacheKey::whole(model_m(), "r", tokens(9, 48), CHUNK);
    key.world_size = 2;
    store(&mut c, &pool, &key.for_worker(0), 1, |_| 1);
    assert_eq!(c.lookup(&key).unwrap(), 0, "shard 1 has nothing yet");
    let mut two = key.for_worker(1);
    two.end = 2 * CHUNK;
    store(&mut c, &pool, &two, 2, |_| 2);
    assert_eq!(c.lookup(&key).unwrap(), 2, "hit = shortest shard prefix");
}

#[test]
fn malformed_requests_get_typed_failures_and_the_server_keeps_serving() {
    let s = server("bad");
    let mut c = client(&s);
    let enc = |v: Value| value::encode(&v);
    // Store with a wrong-typed parameter: the typed failure (b"", false).
    c.send_frames(&[
        enc(Value::from(100)),
        enc(Value::from(6)),
        enc(Value::from("not a key")),
        enc(Value::from(1)),
        enc(Value::Array(vec![])),
        enc(Value::Binary(vec![])),
    ])
    .unwrap();
    let r = c.recv_frames().unwrap().expect("store must be answered");
    assert_eq!(r.len(), 3);
    assert_eq!(r[2], vec![0x92, 0xc4, 0x00, 0xc2], "(b\"\", False)");
    // Unknown op id: a void reply, echoing uid and op.
    c.send_frames(&[enc(Value::from(101)), enc(Value::from(99))]).unwrap();
    let r = c.recv_frames().unwrap().expect("unknown op must be answered");
    assert_eq!(r, vec![enc(Value::from(101)), enc(Value::from(99))]);
    // Garbage msgpack in a parameter of commit_store: False.
    c.send_frames(&[enc(Value::from(102)), enc(Value::from(17)), vec![0xdc, 0xff]]).unwrap();
    let r = c.recv_frames().unwrap().expect("commit_store must be answered");
    assert_eq!(r[2], vec![0xc2]);
    // Wrong parameter count for ping: still true (liveness).
    c.send_frames(&[enc(Value::from(103)), enc(Value::from(22))]).unwrap();
    assert_eq!(c.recv_frames().unwrap().unwrap()[2], vec![0xc3]);
    // Lookup whose range exceeds its tokens: answered, zero hits.
    let mut k = CacheKey::whole(model_m(), "bad", tokens(1, 16), CHUNK);
    k.end = 64;
    assert_eq!(c.lookup(&k).unwrap(), 0);
    // Unregistered instance: explicit failures, not silence.
    let key = CacheKey::whole(model_m(), "x", tokens(1, 32), CHUNK).for_worker(0);
    assert!(c.prepare_retrieve(&key, 12345).unwrap().is_none());
    assert!(!c.commit_store(&key, 12345).unwrap());
    // Everything was counted, and the server still works.
    let metrics = s.state().metrics.encode();
    assert!(
        metrics.contains("lmcache_rs_mp_request_errors_total{op=\"store\",kind=\"wrong_type\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("lmcache_rs_mp_request_seconds_count{op=\"lookup\"}"), "{metrics}");
    assert_eq!(c.get_chunk_size().unwrap(), CHUNK as u64);
}

#[test]
fn replies_are_not_blocked_by_many_pipelined_requests() {
    let s = server("pipe");
    let c = client(&s);
    let enc = |v: Value| value::encode(&v);
    for uid in 0..200u64 {
        c.send_frames(&[enc(Value::from(uid)), enc(Value::from(21))]).unwrap();
    }
    let mut seen = std::collections::HashSet::new();
    for _ in 0..200 {
        let r = c.recv_frames().unwrap().expect("reply");
        seen.insert(r[0].clone());
    }
    assert_eq!(seen.len(), 200, "exactly one reply per request");
}

#[test]
fn an_unknown_worker_is_told_once_so_that_it_registers_again() {
    let s = server("told");
    let mut c = client(&s);
    // A worker the server does not know (it restarted, or reaped it): one false, then true
    // (LMCache's vLLM adapter re-registers on that false-to-true edge).
    assert!(!c.ping(Some(77)).unwrap(), "the first ping of an unknown worker");
    assert!(c.ping(Some(77)).unwrap(), "only once");
    assert!(c.ping(None).unwrap(), "an untracked prober is always answered true");
    let _pool = register(&mut c, 77, 1);
    assert!(c.ping(Some(77)).unwrap());
    assert!(c.ping(Some(77)).unwrap());
}

#[test]
fn silent_workers_are_reaped_and_lookups_then_miss() {
    // A server whose reaper drops workers after 100 ms of silence.
    let s = server_with("reap", |c| {
        c.worker_reap_timeout = Duration::from_millis(100);
        c.worker_registration_grace = Duration::from_millis(100);
    });
    let mut c = client(&s);
    let pool = register(&mut c, 5, 1);
    assert!(c.ping(Some(5)).unwrap());
    let key = CacheKey::whole(model_m(), "r", tokens(3, 32), CHUNK);
    store(&mut c, &pool, &key.for_worker(0), 5, |_| 9);
    assert_eq!(c.lookup(&key).unwrap(), 2);
    std::thread::sleep(Duration::from_millis(400));
    let key2 = CacheKey { request_id: "r2".into(), ..key.clone() };
    assert_eq!(c.lookup(&key2).unwrap(), 0, "a reaped worker's model must not hit");
    assert!(!c.commit_store(&key.for_worker(0), 5).unwrap(), "transfers of a reaped worker fail");
}

fn batch_events(frames: &[Vec<u8>]) -> (Vec<Value>, u64) {
    let v = value::decode(2, &frames[2]).unwrap();
    let f = value::Fields::of("batch", &v).unwrap();
    assert_eq!(f.req("enabled").unwrap(), &Value::Boolean(true));
    let cursor = value::u64_("next_cursor", f.req("next_cursor").unwrap()).unwrap();
    (value::array("events", f.req("events").unwrap()).unwrap().to_vec(), cursor)
}

#[test]
fn kv_event_stream_announces_stores_and_removals_with_credits() {
    let s = server("events");
    let mut c = client(&s);
    let pool = register(&mut c, 3, 1);
    let sub = client(&s);
    let enc = |v: Value| value::encode(&v);
    let uid = enc(Value::from(900));
    let op = enc(Value::from("subscribe_kv_events"));
    sub.send_frames(&[
        uid.clone(),
        op.clone(),
        enc(Value::from(3)),
        enc(Value::from("m")),
        enc(Value::from(0)),
        enc(Value::from(16)),
    ])
    .unwrap();
    let first = sub.recv_frames().unwrap().expect("status batch at once");
    assert_eq!((&first[0], &first[1]), (&uid, &op));
    assert!(batch_events(&first).0.is_empty());
    // No credit left: a store is not delivered until the ack.
    let key = CacheKey::whole(model_m(), "r", tokens(4, 32), CHUNK);
    store(&mut c, &pool, &key.for_worker(0), 3, |_| 5);
    let early = sub.recv_frames_within(Duration::from_millis(300)).unwrap();
    assert_eq!(early, None, "a batch arrived before the ack granted a credit");
    sub.send_frames(&[uid.clone(), Vec::new(), b"ack".to_vec()]).unwrap();
    let got = sub.recv_frames().unwrap().expect("stored events after the ack");
    let (events, cursor) = batch_events(&got);
    assert_eq!(events.len(), 2, "one stored record per chunk");
    assert_eq!(cursor, 2);
    let e0 = value::Fields::of("e", &events[0]).unwrap();
    let e1 = value::Fields::of("e", &events[1]).unwrap();
    assert_eq!(e0.req("kind").unwrap(), &Value::from("stored"));
    assert_eq!(e0.req("parent_block_hash").unwrap(), &Value::Nil);
    let h0 = e0.req("block_hashes").unwrap().as_array().unwrap()[0].clone();
    assert_eq!(e1.req("parent_block_hash").unwrap(), &h0, "second chunk's parent is the first");
    let toks = value::array("t", e0.req("token_ids").unwrap()).unwrap();
    assert_eq!(toks.len(), CHUNK);
    let want = lmcache_core::TokenHasher::new(CHUNK).unwrap().hash_tokens(&tokens(4, 32));
    assert_eq!(h0, Value::Binary(want[0].0.to_vec()), "block hash is the LMCache chunk hash");
    // Removal: clear, ack, receive the removed records.
    c.call(Op::Clear, &[Value::Boolean(false)]).unwrap();
    sub.send_frames(&[uid.clone(), Vec::new(), b"ack".to_vec()]).unwrap();
    let got = sub.recv_frames().unwrap().expect("removed events");
    let (events, _) = batch_events(&got);
    assert_eq!(events.len(), 2);
    assert!(events.iter().all(|e| e.to_string().contains("removed")));
    // The worker unregisters: its stream ends with a payload-less frame.
    c.call(Op::UnregisterKvCacheEngineDrivenContext, &[Value::from(3)]).unwrap();
    let end = sub.recv_frames().unwrap().expect("end of the departed worker's stream");
    assert_eq!(end, vec![uid.clone(), op.clone()]);
    sub.send_frames(&[uid.clone(), Vec::new(), b"cancel".to_vec()]).unwrap();
    // A bad subscription (max_events 0) is ended at once with a payload-less frame.
    sub.send_frames(&[
        enc(Value::from(901)),
        op.clone(),
        enc(Value::from(4)),
        enc(Value::from("m")),
        enc(Value::from(0)),
        enc(Value::from(0)),
    ])
    .unwrap();
    let end = sub.recv_frames().unwrap().expect("end of stream");
    assert_eq!(end.len(), 2, "end-of-stream frames carry no payload");
}

/// A chunk evicted from L1 ("removed") and brought back from L2 by a lookup is in L1 again:
/// the stream announces it as stored again, with its hash and tokens (before, L2 loads were
/// never announced, so a subscriber kept the chunk as removed).
#[test]
fn chunks_a_lookup_brings_back_from_l2_are_announced_as_stored_again() {
    let s = server_with("events_l2", |c| {
        c.l2_adapters = vec![serde_json::json!({"type": "mock", "max_size_gb": 1})];
    });
    let mut c = client(&s);
    let pool = register(&mut c, 3, 1);
    let sub = client(&s);
    let enc = |v: Value| value::encode(&v);
    let uid = enc(Value::from(902));
    sub.send_frames(&[
        uid.clone(),
        enc(Value::from("subscribe_kv_events")),
        enc(Value::from(3)),
        enc(Value::from("m")),
        enc(Value::from(0)),
        enc(Value::from(16)),
    ])
    .unwrap();
    assert!(batch_events(&sub.recv_frames().unwrap().expect("status batch")).0.is_empty());
    let ack = || sub.send_frames(&[uid.clone(), Vec::new(), b"ack".to_vec()]).unwrap();
    let kinds = |events: &[Value]| -> Vec<(String, Value)> {
        events
            .iter()
            .map(|e| {
                let f = value::Fields::of("e", e).unwrap();
                let kind = f.req("kind").unwrap().as_str().unwrap().to_owned();
                (kind, f.req("block_hashes").unwrap().as_array().unwrap()[0].clone())
            })
            .collect()
    };
    let key = CacheKey::whole(model_m(), "r", tokens(7, 32), CHUNK);
    assert_eq!(store(&mut c, &pool, &key.for_worker(0), 3, |i| 0x30 + i as u8), 2);
    ack();
    let stored = kinds(&batch_events(&sub.recv_frames().unwrap().expect("stored")).0);
    assert_eq!(stored.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["stored", "stored"]);
    assert_eq!(s.state().storage.flush(Duration::from_secs(10)), 0, "write-behind unfinished");
    c.call(Op::Clear, &[Value::Boolean(true)]).unwrap();
    ack();
    let removed = kinds(&batch_events(&sub.recv_frames().unwrap().expect("removed")).0);
    assert!(removed.iter().all(|(k, _)| k == "removed"), "{removed:?}");
    // The lookup loads both chunks back from L2 into L1.
    let again = CacheKey { request_id: "again".into(), ..key.clone() };
    assert_eq!(c.lookup(&again).unwrap(), 2, "both chunks from L2");
    ack();
    let got = sub.recv_frames_within(Duration::from_secs(5)).unwrap().expect("the L2 reload");
    let (events, _) = batch_events(&got);
    assert_eq!(kinds(&events), stored, "the reloaded chunks are stored again, hashes as before");
    let e0 = value::Fields::of("e", &events[0]).unwrap();
    let toks = value::array("t", e0.req("token_ids").unwrap()).unwrap();
    assert_eq!(toks.len(), CHUNK, "with their tokens");
    c.end_session("again").unwrap();
}

#[test]
fn an_l2_prefetch_is_waited_on_not_polled_and_its_hits_come_once() {
    // A slow L2 (250 ms a call): chunks evicted from L1 come back through a prefetch.
    let s = server_with("l2wait", |c| {
        c.l2_adapters =
            vec![serde_json::json!({"type": "mock", "max_size_gb": 1, "latency_ms": 250})];
    });
    let mut c = client(&s);
    let pool = register(&mut c, 3, 1);
    let key = CacheKey::whole(model_m(), "w", tokens(11, 64), CHUNK);
    assert_eq!(store(&mut c, &pool, &key.for_worker(0), 3, |i| 0x10 + i as u8), 4);
    assert_eq!(s.state().storage.flush(Duration::from_secs(10)), 0, "write-behind unfinished");
    s.state().l1().clear(true);

    // lookup, then wait: it returns when the prefetch ends, with every chunk, well before the
    // 5 s asked, and answers exactly once.
    let lookup = |c: &mut Client, id: &str| {
        let mut k = CacheKey::whole(model_m(), id, tokens(11, 64), CHUNK);
        k.request_id = id.into();
        assert_eq!(c.call(Op::Lookup, &[k.encode(), Value::from(3u64)]).unwrap(), None);
    };
    lookup(&mut c, "w");
    assert_eq!(c.call(Op::QueryPrefetchStatus, &[Value::from("w")]).unwrap(), Some(Value::Nil));
    let t0 = std::time::Instant::now();
    let v = c.call(Op::WaitPrefetchStatus, &[Value::from("w"), Value::from(5.0)]).unwrap();
    assert_eq!(v, Some(Value::from(4u64)), "all 4 chunks from L2");
    assert!(t0.elapsed() < Duration::from_secs(3), "wait took {:?}", t0.elapsed());
    assert_eq!(
        c.call(Op::QueryPrefetchStatus, &[Value::from("w")]).unwrap(),
        Some(Value::from(0u64)),
        "the hits are handed out once"
    );
    let slots = c.prepare_retrieve(&key.for_worker(0), 3).unwrap().expect("chunks back in L1");
    for (i, slot) in slots.iter().enumerate() {
        let mut buf = vec![0u8; slot.length as usize];
        pool.read(slot.offset, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0x10 + i as u8), "chunk {i} came back wrong");
    }
    assert!(c.commit_retrieve(&key.for_worker(0), 3).unwrap());
    c.end_session("w").unwrap();
    let m = s.state().metrics.encode();
    assert!(m.lines().any(|l| l == "lmcache_mp_lookup_hit_l2_tokens_total 64"), "{m}");

    // A wait shorter than the prefetch answers nil. A repeated lookup abandons the first
    // prefetch (its result is dropped when it ends) and answers for the second; once both
    // have ended, no lease of either is left: nothing in L1 stays locked.
    s.state().l1().clear(true);
    lookup(&mut c, "x");
    let v = c.call(Op::WaitPrefetchStatus, &[Value::from("x"), Value::from(0.01)]).unwrap();
    assert_eq!(v, Some(Value::Nil));
    lookup(&mut c, "x");
    let v = c.call(Op::WaitPrefetchStatus, &[Value::from("x"), Value::from(5.0)]).unwrap();
    assert!(matches!(v, Some(Value::Integer(_))), "{v:?}");
    c.end_session("x").unwrap();
    let t0 = std::time::Instant::now();
    while s.state().l1().usage().locked_objects > 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "an abandoned prefetch kept its leases");
        std::thread::sleep(Duration::from_millis(20));
    }

    // The Rust client's lookup (what `lmcache-rs bench server` uses) waits out a pending
    // prefetch instead of failing on its nil status.
    s.state().l1().clear(true);
    let k = CacheKey::whole(model_m(), "y", tokens(11, 64), CHUNK);
    assert_eq!(c.lookup(&k).unwrap(), 4, "a lookup served from L2");
    c.end_session("y").unwrap();
}

/// A retrieve spends the locks its lookup took instead of locking every chunk again: what the
/// lookup promised is served even if the objects were unindexed since (a forced clear), and a
/// failed prepare never releases another reader's share.
#[test]
fn a_retrieve_spends_the_lookups_locks() {
    let s = server("spend");
    let mut c = client(&s);
    let pool = register(&mut c, 4, 1);
    let stored = CacheKey::whole(model_m(), "r", tokens(21, 32), CHUNK);
    assert_eq!(store(&mut c, &pool, &stored.for_worker(0), 4, |i| 0x40 + i as u8), 2);
    // Three chunks asked, two held; two readers each get a lock on the two hits.
    let mut key = CacheKey::whole(model_m(), "r", tokens(21, 48), CHUNK);
    key.num_kv_readers = 2;
    assert_eq!(c.lookup(&key).unwrap(), 2);
    assert_eq!(s.state().l1().usage().locked_objects, 2);
    // Unindexed objects keep their memory while a lock is held: the bytes in use tell.
    let held = |s: &Server| s.state().l1().usage().used_bytes;
    let two = held(&s);
    s.state().l1().clear(true);
    assert_eq!(held(&s), two, "a forced clear freed memory under a lock");

    // Reader A asks for all three chunks: the third is missing, so it fails, having spent
    // A's locks; its commit must not release B's.
    let all = key.for_worker(0);
    assert!(c.prepare_retrieve(&all, 4).unwrap().is_none());
    assert!(!c.commit_retrieve(&all, 4).unwrap());
    assert_eq!(held(&s), two, "reader B's locks were released by reader A's commit");

    // Reader B asks for the two hits: served from the lookup's locks, although a forced clear
    // unindexed both objects after the lookup.
    let hits = CacheKey { end: 32, ..key.for_worker(0) };
    let slots = c.prepare_retrieve(&hits, 4).unwrap().expect("the lookup's hits are served");
    assert_eq!(slots.len(), 2);
    for (i, slot) in slots.iter().enumerate() {
        let mut buf = vec![0u8; slot.length as usize];
        pool.read(slot.offset, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0x40 + i as u8), "chunk {i} came back wrong");
    }
    assert!(c.commit_retrieve(&hits, 4).unwrap());
    assert_eq!(held(&s), 0, "every lock was spent once");
    // Nothing is left to spend, and the objects are gone from the index.
    assert!(c.prepare_retrieve(&hits, 4).unwrap().is_none());
}

/// Two requests of one instance over the same tokens, in both orders: neither commits,
/// releases or replaces the other's reservations or read leases.
#[test]
fn requests_on_the_same_prefix_never_touch_each_others_transfers() {
    let s = server("isolate");
    let mut c = client(&s);
    let pool = register(&mut c, 8, 1);
    let tokens = tokens(31, 32);
    let a = CacheKey::whole(model_m(), "a", tokens.clone(), CHUNK).for_worker(0);
    let b = CacheKey::whole(model_m(), "b", tokens.clone(), CHUNK).for_worker(0);

    // Stores. A reserves both chunks; B finds them being written and gets slots of its own
    // (it never counts on A finishing): no slot is shared.
    let slots_a = c.prepare_store(&a, 8).unwrap();
    assert_eq!(slots_a.len(), 2);
    let slots_b = c.prepare_store(&b, 8).unwrap();
    assert_eq!(slots_b.len(), 2);
    for ((_, sa), (_, sb)) in slots_a.iter().zip(&slots_b) {
        assert_ne!(sa.offset, sb.offset, "B was handed A's memory");
    }
    // B commits first: its own bytes become visible, never A's half-written ones.
    for (i, slot) in &slots_b {
        pool.write(slot.offset, &vec![0x70 + *i as u8; slot.length as usize]).unwrap();
    }
    for (_, slot) in &slots_a {
        pool.write(slot.offset, &vec![0xAA; slot.length as usize / 2]).unwrap();
    }
    assert!(c.commit_store(&b, 8).unwrap(), "B's acknowledged store is not visible");
    assert_eq!(c.lookup(&CacheKey::whole(model_m(), "q1", tokens.clone(), CHUNK)).unwrap(), 2);
    c.end_session("q1").unwrap();
    // A finishes late: its commit succeeds (the chunks are visible) and changes nothing.
    for (_, slot) in &slots_a {
        pool.write(slot.offset, &vec![0xAB; slot.length as usize]).unwrap();
    }
    assert!(c.commit_store(&a, 8).unwrap(), "A's commit failed although its chunks are visible");
    assert_eq!(s.state().l1().usage().stats.superseded, 2);
    assert_eq!(s.state().l1().usage().resident_objects, 2);
    assert_eq!(s.state().l1().usage().staged_objects, 0, "A's copy was not dropped");

    // Retrieves. Both prepare; B's commit releases only B's leases, A still reads its slots.
    let ra = c.prepare_retrieve(&a, 8).unwrap().expect("A's chunks");
    let rb = c.prepare_retrieve(&b, 8).unwrap().expect("B's chunks");
    assert_eq!((ra.len(), rb.len()), (2, 2));
    assert!(c.commit_retrieve(&b, 8).unwrap());
    assert_eq!(s.state().l1().usage().locked_objects, 2, "B's commit released A's leases");
    s.state().l1().clear(false);
    assert_eq!(s.state().l1().usage().resident_objects, 2, "A's locked chunks were evicted");
    for (i, slot) in ra.iter().enumerate() {
        let mut buf = vec![0u8; slot.length as usize];
        pool.read(slot.offset, &mut buf).unwrap();
        assert!(buf.iter().all(|&x| x == 0x70 + i as u8), "chunk {i} is not the stored copy");
    }
    assert!(c.commit_retrieve(&a, 8).unwrap());
    assert_eq!(s.state().l1().usage().locked_objects, 0);
    // The other order: A commits first, then B.
    let ra = c.prepare_retrieve(&a, 8).unwrap().expect("A's chunks");
    let rb = c.prepare_retrieve(&b, 8).unwrap().expect("B's chunks");
    assert_eq!((ra.len(), rb.len()), (2, 2));
    assert!(c.commit_retrieve(&a, 8).unwrap());
    assert_eq!(s.state().l1().usage().locked_objects, 2, "A's commit released B's leases");
    assert!(c.commit_retrieve(&b, 8).unwrap());
    assert_eq!(s.state().l1().usage().locked_objects, 0);
}

/// commit_store answers true only when every chunk its prepare reserved became visible: a
/// client whose reservations expired (it took longer than the write lease) hears false, and
/// the chunks are not visible.
#[test]
fn commit_store_is_false_when_a_reservation_expired() {
    let s = server_with("expire", |c| {
        c.l1 = lmcache_l1::L1Config {
            write_ttl: Duration::from_millis(100),
            maintenance_interval: Duration::from_millis(20),
            ..lmcache_l1::L1Config::default()
        };
    });
    let mut c = client(&s);
    let pool = register(&mut c, 9, 1);
    let key = CacheKey::whole(model_m(), "slow", tokens(41, 32), CHUNK).for_worker(0);
    let slots = c.prepare_store(&key, 9).unwrap();
    assert_eq!(slots.len(), 2);
    std::thread::sleep(Duration::from_millis(400));
    for (i, slot) in &slots {
        pool.write(slot.offset, &vec![*i as u8; slot.length as usize]).unwrap();
    }
    assert!(!c.commit_store(&key, 9).unwrap(), "expired reservations reported committed");
    let q = CacheKey::whole(model_m(), "q", tokens(41, 32), CHUNK);
    assert_eq!(c.lookup(&q).unwrap(), 0);
    // In time, the same store commits.
    assert_eq!(store(&mut c, &pool, &key, 9, |i| i as u8), 2);
}

/// A retrieve hands out slots only for objects of the layout its instance registered: an
/// object stored by an instance with another layout is never given as a slot of the wrong
/// length.
#[test]
fn prepare_retrieve_checks_objects_against_the_registered_layout() {
    let s = server("layout");
    let mut c = client(&s);
    let pool = register(&mut c, 11, 1);
    let other = c.register_engine_driven(&registration(12, 1, 16, LAYERS * 2, HIDDEN)).unwrap();
    assert!(!other.shm_name.is_empty());
    let key = CacheKey::whole(model_m(), "r", tokens(41, 32), CHUNK).for_worker(0);
    assert_eq!(store(&mut c, &pool, &key, 11, |_| 3), 2);
    assert!(c.prepare_retrieve(&key, 11).unwrap().is_some(), "the storing layout is served");
    assert!(c.commit_retrieve(&key, 11).unwrap());
    assert!(
        c.prepare_retrieve(&key, 12).unwrap().is_none(),
        "objects of another layout were handed out as slots"
    );
    assert!(!c.commit_retrieve(&key, 12).unwrap());
    assert_eq!(s.state().l1().usage().locked_objects, 0, "a refused prepare kept its leases");
}

/// A panic, inside a handler or around it, on a worker thread or on the socket thread, gives
/// the client its operation's typed failure (never silence), is counted, and the server
/// keeps serving on the same threads.
#[test]
fn a_panic_in_or_around_a_handler_answers_the_typed_failure() {
    let s = server("panic");
    let mut c = client(&s);
    let pool = register(&mut c, 9, 1);
    let key = CacheKey::whole(model_m(), "p", tokens(77, 32), CHUNK);
    let faults = &s.state().faults;
    // Inside the commit_store handler (transfer pool): false, the store did nothing.
    *faults.panic_in_handler.lock() = Some("commit_store");
    let slots = c.prepare_store(&key.for_worker(0), 9).unwrap();
    assert_eq!(slots.len(), 2);
    assert!(!c.commit_store(&key.for_worker(0), 9).unwrap(), "a panicked commit said true");
    *faults.panic_in_handler.lock() = None;
    // After the lookup handler answered (socket thread): the lookup's typed failure, 0 hits.
    *faults.panic_after_handler.lock() = Some("lookup");
    assert_eq!(c.lookup(&key).unwrap(), 0);
    *faults.panic_after_handler.lock() = None;
    // After the prepare_store handler (transfer pool): no slots offered.
    *faults.panic_after_handler.lock() = Some("prepare_store");
    assert!(c.prepare_store(&key.for_worker(0), 9).unwrap_or_default().is_empty());
    *faults.panic_after_handler.lock() = None;
    let m = s.state().metrics.encode();
    assert!(m.lines().any(|l| l == "lmcache_rs_handler_panics_total 3"), "{m}");
    // The same threads serve on: the whole store and lookup work.
    assert_eq!(store(&mut c, &pool, &key.for_worker(0), 9, |i| i as u8 + 1), 2);
    assert_eq!(c.lookup(&key).unwrap(), 2);
}

#[test]
fn engine_driven_stores_land_in_the_objects_of_a_warm_restart_segment() {
    // L1 as a warm-restart file in /dev/shm: engines map it by name, and the pool starts
    // after the file's catalog, so every offset the server hands out is shifted by it.
    let name = format!("lmcache_rs_mp_test_warmshm_{}", std::process::id());
    let path = std::path::Path::new("/dev/shm").join(&name);
    let _ = std::fs::remove_file(&path);
    let s = server_with("warmshm", |c| {
        c.arena.backing = ArenaBacking::File(lmcache_memory::FileBacking {
            path: path.clone(),
            format: false,
            adopt: true,
        });
    });
    let mut c = client(&s);
    let reg = c.register_engine_driven(&registration(3, 1, 16, LAYERS, HIDDEN)).unwrap();
    assert_eq!(reg.shm_name, name);
    let base = s.state().l1().memory().arena().engine_segment().unwrap().base;
    assert!(base > 0);
    assert_eq!(reg.pool_size, std::fs::metadata(&path).unwrap().len());
    let pool = ForeignSegment::open(&reg.shm_name, reg.pool_size).unwrap();
    let key = CacheKey::whole(model_m(), "r", tokens(11, 64), CHUNK);
    assert_eq!(store(&mut c, &pool, &key.for_worker(0), 3, |i| 0x60 + i as u8), 4);
    // The server's own objects hold what the engine wrote (read through L1, not the pool).
    let l1 = s.state().l1();
    let mut seen: Vec<u8> = l1
        .resident_keys()
        .into_iter()
        .map(|(k, _)| {
            let lease = l1.read_lock(&[k], 1).pop().unwrap().unwrap();
            let b = lease.bytes();
            assert!(b.iter().all(|&x| x == b[0]), "an object mixes bytes");
            b[0]
        })
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, vec![0x60, 0x61, 0x62, 0x63]);
    let slots = c.prepare_retrieve(&key.for_worker(0), 3).unwrap().expect("all chunks present");
    for (i, slot) in slots.iter().enumerate() {
        assert!(slot.offset >= base, "an offset inside the catalog");
        let mut buf = vec![0u8; slot.length as usize];
        pool.read(slot.offset, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0x60 + i as u8), "chunk {i} came back wrong");
    }
    assert!(c.commit_retrieve(&key.for_worker(0), 3).unwrap());
    drop(c);
    drop(pool);
    drop(s);
    // The L1 file and what the server keeps beside it (registrations, tokens).
    for suffix in ["", ".lmcache-rs-workers", ".lmcache-rs-tokens"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}
