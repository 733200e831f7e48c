//! The adapter interface: an async, batched byte store keyed by [`ObjectKey`].
//!
//! Adapters see opaque [`Blob`]s; the tier above encodes and verifies them, so an adapter
//! cannot serve bytes that fail the blob checks. Every method takes a whole batch and returns
//! one result per key (or one error for the whole batch when the backend could not be asked).
//! Implementations must be `Send + Sync`: the store and prefetch controllers call them
//! concurrently.

use async_trait::async_trait;
use bytes::Bytes;
use lmcache_core::ObjectKey;

use crate::blob::Blob;
use crate::error::L2Error;

/// The slowest transfer rate a healthy backend is allowed, in bytes per second: time limits
/// grow by the bytes in flight at this rate, so a batch of 32 MiB objects is never cut off by a
/// limit sized for small values.
pub const FLOOR_BANDWIDTH: u64 = 100_000_000;

/// The time limit of an operation moving `bytes`: `base` plus `bytes` at [`FLOOR_BANDWIDTH`].
pub fn time_budget(base: std::time::Duration, bytes: u64) -> std::time::Duration {
    base + std::time::Duration::from_secs_f64(bytes as f64 / FLOOR_BANDWIDTH as f64)
}

/// What happened to one stored key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// Written: this many bytes went to the backend.
    Written(u64),
    /// The backend already held the key; nothing was written.
    AlreadyPresent,
}

/// Which keys a listing returns: all, or those of one model and/or one cache salt (a
/// tenant's listing shows only its own salt's objects).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KeyFilter {
    /// Only keys of this model.
    pub model: Option<String>,
    /// Only keys of this cache salt (`Some("")`: the unsalted ones).
    pub cache_salt: Option<String>,
}

impl KeyFilter {
    /// Every key.
    pub const ALL: KeyFilter = KeyFilter { model: None, cache_salt: None };

    /// Keys of `model`.
    pub fn model(model: &str) -> Self {
        Self { model: Some(model.to_owned()), cache_salt: None }
    }

    /// True when `key` passes.
    pub fn matches(&self, key: &ObjectKey) -> bool {
        self.model.as_deref().is_none_or(|m| key.model_name.as_str() == m)
            && self.cache_salt.as_deref().is_none_or(|s| key.cache_salt.as_str() == s)
    }
}

/// One page of a key listing.
#[derive(Debug, Default, Clone)]
pub struct KeyPage {
    /// Keys with their stored sizes.
    pub keys: Vec<(ObjectKey, u64)>,
    /// Cursor for the next page; `None` on the last page.
    pub next: Option<String>,
}

/// Memory a blob's payload is read straight into (an L1 write reservation, a buffer).
pub trait PayloadSink: Send + 'static {
    /// The destination; its length is the payload length expected.
    fn payload_mut(&mut self) -> &mut [u8];
    /// The sink as `Any`, so that its owner can take its own type back.
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
}

impl PayloadSink for Vec<u8> {
    fn payload_mut(&mut self) -> &mut [u8] {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

/// One direct load: the key, the blob header length expected (see
/// [`crate::blob::header_len`]), and where the payload goes.
pub type DirectItem = (ObjectKey, usize, Box<dyn PayloadSink>);

/// What a direct load read besides the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectHeader {
    /// The blob header's bytes.
    pub bytes: Vec<u8>,
    /// The payload's xxh3-64, when the adapter hashed each piece of the payload in the sink as
    /// it landed there, still in cache ([`crate::blob::PieceHasher`]): the verifier then reads
    /// the payload no second time. Only this crate's adapters set it.
    pub payload_xxh3: Option<u64>,
}

impl From<Vec<u8>> for DirectHeader {
    fn from(bytes: Vec<u8>) -> Self {
        Self { bytes, payload_xxh3: None }
    }
}

/// The result of one direct load: the sink back, and the header read (`None` = miss,
/// including a stored blob of another length).
pub type DirectResult = (Box<dyn PayloadSink>, Result<Option<DirectHeader>, L2Error>);

/// Storage below L1.
#[async_trait]
pub trait L2Adapter: Send + Sync + std::fmt::Debug {
    /// The configured type name (`fs`, `redis`, ...).
    fn kind(&self) -> &'static str;

    /// Stores `items`. Keys the backend already holds may be skipped ([`Stored::AlreadyPresent`]).
    async fn store(&self, items: Vec<(ObjectKey, Blob)>) -> Vec<Result<Stored, L2Error>>;

