//! [`RequestScope`]: a request's view of storage. The same operations as
//! [`StorageManager`], each announced to the subscribers with the request's
//! [`RequestContext`] ([`crate::observe`]). The server's handlers use it and nothing else;
//! tools that need no subscribers (trace replay, tests) call the manager directly.

use std::time::Duration;

use lmcache_core::ObjectKey;
use lmcache_l1::{L1Error, ReadLease, WriteRequest, WriteReservation};

use crate::manager::{StorageManager, StoreSlot};
use crate::observe::{RequestContext, StorageEvent};
use crate::{GroupLookupRequest, Lookup, Settled};

/// Storage for one request. Cheap: two references.
#[derive(Debug, Clone, Copy)]
pub struct RequestScope<'s, 'a> {
    storage: &'s StorageManager,
    ctx: &'s RequestContext<'a>,
}

impl<'s, 'a> RequestScope<'s, 'a> {
    pub(crate) fn new(storage: &'s StorageManager, ctx: &'s RequestContext<'a>) -> Self {
        Self { storage, ctx }
    }

    /// The request's context.
    pub fn context(&self) -> &RequestContext<'a> {
        self.ctx
    }

    fn publish(&self, event: &StorageEvent<'_>) {
        self.storage.announce(event);
    }

    /// Looks `req` up ([`StorageManager::lookup_groups`]): announces the keys looked up, then
    /// what L1 served.
    pub fn lookup(&self, req: &GroupLookupRequest) -> Lookup {
        self.publish(&StorageEvent::LookupStarted { ctx: self.ctx, request: req });
        let lookup = self.storage.lookup_groups_of(req, Some(self.ctx.objects));
        let shards = req.groups.first().map_or(0, |(_, s)| s.len());
        self.publish(&StorageEvent::LookedUp {
            ctx: self.ctx,
            shards,
            l1_hits: lookup.l1_hit(),
            pending: lookup.is_pending(),
        });
        lookup
    }

    /// If `lookup`'s prefetch (L2, the peers) has ended, joins it ([`Lookup::settle`]) and
    /// announces what it added to this request's lookup of `chunks` chunks: chunks
    /// `settled.hits - settled.l2_hits..settled.hits` of the context's range are newly
    /// resident in L1. Returns that, once.
    pub fn settle(&self, chunks: usize, lookup: &mut Lookup) -> Option<Settled> {
        let settled = lookup.settle()?;
        self.publish(&StorageEvent::LookupSettled {
            ctx: self.ctx,
            chunks,
            settled: settled.clone(),
        });
        Some(settled)
    }

    /// Reserves L1 memory for `requests` of object group `object_group`
    /// ([`StorageManager::reserve_for_store`]); each refusal is announced.
    pub fn reserve_for_store(
        &self,
        object_group: u32,
        requests: &[WriteRequest],
    ) -> Vec<StoreSlot> {
        if self.storage.subscribers().any() {
            let keys: Vec<ObjectKey> = requests.iter().map(|r| r.key.clone()).collect();
            self.publish(&StorageEvent::WriteReserving {
                ctx: self.ctx,
                object_group,
                keys: &keys,
            });
        }
        let slots = self.storage.reserve_for_store(requests);
        for (r, slot) in requests.iter().zip(&slots) {
            if let StoreSlot::Refused(error) = slot {
                self.publish(&StorageEvent::WriteRefused { ctx: self.ctx, key: &r.key, error });
            }
        }
        slots
    }

    /// Commits `writes` ([`StorageManager::commit`]) and announces each result.
    pub fn commit(&self, writes: Vec<WriteReservation>) -> Vec<Result<(), L1Error>> {
        let heard = self.storage.subscribers().any();
        let keys: Vec<ObjectKey> =
            if heard { writes.iter().map(|w| w.key().clone()).collect() } else { Vec::new() };
        let results = self.storage.commit(writes);
        if heard {
            self.publish(&StorageEvent::Committed {
                ctx: self.ctx,
                keys: &keys,
                results: &results,
            });
        }
        results
    }

    /// The leases a retrieve of `keys` copies from ([`StorageManager::retrieve_leases`]),
    /// announced.
    pub fn retrieve_leases(
        &self,
        spent: Vec<Option<ReadLease>>,
        keys: &[ObjectKey],
    ) -> Vec<Result<ReadLease, L1Error>> {
        let leases = self.storage.retrieve_leases(spent, keys);
        self.publish(&StorageEvent::ReadLeased { ctx: self.ctx, keys });
        leases
    }

    /// Announces that the request's store ended with chunks `committed` of the range stored.
    pub fn store_finished(&self, committed: &[usize], bytes: u64, copy_time: Option<Duration>) {
        self.publish(&StorageEvent::StoreFinished { ctx: self.ctx, committed, bytes, copy_time });
    }
}
