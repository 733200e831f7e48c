//! "Why was this a miss?": for every lookup, chunk by chunk, what served it or why nothing did
//! (`GET /cache/requests/{request_id}/explain`, `lmcache-rs explain`, and
//! `lmcache_rs_lookup_miss_chunks_total{reason}`).
//!
//! The [`Explainer`] keeps three bounded memories, behind one lock:
//! - **fates**: what last happened to a key that left or never arrived, per tier (evicted,
//!   deleted or cleared from L1, its store refused by a quota or for memory; evicted or deleted
//!   from an L2 adapter, its blob refused), under a 64-bit fingerprint of the key, the oldest
//!   forgotten first; L2's fate explains a miss before L1's (a key L1 let go misses only when
//!   L2 lost it too), and is forgotten when an adapter stores the key again;
//! - **variants**: which (model, world size, object group, salt) stored each chunk hash lately,
//!   so a miss under another salt, model or layout names the one that holds the chunk (the
//!   chunk hash depends on the tokens only);
//! - **requests**: the last lookup of each recent request, as runs of chunks with one verdict.
//!
//! A lookup's missed chunks are judged once, when it answers (or when its prefetch settles),
//! in this order: a store of the chunk in flight (locked); a failure of the L2 tier or a peer
//! during this lookup (timeout, adapter error, refused blob, a peer that did not answer); the
//! key's fate; the chunk stored under another variant; never stored. A chunk L1 holds after a
//! missing one is `behind_miss`: a prefix cache cannot use it.
//!
//! Subscribers run on request threads and L1 calls its listener with its lock held, so the
//! explainer never calls into L1 while holding its own lock.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use lmcache_core::{CacheSalt, ChunkHash, ModelName, ObjectKey};
use lmcache_l1::{L1Cache, L1Error, RemovalCause, Residency};
use lmcache_storage::{PrefetchTrouble, StorageEvent, StorageSubscriber};
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde_json::{Value, json};

use crate::metrics::ReasonLabel;

/// Requests remembered by default (`--explain-requests`).
pub const DEFAULT_REQUESTS: usize = 1024;
/// Key fates remembered (about 40 bytes each).
const FATES: usize = 1 << 18;
/// Chunk hashes whose variants are remembered.
const CHUNKS: usize = 1 << 18;
/// Distinct (model, world size, group, salt) variants named; past it, new ones go unnamed.
const VARIANTS: usize = 4096;
/// Variants kept per chunk hash.
const PER_CHUNK: usize = 4;

/// What happened to a key, compactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    L1(RemovalCause),
    L2Evicted(u64),
    L2Deleted(u64),
    QuotaRefused,
    NoMemory,
    BlobRefused(u64),
}

/// A (model, world size, object group, salt) that stored a chunk.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Variant {
    model: ModelName,
    world_size: u32,
    object_group: u32,
    salt: CacheSalt,
}

impl Variant {
    fn of(key: &ObjectKey) -> Self {
        Self {
            model: key.model_name.clone(),
            world_size: key.kv_rank.world_size(),
            object_group: key.object_group_id,
            salt: key.cache_salt.clone(),
        }
    }
}

