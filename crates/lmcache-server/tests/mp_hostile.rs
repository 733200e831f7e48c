//! Hostile and unservable input over real ZMQ: registrations the server cannot serve are
//! refused loudly (log, `/status`, count, typed failures later), numbers from the wire never
//! overflow, and messages without a usable header are handled as documented.

use std::time::Duration;

use lmcache_client::{CacheKey, Client, EngineGroupInfo, IpcDescriptor, TensorMeta};
use lmcache_core::{Dtype, ModelName};
use lmcache_memory::shm::ShmSegment;
use lmcache_memory::{ArenaBacking, ArenaConfig};
use lmcache_protocol::{Op, value};
use lmcache_server::{Server, ServerConfig};
use rmpv::Value;
use serde_json::Value as Json;

mod common;

const CHUNK: usize = 16;

fn server(backing: ArenaBacking) -> Server {
    Server::start(ServerConfig {
        chunk_size: CHUNK,
        http_port: Some(0),
        ..ServerConfig::local(ArenaConfig { size: 16 << 20, backing, mlock: false })
    })
    .unwrap()
}

fn shm_server(tag: &str) -> Server {
    let name = format!("lmcache_rs_hostile_{tag}_{}", std::process::id());
    server(ArenaBacking::SharedMemory { name })
}

fn client(s: &Server) -> Client {
    Client::connect(s.endpoint(), Duration::from_secs(5)).unwrap()
}

