//! The JSON wire contract between cache servers and LMCache 0.5.6's coordinator
//! (`lmcache coordinator`, port 9300): registration, heartbeats, cache-event batches and
//! the directory's answers, with LMCache's field names and defaults. Both ends use these
//! types: `lmcache-rs server` to report, `lmcache-rs coordinator` to serve.
//!
//! Decoding is serde's (unknown fields ignored, as pydantic does); the checks LMCache's
//! models make beyond types (non-empty ids, `seq ≥ 1`, hex keys...) are [`CacheEventBatch::validate`]
//! and friends, each error naming the field.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `CACHE_EVENT_SCHEMA_VERSION` of LMCache 0.5.6.
pub const CACHE_EVENT_SCHEMA_VERSION: u32 = 1;

/// The NATS JetStream stream cache events travel in (lmcache-rs's transport; LMCache's own
/// alternative to HTTP is Kafka).
pub const JETSTREAM_STREAM: &str = "LMCACHE_CACHE_EVENTS";

/// Subjects of the default stream: `lmcache.cache_events.<instance>` (one subject per
/// emitter, so its batches stay in order).
pub const JETSTREAM_SUBJECTS: &str = "lmcache.cache_events.>";

/// The subject prefix of stream `stream`: the default stream's `lmcache.cache_events`, any
/// other's `lmcache.cache_events_<stream>`, so that streams never overlap (NATS refuses a
/// stream whose subjects overlap another's) and a fleet on its own stream (a test run, a
/// second fleet on one NATS) never reads or disturbs another's.
fn subject_prefix(stream: &str) -> String {
    if stream == JETSTREAM_STREAM {
        "lmcache.cache_events".to_string()
    } else {
        format!("lmcache.cache_events_{}", token(stream))
    }
}

/// The subjects stream `stream` holds (see [`jetstream_subject`]).
pub fn jetstream_subjects(stream: &str) -> String {
    format!("{}.>", subject_prefix(stream))
}

fn token(s: &str) -> String {
    let t: String = s
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
        .collect();
    if t.is_empty() { "_".to_string() } else { t }
}

/// The subject an emitter publishes on in stream `stream`: its id with every character a
/// subject token cannot hold replaced by `_` (the batch itself carries the exact id).
pub fn jetstream_subject(stream: &str, instance_id: &str) -> String {
    format!("{}.{}", subject_prefix(stream), token(instance_id))
}

/// The token-form cap of LMCache's key resolver (`MAX_TOKEN_IDS`).
pub const MAX_TOKEN_IDS: usize = 1_000_000;

/// A tier name on this wire.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum WireTier {
    /// L1.
    L1,
    /// L2.
    L2,
    /// Both (filters and deletes only; never an event's tier).
    #[default]
    All,
}

/// `EncodedObjectKey`: an object key with its chunk hash in hex.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EncodedObjectKey {
    /// Hex of the 32-byte chunk hash.
    pub chunk_hash_hex: String,
    /// Model.
    pub model_name: String,
    /// Packed kv rank.
    pub kv_rank: u32,
    /// Object group.
    #[serde(default)]
    pub object_group_id: u32,
    /// Tenant salt.
    #[serde(default)]
    pub cache_salt: String,
}

/// The namespace part of an object key (everything but the chunk hash), borrowed: keys with
/// equal namespaces compare equal here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyNamespace<'a> {
    /// Model name.
    pub model_name: &'a str,
    /// Packed world size and rank (LMCache's `kv_rank`).
    pub kv_rank: u32,
    /// Object group.
    pub object_group_id: u32,
    /// Cache salt.
    pub cache_salt: &'a str,
}

impl EncodedObjectKey {
    /// Its namespace part.
    pub fn namespace(&self) -> KeyNamespace<'_> {
        KeyNamespace {
            model_name: &self.model_name,
            kv_rank: self.kv_rank,
            object_group_id: self.object_group_id,
            cache_salt: &self.cache_salt,
        }
    }

    /// The chunk hash's bytes, or what is wrong with it.
    pub fn chunk_hash(&self) -> Result<[u8; 32], String> {
        chunk_hash_of(&self.chunk_hash_hex)
    }

    /// Checks what LMCache's `ObjectKey` checks.
    pub fn validate(&self) -> Result<(), String> {
        self.chunk_hash()?;
        validate_namespace(self.namespace())
    }
}

/// The bytes of a `chunk_hash_hex`, or what is wrong with it.
pub(crate) fn chunk_hash_of(hex: &str) -> Result<[u8; 32], String> {
    hex32(hex).ok_or_else(|| {
        format!("chunk_hash_hex must be 64 hex digits (32 bytes), got {:?}", truncate(hex))
    })
}

