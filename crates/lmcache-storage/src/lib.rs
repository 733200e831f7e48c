//! The storage controllers of lmcache-rs: the L2 tier joined to L1.
//!
//! - `build`: [`Storage`], storage built whole from a [`StorageConfig`] (an arena per L1,
//!   the L1s and their maintenance, the L2 tier and its runtime), the one door the server and
//!   tools use.
//! - [`fold`]: what a hit means for a hybrid model: the longest prefix every object group
//!   can serve (full attention: every chunk; a window of `w` chunks: its last `w`), and the
//!   cells that prefix needs.
//! - [`ledger`]: per adapter, the keys and bytes held per cache_salt, the eviction order,
//!   admission against capacity and quotas, and pins that keep loads from being evicted.
//! - [`manager`]: [`StorageManager`], the one owner of L1 and L2 the store path calls:
//!   reserve (waiting for the write-behind rather than evicting what L2 lacks), commit (L1
//!   commit plus write-behind in one call), flush.
//! - [`observe`]: [`StorageEvent`]s, what storage tells its [`StorageSubscriber`]s (metrics,
//!   KV events, trace recording and the like), with the [`RequestContext`] a caller hands it.
//! - [`peers`]: [`PeerSource`], the fleet's peers as a source of a lookup's misses (P2P),
//!   asked for what L1 and then L2 could not serve.
//! - [`scope`]: [`RequestScope`], a request's view of storage: the manager's operations, each
//!   announced with the request's context.
//! - [`lookup`]: a lookup through both tiers as one value (`Ready` leases or `Pending` on a
//!   prefetch), and the leases a retrieve spends.
//! - [`tier`]: [`L2Tier`], the ordered set of adapters (priority = order), their health and
//!   byte accounting per cache_salt, runtime add and remove, and the runtime that drives them.
//! - [`store`]: the write-behind store controller (L1 commit → every adapter), with a bounded
//!   queue, duplicate skipping, retries with backoff and counted drops.
//! - `testing` (feature `testing`, for this crate's own tests): the tier internals.
//! - [`prefetch`]: the prefetch controller (lookup → L2 → L1), with an in-flight limit and a
//!   deadline per request.
#![forbid(unsafe_code)]

mod build;
pub mod fold;
pub mod ledger;
pub mod lookup;
pub mod manager;
pub mod observe;
pub mod peers;
pub mod prefetch;
pub mod scope;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tier;

pub use build::{BuildError, L1MemberConfig, Storage, StorageConfig};
pub use lookup::{
    GroupLookupRequest, Lookup, LookupLeases, LookupRequest, PendingLookup, Settled, ShardKeys,
};
pub use manager::{
    DeleteReport, DeleteScope, L2Listing, StorageError, StorageManager, StoreSlot, TierName,
};
pub use observe::{RequestContext, StorageEvent, StorageSubscriber};
pub use peers::{PeerDone, PeerFetch, PeerSource};
pub use prefetch::{
    PrefetchHandle, PrefetchOutcome, PrefetchRequest, PrefetchTrouble, PrefetchWaiter,
};
pub use scope::RequestScope;
pub use tier::{
    AdapterCounters, AdapterInfo, L2Tier, PrefetchReport, StorePolicy, StoreReport, TierConfig,
    TierObserver, TierStats,
};
