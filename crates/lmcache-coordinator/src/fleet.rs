//! The coordinator's state and every operation on it, without HTTP: the instance registry,
//! the event gate, the key directory and the capacity declarations.
//!
//! Lock order: `views` (gate + directory + capacities, one mutex, so a batch is admitted and
//! applied atomically and in order per emitter) is never held while taking `registry`, and
//! the other way round neither.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lmcache_core::{KvRank, TokenHasher};
use lmcache_directory::{
    DirKey, Directory, Entry, EventKind, KeyFilter, Namespace, PlacementView, PrefixRun, RunQuery,
    Tier,
};
use lmcache_protocol::coordinator::{
    CacheEventBatch, CacheEventType, CacheEventsResponse, DirectoryKeyInfo, DirectoryKeyPlacements,
    EncodedObjectKey, FleetMemoryResponse, InstanceInfo, InstanceMemoryStatus, MAX_TOKEN_IDS,
    ModuleMemoryStatus, Placement, RegisterRequest, RegisterResponse, WireTier,
};
use parking_lot::Mutex;

use crate::config::CoordinatorConfig;
use crate::metrics::Metrics;

/// Why a request was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FleetError {
    /// The body fails LMCache's validation (HTTP 422).
    #[error("{0}")]
    Invalid(String),
    /// The request is well formed but cannot be served (HTTP 400).
    #[error("{0}")]
    BadRequest(String),
    /// No such instance (HTTP 404).
    #[error("unknown instance {0}")]
    UnknownInstance(String),
    /// A limit of the directory was reached.
    #[error(transparent)]
    Directory(#[from] lmcache_directory::DirectoryError),
}

/// One registered instance.
#[derive(Debug, Clone)]
struct Registration {
    info: InstanceInfo,
    last_heartbeat: Instant,
}

/// A resync of one instance's L1 placements from its snapshot, in progress.
#[derive(Debug)]
struct Repair {
    incarnation: u64,
    /// Keys L1 events named since the repair began: newer than any snapshot page.
    touched: std::collections::HashSet<DirKey>,
    /// Keys the snapshot listed.
    listed: std::collections::HashSet<DirKey>,
    started: Instant,
    /// Another gap came during this repair: run again after it.
    again: bool,
}

/// Where a repair fetches from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairTarget {
    /// `http://ip:port`.
    pub base_url: String,
    /// The incarnation being repaired.
    pub incarnation: u64,
}

/// How a repair ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepairOutcome {
    /// The snapshot replaced the instance's L1 placements.
    Repaired,
    /// No snapshot could be had: the instance's L1 placements were dropped (never wrong,
    /// possibly short until new events come).
    Fenced,
    /// A newer incarnation (or a deregistration) made it moot.
    Superseded,
}

/// Per emitter: where its stream stands.
#[derive(Debug, Clone)]
struct Cursor {
    incarnation: u64,
    last_seq: u64,
    /// Batches missing between admitted ones, ever (this incarnation).
    missing: u64,
    /// Whether a gap is open (seen and not yet repaired).
    gap: bool,
    last_admitted: Instant,
    /// Repairs completed for this emitter.
    repairs: u64,
    /// How long the last repair took.
    last_repair: Option<Duration>,
}

/// One instance's capacity declaration.
#[derive(Debug, Clone, Default)]
struct Declaration {
    stamp: (u64, u64),
    /// (tier, backend, shared) → capacity bytes.
    compartments: BTreeMap<(Tier, String, bool), u64>,
}

#[derive(Debug)]
struct Views {
    dir: Directory,
    cursors: HashMap<String, Cursor>,
    declarations: HashMap<String, Declaration>,
    repairs: HashMap<String, Repair>,
}

/// Admission of one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admission {
    Applied,
    Duplicate,
    Stale,
}

/// What a stream looks like to operators (`/directory/stats`, metrics).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StreamStats {
    /// Emitter.
    pub instance_id: String,
    /// Its incarnation.
    pub incarnation: u64,
    /// Last admitted seq.
    pub last_seq: u64,
    /// Whether a gap is open (seen, not yet repaired).
    pub gap_detected: bool,
    /// Whether a resync is running.
    pub repairing: bool,
    /// Resyncs completed.
    pub repairs: u64,
    /// Seconds the last resync took.
    pub last_repair_seconds: Option<f64>,
    /// Batches missing in gaps, this incarnation.
    pub missing_batches: u64,
    /// Seconds since its last admitted batch.
    pub seconds_since_last_batch: f64,
}