/// Why one chunk was not served.
#[derive(Debug, Clone, PartialEq)]
pub enum Reason {
    /// No worker registered the model at this world size: nothing was looked up.
    NotRegistered,
    /// No record of this chunk ever being stored here.
    NeverStored,
    /// Stored under another model, world size, object group or salt (named).
    OtherVariant {
        /// The model that holds it.
        model: String,
        /// Its world size.
        world_size: u32,
        /// Its object group.
        object_group: u32,
        /// Its salt.
        cache_salt: String,
    },
    /// Evicted by a tier's policy.
    Evicted {
        /// `L1`, or the L2 adapter (`type#id`).
        tier: String,
        /// The eviction policy.
        policy: String,
        /// `memory` (room for a store, or the watermark), `quota` or `capacity` (L2).
        trigger: &'static str,
        /// When (Unix milliseconds).
        at_ms: u64,
    },
    /// Deleted on request, cleared, or a temporary object released.
    Deleted {
        /// `L1`, or the L2 adapter.
        tier: String,
        /// `deleted`, `cleared` or `released`.
        how: &'static str,
        /// When.
        at_ms: u64,
    },
    /// A store of this chunk had not committed yet (write-locked).
    Locked,
    /// The L2 tier failed during this lookup.
    L2Error {
        /// The adapter.
        adapter: String,
        /// Its error.
        error: String,
    },
    /// The L2 prefetch ran past its deadline.
    L2Timeout,
    /// L2 held a blob that failed verification: wrong KV is a miss, never served.
    L2Corrupt {
        /// The adapter.
        adapter: String,
        /// What was wrong.
        reason: String,
    },
    /// A peer of the fleet did not answer, or its transfer failed.
    PeerFailed {
        /// The peer.
        peer: String,
        /// What went wrong.
        error: String,
    },
    /// A store of this chunk was refused: its tenant was over its L1 quota.
    QuotaRefused {
        /// When.
        at_ms: u64,
    },
    /// A store of this chunk was refused: L1 had no room (everything locked).
    NoMemory {
        /// When.
        at_ms: u64,
    },
    /// Resident, but a chunk before it missed: a prefix cache cannot use it.
    BehindMiss,
}

impl Reason {
    /// The metric label and JSON `reason`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::NotRegistered => "not_registered",
            Self::NeverStored => "never_stored",
            Self::OtherVariant { .. } => "other_variant",
            Self::Evicted { .. } => "evicted",
            Self::Deleted { .. } => "deleted",
            Self::Locked => "locked",
            Self::L2Error { .. } => "l2_error",
            Self::L2Timeout => "l2_timeout",
            Self::L2Corrupt { .. } => "l2_corrupt",
            Self::PeerFailed { .. } => "peer_failed",
            Self::QuotaRefused { .. } => "quota_refused",
            Self::NoMemory { .. } => "no_memory",
            Self::BehindMiss => "behind_miss",
        }
    }

    /// Every reason's name, for docs and tests.
    pub const NAMES: [&'static str; 13] = [
        "not_registered",
        "never_stored",
        "other_variant",
        "evicted",
        "deleted",
        "locked",
        "l2_error",
        "l2_timeout",
        "l2_corrupt",
        "peer_failed",
        "quota_refused",
        "no_memory",
        "behind_miss",
    ];

    fn json(&self, now_ms: u64) -> Value {
        let ago = |at: u64| now_ms.saturating_sub(at) as f64 / 1000.0;
        let mut v = match self {
            Self::OtherVariant { model, world_size, object_group, cache_salt } => json!({
                "stored_as": {"model": model, "world_size": world_size,
                              "object_group": object_group, "cache_salt": cache_salt}}),
            Self::Evicted { tier, policy, trigger, at_ms } => json!({"tier": tier,
                "policy": policy, "trigger": trigger, "at_unix_ms": at_ms,
                "seconds_ago": ago(*at_ms)}),
            Self::Deleted { tier, how, at_ms } => json!({"tier": tier, "how": how,
                "at_unix_ms": at_ms, "seconds_ago": ago(*at_ms)}),
            Self::L2Error { adapter, error } => json!({"adapter": adapter, "error": error}),
            Self::L2Corrupt { adapter, reason } => json!({"adapter": adapter, "error": reason}),
            Self::PeerFailed { peer, error } => json!({"peer": peer, "error": error}),
            Self::QuotaRefused { at_ms } | Self::NoMemory { at_ms } => {
                json!({"tier": "L1", "at_unix_ms": at_ms, "seconds_ago": ago(*at_ms)})
            }
            _ => json!({}),
        };
        v["reason"] = json!(self.name());
        v["detail"] = json!(self.sentence(now_ms));
        v
    }

    /// One sentence for people.
    pub fn sentence(&self, now_ms: u64) -> String {
        let ago = |at: &u64| format!("{:.1} s ago", now_ms.saturating_sub(*at) as f64 / 1000.0);
        match self {
            Self::NotRegistered => {
                "no engine registered this model at this world size: nothing was looked up".into()
            }
            Self::NeverStored => "never stored under this key".into(),
            Self::OtherVariant { model, world_size, object_group, cache_salt } => format!(
                "stored under another key: model {model:?}, world size {world_size}, object group \
                 {object_group}, cache salt {cache_salt:?}"
            ),
            Self::Evicted { tier, policy, trigger, at_ms } => {
                format!("evicted from {tier} by {policy} ({trigger}) {}", ago(at_ms))
            }
            Self::Deleted { tier, how, at_ms } => format!("{how} from {tier} {}", ago(at_ms)),
            Self::Locked => {
                "a store of this chunk was in flight (write-locked) when the lookup ran".into()
            }
            Self::L2Error { adapter, error } => format!("L2 adapter {adapter} failed: {error}"),
            Self::L2Timeout => "the L2 prefetch ran past its deadline".into(),
            Self::L2Corrupt { adapter, reason } => {
                format!("L2 adapter {adapter} held a blob that failed verification: {reason}")
            }
            Self::PeerFailed { peer, error } => format!("peer {peer} did not serve it: {error}"),
            Self::QuotaRefused { at_ms } => {
                format!("its store was refused: the tenant was over its L1 quota {}", ago(at_ms))
            }
            Self::NoMemory { at_ms } => {
                format!("its store was refused: L1 had no room {}", ago(at_ms))
            }
            Self::BehindMiss => "in L1, but a chunk before it missed".into(),
        }
    }
}

