//! Lookups through both tiers, and the leases a retrieve spends.
//!
//! [`crate::StorageManager::lookup`] read-locks the longest prefix L1 holds on every shard
//! asked for; when that is short of the prompt and L2 is attached, it starts a prefetch of the
//! rest. The answer is one value, [`Lookup`]: `Ready` (the hit prefix, locked) or `Pending`
//! (the L1 part, locked, plus the prefetch's handle). [`Lookup::settle`] joins a finished
//! prefetch's leases to the L1 ones, once. A retrieve then *spends* those leases
//! ([`LookupLeases::take_one`] and [`crate::StorageManager::retrieve_leases`]) instead of
//! locking every chunk a second time.

use std::ops::Range;

use lmcache_core::ObjectKey;
use lmcache_l1::ReadLease;

use crate::prefetch::{PrefetchHandle, PrefetchWaiter};

/// What to look up: the keys of chunks `0..chunks` of every shard asked for.
#[derive(Debug, Clone)]
pub struct LookupRequest {
    /// Per shard asked for: its worker id and the keys of its chunks (the same count each).
    pub shards: Vec<(u32, Vec<ObjectKey>)>,
    /// Shards the model has (leases are indexed by worker id `0..world_size`).
    pub world_size: u32,
    /// Read locks per served object (one per engine reader).
    pub readers: u32,
}

impl LookupRequest {
    /// Chunks asked for per shard.
    pub fn chunks(&self) -> usize {
        self.shards.first().map_or(0, |(_, k)| k.len())
    }
}

/// One shard's worker id and the keys of its chunks.
pub type ShardKeys = (u32, Vec<ObjectKey>);

/// What to look up for a model stored as several object groups: per group, its window in
/// chunks (`None`: full attention, every chunk) and every shard's keys (group 0 first; every
/// group lists the same shards, in the same order, with the same chunk count).
#[derive(Debug, Clone)]
pub struct GroupLookupRequest {
    /// Per object group: its window, and each shard's worker id and keys.
    pub groups: Vec<(Option<usize>, Vec<ShardKeys>)>,
    /// Shards the model has.
    pub world_size: u32,
    /// Read locks per served object (one per engine reader).
    pub readers: u32,
}

/// The read leases a lookup holds: per worker id, per chunk of the hit prefix, what is left of
/// the `readers` locks taken (`None` once spent).
#[derive(Debug, Default)]
pub struct LookupLeases {
    shards: Vec<Vec<Option<ReadLease>>>,
    /// Locks on the other object groups' objects a hybrid model's hit needs: held while the
    /// lookup lives, so its retrieve finds them (it takes locks of its own on them).
    pinned: Vec<ReadLease>,
}

impl LookupLeases {
    fn new(world_size: u32) -> Self {
        Self { shards: (0..world_size).map(|_| Vec::new()).collect(), pinned: Vec::new() }
    }

    /// The leases of the prefix every shard holds (each shard's `per_shard` leases cut to the
    /// shortest), with that prefix's length.
    pub fn of_prefix(world_size: u32, per_shard: Vec<(u32, Vec<ReadLease>)>) -> (Self, usize) {
        Self::common_prefix(world_size, per_shard)
    }

    /// Holds `leases` for as long as the lookup lives.
    pub fn pin(&mut self, leases: impl IntoIterator<Item = ReadLease>) {
        self.pinned.extend(leases);
    }

    /// Locks held on other object groups' objects.
    pub fn pinned(&self) -> usize {
        self.pinned.len()
    }

    fn extend(&mut self, shard: u32, leases: impl IntoIterator<Item = ReadLease>) {
        if let Some(s) = self.shards.get_mut(shard as usize) {
            s.extend(leases.into_iter().map(Some));
        }
    }

    /// Takes one lock of shard `shard` on each chunk of `range` (what a retrieve of those
    /// chunks spends); `None` where the lookup holds none.
    pub fn take_one(&mut self, shard: usize, range: Range<usize>) -> Vec<Option<ReadLease>> {
        let mut out: Vec<Option<ReadLease>> = (0..range.len()).map(|_| None).collect();
        let Some(chunks) = self.shards.get_mut(shard) else { return out };
        for (slot, o) in chunks.iter_mut().skip(range.start).take(range.len()).zip(&mut out) {
            *o = match slot {
                Some(lease) if lease.count() > 1 => lease.split(1),
                _ => slot.take(),
            };
        }
        out
    }

    /// Releases every lock on chunks `range`, all shards.
    pub fn release_all(&mut self, range: Range<usize>) {
        for chunks in &mut self.shards {
            for slot in chunks.iter_mut().skip(range.start).take(range.len()) {
                *slot = None;
            }
        }
    }

