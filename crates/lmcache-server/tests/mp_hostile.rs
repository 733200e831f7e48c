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

    // Two KV groups (a hybrid model): refused, not half-registered.
    let group = |id| EngineGroupInfo {
        engine_group_id: id,
        layer_indices: vec![0],
        tokens_per_block: 16,
        sw_size_tokens: -1,
    };
    c.register_kv_cache(8, &good, "m", 1, &[group(0), group(1)]).unwrap();
    let reason = refusal(&s, 8).unwrap()["reason"].as_str().unwrap().to_owned();
    assert!(reason.contains("KV groups"), "{reason}");

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
    assert!(metric(&s, "lmcache_rs_refused_registrations_total 3"));
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
    let reg = lmcache_client::EngineDrivenRegistration {
        instance_id: 4,
        model_name: ModelName::new("m").unwrap(),
        world_size: 1,
        block_size: 16,
        num_layers: 2,
        hidden_dim_size: 32,
        dtype: Dtype::Float16,
        use_mla: false,
        num_physical_slots: None,
    };
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