/// What became of one chunk of a lookup.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Served from L1.
    HitL1,
    /// Served from L2 or a peer (loaded into L1 by the lookup's prefetch).
    HitLoaded,
    /// Not served.
    Miss(Reason),
}

impl Verdict {
    /// The verdict with its times zeroed: what decides whether two chunks share a run.
    fn timeless(&self) -> Verdict {
        let mut v = self.clone();
        if let Verdict::Miss(
            Reason::Evicted { at_ms, .. }
            | Reason::Deleted { at_ms, .. }
            | Reason::QuotaRefused { at_ms }
            | Reason::NoMemory { at_ms },
        ) = &mut v
        {
            *at_ms = 0;
        }
        v
    }
}

/// Chunks `first..end` of a lookup, with one verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    /// First chunk.
    pub first: usize,
    /// One past the last chunk.
    pub end: usize,
    /// What became of them.
    pub verdict: Verdict,
}

/// The explanation of a request's last lookup.
#[derive(Debug, Clone)]
pub struct Explanation {
    /// The request.
    pub request_id: String,
    /// When the lookup was asked (Unix milliseconds).
    pub at_ms: u64,
    /// Whole chunks asked for.
    pub chunks: usize,
    /// Tokens per chunk.
    pub chunk_size: usize,
    /// The model, salt and world size looked up (empty until the lookup reached the tiers).
    pub model: String,
    /// Its salt.
    pub cache_salt: String,
    /// Its world size (0: not looked up).
    pub world_size: u32,
    /// Chunks served (a prefix).
    pub hits: usize,
    /// Of those, chunks loaded from L2 or a peer.
    pub loaded: usize,
    /// Whether its prefetch is still running (the runs past L1's hits are not judged yet).
    pub pending: bool,
    /// The chunks, in runs.
    pub runs: Vec<Run>,
}

impl Explanation {
    /// The JSON of `GET /cache/requests/{id}/explain`.
    pub fn to_json(&self) -> Value {
        let now = now_ms();
        let runs: Vec<Value> = self
            .runs
            .iter()
            .map(|r| {
                let mut v = match &r.verdict {
                    Verdict::HitL1 => json!({"outcome": "hit", "tier": "L1"}),
                    Verdict::HitLoaded => json!({"outcome": "hit", "tier": "L2 or peer"}),
                    Verdict::Miss(reason) => {
                        let mut v = reason.json(now);
                        v["outcome"] = json!("miss");
                        v
                    }
                };
                v["first_chunk"] = json!(r.first);
                v["chunks"] = json!(r.end - r.first);
                v["tokens"] = json!([r.first * self.chunk_size, r.end * self.chunk_size]);
                v
            })
            .collect();
        let first_miss = self.runs.iter().find_map(|r| match &r.verdict {
            Verdict::Miss(reason) => Some(json!({"chunk": r.first, "reason": reason.name(),
                                                 "detail": reason.sentence(now)})),
            _ => None,
        });
        json!({
            "request_id": self.request_id,
            "at_unix_ms": self.at_ms,
            "seconds_ago": now.saturating_sub(self.at_ms) as f64 / 1000.0,
            "model": self.model,
            "cache_salt": self.cache_salt,
            "world_size": self.world_size,
            "chunk_size": self.chunk_size,
            "chunks": self.chunks,
            "hit_chunks": self.hits,
            "hit_tokens": self.hits * self.chunk_size,
            "loaded_chunks": self.loaded,
            "pending": self.pending,
            "first_miss": first_miss,
            "runs": runs,
        })
    }
}

