//! The directory's lookup answer written straight to JSON bytes: the same bytes as
//! `serde_json::to_vec` of the [`DirectoryLookupResponse`] it makes (field order, escapes,
//! numbers), checked by a property test against it, in a quarter of the time. A lookup of 64 keys answers
//! about 25 KB, and serde's per-byte escape loop over its strings was the largest single cost
//! of the route (15 % of the server's samples): here a string is checked for anything to
//! escape in one vectorised pass and copied whole when clean, which every hash, model name and
//! interned instance name is.

#[cfg(doc)]
use crate::coordinator::DirectoryLookupResponse;
use crate::coordinator::{Placement, WireTier};
use crate::coordinator_borrowed::EncodedObjectKeyRef;

/// One key's answer, without the key (the writer echoes the key asked beside it): what
/// [`crate::coordinator::DirectoryKeyPlacements`] holds besides its key.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KeyAnswer {
    /// Its placements, sorted by instance, tier, backend.
    pub placements: Vec<Placement>,
    /// The chunk's tokens when known.
    pub token_ids: Vec<u32>,
    /// Accesses reported.
    pub access_count: u64,
}

/// The answer to keys `asked` whose answers are `answers` (in the same order): the bytes
/// `serde_json::to_vec` writes for the [`DirectoryLookupResponse`] they make.
pub fn lookup_answer_json(
    chunks: u64,
    asked: &[EncodedObjectKeyRef<'_>],
    answers: &[KeyAnswer],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + asked.len() * 600);
    out.extend_from_slice(b"{\"chunks\":");
    number(&mut out, chunks);
    out.extend_from_slice(b",\"results\":[");
    for (i, (k, a)) in asked.iter().zip(answers).enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"key\":");
        key(&mut out, k);
        out.extend_from_slice(b",\"placements\":[");
        for (i, p) in a.placements.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            placement(&mut out, p);
        }
        out.extend_from_slice(b"],\"token_ids\":[");
        for (i, &t) in a.token_ids.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            number(&mut out, u64::from(t));
        }
        out.extend_from_slice(b"],\"access_count\":");
        number(&mut out, a.access_count);
        out.push(b'}');
    }
    out.extend_from_slice(b"]}");
    out
}

fn key(out: &mut Vec<u8>, k: &EncodedObjectKeyRef<'_>) {
    out.extend_from_slice(b"{\"chunk_hash_hex\":");
    string(out, &k.chunk_hash_hex);
    out.extend_from_slice(b",\"model_name\":");
    string(out, &k.model_name);
    out.extend_from_slice(b",\"kv_rank\":");
    number(out, u64::from(k.kv_rank));
    out.extend_from_slice(b",\"object_group_id\":");
    number(out, u64::from(k.object_group_id));
    out.extend_from_slice(b",\"cache_salt\":");
    string(out, &k.cache_salt);
    out.push(b'}');
}

fn placement(out: &mut Vec<u8>, p: &Placement) {
    out.extend_from_slice(b"{\"instance_id\":");
    string(out, &p.instance_id);
    out.extend_from_slice(b",\"incarnation\":");
    number(out, p.incarnation);
    out.extend_from_slice(match p.tier {
        WireTier::L1 => b",\"tier\":\"l1\",\"backend\":",
        WireTier::L2 => b",\"tier\":\"l2\",\"backend\":",
        WireTier::All => b",\"tier\":\"all\",\"backend\":",
    });
    string(out, &p.backend);
    out.extend_from_slice(b",\"size_bytes\":");
    number(out, p.size_bytes);
    out.extend_from_slice(if p.shared { b",\"shared\":true}" } else { b",\"shared\":false}" });
}

