//! Registered engine workers: their object layouts, their KV memory (lmcache-driven), and
//! their liveness. Lookups return zero hits for a `(model, world_size)` that no worker has
//! registered, as LMCache does.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_core::ModelName;
pub use lmcache_core::layout::{ObjectLayout, ObjectShape};
use lmcache_memory::ForeignSegment;
use lmcache_protocol::types::TensorMeta;
use parking_lot::RwLock;

use crate::registry_file::{RegistryFile, Saved};

/// A kernel group of an lmcache-driven registration: layers that share one geometry, dtype
/// and engine block space, moved by one copy loop.
#[derive(Debug, Clone)]
pub struct KernelGroup {
    /// Registered tensor indices, ascending.
    pub layer_indices: Vec<usize>,
    /// Their tensors, in the same order.
    pub layers: Vec<LayerTensor>,
    /// Their common geometry (`block_size` is physical slots per block).
    pub geometry: crate::transfer::PagedGeometry,
    /// MLA (`[NB, BS, D]` per layer).
    pub mla: bool,
    /// Which request block-id list it reads (its index in `block_ids`).
    pub view: usize,
    /// Logical tokens per engine block.
    pub tokens_per_block: u64,
    /// Engine blocks in one chunk.
    pub blocks_per_chunk: usize,
    /// The last blocks of each chunk it stores (all of them but for a sliding window smaller
    /// than a chunk).
    pub kept_blocks: usize,
    /// The engine group it lives in.
    pub engine_group: i64,
    /// Sliding window in tokens, -1 for none.
    pub sw_size_tokens: i64,
    /// Recurrent state pages.
    pub recurrent: bool,
    /// LMCache's connector-private extra-group tag (0: regular).
    pub extra_tag: i64,
}

impl KernelGroup {
    /// KV bytes per logical token (LMCache's `cache_size_per_token` for one group): a slot's
    /// bytes over the tokens it holds (more than one in a compressed group, whose blocks have
    /// fewer slots than tokens).
    pub fn bytes_per_token(&self) -> u64 {
        let g = &self.geometry;
        let slot = g.kv * self.layers.len() as u64 * g.hidden * g.dtype.itemsize();
        let ratio = (self.tokens_per_block / g.block_size.max(1)).max(1);
        slot / ratio
    }
}

/// An object group of an lmcache-driven registration.
#[derive(Debug, Clone)]
pub struct ObjectGroup {
    /// Its kernel groups (indices into the registration's), in layout order.
    pub kernel_groups: Vec<usize>,
}

/// One layer's paged KV tensor in a client segment (lmcache-driven, CPU).
#[derive(Debug, Clone)]
pub struct LayerTensor {
    /// The mapped segment.
    pub segment: Arc<ForeignSegment>,
    /// Its view.
    pub meta: TensorMeta,
}

/// What a worker registered.
#[derive(Debug, Clone)]
pub enum Registration {
    /// The client copies (engine-driven, SHM pool).
    EngineDriven,
    /// The server copies from/to these layer tensors.
    LmcacheDriven {
        /// The kernel groups (LMCache's order: by first layer).
        kernel_groups: Vec<KernelGroup>,
        /// The object groups; object group `i` is stored under `object_group_id` `i`.
        object_groups: Vec<ObjectGroup>,
        /// Registered layer tensors.
        num_layers: usize,
    },
}

/// A registered worker.
#[derive(Debug, Clone)]
pub struct Instance {
    /// The model.
    pub model: ModelName,
    /// Its world size.
    pub world_size: u32,
    /// Its objects, one per object group (never empty).
    pub objects: Vec<ObjectShape>,
    /// How it transfers.
    pub registration: Registration,
    /// Last request seen from it.
    pub last_seen: Instant,
    /// Proven alive by a ping.
    pub ping_proven: bool,
}

impl Instance {
    /// The layout of an instance with one single-part object group (every engine-driven
    /// one); `None` for a hybrid registration.
    pub fn single_layout(&self) -> Option<&ObjectLayout> {
        match self.objects.as_slice() {
            [o] if o.parts.len() == 1 => o.parts.first(),
            _ => None,
        }
    }
}

/// A registration the server refused: the worker believes it registered (the reply type is
/// void), so every later operation of it fails naming this reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The model it named, if that much decoded.
    pub model: Option<String>,
    /// Its world size, if that much decoded.
    pub world_size: Option<u32>,
    /// Why, and what to do about it.
    pub reason: String,
    /// When (seconds since the Unix epoch).
    pub at_unix: u64,
}

