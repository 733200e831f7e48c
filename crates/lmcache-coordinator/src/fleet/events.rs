//! The event gate: cache-event batches admitted in order per emitter (duplicates, stale
//! incarnations and gaps told apart) and applied to the directory.

use lmcache_protocol::coordinator_binary::{self, BinaryBatch};
use lmcache_protocol::coordinator_borrowed::CacheEventBatchRef;

use super::*;

/// One entry as the gate applies it, whichever form its batch came in.
pub(crate) struct EntryView<'a> {
    pub(super) ns: KeyNamespace<'a>,
    pub(super) hash: Result<[u8; 32], String>,
    pub(super) size_bytes: u64,
    pub(super) token_ids: &'a [u32],
    pub(super) token_offset: i64,
}

/// A cache-event batch as the gate reads it: LMCache's JSON form ([`CacheEventBatch`]) or the
/// binary JetStream form ([`BinaryBatch`]), which carries raw chunk hashes and a namespace
/// table, so applying it parses no hex and allocates no string per entry.
pub(crate) trait IncomingBatch {
    fn instance_id(&self) -> &str;
    fn incarnation(&self) -> u64;
    fn seq(&self) -> u64;
    fn event_type(&self) -> CacheEventType;
    fn tier(&self) -> WireTier;
    fn backend(&self) -> &str;
    fn shared(&self) -> bool;
    fn ts(&self) -> f64;
    fn validate(&self) -> Result<(), String>;
    fn entry_count(&self) -> usize;
    fn entries(&self) -> impl Iterator<Item = EntryView<'_>>;
    /// Config only: the compartment's capacity and the declaration's revision.
    fn capacity(&self) -> (u64, u64);
}

impl IncomingBatch for BinaryBatch<'_> {
    fn instance_id(&self) -> &str {
        self.instance_id
    }
    fn incarnation(&self) -> u64 {
        self.incarnation
    }
    fn seq(&self) -> u64 {
        self.seq
    }
    fn event_type(&self) -> CacheEventType {
        self.event_type
    }
    fn tier(&self) -> WireTier {
        self.tier
    }
    fn backend(&self) -> &str {
        self.backend
    }
    fn shared(&self) -> bool {
        self.shared
    }
    fn ts(&self) -> f64 {
        self.ts
    }
    fn validate(&self) -> Result<(), String> {
        BinaryBatch::validate(self)
    }
    fn entry_count(&self) -> usize {
        self.entries.len()
    }
    fn entries(&self) -> impl Iterator<Item = EntryView<'_>> {
        self.entries.iter().map(|e| EntryView {
            ns: self.namespace(e),
            hash: Ok(e.hash),
            size_bytes: e.size_bytes,
            token_ids: self.tokens_of(e),
            token_offset: e.token_offset,
        })
    }
    fn capacity(&self) -> (u64, u64) {
        (self.capacity_bytes, self.capacity_revision)
    }
}

impl IncomingBatch for CacheEventBatchRef<'_> {
    fn instance_id(&self) -> &str {
        &self.instance_id
    }
    fn incarnation(&self) -> u64 {
        self.incarnation
    }
    fn seq(&self) -> u64 {
        self.seq
    }
    fn event_type(&self) -> CacheEventType {
        self.event_type
    }
    fn tier(&self) -> WireTier {
        self.tier
    }
    fn backend(&self) -> &str {
        &self.backend
    }
    fn shared(&self) -> bool {
        self.shared
    }
    fn ts(&self) -> f64 {
        self.ts
    }
    fn validate(&self) -> Result<(), String> {
        CacheEventBatchRef::validate(self)
    }
    fn entry_count(&self) -> usize {
        self.entries.len()
    }
    fn entries(&self) -> impl Iterator<Item = EntryView<'_>> {
        self.entries.iter().map(|e| EntryView {
            ns: e.key.namespace(),
            hash: e.key.chunk_hash.0.clone(),
            size_bytes: e.size_bytes,
            token_ids: &e.token_ids,
            token_offset: e.token_offset,
        })
    }
    fn capacity(&self) -> (u64, u64) {
        (self.capacity_bytes, self.capacity_revision)
    }
}

impl Fleet {
    // ---- events ---------------------------------------------------------------------------

