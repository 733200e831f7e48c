//! The event gate: cache-event batches admitted in order per emitter (duplicates, stale
//! incarnations and gaps told apart) and applied to the directory.

use super::*;

impl Fleet {
    // ---- events ---------------------------------------------------------------------------

    /// `POST /events`: every batch is validated before any applies (a bad one refuses the
    /// request, as LMCache's 422 does); then each is admitted by its emitter's cursor and
    /// applied in order.
    pub fn ingest(&self, batches: &[CacheEventBatch]) -> Result<CacheEventsResponse, FleetError> {
        for (i, b) in batches.iter().enumerate() {
            b.validate().map_err(|m| FleetError::Invalid(format!("batches[{i}]: {m}")))?;
        }
        let mut out = CacheEventsResponse::default();
        let mut v = self.views.lock();
        for b in batches {
            match self.admit(&mut v, b)? {
                Admission::Applied => out.applied += 1,
                Admission::Duplicate => out.duplicates += 1,
                Admission::Stale => out.stale += 1,
            }
        }
        drop(v);
        self.metrics.batches("applied", out.applied);
        self.metrics.batches("duplicate", out.duplicates);
        self.metrics.batches("stale", out.stale);
        Ok(out)
    }

    fn admit(&self, v: &mut Views, b: &CacheEventBatch) -> Result<Admission, FleetError> {
        let now = Instant::now();
        match v.cursors.get_mut(&b.instance_id) {
            Some(c) if b.incarnation < c.incarnation => return Ok(Admission::Stale),
            Some(c) if b.incarnation == c.incarnation => {
                if b.seq <= c.last_seq {
                    return Ok(Admission::Duplicate);
                }
                if b.seq > c.last_seq + 1 {
                    let missing = b.seq - c.last_seq - 1;
                    if !c.gap {
                        tracing::warn!(instance = %b.instance_id, incarnation = b.incarnation, from = c.last_seq, to = b.seq,
                            "cache-event gap: {missing} batch(es) missing");
                    }
                    c.gap = true;
                    c.missing += missing;
                    self.metrics.missing_batches.inc_by(missing);
                    c.last_seq = b.seq;
                    c.last_admitted = now;
                    self.want_repair(v, &b.instance_id, b.incarnation);
                } else {
                    c.last_seq = b.seq;
                    c.last_admitted = now;
                }
            }
            existing => {
                if let Some(c) = existing {
                    tracing::info!(instance = %b.instance_id, old = c.incarnation, new = b.incarnation,
                        "instance restarted: fencing its L1 placements");
                    self.fence(v, &b.instance_id);
                }
                let gap = b.seq > 1;
                if gap {
                    self.metrics.missing_batches.inc_by(b.seq - 1);
                }
                v.cursors.insert(
                    b.instance_id.clone(),
                    Cursor {
                        incarnation: b.incarnation,
                        last_seq: b.seq,
                        missing: b.seq - 1,
                        gap,
                        last_admitted: now,
                        repairs: 0,
                        last_repair: None,
                    },
                );
                v.repairs.remove(&b.instance_id);
                if gap {
                    self.want_repair(v, &b.instance_id, b.incarnation);
                }
            }
        }
        self.apply(v, b)?;
        Ok(Admission::Applied)
    }

    fn apply(&self, v: &mut Views, b: &CacheEventBatch) -> Result<(), FleetError> {
        let Some(tier) = tier_of(b.tier) else { return Ok(()) };
        let reporter = v.dir.instance(&b.instance_id)?;
        let kind = match b.event_type {
            CacheEventType::Store => EventKind::Store,
            CacheEventType::Delete => EventKind::Delete,
            CacheEventType::Access => EventKind::Access,
            CacheEventType::Config => {
                if b.shared {
                    v.dir.site(reporter, tier, &b.backend, true)?;
                }
                declare(&mut v.declarations, b, tier);
                return Ok(());
            }
        };
        let site = match kind {
            EventKind::Access => None,
            _ => Some(v.dir.site(reporter, tier, &b.backend, b.shared)?),
        };
        let mut entries = Vec::with_capacity(b.entries.len());
        let mut last: Option<(&EncodedObjectKey, lmcache_directory::NsId)> = None;
        for e in &b.entries {
            let k = &e.key;
            let ns = match last {
                Some((p, id))
                    if p.model_name == k.model_name
                        && p.kv_rank == k.kv_rank
                        && p.object_group_id == k.object_group_id
                        && p.cache_salt == k.cache_salt =>
                {
                    id
                }
                _ => {
                    let ns = namespace(k);
                    let id = if kind == EventKind::Store {
                        v.dir.namespace(&ns)?
                    } else {
                        match v.dir.find_namespace(&ns) {
                            Some(id) => id,
                            None => continue,
                        }
                    };
                    last = Some((k, id));
                    id
                }
            };
            let hash = k.chunk_hash().map_err(FleetError::Invalid)?;
            entries.push(Entry {
                key: DirKey { hash, ns },
                size: e.size_bytes,
                tokens: &e.token_ids,
                token_offset: e.token_offset,
            });
        }
        if kind != EventKind::Access {
            if let Some(r) = v.repairs.get_mut(&b.instance_id) {
                match (tier, site) {
                    (Tier::L1, _) => r.touched.extend(entries.iter().map(|e| e.key)),
                    (Tier::L2, Some(site)) => {
                        r.touched_l2.extend(entries.iter().map(|e| (e.key, site)))
                    }
                    (Tier::L2, None) => {}
                }
            }
        }
        match site {
            Some(site) => v.dir.apply(reporter, b.incarnation, kind, site, b.ts, &entries)?,
            None => v.dir.access(b.ts, entries.iter().map(|e| e.key)),
        }
        self.publish_vllm(b, tier, kind);
        self.metrics.entries.inc_by(entries.len() as u64);
        Ok(())
    }

    /// The emitters' streams.
    pub(crate) fn streams(&self) -> Vec<StreamStats> {
        let now = Instant::now();
        let v = self.views.lock();
        let mut out: Vec<StreamStats> = v
            .cursors
            .iter()
            .map(|(id, c)| StreamStats {
                instance_id: id.clone(),
                incarnation: c.incarnation,
                last_seq: c.last_seq,
                gap_detected: c.gap,
                repairing: v.repairs.contains_key(id),
                repairs: c.repairs,
                last_repair_seconds: c.last_repair.map(|d| d.as_secs_f64()),
                missing_batches: c.missing,
                seconds_since_last_batch: now
                    .saturating_duration_since(c.last_admitted)
                    .as_secs_f64(),
            })
            .collect();
        out.sort_by(|a, b| a.instance_id.cmp(&b.instance_id));
        out
    }
}
