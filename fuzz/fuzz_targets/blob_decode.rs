//! Bytes an L2 backend hands back, for every codec: verification and decoding never panic
//! and never allocate what the header claims without checking it; a blob that verifies for
//! one key never verifies for another.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use lmcache_core::{Dtype, ObjectKey};
use lmcache_l2::Codec;

fn codecs() -> &'static [Codec] {
    static C: OnceLock<Vec<Codec>> = OnceLock::new();
    C.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("lmcache-rs-fuzz-key-{}", std::process::id()));
        std::fs::write(&path, "ab".repeat(32)).expect("key file");
        let specs = [
            serde_json::json!({"type": "none"}),
            serde_json::json!({"type": "lz4"}),
            serde_json::json!({"type": "zstd"}),
            serde_json::json!({"type": "aesgcm", "master_key_path": path}),
            serde_json::json!({"type": "fp8", "block_size": 16}),
        ];
        specs
            .iter()
            .map(|s| {
                let c = Codec::from_spec(Some(s)).expect("codec spec");
                c.bind_dtype(Dtype::Float16, false).expect("bind");
                c
            })
            .collect()
    })
}

fuzz_target!(|input: (u8, Vec<u8>, Vec<u8>, Vec<u32>)| {
    let (which, raw, stored, flips) = input;
    let key = ObjectKey::new([7; 32], "m", 1, 0, 0, "").unwrap();
    let other = ObjectKey::new([8; 32], "m", 1, 0, 0, "").unwrap();
    let c = &codecs()[which as usize % codecs().len()];
    // Arbitrary stored bytes: a miss or an error, never a panic.
    let _ = c.decode(&key, &stored);
    // A real blob of arbitrary raw bytes: decodes for its key (lossless codecs give the bytes
    // back), never for another key.
    if let Ok(blob) = c.encode(&key, bytes::Bytes::from(raw.clone())) {
        let whole = [blob.header().as_ref(), blob.payload.as_ref()].concat();
        let back = c.decode(&key, &whole).expect("a fresh blob decodes");
        if c.id() != 4 {
            assert_eq!(back, raw);
        }
        assert!(c.decode(&other, &whole).is_err(), "a blob decoded for another key");
        // Bits the fuzzer chooses, anywhere in header, key or payload, flipped: refused
        // (a pair of flips of one bit cancels out: those are skipped).
        if !whole.is_empty() && !flips.is_empty() {
            let bits = whole.len() * 8;
            let mut bad = whole.clone();
            for f in flips.iter().take(64) {
                let b = *f as usize % bits;
                bad[b / 8] ^= 1 << (b % 8);
            }
            if bad != whole {
                assert!(c.decode(&key, &bad).is_err(), "flipped bits {flips:?} went unnoticed");
            }
        }
    }
});