/// An instance's place in a routing answer.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RouteCandidate {
    /// Instance.
    pub instance_id: String,
    /// Leading chunks in its L1.
    pub l1_chunks: u32,
    /// Leading chunks in its L1 or any L2 it can load from.
    pub l1_l2_chunks: u32,
    /// `l1_chunks` in tokens.
    pub l1_tokens: u64,
    /// `l1_l2_chunks` in tokens.
    pub l1_l2_tokens: u64,
    /// Higher is better: chunks saved, L2 ones weighted, minus the load given.
    pub score: f64,
    /// Where to reach it.
    pub ip: String,
    /// Its HTTP port.
    pub http_port: u32,
}

/// The fleet state.
#[derive(Debug)]
pub struct Fleet {
    config: CoordinatorConfig,
    hasher: TokenHasher,
    views: Mutex<Views>,
    registry: Mutex<HashMap<String, Registration>>,
    /// Instances whose stream needs a resync, for the repair thread.
    repair_tx: Mutex<Option<std::sync::mpsc::Sender<String>>>,
    /// Quotas and pins (lock order: views before control; never the other way).
    control: Mutex<crate::control::Control>,
    /// The last JetStream stream sequence applied (0: none; HTTP transport: always 0).
    stream_position: std::sync::atomic::AtomicU64,
    /// Metrics (shared with the HTTP layer).
    pub metrics: Arc<Metrics>,
}

fn wall_clock() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn tier_of(t: WireTier) -> Option<Tier> {
    match t {
        WireTier::L1 => Some(Tier::L1),
        WireTier::L2 => Some(Tier::L2),
        WireTier::All => None,
    }
}

fn wire_tier(t: Tier) -> WireTier {
    match t {
        Tier::L1 => WireTier::L1,
        Tier::L2 => WireTier::L2,
    }
}

fn placement(p: PlacementView) -> Placement {
    Placement {
        instance_id: p.instance.to_string(),
        incarnation: p.incarnation,
        tier: wire_tier(p.tier),
        backend: p.backend.to_string(),
        size_bytes: p.size,
        shared: p.shared,
    }
}

/// `mp-<32 hex>`: unique enough for instance ids (time, pid and a counter through BLAKE3).
fn fresh_instance_id() -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = blake3::Hasher::new();
    h.update(&wall_clock().to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    h.update(&N.fetch_add(1, std::sync::atomic::Ordering::Relaxed).to_le_bytes());
    format!("mp-{}", &h.finalize().to_hex()[..32])
}

impl Fleet {
    /// A coordinator with nothing registered.
    pub fn new(config: CoordinatorConfig) -> Result<Self, FleetError> {
        if config.hash_algorithm != "blake3" {
            return Err(FleetError::BadRequest(format!(
                "hash algorithm {:?} is not supported (the fleet must use blake3, LMCache's default)",
                config.hash_algorithm
            )));
        }
        let hasher = TokenHasher::new(config.chunk_size)
            .map_err(|e| FleetError::BadRequest(format!("chunk_size: {e}")))?;
        let dir = Directory::new(config.directory());
        Ok(Self {
            config,
            hasher,
            views: Mutex::new(Views {
                dir,
                cursors: HashMap::new(),
                declarations: HashMap::new(),
                repairs: HashMap::new(),
            }),
            registry: Mutex::new(HashMap::new()),
            repair_tx: Mutex::new(None),
            control: Mutex::new(crate::control::Control::default()),
            stream_position: std::sync::atomic::AtomicU64::new(0),
            metrics: Arc::new(Metrics::new()),
        })
    }

    /// The settings.
    pub fn config(&self) -> &CoordinatorConfig {
        &self.config
    }

    // ---- registry -------------------------------------------------------------------------

