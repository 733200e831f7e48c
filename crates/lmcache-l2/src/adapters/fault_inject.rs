//! `fault_inject`: wraps any adapter and fails, delays, corrupts or drops chosen operations.
//!
//! A key is chosen when the xxh3 hash of `seed` and its wire key falls under `rate`, so the
//! same keys are chosen on every run. `set_down` turns the whole backend off and on, for
//! outage and recovery tests.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use lmcache_core::ObjectKey;

use crate::adapter::{KeyFilter, KeyPage, L2Adapter, Stored};
use crate::blob::Blob;
use crate::error::L2Error;
use crate::wire_key;

/// Which operations are faulted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    /// store
    Store,
    /// lookup
    Lookup,
    /// load
    Load,
    /// delete (mode `fail`: the whole call fails when it names a chosen key)
    Delete,
}

/// What a fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultMode {
    /// The operation fails for the chosen key.
    Fail,
    /// The operation succeeds but loaded bytes have one bit flipped (load only).
    Corrupt,
    /// Loaded bytes are cut short, as after a torn write (load only).
    Truncate,
    /// The operation is delayed, then succeeds.
    Delay(Duration),
    /// A lookup or load reports a miss.
    Miss,
}

/// Settings of the fault injector.
#[derive(Debug, Clone)]
pub struct FaultConfig {
    /// Fraction of keys chosen (0..=1).
    pub rate: f64,
    /// Seed of the key choice.
    pub seed: u64,
    /// Operations faulted.
    pub ops: Vec<FaultOp>,
    /// The fault.
    pub mode: FaultMode,
}

/// True when a fault injector with `seed` and `rate` chooses `key` (for the operations it
/// faults): what tests use to know which keys to expect faulted.
pub fn chosen_by(seed: u64, rate: f64, key: &ObjectKey) -> bool {
    if rate <= 0.0 {
        return false;
    }
    let mut s = seed.to_le_bytes().to_vec();
    s.extend_from_slice(wire_key::encode(key).as_bytes());
    let h = crate::blob::xxh3_64(&s);
    (h as f64 / u64::MAX as f64) < rate
}

/// The fault-injecting wrapper.
#[derive(Debug)]
pub struct FaultInjectAdapter {
    inner: Arc<dyn L2Adapter>,
    config: FaultConfig,
    down: AtomicBool,
}

impl FaultInjectAdapter {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn L2Adapter>, config: FaultConfig) -> Self {
        Self { inner, config, down: AtomicBool::new(false) }
    }

    /// Takes the backend down (every operation fails as unavailable) or brings it back.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::Relaxed);
    }

    fn chosen(&self, op: FaultOp, key: &ObjectKey) -> bool {
        self.config.ops.contains(&op) && chosen_by(self.config.seed, self.config.rate, key)
    }

    fn check_up(&self) -> Result<(), L2Error> {
        if self.down.load(Ordering::Relaxed) {
            Err(L2Error::unavailable("fault_inject: backend is down"))
        } else {
            Ok(())
        }
    }

    async fn maybe_delay(&self, op: FaultOp, keys: &[ObjectKey]) {
        if let FaultMode::Delay(d) = self.config.mode
            && keys.iter().any(|k| self.chosen(op, k))
        {
            tokio::time::sleep(d).await;
        }
    }
}

