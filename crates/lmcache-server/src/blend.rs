//! CacheBlend's server state (`--engine-type blend`, LMCache's blend module): each worker's
//! rope state for re-rotating K, the matcher over this server's own stores, the coordinator
//! leg that finds the fleet's, the reorder planner's stored prompts, and what each request's
//! unified lookup holds between its polls ([`BlendSession`]).
//!
//! The operations themselves are in `handlers::blend`; the scatter in
//! `handlers::lmcache_driven`.
//!
//! A registration refused gets the void reply its type has (logged as a refused request and
//! counted); LMCache's server raises and sends none, so its client times out instead.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_blend::{CosSinCache, Found, Matcher, Namespace, PromptStore, RopeStyle, StoredRun};
use lmcache_core::Dtype;
use lmcache_memory::ForeignSegment;
use lmcache_protocol::request::CbRegisterRope;
use lmcache_protocol::types::{CacheKey, TensorMeta};
use parking_lot::Mutex;
use rmpv::Value;

use crate::blend_fleet::{FleetMatcher, FleetQuery};
use crate::blend_telemetry::{BlendEvent, BlendTelemetry, BlendTrace, InstantSpan};

/// LMCache's blend protocol version.
pub const PROTOCOL_VERSION: i64 = 1;

/// How the blend engine runs (LMCache's flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlendOptions {
    /// `--enable-segmented-prefix`.
    pub segmented_prefix: bool,
    /// `--enable-dedup-content`.
    pub dedup_content: bool,
    /// `--enable-blend-reorder` (ignored with a coordinator leg, as LMCache ignores it: a
    /// plan sees only this server's prompts).
    pub reorder: bool,
    /// `--coordinator-blend-timeout`: the coordinator leg's HTTP timeout and deadline.
    pub coordinator_timeout: Duration,
    /// `--coordinator-blend-match-concurrency`: coordinator queries in flight at most.
    pub coordinator_match_concurrency: usize,
}

impl Default for BlendOptions {
    fn default() -> Self {
        Self {
            segmented_prefix: false,
            dedup_content: false,
            reorder: false,
            coordinator_timeout: Duration::from_secs(1),
            coordinator_match_concurrency: 8,
        }
    }
}

/// The fp8 flavour of a worker's KV (`kv_quant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvQuant {
    /// Unquantized.
    None,
    /// `fp8_e4m3`.
    E4m3,
    /// `fp8_e5m2`.
    E5m2,
}

/// One worker's rope state.
#[derive(Debug)]
pub struct RopeState {
    /// Rotary head size.
    pub head_size: u32,
    /// Pairing style.
    pub style: RopeStyle,
    /// The caches (YaRN scales removed), one per rope.
    pub caches: Vec<CosSinCache>,
    /// The scale removed from each cache, if any.
    pub mscales: Vec<Option<f32>>,
    /// Per engine group, its cache (`-1`: none); empty: cache 0 for all.
    pub group_to_cache: Vec<i64>,
    /// Per engine group, its rotary window (`None`: not rotated); empty: `head_size` at 0.
    pub group_rot: Vec<Option<(u64, u64)>>,
    /// Per engine group, its head size; empty: `head_size`.
    pub group_head_size: Vec<u64>,
    /// The KV's fp8 flavour.
    pub kv_quant: KvQuant,
}

/// How one kernel group's K is re-rotated.
#[derive(Debug, Clone, Copy)]
pub struct GroupRotation<'a> {
    /// The group's cos/sin cache.
    pub cache: &'a CosSinCache,
    /// Where the rotated elements sit in a token's row.
    pub row: lmcache_blend::KRow,
    /// How the row's elements are stored.
    pub format: lmcache_blend::KFormat,
}

