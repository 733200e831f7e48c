//! gRPC request bodies (`--transport grpc`): any bytes, as the body of any method. The
//! protobuf decoder and its conversion to the ZMQ parameters never panic, and neither does the
//! typed command decoder over what comes out; a reply value of any shape is written as a
//! response or refused, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lmcache_protocol::grpc::{self, METHODS};
use lmcache_protocol::request::Command;

fuzz_target!(|input: (u8, Vec<u8>)| {
    let (which, body) = input;
    let method = METHODS[usize::from(which) % METHODS.len()];
    if let Ok(params) = grpc::decode_request(method.op, &body) {
        let _ = Command::decode(method.op, &params);
    }
    // The same bytes as msgpack: a reply value of any shape.
    if let Ok(v) = lmcache_protocol::value::decode(0, &body) {
        let _ = grpc::encode_response(method.op, Some(&v));
        let _ = grpc::encode_event_batch(&v);
    }
});
