//! `POST /events` bodies decoded in place: the cache-event batches of [`crate::coordinator`] with
//! their strings borrowed from the body (copied only when JSON escapes them) and each chunk
//! hash decoded from hex once, while the body is parsed. The coordinator ingests these; the
//! owned types stay what servers build and send.
//!
//! Same fields, defaults and checks as the owned types (unknown fields ignored, as pydantic
//! does), and the same error texts. [`decode_body`] is the door: one pass of `scan` over a
//! body in the shape servers send, serde for anything else.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use crate::coordinator::{
    BatchHeader, CacheEventBatch, CacheEventEntry, CacheEventType, EncodedObjectKey, KeyNamespace,
    WireTier, chunk_hash_of, one, unknown_offset, validate_batch, validate_namespace,
};

mod scan;

/// A `POST /events` body decoded in place: read in one pass (`scan`) when it has the shape
/// servers send (fields of these types, strings without escapes, integers as digits), by
/// serde otherwise, which gives the same value for any body the pass reads and names what is
/// wrong with a bad one.
pub fn decode_body(text: &str) -> Result<CacheEventsBody<'_>, serde_json::Error> {
    match scan::scan(text) {
        Some(body) => Ok(body),
        None => serde_json::from_str(text),
    }
}

/// `POST /events` body, borrowing from the bytes it was parsed from.
#[derive(Debug, Default, PartialEq, Deserialize)]
pub struct CacheEventsBody<'a> {
    /// Batches in emission order.
    #[serde(borrow, default)]
    pub batches: Vec<CacheEventBatchRef<'a>>,
}

/// A [`CacheEventBatch`] borrowing its strings.
#[derive(Debug, PartialEq, Deserialize)]
pub struct CacheEventBatchRef<'a> {
    /// Emitter id.
    #[serde(borrow)]
    pub instance_id: Cow<'a, str>,
    /// Emitter restart counter.
    pub incarnation: u64,
    /// Per (instance, incarnation) batch counter from 1.
    pub seq: u64,
    /// What happened.
    pub event_type: CacheEventType,
    /// `l1` or `l2`.
    pub tier: WireTier,
    /// Backend; empty only for access batches.
    #[serde(borrow, default)]
    pub backend: Cow<'a, str>,
    /// The keys.
    #[serde(borrow, default)]
    pub entries: Vec<CacheEventEntryRef<'a>>,
    /// Whether the backend is a pool several instances mount.
    #[serde(default)]
    pub shared: bool,
    /// Emitter wall-clock seconds.
    #[serde(default)]
    pub ts: f64,
    /// Config only: the compartment's capacity (0 = undeclared).
    #[serde(default)]
    pub capacity_bytes: u64,
    /// Config only: which declaration this batch belongs to.
    #[serde(default)]
    pub capacity_revision: u64,
}

/// A [`CacheEventEntry`] borrowing its key's strings.
#[derive(Debug, PartialEq, Deserialize)]
pub struct CacheEventEntryRef<'a> {
    /// The key.
    #[serde(borrow)]
    pub key: ObjectKeyRef<'a>,
    /// Bytes (store only).
    #[serde(default)]
    pub size_bytes: u64,
    /// The chunk's tokens (store only, when known).
    #[serde(default)]
    pub token_ids: Vec<u32>,
    /// Position of the chunk's first token; -1 when unknown.
    #[serde(default = "unknown_offset")]
    pub token_offset: i64,
}

/// An [`EncodedObjectKey`] with its hash decoded and its strings borrowed.
#[derive(Debug, PartialEq, Deserialize)]
pub struct ObjectKeyRef<'a> {
    /// The chunk hash (`chunk_hash_hex` on the wire).
    #[serde(rename = "chunk_hash_hex")]
    pub chunk_hash: ChunkHashHex,
    /// Model.
    #[serde(borrow)]
    pub model_name: Cow<'a, str>,
    /// Packed kv rank.
    pub kv_rank: u32,
    /// Object group.
    #[serde(default)]
    pub object_group_id: u32,
    /// Tenant salt.
    #[serde(borrow, default)]
    pub cache_salt: Cow<'a, str>,
}

