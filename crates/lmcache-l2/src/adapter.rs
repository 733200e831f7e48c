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

/// What happened to one stored key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// Written: this many bytes went to the backend.
    Written(u64),
    /// The backend already held the key; nothing was written.
    AlreadyPresent,
}

/// One page of a key listing.
#[derive(Debug, Default, Clone)]
pub struct KeyPage {
    /// Keys with their stored sizes.
    pub keys: Vec<(ObjectKey, u64)>,
    /// Cursor for the next page; `None` on the last page.
    pub next: Option<String>,
}

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

    /// Deletes `keys`; returns how many were present.
    async fn delete(&self, keys: &[ObjectKey]) -> Result<u64, L2Error>;

    /// Lists stored keys, optionally of one model, a page at a time.
    async fn list(
        &self,
        _model: Option<&str>,
        _cursor: Option<&str>,
        _limit: usize,
    ) -> Result<KeyPage, L2Error> {
        Err(L2Error::Unsupported("listing"))
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