/// How many refusals are remembered (the oldest go first).
const MAX_REFUSALS: usize = 256;

/// All registrations, keyed by `(transfer family, instance id)`, and the refused ones.
#[derive(Debug, Default)]
pub struct Registry {
    instances: RwLock<HashMap<(bool, u64), Instance>>,
    refused: RwLock<HashMap<(bool, u64), Refusal>>,
    /// Instance ids that pinged while unknown and were answered `false` once (see
    /// [`Registry::ping`]); an id leaves when it registers.
    told_unknown: parking_lot::Mutex<std::collections::HashSet<u64>>,
    /// Where registrations are kept for a warm restart (an L1 file that restarts warm).
    file: Option<RegistryFile>,
}

/// How many unknown instance ids [`Registry::ping`] remembers having told (then it starts over).
const MAX_TOLD_UNKNOWN: usize = 4096;

/// Which family a registration belongs to (LMCache keeps them apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `register_kv_cache` family.
    LmcacheDriven,
    /// `register_kv_cache_engine_driven_context` family.
    EngineDriven,
}

/// A map's entries with their family and instance id, by instance id.
fn by_instance<T: Clone>(map: &HashMap<(bool, u64), T>) -> Vec<(Family, u64, T)> {
    let mut v: Vec<_> =
        map.iter().map(|((ed, id), x)| (Family::of_key(*ed), *id, x.clone())).collect();
    v.sort_by_key(|x| x.1);
    v
}

impl Family {
    fn of_key(engine_driven: bool) -> Self {
        if engine_driven { Family::EngineDriven } else { Family::LmcacheDriven }
    }

    /// The operation that registers a worker of this family.
    pub fn register_op(self) -> lmcache_protocol::Op {
        match self {
            Family::LmcacheDriven => lmcache_protocol::Op::RegisterKvCache,
            Family::EngineDriven => lmcache_protocol::Op::RegisterKvCacheEngineDrivenContext,
        }
    }

    /// The transfer mode's name, as `/status` shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::LmcacheDriven => "lmcache_driven",
            Family::EngineDriven => "engine_driven",
        }
    }

    fn key(self, id: u64) -> (bool, u64) {
        (self == Family::EngineDriven, id)
    }
}

impl Registry {
    /// A registry that keeps its registrations in `file`, for the next warm restart.
    pub fn persisted(file: RegistryFile) -> Self {
        Self { file: Some(file), ..Self::default() }
    }

    /// Saves a registration that succeeded as the request that made it (only where the
    /// registry is persisted).
    pub fn remember(&self, saved: Saved) {
        if let Some(f) = &self.file {
            f.put(saved);
        }
    }

    fn forget(&self, keys: &[(Family, u64)]) {
        if let (Some(f), false) = (&self.file, keys.is_empty()) {
            f.remove(keys);
        }
    }

    /// Adds or replaces a registration (and forgets an earlier refusal of it).
    pub fn register(&self, family: Family, id: u64, instance: Instance) {
        self.told_unknown.lock().remove(&id);
        self.refused.write().remove(&family.key(id));
        self.instances.write().insert(family.key(id), instance);
    }

    /// Removes a registration or a refusal; false if neither was known.
    pub fn unregister(&self, family: Family, id: u64) -> bool {
        let refused = self.refused.write().remove(&family.key(id)).is_some();
        self.forget(&[(family, id)]);
        self.instances.write().remove(&family.key(id)).is_some() || refused
    }

    /// Records that `id`'s registration was refused. A registration it held before stays
    /// dropped: the worker now believes its new one is in place.
    pub fn refuse(&self, family: Family, id: u64, refusal: Refusal) {
        self.instances.write().remove(&family.key(id));
        self.forget(&[(family, id)]);
        let mut map = self.refused.write();
        if map.len() >= MAX_REFUSALS && !map.contains_key(&family.key(id)) {
            let oldest = map.iter().min_by_key(|(_, r)| r.at_unix).map(|(k, _)| *k);
            if let Some(k) = oldest {
                map.remove(&k);
            }
        }
        map.insert(family.key(id), refusal);
    }

    /// Why `id`'s registration was refused, if it was (and it has not registered since).
    pub fn refusal(&self, family: Family, id: u64) -> Option<Refusal> {
        self.refused.read().get(&family.key(id)).cloned()
    }

    /// Every refusal, by instance id.
    pub fn refusals(&self) -> Vec<(Family, u64, Refusal)> {
        by_instance(&self.refused.read())
    }

