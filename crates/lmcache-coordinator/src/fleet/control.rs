//! Operator control: quotas and pins (persisted in the metadata document), the fleet L2
//! eviction plan, the JetStream position and the replicas' digest.

use super::*;

/// A fleet L2 eviction order: delete `keys` through the server at `endpoint`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvictionOrder {
    /// Instance.
    pub instance_id: String,
    /// Where to send it.
    pub endpoint: Endpoint,
    /// Keys to delete from L2.
    pub keys: Vec<EncodedObjectKey>,
}

impl Fleet {
    /// Runs `f` on the quotas and pins; with `persist`, the metadata document is rewritten
    /// (at `--metadata-path`) before this returns, so a 200 means durable.
    pub(crate) fn control<T>(
        &self,
        persist: bool,
        f: impl FnOnce(&mut crate::control::Control) -> T,
    ) -> Result<T, FleetError> {
        let (out, doc) = {
            let mut c = self.control.lock();
            let out = f(&mut c);
            (out, persist.then(|| c.metadata(wall_clock())))
        };
        if let (Some(doc), Some(path)) = (&doc, &self.config.metadata_path) {
            let bytes = serde_json::to_vec_pretty(doc).unwrap_or_default();
            crate::checkpoint::write_atomic(path, &bytes).map_err(|e| {
                FleetError::BadRequest(format!("could not save the metadata document: {e}"))
            })?;
        }
        if let Some(doc) = doc {
            self.replicate(crate::replication::Change::Metadata { doc });
        }
        Ok(out)
    }

    /// Loads `--metadata-path` (before anything is served); a missing file is an empty one.
    pub(crate) fn load_metadata(&self) -> Result<(), String> {
        let Some(path) = &self.config.metadata_path else { return Ok(()) };
        match std::fs::read(path) {
            Ok(b) => {
                let doc: serde_json::Value =
                    serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", path.display()))?;
                *self.control.lock() = crate::control::Control::from_metadata(&doc)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }

    /// Bytes per cache salt in `tier`, and the total.
    pub(crate) fn salt_bytes(&self, tier: Tier) -> (BTreeMap<String, u64>, u64) {
        let v = self.views.lock();
        let by: BTreeMap<String, u64> =
            v.dir.bytes_by_salt(tier).into_iter().map(|(s, b)| (s.to_string(), b)).collect();
        let total = match tier {
            Tier::L1 => v.dir.stats().l1.bytes,
            Tier::L2 => v.dir.stats().l2.bytes,
        };
        (by, total)
    }

    /// LMCache's fleet eviction pass: for every salt whose L2 bytes reach `watermark` × its
    /// limit (its quota, else the default; neither: exempt), the `ratio` least recently used
    /// of its unpinned L2 keys (all of them for a zero limit), each sent to a registered
    /// server that can delete it (the owner of a private L2, a mounter of a shared pool).
    pub(crate) fn eviction_plan(&self, ratio: f64, watermark: f64) -> Vec<EvictionOrder> {
        let (by_salt, _) = self.salt_bytes(Tier::L2);
        let limits: Vec<(String, u64, u64)> = {
            let c = self.control.lock();
            by_salt
                .into_iter()
                .filter_map(|(salt, used)| Some((c.limit_for(&salt)?, salt, used)))
                .map(|(l, s, u)| (s, u, l))
                .collect()
        };
        let registered = self.registered_ids();
        let mut orders: BTreeMap<String, Vec<EncodedObjectKey>> = BTreeMap::new();
        for (salt, used, limit) in limits {
            if (used as f64) < watermark * limit as f64 || used == 0 {
                continue;
            }
            let share = if limit == 0 { 1.0 } else { ratio };
            let v = self.views.lock();
            let mut cands = v.dir.l2_keys_of_salt(&salt);
            cands.sort_by_key(|(_, last, _)| *last);
            let c = self.control.lock();
            let cands: Vec<_> = cands
                .into_iter()
                .filter_map(|(k, _, sites)| {
                    let ns = v.dir.namespace_of(k.ns).ok()?;
                    let key = encoded(&k.hash, ns);
                    (!c.is_pinned(&key)).then_some((key, sites))
                })
                .collect();
            let take = ((cands.len() as f64) * share).ceil() as usize;
            for (key, sites) in cands.into_iter().take(take) {
                for site in sites {
                    let Ok(s) = v.dir.site_of(site) else { continue };
                    let target = match s.owner {
                        Some(o) => v
                            .dir
                            .instance_name(o)
                            .ok()
                            .map(|n| n.to_string())
                            .filter(|n| registered.contains(n)),
                        None => v
                            .dir
                            .mounts(site)
                            .iter()
                            .filter_map(|m| v.dir.instance_name(*m).ok())
                            .map(|n| n.to_string())
                            .find(|n| registered.contains(n)),
                    };
                    if let Some(t) = target {
                        orders.entry(t).or_default().push(key.clone());
                    }
                }
            }
        }
        orders
            .into_iter()
            .filter_map(|(id, mut keys)| {
                keys.sort();
                keys.dedup();
                let endpoint = self.registry.endpoint(&id)?;
                Some(EvictionOrder { endpoint, instance_id: id, keys })
            })
            .collect()
    }

    /// The last applied stream sequence (JetStream).
    pub fn stream_position(&self) -> u64 {
        self.stream_position.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records that stream sequence `seq` has been applied.
    pub(crate) fn set_stream_position(&self, seq: u64) {
        self.stream_position.store(seq, std::sync::atomic::Ordering::Release);
    }

    /// `GET /directory/digest`.
    pub(crate) fn digest(&self) -> serde_json::Value {
        let v = self.views.lock();
        let (total, by) = v.dir.digest();
        let position = self.stream_position();
        let part = |(d, n): (u128, u64)| serde_json::json!({"digest": format!("{d:032x}"), "placements": n});
        serde_json::json!({
            "stream_sequence": position,
            "total": part(total),
            "instances": by.into_iter().map(|(k, d)| (k, part(d))).collect::<serde_json::Map<_, _>>(),
        })
    }

    /// Where to call registered instance `id`.
    pub(crate) fn endpoint(&self, id: &str) -> Option<Endpoint> {
        self.registry.endpoint(id)
    }
}
