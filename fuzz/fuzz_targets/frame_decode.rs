//! Multipart frames from a client: the frame parser, the request's typed command, then every
//! typed decoder over every parameter. Nothing may panic; whatever decodes must encode back
//! to something that decodes to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lmcache_protocol::frame::{self, Incoming};
use lmcache_protocol::types::{
    self, CacheKey, EngineDrivenRegistered, EngineDrivenRegistration, EngineGroupInfo,
    IpcDescriptor, PrepareRetrieveResponse, PrepareStoreResponse, SlotDesc,
};

fuzz_target!(|frames: Vec<Vec<u8>>| {
    let Ok(Incoming::Request(req)) = frame::parse(frames) else { return };
    for p in &req.params {
        if let Ok(k) = CacheKey::decode("k", p) {
            let back = CacheKey::decode("k", &k.encode()).expect("an encoded key decodes");
            assert!(back.same_identity(&k) && back.request_id == k.request_id);
        }
        if let Ok(r) = EngineDrivenRegistration::decode("r", p) {
            assert_eq!(EngineDrivenRegistration::decode("r", &r.encode()).ok(), Some(r));
        }
        if let Ok(d) = IpcDescriptor::decode("d", p) {
            assert_eq!(IpcDescriptor::decode("d", &d.encode()).ok(), Some(d));
        }
        if let Ok(g) = EngineGroupInfo::decode("g", p) {
            assert_eq!(EngineGroupInfo::decode("g", &g.encode()).ok(), Some(g));
        }
        let _ = SlotDesc::decode("s", p);
        let _ = EngineDrivenRegistered::decode("e", p);
        let _ = PrepareStoreResponse::decode("p", p);
        let _ = PrepareRetrieveResponse::decode("p", p);
        let _ = types::block_ids("b", p);
        if let Ok(m) = types::blend::CbMatch::decode("m", p) {
            assert_eq!(types::blend::CbMatch::decode("m", &m.encode()).ok(), Some(m));
        }
    }
    // Every typed request (CacheBlend's among them) decodes or is refused, never panics.
    let _ = lmcache_protocol::request::Command::decode(req.op, &req.params);
});
