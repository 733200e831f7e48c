//! The key arena: every key the directory holds, in the order store batches first named them.
//!
//! A request's chunks arrive in one store batch, so they land in consecutive slots, and a lookup
//! of the same chunks walks the arena sequentially: it checks the slot after the previous hit
//! before it probes the table, one predictable read per chunk instead of one random probe
//! ([`Slots::find_after`]). The table ([`SegTable`]) holds slot numbers and 32-bit fingerprints,
//! keyed by the chunk hash; the 32-byte hashes sit in an array parallel to the 12-byte slot
//! records, so each costs its bytes once.
//!
//! A slot names its key's namespace and single placement through a *head*, interned and shared
//! by every slot with the same ones (a store batch's keys, as a rule); a key placed at several
//! sites (a prefix every server holds, a chunk in L1 and L2) keeps them all in a spill list the
//! slot points to instead, shared as heads are by every slot with the same placements (a
//! prefix's chunks, which its servers store batch by batch). A key with no placement has no
//! slot: the last removal frees it for the next new key.

use std::hash::BuildHasher as _;

use crate::directory::Placement;
use crate::ids::{DirKey, InstanceId, NsId, SiteId, Tier};
use crate::seg_table::SegTable;

/// How many keys ahead a store batch asks for table lines, and a walk of consecutive slots
/// for arena records.
pub(crate) const PREFETCH_AHEAD: usize = 8;

/// Puts `item` in a freed place of `items` (from `free`), or at the end; its number.
fn file_in<T>(items: &mut Vec<T>, free: &mut Vec<u32>, item: T) -> u32 {
    match free.pop() {
        Some(id) => {
            items[id as usize] = item;
            id
        }
        None => {
            items.push(item);
            (items.len() - 1) as u32
        }
    }
}

/// Per site: its owner and tier when private, `None` for a shared pool (the directory's table).
pub(crate) type SiteOwners = [Option<(InstanceId, Tier)>];

/// Instance bitsets, one bit per instance id.
pub(crate) type Bits = smallvec::SmallVec<[u64; 2]>;

fn set_bit(bits: &mut Bits, i: InstanceId) {
    let w = (i.index() / 64) as usize;
    if bits.len() <= w {
        bits.resize(w + 1, 0);
    }
    bits[w] |= 1 << (i.index() % 64);
}

/// The placements of keys held at several sites, with what the routing scan needs from them
/// precomputed: the owners of its private L1 sites and of all its private sites as bitsets,
/// and how many of its sites are shared pools (whose mounts the scan still reads). A
/// placement is its [`Heads`] number (4 bytes): the servers holding one prefix share their
/// heads with the rest of their store batches.
///
/// A list is shared by every slot with the same placements, as a head is: the chunks of a
/// prefix that many servers hold get each new placement in one store batch, so the batch's
/// first key makes the new list (a copy of the old one plus the placement) and the others move
/// onto it ([`Slots`]'s memo), instead of each key growing a list of its own. A list that
/// more than one slot names is never changed in place: a change is a new list for the slot
/// that changes.
#[derive(Debug, Default)]
pub(crate) struct Spill {
    /// The keys' namespace (a spilled slot names its list instead of a head).
    ns: u32,
    /// Head numbers, one reference each (however many slots name the list).
    list: Vec<u32>,
    /// Owners of the private L1 sites in `list`.
    pub(crate) l1: Bits,
    /// Owners of the private sites in `list`, any tier.
    pub(crate) any: Bits,
    /// Placements in `list` at shared pools.
    pub(crate) shared: u32,
    /// Slots naming the list; 0: free.
    refs: u32,
    /// Bumped at every change in place, at its release and at the reuse of its number: a memo
    /// names the versions it was made from and to, so a memo of a changed list is stale.
    version: u32,
}

impl Spill {
    /// Adds head `id` (a reference the list takes over), whose placement is `p`.
    fn add(&mut self, id: u32, p: Placement, owners: &SiteOwners) {
        self.note(p, owners);
        if self.list.len() == self.list.capacity() && self.list.len() >= 16 {
            // Past 16 placements (a prefix many servers hold), a quarter more, not double: a
            // list of 150 would otherwise hold room for 256.
            self.list.reserve_exact(self.list.len() / 4);
        }
        self.list.push(id);
    }

    /// Counts `p` in the bitsets.
    fn note(&mut self, p: Placement, owners: &SiteOwners) {
        match owners.get(p.site.0 as usize).copied().flatten() {
            Some((owner, tier)) => {
                if tier == Tier::L1 {
                    set_bit(&mut self.l1, owner);
                }
                set_bit(&mut self.any, owner);
            }
            None => self.shared += 1,
        }
    }

    /// Whether the list may hold a placement at `site`: false only for a private site whose
    /// owner has no placement of this key at any of its sites.
    fn may_hold(&self, site: SiteId, owners: &SiteOwners) -> bool {
        match owners.get(site.0 as usize).copied().flatten() {
            Some((owner, _)) => {
                let i = owner.index();
                self.any.get((i / 64) as usize).is_some_and(|w| w & (1 << (i % 64)) != 0)
            }
            None => true,
        }
    }

    /// Where in the list the placement at `site` is.
    fn position(&self, site: SiteId, heads: &Heads) -> Option<usize> {
        self.list.iter().position(|&h| heads.get(h).placement.site == site)
    }

    fn rebuild(&mut self, heads: &Heads, owners: &SiteOwners) {
        self.l1.clear();
        self.any.clear();
        self.shared = 0;
        for k in 0..self.list.len() {
            self.note(heads.get(self.list[k]).placement, owners);
        }
    }
}

/// A key's placements, by value: its head's, or its spill list's.
#[derive(Debug, Clone)]
pub(crate) enum Placements<'a> {
    One(std::option::IntoIter<Placement>),
    Many(std::slice::Iter<'a, u32>, &'a Heads),
}

impl Iterator for Placements<'_> {
    type Item = Placement;

    fn next(&mut self) -> Option<Placement> {
        match self {
            Placements::One(p) => p.next(),
            Placements::Many(ids, heads) => ids.next().map(|&h| heads.get(h).placement),
        }
    }
}

