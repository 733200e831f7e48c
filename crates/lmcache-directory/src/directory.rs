//! The key table and the events that change it.

use std::collections::HashMap;
use std::sync::Arc;

use crate::DirectoryError;
use crate::ids::{DirKey, InstanceId, Interner, Namespace, NsId, Site, SiteId, Tier};
use crate::slots::Slots;
use crate::tokens::{Bindings, TokenBinding};
use lmcache_blend::{BlendConfig, BlendIndex, BlendMatch, BlendNs, BlendStats};

/// Limits.
#[derive(Debug, Clone)]
pub struct DirectoryConfig {
    /// Chunk hashes whose tokens are kept (each costs its tokens: 1 KiB for 256 tokens).
    pub max_token_bindings: usize,
    /// Index chunk contents for fragment (CacheBlend) lookups; off when `None`.
    pub blend: Option<BlendConfig>,
}

impl Default for DirectoryConfig {
    fn default() -> Self {
        Self { max_token_bindings: 262_144, blend: None }
    }
}

/// What a batch of events does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// The keys were written at the site (new placement, or its size replaced).
    Store,
    /// The keys left the site (deleted or evicted).
    Delete,
    /// The keys were used (recency and a count; no placement change).
    Access,
}

/// One key of an event batch.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    /// The key.
    pub key: DirKey,
    /// Bytes stored (store only).
    pub size: u64,
    /// The chunk's tokens when the reporter had them (store only; may be empty).
    pub tokens: &'a [u32],
    /// Position of the chunk's first token; -1 when unknown.
    pub token_offset: i64,
}

/// 16 bytes, 4-aligned: the site, who reported it at which incarnation (an interned
/// [`Epoch`]), bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Placement {
    pub(crate) site: SiteId,
    pub(crate) epoch: u32,
    size: [u32; 2],
}

impl Placement {
    pub(crate) fn new(site: SiteId, epoch: u32, size: u64) -> Self {
        Self { site, epoch, size: [size as u32, (size >> 32) as u32] }
    }

    pub(crate) fn site(&self) -> SiteId {
        self.site
    }

    /// Bytes.
    pub(crate) fn size(&self) -> u64 {
        u64::from(self.size[0]) | u64::from(self.size[1]) << 32
    }
}

/// An (instance, incarnation) pair, interned: placements name their reporter through it.
pub(crate) type Epoch = (InstanceId, u64);

fn seconds(ts: f64) -> u32 {
    // Wall-clock seconds fit u32 until 2106; NaN and negatives become 0.
    if ts.is_finite() && ts > 0.0 { ts.min(f64::from(u32::MAX)) as u32 } else { 0 }
}

/// Placements and bytes of one site.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SiteStats {
    /// Placements.
    pub count: u64,
    /// Bytes the placements reported.
    pub bytes: u64,
}

/// A placement as answers show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementView {
    /// The instance that reported it last (the owner, for a private site).
    pub instance: Arc<str>,
    /// Its incarnation at that report.
    pub incarnation: u64,
    /// Tier.
    pub tier: Tier,
    /// Backend.
    pub backend: Arc<str>,
    /// Bytes.
    pub size: u64,
    /// Whether the site is a shared pool.
    pub shared: bool,
}

/// Which placements a listing shows.
#[derive(Debug, Clone, Default)]
pub struct KeyFilter {
    /// Only this tier.
    pub tier: Option<Tier>,
    /// Only placements this instance reported.
    pub instance: Option<String>,
    /// Only this backend.
    pub backend: Option<String>,
}

/// Totals, kept as events apply (O(1) to read).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DirectoryStats {
    /// Keys with a placement.
    pub keys: u64,
    /// Placements in L1 and L2.
    pub l1: SiteStats,
    /// Placements in L2.
    pub l2: SiteStats,
    /// Chunk hashes whose tokens are kept.
    pub token_bindings: u64,
    /// Chunk hashes whose tokens were not kept (over `max_token_bindings`).
    pub token_bindings_dropped: u64,
}

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A token binding as the checkpoint saves it: chunk hash, offset, tokens, holders.
pub(crate) type SavedBinding = ([u8; 32], i64, Vec<u32>, Vec<NsId>);

/// The interned tables, in id order, for encoding.
pub(crate) struct Parts<'a> {
    pub(crate) namespaces: Vec<&'a Namespace>,
    pub(crate) instances: Vec<&'a Arc<str>>,
    pub(crate) epochs: Vec<Epoch>,
    pub(crate) sites: Vec<&'a Site>,
    pub(crate) mounts: &'a [Vec<InstanceId>],
}