    /// `POST /instances`.
    pub fn register(&self, mut req: RegisterRequest) -> Result<RegisterResponse, FleetError> {
        req.validate().map_err(FleetError::Invalid)?;
        let instance_id =
            if req.instance_id.is_empty() { fresh_instance_id() } else { req.instance_id.clone() };
        let info = InstanceInfo {
            instance_id: instance_id.clone(),
            ip: req.ip,
            http_port: req.http_port,
            registration_time: wall_clock(),
            metadata: req.metadata,
            p2p_advertised_url: req.p2p_advertised_url,
            mq_port: req.mq_port,
        };
        let re_registered = self
            .registry
            .lock()
            .insert(instance_id.clone(), Registration { info, last_heartbeat: Instant::now() })
            .is_some();
        tracing::info!(instance = %instance_id, re_registered, "instance registered");
        self.metrics.registrations.inc();
        Ok(RegisterResponse { instance_id, re_registered })
    }

    /// `PUT /instances/{id}/heartbeat`: false when the instance is unknown.
    pub fn heartbeat(&self, id: &str) -> bool {
        match self.registry.lock().get_mut(id) {
            Some(r) => {
                r.last_heartbeat = Instant::now();
                true
            }
            None => false,
        }
    }

    /// `DELETE /instances/{id}`: forgets it, fences its L1 placements and its stream, and its
    /// capacity declaration. Idempotent.
    pub fn deregister(&self, id: &str) {
        let known = self.registry.lock().remove(id).is_some();
        tracing::info!(instance = %id, known, "instance deregistered");
        self.drop_instance(id);
        self.views.lock().declarations.remove(id);
    }

    /// Registered instances, in registration order.
    pub fn instances(&self) -> Vec<InstanceInfo> {
        let mut v: Vec<InstanceInfo> =
            self.registry.lock().values().map(|r| r.info.clone()).collect();
        v.sort_by(|a, b| {
            a.registration_time
                .total_cmp(&b.registration_time)
                .then(a.instance_id.cmp(&b.instance_id))
        });
        v
    }

    /// Drops instances silent for longer than the instance timeout (their L1 placements and
    /// stream cursor go; capacity declarations stay, as in LMCache). Returns their ids.
    pub fn sweep(&self, now: Instant) -> Vec<String> {
        let timeout = self.config.instance_timeout;
        let dead: Vec<String> = {
            let mut reg = self.registry.lock();
            let dead: Vec<String> = reg
                .iter()
                .filter(|(_, r)| now.saturating_duration_since(r.last_heartbeat) > timeout)
                .map(|(id, _)| id.clone())
                .collect();
            for id in &dead {
                reg.remove(id);
            }
            dead
        };
        for id in &dead {
            tracing::warn!(instance = %id, timeout_s = timeout.as_secs_f64(), "instance missed its heartbeats; dropped");
            self.metrics.expired_instances.inc();
            self.drop_instance(id);
        }
        dead
    }

    fn drop_instance(&self, id: &str) {
        let mut v = self.views.lock();
        self.fence(&mut v, id);
        v.cursors.remove(id);
        v.repairs.remove(id);
    }

    /// Drops `id`'s L1 placements, counted; returns how many.
    fn fence(&self, v: &mut Views, id: &str) -> u64 {
        let n = v.dir.find_instance(id).map_or(0, |inst| v.dir.fence_l1(inst));
        self.metrics.fenced_placements.inc_by(n);
        n
    }

    // ---- repair ---------------------------------------------------------------------------

    /// Installs the channel gaps are reported on (the service's repair thread reads it).
    pub fn set_repairer(&self, tx: std::sync::mpsc::Sender<String>) {
        *self.repair_tx.lock() = Some(tx);
    }

    /// Drops the repair channel's sender: the repair thread sees it closed and ends.
    pub fn close_repairer(&self) {
        self.repair_tx.lock().take();
    }