/// What a lookup left to judge once it answers.
#[derive(Debug, Clone)]
struct Draft {
    /// Per (object group, shard) cell, one of its keys (its chunk hash is replaced).
    cells: Vec<ObjectKey>,
    hashes: Vec<ChunkHash>,
    l1_hits: usize,
}

#[derive(Debug)]
struct Record {
    explanation: Explanation,
    draft: Option<Draft>,
}

/// A map that forgets its oldest insertions past `cap` entries.
#[derive(Debug)]
struct Bounded<K, V> {
    map: HashMap<K, (V, u64)>,
    order: VecDeque<(K, u64)>,
    seq: u64,
    cap: usize,
}

impl<K: Hash + Eq + Clone, V> Bounded<K, V> {
    fn new(cap: usize) -> Self {
        Self { map: HashMap::new(), order: VecDeque::new(), seq: 0, cap }
    }

    /// Inserts or replaces `k` (it becomes the newest).
    fn put(&mut self, k: K, v: V) {
        if self.cap == 0 {
            return;
        }
        self.seq += 1;
        self.map.insert(k.clone(), (v, self.seq));
        self.order.push_back((k, self.seq));
        while self.map.len() > self.cap || self.order.len() > 2 * self.cap {
            let Some((old, seq)) = self.order.pop_front() else { break };
            if self.map.get(&old).is_some_and(|(_, s)| *s == seq) {
                self.map.remove(&old);
            }
        }
    }

    fn remove(&mut self, k: &K) {
        self.map.remove(k);
    }

    fn get<Q: Hash + Eq + ?Sized>(&self, k: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
    {
        self.map.get(k).map(|(v, _)| v)
    }

    fn get_mut<Q: Hash + Eq + ?Sized>(&mut self, k: &Q) -> Option<&mut V>
    where
        K: std::borrow::Borrow<Q>,
    {
        self.map.get_mut(k).map(|(v, _)| v)
    }
}

#[derive(Debug)]
struct Inner {
    /// What L1 did with a key (removed it, refused its store).
    l1_fates: Bounded<u64, (u64, Fate)>,
    /// What L2 did with a key (evicted, deleted, refused its blob); forgotten when an adapter
    /// stores the key again.
    l2_fates: Bounded<u64, (u64, Fate)>,
    chunks: Bounded<u64, Vec<u32>>,
    variants: Vec<Variant>,
    variant_ids: HashMap<Variant, u32>,
    requests: Bounded<String, Record>,
}

impl Inner {
    fn variant_id(&mut self, v: Variant) -> Option<u32> {
        if let Some(&id) = self.variant_ids.get(&v) {
            return Some(id);
        }
        if self.variants.len() >= VARIANTS {
            return None;
        }
        let id = self.variants.len() as u32;
        self.variants.push(v.clone());
        self.variant_ids.insert(v, id);
        Some(id)
    }
}

/// Remembers why keys are absent and explains each request's last lookup.
#[derive(Debug)]
pub struct Explainer {
    /// False with `--explain-requests 0`: every hook returns at once, without the lock.
    enabled: bool,
    inner: Mutex<Inner>,
    l1: L1Cache,
    chunk_size: usize,
    /// L1's eviction policy, as named in explanations.
    l1_policy: String,
    /// L2 adapters' names (`type#id`) and eviction policies, by id.
    adapters: Mutex<HashMap<u64, (String, String)>>,
    /// Missed chunks by reason.
    misses: Family<ReasonLabel, Counter>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn fingerprint(h: &impl Hash) -> u64 {
    let mut s = twox_hash::XxHash3_64::default();
    h.hash(&mut s);
    s.finish()
}

impl Explainer {
    /// An explainer over `l1`, remembering the last lookup of `requests` requests (0: none).
    /// Missed chunks are counted into `misses`, by reason.
    pub fn new(
        l1: L1Cache,
        chunk_size: usize,
        requests: usize,
        misses: Family<ReasonLabel, Counter>,
    ) -> Self {
        let l1_policy = l1.config().eviction_policy.to_string();
        Self {
            inner: Mutex::new(Inner {
                l1_fates: Bounded::new(if requests == 0 { 0 } else { FATES }),
                l2_fates: Bounded::new(if requests == 0 { 0 } else { FATES }),
                chunks: Bounded::new(if requests == 0 { 0 } else { CHUNKS }),
                variants: Vec::new(),
                variant_ids: HashMap::new(),
                requests: Bounded::new(requests),
            }),
            enabled: requests > 0,
            l1,
            chunk_size,
            l1_policy,
            adapters: Mutex::new(HashMap::new()),
            misses,
        }
    }