    /// `POST /events`: every batch is validated before any applies (a bad one refuses the
    /// request, as LMCache's 422 does); then each is admitted by its emitter's cursor and
    /// applied in order.
    pub fn ingest(&self, batches: &[CacheEventBatch]) -> Result<CacheEventsResponse, FleetError> {
        let views: Vec<_> = batches.iter().map(CacheEventBatchRef::of).collect();
        self.ingest_any(&views)
    }

    /// Batches decoded in place from a `POST /events` body or a JSON JetStream message
    /// ([`lmcache_protocol::coordinator_borrowed`]): admitted and applied as [`Fleet::ingest`]
    /// does, without a string copied or a hash decoded twice per entry.
    pub fn ingest_borrowed(
        &self,
        batches: &[CacheEventBatchRef<'_>],
    ) -> Result<CacheEventsResponse, FleetError> {
        self.ingest_any(batches)
    }

    /// A binary JetStream message ([`coordinator_binary`]): decoded without copying its
    /// strings, then admitted and applied exactly as [`Fleet::ingest`] does JSON batches.
    pub fn ingest_binary(&self, message: &[u8]) -> Result<CacheEventsResponse, FleetError> {
        let batches = coordinator_binary::decode(message)
            .map_err(|e| FleetError::Invalid(format!("binary batches: {e}")))?;
        self.ingest_any(&batches)
    }

    fn ingest_any<B: IncomingBatch>(
        &self,
        batches: &[B],
    ) -> Result<CacheEventsResponse, FleetError> {
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

    fn admit<B: IncomingBatch>(&self, v: &mut Views, b: &B) -> Result<Admission, FleetError> {
        let now = Instant::now();
        let (id, incarnation, seq) = (b.instance_id(), b.incarnation(), b.seq());
        match v.cursors.get_mut(id) {
            Some(c) if incarnation < c.incarnation => return Ok(Admission::Stale),
            Some(c) if incarnation == c.incarnation => {
                if seq <= c.last_seq {
                    return Ok(Admission::Duplicate);
                }
                if seq > c.last_seq + 1 {
                    let missing = seq - c.last_seq - 1;
                    if !c.gap {
                        tracing::warn!(instance = %id, incarnation, from = c.last_seq, to = seq,
                            "cache-event gap: {missing} batch(es) missing");
                    }
                    c.gap = true;
                    c.missing += missing;
                    self.metrics.missing_batches.inc_by(missing);
                    c.last_seq = seq;
                    c.last_admitted = now;
                    self.want_repair(v, id, incarnation);
                } else {
                    c.last_seq = seq;
                    c.last_admitted = now;
                }
            }
            existing => {
                if let Some(c) = existing {
                    tracing::info!(instance = %id, old = c.incarnation, new = incarnation,
                        "instance restarted: fencing its L1 placements");
                    self.fence(v, id);
                }
                let gap = seq > 1;
                if gap {
                    self.metrics.missing_batches.inc_by(seq - 1);
                }
                v.cursors.insert(
                    id.to_string(),
                    Cursor {
                        incarnation,
                        last_seq: seq,
                        missing: seq - 1,
                        gap,
                        last_admitted: now,
                        repairs: 0,
                        last_repair: None,
                    },
                );
                v.repairs.remove(id);
                if gap {
                    self.want_repair(v, id, incarnation);
                }
            }
        }
        self.apply(v, b)?;
        Ok(Admission::Applied)
    }

    fn apply<B: IncomingBatch>(&self, v: &mut Views, b: &B) -> Result<(), FleetError> {
        let Some(tier) = tier_of(b.tier()) else { return Ok(()) };
        let reporter = v.dir.instance(b.instance_id())?;
        let kind = match b.event_type() {
            CacheEventType::Store => EventKind::Store,
            CacheEventType::Delete => EventKind::Delete,
            CacheEventType::Access => EventKind::Access,
            CacheEventType::Config => {
                if b.shared() {
                    v.dir.site(reporter, tier, b.backend(), true)?;
                }
                declare(&mut v.declarations, b, tier);
                return Ok(());
            }
        };
        let site = match kind {
            EventKind::Access => None,
            _ => Some(v.dir.site(reporter, tier, b.backend(), b.shared())?),
        };
        let mut entries = Vec::with_capacity(b.entry_count());
        let mut last: Option<(KeyNamespace<'_>, lmcache_directory::NsId)> = None;
        for e in b.entries() {
            let ns = match last {
                Some((p, id)) if p == e.ns => id,
                _ if kind == EventKind::Store => v.dir.namespace(&namespace(e.ns))?,
                _ => match v.dir.find_namespace(&namespace(e.ns)) {
                    Some(id) => id,
                    // Nothing was ever stored in it: nothing to delete or touch.
                    None => continue,
                },
            };
            let hash = e.hash.map_err(FleetError::Invalid)?;
            entries.push(Entry {
                key: DirKey { hash, ns },
                size: e.size_bytes,
                tokens: e.token_ids,
                token_offset: e.token_offset,
            });
            last = Some((e.ns, ns));
        }
        if kind != EventKind::Access {
            if let Some(r) = v.repairs.get_mut(b.instance_id()) {
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
            Some(site) => v.dir.apply(reporter, b.incarnation(), kind, site, b.ts(), &entries)?,
            None => v.dir.access(b.ts(), entries.iter().map(|e| e.key)),
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

#[cfg(test)]
mod tests {
    use super::super::test_batches::{key, l1_store};
    use super::*;

    /// Batch `seq` of instance `s`: `keys` (chunk byte, salt) with sizes, and tokens on the
    /// even ones.
    fn batch(
        seq: u64,
        event_type: CacheEventType,
        tier: WireTier,
        keys: &[(u8, &str)],
    ) -> CacheEventBatch {
        let mut out = l1_store(
            seq,
            keys.iter().map(|&(b, salt)| key(format!("{b:02x}").repeat(32), "m", salt)),
        );
        for (e, &(b, _)) in out.entries.iter_mut().zip(keys) {
            e.size_bytes = 100 + u64::from(b);
            if b % 2 == 0 {
                (e.token_ids, e.token_offset) = (vec![u32::from(b); 4], 0);
            }
        }
        CacheEventBatch {
            event_type,
            tier,
            backend: if tier == WireTier::L1 { "dram".into() } else { "fs".into() },
            capacity_bytes: if event_type == CacheEventType::Config { 1 << 30 } else { 0 },
            capacity_revision: 1,
            ..out
        }
    }

    /// The binary layout and LMCache's JSON give the same fleet: placements, cursors,
    /// declarations; a damaged message is refused by name and changes nothing.
    #[test]
    fn binary_and_json_batches_make_the_same_fleet() {
        use CacheEventType::*;
        let batches = vec![
            batch(1, Config, WireTier::L2, &[]),
            batch(2, Store, WireTier::L1, &[(1, ""), (2, ""), (3, "t"), (4, "t")]),
            batch(3, Store, WireTier::L2, &[(1, ""), (5, "")]),
            batch(4, Delete, WireTier::L1, &[(2, ""), (9, "nobody")]),
            batch(5, Access, WireTier::L1, &[(1, "")]),
        ];
        let json = Fleet::new(CoordinatorConfig::default()).unwrap();
        json.ingest(&batches).unwrap();
        let bin = Fleet::new(CoordinatorConfig::default()).unwrap();
        for b in &batches {
            let message = coordinator_binary::encode(std::slice::from_ref(b)).unwrap();
            assert_eq!(bin.ingest_binary(&message).unwrap().applied, 1);
        }
        let (a, b) = (json.views.lock(), bin.views.lock());
        assert_eq!(a.dir.digest(), b.dir.digest());
        assert_eq!(a.dir.stats(), b.dir.stats());
        assert_eq!(a.cursors["s"].last_seq, b.cursors["s"].last_seq);
        assert_eq!(a.declarations["s"].compartments, b.declarations["s"].compartments);
        assert_eq!(
            a.dir.tokens(&[4; 32]).map(|t| t.tokens.to_vec()),
            b.dir.tokens(&[4; 32]).map(|t| t.tokens.to_vec()),
            "tokens travel too"
        );
        let before = b.dir.digest();
        drop((a, b));
        let mut bad =
            coordinator_binary::encode(&[batch(6, Store, WireTier::L1, &[(7, "")])]).unwrap();
        bad.truncate(bad.len() - 3);
        let err = bin.ingest_binary(&bad).unwrap_err().to_string();
        assert!(err.starts_with("binary batches: "), "{err}");
        assert_eq!(bin.views.lock().dir.digest(), before, "a refused message changes nothing");
    }
}