impl RopeState {
    /// Engine group `eg`'s rotation for a kernel group of `planes` planes whose token rows
    /// hold `hidden` elements of `dtype`. `None`: the group's K is written as stored (NoPE, a
    /// `-1` group, a `[]` window, or a non-float group under a declared window map, as
    /// LMCache skips an fp8 index cache beside an MLA latent). Refused (the retrieve answers
    /// "not ran", as LMCache's planner declines): geometry that does not fit, a window map
    /// that does not cover the group, uint8 K without a `kv_quant` flavour, a single-plane
    /// group with no declared window (an MLA latent would have its content rotated).
    pub fn for_group(
        &self,
        eg: i64,
        hidden: u64,
        planes: u64,
        dtype: Dtype,
    ) -> Result<Option<GroupRotation<'_>>, String> {
        use lmcache_blend::KFormat;
        let at = usize::try_from(eg).ok();
        let cache = match (&self.caches[..], &self.group_to_cache[..]) {
            ([], _) => return Ok(None),
            ([c, ..], []) => c,
            (caches, map) => match at.and_then(|g| map.get(g)) {
                Some(&c) if c < 0 => return Ok(None),
                Some(&c) => {
                    caches.get(c as usize).ok_or(format!("engine group {eg}: no cache {c}"))?
                }
                None => return Err(format!("engine group {eg} has no rope cache mapping")),
            },
        };
        let declared = !self.group_rot.is_empty();
        let float = matches!(
            dtype,
            Dtype::Float32
                | Dtype::Float16
                | Dtype::BFloat16
                | Dtype::Float8E4M3Fn
                | Dtype::Float8E5M2
        );
        if declared && !float {
            return Ok(None);
        }
        let window = if declared {
            match at.and_then(|g| self.group_rot.get(g)) {
                Some(Some(w)) => Some(*w),
                Some(None) => return Ok(None),
                None => return Err(format!("engine group {eg} has no rope window")),
            }
        } else {
            None
        };
        let format = match (dtype, self.kv_quant) {
            (Dtype::Float32, _) => KFormat::F32,
            (Dtype::Float16, _) => KFormat::F16,
            (Dtype::BFloat16, _) => KFormat::Bf16,
            (Dtype::Float8E4M3Fn, _) | (Dtype::UInt8, KvQuant::E4m3) => KFormat::Fp8E4m3,
            (Dtype::Float8E5M2, _) | (Dtype::UInt8, KvQuant::E5m2) => KFormat::Fp8E5m2,
            (Dtype::UInt8, KvQuant::None) => {
                return Err("uint8 K without a kv_quant flavour cannot be re-rotated".into());
            }
            (other, _) => return Err(format!("{other:?} K cannot be re-rotated")),
        };
        let row = match window {
            // An MLA latent: one row, [content | rope], the rope part rotated.
            Some((off, width)) if off > 0 => {
                if planes != 1 {
                    return Err(format!(
                        "engine group {eg}: a rope window at {off} needs a single-plane MLA \
                         latent, the group has {planes} planes"
                    ));
                }
                if off + width != hidden {
                    return Err(format!(
                        "engine group {eg}: rope window [{off}, +{width}) does not end the row \
                         of {hidden}"
                    ));
                }
                if cache.rot_dim() as u64 != width {
                    return Err(format!(
                        "engine group {eg}: rope width {width} but the cos/sin cache rotates {}",
                        cache.rot_dim()
                    ));
                }
                lmcache_blend::KRow {
                    heads: 1,
                    head_stride: hidden as usize,
                    rot_offset: off as usize,
                }
            }
            _ => {
                if planes == 1 && !declared {
                    return Err(format!(
                        "engine group {eg}: single-plane K with no declared rope window (an MLA \
                         latent needs group_rot)"
                    ));
                }
                let head = match at.and_then(|g| self.group_head_size.get(g)) {
                    Some(&h) => h,
                    None => u64::from(self.head_size),
                };
                let heads = hidden / head.max(1);
                if heads == 0 || heads * head != hidden {
                    return Err(format!("a row of {hidden} is not heads of {head}"));
                }
                lmcache_blend::KRow {
                    heads: heads as usize,
                    head_stride: head as usize,
                    rot_offset: 0,
                }
            }
        };
        if row.rot_offset + cache.rot_dim() > row.head_stride {
            return Err(format!(
                "engine group {eg}: a rotary window of {} does not fit a head of {}",
                cache.rot_dim(),
                row.head_stride
            ));
        }
        Ok(Some(GroupRotation { cache, row, format }))
    }
}

/// What identifies a scattered match: its hash, its new start and its destination blocks.
pub type AppliedKey = (Vec<u8>, u64, Vec<u64>);

/// A request and the worker (shard) a retrieve is for.
pub type RequestWorker = (String, Option<u32>);

/// Matches already scattered per (request, worker), the oldest request first out.
#[derive(Debug, Default)]
struct Applied {
    done: HashMap<RequestWorker, std::collections::HashSet<AppliedKey>>,
    order: std::collections::VecDeque<RequestWorker>,
}

/// Requests whose applied matches are kept (LMCache keeps a bounded LRU too).
const APPLIED_REQUESTS: usize = 4096;