    /// Whether it remembers anything (`--explain-requests 0` turns it off).
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Names L2 adapter `id` (`type#id`) and its eviction policy in explanations.
    pub fn name_adapter(&self, id: u64, kind: &str, policy: &str) {
        self.adapters.lock().insert(id, (format!("{kind}#{id}"), policy.to_owned()));
    }

    /// The most recent lookups, newest first, at most `limit`.
    pub fn recent(&self, limit: usize) -> Vec<Explanation> {
        let inner = self.inner.lock();
        let b = &inner.requests;
        b.order
            .iter()
            .rev()
            .filter_map(|(k, seq)| match b.map.get(k) {
                Some((r, s)) if s == seq => Some(r.explanation.clone()),
                _ => None,
            })
            .take(limit)
            .collect()
    }

    /// The explanation of `request_id`'s last lookup, if it is still remembered.
    pub fn explain(&self, request_id: &str) -> Option<Explanation> {
        self.inner.lock().requests.get(request_id).map(|r| r.explanation.clone())
    }

    /// Records `fate` for every key of `keys`: fingerprints first, then one lock.
    fn fate(&self, keys: &[ObjectKey], fate: Fate) {
        if !self.enabled {
            return;
        }
        let fps: Vec<u64> = keys.iter().map(fingerprint).collect();
        let at = now_ms();
        let mut inner = self.inner.lock();
        let fates = match fate {
            Fate::L2Evicted(_) | Fate::L2Deleted(_) | Fate::BlobRefused(_) => &mut inner.l2_fates,
            _ => &mut inner.l1_fates,
        };
        for fp in fps {
            fates.put(fp, (at, fate));
        }
    }

    /// An L2 adapter stored `keys`: what L2 did with them before no longer explains a miss.
    pub fn l2_stored(&self, keys: &[(ObjectKey, u64)]) {
        if !self.enabled {
            return;
        }
        let fps: Vec<u64> = keys.iter().map(|(k, _)| fingerprint(k)).collect();
        let mut inner = self.inner.lock();
        for fp in fps {
            inner.l2_fates.remove(&fp);
        }
    }

    /// L1 let `key` go.
    pub fn l1_removed(&self, key: &ObjectKey, cause: RemovalCause) {
        self.fate(std::slice::from_ref(key), Fate::L1(cause));
    }

    /// `key` became resident in L1: its chunk's variants learn its.
    pub fn committed(&self, key: &ObjectKey) {
        if !self.enabled {
            return;
        }
        let chunk = fingerprint(&key.chunk_hash);
        let mut inner = self.inner.lock();
        let Some(id) = inner.variant_id(Variant::of(key)) else { return };
        match inner.chunks.get_mut(&chunk) {
            Some(ids) if ids.contains(&id) => {}
            Some(ids) => {
                if ids.len() >= PER_CHUNK {
                    ids.remove(0);
                }
                ids.push(id);
            }
            None => inner.chunks.put(chunk, vec![id]),
        }
    }