/// A `chunk_hash_hex` decoded while the body is parsed: its 32 bytes, or the error that
/// names what was wrong (kept for [`CacheEventBatchRef::validate`], so a bad hash is refused
/// with the same text, and at the same point, as the owned form's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkHashHex(pub Result<[u8; 32], String>);

impl<'de> Deserialize<'de> for ChunkHashHex {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct HexVisitor;
        impl Visitor<'_> for HexVisitor {
            type Value = ChunkHashHex;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string of 64 hex digits")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ChunkHashHex, E> {
                Ok(ChunkHashHex(chunk_hash_of(v)))
            }
        }
        d.deserialize_str(HexVisitor)
    }
}

impl ObjectKeyRef<'_> {
    /// Its namespace part.
    pub fn namespace(&self) -> KeyNamespace<'_> {
        KeyNamespace {
            model_name: &self.model_name,
            kv_rank: self.kv_rank,
            object_group_id: self.object_group_id,
            cache_salt: &self.cache_salt,
        }
    }

    /// The owned form (the hash re-encoded in lowercase hex; empty if it was bad).
    pub fn to_owned_key(&self) -> EncodedObjectKey {
        EncodedObjectKey {
            chunk_hash_hex: self.chunk_hash.0.as_ref().map(hex::encode).unwrap_or_default(),
            model_name: self.model_name.to_string(),
            kv_rank: self.kv_rank,
            object_group_id: self.object_group_id,
            cache_salt: self.cache_salt.to_string(),
        }
    }
}

impl<'a> CacheEventBatchRef<'a> {
    /// A view of an owned batch (its hashes decoded, its token lists copied).
    pub fn of(b: &'a CacheEventBatch) -> Self {
        Self {
            instance_id: Cow::Borrowed(&b.instance_id),
            incarnation: b.incarnation,
            seq: b.seq,
            event_type: b.event_type,
            tier: b.tier,
            backend: Cow::Borrowed(&b.backend),
            entries: b
                .entries
                .iter()
                .map(|e| CacheEventEntryRef {
                    key: ObjectKeyRef {
                        chunk_hash: ChunkHashHex(e.key.chunk_hash()),
                        model_name: Cow::Borrowed(&e.key.model_name),
                        kv_rank: e.key.kv_rank,
                        object_group_id: e.key.object_group_id,
                        cache_salt: Cow::Borrowed(&e.key.cache_salt),
                    },
                    size_bytes: e.size_bytes,
                    token_ids: e.token_ids.clone(),
                    token_offset: e.token_offset,
                })
                .collect(),
            shared: b.shared,
            ts: b.ts,
            capacity_bytes: b.capacity_bytes,
            capacity_revision: b.capacity_revision,
        }
    }

    /// [`CacheEventBatch::validate`]'s checks, with its texts.
    pub fn validate(&self) -> Result<(), String> {
        validate_batch(
            BatchHeader {
                instance_id: &self.instance_id,
                backend: &self.backend,
                event_type: self.event_type,
                entries: self.entries.len(),
                seq: self.seq,
                tier: self.tier,
                ts: self.ts,
            },
            self.entries.iter().map(|e| e.token_offset),
        )?;
        for (i, e) in self.entries.iter().enumerate() {
            e.key
                .chunk_hash
                .0
                .as_ref()
                .map_err(Clone::clone)
                .and_then(|_| validate_namespace(e.key.namespace()))
                .map_err(|m| format!("entries[{i}].key: {m}"))?;
        }
        Ok(())
    }

