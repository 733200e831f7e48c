//! The directory's questions: lookups by keys or tokens, listings, stats, blend matches and
//! the routing answer.

use super::*;

impl Fleet {
    // ---- directory ------------------------------------------------------------------------

    /// The object keys of a token sequence's complete chunks, chunk-major with one key per
    /// rank, as LMCache's key resolver builds them.
    pub(crate) fn resolve_tokens(
        &self,
        tokens: &[u32],
        model: &str,
        world_size: u32,
        salt: &str,
    ) -> Result<(usize, Vec<EncodedObjectKey>), FleetError> {
        if tokens.len() > MAX_TOKEN_IDS {
            return Err(FleetError::BadRequest(format!(
                "too many token_ids in a single request (limit={MAX_TOKEN_IDS}, got={})",
                tokens.len()
            )));
        }
        let hashes: Vec<String> =
            self.hasher.hash_tokens(tokens).iter().map(|h| h.to_hex()).collect();
        Ok((hashes.len(), keys_of_chunks(&hashes, model, world_size, salt)?))
    }

    /// `keys` with, after each, the same chunk's keys in the other object groups the
    /// directory holds (LMCache's `get_keys_across_object_groups`: under
    /// `--separate-object-groups` a chunk is stored once per group, and token-addressed
    /// operations resolve group 0), each key's groups in ascending order.
    pub(crate) fn across_object_groups(
        &self,
        keys: Vec<EncodedObjectKey>,
    ) -> Vec<EncodedObjectKey> {
        let v = self.views.lock();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let Ok(hash) = k.chunk_hash() else {
                out.push(k);
                continue;
            };
            let mut others: Vec<EncodedObjectKey> = v
                .dir
                .namespaces_like(&namespace(k.namespace()))
                .into_iter()
                .filter(|(ns, id)| {
                    ns.object_group != k.object_group_id && v.dir.has_key(&DirKey { hash, ns: *id })
                })
                .map(|(ns, _)| EncodedObjectKey { object_group_id: ns.object_group, ..k.clone() })
                .collect();
            others.push(k);
            others.sort_by_key(|e| e.object_group_id);
            out.extend(others);
        }
        out
    }

    /// The placements, tokens and access counts of `keys` (each key is echoed back as given).
    pub fn lookup(
        &self,
        keys: Vec<EncodedObjectKey>,
    ) -> Result<Vec<DirectoryKeyPlacements>, FleetError> {
        let asked: Vec<_> = keys.iter().map(EncodedObjectKeyRef::of).collect();
        let answers = self.lookup_answers(&asked)?;
        Ok(keys
            .into_iter()
            .zip(answers)
            .map(|(key, a)| DirectoryKeyPlacements {
                key,
                placements: a.placements,
                token_ids: a.token_ids,
                access_count: a.access_count,
            })
            .collect())
    }

    /// [`Fleet::lookup`]'s answers to borrowed keys, without the keys (the route writes them
    /// beside their answers: `lookup_answer_json`).
    pub fn lookup_answers(
        &self,
        keys: &[EncodedObjectKeyRef<'_>],
    ) -> Result<Vec<KeyAnswer>, FleetError> {
        let mut parsed = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            k.validate().map_err(|m| FleetError::Invalid(format!("keys[{i}]: {m}")))?;
            parsed.push(k.chunk_hash().map_err(FleetError::Invalid)?);
        }
        let v = self.views.lock();
        // A request's keys mostly share one namespace: resolve it once per run of equal ones.
        let mut last: Option<(usize, Option<lmcache_directory::NsId>)> = None;
        let mut nss = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            let ns = match last {
                Some((j, ns)) if keys[j].namespace() == k.namespace() => ns,
                _ => v.dir.find_namespace(&namespace(k.namespace())),
            };
            last = Some((i, ns));
            nss.push(ns);
        }
        Ok(parsed
            .into_iter()
            .zip(nss)
            .map(|(hash, ns)| {
                let dk = ns.map(|ns| DirKey { hash, ns });
                KeyAnswer {
                    placements: dk
                        .map(|dk| v.dir.placements(&dk))
                        .unwrap_or_default()
                        .into_iter()
                        .map(placement)
                        .collect(),
                    token_ids: v.dir.tokens(&hash).map(|b| b.tokens.to_vec()).unwrap_or_default(),
                    access_count: dk.map_or(0, |dk| v.dir.access_count(&dk)),
                }
            })
            .collect())
    }

    /// `GET /directory/keys`.
    pub(crate) fn list(
        &self,
        filter: &KeyFilter,
        offset: usize,
        limit: usize,
    ) -> (u64, Vec<DirectoryKeyInfo>) {
        let v = self.views.lock();
        let (total, page) = v.dir.list(filter, offset, limit);
        let keys = page
            .into_iter()
            .filter_map(|(k, ps)| {
                let ns = v.dir.namespace_of(k.ns).ok()?;
                Some(DirectoryKeyInfo {
                    key: encoded(&k.hash, ns),
                    placements: ps.into_iter().map(placement).collect(),
                    num_tokens: v.dir.tokens(&k.hash).map_or(0, |b| b.tokens.len() as u64),
                    access_count: v.dir.access_count(&k),
                })
            })
            .collect();
        (total, keys)
    }

    /// `GET /directory/stats`, LMCache's fields plus `streams` and token-binding counts.
    pub(crate) fn directory_stats(&self) -> serde_json::Value {
        let streams = self.streams();
        let v = self.views.lock();
        let st = v.dir.stats();
        let blend = v.dir.blend_stats();
        let by_instance: serde_json::Map<String, serde_json::Value> = v
            .dir
            .l1_keys_by_instance()
            .into_iter()
            .map(|(k, n)| (k.to_string(), n.into()))
            .collect();
        serde_json::json!({
            "num_keys": st.keys,
            "num_placements": st.l1.count + st.l2.count,
            "l1_keys_by_instance": by_instance,
            "blend": {
                "num_contents": blend.num_contents,
                "num_chunks": blend.num_chunks,
                "num_claims": blend.num_claims,
                "num_namespaces": blend.num_namespaces,
                "table_size": blend.table_size,
                "crowded": blend.crowded,
            },
            "l1_count": st.l1.count,
            "l1_size_bytes": st.l1.bytes,
            "l2_count": st.l2.count,
            "l2_size_bytes": st.l2.bytes,
            "token_bindings": st.token_bindings,
            "token_bindings_dropped": st.token_bindings_dropped,
            "streams": streams,
        })
    }

    /// The chunks stored under (`model`, `cache_salt`, `world_size`) found inside `tokens`
    /// (empty unless blend lookup is enabled).
    pub(crate) fn blend_matches(
        &self,
        tokens: &[u32],
        model: &str,
        cache_salt: &str,
        world_size: u32,
    ) -> Vec<lmcache_directory::BlendMatch> {
        self.views.lock().dir.blend_matches(tokens, model, cache_salt, world_size)
    }

    /// Placement totals per tier: ((l1 count, l1 bytes), (l2 count, l2 bytes)), and keys.
    pub(crate) fn totals(&self) -> ((u64, u64), (u64, u64), u64) {
        let st = self.views.lock().dir.stats();
        ((st.l1.count, st.l1.bytes), (st.l2.count, st.l2.bytes), st.keys)
    }

    /// Each registered instance's longest leading run of `keys` (chunk-major, `per_chunk`
    /// keys a chunk), best first. `l2_weight` values a chunk loaded from L2 against one in
    /// L1 (1.0: equal); `loads` (instance → queued chunks) is subtracted times `load_weight`.
    pub(crate) fn route(
        &self,
        keys: &[EncodedObjectKey],
        per_chunk: usize,
        l2_weight: f64,
        load_weight: f64,
        loads: &BTreeMap<String, f64>,
    ) -> Result<Vec<RouteCandidate>, FleetError> {
        let mut dks = Vec::with_capacity(keys.len());
        let runs: Vec<(String, PrefixRun)> = {
            let v = self.views.lock();
            for k in keys {
                let hash = k.chunk_hash().map_err(FleetError::Invalid)?;
                // A key of a namespace nobody stored into is held nowhere: the runs stop there.
                match v.dir.find_namespace(&namespace(k.namespace())) {
                    Some(ns) => dks.push(DirKey { hash, ns }),
                    None => break,
                }
            }
            let usable = dks.len() - dks.len() % per_chunk.max(1);
            v.dir
                .prefix_runs(RunQuery { keys: &dks[..usable], per_chunk })
                .into_iter()
                .filter_map(|r| Some((v.dir.instance_name(r.instance).ok()?.to_string(), r)))
                .collect()
        };
        let chunk = self.config.chunk_size as u64;
        let mut out: Vec<RouteCandidate> = runs
            .into_iter()
            .filter_map(|(id, r)| {
                let info = self.registry.info(&id)?;
                let load = loads.get(&id).copied().unwrap_or(0.0);
                Some(RouteCandidate {
                    score: f64::from(r.l1) + l2_weight * f64::from(r.any - r.l1)
                        - load_weight * load,
                    l1_chunks: r.l1,
                    l1_l2_chunks: r.any,
                    l1_tokens: u64::from(r.l1) * chunk,
                    l1_l2_tokens: u64::from(r.any) * chunk,
                    ip: info.ip,
                    http_port: info.http_port,
                    instance_id: id,
                })
            })
            .collect();
        out.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.instance_id.cmp(&b.instance_id)));
        Ok(out)
    }

    /// The instances the directory knows by name (for `route` callers that want every one).
    pub(crate) fn registered_ids(&self) -> Vec<String> {
        self.registry.ids()
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_batches::l1_store;
    use super::*;

    fn key(b: u8, model: &str, salt: &str) -> EncodedObjectKey {
        super::super::test_batches::key(format!("{b:02x}").repeat(32), model, salt)
    }

    #[test]
    fn a_lookup_answers_each_key_in_its_own_namespace() {
        let f = Fleet::new(CoordinatorConfig::default()).unwrap();
        let stored = [key(1, "m1", ""), key(2, "m2", ""), key(3, "m2", "t"), key(4, "m1", "")];
        f.ingest(&[l1_store(1, stored.iter().cloned())]).unwrap();
        // Runs of one namespace, and the same hashes asked in another namespace (a miss).
        let asked = vec![
            key(1, "m1", ""),
            key(4, "m1", ""),
            key(2, "m2", ""),
            key(1, "m2", ""),
            key(3, "m2", "t"),
            key(2, "m2", "t"),
            key(4, "m1", ""),
            key(4, "m3", ""),
        ];
        let hits: Vec<bool> =
            f.lookup(asked.clone()).unwrap().iter().map(|r| !r.placements.is_empty()).collect();
        assert_eq!(hits, [true, true, true, false, true, false, true, false]);
        let echoed: Vec<EncodedObjectKey> =
            f.lookup(asked.clone()).unwrap().into_iter().map(|r| r.key).collect();
        assert_eq!(echoed, asked, "each key is echoed as asked");
    }
}