/// The blend engine.
#[derive(Debug)]
pub struct BlendEngine {
    options: BlendOptions,
    applied: Mutex<Applied>,
    ropes: Mutex<HashMap<u64, Arc<RopeState>>>,
    matcher: Mutex<Matcher>,
    /// The stored prompts a reorder plan copies (with `--enable-blend-reorder` only).
    prompts: Option<Mutex<PromptStore>>,
    /// The coordinator leg (a coordinator with event reporting).
    fleet: Option<FleetMatcher>,
    telemetry: BlendTelemetry,
    chunk_size: usize,
}

impl BlendEngine {
    /// An engine for chunks of `chunk_size` tokens, telling `telemetry` what it does, with
    /// the coordinator's matches from `fleet` when there is one.
    pub fn new(
        options: BlendOptions,
        chunk_size: usize,
        telemetry: BlendTelemetry,
        fleet: Option<FleetMatcher>,
    ) -> Self {
        let reorder = options.reorder && fleet.is_none();
        if options.reorder && !reorder {
            tracing::warn!("--enable-blend-reorder is ignored with a coordinator blend leg");
        }
        Self {
            options,
            applied: Mutex::default(),
            ropes: Mutex::new(HashMap::new()),
            matcher: Mutex::new(Matcher::new(chunk_size, options.dedup_content)),
            prompts: reorder.then(Mutex::default),
            fleet,
            telemetry,
            chunk_size,
        }
    }

    /// Counts and publishes a blend event.
    pub fn emit(&self, event: BlendEvent) {
        self.telemetry.emit(event);
    }

    /// The coordinator leg, when the engine has one.
    pub fn fleet(&self) -> Option<&FleetMatcher> {
        self.fleet.as_ref()
    }

    /// The handshake's answer: our version, and whether the client's is it.
    pub fn handshake(client_version: i64) -> Value {
        Value::Array(vec![
            Value::from(PROTOCOL_VERSION),
            Value::Boolean(client_version == PROTOCOL_VERSION),
        ])
    }

    /// Validates a rope registration as LMCache does (`max_engine_group` is the largest
    /// engine group index of the worker's registered KV, `-1` for none) and, with the caches
    /// already read, records it (replacing an earlier one: registration is idempotent).
    pub fn register_rope(
        &self,
        req: &CbRegisterRope,
        max_engine_group: i64,
        caches: Vec<CosSinCache>,
    ) -> Result<(), String> {
        let n = caches.len() as i64;
        if !req.group_to_cache.is_empty() {
            let (lo, hi) = req
                .group_to_cache
                .iter()
                .fold((i64::MAX, i64::MIN), |(lo, hi), &g| (lo.min(g), hi.max(g)));
            if lo < -1 || hi >= n {
                return Err(format!(
                    "group_to_cache {:?} holds indices outside [-1, {n}) for the {n} cache(s) sent",
                    req.group_to_cache
                ));
            }
            if (req.group_to_cache.len() as i64) <= max_engine_group {
                return Err(format!(
                    "group_to_cache covers {} engine group(s) but the registered model has \
                     engine groups up to index {max_engine_group}",
                    req.group_to_cache.len()
                ));
            }
        }
        let kv_quant = match req.kv_quant.as_str() {
            "" => KvQuant::None,
            "fp8_e4m3" => KvQuant::E4m3,
            "fp8_e5m2" => KvQuant::E5m2,
            other => {
                return Err(format!(
                    "kv_quant={other:?}: expected one of \"fp8_e4m3\", \"fp8_e5m2\" or \"\""
                ));
            }
        };
        let mut group_rot = Vec::with_capacity(req.group_rot.len());
        for (g, r) in req.group_rot.iter().enumerate() {
            match r.as_slice() {
                [] => group_rot.push(None),
                &[off, width] if off >= 0 && width > 0 => {
                    group_rot.push(Some((off as u64, width as u64)));
                }
                other => {
                    return Err(format!(
                        "group_rot[{g}] = {other:?}: expected [offset >= 0, width > 0] or []"
                    ));
                }
            }
        }
        let (caches, mscales): (Vec<_>, Vec<_>) =
            caches.into_iter().map(CosSinCache::normalized).unzip();
        for (i, m) in mscales.iter().enumerate() {
            if let Some(m) = m {
                tracing::info!(cache = i, mscale = m, "CB re-RoPE: rope-cache scale removed");
            }
        }
        let state = RopeState {
            head_size: req.head_size,
            style: if req.is_neox_style { RopeStyle::Neox } else { RopeStyle::GptJ },
            caches,
            mscales,
            group_to_cache: req.group_to_cache.clone(),
            group_rot,
            group_head_size: req.group_head_size.clone(),
            kv_quant,
        };
        tracing::info!(
            instance_id = req.instance_id,
            caches = state.caches.len(),
            head_size = state.head_size,
            style = ?state.style,
            kv_quant = ?state.kv_quant,
            "CB rope state registered"
        );
        self.ropes.lock().insert(req.instance_id, Arc::new(state));
        Ok(())
    }

