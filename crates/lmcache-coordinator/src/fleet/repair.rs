//! Stream repair: a gap in an emitter's stream starts a resync from its snapshot, paged and
//! finished here (the pages are fetched by the service's repair thread).

use super::*;

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
            k.validate().map_err(FleetError::Invalid)?;
            let ns = v.dir.namespace(&namespace(k))?;
            keys.push((DirKey { hash: k.chunk_hash().map_err(FleetError::Invalid)?, ns }, *size));
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

    /// Ends a repair: with the snapshot complete, L1 placements it did not list (and no
    /// newer event named) go. With `failed`, all of the instance's L1 placements go instead.
    pub(crate) fn resync_finish(&self, id: &str, incarnation: u64, failed: bool) -> RepairOutcome {
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
        let took = r.started.elapsed();
        if let Some(c) = v.cursors.get_mut(id) {
            c.gap = false;
            c.repairs += 1;
            c.last_repair = Some(took);
        }
        let outcome = if failed { RepairOutcome::Fenced } else { RepairOutcome::Repaired };
        tracing::info!(instance = %id, ?outcome, listed = r.listed.len(), removed,
            took_ms = took.as_millis() as u64, "L1 placements resynced");
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
