//! `POST /events` bodies through `lmcache_protocol::coordinator_borrowed::decode_body` (one
//! pass over the usual shape, serde for anything else) against serde alone: for any text the
//! door gives exactly serde's value, or fails where serde fails. The input is also spliced
//! into a valid body at a position it names, so the fuzzer works inside the usual shape at
//! once.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lmcache_protocol::coordinator_borrowed::{CacheEventsBody, decode_body};

const VALID: &str = r#"{"batches": [{"instance_id": "server-0", "incarnation": 1, "seq": 1, "event_type": "store", "tier": "l1", "backend": "dram", "shared": false, "ts": 1733370000.5, "entries": [{"key": {"chunk_hash_hex": "6d0a5e3ad8b0f3d7c5c4b3a29181706f5e4d3c2b1a09f8e7d6c5b4a392817060", "model_name": "m", "kv_rank": 16777472, "object_group_id": 0, "cache_salt": ""}, "size_bytes": 33554432, "token_ids": [1, 2], "token_offset": -1}]}]}"#;

fn check(text: &str) {
    let door = decode_body(text);
    let serde: Result<CacheEventsBody<'_>, _> = serde_json::from_str(text);
    assert_eq!(door.is_ok(), serde.is_ok(), "{text}");
    assert_eq!(door.ok(), serde.ok(), "{text}");
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    check(text);
    if let Some((&at, rest)) = data.split_first()
        && let Ok(piece) = std::str::from_utf8(rest)
    {
        // VALID is ASCII: every index is a character boundary.
        let at = usize::from(at) * VALID.len() / 256;
        let cut = (at + piece.len() % 7).min(VALID.len());
        check(&format!("{}{piece}{}", &VALID[..at], &VALID[cut..]));
    }
});