    /// Drops a worker's rope state (its KV registration stays).
    pub fn unregister_rope(&self, instance_id: u64) -> bool {
        self.ropes.lock().remove(&instance_id).is_some()
    }

    /// A worker's rope state.
    pub fn rope(&self, instance_id: u64) -> Option<Arc<RopeState>> {
        self.ropes.lock().get(&instance_id).cloned()
    }

    /// After an lmcache-driven store of `key`'s range (chunk `first` on, `hashes` one per
    /// chunk, `committed` the indexes stored): fingerprints the committed runs, as LMCache's
    /// blend store does (worker 0 or every worker only; from chunk 1 when the range starts at
    /// token 0). Returns the chunks newly indexed.
    pub fn on_store(&self, key: &CacheKey, hashes: &[[u8; 32]], committed: &[usize]) -> usize {
        if !matches!(key.worker_id, None | Some(0)) || hashes.is_empty() {
            return 0;
        }
        let n = self.chunk_size;
        let ns = namespace(key);
        let start_chunk = usize::from(key.start == 0);
        let Some(range) = key.token_ids.get(key.start..key.end) else { return 0 };
        let mut stored = vec![false; hashes.len()];
        for &i in committed {
            if let Some(s) = stored.get_mut(i) {
                *s = true;
            }
        }
        let mut added = 0;
        let mut matcher = self.matcher.lock();
        let mut i = 0;
        while i < hashes.len() {
            if !stored[i] {
                i += 1;
                continue;
            }
            let run_start = i;
            while i < hashes.len() && stored[i] {
                i += 1;
            }
            let Some(tokens) = range.get(run_start * n..(i * n).min(range.len())) else {
                continue;
            };
            added += matcher.register(
                &ns,
                StoredRun {
                    tokens,
                    hashes: &hashes[run_start..i],
                    start_chunk: start_chunk.saturating_sub(run_start),
                    position: (key.start + run_start * n) as u64,
                },
            );
        }
        drop(matcher);
        if added > 0 {
            InstantSpan::FingerprintsRegistered.record(None, added as u64);
            self.emit(BlendEvent::FingerprintsRegistered {
                request_id: key.request_id.clone(),
                chunks: added as u64,
            });
        }
        added
    }

    /// Whether stores are recorded for reorder plans (`--enable-blend-reorder`).
    pub fn records_prompts(&self) -> bool {
        self.prompts.is_some()
    }

    /// Records a store that committed KV for the reorder planner (worker 0 or every worker
    /// only, as fingerprints): `chain` is the request's chunk hashes from chunk 0.
    pub fn record_prompt(&self, key: &CacheKey, chain: &[[u8; 32]]) {
        if let Some(p) = &self.prompts
            && matches!(key.worker_id, None | Some(0))
        {
            p.lock().record(&namespace(key), &key.request_id, &key.token_ids, chain);
        }
    }

    /// `cb_reorder_plan`: the prompt's tokens in the order that starts with the longest copy
    /// of a stored prompt's beginning, or empty to keep the prompt (always, without
    /// `--enable-blend-reorder`, or when the key's namespace is none or ambiguous). `chain`
    /// is the prompt's chunk hashes from chunk 0.
    pub fn reorder(
        &self,
        key: &CacheKey,
        keep_prefix: u64,
        budget: std::time::Duration,
        chain: &[[u8; 32]],
    ) -> Vec<u32> {
        let Some(prompts) = &self.prompts else { return Vec::new() };
        let deadline = std::time::Instant::now() + budget;
        let prompts = prompts.lock();
        let Some(ns) =
            prompts.resolve(key.model_name.as_str(), key.world_size, key.cache_salt.as_str())
        else {
            return Vec::new();
        };
        let p = &key.token_ids;
        let hits: Vec<[u8; 32]> = self.matcher.lock().find(&ns, p).iter().map(|f| f.hash).collect();
        let (candidates, base) = prompts.candidates(&ns, &hits, chain, 4);
        let keep = usize::try_from(keep_prefix).unwrap_or(usize::MAX);
        let order: Vec<u32> =
            match lmcache_blend::plan(p, &candidates, self.chunk_size, base, deadline, keep) {
                Some(perm) => perm.iter().map(|&i| p[i]).collect(),
                None => Vec::new(),
            };
        self.emit(BlendEvent::Reordered { reordered: !order.is_empty() });
        order
    }