    /// The owned form.
    pub fn to_owned_batch(&self) -> CacheEventBatch {
        CacheEventBatch {
            instance_id: self.instance_id.to_string(),
            incarnation: self.incarnation,
            seq: self.seq,
            event_type: self.event_type,
            tier: self.tier,
            backend: self.backend.to_string(),
            entries: self
                .entries
                .iter()
                .map(|e| CacheEventEntry {
                    key: e.key.to_owned_key(),
                    size_bytes: e.size_bytes,
                    token_ids: e.token_ids.clone(),
                    token_offset: e.token_offset,
                })
                .collect(),
            shared: self.shared,
            ts: self.ts,
            capacity_bytes: self.capacity_bytes,
            capacity_revision: self.capacity_revision,
        }
    }
}

/// `POST /directory/lookup` body ([`crate::coordinator::DirectoryLookupRequest`]) borrowing
/// its strings.
#[derive(Debug, PartialEq, Deserialize)]
pub struct DirectoryLookupBody<'a> {
    /// Keys form.
    #[serde(borrow, default)]
    pub keys: Vec<EncodedObjectKeyRef<'a>>,
    /// Tokens form: the request's whole token sequence from position 0.
    #[serde(default)]
    pub token_ids: Vec<u32>,
    /// Tokens form: model.
    #[serde(borrow, default)]
    pub model_name: Cow<'a, str>,
    /// Tokens form: world size (rank fan-out).
    #[serde(default = "one")]
    pub world_size: u32,
    /// Tokens form: salt.
    #[serde(borrow, default)]
    pub cache_salt: Cow<'a, str>,
}

/// An [`EncodedObjectKey`] borrowing its strings, the hash kept as the caller wrote it (an
/// answer echoes the key asked).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct EncodedObjectKeyRef<'a> {
    /// Hex of the 32-byte chunk hash.
    #[serde(borrow)]
    pub chunk_hash_hex: Cow<'a, str>,
    /// Model.
    #[serde(borrow)]
    pub model_name: Cow<'a, str>,
    /// Packed kv rank.
    pub kv_rank: u32,
    /// Object group.
    #[serde(default)]
    pub object_group_id: u32,
    /// Tenant salt.
    #[serde(borrow, default)]
    pub cache_salt: Cow<'a, str>,
}

impl<'a> EncodedObjectKeyRef<'a> {
    /// A view of an owned key.
    pub fn of(k: &'a EncodedObjectKey) -> Self {
        Self {
            chunk_hash_hex: Cow::Borrowed(&k.chunk_hash_hex),
            model_name: Cow::Borrowed(&k.model_name),
            kv_rank: k.kv_rank,
            object_group_id: k.object_group_id,
            cache_salt: Cow::Borrowed(&k.cache_salt),
        }
    }

