//! Test hooks (feature `testing`): the tier internals this crate's own integration tests
//! drive directly. Nothing above storage enables it (only dev-dependencies do), so the server
//! and the CLI cannot reach an adapter: their build has no such methods.

use std::sync::Arc;

use lmcache_core::ObjectKey;
use lmcache_l2::L2Adapter;

use crate::manager::StorageManager;
use crate::tier::{AdapterSlot, L2Tier};

/// The tier's internals.
pub trait TierInternals {
    /// The attached adapters in priority order.
    fn adapters(&self) -> Vec<Arc<AdapterSlot>>;
    /// Queues keys for the write-behind, as a commit does.
    fn submit_store(&self, keys: impl IntoIterator<Item = ObjectKey>);
}

impl TierInternals for L2Tier {
    fn adapters(&self) -> Vec<Arc<AdapterSlot>> {
        self.slots()
    }

    fn submit_store(&self, keys: impl IntoIterator<Item = ObjectKey>) {
        self.queue_store(keys);
    }
}

/// An adapter slot's internals.
pub trait SlotInternals {
    /// The adapter itself.
    fn adapter(&self) -> Arc<dyn L2Adapter>;
}

impl SlotInternals for AdapterSlot {
    fn adapter(&self) -> Arc<dyn L2Adapter> {
        self.built.adapter.clone()
    }
}

/// The manager's internals.
pub trait ManagerInternals {
    /// The L2 tier.
    fn l2(&self) -> Option<&L2Tier>;
}

impl ManagerInternals for StorageManager {
    fn l2(&self) -> Option<&L2Tier> {
        self.l2_tier()
    }
}
