//! `mock`: an in-memory adapter with simulated bandwidth and latency, for tests and benches.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use lmcache_core::ObjectKey;
use parking_lot::Mutex;

use crate::adapter::{KeyFilter, KeyPage, L2Adapter, Stored};
use crate::blob::Blob;
use crate::error::L2Error;

/// Settings of the mock adapter.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// Capacity in bytes; stores beyond it fail with [`L2Error::Full`].
    pub capacity: u64,
    /// Simulated bandwidth in bytes per second (0 = unlimited).
    pub bandwidth: f64,
    /// Simulated latency per batch.
    pub latency: Duration,
}

/// In-memory L2.
#[derive(Debug)]
pub struct MockAdapter {
    config: MockConfig,
    objects: Mutex<(HashMap<ObjectKey, Bytes>, u64)>,
}

impl MockAdapter {
    /// An empty mock.
    pub fn new(config: MockConfig) -> Self {
        Self { config, objects: Mutex::new((HashMap::new(), 0)) }
    }

    async fn delay(&self, bytes: u64) {
        let mut d = self.config.latency;
        if self.config.bandwidth > 0.0 {
            d += Duration::from_secs_f64(bytes as f64 / self.config.bandwidth);
        }
        if !d.is_zero() {
            tokio::time::sleep(d).await;
        }
    }
}

#[async_trait]
impl L2Adapter for MockAdapter {
    fn kind(&self) -> &'static str {
        "mock"
    }

    async fn store(&self, items: Vec<(ObjectKey, Blob)>) -> Vec<Result<Stored, L2Error>> {
        let bytes: u64 = items.iter().map(|(_, b)| b.len() as u64).sum();
        self.delay(bytes).await;
        let mut g = self.objects.lock();
        items
            .into_iter()
            .map(|(k, b)| {
                if g.0.contains_key(&k) {
                    return Ok(Stored::AlreadyPresent);
                }
                let n = b.len() as u64;
                if g.1 + n > self.config.capacity {
                    return Err(L2Error::Full {
                        what: "mock capacity",
                        needed: g.1 + n,
                        limit: self.config.capacity,
                    });
                }
                g.1 += n;
                g.0.insert(k, b.to_contiguous());
                Ok(Stored::Written(n))
            })
            .collect()
    }

    async fn lookup(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, L2Error> {
        self.delay(0).await;
        let g = self.objects.lock();
        Ok(keys.iter().map(|k| g.0.contains_key(k)).collect())
    }

    async fn lookup_sized(&self, keys: &[ObjectKey]) -> Result<Vec<Option<u64>>, L2Error> {
        self.delay(0).await;
        let g = self.objects.lock();
        Ok(keys.iter().map(|k| g.0.get(k).map(|b| b.len() as u64)).collect())
    }

    async fn load(&self, keys: &[ObjectKey]) -> Vec<Result<Option<Bytes>, L2Error>> {
        let found: Vec<Option<Bytes>> = {
            let g = self.objects.lock();
            keys.iter().map(|k| g.0.get(k).cloned()).collect()
        };
        self.delay(found.iter().flatten().map(|b| b.len() as u64).sum()).await;
        found.into_iter().map(Ok).collect()
    }

    async fn delete(&self, keys: &[ObjectKey]) -> Result<u64, L2Error> {
        let mut g = self.objects.lock();
        let mut n = 0;
        for k in keys {
            if let Some(b) = g.0.remove(k) {
                g.1 -= b.len() as u64;
                n += 1;
            }
        }
        Ok(n)
    }

    async fn list(
        &self,
        filter: &KeyFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<KeyPage, L2Error> {
        let g = self.objects.lock();
        let keys = g.0.iter().map(|(k, b)| (k, b.len() as u64));
        Ok(crate::adapter::page_keys(keys, filter, cursor, limit))
    }

    fn capacity(&self) -> Option<u64> {
        Some(self.config.capacity)
    }

    fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "mock",
            "max_size_bytes": self.config.capacity,
            "bandwidth_bytes_per_s": self.config.bandwidth,
            "latency_ms": self.config.latency.as_secs_f64() * 1e3,
        })
    }
}