    /// L2 adapter `adapter` evicted `keys`.
    pub fn l2_evicted(&self, adapter: u64, keys: &[ObjectKey]) {
        self.fate(keys, Fate::L2Evicted(adapter));
    }

    /// L2 adapter `adapter` deleted `keys` on request.
    pub fn l2_deleted(&self, adapter: u64, keys: &[ObjectKey]) {
        self.fate(keys, Fate::L2Deleted(adapter));
    }

    /// L2 adapter `adapter` refused the blob of `key`.
    pub fn blob_refused(&self, adapter: u64, key: &ObjectKey) {
        self.fate(std::slice::from_ref(key), Fate::BlobRefused(adapter));
    }

    fn adapter(&self, id: u64) -> (String, String) {
        self.adapters.lock().get(&id).cloned().unwrap_or_else(|| (format!("l2#{id}"), "LRU".into()))
    }

    fn asked(&self, request_id: &str, chunks: usize) {
        if !self.enabled {
            return;
        }
        let runs = if chunks == 0 {
            Vec::new()
        } else {
            vec![Run { first: 0, end: chunks, verdict: Verdict::Miss(Reason::NotRegistered) }]
        };
        let explanation = Explanation {
            request_id: request_id.to_owned(),
            at_ms: now_ms(),
            chunks,
            chunk_size: self.chunk_size,
            model: String::new(),
            cache_salt: String::new(),
            world_size: 0,
            hits: 0,
            loaded: 0,
            pending: false,
            runs,
        };
        self.inner.lock().requests.put(request_id.to_owned(), Record { explanation, draft: None });
    }

    fn started(
        &self,
        request_id: &str,
        hashes: &[ChunkHash],
        req: &lmcache_storage::GroupLookupRequest,
    ) {
        let cells: Vec<ObjectKey> = req
            .groups
            .iter()
            .flat_map(|(_, shards)| shards.iter().filter_map(|(_, keys)| keys.first().cloned()))
            .collect();
        let Some(first) = cells.first() else { return };
        let (model, salt, ws) = (
            first.model_name.as_str().to_owned(),
            first.cache_salt.as_str().to_owned(),
            first.kv_rank.world_size(),
        );
        let mut inner = self.inner.lock();
        let Some(r) = inner.requests.get_mut(request_id) else { return };
        r.explanation.model = model;
        r.explanation.cache_salt = salt;
        r.explanation.world_size = ws;
        r.explanation.pending = true;
        r.explanation.runs.clear();
        r.draft = Some(Draft { cells, hashes: hashes.to_vec(), l1_hits: 0 });
    }

    fn looked_up(&self, request_id: &str, l1_hits: usize, pending: bool) {
        if pending {
            if let Some(r) = self.inner.lock().requests.get_mut(request_id)
                && let Some(d) = &mut r.draft
            {
                d.l1_hits = l1_hits;
            }
            return;
        }
        self.judge(request_id, l1_hits, 0, None);
    }