/// Slots at most: 2^31 - 1, so a spill list's number (at most one per key) fits the 31 bits
/// [`SPILLED`] leaves, and `u32::MAX` is never a slot number.
const MAX_SLOTS: usize = (1 << 31) - 1;
/// `head` of a free slot.
const FREE: u32 = u32::MAX;
/// The bit of `head` that says the rest is a spill list's number, not a head's.
const SPILLED: u32 = 1 << 31;

/// 12 bytes: a key's placement (or its spill list), use and binding flag. Its namespace and
/// single placement live in the shared [`Heads`] table: the keys of one store batch (same
/// namespace, site, reporter and, but for a last partial chunk, size) share one head.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slot {
    /// A [`Heads`] number, or [`SPILLED`] and a spill list number, or [`FREE`].
    head: u32,
    /// Last store or access, whole seconds.
    pub(crate) last_access: u32,
    /// Accesses reported (low 31 bits, saturating) and whether the key holds a reference on
    /// its chunk's token binding (the top bit).
    meta: u32,
}

const BOUND: u32 = 1 << 31;

impl Slot {
    fn new(head: u32) -> Self {
        Self { head, last_access: 0, meta: 0 }
    }

    /// Accesses reported (saturating at 2^31 - 1).
    pub(crate) fn access_count(&self) -> u32 {
        self.meta & !BOUND
    }

    pub(crate) fn count_access(&mut self) {
        if self.access_count() < !BOUND {
            self.meta += 1;
        }
    }

    fn set_access_count(&mut self, n: u32) {
        self.meta = (self.meta & BOUND) | n.min(!BOUND);
    }

    /// Whether the key holds a reference on its chunk's token binding.
    pub(crate) fn bound(&self) -> bool {
        self.meta & BOUND != 0
    }

    pub(crate) fn set_bound(&mut self, bound: bool) {
        self.meta = if bound { self.meta | BOUND } else { self.meta & !BOUND };
    }

    fn is_free(&self) -> bool {
        self.head == FREE
    }

    /// The spill list number, when the key has several placements.
    fn spilled(&self) -> Option<u32> {
        (self.head != FREE && self.head & SPILLED != 0).then_some(self.head & !SPILLED)
    }
}

/// A namespace and one placement, shared by the slots that name it.
#[derive(Debug, Clone, Copy)]
struct Head {
    ns: u32,
    placement: Placement,
    /// Slots naming it; 0: free, its number on the free list.
    refs: u32,
}

/// The heads in use, interned: one per distinct (namespace, placement), counted by the slots
/// that name it, so at most one per key. A store batch names one head for all its keys; the
/// last head handed out is remembered, so such a batch interns by one compare per key.
#[derive(Debug, Default)]
pub(crate) struct Heads {
    list: Vec<Head>,
    by_value: hashbrown::HashMap<(u32, Placement), u32, foldhash::fast::FixedState>,
    free: Vec<u32>,
    /// The last head interned, while it lives.
    last: Option<(u32, Placement, u32)>,
}

impl Heads {
    /// A reference on the head of (`ns`, `p`), made if new.
    fn acquire(&mut self, ns: u32, p: Placement) -> u32 {
        let id = match self.last {
            Some((lns, lp, id)) if lns == ns && lp == p => id,
            _ => match self.by_value.get(&(ns, p)) {
                Some(&id) => id,
                None => {
                    let head = Head { ns, placement: p, refs: 0 };
                    let id = file_in(&mut self.list, &mut self.free, head);
                    self.by_value.insert((ns, p), id);
                    id
                }
            },
        };
        self.list[id as usize].refs += 1;
        self.last = Some((ns, p, id));
        id
    }

    /// One more reference on live head `id` (a list copied names it too).
    fn retain(&mut self, id: u32) {
        self.list[id as usize].refs += 1;
    }

    /// Drops a reference on head `id`; the head goes with its last.
    fn release(&mut self, id: u32) {
        let h = &mut self.list[id as usize];
        h.refs -= 1;
        if h.refs == 0 {
            self.by_value.remove(&(h.ns, h.placement));
            self.free.push(id);
            if self.last.is_some_and(|(_, _, l)| l == id) {
                self.last = None;
            }
        }
    }

    fn get(&self, id: u32) -> &Head {
        &self.list[id as usize]
    }

    fn bytes(&self) -> usize {
        self.list.capacity() * std::mem::size_of::<Head>()
            + self.by_value.capacity() * (std::mem::size_of::<((u32, Placement), u32)>() + 1)
            + self.free.capacity() * 4
    }
}

/// What removing a placement did.
pub(crate) struct Removed {
    /// The placement removed.
    pub(crate) placement: Placement,
    /// `Some(bound)` when it was the key's last: the key is gone; `bound` says whether it held
    /// a token binding.
    pub(crate) key_gone: Option<bool>,
}

/// What a slot names for its placements: a head (with what it names, so a head number
/// reused since does not match), or a list at a version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    Head(u32, u32, Placement),
    List(u32, u32),
}

/// A change to a slot's placements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    /// The placement at its site stored (added, or replacing the site's).
    Put(Placement),
    /// The placement at this site removed.
    Remove(SiteId),
}

/// The last change that gave a slot a new list (or took it back to a head): from what it held,
/// `change` made it hold `to`, replacing or removing placement `gone`. The next slot of the
/// batch that held the same and takes the same change moves onto `to`.
#[derive(Debug, Clone, Copy)]
struct Memo {
    from: Held,
    change: Change,
    to: Held,
    gone: Option<Placement>,
}

/// The arena and its table. See the module docs.
#[derive(Debug)]
pub(crate) struct Slots {
    table: SegTable,
    hasher: foldhash::fast::FixedState,
    hashes: Vec<[u8; 32]>,
    slots: Vec<Slot>,
    heads: Heads,
    spill: Vec<Spill>,
    spill_free: Vec<u32>,
    /// The last change that made a list (see [`Memo`]).
    memo: Option<Memo>,
    free: Vec<u32>,
    live: usize,
    /// While an image build runs, new keys append instead of reusing freed slots.
    reuse_paused: bool,
}

/// The namespace of a live slot.
fn ns_of(slot: &Slot, heads: &Heads, spill: &[Spill]) -> u32 {
    match slot.spilled() {
        Some(id) => spill[id as usize].ns,
        None => heads.get(slot.head).ns,
    }
}