    /// Its namespace part.
    pub fn namespace(&self) -> KeyNamespace<'_> {
        KeyNamespace {
            model_name: &self.model_name,
            kv_rank: self.kv_rank,
            object_group_id: self.object_group_id,
            cache_salt: &self.cache_salt,
        }
    }

    /// The chunk hash's bytes, or what is wrong with it ([`EncodedObjectKey::chunk_hash`]).
    pub fn chunk_hash(&self) -> Result<[u8; 32], String> {
        chunk_hash_of(&self.chunk_hash_hex)
    }

    /// [`EncodedObjectKey::validate`]'s checks, with its texts.
    pub fn validate(&self) -> Result<(), String> {
        self.chunk_hash()?;
        validate_namespace(self.namespace())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::CacheEventsRequest;

    const HASH: &str = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";

    fn body(hash: &str, model: &str) -> String {
        format!(
            r#"{{"batches": [{{"instance_id": "srv\u002d1", "incarnation": 3, "seq": 1,
            "event_type": "store", "tier": "l1", "backend": "dram", "unknown": [1, {{"x": 2}}],
            "entries": [{{"key": {{"chunk_hash_hex": "{hash}", "model_name": "{model}",
            "kv_rank": 16777472}}, "size_bytes": 7, "token_ids": [1, 2], "token_offset": 256}},
            {{"key": {{"chunk_hash_hex": "{hash}", "model_name": "{model}",
            "kv_rank": 16777472, "object_group_id": 2, "cache_salt": "t"}}}}]}}]}}"#
        )
    }

    #[test]
    fn decodes_as_the_owned_form_does_borrowing_unescaped_strings() {
        let text = body(HASH, "m");
        let borrowed: CacheEventsBody<'_> = serde_json::from_str(&text).unwrap();
        let owned: CacheEventsRequest = serde_json::from_str(&text).unwrap();
        assert_eq!(borrowed.batches.len(), 1);
        let b = &borrowed.batches[0];
        b.validate().unwrap();
        // An escaped string is copied, a plain one borrowed.
        assert!(matches!(b.instance_id, Cow::Owned(_)));
        assert_eq!(b.instance_id, "srv-1");
        assert!(matches!(b.backend, Cow::Borrowed("dram")));
        assert!(matches!(b.entries[0].key.model_name, Cow::Borrowed("m")));
        assert_eq!(b.entries[0].key.chunk_hash.0, owned.batches[0].entries[0].key.chunk_hash());
        assert_eq!(b.entries[1].token_offset, -1);
        // The owned form round-trips (the hash in lowercase hex).
        let mut expect = owned.batches[0].clone();
        for e in &mut expect.entries {
            e.key.chunk_hash_hex = e.key.chunk_hash_hex.to_lowercase();
        }
        assert_eq!(b.to_owned_batch(), expect);
        // A view of the owned form is the decoded form.
        assert_eq!(&CacheEventBatchRef::of(&owned.batches[0]), b);
    }

    #[test]
    fn refuses_with_the_owned_forms_texts() {
        for (hash, model) in
            [("abc", "m"), (&HASH[..63], "m"), (&HASH.replace('0', "g"), "m"), (HASH, "")]
        {
            let text = body(hash, model);
            let borrowed: CacheEventsBody<'_> = serde_json::from_str(&text).unwrap();
            let owned: CacheEventsRequest = serde_json::from_str(&text).unwrap();
            let err = borrowed.batches[0].validate().unwrap_err();
            assert_eq!(err, owned.batches[0].validate().unwrap_err());
            assert!(err.starts_with("entries[0].key: "), "{err}");
        }
        // A hash that is not a string is a decode error, as for the owned form.
        let text = body(HASH, "m").replacen(&format!("\"{HASH}\""), "7", 1);
        assert!(serde_json::from_str::<CacheEventsBody<'_>>(&text).is_err());
        assert!(serde_json::from_str::<CacheEventsRequest>(&text).is_err());
    }

    #[test]
    fn lookup_bodies_decode_as_the_owned_form_does() {
        for text in [
            format!(
                r#"{{"keys": [{{"chunk_hash_hex": "{HASH}", "model_name": "m\u0031", "kv_rank": 16777472}},
                {{"chunk_hash_hex": "zz", "model_name": "", "kv_rank": 1, "object_group_id": 3, "cache_salt": "s", "x": 1}}]}}"#
            ),
            r#"{"token_ids": [1, 2, 3], "model_name": "m", "world_size": 2, "cache_salt": "t"}"#
                .into(),
            "{}".into(),
        ] {
            let owned: crate::coordinator::DirectoryLookupRequest =
                serde_json::from_str(&text).unwrap();
            let borrowed: DirectoryLookupBody<'_> = serde_json::from_str(&text).unwrap();
            assert_eq!(borrowed.keys.len(), owned.keys.len());
            for (b, o) in borrowed.keys.iter().zip(&owned.keys) {
                assert_eq!(b, &EncodedObjectKeyRef::of(o));
                assert_eq!(b.chunk_hash(), o.chunk_hash());
                assert_eq!(b.validate(), o.validate());
                assert_eq!(b.namespace(), o.namespace());
            }
            assert_eq!(borrowed.token_ids, owned.token_ids);
            assert_eq!(borrowed.model_name, owned.model_name);
            assert_eq!(borrowed.world_size, owned.world_size);
            assert_eq!(borrowed.cache_salt, owned.cache_salt);
        }
    }
}
