//! Registered engine workers: their object layouts, their KV memory (lmcache-driven), and
//! their liveness. Lookups return zero hits for a `(model, world_size)` that no worker has
//! registered, as LMCache does.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_core::{Dtype, ModelName};
use lmcache_memory::ForeignSegment;
use lmcache_protocol::types::TensorMeta;
use parking_lot::RwLock;

/// Shape of one stored object: `[kv, layers, slots, hidden]` (`kv` = 2, or 1 for MLA).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectLayout {
    /// K and V planes (2) or one (MLA).
    pub kv: u64,
    /// Layers.
    pub layers: u64,
    /// Token slots per chunk.
    pub slots: u64,
    /// Elements per token per layer (heads x head size).
    pub hidden: u64,
    /// Element type.
    pub dtype: Dtype,
}

impl ObjectLayout {
    /// Bytes of one object; `None` on overflow.
    pub fn bytes(&self) -> Option<u64> {
        self.kv
            .checked_mul(self.layers)?
            .checked_mul(self.slots)?
            .checked_mul(self.hidden)?
            .checked_mul(self.dtype.itemsize())
    }

    /// The object's tensor shape as the wire describes it.
    pub fn shape(&self) -> Vec<u64> {
        if self.kv == 1 {
            vec![self.layers, self.slots, self.hidden]
        } else {
            vec![self.kv, self.layers, self.slots, self.hidden]
        }
    }
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
        /// One per layer, in layer order.
        layers: Vec<LayerTensor>,
        /// Tokens per engine block.
        block_size: u64,
        /// MLA (`[NB, BS, D]` per layer).
        mla: bool,
        /// Blocks in each layer tensor.
        num_blocks: u64,
    },
}

/// A registered worker.
#[derive(Debug, Clone)]
pub struct Instance {
    /// The model.
    pub model: ModelName,
    /// Its world size.
    pub world_size: u32,
    /// Its object layout.
    pub layout: ObjectLayout,
    /// How it transfers.
    pub registration: Registration,
    /// Last request seen from it.
    pub last_seen: Instant,
    /// Proven alive by a ping.
    pub ping_proven: bool,
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
}

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
    /// Adds or replaces a registration (and forgets an earlier refusal of it).
    pub fn register(&self, family: Family, id: u64, instance: Instance) {
        self.refused.write().remove(&family.key(id));
        self.instances.write().insert(family.key(id), instance);
    }

    /// Removes a registration or a refusal; false if neither was known.
    pub fn unregister(&self, family: Family, id: u64) -> bool {
        let refused = self.refused.write().remove(&family.key(id)).is_some();
        self.instances.write().remove(&family.key(id)).is_some() || refused
    }

    /// Records that `id`'s registration was refused. A registration it held before stays
    /// dropped: the worker now believes its new one is in place.
    pub fn refuse(&self, family: Family, id: u64, refusal: Refusal) {
        self.instances.write().remove(&family.key(id));
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
    pub fn ping(&self, id: u64) {
        let now = Instant::now();
        for ((_, i), inst) in self.instances.write().iter_mut() {
            if *i == id {
                inst.last_seen = now;
                inst.ping_proven = true;
            }
        }
    }

    /// True when some worker registered `(model, world_size)`.
    pub fn has_model(&self, model: &ModelName, world_size: u32) -> bool {
        self.instances.read().values().any(|i| &i.model == model && i.world_size == world_size)
    }

    /// Drops registrations silent for longer than their timeout; returns how many.
    pub fn reap(&self, now: Instant, timeout: Duration, grace: Duration) -> usize {
        if timeout.is_zero() {
            return 0;
        }
        let mut map = self.instances.write();
        let before = map.len();
        map.retain(|_, i| {
            let limit = if i.ping_proven { timeout } else { grace };
            now.duration_since(i.last_seen) < limit
        });
        before - map.len()
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