/// Whether slot `i` of the arena (`slots`, `hashes`, `heads`, `spill`) holds `key`.
fn holds(
    slots: &[Slot],
    hashes: &[[u8; 32]],
    heads: &Heads,
    spill: &[Spill],
    i: u32,
    key: &DirKey,
) -> bool {
    let i = i as usize;
    hashes[i] == key.hash && !slots[i].is_free() && ns_of(&slots[i], heads, spill) == key.ns.0
}

fn key_hash(hasher: &foldhash::fast::FixedState, hash: &[u8; 32], ns: u32) -> u64 {
    hasher.hash_one(DirKey { hash: *hash, ns: NsId(ns) })
}

impl Slots {
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            table: SegTable::default(),
            hasher: foldhash::fast::FixedState::with_seed(seed),
            hashes: Vec::new(),
            slots: Vec::new(),
            heads: Heads::default(),
            spill: Vec::new(),
            spill_free: Vec::new(),
            memo: None,
            free: Vec::new(),
            live: 0,
            reuse_paused: false,
        }
    }

    /// Keys held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    fn matches(&self, i: u32, key: &DirKey) -> bool {
        holds(&self.slots, &self.hashes, &self.heads, &self.spill, i, key)
    }

    /// The namespace of live slot `i`.
    pub(crate) fn ns_of(&self, i: u32) -> NsId {
        NsId(ns_of(&self.slots[i as usize], &self.heads, &self.spill))
    }

    /// The table hash of `key`.
    pub(crate) fn hash_of(&self, key: &DirKey) -> u64 {
        key_hash(&self.hasher, &key.hash, key.ns.0)
    }

    /// The slot of `key`, by its table hash `h`.
    fn find_hashed(&self, key: &DirKey, h: u64) -> Option<u32> {
        self.table.find(h, |i| self.matches(i, key))
    }

    /// The slot of `key`.
    pub(crate) fn find(&self, key: &DirKey) -> Option<u32> {
        self.find_hashed(key, self.hash_of(key))
    }

    /// The slot after `prev` when it holds `key` (a request's next chunk, stored next).
    /// The slot [`PREFETCH_AHEAD`] further on is asked for, so a walk of a stored run (a
    /// lookup's, or a store batch's over a prefix another server stored first) finds its
    /// records in cache. Past the arena's end, nothing is asked for.
    fn next_slot(&self, prev: Option<u32>, key: &DirKey) -> Option<u32> {
        let prev = prev?;
        self.prefetch_slot(prev.wrapping_add(PREFETCH_AHEAD as u32));
        let next = prev.wrapping_add(1);
        ((next as usize) < self.slots.len() && self.matches(next, key)).then_some(next)
    }

    /// The slot of `key`, trying the one after `prev` first.
    pub(crate) fn find_after(&self, prev: Option<u32>, key: &DirKey) -> Option<u32> {
        self.next_slot(prev, key).or_else(|| self.find(key))
    }

    /// The table hashes of `keys`, for [`Slots::store`], with the table lines of the first
    /// [`PREFETCH_AHEAD`] asked for: the store of key `j` asks for key `j + PREFETCH_AHEAD`'s
    /// ([`Slots::prefetch`]), so a batch's misses overlap instead of coming one after another.
    pub(crate) fn table_hashes<'a>(
        &self,
        keys: impl Iterator<Item = &'a DirKey>,
    ) -> smallvec::SmallVec<[u64; 64]> {
        let hashes: smallvec::SmallVec<[u64; 64]> = keys.map(|key| self.hash_of(key)).collect();
        for &h in hashes.iter().take(PREFETCH_AHEAD) {
            self.table.prefetch(h);
        }
        hashes
    }

    /// Asks the cache for slot `i`'s record and hash, when there is such a slot.
    fn prefetch_slot(&self, i: u32) {
        if let (Some(s), Some(h)) = (self.slots.get(i as usize), self.hashes.get(i as usize)) {
            crate::prefetch::prefetch(s);
            crate::prefetch::prefetch(h);
        }
    }

    /// Asks the cache for the table line a key of table hash `h` is probed at.
    pub(crate) fn prefetch(&self, h: u64) {
        self.table.prefetch(h);
    }

    /// Whether `n` more keys can be given slots (slot numbers are 32-bit; `u32::MAX` is never
    /// handed out).
    pub(crate) fn has_room(&self, n: usize) -> bool {
        let free = if self.reuse_paused { 0 } else { self.free.len() };
        self.slots.len().saturating_add(n.saturating_sub(free)) < MAX_SLOTS
    }

    /// Slot `i`'s record.
    pub(crate) fn slot(&self, i: u32) -> &Slot {
        &self.slots[i as usize]
    }

    pub(crate) fn slot_mut(&mut self, i: u32) -> &mut Slot {
        &mut self.slots[i as usize]
    }

    /// Slot `i`'s key.
    pub(crate) fn key(&self, i: u32) -> DirKey {
        DirKey { hash: self.hashes[i as usize], ns: self.ns_of(i) }
    }

    /// Slot `i`'s placements (at least one).
    pub(crate) fn placements(&self, i: u32) -> Placements<'_> {
        let s = &self.slots[i as usize];
        match s.spilled() {
            Some(id) => Placements::Many(self.spill[id as usize].list.iter(), &self.heads),
            None => Placements::One(Some(self.heads.get(s.head).placement).into_iter()),
        }
    }

    /// What live slot `i` names for its placements: a head, or a list (as a number with
    /// [`SPILLED`] set). Slots naming the same hold the same namespace and placements.
    pub(crate) fn held(&self, i: u32) -> Option<u32> {
        let s = &self.slots[i as usize];
        (!s.is_free()).then_some(s.head)
    }

    /// Slot `i`'s spill list, when it has several placements.
    pub(crate) fn spill(&self, i: u32) -> Option<&Spill> {
        self.slots[i as usize].spilled().map(|id| &self.spill[id as usize])
    }

    /// Places `key` at `p.site` (replacing the placement there), trying the slot after `prev`
    /// first (the batch's previous key). Returns the slot, whether the key is new, and the
    /// size of the placement replaced.
    pub(crate) fn store(
        &mut self,
        prev: Option<u32>,
        key: &DirKey,
        h: u64,
        p: Placement,
        owners: &SiteOwners,
    ) -> (u32, bool, Option<u64>) {
        if let Some(i) = self.next_slot(prev, key) {
            return (i, false, self.put(i, p, owners));
        }
        // The slot a new key takes: a freed one, or the arena's end (`has_room` was asked
        // before the batch, so the number fits).
        let reused = if self.reuse_paused { None } else { self.free.last().copied() };
        let new = reused.unwrap_or(self.slots.len() as u32);
        let (slots, hashes, heads, spill) = (&self.slots, &self.hashes, &self.heads, &self.spill);
        match self.table.find_or_insert(h, |j| holds(slots, hashes, heads, spill, j, key), new) {
            Some(i) => {
                // A held key found by the table may start a stored run: the records after it
                // are asked for, as the next keys of the batch try them first.
                for k in 1..=PREFETCH_AHEAD as u32 {
                    self.prefetch_slot(i.wrapping_add(k));
                }
                (i, false, self.put(i, p, owners))
            }
            None => {
                self.occupy(new, reused.is_some(), key, p);
                (new, true, None)
            }
        }
    }

    /// Slot `i` (a freed one when `reused`, else the arena's end) takes a new key with its
    /// first placement; the table already names it.
    fn occupy(&mut self, i: u32, reused: bool, key: &DirKey, p: Placement) {
        let slot = Slot::new(self.heads.acquire(key.ns.0, p));
        if reused {
            self.free.pop();
            self.slots[i as usize] = slot;
            self.hashes[i as usize] = key.hash;
        } else {
            self.slots.push(slot);
            self.hashes.push(key.hash);
        }
        self.live += 1;
    }

    /// Upserts `p` into slot `i`; the size it replaced.
    fn put(&mut self, i: u32, p: Placement, owners: &SiteOwners) -> Option<u64> {
        let held = self.holding(self.slots[i as usize].head);
        if let Held::Head(h, ns, old) = held
            && old.site == p.site
        {
            // One placement, at this site: replaced in the slot.
            self.slots[i as usize].head = self.heads.acquire(ns, p);
            self.heads.release(h);
            return Some(old.size());
        }
        if let Some(m) = self.recall(held, Change::Put(p)) {
            // The batch's key before held the same and got the same: share its new list.
            self.take_up(i, held, m.to);
            return m.gone.map(|g| g.size());
        }
        match held {
            Held::Head(h, ns, old) => {
                // The slot's head reference moves into the list.
                let mut spill = Spill { ns, refs: 1, ..Spill::default() };
                spill.add(h, old, owners);
                spill.add(self.heads.acquire(ns, p), p, owners);
                let to = self.file_spill(spill);
                self.slots[i as usize].head = SPILLED | to;
                self.remember(held, Change::Put(p), SPILLED | to, None);
                None
            }
            Held::List(id, _) => {
                let spill = &self.spill[id as usize];
                // A private site whose owner holds nothing of this key is a new placement,
                // without a scan of the list (a prefix every server holds has one per server).
                let at = match spill.may_hold(p.site, owners) {
                    true => spill.position(p.site, &self.heads),
                    false => None,
                };
                let gone = at.map(|k| self.heads.get(spill.list[k]).placement);
                let replaced = gone.map(|g| g.size());
                if spill.refs == 1 {
                    // Named by this slot alone: changed in place.
                    let head = self.heads.acquire(spill.ns, p);
                    let spill = &mut self.spill[id as usize];
                    spill.version = spill.version.wrapping_add(1);
                    match at {
                        // Same site, same owner: the bitsets stand.
                        Some(k) => {
                            let old = std::mem::replace(&mut spill.list[k], head);
                            self.heads.release(old);
                        }
                        None => spill.add(head, p, owners),
                    }
                    return replaced;
                }
                // Shared: a copy with the change, for this slot (room for one more only: a
                // list of 150 would otherwise double).
                let mut list = Vec::with_capacity(spill.list.len() + 1);
                list.extend_from_slice(&spill.list);
                let ns = spill.ns;
                for &h in &list {
                    self.heads.retain(h);
                }
                // The bitsets carry over: a placement replaced keeps its site and owner, and an
                // added one sets its owner's bits (no walk of the list's heads).
                let (l1, any, shared) = (spill.l1.clone(), spill.any.clone(), spill.shared);
                let head = self.heads.acquire(ns, p);
                let mut copy = Spill { ns, l1, any, shared, refs: 1, ..Spill::default() };
                match at {
                    Some(k) => {
                        let old = std::mem::replace(&mut list[k], head);
                        self.heads.release(old);
                    }
                    None => {
                        list.push(head);
                        copy.note(p, owners);
                    }
                }
                copy.list = list;
                let to = self.file_spill(copy);
                self.spill[id as usize].refs -= 1;
                self.slots[i as usize].head = SPILLED | to;
                self.remember(held, Change::Put(p), SPILLED | to, gone);
                replaced
            }
        }
    }

    /// Drops a slot's hold on what it `held` (it now names another list).
    fn leave(&mut self, held: Held) {
        match held {
            Held::Head(h, _, _) => self.heads.release(h),
            Held::List(id, _) => self.unref_spill(id),
        }
    }

    /// Notes that `change` took a slot from `from` to list `to` (or, with [`SPILLED`] clear,
    /// to head `to`), replacing or removing placement `gone`.
    fn remember(&mut self, from: Held, change: Change, to: u32, gone: Option<Placement>) {
        self.memo = Some(Memo { from, change, to: self.holding(to), gone });
    }

    /// What a live slot's `head` field (a head number, or [`SPILLED`] and a list number)
    /// names now.
    fn holding(&self, raw: u32) -> Held {
        match raw & SPILLED {
            0 => {
                let head = self.heads.get(raw);
                Held::Head(raw, head.ns, head.placement)
            }
            _ => Held::List(raw & !SPILLED, self.spill[(raw & !SPILLED) as usize].version),
        }
    }

    /// The memo of `change` from `held`, while what it leads to is unchanged.
    fn recall(&self, held: Held, change: Change) -> Option<Memo> {
        let m = self.memo.filter(|m| m.from == held && m.change == change)?;
        let live = match m.to {
            Held::List(id, version) => {
                let sp = &self.spill[id as usize];
                sp.version == version && sp.refs > 0
            }
            Held::Head(h, ns, placement) => self
                .heads
                .list
                .get(h as usize)
                .is_some_and(|x| x.refs > 0 && x.ns == ns && x.placement == placement),
        };
        live.then_some(m)
    }

    /// Slot `i`, which held `held`, now names `to` (another list, or a head).
    fn take_up(&mut self, i: u32, held: Held, to: Held) {
        self.slots[i as usize].head = match to {
            Held::List(id, _) => {
                self.spill[id as usize].refs += 1;
                SPILLED | id
            }
            Held::Head(h, _, _) => {
                self.heads.retain(h);
                h
            }
        };
        self.leave(held);
    }

    /// A new list's number: a freed one (its version moves on) or the next.
    fn file_spill(&mut self, mut spill: Spill) -> u32 {
        match self.spill_free.pop() {
            Some(id) => {
                spill.version = self.spill[id as usize].version.wrapping_add(1);
                self.spill[id as usize] = spill;
                id
            }
            None => {
                self.spill.push(spill);
                (self.spill.len() - 1) as u32
            }
        }
    }

    /// One slot fewer names list `id`; the list goes with its last, releasing its heads.
    fn unref_spill(&mut self, id: u32) {
        let spill = &mut self.spill[id as usize];
        spill.refs -= 1;
        if spill.refs == 0 {
            let version = spill.version.wrapping_add(1);
            for h in std::mem::take(spill).list {
                self.heads.release(h);
            }
            self.spill[id as usize].version = version;
            self.spill_free.push(id);
        }
    }

    /// Removes slot `i`'s placement at `site`; frees the slot when it was the last.
    pub(crate) fn remove(&mut self, i: u32, site: SiteId, owners: &SiteOwners) -> Option<Removed> {
        let s = self.slots[i as usize];
        let Some(id) = s.spilled() else {
            let head = *self.heads.get(s.head);
            if head.placement.site != site {
                return None;
            }
            // The only placement: the key goes.
            let bound = s.bound();
            self.free_slot(i);
            return Some(Removed { placement: head.placement, key_gone: Some(bound) });
        };
        let held = self.holding(s.head);
        if let Some(m) = self.recall(held, Change::Remove(site))
            && let Some(placement) = m.gone
        {
            // The batch's key before held the same and lost the same: share what it got.
            self.take_up(i, held, m.to);
            return Some(Removed { placement, key_gone: None });
        }
        let spill = &self.spill[id as usize];
        let at = spill.position(site, &self.heads)?;
        let placement = self.heads.get(spill.list[at]).placement;
        if spill.refs > 1 {
            // Shared: this slot alone leaves it, for a copy without the placement, or for the
            // one head left.
            let rest: Vec<u32> =
                spill.list.iter().enumerate().filter(|&(k, _)| k != at).map(|(_, &h)| h).collect();
            let ns = spill.ns;
            for &h in &rest {
                self.heads.retain(h);
            }
            self.spill[id as usize].refs -= 1;
            let to = match rest[..] {
                [last] => last,
                _ => {
                    let mut copy = Spill { ns, list: rest, refs: 1, ..Spill::default() };
                    copy.rebuild(&self.heads, owners);
                    SPILLED | self.file_spill(copy)
                }
            };
            self.slots[i as usize].head = to;
            self.remember(held, Change::Remove(site), to, Some(placement));
            return Some(Removed { placement, key_gone: None });
        }
        let spill = &mut self.spill[id as usize];
        spill.version = spill.version.wrapping_add(1);
        let gone = spill.list.swap_remove(at);
        self.heads.release(gone);
        if spill.list.len() == 1 {
            // The last head reference moves back into the slot.
            let last = spill.list[0];
            let version = spill.version.wrapping_add(1);
            self.spill[id as usize] = Spill { version, ..Spill::default() };
            self.spill_free.push(id);
            self.slots[i as usize].head = last;
        } else {
            spill.rebuild(&self.heads, owners);
        }
        Some(Removed { placement, key_gone: None })
    }

    fn free_slot(&mut self, i: u32) {
        let h = self.hash_of(&self.key(i));
        self.table.remove(h, i);
        let s = &mut self.slots[i as usize];
        let held = s.head;
        s.head = FREE;
        s.set_bound(false);
        match (held & SPILLED != 0).then_some(held & !SPILLED) {
            // (Only a list of one placement is freed with its key, and such a list goes back
            // inline first; this keeps a slot's list from leaking whatever the caller did.)
            Some(id) => self.unref_spill(id),
            None => self.heads.release(held),
        }
        self.free.push(i);
        self.live -= 1;
    }

    /// Slot `i`'s placements that `keep` refuses go; returns them, and `Some(bound)` when the
    /// key went with them.
    pub(crate) fn retain(
        &mut self,
        i: u32,
        mut keep: impl FnMut(&Placement) -> bool,
        owners: &SiteOwners,
    ) -> (Vec<Placement>, Option<bool>) {
        let doomed: Vec<SiteId> = self.placements(i).filter(|p| !keep(p)).map(|p| p.site).collect();
        let mut gone = Vec::with_capacity(doomed.len());
        let mut key_gone = None;
        for site in doomed {
            if let Some(r) = self.remove(i, site, owners) {
                gone.push(r.placement);
                key_gone = key_gone.or(r.key_gone);
            }
        }
        (gone, key_gone)
    }

    /// Slots in the arena, live or free.
    pub(crate) fn slot_count(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Whether new keys must append rather than take freed slots.
    pub(crate) fn pause_reuse(&mut self, pause: bool) {
        self.reuse_paused = pause;
    }

    /// The live slot numbers in `from..to`, in order.
    pub(crate) fn iter_range(&self, from: u32, to: u32) -> impl Iterator<Item = u32> + '_ {
        let to = (to as usize).min(self.slots.len());
        let from = (from as usize).min(to);
        self.slots[from..to]
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_free())
            .map(move |(i, _)| (from + i) as u32)
    }

    /// Every live slot number, in arena order (stable while nothing changes).
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.iter_range(0, self.slot_count())
    }

    /// Room for `n` more keys in the arena (the table is built after a restore).
    pub(crate) fn reserve(&mut self, n: usize) {
        self.slots.reserve(n);
        self.hashes.reserve(n);
    }

    /// Appends a decoded key with its placements (distinct sites, at least one) to the arena,
    /// leaving the table to [`Slots::index_restored`]; false when there is no placement.
    pub(crate) fn push_restored(
        &mut self,
        key: &DirKey,
        placements: &[Placement],
        access_count: u32,
        last_access: u32,
        owners: &SiteOwners,
    ) -> bool {
        let Some((first, rest)) = placements.split_first() else { return false };
        if !self.has_room(1) {
            return false;
        }
        let i = self.slots.len() as u32;
        // A key with the placements of the key before (a prefix's chunks) shares its list.
        let shared = self.slots.last().and_then(Slot::spilled).filter(|&id| {
            let sp = &self.spill[id as usize];
            sp.ns == key.ns.0
                && sp.list.len() == placements.len()
                && sp.list.iter().zip(placements).all(|(&h, p)| self.heads.get(h).placement == *p)
        });
        let mut slot = match shared {
            Some(id) => {
                self.spill[id as usize].refs += 1;
                Slot::new(SPILLED | id)
            }
            None => Slot::new(self.heads.acquire(key.ns.0, *first)),
        };
        slot.last_access = last_access;
        slot.set_access_count(access_count);
        self.slots.push(slot);
        self.hashes.push(key.hash);
        if shared.is_none() {
            for p in rest {
                self.put(i, *p, owners);
            }
        }
        self.live += 1;
        true
    }

    /// Builds the table over every slot [`Slots::push_restored`] appended (the arena read
    /// once, in order); false if two slots hold the same key.
    pub(crate) fn index_restored(&mut self) -> bool {
        let (hashes, slots, hasher) = (&self.hashes, &self.slots, &self.hasher);
        let (heads, spill) = (&self.heads, &self.spill);
        let entries: Vec<(u64, u32)> = hashes
            .iter()
            .zip(slots)
            .enumerate()
            .filter(|(_, (_, s))| !s.is_free())
            .map(|(i, (h, s))| (key_hash(hasher, h, ns_of(s, heads, spill)), i as u32))
            .collect();
        let same = |a: u32, b: u32| {
            let (a, b) = (a as usize, b as usize);
            hashes[a] == hashes[b]
                && ns_of(&slots[a], heads, spill) == ns_of(&slots[b], heads, spill)
        };
        match SegTable::build(entries, same) {
            Some(table) => {
                self.table = table;
                true
            }
            None => false,
        }
    }

    /// Bytes held: arena, hashes, table, spill lists.
    pub(crate) fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
            + self.hashes.capacity() * 32
            + self.table.bytes()
            + self.heads.bytes()
            + self
                .spill
                .iter()
                .map(|l| {
                    l.list.capacity() * 4
                        + if l.l1.spilled() { l.l1.capacity() * 8 } else { 0 }
                        + if l.any.spilled() { l.any.capacity() * 8 } else { 0 }
                })
                .sum::<usize>()
            + self.spill.capacity() * std::mem::size_of::<Spill>()
            + (self.free.capacity() + self.spill_free.capacity()) * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> DirKey {
        DirKey { hash: [b; 32], ns: NsId(0) }
    }

    fn st(s: &mut Slots, k: &DirKey, p: Placement) -> (u32, bool, Option<u64>) {
        let h = s.hash_of(k);
        s.store(None, k, h, p, &OWNERS)
    }

    fn ps(s: &Slots, i: u32) -> Vec<Placement> {
        s.placements(i).collect()
    }

    fn p(site: u32, size: u64) -> Placement {
        Placement::new(SiteId(site), 0, size)
    }

    /// Sites 0..3 owned by instances 0..3 (site 1 in L2), site 3 a shared pool, site 4 owned
    /// by instance 70 (a second bitset word).
    const OWNERS: [Option<(InstanceId, Tier)>; 5] = [
        Some((InstanceId(0), Tier::L1)),
        Some((InstanceId(1), Tier::L2)),
        Some((InstanceId(2), Tier::L1)),
        None,
        Some((InstanceId(70), Tier::L1)),
    ];

    #[test]
    fn slot_is_12_bytes_and_counts_apart_from_its_binding_flag() {
        assert_eq!(std::mem::size_of::<Slot>(), 12);
        let mut s = Slot::new(0);
        s.set_bound(true);
        s.count_access();
        assert_eq!((s.access_count(), s.bound()), (1, true));
        s.set_access_count(u32::MAX);
        s.count_access();
        assert_eq!(
            (s.access_count(), s.bound()),
            (u32::MAX >> 1, true),
            "saturates below the flag"
        );
        s.set_bound(false);
        assert_eq!((s.access_count(), s.bound()), (u32::MAX >> 1, false));
    }

    #[test]
    fn a_batch_shares_one_head_and_heads_go_with_their_last_key() {
        let mut s = Slots::new(1);
        for b in 0..8 {
            st(&mut s, &key(b), p(0, 5 << 32 | 7));
        }
        assert_eq!(s.heads.by_value.len(), 1, "one head for the batch");
        assert_eq!(ps(&s, 3), &[p(0, 5 << 32 | 7)], "a size past 32 bits is kept");
        // A new size for one key: its own head; the batch's keeps the others.
        assert_eq!(st(&mut s, &key(3), p(0, 9)).2, Some(5 << 32 | 7));
        assert_eq!(s.heads.by_value.len(), 2);
        // Spilled and back: the key's head is interned again, in its namespace.
        st(&mut s, &key(3), p(1, 4));
        assert_eq!(s.heads.by_value.len(), 3, "a spill list names heads too");
        s.remove(3, SiteId(0), &OWNERS);
        assert_eq!(s.heads.by_value.len(), 2, "the removed placement's head went");
        assert_eq!(ps(&s, 3), &[p(1, 4)]);
        assert_eq!(s.key(3), key(3));
        for b in 0..8 {
            s.remove(b, SiteId(0), &OWNERS);
        }
        assert_eq!(s.heads.by_value.len(), 1, "only key 3's head is left");
        s.remove(3, SiteId(1), &OWNERS);
        assert!(s.heads.by_value.is_empty() && s.heads.last.is_none());
        assert_eq!(s.heads.free.len(), s.heads.list.len(), "every head is free");
        assert_eq!(s.len(), 0);
    }

    #[test]
    fn a_batch_lands_in_consecutive_slots_and_is_found_from_its_neighbour() {
        let mut s = Slots::new(1);
        let idx: Vec<u32> = (0..8).map(|b| st(&mut s, &key(b), p(0, 1)).0).collect();
        assert_eq!(idx, (0..8).collect::<Vec<_>>());
        assert_eq!(s.find_after(Some(2), &key(3)), Some(3));
        // A wrong guess falls back to the table.
        assert_eq!(s.find_after(Some(5), &key(3)), Some(3));
        assert_eq!(s.find_after(Some(7), &key(99)), None);
        assert_eq!(s.find_after(Some(u32::MAX), &key(0)), Some(0));
    }

    #[test]
    fn placements_spill_and_come_back_inline() {
        let mut s = Slots::new(1);
        let (i, new, old) = st(&mut s, &key(1), p(0, 10));
        assert!(new && old.is_none());
        assert_eq!(st(&mut s, &key(1), p(0, 11)), (i, false, Some(10)));
        assert_eq!(st(&mut s, &key(1), p(1, 20)).2, None);
        assert_eq!(st(&mut s, &key(1), p(2, 30)).2, None);
        assert_eq!(ps(&s, i).len(), 3);
        assert_eq!(
            s.remove(i, SiteId(0), &OWNERS).map(|r| (r.placement.size(), r.key_gone)),
            Some((11, None))
        );
        assert!(s.remove(i, SiteId(0), &OWNERS).is_none());
        assert_eq!(s.remove(i, SiteId(2), &OWNERS).map(|r| r.key_gone), Some(None));
        assert_eq!(ps(&s, i), &[p(1, 20)]);
        assert_eq!(s.spill_free.len(), 1, "a list back to one placement is released");
        s.slot_mut(i).set_bound(true);
        assert_eq!(s.remove(i, SiteId(1), &OWNERS).map(|r| r.key_gone), Some(Some(true)));
        assert_eq!(s.len(), 0);
        assert_eq!(s.find(&key(1)), None);
        // The freed slot and spill list are reused, unbound.
        let (j, new, _) = st(&mut s, &key(2), p(0, 1));
        assert!(new && j == i && !s.slot(j).bound());
        st(&mut s, &key(2), p(1, 1));
        assert!(s.spill_free.is_empty());
    }

    #[test]
    fn a_spill_list_keeps_its_owner_bitsets() {
        let mut s = Slots::new(1);
        let i = st(&mut s, &key(1), p(0, 1)).0;
        assert!(s.spill(i).is_none());
        for site in 1..5 {
            st(&mut s, &key(1), p(site, 1));
        }
        let sp = s.spill(i).unwrap();
        assert!(sp.may_hold(SiteId(2), &OWNERS), "instance 2 holds it");
        assert!(sp.may_hold(SiteId(3), &OWNERS), "a shared pool is always looked up");
        assert!(sp.may_hold(SiteId(9), &OWNERS), "an unknown site is looked up");
        assert_eq!(sp.l1.as_slice(), &[0b101, 1 << 6]);
        assert_eq!(sp.any.as_slice(), &[0b111, 1 << 6]);
        assert_eq!(sp.shared, 1);
        s.remove(i, SiteId(2), &OWNERS);
        s.remove(i, SiteId(3), &OWNERS);
        let sp = s.spill(i).unwrap();
        assert_eq!((sp.l1[0], sp.any[0], sp.shared), (0b1, 0b11, 0));
        assert!(!sp.may_hold(SiteId(2), &OWNERS), "instance 2's placement went");
        s.remove(i, SiteId(4), &OWNERS);
        assert_eq!(s.spill(i).unwrap().l1.iter().sum::<u64>(), 1, "instance 70's bit went");
        // Stored again from instance 2 (not in the bitsets): appended, and then replaced, not
        // added twice.
        st(&mut s, &key(1), p(2, 5));
        assert!(ps(&s, i).contains(&p(2, 5)));
        assert_eq!(st(&mut s, &key(1), p(2, 6)).2, Some(5));
        assert_eq!(ps(&s, i).len(), 3);
    }

    #[test]
    fn a_restored_arena_is_indexed_and_refuses_a_duplicate() {
        let mut s = Slots::new(3);
        for b in 0..200u8 {
            assert!(s.push_restored(&key(b), &[p(0, 1), p(3, 2)], 1, 2, &OWNERS));
        }
        assert!(!s.push_restored(&key(9), &[], 0, 0, &OWNERS), "a key needs a placement");
        assert!(s.index_restored());
        for b in 0..200u8 {
            assert_eq!(s.find(&key(b)), Some(u32::from(b)));
            assert_eq!(s.spill(u32::from(b)).unwrap().shared, 1);
        }
        assert_eq!(live_lists(&s), 1, "keys restored with the same placements share a list");
        heads_add_up(&s);
        assert_eq!(s.find(&key(200)), None);
        let mut d = Slots::new(3);
        d.push_restored(&key(1), &[p(0, 1)], 0, 0, &OWNERS);
        d.push_restored(&key(2), &[p(0, 1)], 0, 0, &OWNERS);
        d.push_restored(&key(1), &[p(2, 1)], 0, 0, &OWNERS);
        assert!(!d.index_restored());
    }

    #[test]
    fn keys_differ_by_namespace() {
        let mut s = Slots::new(1);
        let a = st(&mut s, &key(1), p(0, 1)).0;
        let other = DirKey { hash: [1; 32], ns: NsId(1) };
        assert_eq!(s.find(&other), None);
        assert_eq!(s.find_after(Some(a.wrapping_sub(1)), &other), None);
        let b = st(&mut s, &other, p(0, 1)).0;
        assert_ne!(a, b);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![a, b]);
    }

    #[test]
    fn many_keys_survive_table_growth_and_removal() {
        let mut s = Slots::new(7);
        // Past 14,336 keys the table splits segments.
        let keys: Vec<DirKey> = (0..40_000u32)
            .map(|i| {
                let mut h = [0u8; 32];
                h[..4].copy_from_slice(&i.to_le_bytes());
                h[8..12].copy_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
                DirKey { hash: h, ns: NsId(i % 3) }
            })
            .collect();
        for k in &keys {
            st(&mut s, k, p(0, 1));
        }
        for k in keys.iter().step_by(2) {
            let i = s.find(k).unwrap();
            assert!(s.remove(i, SiteId(0), &OWNERS).unwrap().key_gone.is_some());
        }
        for (n, k) in keys.iter().enumerate() {
            assert_eq!(s.find(k).is_some(), n % 2 == 1, "key {n}");
        }
        assert_eq!(s.len(), 20_000);
        assert_eq!(s.iter().count(), 20_000);
    }

    /// The number of live spill lists.
    fn live_lists(s: &Slots) -> usize {
        s.spill.iter().filter(|sp| sp.refs > 0).count()
    }

    #[test]
    fn a_prefix_several_servers_store_shares_one_list() {
        let mut s = Slots::new(1);
        let keys: Vec<DirKey> = (0..16).map(key).collect();
        // Server 0 stores the prefix, then servers 2 and 70 each store it in one batch.
        for site in [0, 2, 4] {
            let mut prev = None;
            for k in &keys {
                let h = s.hash_of(k);
                prev = Some(s.store(prev, k, h, p(site, 1), &OWNERS).0);
            }
            heads_add_up(&s);
        }
        assert_eq!(live_lists(&s), 1, "one list for sixteen keys");
        let shared = s.held(0);
        assert!((0..16).all(|i| s.held(i) == shared && ps(&s, i).len() == 3));
        // One key loses a placement: a list of its own; the others keep theirs.
        assert_eq!(s.remove(5, SiteId(2), &OWNERS).map(|r| r.placement), Some(p(2, 1)));
        assert_eq!(live_lists(&s), 2);
        assert_eq!(ps(&s, 5), &[p(0, 1), p(4, 1)]);
        assert!((0..16).filter(|&i| i != 5).all(|i| s.held(i) == shared));
        heads_add_up(&s);
        // The others lose it too, in one batch: they share again, with key 5 or beside it.
        for i in (0..16).filter(|&i| i != 5) {
            assert!(s.remove(i, SiteId(2), &OWNERS).is_some());
        }
        assert!(live_lists(&s) <= 2, "{} lists", live_lists(&s));
        assert!((0..16).filter(|&i| i != 5).all(|i| s.held(i) == s.held(0)));
        heads_add_up(&s);
        // Down to one placement each: every key back on a head, no list left.
        for i in 0..16 {
            assert_eq!(s.remove(i, SiteId(4), &OWNERS).map(|r| r.key_gone), Some(None));
        }
        assert_eq!(live_lists(&s), 0);
        assert!((0..16).all(|i| ps(&s, i) == [p(0, 1)] && s.spill(i).is_none()));
        heads_add_up(&s);
    }

    #[test]
    fn a_list_changed_since_is_not_shared() {
        let mut s = Slots::new(1);
        let (a, b) = (st(&mut s, &key(1), p(0, 1)).0, st(&mut s, &key(2), p(0, 1)).0);
        // Key 1 gets site 2 (a new list), then site 4 in place: the list no longer is what
        // site 2 alone made of key 2's head.
        st(&mut s, &key(1), p(2, 1));
        st(&mut s, &key(1), p(4, 1));
        st(&mut s, &key(2), p(2, 1));
        assert_eq!(ps(&s, b), &[p(0, 1), p(2, 1)]);
        assert_eq!(ps(&s, a), &[p(0, 1), p(2, 1), p(4, 1)]);
        assert_ne!(s.held(a), s.held(b));
        heads_add_up(&s);
    }

    /// Every live head is named as often as its count says (by slots and live spill lists,
    /// each list once), only live heads are interned, and every list is named by as many slots
    /// as its count says.
    fn heads_add_up(s: &Slots) {
        let mut named = vec![0u32; s.heads.list.len()];
        let mut naming = vec![0u32; s.spill.len()];
        for i in s.iter() {
            match s.slots[i as usize].spilled() {
                Some(id) => naming[id as usize] += 1,
                None => named[s.slots[i as usize].head as usize] += 1,
            }
        }
        for (id, sp) in s.spill.iter().enumerate() {
            assert_eq!(sp.refs, naming[id], "list {id}'s count");
            assert_eq!(sp.refs == 0, s.spill_free.contains(&(id as u32)), "list {id} is free");
            sp.list.iter().for_each(|&h| named[h as usize] += 1);
        }
        for (id, h) in s.heads.list.iter().enumerate() {
            assert_eq!(h.refs, named[id], "head {id}'s count");
            let interned = s.heads.by_value.get(&(h.ns, h.placement)) == Some(&(id as u32));
            assert_eq!(interned, h.refs > 0, "head {id} is interned while it lives");
        }
        assert_eq!(s.heads.by_value.len(), named.iter().filter(|&&n| n > 0).count());
    }

    proptest::proptest! {
        /// Stores and removals of a few keys at the sites of `OWNERS` (sizes from a small set,
        /// so heads are shared and split) agree with a map of placements, and the heads' counts
        /// stay exact.
        #[test]
        fn placements_and_heads_agree_with_a_map(
            ops in proptest::collection::vec((0u8..6, 0u32..5, 0u64..3, proptest::bool::ANY), 1..300)
        ) {
            let mut s = Slots::new(5);
            let mut model: std::collections::BTreeMap<(u8, u32), u64> = Default::default();
            for (k, site, size, store) in ops {
                if store {
                    let old = st(&mut s, &key(k), p(site, size)).2;
                    proptest::prop_assert_eq!(old, model.insert((k, site), size));
                } else {
                    let gone = s.find(&key(k)).and_then(|i| s.remove(i, SiteId(site), &OWNERS));
                    let want = model.remove(&(k, site));
                    proptest::prop_assert_eq!(gone.map(|r| r.placement.size()), want);
                }
                heads_add_up(&s);
            }
            for k in 0..6u8 {
                let mut got: Vec<(u32, u64)> = s
                    .find(&key(k))
                    .map(|i| ps(&s, i).iter().map(|q| (q.site.0, q.size())).collect())
                    .unwrap_or_default();
                got.sort_unstable();
                let want: Vec<(u32, u64)> =
                    model.range((k, 0)..=(k, u32::MAX)).map(|(&(_, site), &n)| (site, n)).collect();
                proptest::prop_assert_eq!(got, want);
            }
        }
    }
}
