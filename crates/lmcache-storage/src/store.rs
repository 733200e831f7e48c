//! The write-behind store controller: L1 commits → every adapter.
//!
//! [`L2Tier::submit_store`] never blocks: keys go into a bounded queue and are dropped
//! (counted) when it is full. The controller drains the queue in batches; per adapter it
//! asks which keys are already stored (skipped), read-locks the rest in L1 just long enough
//! to encode and write them (with no codec the write reads L1 memory directly, with no copy),
//! and retries transient failures with exponential backoff.
//!
//! Each write is admitted by the adapter's [`crate::ledger::Ledger`] first: if it would not
//! fit under the capacity or its cache_salt's quota, victims are evicted before it is written,
//! and what cannot fit is refused (counted). Crossing the watermark wakes the eviction task.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use lmcache_core::ObjectKey;
use lmcache_l1::ReadLease;
use lmcache_l2::{Blob, L2Error, Stored};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::ledger::Refusal;
use crate::tier::{AdapterSlot, L2Tier, Shared, StorePolicy};

/// L1 bytes lent to a blob: the read lock is released when the last copy of the `Bytes` goes.
struct LeaseBytes(ReadLease);

impl AsRef<[u8]> for LeaseBytes {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

impl L2Tier {
    /// Queues newly committed L1 keys for writing behind. Never blocks.
    pub(crate) fn queue_store(&self, keys: impl IntoIterator<Item = ObjectKey>) {
        if self.is_empty() {
            return;
        }
        let st = &self.shared.stats;
        for k in keys {
            match self.store_tx.try_send(k) {
                Ok(()) => {
                    st.store_enqueued.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    // Never to be written: counted, and an ordinary L1 object again.
                    st.store_dropped.fetch_add(1, Ordering::Relaxed);
                    self.shared.l1.mark_written(&[e.into_inner()]);
                }
            }
        }
    }
}

impl L2Tier {
    /// Queues `keys` for writing behind without dropping any: a task feeds them to the
    /// controller as the queue drains. For what a restarted L1 adopted: the previous process
    /// may have been stopped before its write-behind reached them, and the controller skips
    /// whatever an adapter already holds. They stay ordinary eviction candidates meanwhile
    /// (an object evicted before its turn is skipped, counted as vanished).
    pub(crate) fn replay_store(&self, keys: Vec<ObjectKey>) {
        if self.is_empty() || keys.is_empty() {
            return;
        }
        let (tx, stats) = (self.store_tx.clone(), Arc::clone(&self.shared));
        self.rt.spawn(async move {
            for k in keys {
                if tx.send(k).await.is_err() {
                    return; // the tier stopped
                }
                stats.stats.store_enqueued.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
}

pub(crate) async fn run(shared: Arc<Shared>, mut rx: mpsc::Receiver<ObjectKey>) {
    let batch = shared.config.store_batch.max(1);
    let mut buf = Vec::with_capacity(batch);
    loop {
        buf.clear();
        if rx.recv_many(&mut buf, batch).await == 0 {
            return;
        }
        let Ok(permit) = shared.store_slots.clone().acquire_owned().await else { return };
        let keys = std::mem::take(&mut buf);
        let sh = shared.clone();
        let span = tracing::info_span!("l2_store_batch", keys = keys.len());
        tokio::spawn(
            async move {
                store_batch(&sh, keys).await;
                drop(permit);
            }
            .instrument(span),
        );
    }
}

async fn store_batch(shared: &Shared, keys: Vec<ObjectKey>) {
    let adapters = shared.slots();
    let mut all_ok = vec![true; keys.len()];
    for slot in &adapters {
        if !slot.usable(shared.epoch) {
            all_ok.iter_mut().for_each(|o| *o = false);
            continue;
        }
        let ok = store_to(shared, slot, &keys).await;
        for (a, o) in all_ok.iter_mut().zip(ok) {
            *a &= o;
        }
    }
    if shared.config.store_policy == StorePolicy::SkipL1 && !adapters.is_empty() {
        let done: Vec<ObjectKey> =
            keys.iter().zip(&all_ok).filter(|(_, ok)| **ok).map(|(k, _)| k.clone()).collect();
        let n = shared.l1.delete(&done, false).iter().filter(|r| r.is_ok()).count();
        shared.stats.l1_deleted_after_store.fetch_add(n as u64, Ordering::Relaxed);
    }
    // Written, or given up on (failures, refusals and down adapters are counted): L1 may
    // evict these like any other object now. Then wake stores waiting for room, and flushes.
    shared.l1.mark_written(&keys);
    *shared.processed.lock() += keys.len() as u64;
    shared.progress.notify_all();
    shared.progress_wake.notify_waiters();
}

/// Writes `keys` to one adapter; returns per key whether the adapter holds it afterwards.
async fn store_to(shared: &Shared, slot: &AdapterSlot, keys: &[ObjectKey]) -> Vec<bool> {
    let stats = &slot.stats;
    let adapter = &slot.built.adapter;
    let mut held = vec![false; keys.len()];
    let mut report = crate::tier::StoreReport {
        adapter: slot.id,
        kind: slot.built.kind.clone(),
        written: 0,
        skipped: 0,
        failed: 0,
        bytes: 0,
        keys: Vec::new(),
    };
    // 1. Skip what the adapter already has.
    let present = match adapter.lookup(keys).await {
        Ok(p) => {
            slot.ok();
            p
        }
        Err(e) => {
            slot.failed(shared.epoch, &e);
            vec![false; keys.len()]
        }
    };
    let mut todo: Vec<usize> = Vec::new();
    for (i, p) in present.iter().enumerate() {
        if *p {
            held[i] = true;
            report.skipped += 1;
            stats.skipped_keys.fetch_add(1, Ordering::Relaxed);
        } else {
            todo.push(i);
        }
    }
    // 2. Encode from L1 under a read lock each.
    let leases = shared.l1.read_lock(&todo.iter().map(|&i| keys[i].clone()).collect::<Vec<_>>(), 1);
    let mut encoded: Vec<(usize, ObjectKey, Blob)> = Vec::new();
    for (&i, lease) in todo.iter().zip(leases) {
        let Ok(lease) = lease else {
            shared.stats.store_vanished.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let raw = Bytes::from_owner(LeaseBytes(lease));
        match slot.built.codec.encode(&keys[i], raw) {
            Ok(blob) => encoded.push((i, keys[i].clone(), blob)),
            Err(e) => {
                tracing::warn!(key = %keys[i], error = %e, "L2 encode failed; key not stored");
                report.failed += 1;
                stats.store_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    // 3. Admit each write against capacity and quota, evicting first where needed.
    let mut items = Vec::with_capacity(encoded.len());
    let mut victims = Vec::new();
    for (i, k, b) in encoded {
        match slot.ledger.admit(&k.cache_salt, b.len() as u64, shared.quota(&k.cache_salt)) {
            Ok((adm, v)) => {
                victims.extend(v);
                items.push((i, k, b, adm));
            }
            Err(r) => {
                let c = match r {
                    Refusal::Quota => &stats.quota_rejections,
                    Refusal::Capacity => &stats.capacity_rejections,
                };
                c.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(key = %k, reason = ?r, "L2 write refused admission");
                report.failed += 1;
            }
        }
    }
    shared.delete_victims(slot, victims).await;
    // 4. Write, retrying transient failures.
    let mut delay = shared.config.retry_backoff;
    for attempt in 0..=shared.config.store_retries {
        if items.is_empty() {
            break;
        }
        let batch: Vec<(ObjectKey, Blob)> =
            items.iter().map(|(_, k, b, _)| (k.clone(), b.clone())).collect();
        let results = adapter.store(batch).await;
        let mut retry = Vec::new();
        let mut last_err: Option<L2Error> = None;
        for ((i, k, b, adm), r) in items.drain(..).zip(results) {
            match r {
                Ok(Stored::Written(n)) => {
                    held[i] = true;
                    report.written += 1;
                    report.bytes += n;
                    stats.stored_keys.fetch_add(1, Ordering::Relaxed);
                    stats.stored_bytes.fetch_add(n, Ordering::Relaxed);
                    adm.commit(&k, n);
                    report.keys.push((k, n));
                }
                Ok(Stored::AlreadyPresent) => {
                    held[i] = true;
                    report.keys.push((k.clone(), b.len() as u64));
                    report.skipped += 1;
                    stats.skipped_keys.fetch_add(1, Ordering::Relaxed);
                    adm.commit(&k, b.len() as u64);
                }
                Err(e) if e.is_transient() && attempt < shared.config.store_retries => {
                    retry.push((i, k, b, adm));
                    last_err = Some(e);
                }
                Err(e) => {
                    report.failed += 1;
                    stats.store_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(key = %k, error = %e, "L2 store failed");
                    last_err = Some(e);
                }
            }
        }
        // Health hears the batch once, by its final attempt: retries of one slow or failed
        // batch never add up to marking a healthy adapter down.
        if retry.is_empty() || attempt == shared.config.store_retries {
            match &last_err {
                Some(e) => slot.failed(shared.epoch, e),
                None => slot.ok(),
            }
        }
        items = retry;
        if !items.is_empty() {
            tokio::time::sleep(delay).await;
            delay *= 2;
        }
    }
    if slot.ledger.over_watermark() {
        shared.evict_now.notify_one();
    }
    shared.observe(|o| o.stored(&report));
    held
}