/// What LMCache's `ObjectKey` checks of a key beyond its hash.
pub(crate) fn validate_namespace(ns: KeyNamespace<'_>) -> Result<(), String> {
    if ns.model_name.is_empty() {
        return Err("model_name must be non-empty".into());
    }
    if ns.kv_rank >> 24 == 0 {
        return Err(format!("kv_rank {:#x} packs world size 0", ns.kv_rank));
    }
    Ok(())
}

/// Decodes 64 hex digits (either case) into 32 bytes; `None` for anything else. Every
/// cache-event entry and lookup key goes through here, so each digit is worked out by
/// arithmetic with no branch or table, which the compiler runs in vector registers.
pub fn hex32(s: &str) -> Option<[u8; 32]> {
    let b: &[u8; 64] = s.as_bytes().try_into().ok()?;
    let mut nibbles = [0u8; 64];
    let mut bad = false;
    for (n, &c) in nibbles.iter_mut().zip(b) {
        let digit = c.wrapping_sub(b'0');
        let letter = (c | 0x20).wrapping_sub(b'a');
        let (is_digit, is_letter) = (digit < 10, letter < 6);
        *n = if is_digit { digit } else { letter.wrapping_add(10) };
        bad |= !(is_digit | is_letter);
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(nibbles.chunks_exact(2)) {
        *o = pair[0] << 4 | pair[1];
    }
    (!bad).then_some(out)
}

fn truncate(s: &str) -> &str {
    s.char_indices().nth(80).map_or(s, |(i, _)| &s[..i])
}

/// `POST /instances` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegisterRequest {
    /// Empty: the coordinator assigns `mp-<uuid hex>`.
    #[serde(default)]
    pub instance_id: String,
    /// Address the coordinator calls the server's HTTP API at.
    pub ip: String,
    /// The server's HTTP port, 1..=65535.
    pub http_port: u32,
    /// Free-form hints.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// P2P URL; empty when not a P2P peer.
    #[serde(default)]
    pub p2p_advertised_url: String,
    /// P2P message-queue port; 0 when not a P2P peer.
    #[serde(default)]
    pub mq_port: u32,
}

impl RegisterRequest {
    /// Trims what pydantic trims and checks its bounds.
    pub fn validate(&mut self) -> Result<(), String> {
        self.instance_id = self.instance_id.trim().to_string();
        self.ip = self.ip.trim().to_string();
        self.p2p_advertised_url = self.p2p_advertised_url.trim().to_string();
        if self.ip.is_empty() {
            return Err("ip: must be non-empty".into());
        }
        if !(1..=65535).contains(&self.http_port) {
            return Err(format!("http_port: {} is not in 1..65535", self.http_port));
        }
        if self.mq_port > 65535 {
            return Err(format!("mq_port: {} is not in 0..65535", self.mq_port));
        }
        Ok(())
    }
}

/// `POST /instances` reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterResponse {
    /// The registered id.
    pub instance_id: String,
    /// Whether it replaced a registration of the same id.
    pub re_registered: bool,
}

/// One registered instance, as `GET /instances` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceInfo {
    /// Id.
    pub instance_id: String,
    /// Address.
    pub ip: String,
    /// HTTP port.
    pub http_port: u32,
    /// Wall-clock seconds of its registration.
    pub registration_time: f64,
    /// Hints.
    pub metadata: BTreeMap<String, String>,
    /// P2P URL.
    pub p2p_advertised_url: String,
    /// P2P port.
    pub mq_port: u32,
}

/// What a batch reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheEventType {
    /// Placements committed.
    Store,
    /// Placements removed (deletes and evictions).
    Delete,
    /// Keys used.
    Access,
    /// A capacity declaration (no entries).
    Config,
}

pub(crate) fn unknown_offset() -> i64 {
    -1
}

/// `CacheEventEntry`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheEventEntry {
    /// The key.
    pub key: EncodedObjectKey,
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

/// `CacheEventBatch`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheEventBatch {
    /// Emitter id.
    pub instance_id: String,
    /// Emitter restart counter (LMCache: start time in seconds).
    pub incarnation: u64,
    /// Per (instance, incarnation) batch counter from 1.
    pub seq: u64,
    /// What happened.
    pub event_type: CacheEventType,
    /// `l1` or `l2`.
    pub tier: WireTier,
    /// Backend; empty only for access batches.
    #[serde(default)]
    pub backend: String,
    /// The keys.
    #[serde(default)]
    pub entries: Vec<CacheEventEntry>,
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

/// A batch's header as [`validate_batch`] checks it, whatever the batch's encoding.
pub(crate) struct BatchHeader<'a> {
    pub(crate) instance_id: &'a str,
    pub(crate) backend: &'a str,
    pub(crate) event_type: CacheEventType,
    pub(crate) entries: usize,
    pub(crate) seq: u64,
    pub(crate) tier: WireTier,
    pub(crate) ts: f64,
}