    /// Judges the lookup's chunks: hits, then each missed chunk's reason.
    fn judge(
        &self,
        request_id: &str,
        hits: usize,
        loaded: usize,
        trouble: Option<&PrefetchTrouble>,
    ) {
        let Some(draft) =
            self.inner.lock().requests.get_mut(request_id).and_then(|r| r.draft.take())
        else {
            return;
        };
        let chunks = draft.hashes.len();
        let hits = hits.min(chunks);
        // Where every cell of every missed chunk stands in L1 (L1's lock, not ours).
        let missed = chunks - hits;
        let keys: Vec<ObjectKey> = draft.hashes[hits..]
            .iter()
            .flat_map(|h| draft.cells.iter().map(|c| ObjectKey { chunk_hash: *h, ..c.clone() }))
            .collect();
        let residency = self.l1.probe(&keys);
        let per_chunk = draft.cells.len().max(1);
        let trouble_reason = trouble.map(|t| match t {
            PrefetchTrouble::TimedOut => Reason::L2Timeout,
            PrefetchTrouble::L2Error { adapter, error } => {
                Reason::L2Error { adapter: adapter.clone(), error: error.clone() }
            }
            PrefetchTrouble::BlobRefused { adapter, reason } => {
                Reason::L2Corrupt { adapter: adapter.clone(), reason: reason.clone() }
            }
            PrefetchTrouble::Peer { peer, error } => {
                Reason::PeerFailed { peer: peer.clone(), error: error.clone() }
            }
        });
        // Fingerprints first, outside the lock.
        let absent: Vec<Option<(usize, u64, u64)>> = (0..missed)
            .map(|m| {
                let cells = &residency[m * per_chunk..(m + 1) * per_chunk];
                cells.iter().position(|r| *r != Residency::Resident).map(|i| {
                    let k = &keys[m * per_chunk + i];
                    (i, fingerprint(k), fingerprint(&k.chunk_hash))
                })
            })
            .collect();
        let mut reasons = Vec::with_capacity(missed);
        {
            let inner = self.inner.lock();
            for (m, a) in absent.iter().enumerate() {
                let Some((i, key_fp, chunk_fp)) = *a else {
                    reasons.push(Reason::BehindMiss);
                    continue;
                };
                let key = &keys[m * per_chunk + i];
                let reason = if residency[m * per_chunk + i] == Residency::BeingWritten {
                    Reason::Locked
                } else if let Some(t) = &trouble_reason {
                    t.clone()
                } else if let Some(&(at_ms, fate)) =
                    // L2's fate first: a key L1 let go is a miss only if L2 lost it too.
                    inner
                        .l2_fates
                        .get(&key_fp)
                        .or_else(|| inner.l1_fates.get(&key_fp))
                {
                    self.fate_reason(fate, at_ms)
                } else {
                    let mine = Variant::of(key);
                    let ids = inner.chunks.get(&chunk_fp);
                    let other = ids.and_then(|ids| {
                        ids.iter()
                            .filter_map(|&i| inner.variants.get(i as usize))
                            .find(|v| **v != mine)
                    });
                    match other {
                        Some(v) => Reason::OtherVariant {
                            model: v.model.as_str().to_owned(),
                            world_size: v.world_size,
                            object_group: v.object_group,
                            cache_salt: v.salt.as_str().to_owned(),
                        },
                        None => Reason::NeverStored,
                    }
                };
                reasons.push(reason);
            }
        }
        // The first missed chunk is never "behind" a miss: all its cells were resident only if
        // a store in flight committed between the lookup and this judgement.
        if let Some(first) = reasons.first_mut()
            && *first == Reason::BehindMiss
        {
            *first = Reason::Locked;
        }
        for r in &reasons {
            self.misses.get_or_create(&ReasonLabel { reason: r.name().to_owned() }).inc();
        }
        // Chunks with the same verdict, moments apart, are one run (its first chunk's time).
        let mut runs: Vec<Run> = Vec::new();
        let mut push = |c: usize, v: Verdict| match runs.last_mut() {
            Some(last) if last.verdict.timeless() == v.timeless() && last.end == c => last.end += 1,
            _ => runs.push(Run { first: c, end: c + 1, verdict: v }),
        };
        for c in 0..hits {
            push(c, if c < hits - loaded.min(hits) { Verdict::HitL1 } else { Verdict::HitLoaded });
        }
        for (m, r) in reasons.into_iter().enumerate() {
            push(hits + m, Verdict::Miss(r));
        }
        let mut inner = self.inner.lock();
        if let Some(r) = inner.requests.get_mut(request_id) {
            r.explanation.hits = hits;
            r.explanation.loaded = loaded.min(hits);
            r.explanation.pending = false;
            r.explanation.runs = runs;
        }
    }