fn status(s: &Server) -> Json {
    let (code, body) = common::http_raw(s, "GET", "/status", None, Duration::from_secs(5));
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

fn refusal(s: &Server, id: u64) -> Option<Json> {
    status(s)["refused_instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["instance_id"] == id)
        .cloned()
}

/// A vLLM flash-attn layer tensor `[2, NB, BS, NH, HS]` float16 in `seg`.
fn layer(seg: &str, nbytes: u64, nb: u64, bs: u64, nh: u64, hs: u64) -> IpcDescriptor {
    IpcDescriptor::CpuShm {
        shm_name: seg.to_owned(),
        nbytes,
        meta: TensorMeta {
            dtype: Dtype::Float16,
            shape: vec![2, nb, bs, nh, hs],
            stride: vec![nb * bs * nh * hs, bs * nh * hs, nh * hs, hs, 1],
            storage_offset: 0,
            device_uuid: "cpu".into(),
        },
    }
}

fn store_request(c: &mut Client, id: u64) -> Option<Value> {
    let key = CacheKey::whole(ModelName::new("m").unwrap(), "r", vec![1; CHUNK], CHUNK);
    let blocks = Value::Array(vec![Value::Array(vec![Value::from(1)])]);
    let params = [key.for_worker(0).encode(), Value::from(id), blocks, Value::Binary(vec![])];
    c.call(Op::Store, &params).unwrap()
}

fn metric(s: &Server, line: &str) -> bool {
    s.state().metrics.encode().lines().any(|l| l == line)
}

#[test]
fn unservable_registrations_are_refused_loudly_and_later_ops_name_why() {
    let s = shm_server("refuse");
    let mut c = client(&s);
    // A CUDA descriptor: this server copies on the CPU.
    let cuda = IpcDescriptor::Device { kind: "cuda".into() };
    c.register_kv_cache(7, &[cuda], "m", 1, &[]).unwrap();
    let r = refusal(&s, 7).expect("a CUDA registration must show as refused");
    assert_eq!(r["model_name"], "m");
    assert_eq!(r["transfer_mode"], "lmcache_driven");
    let reason = r["reason"].as_str().unwrap();
    assert!(reason.contains("cuda") && reason.contains("engine_driven"), "{reason}");
    assert!(status(&s)["registered_instances"].as_array().unwrap().is_empty());
    // Each later operation fails with its typed failure, counted under the refusal.
    assert_eq!(store_request(&mut c, 7), Some(lmcache_protocol::types::transfer_result(false)));
    assert!(metric(&s, "lmcache_rs_mp_request_errors_total{op=\"store\",kind=\"not_servable\"} 1"));

    // A good segment for the next registrations: one layer of [2, 8, 16, 2, 8] float16.
    let seg = format!("lmrs_hostile_kv_{}", std::process::id());
    let bytes = 2 * 8 * 16 * 2 * 8 * 2;
    let _owner = ShmSegment::create(&seg, bytes).unwrap();
    let good = [layer(&seg, bytes, 8, 16, 2, 8)];

    // Two KV groups that disagree with the tensors (both claim layer 0; one kernel group
    // forms): refused, not half-registered.
    let group = |id| EngineGroupInfo::full(id, vec![0], 16);
    c.register_kv_cache(8, &good, "m", 1, &[group(0), group(1)]).unwrap();
    let reason = refusal(&s, 8).unwrap()["reason"].as_str().unwrap().to_owned();
    assert!(reason.contains("engine_group_infos"), "{reason}");
    // A group naming a layer that was not registered.
    c.register_kv_cache(8, &good, "m", 1, &[EngineGroupInfo::full(0, vec![0, 3], 16)]).unwrap();
    let reason = refusal(&s, 8).unwrap()["reason"].as_str().unwrap().to_owned();
    assert!(reason.contains("layer 3") && reason.contains("1 registered"), "{reason}");

    // A shape whose products overflow u64: a refusal naming it (this panicked the transfer
    // thread in debug builds, so the registration and every later transfer of the client
    // went unanswered).
    let big = 1u64 << 40;
    let overflow = IpcDescriptor::CpuShm {
        shm_name: seg.clone(),
        nbytes: bytes,
        meta: TensorMeta {
            dtype: Dtype::Float16,
            shape: vec![2, 1, big, big, big],
            stride: vec![1, 1, 1, big, 1],
            storage_offset: 0,
            device_uuid: "cpu".into(),
        },
    };
    c.register_kv_cache(9, &[overflow], "m", 1, &[]).unwrap();
    let reason = refusal(&s, 9).unwrap()["reason"].as_str().unwrap().to_owned();
    assert!(reason.contains("overflow"), "{reason}");
    assert!(metric(&s, "lmcache_rs_refused_registrations_total 4"));
    assert!(metric(&s, "lmcache_rs_handler_panics_total 0"), "nothing may panic on the way");

    // Registering properly clears the refusal; the worker's stores then work.
    c.register_kv_cache(7, &good, "m", 1, &[group(0)]).unwrap();
    assert!(refusal(&s, 7).is_none());
    let registered = status(&s)["registered_instances"].as_array().unwrap().len();
    assert_eq!(registered, 1);
    let ok = store_request(&mut c, 7).unwrap();
    assert_eq!(ok, lmcache_protocol::types::transfer_result(true));
    // The CLI's `describe kvcache` reads the same /status: the refusals are in it.
    assert_eq!(status(&s)["refused_instances"].as_array().unwrap().len(), 2);
}

#[test]
fn engine_driven_registrations_the_pool_cannot_serve_are_refused() {
    // A private L1 (no POSIX shm name): the client would fall back to pickle mode, which
    // this server does not serve, so every store would fail. Refused at registration.
    let s = server(ArenaBacking::Anonymous);
    let mut c = client(&s);
    let reg = common::small_registration(4, "m", Dtype::Float16);
    let pool = c.register_engine_driven(&reg).unwrap();
    assert_eq!((pool.shm_name.as_str(), pool.pool_size), ("", 0));
    let r = refusal(&s, 4).expect("refused");
    assert_eq!(r["transfer_mode"], "engine_driven");
    assert!(r["reason"].as_str().unwrap().contains("shared memory"), "{r}");
    let key = CacheKey::whole(reg.model_name.clone(), "r", vec![3; 32], CHUNK).for_worker(0);
    assert!(c.prepare_store(&key, 4).unwrap().is_empty());
    assert!(!c.commit_store(&key, 4).unwrap());
    let errors = s.state().metrics.encode();
    for op in ["prepare_store", "commit_store"] {
        let line =
            format!("lmcache_rs_mp_request_errors_total{{op=\"{op}\",kind=\"not_servable\"}} 1");
        assert!(errors.contains(&line), "{op}: {errors}");
    }

    // An L1 in a file (--l1-devdax-path): refused, naming the flag and the mode that works.
    let dir = tempfile::tempdir().unwrap();
    let s = server(ArenaBacking::File(lmcache_memory::FileBacking {
        path: dir.path().join("l1"),
        format: false,
        adopt: false,
    }));
    let mut c = client(&s);
    assert_eq!(c.register_engine_driven(&reg).unwrap().pool_size, 0);
    let r = refusal(&s, 4).expect("refused");
    let reason = r["reason"].as_str().unwrap();
    assert!(reason.contains("--l1-devdax-path") && reason.contains("lmcache_driven"), "{r}");

    // A layout larger than the pool, on a shared pool: refused the same way.
    let s = shm_server("toolarge");
    let mut c = client(&s);
    let huge = lmcache_client::EngineDrivenRegistration { num_layers: 1 << 20, ..reg };
    assert_eq!(c.register_engine_driven(&huge).unwrap().pool_size, 0);
    let r = refusal(&s, 4).expect("refused");
    assert!(r["reason"].as_str().unwrap().contains("does not fit"), "{r}");
}

#[test]
fn a_kv_event_cursor_at_u64_max_does_not_stop_the_server() {
    let s = shm_server("cursor");
    let c = client(&s);
    let enc = |v: Value| value::encode(&v);
    // subscribe_kv_events(instance_id, model, cursor = u64::MAX, max_events): the first
    // batch says records were lost (a cursor from the future). This overflowed on the
    // socket thread, which took the whole server down in debug builds.
    c.send_frames(&[
        enc(Value::from(1)),
        enc(Value::from("subscribe_kv_events")),
        enc(Value::from(3)),
        enc(Value::from("m")),
        enc(Value::from(u64::MAX)),
        enc(Value::from(8)),
    ])
    .unwrap();
    let r = c.recv_frames().unwrap().expect("first batch");
    let batch = value::decode(2, &r[2]).unwrap();
    let f = value::Fields::of("batch", &batch).unwrap();
    assert_eq!(f.req("lost").unwrap(), &Value::Boolean(true));
    let mut c2 = client(&s);
    assert_eq!(c2.get_chunk_size().unwrap(), CHUNK as u64, "server stopped serving");
    // A wait of NaN or infinite seconds: answered (0 hits: no such lookup), without a panic
    // (Duration::from_secs_f64(NaN) panics).
    for t in [f64::NAN, f64::INFINITY, -1.0] {
        let r = c2.call(Op::WaitPrefetchStatus, &[Value::from("none"), Value::F64(t)]).unwrap();
        assert_eq!(r, Some(Value::from(0)), "timeout {t}");
    }
    assert!(metric(&s, "lmcache_rs_handler_panics_total 0"));
}

#[test]
fn messages_without_a_usable_header_are_handled_as_documented() {
    let s = shm_server("frames");
    let c = Client::connect(s.endpoint(), Duration::from_secs(2)).unwrap();
    let enc = |v: Value| value::encode(&v);
    // Fewer than 3 frames: no op frame to echo, so nothing the client could match. Counted,
    // no reply.
    c.send_frames(&[enc(Value::from(1))]).unwrap();
    // An empty op frame is a stream control; anything but ack/cancel is dropped, counted.
    c.send_frames(&[enc(Value::from(2)), vec![], b"nack".to_vec()]).unwrap();
    c.send_frames(&[enc(Value::from(3)), vec![]]).unwrap();
    // An undecodable uid with a known op: the op's typed failure, uid frame echoed verbatim.
    c.send_frames(&[b"\xa1x".to_vec(), enc(Value::from(6))]).unwrap();
    let r = c.recv_frames().unwrap().expect("a store with a bad uid must be answered");
    assert_eq!(r, vec![b"\xa1x".to_vec(), enc(Value::from(6)), vec![0x92, 0xc4, 0x00, 0xc2]]);
    // (0xdc 0xff: an array16 header cut short, not msgpack.)
    c.send_frames(&[vec![0xdc, 0xff], enc(Value::from(22))]).unwrap();
    let r = c.recv_frames().unwrap().expect("a ping with a bad uid must be answered");
    assert_eq!(r, vec![vec![0xdc, 0xff], enc(Value::from(22)), vec![0xc3]]);
    // An op frame that is not msgpack: a void reply echoing both frames.
    c.send_frames(&[enc(Value::from(4)), vec![0xdc, 0xff]]).unwrap();
    let r = c.recv_frames().unwrap().expect("a bad op frame must be answered");
    assert_eq!(r, vec![enc(Value::from(4)), vec![0xdc, 0xff]]);
    // Nothing else arrives: the first three got no reply, and the server serves on.
    assert!(c.recv_frames().unwrap().is_none(), "a message without a usable header was answered");
    let mut c2 = client(&s);
    assert_eq!(c2.get_chunk_size().unwrap(), CHUNK as u64);
    let m = s.state().metrics.encode();
    for line in [
        "lmcache_rs_mp_request_errors_total{op=\"unknown\",kind=\"too_few_frames\"} 1",
        "lmcache_rs_mp_request_errors_total{op=\"unknown\",kind=\"unknown_op\"} 2",
        "lmcache_rs_mp_request_errors_total{op=\"store\",kind=\"wrong_type\"} 1",
        "lmcache_rs_mp_request_errors_total{op=\"ping\",kind=\"bad_msgpack\"} 1",
        "lmcache_rs_mp_request_errors_total{op=\"unknown\",kind=\"bad_msgpack\"} 1",
    ] {
        assert!(m.lines().any(|l| l == line), "missing {line}: {m}");
    }
}

/// Random msgpack values, nested a little, with the field names and numbers handlers read.
fn random_value(rng: &mut impl rand::Rng, depth: u32) -> Value {
    match rng.gen_range(0..if depth > 2 { 8 } else { 10 }) {
        0 => Value::Nil,
        1 => Value::Boolean(rng.r#gen()),
        2 => Value::from(rng.gen_range(-5i64..300)),
        3 => Value::from([0, 1, u64::MAX, u64::MAX / 2, 1 << 32, 1 << 63][rng.gen_range(0..6)]),
        4 => Value::from(["m", "", "a@b", "x/y", "req", "cpu_shm", "cuda"][rng.gen_range(0..7)]),
        5 => Value::Binary(vec![0xc1; rng.gen_range(0..4)]),
        6 => Value::F64([f64::NAN, f64::INFINITY, -1.0, 0.5, 1e300][rng.gen_range(0..5)]),
        7 => Value::Ext(rng.gen_range(0..3), vec![0x80; rng.gen_range(0..3)]),
        8 => Value::Array((0..rng.gen_range(0..5)).map(|_| random_value(rng, depth + 1)).collect()),
        _ => {
            let names = [
                "model_name",
                "world_size",
                "worker_id",
                "token_ids",
                "start",
                "end",
                "request_id",
                "cache_salt",
                "num_kv_readers",
                "instance_id",
                "type",
                "block_size",
                "num_layers",
                "hidden_dim_size",
                "dtype_str",
                "use_mla",
                "shape",
                "stride",
                "method",
            ];
            Value::Map(
                (0..rng.gen_range(0..10))
                    .map(|_| {
                        let k = Value::from(names[rng.gen_range(0..names.len())]);
                        (k, random_value(rng, depth + 1))
                    })
                    .collect(),
            )
        }
    }
}

/// True when `payload` (`None`: a void reply) has `op`'s response type, as LMCache's client
/// decodes it.
fn reply_fits(op: Op, payload: Option<&Value>) -> bool {
    let int = |v: &Value| matches!(v, Value::Integer(_));
    let map_with = |v: Option<&Value>, keys: &[&str]| match v {
        Some(Value::Map(m)) => keys.iter().all(|k| m.iter().any(|(x, _)| x.as_str() == Some(k))),
        _ => false,
    };
    match op {
        Op::Store | Op::Retrieve | Op::StoreQ | Op::CbRetrievePreComputed => matches!(
            payload,
            Some(Value::Array(a)) if a.len() == 2 && matches!(a[0], Value::Binary(_)) && a[1].is_bool()
        ),
        Op::CommitStore | Op::CommitRetrieve | Op::Ping => {
            matches!(payload, Some(Value::Boolean(_)))
        }
        Op::PrepareStore => map_with(payload, &[]),
        Op::PrepareRetrieve => map_with(payload, &["success"]),
        Op::QueryPrefetchStatus | Op::WaitPrefetchStatus => {
            payload.is_some_and(|v| int(v) || v.is_nil())
        }
        Op::RegisterKvCacheEngineDrivenContext => map_with(payload, &["shm_name", "pool_size"]),
        Op::GetChunkSize | Op::P2pLookupAndLock => payload.is_some_and(int),
        Op::GetExperimental | Op::CbReorderPlan => matches!(payload, Some(Value::Array(_))),
        Op::P2pQueryLookupResults => matches!(payload, Some(Value::Array(_) | Value::Nil) | None),
        Op::Noop => payload == Some(&Value::from("OK")),
        Op::CbProtocolHandshake => matches!(
            payload,
            Some(Value::Array(a)) if a.len() == 2 && int(&a[0]) && a[1].is_bool()
        ),
        Op::ServerModuleCall => map_with(payload, &["success", "payload", "error"]),
        // A request that fails gets an empty answer, never the void that means "still
        // loading, ask again" (which would keep its client asking).
        Op::CbUnifiedLookup => map_with(payload, &["prefix_coverage_tokens"]),
        // A stream: its first batch, or a payload-less end.
        Op::SubscribeKvEvents => payload.is_none() || map_with(payload, &["events"]),
        // Void operations (nil is read as None too).
        _ => payload.is_none_or(Value::is_nil),
    }
}

/// Every operation, with random uids (ints, strings, undecodable bytes), random parameter
/// counts and values: exactly one reply per request, of its operation's response type (a
/// subscription may also get its end of stream), none for messages without an op frame, and
/// nothing that panics.
#[test]
fn random_messages_to_every_op_get_one_reply_of_the_ops_type() {
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;
    let s = shm_server("fuzz");
    let c = Client::connect(s.endpoint(), Duration::from_secs(3)).unwrap();
    let seed = std::env::var("LMCACHE_RS_FUZZ_SEED").ok().and_then(|v| v.parse().ok());
    let seed = seed.unwrap_or(0x5eed_u64);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let ops: Vec<Op> = Op::all().collect();
    let mut sent: HashMap<Vec<u8>, Op> = HashMap::new();
    let mut headerless = 0;
    for i in 0..1500u64 {
        let uid = match rng.gen_range(0..10) {
            0 => value::encode(&Value::from(format!("u{i}"))),
            1 => [&[0xdc, 0xff][..], &i.to_le_bytes()].concat(),
            _ => value::encode(&Value::from((rng.r#gen::<u64>() & !0xffff) | i)),
        };
        if rng.gen_bool(0.02) {
            // No op frame at all.
            c.send_frames(&[uid]).unwrap();
            headerless += 1;
            continue;
        }
        let op = ops[i as usize % ops.len()];
        let op_value = match (op.id(), rng.gen_bool(0.5)) {
            (Some(id), true) => Value::from(id),
            _ => Value::from(op.name()),
        };
        let mut frames = vec![uid.clone(), value::encode(&op_value)];
        for _ in 0..rng.gen_range(0..9) {
            if rng.gen_bool(0.05) {
                frames.push((0..rng.gen_range(0..6)).map(|_| rng.r#gen::<u8>()).collect());
            } else {
                frames.push(value::encode(&random_value(&mut rng, 0)));
            }
        }
        c.send_frames(&frames).unwrap();
        sent.insert(uid, op);
    }
    let mut replies: HashMap<Vec<u8>, Vec<Option<Value>>> = HashMap::new();
    while let Some(r) = c.recv_frames().unwrap() {
        let payload = r.get(2).map(|p| value::decode(2, p).unwrap());
        replies.entry(r[0].clone()).or_default().push(payload);
    }
    for (uid, op) in &sent {
        let got = replies.remove(uid).unwrap_or_default();
        let first = got.first().unwrap_or_else(|| panic!("{op:?} (uid {uid:x?}) got no reply"));
        assert!(reply_fits(*op, first.as_ref()), "{op:?}: reply {first:?} is not its type");
        match (op, got.len()) {
            (_, 1) => {}
            (Op::SubscribeKvEvents, 2) => assert_eq!(got[1], None, "a stream ends payload-less"),
            _ => panic!("{op:?} (uid {uid:x?}) got {} replies: {got:?}", got.len()),
        }
    }
    assert!(replies.is_empty(), "replies to nothing that was sent: {replies:?}");
    let m = s.state().metrics.encode();
    let too_few = format!(
        "lmcache_rs_mp_request_errors_total{{op=\"unknown\",kind=\"too_few_frames\"}} {headerless}"
    );
    assert!(m.lines().any(|l| l == too_few), "{too_few}: {m}");
    assert!(metric(&s, "lmcache_rs_handler_panics_total 0"), "a handler panicked");
    let mut c = client(&s);
    assert_eq!(c.get_chunk_size().unwrap(), CHUNK as u64, "server stopped serving");
}

/// LMCache-driven registrations map only segments of the server's uid, never its own L1
/// pool, within --allowed-shm-prefix; a client that shrinks a mapped segment fails its own
/// transfers and nothing else.
#[test]
fn client_segments_must_be_the_clients_own_and_may_not_shrink_under_us() {
    let pool = format!("lmcache_rs_hostile_own_{}", std::process::id());
    let s = Server::start(ServerConfig {
        chunk_size: CHUNK,
        http_port: Some(0),
        allowed_shm_prefix: Some("lmrs_ok_".into()),
        ..ServerConfig::local(ArenaConfig {
            size: 16 << 20,
            backing: ArenaBacking::SharedMemory { name: pool.clone() },
            mlock: false,
        })
    })
    .unwrap();
    let mut c = client(&s);
    let pid = std::process::id();
    let bytes = 2 * 8 * 16 * 2 * 8 * 2;
    let reason = |c: &mut Client, id: u64, seg: &str| {
        c.register_kv_cache(id, &[layer(seg, bytes, 8, 16, 2, 8)], "m", 1, &[]).unwrap();
        refusal(&s, id).map(|r| r["reason"].as_str().unwrap().to_owned())
    };
    // Outside the prefix (checked before anything is opened).
    let outside = format!("lmrs_other_{pid}");
    let _o = ShmSegment::create(&outside, bytes).unwrap();
    assert!(reason(&mut c, 1, &outside).unwrap().contains("--allowed-shm-prefix"));
    // The server's own L1 pool, even under the prefix's rules: refused (without a prefix).
    let s2 = shm_server("ownpool");
    let own = s2.state().l1().memory().arena().shm_name().unwrap().to_owned();
    let mut c2 = client(&s2);
    c2.register_kv_cache(2, &[layer(&own, bytes, 8, 16, 2, 8)], "m", 1, &[]).unwrap();
    let r = refusal(&s2, 2).expect("own pool accepted");
    assert!(r["reason"].as_str().unwrap().contains("own L1 pool"), "{r}");
    // A segment of another user.
    let theirs = format!("lmrs_ok_theirs_{pid}");
    let t = ShmSegment::create(&theirs, bytes).unwrap();
    std::os::unix::fs::fchown(t.file(), Some(65534), Some(65534)).unwrap();
    assert!(reason(&mut c, 3, &theirs).unwrap().contains("owned by uid 65534"));
    // A good one registers; then its owner shrinks it: the store fails, the server lives.
    let good = format!("lmrs_ok_good_{pid}");
    let g = ShmSegment::create(&good, bytes).unwrap();
    assert_eq!(reason(&mut c, 4, &good), None);
    assert_eq!(store_request(&mut c, 4), Some(lmcache_protocol::types::transfer_result(true)));
    g.file().set_len(0).unwrap();
    let key = CacheKey::whole(ModelName::new("m").unwrap(), "r2", vec![2; CHUNK], CHUNK);
    let blocks = Value::Array(vec![Value::Array(vec![Value::from(1)])]);
    let params = [key.for_worker(0).encode(), Value::from(4), blocks, Value::Binary(vec![])];
    let r = c.call(Op::Store, &params).unwrap();
    assert_eq!(r, Some(lmcache_protocol::types::transfer_result(false)), "a shrunk segment");
    assert_eq!(c.get_chunk_size().unwrap(), CHUNK as u64, "the server died");
    assert!(s.state().l1().usage().resident_objects == 1, "the failed store left an object");
}

/// Every L1 of the server is its own, not only the first: a client naming the file of a
/// second L1 (here a file in /dev/shm, under the allowed prefix) as its segment is refused.
#[test]
fn a_client_may_not_name_any_of_the_servers_l1s_as_its_segment() {
    let pid = std::process::id();
    let member = format!("lmrs_ok_member_{pid}");
    let path = std::path::Path::new("/dev/shm").join(&member);
    let _ = std::fs::remove_file(&path);
    let arena = |backing| ArenaConfig { size: 16 << 20, backing, mlock: false };
    let s = Server::start(ServerConfig {
        chunk_size: CHUNK,
        http_port: Some(0),
        allowed_shm_prefix: Some("lmrs_ok_".into()),
        more_l1: vec![lmcache_storage::L1MemberConfig {
            tag: "second".into(),
            arena: arena(ArenaBacking::File(lmcache_memory::FileBacking {
                path: path.clone(),
                format: false,
                adopt: false,
            })),
            align: lmcache_memory::DEFAULT_ALIGN,
            l1: lmcache_l1::L1Config::default(),
        }],
        ..ServerConfig::local(arena(ArenaBacking::Anonymous))
    })
    .unwrap();
    let mut c = client(&s);
    let bytes = 2 * 8 * 16 * 2 * 8 * 2;
    c.register_kv_cache(1, &[layer(&member, bytes, 8, 16, 2, 8)], "m", 1, &[]).unwrap();
    let r = refusal(&s, 1).expect("the second L1's file was accepted as a client segment");
    assert!(r["reason"].as_str().unwrap().contains("own L1 pool (second)"), "{r}");
    drop(c);
    drop(s);
    std::fs::remove_file(&path).unwrap();
}