/// The directory. Not thread-safe by itself: the coordinator holds it under one lock.
#[derive(Debug)]
pub struct Directory {
    /// The keys, in store order (see `slots`); its table is seeded per directory, the seed
    /// kept in the checkpoint image.
    keys: Slots,
    seed: u64,
    namespaces: Interner<Namespace>,
    instances: Interner<Arc<str>>,
    epochs: Interner<Epoch>,
    sites: Interner<Site>,
    /// Per site: placements and bytes.
    site_stats: Vec<SiteStats>,
    /// Per shared site: the instances that mount it (reported to it), sorted.
    mounts: Vec<Vec<InstanceId>>,
    /// Per site: its owner and tier when private (the routing scan's hot lookup).
    site_owners: Vec<Option<(InstanceId, Tier)>>,
    /// Per namespace: bytes in L1 and L2.
    ns_bytes: Vec<[u64; 2]>,
    bindings: Bindings,
    /// The fingerprint index over the bindings, when enabled.
    blend: Option<BlendIndex>,
    /// Per namespace: its blend namespace (model, salt, world size), interned.
    blend_ns: Vec<BlendNs>,
    blend_names: Interner<(Arc<str>, Arc<str>, u32)>,
    stats: DirectoryStats,
    /// Image builds started (the latest one resumes slot reuse when it finishes).
    pub(crate) builds: u64,
}

impl Directory {
    /// An empty directory.
    pub fn new(config: DirectoryConfig) -> Self {
        use std::hash::BuildHasher as _;
        let seed = foldhash::fast::RandomState::default().hash_one(0x6c6d_6361_6368_6521u64);
        Self::with_seed(config, seed)
    }

    pub(crate) fn with_seed(config: DirectoryConfig, seed: u64) -> Self {
        Self {
            keys: Slots::new(seed),
            seed,
            namespaces: Interner::new("namespace"),
            instances: Interner::new("instance"),
            epochs: Interner::new("epoch"),
            sites: Interner::new("site"),
            site_stats: Vec::new(),
            mounts: Vec::new(),
            site_owners: Vec::new(),
            ns_bytes: Vec::new(),
            bindings: Bindings::new(config.max_token_bindings),
            blend: config.blend.map(BlendIndex::new),
            blend_ns: Vec::new(),
            blend_names: Interner::new("blend namespace"),
            stats: DirectoryStats::default(),
            builds: 0,
        }
    }

    /// The id of `ns`, interning it.
    pub fn namespace(&mut self, ns: &Namespace) -> Result<NsId, DirectoryError> {
        let id = self.namespaces.intern(ns)?;
        if self.ns_bytes.len() <= id as usize {
            self.ns_bytes.resize(id as usize + 1, [0; 2]);
            let b = self.blend_names.intern(&(
                ns.model.clone(),
                ns.cache_salt.clone(),
                ns.world_size(),
            ))?;
            self.blend_ns.resize(id as usize + 1, b);
        }
        Ok(NsId(id))
    }

    /// The id of `ns` if any event named it (a key of an unknown namespace has no placement).
    pub fn find_namespace(&self, ns: &Namespace) -> Option<NsId> {
        self.namespaces.find(ns).map(NsId)
    }

    /// Every interned namespace equal to `ns` but for its object group (with `ns` itself).
    pub fn namespaces_like(&self, ns: &Namespace) -> Vec<(Namespace, NsId)> {
        (0..self.namespaces.len() as u32)
            .filter_map(|i| self.namespaces.get(i).ok().map(|n| (n, NsId(i))))
            .filter(|(n, _)| {
                n.model == ns.model && n.kv_rank == ns.kv_rank && n.cache_salt == ns.cache_salt
            })
            .map(|(n, id)| (n.clone(), id))
            .collect()
    }

    /// Whether `key` has a placement.
    pub fn has_key(&self, key: &DirKey) -> bool {
        self.keys.find(key).is_some()
    }

    /// The namespace of `id`.
    pub fn namespace_of(&self, id: NsId) -> Result<&Namespace, DirectoryError> {
        self.namespaces.get(id.0)
    }

    /// The id of instance `name`, interning it.
    pub fn instance(&mut self, name: &str) -> Result<InstanceId, DirectoryError> {
        self.instances.intern(&Arc::from(name)).map(InstanceId)
    }

    /// The id of instance `name` if known.
    pub fn find_instance(&self, name: &str) -> Option<InstanceId> {
        self.instances.find(&Arc::from(name)).map(InstanceId)
    }

    /// The name of instance `id`.
    pub fn instance_name(&self, id: InstanceId) -> Result<&Arc<str>, DirectoryError> {
        self.instances.get(id.0)
    }

    /// Instances interned so far.
    pub fn instance_count(&self) -> usize {
        self.instances.len()
    }

    /// The site for a placement: `reporter`'s own, or the shared pool of (tier, backend).
    /// A shared site remembers `reporter` as one of its mounts.
    pub fn site(
        &mut self,
        reporter: InstanceId,
        tier: Tier,
        backend: &str,
        shared: bool,
    ) -> Result<SiteId, DirectoryError> {
        self.instances.get(reporter.0)?;
        let site = Site { tier, backend: Arc::from(backend), owner: (!shared).then_some(reporter) };
        let id = self.sites.intern(&site)?;
        if self.site_stats.len() <= id as usize {
            self.site_stats.resize(id as usize + 1, SiteStats::default());
            self.mounts.resize(id as usize + 1, Vec::new());
            self.site_owners.resize(id as usize + 1, None);
            self.site_owners[id as usize] = (!shared).then_some((reporter, tier));
        }
        if shared {
            let m = &mut self.mounts[id as usize];
            if let Err(at) = m.binary_search(&reporter) {
                m.insert(at, reporter);
            }
        }
        Ok(SiteId(id))
    }