    /// What `/status` shows: the options, the workers with rope state, the index's size.
    pub fn status(&self) -> serde_json::Value {
        let mut ropes: Vec<u64> = self.ropes.lock().keys().copied().collect();
        ropes.sort_unstable();
        let (chunks, stats) = self.matcher.lock().stats();
        serde_json::json!({
            "registered_cb_rope_instances": ropes,
            "fingerprinted_chunks": chunks,
            "fingerprint_contents": stats.num_contents,
            "segmented_prefix": self.options.segmented_prefix,
            "dedup_content": self.options.dedup_content,
            "reorder": self.prompts.is_some(),
            "coordinator_leg": self.fleet.is_some(),
            "reorder_prompts": self.prompts.as_ref().map_or(0, |p| p.lock().len().0),
        })
    }

    /// Of `matches` (hash, cur_st, destination blocks), those not scattered yet for this
    /// request and worker.
    pub fn not_applied<'m, T>(
        &self,
        request: &RequestWorker,
        matches: &'m [(T, AppliedKey)],
    ) -> Vec<&'m (T, AppliedKey)> {
        let applied = self.applied.lock();
        let done = applied.done.get(request);
        matches.iter().filter(|(_, k)| done.is_none_or(|d| !d.contains(k))).collect()
    }

    /// Records matches as scattered for this request and worker.
    pub fn mark_applied(&self, request: RequestWorker, keys: impl IntoIterator<Item = AppliedKey>) {
        let mut a = self.applied.lock();
        if !a.done.contains_key(&request) {
            a.order.push_back(request.clone());
            while a.order.len() > APPLIED_REQUESTS {
                if let Some(old) = a.order.pop_front() {
                    a.done.remove(&old);
                }
            }
        }
        a.done.entry(request).or_default().extend(keys);
    }

    /// How the engine runs.
    pub fn options(&self) -> BlendOptions {
        self.options
    }

    /// The matcher (the lookup's leg, and tests).
    pub fn matcher(&self) -> &Mutex<Matcher> {
        &self.matcher
    }
}

/// A request's CacheBlend state, kept in its session (so it goes with the session, at
/// `end_session` or the session TTL, and its locks and spans with it).
#[derive(Debug, Default)]
pub struct BlendSession {
    /// A unified lookup between its first poll and its answer.
    pub job: Option<LookupJob>,
    /// The matches the last unified lookup answered (the non-prefix ones, then the
    /// segmented tail).
    pub matched: Vec<lmcache_protocol::types::blend::CbMatch>,
    /// The read locks on their objects (every blend object group and shard of each chunk,
    /// `num_kv_readers` times), held for the retrieve.
    pub leases: Vec<lmcache_l1::ReadLease>,
    /// The request's open spans.
    pub trace: Option<BlendTrace>,
}

/// A unified lookup in progress: its legs, each polled until it lands.
#[derive(Debug)]
pub struct LookupJob {
    /// This server's fingerprint matches, found at the first poll.
    pub local: Vec<Found>,
    /// The coordinator leg, until it answers or its deadline passes.
    pub fleet: Option<FleetLeg>,
    /// The prefix leg's leading chunks, once it landed.
    pub prefix_chunks: Option<u64>,
    /// The sparse leg, once started: the candidates past the prefix (ascending `cur_st`)
    /// and, per distinct chunk, where its objects stand.
    pub sparse: Option<SparseLeg>,
    /// No worker of the model registered: nothing to match or scatter into.
    pub no_context: bool,
}

/// The coordinator leg of a lookup.
#[derive(Debug)]
pub struct FleetLeg {
    /// The query in flight.
    pub query: FleetQuery,
    /// When the lookup stops waiting for it.
    pub deadline: Instant,
    /// Its matches, once answered (empty after a failure or the deadline).
    pub matches: Option<Vec<Found>>,
}