/// LMCache's `__post_init__` checks of a batch, given its header and its entries' token
/// offsets, naming the field.
pub(crate) fn validate_batch(
    h: BatchHeader<'_>,
    token_offsets: impl Iterator<Item = i64>,
) -> Result<(), String> {
    if h.instance_id.is_empty() {
        return Err("instance_id must be non-empty".into());
    }
    if h.backend.is_empty() && h.event_type != CacheEventType::Access {
        return Err(
            format!("backend must be non-empty for {:?} batches", h.event_type).to_lowercase()
        );
    }
    if h.event_type == CacheEventType::Config && h.entries > 0 {
        return Err("config batches declare capacity and carry no entries".into());
    }
    if h.seq < 1 {
        return Err(format!("seq must be >= 1 (got {})", h.seq));
    }
    if h.tier == WireTier::All {
        return Err("cache events must target a concrete tier (got 'all')".into());
    }
    if !h.ts.is_finite() || h.ts < 0.0 {
        return Err(format!("ts must be a finite number >= 0 (got {})", h.ts));
    }
    for (i, off) in token_offsets.enumerate() {
        if off < -1 {
            return Err(format!("entries[{i}].token_offset must be >= 0 or -1, got {off}"));
        }
    }
    Ok(())
}

impl CacheEventBatch {
    /// LMCache's `__post_init__` checks plus key decoding, naming the field.
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
            e.key.validate().map_err(|m| format!("entries[{i}].key: {m}"))?;
        }
        Ok(())
    }
}

/// `POST /events` body.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CacheEventsRequest {
    /// Batches in emission order.
    #[serde(default)]
    pub batches: Vec<CacheEventBatch>,
}

/// `POST /events` reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CacheEventsResponse {
    /// Batches applied.
    pub applied: u64,
    /// Replays dropped.
    pub duplicates: u64,
    /// Batches of an older incarnation dropped.
    pub stale: u64,
}

/// A placement in directory answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Latest reporter (shared with the directory's interned name: no copy per answer).
    pub instance_id: std::sync::Arc<str>,
    /// Its incarnation then.
    pub incarnation: u64,
    /// Tier.
    pub tier: WireTier,
    /// Backend (shared, as `instance_id`).
    pub backend: std::sync::Arc<str>,
    /// Bytes.
    pub size_bytes: u64,
    /// Whether in a shared pool.
    pub shared: bool,
}

pub(crate) fn one() -> u32 {
    1
}

/// `POST /directory/lookup` body: `keys`, or `token_ids` with `model_name`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DirectoryLookupRequest {
    /// Keys form.
    #[serde(default)]
    pub keys: Vec<EncodedObjectKey>,
    /// Tokens form: the request's whole token sequence from position 0.
    #[serde(default)]
    pub token_ids: Vec<u32>,
    /// Tokens form: model.
    #[serde(default)]
    pub model_name: String,
    /// Tokens form: world size (rank fan-out).
    #[serde(default = "one")]
    pub world_size: u32,
    /// Tokens form: salt.
    #[serde(default)]
    pub cache_salt: String,
}

/// One key's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectoryKeyPlacements {
    /// The key.
    pub key: EncodedObjectKey,
    /// Its placements, sorted by instance, tier, backend.
    pub placements: Vec<Placement>,
    /// The chunk's tokens when known.
    pub token_ids: Vec<u32>,
    /// Accesses reported.
    pub access_count: u64,
}

/// `POST /directory/lookup` reply.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DirectoryLookupResponse {
    /// Chunks resolved (tokens form) or keys asked (keys form).
    pub chunks: u64,
    /// One per key, in request order (tokens form: chunk-major, ranks within).
    pub results: Vec<DirectoryKeyPlacements>,
}

/// One listed key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectoryKeyInfo {
    /// The key.
    pub key: EncodedObjectKey,
    /// Placements matching the filters.
    pub placements: Vec<Placement>,
    /// Tokens known for its chunk.
    pub num_tokens: u64,
    /// Accesses reported.
    pub access_count: u64,
}

/// `GET /directory/keys` reply.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DirectoryListResponse {
    /// Keys matching.
    pub total: u64,
    /// This page.
    pub keys: Vec<DirectoryKeyInfo>,
}

/// A compartment's usage and capacity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModuleMemoryStatus {
    /// Tier.
    pub tier: WireTier,
    /// Backend.
    pub backend: String,
    /// Shared pool.
    pub shared: bool,
    /// Bytes held.
    pub used_bytes: u64,
    /// Declared capacity (0 = undeclared).
    pub capacity_bytes: u64,
    /// `used / capacity`, null when undeclared.
    pub usage_ratio: Option<f64>,
}