    /// A registration, refreshing its liveness.
    pub fn get(&self, family: Family, id: u64) -> Option<Instance> {
        let mut map = self.instances.write();
        let inst = map.get_mut(&family.key(id))?;
        inst.last_seen = Instant::now();
        Some(inst.clone())
    }

    /// True when `id` has a registration in either family.
    pub fn has_instance(&self, id: u64) -> bool {
        self.instances.read().keys().any(|(_, i)| *i == id)
    }

    /// True when registered (no liveness refresh).
    pub fn contains(&self, family: Family, id: u64) -> bool {
        self.instances.read().contains_key(&family.key(id))
    }

    /// A ping from `id`: refreshes and proves every registration it has.
    ///
    /// Returns the ping's answer: true, except the first ping of an instance id the server
    /// does not know (neither registered nor refused: the server restarted, or reaped it).
    /// LMCache's server always answers true, so a worker of a server that restarted within
    /// one heartbeat never notices and its stores and lookups go to a server without its
    /// registration; one `false` makes LMCache's vLLM adapter mark the server unhealthy, and
    /// the next `true` runs its recovery, which registers the KV caches again.
    pub fn ping(&self, id: u64) -> bool {
        let now = Instant::now();
        let mut known = false;
        for ((_, i), inst) in self.instances.write().iter_mut() {
            if *i == id {
                inst.last_seen = now;
                inst.ping_proven = true;
                known = true;
            }
        }
        if known || self.refused.read().keys().any(|(_, i)| *i == id) {
            return true;
        }
        let mut told = self.told_unknown.lock();
        if told.len() >= MAX_TOLD_UNKNOWN {
            told.clear();
        }
        !told.insert(id)
    }

    /// True when some worker registered `(model, world_size)`.
    pub fn has_model(&self, model: &ModelName, world_size: u32) -> bool {
        self.instances.read().values().any(|i| &i.model == model && i.world_size == world_size)
    }

    /// The windows of the object groups `(model, world_size)` stores (one `None` for a model
    /// stored as one full-attention object per chunk, the usual case).
    pub fn object_windows(&self, model: &ModelName, world_size: u32) -> Vec<Option<u64>> {
        self.instances
            .read()
            .values()
            .filter(|i| &i.model == model && i.world_size == world_size)
            .map(|i| i.objects.iter().map(|o| o.window_chunks).collect::<Vec<_>>())
            .max_by_key(Vec::len)
            .unwrap_or_else(|| vec![None])
    }

    /// The object groups `(model, world_size)` stores (the registration with the most), empty
    /// when no worker registered it.
    pub fn objects(&self, model: &ModelName, world_size: u32) -> Vec<ObjectShape> {
        self.instances
            .read()
            .values()
            .filter(|i| &i.model == model && i.world_size == world_size)
            .map(|i| i.objects.clone())
            .max_by_key(Vec::len)
            .unwrap_or_default()
    }

    /// The parts of object group 0 of `(model, world_size)` (what a lookup-hash log line
    /// names), if a worker registered it.
    pub fn first_object(&self, model: &ModelName, world_size: u32) -> Option<ObjectShape> {
        self.instances
            .read()
            .values()
            .find(|i| &i.model == model && i.world_size == world_size)
            .and_then(|i| i.objects.first().cloned())
    }

    /// Drops registrations silent for longer than their timeout; returns how many.
    pub fn reap(&self, now: Instant, timeout: Duration, grace: Duration) -> usize {
        if timeout.is_zero() {
            return 0;
        }
        let mut reaped = Vec::new();
        self.instances.write().retain(|(ed, id), i| {
            let limit = if i.ping_proven { timeout } else { grace };
            let keep = now.duration_since(i.last_seen) < limit;
            if !keep {
                reaped.push((Family::of_key(*ed), *id));
            }
            keep
        });
        self.forget(&reaped);
        reaped.len()
    }

    /// Every registration, with its instance id and family.
    pub fn snapshot(&self) -> Vec<(Family, u64, Instance)> {
        by_instance(&self.instances.read())
    }

    /// `(family, instance id, model, world size)` of every registration.
    pub fn list(&self) -> Vec<(Family, u64, String, u32)> {
        let mut v: Vec<_> = self
            .instances
            .read()
            .iter()
            .map(|((ed, id), i)| (Family::of_key(*ed), *id, i.model.to_string(), i.world_size))
            .collect();
        v.sort_by_key(|x| x.1);
        v
    }
}