    /// The site of `id`.
    pub fn site_of(&self, id: SiteId) -> Result<&Site, DirectoryError> {
        self.sites.get(id.0)
    }

    /// Placements and bytes at `id`.
    pub fn site_stats(&self, id: SiteId) -> SiteStats {
        self.site_stats.get(id.0 as usize).copied().unwrap_or_default()
    }

    /// Every site with its id, in id order.
    pub fn sites(&self) -> impl Iterator<Item = (SiteId, &Site)> {
        (0..self.sites.len() as u32).filter_map(|i| self.sites.get(i).ok().map(|s| (SiteId(i), s)))
    }

    /// The instances mounting shared site `id` (empty for a private site).
    pub fn mounts(&self, id: SiteId) -> &[InstanceId] {
        self.mounts.get(id.0 as usize).map(Vec::as_slice).unwrap_or_default()
    }

    /// Applies one batch of events that `reporter` (at `incarnation`) reported at `site`
    /// (not even checked for [`EventKind::Access`]). Idempotent: a store replaces the
    /// placement of the same site, a delete of an absent placement does nothing.
    pub fn apply(
        &mut self,
        reporter: InstanceId,
        incarnation: u64,
        kind: EventKind,
        site: SiteId,
        ts: f64,
        entries: &[Entry<'_>],
    ) -> Result<(), DirectoryError> {
        self.instances.get(reporter.0)?;
        let tier = match kind {
            EventKind::Access => Tier::L1,
            _ => self.sites.get(site.0)?.tier,
        };
        for e in entries {
            self.namespaces.get(e.key.ns.0)?;
        }
        if kind == EventKind::Store && !self.keys.has_room(entries.len()) {
            return Err(DirectoryError::Exhausted("keys"));
        }
        match kind {
            EventKind::Store => {
                let epoch = self.epochs.intern(&(reporter, incarnation))?;
                let ts = seconds(ts);
                let (mut count, mut bytes) = (0i64, 0i64);
                let hashes = self.keys.table_hashes(entries.iter().map(|e| &e.key));
                let mut prev = None;
                for (j, (e, &h)) in entries.iter().zip(&hashes).enumerate() {
                    if let Some(&ahead) = hashes.get(j + crate::slots::PREFETCH_AHEAD) {
                        self.keys.prefetch(ahead);
                    }
                    let (slot, c, b) = self.store(prev, h, epoch, site, ts, e);
                    prev = Some(slot);
                    count += c;
                    bytes += b;
                    if let Some(nb) = self.ns_bytes.get_mut(e.key.ns.0 as usize) {
                        nb[tier as usize] = nb[tier as usize].saturating_add_signed(b);
                    }
                }
                self.account(site, tier, count, bytes);
            }
            EventKind::Delete => {
                for e in entries {
                    self.delete(site, tier, &e.key);
                }
            }
            EventKind::Access => self.access(ts, entries.iter().map(|e| e.key)),
        }
        Ok(())
    }

    fn account(&mut self, site: SiteId, tier: Tier, count: i64, bytes: i64) {
        let s = &mut self.site_stats[site.0 as usize];
        s.count = s.count.saturating_add_signed(count);
        s.bytes = s.bytes.saturating_add_signed(bytes);
        let t = match tier {
            Tier::L1 => &mut self.stats.l1,
            Tier::L2 => &mut self.stats.l2,
        };
        t.count = t.count.saturating_add_signed(count);
        t.bytes = t.bytes.saturating_add_signed(bytes);
    }

    /// Upserts one placement (`h`: its key's table hash), trying the slot after `prev` first;
    /// returns its slot and the (placements, bytes) it added.
    fn store(
        &mut self,
        prev: Option<u32>,
        h: u64,
        epoch: u32,
        site: SiteId,
        ts: u32,
        e: &Entry<'_>,
    ) -> (u32, i64, i64) {
        let new = Placement::new(site, epoch, e.size);
        let (i, is_new, replaced) = self.keys.store(prev, &e.key, h, new, &self.site_owners);
        if is_new {
            self.stats.keys += 1;
        }
        let record = self.keys.slot_mut(i);
        record.last_access = record.last_access.max(ts);
        let delta = match replaced {
            Some(old) => (0, e.size as i64 - old as i64),
            None => (1, e.size as i64),
        };
        // Token bindings exist only for chunks some store carried tokens for; every key of
        // the chunk stored since holds a reference.
        let bound = record.bound();
        if !bound && (!e.tokens.is_empty() || self.bindings.holds(&e.key.hash)) {
            let now = self.bindings.add_ref(&e.key.hash, e.tokens, e.token_offset);
            self.keys.slot_mut(i).set_bound(now);
            if now {
                self.blend_claim(&e.key);
            }
        } else if bound && !e.tokens.is_empty() {
            self.bindings.set(&e.key.hash, e.tokens, e.token_offset);
            if let (Some(blend), Some(b)) = (self.blend.as_mut(), self.bindings.get(&e.key.hash)) {
                blend.sync(&e.key.hash, &b.tokens, b.offset, false);
            }
        }
        (i, delta.0, delta.1)
    }

    fn delete(&mut self, site: SiteId, tier: Tier, key: &DirKey) {
        let Some(i) = self.keys.find(key) else { return };
        let Some(removed) = self.keys.remove(i, site, &self.site_owners) else { return };
        let gone = removed.placement;
        if let Some(bound) = removed.key_gone {
            self.stats.keys -= 1;
            if bound {
                self.bindings.release(&key.hash);
                self.blend_release(key);
            }
        }
        self.account(site, tier, -1, -(gone.size() as i64));
        if let Some(nb) = self.ns_bytes.get_mut(key.ns.0 as usize) {
            nb[tier as usize] = nb[tier as usize].saturating_sub(gone.size());
        }
    }

    /// Drops every L1 placement `instance` owns (it restarted, or stopped heartbeating) and
    /// returns how many. L2 placements stay: they outlive the process.
    pub fn fence_l1(&mut self, instance: InstanceId) -> u64 {
        self.sweep_l1(instance, |_| false)
    }

    /// Drops the L1 placements `instance` owns of keys `keep` refuses (a resync from a
    /// snapshot keeps what the snapshot and newer events name); returns how many went.
    pub fn sweep_l1(&mut self, instance: InstanceId, keep: impl Fn(&DirKey) -> bool) -> u64 {
        self.sweep_owned(instance, Tier::L1, |k, _| keep(k))
    }

    /// Drops the placements at `tier` sites `instance` owns (its private backends, never a
    /// shared pool) that `keep` refuses, per key and site; returns how many went.
    pub fn sweep_owned(
        &mut self,
        instance: InstanceId,
        tier: Tier,
        keep: impl Fn(&DirKey, SiteId) -> bool,
    ) -> u64 {
        let doomed: Vec<bool> = (0..self.sites.len() as u32)
            .map(|i| {
                self.sites.get(i).is_ok_and(|s| s.tier == tier && s.owner == Some(instance))
                    && self.site_stats[i as usize].count > 0
            })
            .collect();
        if !doomed.contains(&true) {
            return 0;
        }
        let mut removed: Vec<(SiteId, NsId, u64)> = Vec::new();
        let mut emptied = 0u64;
        let mut released: Vec<DirKey> = Vec::new();
        let live: Vec<u32> = self.keys.iter().collect();
        for i in live {
            let key = self.keys.key(i);
            if !self.keys.placements(i).any(|p| doomed[p.site.0 as usize]) {
                continue;
            }
            let (gone, key_gone) = self.keys.retain(
                i,
                |p| !doomed[p.site.0 as usize] || keep(&key, p.site),
                &self.site_owners,
            );
            removed.extend(gone.iter().map(|p| (p.site, key.ns, p.size())));
            if let Some(bound) = key_gone {
                emptied += 1;
                if bound {
                    released.push(key);
                }
            }
        }
        for (site, ns, size) in &removed {
            self.account(*site, tier, -1, -(*size as i64));
            if let Some(nb) = self.ns_bytes.get_mut(ns.0 as usize) {
                nb[tier as usize] = nb[tier as usize].saturating_sub(*size);
            }
        }
        self.stats.keys -= emptied;
        for k in &released {
            self.bindings.release(&k.hash);
            self.blend_release(k);
        }
        removed.len() as u64
    }

    /// The placements of `key`, sorted by instance, tier and backend (empty when unknown).
    pub fn placements(&self, key: &DirKey) -> Vec<PlacementView> {
        let Some(i) = self.keys.find(key) else { return Vec::new() };
        self.views(self.keys.placements(i))
    }

    fn views(&self, ps: impl Iterator<Item = Placement>) -> Vec<PlacementView> {
        let mut out: Vec<PlacementView> = ps
            .filter_map(|p| {
                let site = self.sites.get(p.site.0).ok()?;
                let (reporter, incarnation) = *self.epochs.get(p.epoch).ok()?;
                Some(PlacementView {
                    instance: self.instances.get(reporter.0).ok()?.clone(),
                    incarnation,
                    tier: site.tier,
                    backend: site.backend.clone(),
                    size: p.size(),
                    shared: site.owner.is_none(),
                })
            })
            .collect();
        out.sort_by(|a, b| {
            (&a.instance, a.tier, &a.backend).cmp(&(&b.instance, b.tier, &b.backend))
        });
        out
    }

    /// How often `key` was accessed (0 when unknown).
    pub fn access_count(&self, key: &DirKey) -> u64 {
        self.keys.find(key).map_or(0, |i| u64::from(self.keys.slot(i).access_count()))
    }

    /// The tokens known for chunk `hash`.
    pub fn tokens(&self, hash: &[u8; 32]) -> Option<&TokenBinding> {
        self.bindings.get(hash).filter(|b| !b.tokens.is_empty())
    }

    /// A page of keys with at least one placement matching `filter`, in table order (stable
    /// while nothing changes), and the total number of such keys.
    pub fn list(
        &self,
        filter: &KeyFilter,
        offset: usize,
        limit: usize,
    ) -> (u64, Vec<(DirKey, Vec<PlacementView>)>) {
        let instance = match &filter.instance {
            Some(name) => match self.find_instance(name) {
                Some(i) => Some(i),
                None => return (0, Vec::new()),
            },
            None => None,
        };
        let site_ok: Vec<bool> = (0..self.sites.len() as u32)
            .map(|i| {
                self.sites.get(i).is_ok_and(|s| {
                    filter.tier.is_none_or(|t| t == s.tier)
                        && filter.backend.as_deref().is_none_or(|b| *s.backend == *b)
                })
            })
            .collect();
        let reporter_of = |p: &Placement| self.epochs.get(p.epoch).ok().map(|e| e.0);
        let keep = |p: &Placement| {
            site_ok[p.site.0 as usize] && instance.is_none_or(|i| reporter_of(p) == Some(i))
        };
        let mut total = 0u64;
        let mut page = Vec::new();
        for i in self.keys.iter() {
            let placements = self.keys.placements(i);
            if !placements.clone().any(|p| keep(&p)) {
                continue;
            }
            if total >= offset as u64 && page.len() < limit {
                page.push((self.keys.key(i), self.views(placements.filter(|p| keep(p)))));
            }
            total += 1;
        }
        (total, page)
    }

    /// Totals.
    pub fn stats(&self) -> DirectoryStats {
        DirectoryStats {
            token_bindings: self.bindings.len() as u64,
            token_bindings_dropped: self.bindings.dropped,
            ..self.stats.clone()
        }
    }

    /// Keys held per instance in its own L1 sites (placements, one per backend).
    pub fn l1_keys_by_instance(&self) -> Vec<(Arc<str>, u64)> {
        let mut out: FastMap<InstanceId, u64> = FastMap::default();
        for (id, site) in self.sites() {
            if let (Tier::L1, Some(owner)) = (site.tier, site.owner) {
                *out.entry(owner).or_default() += self.site_stats(id).count;
            }
        }
        let mut v: Vec<(Arc<str>, u64)> = out
            .into_iter()
            .filter_map(|(i, n)| Some((self.instances.get(i.0).ok()?.clone(), n)))
            .collect();
        v.sort();
        v
    }

    /// Bytes per cache salt in `tier`.
    pub fn bytes_by_salt(&self, tier: Tier) -> Vec<(Arc<str>, u64)> {
        let mut out: FastMap<Arc<str>, u64> = FastMap::default();
        for (i, b) in self.ns_bytes.iter().enumerate() {
            if let Ok(ns) = self.namespaces.get(i as u32) {
                if b[tier as usize] > 0 {
                    *out.entry(ns.cache_salt.clone()).or_default() += b[tier as usize];
                }
            }
        }
        let mut v: Vec<_> = out.into_iter().collect();
        v.sort();
        v
    }

    /// The slot of `key`, trying the one after `prev` first, for the routing scan.
    pub(crate) fn slot_after(&self, prev: Option<u32>, key: &DirKey) -> Option<u32> {
        self.keys.find_after(prev, key)
    }

    /// The placements in slot `i`, for the routing scan.
    pub(crate) fn placements_at(&self, i: u32) -> crate::slots::Placements<'_> {
        self.keys.placements(i)
    }

