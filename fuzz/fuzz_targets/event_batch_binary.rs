//! The binary cache-event layout of the JetStream feed (`lmcache_protocol::coordinator_binary`)
//! and the coordinator's ingest of it: any bytes are decoded or refused by name, never a
//! panic; a message that decodes is admitted or refused by the gate, and a decoded batch
//! converts to the JSON form without a panic. The input is also tried after a valid header
//! (`LMRSEVB1`), so the fuzzer reaches past the magic at once.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use lmcache_coordinator::CoordinatorConfig;
use lmcache_coordinator::fleet::Fleet;
use lmcache_protocol::coordinator_binary::{MAGIC, decode};

fn fleet() -> &'static Fleet {
    static F: OnceLock<Fleet> = OnceLock::new();
    F.get_or_init(|| Fleet::new(CoordinatorConfig::default()).expect("fleet"))
}

fuzz_target!(|data: &[u8]| {
    let mut framed = MAGIC.to_vec();
    framed.extend_from_slice(data);
    for message in [data, &framed[..]] {
        if let Ok(batches) = decode(message) {
            for b in &batches {
                let _ = b.validate();
                let _ = b.to_owned_batch();
            }
        }
        let _ = fleet().ingest_binary(message);
    }
});