    /// A gap in `id`'s stream at `incarnation`: starts a resync (or asks the running one to
    /// run again).
    fn want_repair(&self, v: &mut Views, id: &str, incarnation: u64) {
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
    pub fn repair_incarnation(&self, id: &str) -> Option<u64> {
        self.views.lock().repairs.get(id).map(|r| r.incarnation)
    }

    /// Where to fetch `id`'s snapshot, if it is registered and a repair is pending.
    pub fn repair_target(&self, id: &str) -> Option<RepairTarget> {
        let incarnation = self.views.lock().repairs.get(id)?.incarnation;
        Some(RepairTarget { base_url: self.base_url(id)?, incarnation })
    }

    /// Applies one snapshot page: each listed key not named by a newer event becomes an L1
    /// placement at `backend`. False when the repair is gone (superseded).
    pub fn resync_page(
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
    pub fn resync_finish(&self, id: &str, incarnation: u64, failed: bool) -> RepairOutcome {
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
        }
        if r.again {
            self.want_repair(v, id, incarnation);
        }
        outcome
    }

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
        if tier == Tier::L1 && kind != EventKind::Access {
            if let Some(r) = v.repairs.get_mut(&b.instance_id) {
                r.touched.extend(entries.iter().map(|e| e.key));
            }
        }
        match site {
            Some(site) => v.dir.apply(reporter, b.incarnation, kind, site, b.ts, &entries)?,
            None => v.dir.access(b.ts, entries.iter().map(|e| e.key)),
        }
        self.metrics.entries.inc_by(entries.len() as u64);
        Ok(())
    }