    /// What slot `i` names for its placements (a head or a shared list): slots naming the
    /// same hold the same placements.
    pub(crate) fn held_at(&self, i: u32) -> Option<u32> {
        self.keys.held(i)
    }

    /// Slot `i`'s spill list with its owner bitsets, when it has several placements.
    pub(crate) fn spill_at(&self, i: u32) -> Option<&crate::slots::Spill> {
        self.keys.spill(i)
    }

    /// A private site's owner and tier (None for a shared pool), from a dense side table.
    pub(crate) fn site_owner(&self, id: SiteId) -> Option<(InstanceId, Tier)> {
        self.site_owners.get(id.0 as usize).copied().flatten()
    }

    /// Every key of cache salt `salt` with an L2 placement, with its last access (seconds) and
    /// the L2 sites holding it: eviction candidates for a salt over its fleet quota.
    pub fn l2_keys_of_salt(&self, salt: &str) -> Vec<(DirKey, u32, Vec<SiteId>)> {
        let ns_ok: Vec<bool> = (0..self.namespaces.len() as u32)
            .map(|i| self.namespaces.get(i).is_ok_and(|n| &*n.cache_salt == salt))
            .collect();
        let l2: Vec<bool> = (0..self.sites.len() as u32)
            .map(|i| self.sites.get(i).is_ok_and(|s| s.tier == Tier::L2))
            .collect();
        self.keys
            .iter()
            .filter(|&i| ns_ok.get(self.keys.ns_of(i).0 as usize).copied().unwrap_or(false))
            .filter_map(|i| {
                let sites: Vec<SiteId> = self
                    .keys
                    .placements(i)
                    .filter(|p| l2.get(p.site.0 as usize).copied().unwrap_or(false))
                    .map(|p| p.site)
                    .collect();
                (!sites.is_empty())
                    .then(|| (self.keys.key(i), self.keys.slot(i).last_access, sites))
            })
            .collect()
    }

