//! Shared helpers of the server's tests: the HTTP ones here, CacheBlend's in `blend`, a
//! 32 MiB-chunk engine's in `chunks32`.
#![allow(dead_code, missing_docs, clippy::allow_attributes)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use lmcache_server::Server;

pub mod blend;
pub mod chunks32;

/// An engine-driven registration of a small model (`[2, 2 layers, chunk slots, 32]`, blocks
/// of 16 tokens, one shard).
pub fn small_registration(
    instance_id: u64,
    model: &str,
    dtype: lmcache_core::Dtype,
) -> lmcache_protocol::types::EngineDrivenRegistration {
    lmcache_protocol::types::EngineDrivenRegistration {
        instance_id,
        model_name: lmcache_core::ModelName::new(model).unwrap(),
        world_size: 1,
        block_size: 16,
        num_layers: 2,
        hidden_dim_size: 32,
        dtype,
        use_mla: false,
        num_physical_slots: None,
    }
}

/// One request to the server's HTTP API, waiting at most `timeout` for the answer; returns
/// (status, body).
pub fn http_raw(
    s: &Server,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> (u16, String) {
    let mut c = TcpStream::connect(s.http_addr().unwrap()).unwrap();
    c.set_read_timeout(Some(timeout)).unwrap();
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    c.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

/// One fp16 paged KV layer of `shape` (`[2, NB, BS, H, D]`, contiguous) in a new shared-memory
/// segment `name`, as an lmcache-driven client registers it: the segment (removed when the
/// first value drops), the client's own mapping, and its descriptor.
pub fn cpu_shm_layer(
    name: &str,
    shape: Vec<u64>,
) -> (lmcache_memory::shm::ShmSegment, lmcache_memory::ForeignSegment, lmcache_client::IpcDescriptor)
{
    let mut stride = vec![1u64; shape.len()];
    for d in (0..shape.len() - 1).rev() {
        stride[d] = stride[d + 1] * shape[d + 1];
    }
    let bytes = shape.iter().product::<u64>() * 2;
    let owner = lmcache_memory::shm::ShmSegment::create(name, bytes).unwrap();
    let seg = lmcache_memory::ForeignSegment::open(name, bytes).unwrap();
    let desc = lmcache_client::IpcDescriptor::CpuShm {
        shm_name: name.to_owned(),
        nbytes: bytes,
        meta: lmcache_client::TensorMeta {
            dtype: lmcache_core::Dtype::Float16,
            shape,
            stride,
            storage_offset: 0,
            device_uuid: "cpu".into(),
        },
    };
    (owner, seg, desc)
}