    /// Locks held on shard `shard` (chunks whose lease is not spent).
    pub fn held(&self, shard: usize) -> usize {
        self.shards.get(shard).map_or(0, |s| s.iter().filter(|l| l.is_some()).count())
    }
}

/// A lookup: its hit prefix locked, or its L1 part locked while L2 prefetches the rest.
#[derive(Debug)]
pub enum Lookup {
    /// Complete: `hits` chunks are servable on every shard asked for, and locked.
    Ready {
        /// The locks.
        leases: LookupLeases,
        /// Chunks servable on every shard.
        hits: usize,
    },
    /// L1 served `l1_hit` chunks; a prefetch of the rest runs. Dropping it abandons the
    /// prefetch: its leases are released when it ends.
    Pending(PendingLookup),
}

/// The pending half of [`Lookup`].
#[derive(Debug)]
pub struct PendingLookup {
    leases: LookupLeases,
    handle: PrefetchHandle,
    l1_hit: usize,
    shards: Vec<u32>,
}

/// What a prefetch added to a lookup, reported once by [`Lookup::settle`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    /// Chunks servable in all (L1 then L2).
    pub hits: usize,
    /// Of those, chunks L2 added.
    pub l2_hits: usize,
    /// Objects loaded from L2.
    pub loaded_keys: usize,
    /// What went wrong in the prefetch, if anything did (a timeout, an adapter's error, a
    /// refused blob, a peer that did not answer).
    pub trouble: Option<crate::prefetch::PrefetchTrouble>,
}

impl LookupLeases {
    /// The leases of the prefix every shard holds: each shard's `per_shard` leases cut to the
    /// shortest. Returns them with that prefix's length.
    pub(crate) fn common_prefix(
        world_size: u32,
        per_shard: Vec<(u32, Vec<ReadLease>)>,
    ) -> (Self, usize) {
        let hit = per_shard.iter().map(|(_, l)| l.len()).min().unwrap_or(0);
        let mut leases = Self::new(world_size);
        for (w, mut l) in per_shard {
            l.truncate(hit);
            leases.extend(w, l);
        }
        (leases, hit)
    }
}

impl Lookup {
    /// A lookup L1 served `l1_hit` chunks of, waiting for `handle` to load the rest of
    /// `shards` (the worker ids the prefetch's leases belong to, in its order).
    pub(crate) fn pending(
        leases: LookupLeases,
        l1_hit: usize,
        handle: PrefetchHandle,
        shards: Vec<u32>,
    ) -> Self {
        Self::Pending(PendingLookup { leases, handle, l1_hit, shards })
    }

    /// Chunks L1 served (all of the hits, once ready, for a lookup that needed no prefetch).
    pub fn l1_hit(&self) -> usize {
        match self {
            Self::Ready { hits, .. } => *hits,
            Self::Pending(p) => p.l1_hit,
        }
    }

    /// The hit count; `None` while the prefetch runs.
    pub fn hits(&self) -> Option<usize> {
        match self {
            Self::Ready { hits, .. } => Some(*hits),
            Self::Pending(_) => None,
        }
    }

    /// Whether a prefetch is still to be settled.
    pub fn is_pending(&self) -> bool {
        matches!(self, Self::Pending(_))
    }

    /// A waiter on the prefetch, while one runs.
    pub fn waiter(&self) -> Option<PrefetchWaiter> {
        match self {
            Self::Pending(p) => Some(p.handle.waiter()),
            Self::Ready { .. } => None,
        }
    }

    /// If the prefetch has ended, joins its leases to the L1 ones and becomes `Ready`;
    /// returns what it added, exactly once.
    pub fn settle(&mut self) -> Option<Settled> {
        let Self::Pending(p) = self else { return None };
        let out = p.handle.poll()?;
        let hits = p.l1_hit + out.hits;
        let mut leases = std::mem::take(&mut p.leases);
        for (&w, l) in p.shards.iter().zip(out.leases) {
            leases.extend(w, l);
        }
        *self = Self::Ready { leases, hits };
        Some(Settled {
            hits,
            l2_hits: out.hits,
            loaded_keys: out.loaded_keys,
            trouble: out.trouble,
        })
    }

    /// The locks held so far (the L1 part while pending).
    pub fn leases_mut(&mut self) -> &mut LookupLeases {
        match self {
            Self::Ready { leases, .. } => leases,
            Self::Pending(p) => &mut p.leases,
        }
    }
}