    /// An order-independent digest of every placement, by names (never ids, which differ
    /// between replicas): the XOR of a 128-bit BLAKE3 of (chunk hash, namespace, tier,
    /// backend, owner, bytes) per placement, with the count; in total and per owner
    /// (`(shared)` for pools). Two directories with the same placements have equal digests.
    pub fn digest(&self) -> ((u128, u64), std::collections::BTreeMap<String, (u128, u64)>) {
        let mut total = (0u128, 0u64);
        let mut by: std::collections::BTreeMap<String, (u128, u64)> = Default::default();
        let owner_names: Vec<String> = (0..self.sites.len() as u32)
            .map(|i| match self.sites.get(i).ok().and_then(|s| s.owner) {
                Some(o) => self.instances.get(o.0).map(|n| n.to_string()).unwrap_or_default(),
                None => "(shared)".to_string(),
            })
            .collect();
        for i in self.keys.iter() {
            let k = self.keys.key(i);
            let Ok(ns) = self.namespaces.get(k.ns.0) else { continue };
            for p in self.keys.placements(i) {
                let Ok(site) = self.sites.get(p.site.0) else { continue };
                let owner = owner_names.get(p.site.0 as usize).map_or("", String::as_str);
                let mut h = blake3::Hasher::new();
                h.update(&k.hash);
                for part in [&*ns.model, &*ns.cache_salt, site.tier.as_str(), &*site.backend, owner]
                {
                    h.update(&(part.len() as u32).to_le_bytes());
                    h.update(part.as_bytes());
                }
                h.update(&ns.kv_rank.to_le_bytes());
                h.update(&ns.object_group.to_le_bytes());
                h.update(&p.size().to_le_bytes());
                let mut w = [0u8; 16];
                w.copy_from_slice(&h.finalize().as_bytes()[..16]);
                let d = u128::from_le_bytes(w);
                total = (total.0 ^ d, total.1 + 1);
                let e = by.entry(owner.to_string()).or_default();
                *e = (e.0 ^ d, e.1 + 1);
            }
        }
        (total, by)
    }