    fn fate_reason(&self, fate: Fate, at_ms: u64) -> Reason {
        match fate {
            Fate::L1(RemovalCause::Evicted) => Reason::Evicted {
                tier: "L1".into(),
                policy: self.l1_policy.clone(),
                trigger: "memory",
                at_ms,
            },
            Fate::L1(RemovalCause::EvictedForQuota) => Reason::Evicted {
                tier: "L1".into(),
                policy: self.l1_policy.clone(),
                trigger: "quota",
                at_ms,
            },
            Fate::L1(c) => Reason::Deleted { tier: "L1".into(), how: c.as_str(), at_ms },
            Fate::L2Evicted(a) => {
                let (tier, policy) = self.adapter(a);
                Reason::Evicted { tier, policy, trigger: "capacity", at_ms }
            }
            Fate::L2Deleted(a) => {
                Reason::Deleted { tier: self.adapter(a).0, how: "deleted", at_ms }
            }
            Fate::QuotaRefused => Reason::QuotaRefused { at_ms },
            Fate::NoMemory => Reason::NoMemory { at_ms },
            Fate::BlobRefused(a) => Reason::L2Corrupt {
                adapter: self.adapter(a).0,
                reason: "the blob failed verification when last loaded".into(),
            },
        }
    }
}

/// The explainer as a storage subscriber.
#[derive(Debug)]
pub struct ExplainSubscriber(pub Arc<Explainer>);

impl StorageSubscriber for ExplainSubscriber {
    fn on_event(&self, event: &StorageEvent<'_>) {
        let x = &self.0;
        match event {
            StorageEvent::LookupAsked { request_id, chunks } => x.asked(request_id, *chunks),
            StorageEvent::LookupStarted { ctx, request } => {
                x.started(ctx.request_id, ctx.hashes, request)
            }
            StorageEvent::LookedUp { ctx, l1_hits, pending, .. } => {
                x.looked_up(ctx.request_id, *l1_hits, *pending)
            }
            StorageEvent::LookupSettled { ctx, settled, .. } => {
                x.judge(ctx.request_id, settled.hits, settled.l2_hits, settled.trouble.as_ref())
            }
            StorageEvent::WriteRefused { key, error, .. } => match error {
                L1Error::QuotaExceeded { .. } => {
                    x.fate(std::slice::from_ref(*key), Fate::QuotaRefused)
                }
                L1Error::OutOfMemory { .. } => x.fate(std::slice::from_ref(*key), Fate::NoMemory),
                _ => {}
            },
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bounded_map_forgets_its_oldest_and_a_replaced_key_is_newest() {
        let mut b: Bounded<u32, u32> = Bounded::new(2);
        b.put(1, 10);
        b.put(2, 20);
        b.put(1, 11); // 1 is now the newest
        b.put(3, 30); // 2 goes
        assert_eq!(b.get(&1), Some(&11));
        assert_eq!(b.get(&2), None);
        assert_eq!(b.get(&3), Some(&30));
        for i in 0..1000 {
            b.put(i % 7, i);
        }
        assert!(
            b.map.len() <= 2 && b.order.len() <= 4,
            "bounded: {} {}",
            b.map.len(),
            b.order.len()
        );
        let mut off: Bounded<u32, u32> = Bounded::new(0);
        off.put(1, 1);
        assert_eq!(off.get(&1), None);
    }

    #[test]
    fn every_reason_has_a_listed_name_and_a_sentence() {
        let all = [
            Reason::NotRegistered,
            Reason::NeverStored,
            Reason::OtherVariant {
                model: "m".into(),
                world_size: 1,
                object_group: 0,
                cache_salt: "a".into(),
            },
            Reason::Evicted {
                tier: "L1".into(),
                policy: "LRU".into(),
                trigger: "memory",
                at_ms: 0,
            },
            Reason::Deleted { tier: "L1".into(), how: "deleted", at_ms: 0 },
            Reason::Locked,
            Reason::L2Error { adapter: "fs#0".into(), error: "e".into() },
            Reason::L2Timeout,
            Reason::L2Corrupt { adapter: "fs#0".into(), reason: "r".into() },
            Reason::PeerFailed { peer: "p".into(), error: "e".into() },
            Reason::QuotaRefused { at_ms: 0 },
            Reason::NoMemory { at_ms: 0 },
            Reason::BehindMiss,
        ];
        let names: Vec<&str> = all.iter().map(Reason::name).collect();
        assert_eq!(names, Reason::NAMES);
        for r in &all {
            assert!(!r.sentence(1000).is_empty());
            assert_eq!(r.json(1000)["reason"], r.name());
        }
    }
}