/// The sparse leg of a lookup: the matches past the prefix, their chunks' objects locked in
/// L1 or loading from L2 and the fleet's peers.
#[derive(Debug, Default)]
pub struct SparseLeg {
    /// Candidate matches, ascending `cur_st`.
    pub candidates: Vec<Found>,
    /// Per distinct chunk hash, its objects.
    pub chunks: HashMap<[u8; 32], ChunkState>,
    /// Keys that had to be loaded.
    pub l2_keys: u64,
    /// Of those, the keys that landed.
    pub found_keys: u64,
}

/// Where one matched chunk's objects stand.
#[derive(Debug)]
pub enum ChunkState {
    /// Every object read-locked.
    Held(Vec<lmcache_l1::ReadLease>),
    /// Some locked, the rest loading.
    Loading {
        /// The locks taken so far.
        held: Vec<lmcache_l1::ReadLease>,
        /// The load of the rest.
        handle: lmcache_storage::PrefetchHandle,
    },
    /// Not every object could be found.
    Missing,
}

impl SparseLeg {
    /// Whether any chunk is still loading.
    pub fn loading(&self) -> bool {
        self.chunks.values().any(|c| matches!(c, ChunkState::Loading { .. }))
    }
}

/// A request's blend namespace.
pub fn namespace(key: &CacheKey) -> Namespace {
    Namespace {
        model: Arc::from(key.model_name.as_str()),
        world_size: key.world_size,
        cache_salt: Arc::from(key.cache_salt.as_str()),
    }
}

/// The largest cos/sin cache read (64 M elements: 256 MiB as `f32`; vLLM's for 128 k
/// positions of 128 is 16 M).
pub const MAX_COS_SIN_ELEMENTS: usize = 1 << 26;

/// Reads a `[positions, rot_dim]` cos/sin cache of `f32`, `f16` or `bf16` out of a mapped
/// segment, every element's offset checked against the mapping first.
pub fn read_cos_sin(seg: &ForeignSegment, meta: &TensorMeta) -> Result<CosSinCache, String> {
    let [rows, cols] = meta.shape[..] else {
        return Err(format!(
            "a cos/sin cache of shape {:?}: expected [positions, rot_dim]",
            meta.shape
        ));
    };
    let [rs, cs] = meta.stride[..] else {
        return Err(format!("strides {:?} for a 2-D cache", meta.stride));
    };
    let elem = match meta.dtype {
        Dtype::Float32 => 4u64,
        Dtype::Float16 | Dtype::BFloat16 => 2,
        other => {
            return Err(format!(
                "a cos/sin cache of {other:?}: expected float32, float16 or bfloat16"
            ));
        }
    };
    if cs != 1 || rs < cols {
        return Err(format!(
            "strides {:?}: a cos/sin cache's rows must be contiguous",
            meta.stride
        ));
    }
    let (rows_us, cols_us) = (
        usize::try_from(rows).map_err(|e| e.to_string())?,
        usize::try_from(cols).map_err(|e| e.to_string())?,
    );
    if rows_us == 0 || cols_us == 0 || rows_us.saturating_mul(cols_us) > MAX_COS_SIN_ELEMENTS {
        return Err(format!(
            "a cos/sin cache of {rows} x {cols}: empty or over {MAX_COS_SIN_ELEMENTS} elements"
        ));
    }
    let last = meta
        .storage_offset
        .checked_add((rows - 1).checked_mul(rs).ok_or("strides overflow")?)
        .and_then(|v| v.checked_add((cols - 1).checked_mul(cs)?))
        .and_then(|v| v.checked_add(1)?.checked_mul(elem))
        .ok_or("the cache's extent overflows")?;
    if last > seg.len() {
        return Err(format!("the cache ends at byte {last}, past its segment's {}", seg.len()));
    }
    let format = match meta.dtype {
        Dtype::Float32 => lmcache_blend::KFormat::F32,
        Dtype::Float16 => lmcache_blend::KFormat::F16,
        _ => lmcache_blend::KFormat::Bf16,
    };
    let mut table = vec![0f32; rows_us * cols_us];
    let mut row = vec![0u8; cols_us * elem as usize];
    for (r, out) in (0..rows).zip(table.chunks_exact_mut(cols_us)) {
        let at = (meta.storage_offset + r * rs) * elem;
        seg.read(at, &mut row).map_err(|e| e.to_string())?;
        format.widen(&row, out);
    }
    CosSinCache::new(cols_us, table).map_err(|e| e.to_string())
}
