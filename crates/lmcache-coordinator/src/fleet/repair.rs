//! Stream repair: a gap in an emitter's stream starts a resync from its snapshot, paged and
//! finished here (the pages are fetched by the service's repair thread).

use super::*;

/// A snapshot entry's key, checked as LMCache checks keys, its namespace interned.
fn listed_key(v: &mut Views, k: &EncodedObjectKey) -> Result<DirKey, FleetError> {
    k.validate().map_err(FleetError::Invalid)?;
    let ns = v.dir.namespace(&namespace(k.namespace()))?;
    Ok(DirKey { hash: k.chunk_hash().map_err(FleetError::Invalid)?, ns })
}

impl Fleet {
    // ---- repair ---------------------------------------------------------------------------

    /// Installs the channel gaps are reported on (the service's repair thread reads it).
    pub(crate) fn set_repairer(&self, tx: std::sync::mpsc::Sender<String>) {
        *self.repair_tx.lock() = Some(tx);
    }

    /// Drops the repair channel's sender: the repair thread sees it closed and ends.
    pub(crate) fn close_repairer(&self) {
        self.repair_tx.lock().take();
    }

    /// A gap in `id`'s stream at `incarnation`: starts a resync (or asks the running one to
    /// run again).
    pub(super) fn want_repair(&self, v: &mut Views, id: &str, incarnation: u64) {
        match v.repairs.get_mut(id) {
            Some(r) if r.incarnation == incarnation => r.again = true,
            _ => {
                let Some(tx) = self.repair_tx.lock().clone() else { return };
                v.repairs.insert(
                    id.to_string(),
                    Repair {
                        incarnation,
                        touched: Default::default(),
                        listed: Default::default(),
                        touched_l2: Default::default(),
                        listed_l2: Default::default(),
                        started: Instant::now(),
                        again: false,
                    },
                );
                let _ = tx.send(id.to_string());
            }
        }
    }

    /// The incarnation of `id`'s pending repair.
    pub(crate) fn repair_incarnation(&self, id: &str) -> Option<u64> {
        self.views.lock().repairs.get(id).map(|r| r.incarnation)
    }

    /// Where to fetch `id`'s snapshot, if it is registered and a repair is pending.
    pub(crate) fn repair_target(&self, id: &str) -> Option<RepairTarget> {
        let incarnation = self.views.lock().repairs.get(id)?.incarnation;
        Some(RepairTarget { endpoint: self.endpoint(id)?, incarnation })
    }

    /// Applies one snapshot page: each listed key not named by a newer event becomes an L1
    /// placement at `backend`. False when the repair is gone (superseded).
    pub(crate) fn resync_page(
        &self,
        id: &str,
        incarnation: u64,
        backend: &str,
        entries: &[(EncodedObjectKey, u64)],
    ) -> Result<bool, FleetError> {
        let mut guard = self.views.lock();
        let v = &mut *guard;
        if v.repairs.get(id).is_none_or(|r| r.incarnation != incarnation) {
            return Ok(false);
        }
        let inst = v.dir.instance(id)?;
        let site = v.dir.site(inst, Tier::L1, backend, false)?;
        let mut keys = Vec::with_capacity(entries.len());
        for (k, size) in entries {
            keys.push((listed_key(v, k)?, *size));
        }
        let Some(r) = v.repairs.get_mut(id) else { return Ok(false) };
        let mut fresh = Vec::with_capacity(keys.len());
        for (dk, size) in keys {
            r.listed.insert(dk);
            if !r.touched.contains(&dk) {
                fresh.push(Entry { key: dk, size, tokens: &[], token_offset: -1 });
            }
        }
        v.dir.apply(inst, incarnation, EventKind::Store, site, wall_clock(), &fresh)?;
        Ok(true)
    }