fn number(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// A JSON string as serde_json writes it: `"` and `\` escaped, control characters as `\b`,
/// `\t`, `\n`, `\f`, `\r` or `\u00XX`, everything else (`/`, DEL, non-ASCII) as is.
fn string(out: &mut Vec<u8>, s: &str) {
    // A fold, not `any`: without an early exit it runs in vector registers.
    let clean = s.bytes().fold(true, |ok, b| ok & (b >= 0x20) & (b != b'"') & (b != b'\\'));
    out.push(b'"');
    if clean {
        out.extend_from_slice(s.as_bytes());
    } else {
        for b in s.bytes() {
            match b {
                b'"' => out.extend_from_slice(b"\\\""),
                b'\\' => out.extend_from_slice(b"\\\\"),
                0x08 => out.extend_from_slice(b"\\b"),
                b'\t' => out.extend_from_slice(b"\\t"),
                b'\n' => out.extend_from_slice(b"\\n"),
                0x0c => out.extend_from_slice(b"\\f"),
                b'\r' => out.extend_from_slice(b"\\r"),
                0..0x20 => {
                    const HEX: &[u8; 16] = b"0123456789abcdef";
                    out.extend_from_slice(b"\\u00");
                    out.push(HEX[usize::from(b >> 4)]);
                    out.push(HEX[usize::from(b & 0xf)]);
                }
                _ => out.push(b),
            }
        }
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::*;
    use crate::coordinator::{DirectoryKeyPlacements, DirectoryLookupResponse, EncodedObjectKey};

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            "[0-9a-f]{64}",
            "[a-zA-Z0-9/_.-]{0,12}",
            any::<String>(),
            proptest::collection::vec(0u8..0x80, 0..12)
                .prop_map(|b| b.into_iter().map(char::from).collect()),
        ]
    }

    fn response() -> impl Strategy<Value = DirectoryLookupResponse> {
        let placement = (text(), any::<u64>(), 0..3u8, text(), any::<u64>(), any::<bool>())
            .prop_map(|(instance, incarnation, tier, backend, size_bytes, shared)| Placement {
                instance_id: Arc::from(instance),
                incarnation,
                tier: [WireTier::L1, WireTier::L2, WireTier::All][usize::from(tier)],
                backend: Arc::from(backend),
                size_bytes,
                shared,
            });
        let key = (text(), text(), any::<u32>(), any::<u32>(), text()).prop_map(
            |(chunk_hash_hex, model_name, kv_rank, object_group_id, cache_salt)| EncodedObjectKey {
                chunk_hash_hex,
                model_name,
                kv_rank,
                object_group_id,
                cache_salt,
            },
        );
        let result = (
            key,
            proptest::collection::vec(placement, 0..4),
            proptest::collection::vec(any::<u32>(), 0..4),
            any::<u64>(),
        )
            .prop_map(|(key, placements, token_ids, access_count)| {
                DirectoryKeyPlacements { key, placements, token_ids, access_count }
            });
        (any::<u64>(), proptest::collection::vec(result, 0..5))
            .prop_map(|(chunks, results)| DirectoryLookupResponse { chunks, results })
    }

    proptest! {
        #[test]
        fn the_answer_is_serdes_byte_for_byte(r in response()) {
            let serde = String::from_utf8(serde_json::to_vec(&r).unwrap()).unwrap();
            let asked: Vec<_> = r.results.iter().map(|k| EncodedObjectKeyRef::of(&k.key)).collect();
            let answers: Vec<_> = r
                .results
                .iter()
                .map(|k| KeyAnswer {
                    placements: k.placements.clone(),
                    token_ids: k.token_ids.clone(),
                    access_count: k.access_count,
                })
                .collect();
            prop_assert_eq!(
                String::from_utf8(lookup_answer_json(r.chunks, &asked, &answers)).unwrap(),
                serde
            );
        }
    }

    #[test]
    fn every_ascii_character_is_escaped_as_serde_escapes_it() {
        for c in 0..0x80u8 {
            let s = format!("a{}b", char::from(c));
            let mut out = Vec::new();
            string(&mut out, &s);
            assert_eq!(out, serde_json::to_vec(&s).unwrap(), "{c:#x}");
        }
    }
}