#[async_trait]
impl L2Adapter for FaultInjectAdapter {
    fn kind(&self) -> &'static str {
        "fault_inject"
    }

    async fn store(&self, items: Vec<(ObjectKey, Blob)>) -> Vec<Result<Stored, L2Error>> {
        if let Err(e) = self.check_up() {
            let msg = e.to_string();
            return items.iter().map(|_| Err(L2Error::unavailable(msg.clone()))).collect();
        }
        let keys: Vec<ObjectKey> = items.iter().map(|(k, _)| k.clone()).collect();
        self.maybe_delay(FaultOp::Store, &keys).await;
        let fail: Vec<bool> = keys
            .iter()
            .map(|k| self.config.mode == FaultMode::Fail && self.chosen(FaultOp::Store, k))
            .collect();
        let pass: Vec<(ObjectKey, Blob)> =
            items.into_iter().zip(&fail).filter(|(_, f)| !**f).map(|(i, _)| i).collect();
        let mut inner = self.inner.store(pass).await.into_iter();
        fail.iter()
            .map(|&f| {
                if f {
                    Err(L2Error::transient("fault_inject: store failed"))
                } else {
                    inner.next().unwrap_or_else(|| Err(L2Error::transient("missing result")))
                }
            })
            .collect()
    }

    async fn lookup(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, L2Error> {
        self.check_up()?;
        self.maybe_delay(FaultOp::Lookup, keys).await;
        let mut found = self.inner.lookup(keys).await?;
        for (k, f) in keys.iter().zip(found.iter_mut()) {
            if self.chosen(FaultOp::Lookup, k) {
                match self.config.mode {
                    FaultMode::Miss => *f = false,
                    FaultMode::Fail => {
                        return Err(L2Error::transient("fault_inject: lookup failed"));
                    }
                    _ => {}
                }
            }
        }
        Ok(found)
    }

    async fn load(&self, keys: &[ObjectKey]) -> Vec<Result<Option<Bytes>, L2Error>> {
        if let Err(e) = self.check_up() {
            let msg = e.to_string();
            return keys.iter().map(|_| Err(L2Error::unavailable(msg.clone()))).collect();
        }
        self.maybe_delay(FaultOp::Load, keys).await;
        let results = self.inner.load(keys).await;
        keys.iter()
            .zip(results)
            .map(|(k, r)| {
                if !self.chosen(FaultOp::Load, k) {
                    return r;
                }
                match (self.config.mode, r) {
                    (FaultMode::Fail, _) => Err(L2Error::transient("fault_inject: load failed")),
                    (FaultMode::Miss, _) => Ok(None),
                    (FaultMode::Corrupt, Ok(Some(b))) if !b.is_empty() => {
                        let mut m = BytesMut::from(&b[..]);
                        let i = m.len() / 2;
                        m[i] ^= 0x10;
                        Ok(Some(m.freeze()))
                    }
                    (FaultMode::Truncate, Ok(Some(b))) => Ok(Some(b.slice(..b.len() / 2))),
                    (_, r) => r,
                }
            })
            .collect()
    }

    async fn delete(&self, keys: &[ObjectKey]) -> Result<u64, L2Error> {
        self.check_up()?;
        if self.config.mode == FaultMode::Fail
            && keys.iter().any(|k| self.chosen(FaultOp::Delete, k))
        {
            return Err(L2Error::transient("fault_inject: delete failed"));
        }
        self.inner.delete(keys).await
    }

    async fn lookup_sized(&self, keys: &[ObjectKey]) -> Result<Vec<Option<u64>>, L2Error> {
        // Only through `lookup`, so that lookup faults apply; sizes come from the inner store.
        let found = self.lookup(keys).await?;
        match self.inner.lookup_sized(keys).await {
            Ok(sizes) => Ok(sizes.into_iter().zip(found).map(|(s, f)| s.filter(|_| f)).collect()),
            Err(e) => Err(e),
        }
    }

    async fn list(
        &self,
        filter: &KeyFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<KeyPage, L2Error> {
        self.check_up()?;
        self.inner.list(filter, cursor, limit).await
    }

    async fn ping(&self) -> Result<(), L2Error> {
        self.check_up()?;
        self.inner.ping().await
    }

    async fn scan(&self, limit: usize) -> Result<Vec<(ObjectKey, u64)>, L2Error> {
        self.check_up()?;
        self.inner.scan(limit).await
    }

    fn capacity(&self) -> Option<u64> {
        self.inner.capacity()
    }

    fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "fault_inject",
            "rate": self.config.rate,
            "seed": self.config.seed,
            "mode": format!("{:?}", self.config.mode),
            "inner": self.inner.describe(),
        })
    }

    async fn close(&self) {
        self.inner.close().await;
    }
}