    /// Records a use of each of `keys` (recency and count; unknown keys are ignored).
    pub fn access(&mut self, ts: f64, keys: impl IntoIterator<Item = DirKey>) {
        let ts = seconds(ts);
        let mut prev = None;
        for k in keys {
            prev = self.keys.find_after(prev, &k);
            if let Some(i) = prev {
                let r = self.keys.slot_mut(i);
                r.count_access();
                r.last_access = r.last_access.max(ts);
            }
        }
    }

    // ---- persistence support (see persist.rs) -----------------------------------------------

    pub(crate) fn parts(&self) -> Parts<'_> {
        Parts {
            namespaces: (0..self.namespaces.len() as u32)
                .filter_map(|i| self.namespaces.get(i).ok())
                .collect(),
            instances: (0..self.instances.len() as u32)
                .filter_map(|i| self.instances.get(i).ok())
                .collect(),
            epochs: (0..self.epochs.len() as u32)
                .filter_map(|i| self.epochs.get(i).ok().copied())
                .collect(),
            sites: (0..self.sites.len() as u32).filter_map(|i| self.sites.get(i).ok()).collect(),
            mounts: &self.mounts,
        }
    }

    pub(crate) fn for_each_record(
        &self,
        mut f: impl FnMut(&DirKey, &[(SiteId, u32, u64)], u32, u32),
    ) {
        self.for_each_record_in(0, self.slot_count(), |k, p, ac, la, _| f(k, p, ac, la));
    }

    /// Slots in the arena, live or free (an image build visits those below this).
    pub(crate) fn slot_count(&self) -> u32 {
        self.keys.slot_count()
    }

    pub(crate) fn keys_pause_reuse(&mut self, pause: bool) {
        self.keys.pause_reuse(pause);
    }

    /// `for_each_record` over the live slots in `from..to`, with whether each key is bound.
    pub(crate) fn for_each_record_in(
        &self,
        from: u32,
        to: u32,
        mut f: impl FnMut(&DirKey, &[(SiteId, u32, u64)], u32, u32, bool),
    ) {
        let mut buf: Vec<(SiteId, u32, u64)> = Vec::new();
        for i in self.keys.iter_range(from, to) {
            let r = self.keys.slot(i);
            buf.clear();
            buf.extend(self.keys.placements(i).map(|p| (p.site, p.epoch, p.size())));
            f(&self.keys.key(i), &buf, r.access_count(), r.last_access, r.bound());
        }
    }

    /// The token bindings of `keys` that still exist, each with the namespaces of those of
    /// `keys` that hold it and are still bound.
    pub(crate) fn bindings_of(&self, keys: &[DirKey]) -> Vec<SavedBinding> {
        let mut holders: FastMap<[u8; 32], Vec<NsId>> = FastMap::default();
        for k in keys {
            holders.entry(k.hash).or_default().push(k.ns);
        }
        holders
            .into_iter()
            .filter_map(|(h, ns)| {
                let b = self.bindings.get(&h)?;
                Some((h, b.offset, b.tokens.to_vec(), ns))
            })
            .collect()
    }

    /// Every token binding with the namespaces of the keys holding it.
    pub(crate) fn bindings_list(&self) -> Vec<SavedBinding> {
        let bound: Vec<DirKey> = self
            .keys
            .iter()
            .filter(|&i| self.keys.slot(i).bound())
            .map(|i| self.keys.key(i))
            .collect();
        self.bindings_of(&bound)
    }

    pub(crate) fn namespace_count(&self) -> usize {
        self.namespaces.len()
    }

    pub(crate) fn epoch_count(&self) -> usize {
        self.epochs.len()
    }

    /// Installs decoded epochs and sites (ids in order) into an empty directory.
    pub(crate) fn restore_tables(
        &mut self,
        epochs: Vec<Epoch>,
        sites: Vec<(Site, Vec<InstanceId>)>,
    ) -> Result<(), DirectoryError> {
        for e in &epochs {
            let id = self.epochs.intern(e)?;
            if id as usize + 1 != self.epochs.len() {
                return Err(DirectoryError::Exhausted("distinct epochs"));
            }
        }
        for (site, mut mounts) in sites {
            let id = self.sites.intern(&site)?;
            if id as usize + 1 != self.sites.len() {
                return Err(DirectoryError::Exhausted("distinct sites"));
            }
            mounts.sort_unstable();
            mounts.dedup();
            self.site_stats.push(SiteStats::default());
            self.site_owners.push(site.owner.map(|o| (o, site.tier)));
            self.mounts.push(mounts);
        }
        Ok(())
    }

    pub(crate) fn reserve(&mut self, n: usize) {
        self.keys.reserve(n);
    }

    pub(crate) fn seed(&self) -> u64 {
        self.seed
    }

    /// Indexes the keys [`Directory::restore_record`] appended; false if a key came twice.
    pub(crate) fn index_restored(&mut self) -> bool {
        self.keys.index_restored()
    }

    /// Appends a decoded key (indexed by [`Directory::index_restored`]); false if it names a
    /// site twice or an unknown one.
    pub(crate) fn restore_record(
        &mut self,
        key: DirKey,
        placements: &[(SiteId, u32, u64)],
        access_count: u32,
        last_access: u32,
    ) -> bool {
        let mut list: smallvec::SmallVec<[Placement; 4]> = smallvec::SmallVec::new();
        for &(site, epoch, size) in placements {
            if list.iter().any(|p| p.site == site) || self.sites.get(site.0).is_err() {
                return false;
            }
            list.push(Placement::new(site, epoch, size));
        }
        if !self.keys.push_restored(&key, &list, access_count, last_access, &self.site_owners) {
            return false;
        }
        for &(site, _, size) in placements {
            let tier = match self.sites.get(site.0) {
                Ok(s) => s.tier,
                Err(_) => return false,
            };
            self.account(site, tier, 1, size as i64);
            if let Some(nb) = self.ns_bytes.get_mut(key.ns.0 as usize) {
                nb[tier as usize] = nb[tier as usize].saturating_add(size);
            }
        }
        self.stats.keys += 1;
        true
    }

    /// Installs a decoded token binding held by the keys of `hash` in `holders`; false if
    /// one of them is not a key of this directory or already holds one.
    pub(crate) fn restore_binding(
        &mut self,
        hash: &[u8; 32],
        tokens: &[u32],
        offset: i64,
        holders: &[NsId],
    ) -> bool {
        for ns in holders {
            match self.keys.find(&DirKey { hash: *hash, ns: *ns }) {
                Some(i) if !self.keys.slot(i).bound() => self.keys.slot_mut(i).set_bound(true),
                _ => return false,
            }
        }
        if !self.bindings.add_ref(hash, tokens, offset) {
            return false;
        }
        for _ in 1..holders.len() {
            self.bindings.add_ref(hash, &[], -1);
        }
        for ns in holders {
            self.blend_claim(&DirKey { hash: *hash, ns: *ns });
        }
        true
    }

    /// A newly bound key claims its chunk for its blend namespace.
    fn blend_claim(&mut self, key: &DirKey) {
        let (Some(blend), Some(b)) = (self.blend.as_mut(), self.bindings.get(&key.hash)) else {
            return;
        };
        if let Some(&ns) = self.blend_ns.get(key.ns.0 as usize) {
            blend.claim(&key.hash, ns, &b.tokens, b.offset);
        }
    }

    /// A bound key left: its blend namespace holds one key fewer of the chunk.
    fn blend_release(&mut self, key: &DirKey) {
        if let (Some(blend), Some(&ns)) =
            (self.blend.as_mut(), self.blend_ns.get(key.ns.0 as usize))
        {
            blend.release(&key.hash, ns);
        }
    }

    /// Chunks stored under (`model`, `cache_salt`, `world_size`) whose tokens occur in
    /// `query`, verified token-exactly, ascending by query position (empty when the index
    /// is off or the namespace holds nothing).
    pub fn blend_matches(
        &self,
        query: &[u32],
        model: &str,
        cache_salt: &str,
        world_size: u32,
    ) -> Vec<BlendMatch> {
        let Some(blend) = &self.blend else { return Vec::new() };
        let Some(ns) =
            self.blend_names.find(&(Arc::from(model), Arc::from(cache_salt), world_size))
        else {
            return Vec::new();
        };
        blend.matches(query, ns)
    }

    /// The fingerprint index's totals (zeros when it is off).
    pub fn blend_stats(&self) -> BlendStats {
        self.blend.as_ref().map(BlendIndex::stats).unwrap_or_default()
    }

    /// Whether fragment lookups are indexed.
    pub fn blend_enabled(&self) -> bool {
        self.blend.is_some()
    }

    /// Approximate bytes the key arena, its table and the placement lists use.
    pub fn table_bytes(&self) -> usize {
        self.keys.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(d: &mut Directory) -> NsId {
        d.namespace(&Namespace {
            model: "m".into(),
            kv_rank: 0x0100_0100,
            object_group: 0,
            cache_salt: "".into(),
        })
        .unwrap()
    }

    fn key(ns: NsId, b: u8) -> DirKey {
        DirKey { hash: [b; 32], ns }
    }

    fn entry(key: DirKey, size: u64) -> Entry<'static> {
        Entry { key, size, tokens: &[], token_offset: -1 }
    }

    #[test]
    fn store_replace_delete_keep_totals() {
        let mut d = Directory::new(DirectoryConfig::default());
        let n = ns(&mut d);
        let a = d.instance("a").unwrap();
        let l1 = d.site(a, Tier::L1, "dram", false).unwrap();
        d.apply(a, 1, EventKind::Store, l1, 1.0, &[entry(key(n, 1), 10), entry(key(n, 2), 20)])
            .unwrap();
        d.apply(a, 1, EventKind::Store, l1, 2.0, &[entry(key(n, 1), 15)]).unwrap();
        assert_eq!(d.stats().l1, SiteStats { count: 2, bytes: 35 });
        assert_eq!(d.stats().keys, 2);
        d.apply(a, 1, EventKind::Delete, l1, 3.0, &[entry(key(n, 1), 0), entry(key(n, 9), 0)])
            .unwrap();
        assert_eq!(d.stats().l1, SiteStats { count: 1, bytes: 20 });
        assert!(d.placements(&key(n, 1)).is_empty());
        assert_eq!(d.placements(&key(n, 2))[0].size, 20);
    }

    #[test]
    fn shared_placements_are_one_per_pool_and_fencing_keeps_l2() {
        let mut d = Directory::new(DirectoryConfig::default());
        let n = ns(&mut d);
        let a = d.instance("a").unwrap();
        let b = d.instance("b").unwrap();
        let s3a = d.site(a, Tier::L2, "s3", true).unwrap();
        let s3b = d.site(b, Tier::L2, "s3", true).unwrap();
        assert_eq!(s3a, s3b);
        assert_eq!(d.mounts(s3a), &[a, b]);
        let l1 = d.site(a, Tier::L1, "dram", false).unwrap();
        d.apply(a, 1, EventKind::Store, s3a, 0.0, &[entry(key(n, 1), 5)]).unwrap();
        d.apply(b, 1, EventKind::Store, s3b, 0.0, &[entry(key(n, 1), 5)]).unwrap();
        d.apply(a, 1, EventKind::Store, l1, 0.0, &[entry(key(n, 1), 5), entry(key(n, 2), 5)])
            .unwrap();
        let p = d.placements(&key(n, 1));
        assert_eq!(p.len(), 2);
        assert!(p.iter().any(|p| p.shared && &*p.instance == "b"), "latest reporter: {p:?}");
        assert_eq!(d.fence_l1(a), 2);
        assert_eq!(d.placements(&key(n, 1)).len(), 1);
        assert!(d.placements(&key(n, 2)).is_empty());
        assert_eq!(d.stats().keys, 1);
        assert_eq!(d.fence_l1(a), 0);
    }

    #[test]
    fn unknown_ids_are_refused_before_anything_changes() {
        let mut d = Directory::new(DirectoryConfig::default());
        let n = ns(&mut d);
        let a = d.instance("a").unwrap();
        let l1 = d.site(a, Tier::L1, "dram", false).unwrap();
        let bad = DirKey { hash: [1; 32], ns: NsId(7) };
        let err = d
            .apply(a, 1, EventKind::Store, l1, 0.0, &[entry(key(n, 1), 1), entry(bad, 1)])
            .unwrap_err();
        assert_eq!(err, DirectoryError::UnknownId { what: "namespace", id: 7 });
        assert_eq!(d.stats().keys, 0);
    }
}