    /// Which of `keys` the backend holds.
    async fn lookup(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, L2Error>;

    /// The stored bytes of each key, `None` for a miss. The caller verifies them.
    async fn load(&self, keys: &[ObjectKey]) -> Vec<Result<Option<Bytes>, L2Error>>;

    /// Which of `keys` the backend holds, with each stored blob's length, for adapters that
    /// know lengths as cheaply as presence. Default: [`L2Error::Unsupported`].
    async fn lookup_sized(&self, _keys: &[ObjectKey]) -> Result<Vec<Option<u64>>, L2Error> {
        Err(L2Error::unsupported("sized lookup"))
    }

    /// Loads blobs whose length is known: the header into a new buffer, the payload straight
    /// into each sink (no intermediate copy where the backend allows). A stored blob of another
    /// length is a miss, or [`L2Error::Corrupt`] when the adapter sees it is torn. The caller
    /// verifies header and payload. Default: [`Self::load`] and a copy.
    async fn load_direct(&self, items: Vec<DirectItem>) -> Vec<DirectResult> {
        load_direct_by_copy(self, items).await
    }

    /// Deletes `keys`; returns how many were present.
    async fn delete(&self, keys: &[ObjectKey]) -> Result<u64, L2Error>;

    /// Lists stored keys that pass `filter`, a page at a time.
    async fn list(
        &self,
        _filter: &KeyFilter,
        _cursor: Option<&str>,
        _limit: usize,
    ) -> Result<KeyPage, L2Error> {
        Err(L2Error::unsupported("listing"))
    }

    /// One cheap round trip to the backend, for health checks: the tier marks an adapter
    /// down only after repeated failures, and up again when this answers. Default: an empty
    /// lookup.
    async fn ping(&self) -> Result<(), L2Error> {
        self.lookup(&[]).await.map(|_| ())
    }

    /// Every stored key with its stored size, at most `limit` of them, for seeding the usage
    /// ledger at start. Default: pages through [`Self::list`].
    async fn scan(&self, limit: usize) -> Result<Vec<(ObjectKey, u64)>, L2Error> {
        let mut out: Vec<(ObjectKey, u64)> = Vec::new();
        let mut cursor: Option<String> = None;
        while out.len() < limit {
            let page = self
                .list(&KeyFilter::ALL, cursor.as_deref(), (limit - out.len()).min(1000))
                .await?;
            out.extend(page.keys);
            match page.next {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        out.truncate(limit);
        Ok(out)
    }

    /// Bytes the backend can hold, if bounded.
    fn capacity(&self) -> Option<u64> {
        None
    }

    /// Adapter-specific settings for /config and /status (never secrets).
    fn describe(&self) -> serde_json::Value {
        serde_json::json!({ "type": self.kind() })
    }

    /// Flushes and releases the backend (checkpoints, connections).
    async fn close(&self) {}
}

/// [`L2Adapter::load_direct`] through [`L2Adapter::load`] and a copy into each sink: a stored
/// blob of another length than the header plus the sink is refused as truncated.
pub(crate) async fn load_direct_by_copy<A: L2Adapter + ?Sized>(
    adapter: &A,
    items: Vec<DirectItem>,
) -> Vec<DirectResult> {
    let keys: Vec<ObjectKey> = items.iter().map(|(k, _, _)| k.clone()).collect();
    let loaded = adapter.load(&keys).await;
    items
        .into_iter()
        .zip(loaded)
        .map(|((_, hlen, mut sink), r)| {
            let r = r.and_then(|found| {
                let Some(b) = found else { return Ok(None) };
                let dest = sink.payload_mut();
                if b.len() != hlen + dest.len() {
                    return Err(crate::blob::BlobError::Truncated {
                        got: b.len(),
                        need: hlen + dest.len(),
                    }
                    .into());
                }
                dest.copy_from_slice(&b[hlen..]);
                Ok(Some(b[..hlen].to_vec().into()))
            });
            (sink, r)
        })
        .collect()
}

/// One page of `keys` (key, stored size) that pass `filter`, in wire-key order: the
/// listing of adapters that hold their keys in memory or get them in one scan.
pub(crate) fn page_keys<'a>(
    keys: impl IntoIterator<Item = (&'a ObjectKey, u64)>,
    filter: &KeyFilter,
    cursor: Option<&str>,
    limit: usize,
) -> KeyPage {
    let mut all: Vec<(String, ObjectKey, u64)> = keys
        .into_iter()
        .filter(|(k, _)| filter.matches(k))
        .map(|(k, n)| (crate::wire_key::encode(k), k.clone(), n))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    page_sorted(all, cursor, limit)
}

/// Pages a listing sorted by wire key: the cursor is the last wire key of the previous page.
pub(crate) fn page_sorted(
    sorted: Vec<(String, ObjectKey, u64)>,
    cursor: Option<&str>,
    limit: usize,
) -> KeyPage {
    let start = cursor.map_or(0, |c| sorted.partition_point(|(w, _, _)| w.as_str() <= c));
    let limit = limit.max(1);
    let end = (start + limit).min(sorted.len());
    let next = (end < sorted.len()).then(|| sorted[end - 1].0.clone());
    KeyPage { keys: sorted[start..end].iter().map(|(_, k, n)| (k.clone(), *n)).collect(), next }
}
