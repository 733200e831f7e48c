//! CacheBlend's server state (`--engine-type blend`, LMCache's blend module): each worker's
//! rope state for re-rotating K, and the matcher over this server's own stores.
//!
//! Served so far: the handshake, the rope registration (validated as LMCache validates it;
//! the cos/sin caches read out of the worker's shared memory and stripped of any baked-in
//! YaRN scale) and its removal, the fingerprints of every lmcache-driven store, the unified
//! lookup (prefix leg, fingerprint matches locked in L1) and the scatter (V as stored, K
//! re-rotated, token by token into the engine's blocks, with LMCache's early outcomes). Not
//! yet: the reorder plan, fp8 KV, windowed or compressed groups in the scatter, the L2
//! prefetch of matches L1 lost, segmented prefixes, the coordinator's blend leg, and the
//! differential test against LMCache's blend server; so the engine is not reachable from the
//! command line.
//!
//! A registration refused gets the void reply its type has (logged as a refused request and
//! counted); LMCache's server raises and sends none, so its client times out instead.

use std::collections::HashMap;
use std::sync::Arc;

use lmcache_blend::{CosSinCache, Matcher, Namespace, PromptStore, RopeStyle, StoredRun};
use lmcache_core::Dtype;
use lmcache_memory::ForeignSegment;
use lmcache_protocol::request::CbRegisterRope;
use lmcache_protocol::types::{CacheKey, TensorMeta};
use parking_lot::Mutex;
use rmpv::Value;

/// LMCache's blend protocol version.
pub const PROTOCOL_VERSION: i64 = 1;

/// How the blend engine runs (LMCache's flags).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlendOptions {
    /// `--enable-segmented-prefix`.
    pub segmented_prefix: bool,
    /// `--enable-dedup-content`.
    pub dedup_content: bool,
    /// `--enable-blend-reorder`.
    pub reorder: bool,
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

impl RopeState {
    /// Engine group `eg`'s rotation: its cache and, in a token's K row of `hidden` elements,
    /// where the rotated windows are. `None`: the group's K is copied as stored (NoPE, a `-1`
    /// group, a group whose window is `[]`). Refused: geometry that does not fit.
    pub fn for_group(
        &self,
        eg: i64,
        hidden: u64,
        planes: u64,
    ) -> Result<Option<(&CosSinCache, lmcache_blend::KRow)>, String> {
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
        let head = match at.and_then(|g| self.group_head_size.get(g)) {
            Some(&h) => h,
            None => u64::from(self.head_size),
        };
        let offset = if self.group_rot.is_empty() {
            0
        } else {
            match at.and_then(|g| self.group_rot.get(g)) {
                Some(Some((off, _))) => *off,
                Some(None) => return Ok(None),
                None => return Err(format!("engine group {eg} has no rope window")),
            }
        };
        // A declared window past 0 on a single plane is an MLA latent: one row, rope last.
        let (heads, stride) =
            if planes == 1 && offset > 0 { (1, hidden) } else { (hidden / head.max(1), head) };
        if heads == 0 || heads * stride != hidden {
            return Err(format!("a row of {hidden} is not heads of {head}"));
        }
        let row = lmcache_blend::KRow {
            heads: heads as usize,
            head_stride: stride as usize,
            rot_offset: offset as usize,
        };
        Ok(Some((cache, row)))
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
    chunk_size: usize,
}

impl BlendEngine {
    /// An engine for chunks of `chunk_size` tokens.
    pub fn new(options: BlendOptions, chunk_size: usize) -> Self {
        Self {
            options,
            applied: Mutex::default(),
            ropes: Mutex::new(HashMap::new()),
            matcher: Mutex::new(Matcher::new(chunk_size, options.dedup_content)),
            prompts: options.reorder.then(Mutex::default),
            chunk_size,
        }
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
        match lmcache_blend::plan(p, &candidates, self.chunk_size, base, deadline, keep) {
            Some(perm) => perm.iter().map(|&i| p[i]).collect(),
            None => Vec::new(),
        }
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
            "reorder": self.options.reorder,
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
/// `end_session` or the session TTL, and its locks with it).
#[derive(Debug, Default)]
pub struct BlendSession {
    /// A unified lookup whose prefix leg is still loading: the matches found when it began.
    pub pending: Option<Vec<lmcache_blend::Found>>,
    /// The matches the last unified lookup answered, with the read locks on their objects
    /// (every object group and shard of the chunk), for the retrieve.
    pub matched: Vec<(lmcache_protocol::types::blend::CbMatch, Vec<lmcache_l1::ReadLease>)>,
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
    let mut table = Vec::with_capacity(rows_us * cols_us);
    let mut row = vec![0u8; cols_us * elem as usize];
    for r in 0..rows {
        let at = (meta.storage_offset + r * rs) * elem;
        seg.read(at, &mut row).map_err(|e| e.to_string())?;
        widen(meta.dtype, &row, &mut table)?;
    }
    CosSinCache::new(cols_us, table).map_err(|e| e.to_string())
}

/// Appends little-endian `f32`, `f16` or `bf16` elements to `out`, widened to `f32`.
pub(crate) fn widen(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) -> Result<(), String> {
    match dtype {
        Dtype::Float32 => {
            out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
        }
        Dtype::Float16 => out
            .extend(bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())),
        Dtype::BFloat16 => out.extend(
            bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        other => return Err(format!("{other:?} elements: expected float32, float16 or bfloat16")),
    }
    Ok(())
}

/// Writes `values` into `out` as little-endian elements of `dtype` (rounded to nearest), the
/// inverse of [`widen`] for the same dtypes.
pub(crate) fn narrow(dtype: Dtype, values: &[f32], out: &mut [u8]) -> Result<(), String> {
    match dtype {
        Dtype::Float32 => out
            .chunks_exact_mut(4)
            .zip(values)
            .for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes())),
        Dtype::Float16 => out
            .chunks_exact_mut(2)
            .zip(values)
            .for_each(|(o, v)| o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes())),
        Dtype::BFloat16 => out
            .chunks_exact_mut(2)
            .zip(values)
            .for_each(|(o, v)| o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes())),
        other => return Err(format!("{other:?} elements: expected float32, float16 or bfloat16")),
    }
    Ok(())
}