    /// The emitters' streams.
    pub fn streams(&self) -> Vec<StreamStats> {
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

    // ---- directory ------------------------------------------------------------------------

    /// The object keys of a token sequence's complete chunks, chunk-major with one key per
    /// rank, as LMCache's key resolver builds them.
    pub fn resolve_tokens(
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
    pub fn across_object_groups(&self, keys: Vec<EncodedObjectKey>) -> Vec<EncodedObjectKey> {
        let v = self.views.lock();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let Ok(hash) = k.chunk_hash() else {
                out.push(k);
                continue;
            };
            let mut others: Vec<EncodedObjectKey> = v
                .dir
                .namespaces_like(&namespace(&k))
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

    /// The placements, tokens and access counts of `keys`.
    pub fn lookup(
        &self,
        keys: &[EncodedObjectKey],
    ) -> Result<Vec<DirectoryKeyPlacements>, FleetError> {
        let mut parsed = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            k.validate().map_err(|m| FleetError::Invalid(format!("keys[{i}]: {m}")))?;
            parsed.push(k.chunk_hash().map_err(FleetError::Invalid)?);
        }
        let v = self.views.lock();
        Ok(keys
            .iter()
            .zip(parsed)
            .map(|(k, hash)| {
                let dk = v.dir.find_namespace(&namespace(k)).map(|ns| DirKey { hash, ns });
                DirectoryKeyPlacements {
                    key: k.clone(),
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
    pub fn list(
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
    pub fn directory_stats(&self) -> serde_json::Value {
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
    pub fn blend_matches(
        &self,
        tokens: &[u32],
        model: &str,
        cache_salt: &str,
        world_size: u32,
    ) -> Vec<lmcache_directory::BlendMatch> {
        self.views.lock().dir.blend_matches(tokens, model, cache_salt, world_size)
    }

    /// Placement totals per tier: ((l1 count, l1 bytes), (l2 count, l2 bytes)), and keys.
    pub fn totals(&self) -> ((u64, u64), (u64, u64), u64) {
        let st = self.views.lock().dir.stats();
        ((st.l1.count, st.l1.bytes), (st.l2.count, st.l2.bytes), st.keys)
    }

    /// Each registered instance's longest leading run of `keys` (chunk-major, `per_chunk`
    /// keys a chunk), best first. `l2_weight` values a chunk loaded from L2 against one in
    /// L1 (1.0: equal); `loads` (instance → queued chunks) is subtracted times `load_weight`.
    pub fn route(
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
                match v.dir.find_namespace(&namespace(k)) {
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
        let reg = self.registry.lock();
        let chunk = self.config.chunk_size as u64;
        let mut out: Vec<RouteCandidate> = runs
            .into_iter()
            .filter_map(|(id, r)| {
                let info = &reg.get(&id)?.info;
                let load = loads.get(&id).copied().unwrap_or(0.0);
                Some(RouteCandidate {
                    score: f64::from(r.l1) + l2_weight * f64::from(r.any - r.l1)
                        - load_weight * load,
                    l1_chunks: r.l1,
                    l1_l2_chunks: r.any,
                    l1_tokens: u64::from(r.l1) * chunk,
                    l1_l2_tokens: u64::from(r.any) * chunk,
                    ip: info.ip.clone(),
                    http_port: info.http_port,
                    instance_id: id,
                })
            })
            .collect();
        out.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.instance_id.cmp(&b.instance_id)));
        Ok(out)
    }

    /// The instances the directory knows by name (for `route` callers that want every one).
    pub fn registered_ids(&self) -> Vec<String> {
        self.registry.lock().keys().cloned().collect()
    }

    // ---- usage ----------------------------------------------------------------------------

    /// `GET /instances/usage`.
    pub fn usage(&self) -> FleetMemoryResponse {
        let registered: Vec<String> = self.registered_ids();
        let v = self.views.lock();
        let mut private: BTreeMap<String, BTreeMap<(Tier, String), u64>> = BTreeMap::new();
        let mut shared: BTreeMap<(Tier, String), u64> = BTreeMap::new();
        for (id, site) in v.dir.sites() {
            let used = v.dir.site_stats(id).bytes;
            match site.owner {
                Some(owner) => {
                    if let (Ok(name), true) = (v.dir.instance_name(owner), used > 0) {
                        private
                            .entry(name.to_string())
                            .or_default()
                            .insert((site.tier, site.backend.to_string()), used);
                    }
                }
                None => {
                    shared.insert((site.tier, site.backend.to_string()), used);
                }
            }
        }
        let mut names: std::collections::BTreeSet<String> = registered.iter().cloned().collect();
        names.extend(private.keys().cloned());
        names.extend(
            v.declarations
                .iter()
                .filter(|(_, d)| d.compartments.values().any(|&c| c > 0))
                .map(|(k, _)| k.clone()),
        );
        let module =
            |tier: Tier, backend: &str, shared: bool, used: u64, cap: u64| ModuleMemoryStatus {
                tier: wire_tier(tier),
                backend: backend.to_string(),
                shared,
                used_bytes: used,
                capacity_bytes: cap,
                usage_ratio: (cap > 0).then(|| used as f64 / cap as f64),
            };
        let instances = names
            .into_iter()
            .map(|name| {
                let decl = v.declarations.get(&name);
                let mut mods: BTreeMap<(Tier, String), (u64, u64)> = BTreeMap::new();
                for ((t, b), used) in private.get(&name).into_iter().flatten() {
                    mods.entry((*t, b.clone())).or_default().0 = *used;
                }
                for ((t, b, s), cap) in decl.map(|d| &d.compartments).into_iter().flatten() {
                    if !*s && *cap > 0 {
                        mods.entry((*t, b.clone())).or_default().1 = *cap;
                    }
                }
                InstanceMemoryStatus {
                    registered: registered.contains(&name),
                    declared_capacity: decl
                        .is_some_and(|d| d.compartments.values().any(|&c| c > 0)),
                    modules: mods
                        .into_iter()
                        .map(|((t, b), (u, c))| module(t, &b, false, u, c))
                        .collect(),
                    instance_id: name,
                }
            })
            .collect();
        let mut shared_caps: BTreeMap<(Tier, String), Option<u64>> = BTreeMap::new();
        for d in v.declarations.values() {
            for ((t, b, s), cap) in &d.compartments {
                if *s && *cap > 0 {
                    let e = shared_caps.entry((*t, b.clone())).or_insert(Some(*cap));
                    if *e != Some(*cap) {
                        *e = None; // declarers disagree: undeclared
                    }
                    shared.entry((*t, b.clone())).or_insert(0);
                }
            }
        }
        let shared_modules = shared
            .into_iter()
            .map(|((t, b), used)| {
                let cap = shared_caps.get(&(t, b.clone())).copied().flatten().unwrap_or(0);
                module(t, &b, true, used, cap)
            })
            .collect();
        FleetMemoryResponse { instances, shared_modules }
    }

    /// How long the health sweep waits between passes (None: disabled).
    pub fn sweep_period(&self) -> Option<Duration> {
        (!self.config.health_check_interval.is_zero()).then_some(self.config.health_check_interval)
    }
}

/// A fleet L2 eviction order: delete `keys` through the server at `base_url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvictionOrder {
    /// Instance.
    pub instance_id: String,
    /// `http://ip:port`.
    pub base_url: String,
    /// Keys to delete from L2.
    pub keys: Vec<EncodedObjectKey>,
}

impl Fleet {
    /// Runs `f` on the quotas and pins; with `persist`, the metadata document is rewritten
    /// (at `--metadata-path`) before this returns, so a 200 means durable.
    pub fn control<T>(
        &self,
        persist: bool,
        f: impl FnOnce(&mut crate::control::Control) -> T,
    ) -> Result<T, FleetError> {
        let (out, doc) = {
            let mut c = self.control.lock();
            let out = f(&mut c);
            (out, persist.then(|| c.metadata(wall_clock())))
        };
        if let (Some(doc), Some(path)) = (doc, &self.config.metadata_path) {
            let bytes = serde_json::to_vec_pretty(&doc).unwrap_or_default();
            crate::checkpoint::write_atomic(path, &bytes).map_err(|e| {
                FleetError::BadRequest(format!("could not save the metadata document: {e}"))
            })?;
        }
        Ok(out)
    }

    /// Loads `--metadata-path` (before anything is served); a missing file is an empty one.
    pub fn load_metadata(&self) -> Result<(), String> {
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
    pub fn salt_bytes(&self, tier: Tier) -> (BTreeMap<String, u64>, u64) {
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
    pub fn eviction_plan(&self, ratio: f64, watermark: f64) -> Vec<EvictionOrder> {
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
        let reg = self.registry.lock();
        orders
            .into_iter()
            .filter_map(|(id, mut keys)| {
                keys.sort();
                keys.dedup();
                let info = &reg.get(&id)?.info;
                Some(EvictionOrder { base_url: base_url_of(info), instance_id: id, keys })
            })
            .collect()
    }

    /// The last applied stream sequence (JetStream).
    pub fn stream_position(&self) -> u64 {
        self.stream_position.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records that stream sequence `seq` has been applied.
    pub fn set_stream_position(&self, seq: u64) {
        self.stream_position.store(seq, std::sync::atomic::Ordering::Release);
    }

    /// `GET /directory/digest`.
    pub fn digest(&self) -> serde_json::Value {
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

    /// The `http://ip:port` of registered instance `id`.
    pub fn base_url(&self, id: &str) -> Option<String> {
        self.registry.lock().get(id).map(|r| base_url_of(&r.info))
    }
}

/// The checkpoint's JSON header: everything but the directory image.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct CheckpointHeader {
    registry: Vec<InstanceInfo>,
    /// (instance, incarnation, last seq, missing batches)
    cursors: Vec<(String, u64, u64, u64)>,
    /// (instance, incarnation, revision, [(tier, backend, shared, capacity)])
    declarations: Vec<(String, u64, u64, Vec<SavedCompartment>)>,
    /// The last JetStream sequence applied (0 with HTTP).
    #[serde(default)]
    stream_position: u64,
}

/// (tier, backend, shared, capacity) of one declared compartment.
type SavedCompartment = (WireTier, String, bool, u64);

impl Fleet {
    /// The checkpoint of this state (see [`crate::checkpoint`]). The directory is encoded
    /// under the views lock, so it is one consistent moment of the event streams.
    pub fn checkpoint(&self) -> Vec<u8> {
        let registry = self.instances();
        let mut image = Vec::new();
        let (cursors, declarations, position) = {
            let v = self.views.lock();
            // Read under the views lock: the image and the position are one moment.
            let position = self.stream_position();
            v.dir.encode(&mut image);
            let cursors = v
                .cursors
                .iter()
                .map(|(id, c)| (id.clone(), c.incarnation, c.last_seq, c.missing))
                .collect();
            let declarations = v
                .declarations
                .iter()
                .map(|(id, d)| {
                    let comps = d
                        .compartments
                        .iter()
                        .map(|((t, b, s), c)| (wire_tier(*t), b.clone(), *s, *c))
                        .collect();
                    (id.clone(), d.stamp.0, d.stamp.1, comps)
                })
                .collect();
            (cursors, declarations, position)
        };
        let header =
            CheckpointHeader { registry, cursors, declarations, stream_position: position };
        let header = serde_json::to_vec(&header).unwrap_or_default();
        crate::checkpoint::frame(&header, &image)
    }

    /// Replaces this (fresh) state with a checkpoint's. Registered instances count as having
    /// just sent a heartbeat; a gap open at checkpoint time shows up again with the next batch.
    pub fn restore(
        &self,
        bytes: &[u8],
    ) -> Result<RestoreStats, crate::checkpoint::CheckpointError> {
        use crate::checkpoint::CheckpointError::Corrupt;
        let (header, image) = crate::checkpoint::unframe(bytes)?;
        let h: CheckpointHeader =
            serde_json::from_slice(header).map_err(|e| Corrupt(format!("header: {e}")))?;
        let dir = Directory::decode(image, self.config.directory())
            .map_err(|e| Corrupt(format!("directory: {e}")))?;
        let now = Instant::now();
        let stats = RestoreStats {
            instances: h.registry.len(),
            keys: dir.stats().keys,
            placements: dir.stats().l1.count + dir.stats().l2.count,
        };
        {
            let mut v = self.views.lock();
            v.dir = dir;
            v.repairs.clear();
            v.cursors = h
                .cursors
                .into_iter()
                .map(|(id, incarnation, last_seq, missing)| {
                    let c = Cursor {
                        incarnation,
                        last_seq,
                        missing,
                        gap: false,
                        last_admitted: now,
                        repairs: 0,
                        last_repair: None,
                    };
                    (id, c)
                })
                .collect();
            v.declarations = h
                .declarations
                .into_iter()
                .map(|(id, inc, rev, comps)| {
                    let compartments = comps
                        .into_iter()
                        .filter_map(|(t, b, s, c)| Some(((tier_of(t)?, b, s), c)))
                        .collect();
                    (id, Declaration { stamp: (inc, rev), compartments })
                })
                .collect();
        }
        self.set_stream_position(h.stream_position);
        *self.registry.lock() = h
            .registry
            .into_iter()
            .map(|info| (info.instance_id.clone(), Registration { info, last_heartbeat: now }))
            .collect();
        Ok(stats)
    }
}

/// What a restore brought back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreStats {
    /// Registered instances.
    pub instances: usize,
    /// Keys.
    pub keys: u64,
    /// Placements.
    pub placements: u64,
}

/// `http://ip:port` of a registered instance (an IPv6 address in brackets).
fn base_url_of(info: &InstanceInfo) -> String {
    let host = if info.ip.contains(':') { format!("[{}]", info.ip) } else { info.ip.clone() };
    format!("http://{host}:{}", info.http_port)
}

fn declare(decls: &mut HashMap<String, Declaration>, b: &CacheEventBatch, tier: Tier) {
    let stamp = (b.incarnation, b.capacity_revision);
    let d = decls.entry(b.instance_id.clone()).or_default();
    if stamp < d.stamp {
        return;
    }
    if stamp > d.stamp {
        d.compartments.clear();
        d.stamp = stamp;
    }
    d.compartments.insert((tier, b.backend.clone(), b.shared), b.capacity_bytes);
}

/// The object keys of chunks given by their hex hashes: chunk-major, one key per rank of a
/// world of `world_size`, object group 0 (LMCache's key resolver).
pub fn keys_of_chunks(
    hashes: &[String],
    model: &str,
    world_size: u32,
    salt: &str,
) -> Result<Vec<EncodedObjectKey>, FleetError> {
    let ranks: Vec<u32> = KvRank::all(world_size)
        .map_err(|e| FleetError::Invalid(format!("world_size: {e}")))?
        .map(KvRank::packed)
        .collect();
    Ok(hashes
        .iter()
        .flat_map(|h| {
            ranks.iter().map(move |&kv_rank| EncodedObjectKey {
                chunk_hash_hex: h.clone(),
                model_name: model.to_string(),
                kv_rank,
                object_group_id: 0,
                cache_salt: salt.to_string(),
            })
        })
        .collect())
}

fn namespace(k: &EncodedObjectKey) -> Namespace {
    Namespace {
        model: Arc::from(k.model_name.as_str()),
        kv_rank: k.kv_rank,
        object_group: k.object_group_id,
        cache_salt: Arc::from(k.cache_salt.as_str()),
    }
}

fn encoded(hash: &[u8; 32], ns: &Namespace) -> EncodedObjectKey {
    EncodedObjectKey {
        chunk_hash_hex: hex::encode(hash),
        model_name: ns.model.to_string(),
        kv_rank: ns.kv_rank,
        object_group_id: ns.object_group,
        cache_salt: ns.cache_salt.to_string(),
    }
}