/// One instance's compartments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceMemoryStatus {
    /// Instance.
    pub instance_id: String,
    /// Whether registered now.
    pub registered: bool,
    /// Whether it declared any capacity.
    pub declared_capacity: bool,
    /// Private compartments, by tier then backend.
    pub modules: Vec<ModuleMemoryStatus>,
}

/// `GET /instances/usage` reply.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FleetMemoryResponse {
    /// Per instance, by id.
    pub instances: Vec<InstanceMemoryStatus>,
    /// Shared pools, counted once.
    pub shared_modules: Vec<ModuleMemoryStatus>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stream_has_subjects_of_its_own() {
        assert_eq!(jetstream_subjects(JETSTREAM_STREAM), JETSTREAM_SUBJECTS);
        assert_eq!(jetstream_subject(JETSTREAM_STREAM, "a.b c"), "lmcache.cache_events.a_b_c");
        let other = jetstream_subjects("TEST_1");
        assert_eq!(other, "lmcache.cache_events_TEST_1.>");
        assert_eq!(jetstream_subject("TEST_1", "s1"), "lmcache.cache_events_TEST_1.s1");
        // The default stream's wildcard never matches another stream's subjects.
        let sub = jetstream_subject("TEST_1", "s1");
        assert!(!sub.starts_with("lmcache.cache_events."), "{sub}");
    }

    #[test]
    fn batches_decode_with_lmcache_defaults_and_validate() {
        let b: CacheEventBatch = serde_json::from_str(
            r#"{"instance_id":"a","incarnation":5,"seq":1,"event_type":"store","tier":"l1","backend":"dram",
                "entries":[{"key":{"chunk_hash_hex":"ab","model_name":"m","kv_rank":16777472}}]}"#,
        )
        .unwrap();
        assert_eq!(b.entries[0].token_offset, -1);
        assert_eq!(b.entries[0].key.object_group_id, 0);
        assert!(b.validate().unwrap_err().contains("entries[0].key: chunk_hash_hex"));
        assert_eq!(hex32(&"aB".repeat(32)), Some([0xab; 32]));
        for bad in
            ["ab".repeat(31), "zz".repeat(32), format!("{}g", "a".repeat(63)), "é".repeat(32)]
        {
            assert_eq!(hex32(&bad), None, "{bad}");
        }
        // Every byte at every position, against the standard library's reading of a digit.
        for c in 0..=255u8 {
            for at in [0, 1, 37, 63] {
                let mut text = *b"0123456789abcdefABCDEF0123456789abcdefABCDEF0123456789abcdef0123";
                text[at] = c;
                let want = (c as char).to_digit(16).map(|_| hex::decode(text).unwrap());
                let got = std::str::from_utf8(&text).ok().and_then(hex32).map(|h| h.to_vec());
                if c.is_ascii() {
                    assert_eq!(got, want, "byte {c:#x} at {at}");
                } else {
                    assert_eq!(got, None);
                }
            }
        }
        let mut ok = b.clone();
        ok.entries[0].key.chunk_hash_hex = "ab".repeat(32);
        assert_eq!(ok.validate(), Ok(()));
        for (edit, want) in [
            (
                Box::new(|b: &mut CacheEventBatch| b.seq = 0) as Box<dyn Fn(&mut CacheEventBatch)>,
                "seq",
            ),
            (Box::new(|b: &mut CacheEventBatch| b.tier = WireTier::All), "concrete tier"),
            (Box::new(|b: &mut CacheEventBatch| b.backend.clear()), "backend"),
            (Box::new(|b: &mut CacheEventBatch| b.instance_id.clear()), "instance_id"),
            (Box::new(|b: &mut CacheEventBatch| b.ts = f64::NAN), "ts"),
            (Box::new(|b: &mut CacheEventBatch| b.event_type = CacheEventType::Config), "config"),
        ] {
            let mut bad = ok.clone();
            edit(&mut bad);
            assert!(bad.validate().unwrap_err().contains(want), "{want}");
        }
    }

    #[test]
    fn registration_is_trimmed_and_bounded() {
        let mut r: RegisterRequest =
            serde_json::from_str(r#"{"ip":" 10.0.0.1 ","http_port":8080}"#).unwrap();
        assert_eq!(r.validate(), Ok(()));
        assert_eq!(r.ip, "10.0.0.1");
        r.http_port = 0;
        assert!(r.validate().unwrap_err().starts_with("http_port"));
        r.http_port = 1;
        r.ip = "  ".into();
        assert!(r.validate().unwrap_err().starts_with("ip"));
    }
}