    /// Applies one page of an L2 snapshot: each listed (key, backend) not named by a newer
    /// event becomes an L2 placement at that backend (a private site of the instance, or the
    /// shared pool). False when the repair is gone (superseded).
    pub(crate) fn resync_l2_page(
        &self,
        id: &str,
        incarnation: u64,
        entries: &[(EncodedObjectKey, u64, String, bool)],
    ) -> Result<bool, FleetError> {
        let mut guard = self.views.lock();
        let v = &mut *guard;
        if v.repairs.get(id).is_none_or(|r| r.incarnation != incarnation) {
            return Ok(false);
        }
        let inst = v.dir.instance(id)?;
        let mut by_site: Vec<(lmcache_directory::SiteId, Vec<(DirKey, u64)>)> = Vec::new();
        for (k, size, backend, shared) in entries {
            let dk = listed_key(v, k)?;
            let site = v.dir.site(inst, Tier::L2, backend, *shared)?;
            match by_site.iter_mut().find(|(s, _)| *s == site) {
                Some((_, keys)) => keys.push((dk, *size)),
                None => by_site.push((site, vec![(dk, *size)])),
            }
        }
        for (site, keys) in by_site {
            let Some(r) = v.repairs.get_mut(id) else { return Ok(false) };
            let mut fresh = Vec::with_capacity(keys.len());
            for (dk, size) in keys {
                r.listed_l2.insert((dk, site));
                if !r.touched_l2.contains(&(dk, site)) {
                    fresh.push(Entry { key: dk, size, tokens: &[], token_offset: -1 });
                }
            }
            v.dir.apply(inst, incarnation, EventKind::Store, site, wall_clock(), &fresh)?;
        }
        Ok(true)
    }

    /// Ends a repair: with the snapshot complete, L1 placements it did not list (and no
    /// newer event named) go; with `l2_listed` (the server listed its whole L2 too), so do
    /// the instance's private L2 placements the L2 snapshot did not list. With `failed`, all
    /// of the instance's L1 placements go instead (L2 ones stay: their events are then the
    /// only source).
    pub(crate) fn resync_finish(&self, id: &str, incarnation: u64, failed: bool) -> RepairOutcome {
        self.resync_finish_with(id, incarnation, failed, false)
    }

    /// [`Fleet::resync_finish`], saying whether the L2 snapshot was complete.
    pub(crate) fn resync_finish_with(
        &self,
        id: &str,
        incarnation: u64,
        failed: bool,
        l2_listed: bool,
    ) -> RepairOutcome {
        let mut guard = self.views.lock();
        let v = &mut *guard;
        let Some(r) = v.repairs.remove(id) else { return RepairOutcome::Superseded };
        if r.incarnation != incarnation
            || v.cursors.get(id).is_none_or(|c| c.incarnation != incarnation)
        {
            return RepairOutcome::Superseded;
        }
        let removed = match v.dir.find_instance(id) {
            Some(inst) if failed => v.dir.fence_l1(inst),
            Some(inst) => v.dir.sweep_l1(inst, |k| r.listed.contains(k) || r.touched.contains(k)),
            None => 0,
        };
        let removed_l2 = match v.dir.find_instance(id) {
            Some(inst) if l2_listed && !failed => v.dir.sweep_owned(inst, Tier::L2, |k, site| {
                r.listed_l2.contains(&(*k, site)) || r.touched_l2.contains(&(*k, site))
            }),
            _ => 0,
        };
        let took = r.started.elapsed();
        if let Some(c) = v.cursors.get_mut(id) {
            c.gap = false;
            c.repairs += 1;
            c.last_repair = Some(took);
        }
        let outcome = if failed { RepairOutcome::Fenced } else { RepairOutcome::Repaired };
        tracing::info!(instance = %id, ?outcome, listed = r.listed.len(), removed,
            l2_listed = r.listed_l2.len(), removed_l2, took_ms = took.as_millis() as u64,
            "placements resynced");
        self.metrics.repaired(if failed { "fenced" } else { "repaired" }, took);
        if failed {
            self.metrics.fenced_placements.inc_by(removed);
            self.publish_vllm_cleared(id);
        }
        if r.again {
            self.want_repair(v, id, incarnation);
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lmcache_protocol::coordinator::{CacheEventEntry, CacheEventType};

    fn key(b: u8) -> EncodedObjectKey {
        EncodedObjectKey {
            chunk_hash_hex: format!("{b:02x}").repeat(32),
            model_name: "m".into(),
            kv_rank: 0x0100_0100,
            object_group_id: 0,
            cache_salt: String::new(),
        }
    }

    fn batch(
        seq: u64,
        tier: WireTier,
        backend: &str,
        shared: bool,
        keys: &[u8],
    ) -> CacheEventBatch {
        CacheEventBatch {
            instance_id: "s".into(),
            incarnation: 1,
            seq,
            event_type: CacheEventType::Store,
            tier,
            backend: backend.into(),
            entries: keys
                .iter()
                .map(|&b| CacheEventEntry {
                    key: key(b),
                    size_bytes: 8,
                    token_ids: Vec::new(),
                    token_offset: -1,
                })
                .collect(),
            shared,
            ts: 1.0,
            capacity_bytes: 0,
            capacity_revision: 0,
        }
    }

    fn l2_at(f: &Fleet, backend: &str) -> Vec<u8> {
        let filter =
            KeyFilter { tier: Some(Tier::L2), instance: None, backend: Some(backend.into()) };
        let mut out: Vec<u8> =
            f.list(&filter, 0, 100).1.iter().map(|k| k.key.chunk_hash().unwrap()[0]).collect();
        out.sort_unstable();
        out
    }

    #[test]
    fn an_l2_snapshot_upserts_what_it_lists_and_sweeps_the_private_rest() {
        let f = Fleet::new(CoordinatorConfig::default()).unwrap();
        let (tx, _rx) = std::sync::mpsc::channel();
        f.set_repairer(tx);
        f.ingest(&[
            batch(1, WireTier::L2, "fs", false, &[1, 2]),
            batch(2, WireTier::L2, "pool", true, &[3]),
        ])
        .unwrap();
        // Batch 3 is lost: a gap starts a repair; an L2 event during it names key 4.
        f.ingest(&[batch(4, WireTier::L1, "dram", false, &[9])]).unwrap();
        assert_eq!(f.repair_incarnation("s"), Some(1));
        f.ingest(&[batch(5, WireTier::L2, "fs", false, &[4])]).unwrap();
        // The snapshots: L1 holds 9; L2 "fs" holds 1 and 5 (2 went in the lost batch's time;
        // 4 was written after the listing was taken).
        assert!(f.resync_page("s", 1, "dram", &[(key(9), 8)]).unwrap());
        let l2 = [(key(1), 8, "fs".to_string(), false), (key(5), 8, "fs".to_string(), false)];
        assert!(f.resync_l2_page("s", 1, &l2).unwrap());
        assert_eq!(f.resync_finish_with("s", 1, false, true), RepairOutcome::Repaired);
        assert_eq!(l2_at(&f, "fs"), vec![1, 4, 5], "listed or newer stays, the rest goes");
        assert_eq!(l2_at(&f, "pool"), vec![3], "a shared pool is not swept");
    }

    #[test]
    fn without_a_whole_l2_listing_nothing_in_l2_is_swept() {
        let f = Fleet::new(CoordinatorConfig::default()).unwrap();
        let (tx, _rx) = std::sync::mpsc::channel();
        f.set_repairer(tx);
        f.ingest(&[batch(1, WireTier::L2, "fs", false, &[1, 2])]).unwrap();
        f.ingest(&[batch(3, WireTier::L1, "dram", false, &[9])]).unwrap();
        assert!(f.resync_page("s", 1, "dram", &[(key(9), 8)]).unwrap());
        let l2 = [(key(1), 8, "fs".to_string(), false)];
        assert!(f.resync_l2_page("s", 1, &l2).unwrap());
        assert_eq!(f.resync_finish_with("s", 1, false, false), RepairOutcome::Repaired);
        assert_eq!(l2_at(&f, "fs"), vec![1, 2]);
    }
}
