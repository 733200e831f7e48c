//! The prefetch controller: a lookup's chunks missing from L1 are looked up in every adapter
//! (one batched call each, concurrently), the longest prefix servable from L1 ∪ L2 is planned
//! (each chunk from the highest-priority adapter holding it), loaded, verified, decoded into
//! L1, and read-locked for the reader like an L1 hit.
//!
//! Safety of buffers: a load either fills memory the adapter owns (then a verified, decoded
//! blob is copied into an L1 write reservation), or, for a direct load, fills an L1 write
//! reservation that is *moved into* the load: the I/O task owns it until it hands it back.
//! An expired or abandoned request drops its future, never the memory under a load in
//! flight: a moved reservation lives until its I/O task ends and is then discarded (RAII),
//! uncommitted, so nothing half-written ever becomes visible.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures_util::future::join_all;
use lmcache_core::ObjectKey;
use lmcache_l1::{L1Error, ReadLease, WriteRequest, WriteReservation};
use lmcache_l2::{Codec, PayloadSink};
use tracing::Instrument;

use crate::ledger::Pins;
use crate::tier::{AdapterSlot, L2Tier, Shared};

/// One prefetch: the keys of chunks `[first, end)` of each shard, and how many read locks
/// the reader needs on each served chunk.
#[derive(Debug, Clone)]
pub struct PrefetchRequest {
    /// Per shard, the keys of the chunks to serve (the same count for every shard).
    pub shards: Vec<Vec<ObjectKey>>,
    /// Read locks per served object.
    pub readers: u32,
}

/// The result: locked objects of the servable prefix.
#[derive(Debug, Default)]
pub struct PrefetchOutcome {
    /// Per shard, leases on the first `hits` chunks.
    pub leases: Vec<Vec<ReadLease>>,
    /// Chunks servable on every shard.
    pub hits: usize,
    /// Objects loaded from L2 for this request.
    pub loaded_keys: usize,
    /// Bytes loaded from L2.
    pub loaded_bytes: u64,
    /// Whether the deadline cut the request short.
    pub expired: bool,
    /// The first thing that went wrong (beyond keys simply being absent), for "why was this
    /// a miss?".
    pub trouble: Option<PrefetchTrouble>,
}

/// Why a prefetch (from L2 or the peers) served less than asked for when something went
/// wrong, rather than the keys being absent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefetchTrouble {
    /// The deadline cut it short.
    TimedOut,
    /// An L2 adapter failed a lookup or a load.
    L2Error {
        /// The adapter (`type#id`).
        adapter: String,
        /// Its error.
        error: String,
    },
    /// A loaded blob failed verification or decoding (wrong KV is a miss, never served).
    BlobRefused {
        /// The adapter (`type#id`).
        adapter: String,
        /// What was wrong.
        reason: String,
    },
    /// A peer did not answer, or its transfer failed.
    Peer {
        /// The peer's instance id.
        peer: String,
        /// What went wrong.
        error: String,
    },
}

impl PrefetchTrouble {
    pub(crate) fn l2(slot: &AdapterSlot, error: impl std::fmt::Display) -> Self {
        Self::L2Error { adapter: adapter_name(slot), error: error.to_string() }
    }
}

/// `type#id` of an adapter, as "why was this a miss?" names it.
pub(crate) fn adapter_name(slot: &AdapterSlot) -> String {
    format!("{}#{}", slot.built.kind, slot.id)
}

impl PrefetchOutcome {
    /// This outcome followed by `next`, an outcome for the chunks after this one's `hits`
    /// (the same shards, in order): leases joined per shard, counts summed.
    pub(crate) fn then(mut self, next: Self) -> Self {
        let joined = next.hits.min(next.leases.iter().map(Vec::len).min().unwrap_or(0));
        if self.leases.len() == next.leases.len() {
            for (mine, theirs) in self.leases.iter_mut().zip(next.leases) {
                mine.extend(theirs.into_iter().take(joined));
            }
            self.hits += joined;
        }
        self.loaded_keys += next.loaded_keys;
        self.loaded_bytes += next.loaded_bytes;
        self.expired |= next.expired;
        self.trouble = self.trouble.or(next.trouble);
        self
    }
}

/// A prefetch in flight, owned by whoever asked for it: [`Self::poll`] takes the outcome once
/// it is there, [`PrefetchWaiter::wait`] blocks (bounded) until it is. Dropping the handle
/// abandons the prefetch: its outcome, and the read leases in it, are dropped when it ends.
#[derive(Debug)]
pub struct PrefetchHandle {
    slot: Arc<PrefetchSlot>,
}

/// Waits for a prefetch without owning its outcome (so a caller can wait without holding the
/// lock that guards the handle).
#[derive(Debug, Clone)]
pub struct PrefetchWaiter {
    slot: Arc<PrefetchSlot>,
}

#[derive(Debug, Default)]
struct PrefetchSlot {
    state: parking_lot::Mutex<SlotState>,
    done: parking_lot::Condvar,
}

#[derive(Debug, Default)]
enum SlotState {
    #[default]
    Running,
    Done(PrefetchOutcome),
    Taken,
}

impl PrefetchHandle {
    /// A handle completed by the returned function, called once from anywhere (a source
    /// outside the tier: the fleet's peers).
    pub(crate) fn external() -> (Self, impl FnOnce(PrefetchOutcome) + Send + 'static) {
        let slot = Arc::new(PrefetchSlot::default());
        let s = slot.clone();
        let complete = move |outcome| {
            *s.state.lock() = SlotState::Done(outcome);
            s.done.notify_all();
        };
        (Self { slot }, complete)
    }

    /// The outcome, once the prefetch has ended; `None` while it runs (and after it was taken).
    pub fn poll(&self) -> Option<PrefetchOutcome> {
        let mut st = self.slot.state.lock();
        match std::mem::take(&mut *st) {
            SlotState::Done(out) => {
                *st = SlotState::Taken;
                Some(out)
            }
            other => {
                *st = other;
                None
            }
        }
    }

    /// A waiter for this prefetch.
    pub fn waiter(&self) -> PrefetchWaiter {
        PrefetchWaiter { slot: self.slot.clone() }
    }
}

impl PrefetchWaiter {
    /// Blocks until the prefetch has ended or `timeout` passed; returns whether it ended.
    pub fn wait(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut st = self.slot.state.lock();
        while matches!(*st, SlotState::Running) {
            if self.slot.done.wait_until(&mut st, deadline).timed_out() {
                return !matches!(*st, SlotState::Running);
            }
        }
        true
    }
}

impl L2Tier {
    /// Starts a prefetch and returns its handle (poll it, or wait on it).
    pub(crate) fn start_prefetch(&self, req: PrefetchRequest) -> PrefetchHandle {
        let slot = Arc::new(PrefetchSlot::default());
        let s = slot.clone();
        self.prefetch(req, move |outcome| {
            *s.state.lock() = SlotState::Done(outcome);
            s.done.notify_all();
        });
        PrefetchHandle { slot }
    }

    /// Starts a prefetch; `done` is called exactly once, from a tier thread.
    pub fn prefetch(
        &self,
        req: PrefetchRequest,
        done: impl FnOnce(PrefetchOutcome) + Send + 'static,
    ) {
        let shared = self.shared.clone();
        self.rt.spawn(async move {
            let outcome = run(&shared, req).await;
            done(outcome);
        });
    }

    /// Runs a prefetch to completion on the calling (non-async) thread.
    pub fn prefetch_blocking(&self, req: PrefetchRequest) -> PrefetchOutcome {
        let shared = self.shared.clone();
        self.block_on(async move { run(&shared, req).await })
    }
}

async fn run(shared: &Arc<Shared>, req: PrefetchRequest) -> PrefetchOutcome {
    let chunks = req.shards.first().map_or(0, Vec::len);
    let span = tracing::info_span!(
        "l2_prefetch",
        shards = req.shards.len(),
        chunks = req.shards.first().map_or(0, Vec::len),
        loaded_keys = tracing::field::Empty,
        loaded_bytes = tracing::field::Empty,
        hits = tracing::field::Empty,
        expired = tracing::field::Empty,
    );
    let out = run_inner(shared, req).instrument(span.clone()).await;
    span.record("loaded_keys", out.loaded_keys);
    span.record("loaded_bytes", out.loaded_bytes);
    span.record("hits", out.hits);
    span.record("expired", out.expired);
    let report = crate::tier::PrefetchReport {
        chunks,
        hits: out.hits,
        loaded_keys: out.loaded_keys,
        loaded_bytes: out.loaded_bytes,
        expired: out.expired,
    };
    shared.observe(|o| o.prefetched(&report));
    out
}

async fn run_inner(shared: &Arc<Shared>, req: PrefetchRequest) -> PrefetchOutcome {
    let stats = &shared.stats;
    stats.prefetch_requests.fetch_add(1, Ordering::Relaxed);
    let deadline = tokio::time::Instant::now() + shared.config.prefetch_deadline;
    let mut out = PrefetchOutcome::default();
    let permit =
        tokio::time::timeout_at(deadline, shared.prefetch_slots.clone().acquire_owned()).await;
    // Read locks on this request's chunks L1 already holds, kept until the prefix is locked
    // below: neither the loads' own reservations nor the watermark may evict them to make
    // room for the chunks loaded beside them (which would leave the prefix short of what L1
    // and L2 hold between them).
    let mut resident: Vec<ReadLease> = Vec::new();
    if let Ok(Ok(_permit)) = permit {
        stats.prefetch_in_flight.fetch_add(1, Ordering::Relaxed);
        if !load_missing(shared, &req, &mut out, &mut resident, deadline).await {
            out.expired = true;
        }
        stats.prefetch_in_flight.fetch_sub(1, Ordering::Relaxed);
    } else {
        out.expired = true;
    }
    if out.expired {
        stats.prefetch_expired.fetch_add(1, Ordering::Relaxed);
        out.trouble.get_or_insert(PrefetchTrouble::TimedOut);
    }
    // Lock what L1 now holds, shard by shard, and keep the common prefix.
    let mut leases: Vec<Vec<ReadLease>> = req
        .shards
        .iter()
        .map(|keys| shared.l1.read_lock_prefix(keys, req.readers).unwrap_or_default())
        .collect();
    let hits = leases.iter().map(Vec::len).min().unwrap_or(0);
    for l in &mut leases {
        l.truncate(hits);
    }
    out.leases = leases;
    out.hits = hits;
    drop(resident);
    out
}

/// Looks up, plans and loads the chunks L1 lacks; read-locks those it holds into `resident`.
/// The lookups must end by `deadline`; the loads get `deadline` plus their planned bytes at
/// [`lmcache_l2::FLOOR_BANDWIDTH`], so a request of large chunks is not cut off by a limit
/// sized for small ones. Returns false if a time limit cut it short.
async fn load_missing(
    shared: &Arc<Shared>,
    req: &PrefetchRequest,
    out: &mut PrefetchOutcome,
    resident: &mut Vec<ReadLease>,
    deadline: tokio::time::Instant,
) -> bool {
    let n = req.shards.iter().map(Vec::len).min().unwrap_or(0);
    if n == 0 {
        return true;
    }
    // Which (shard, chunk) cells L1 lacks; those it holds are locked until the end.
    let mut missing: Vec<(usize, usize)> = Vec::new();
    for (s, keys) in req.shards.iter().enumerate() {
        let keys = keys.get(..n).unwrap_or_default();
        for (c, lease) in shared.l1.read_lock(keys, 1).into_iter().enumerate() {
            match lease {
                Ok(l) => resident.push(l),
                Err(_) => missing.push((s, c)),
            }
        }
    }
    if missing.is_empty() {
        return true;
    }
    let adapters: Vec<Arc<AdapterSlot>> =
        shared.slots().into_iter().filter(|a| a.usable(shared.epoch)).collect();
    if adapters.is_empty() {
        return true;
    }
    let keys: Vec<ObjectKey> = missing.iter().map(|&(s, c)| req.shards[s][c].clone()).collect();
    // Pinned from before the lookups to the end of the loads: eviction never deletes a key
    // this request is reading. A key already being evicted is a miss.
    let pins: Vec<(Pins, Vec<bool>)> = adapters.iter().map(|a| a.ledger.pin(&keys)).collect();
    // One batched lookup per adapter, all at once; with stored sizes where the adapter knows
    // them (they let a load go straight into L1).
    let trouble = parking_lot::Mutex::new(None);
    let lookups = join_all(adapters.iter().map(|a| {
        let (keys, trouble) = (&keys, &trouble);
        async move {
            let r = match a.built.adapter.lookup_sized(keys).await {
                Ok(sizes) => Ok(sizes.into_iter().map(|s| s.map(Some)).collect::<Vec<_>>()),
                Err(lmcache_l2::L2Error::Unsupported { .. }) => a
                    .built
                    .adapter
                    .lookup(keys)
                    .await
                    .map(|f| f.into_iter().map(|x| x.then_some(None)).collect()),
                Err(e) => Err(e),
            };
            a.stats.lookup_keys.fetch_add(keys.len() as u64, Ordering::Relaxed);
            match r {
                Ok(f) if f.len() == keys.len() => {
                    a.ok();
                    let hits = f.iter().filter(|x| x.is_some()).count() as u64;
                    a.stats.lookup_hits.fetch_add(hits, Ordering::Relaxed);
                    f
                }
                Ok(_) => vec![None; keys.len()],
                Err(e) => {
                    a.failed(shared.epoch, &e);
                    trouble.lock().get_or_insert_with(|| PrefetchTrouble::l2(a, &e));
                    vec![None; keys.len()]
                }
            }
        }
    }));
    let Ok(mut found) = tokio::time::timeout_at(deadline, lookups).await else { return false };
    out.trouble = trouble.into_inner();
    for (a, (_, doomed)) in pins.iter().enumerate() {
        for (m, d) in doomed.iter().enumerate() {
            if *d {
                found[a][m] = None;
            }
        }
    }
    // Plan: the first chunk some shard can get from nowhere ends the prefix.
    let source = |m: usize| (0..adapters.len()).find(|&a| found[a][m].is_some());
    let mut limit = n;
    for (m, &(_, c)) in missing.iter().enumerate() {
        if c < limit && source(m).is_none() {
            limit = c;
        }
    }
    let mut plan: HashMap<usize, Vec<usize>> = HashMap::new();
    for (m, &(_, c)) in missing.iter().enumerate() {
        if c < limit
            && let Some(a) = source(m)
        {
            plan.entry(a).or_default().push(m);
        }
    }
    // Load from each adapter concurrently, within a limit grown by the bytes planned.
    let planned: u64 = plan
        .iter()
        .flat_map(|(a, ms)| ms.iter().map(|&m| found[*a][m].flatten().unwrap_or(0)))
        .sum();
    let load_deadline = deadline + lmcache_l2::time_budget(std::time::Duration::ZERO, planned);
    let loads = join_all(plan.into_iter().map(|(a, ms)| {
        let slot = adapters[a].clone();
        let sizes: Vec<Option<u64>> = ms.iter().map(|&m| found[a][m].flatten()).collect();
        let ks: Vec<ObjectKey> = ms.iter().map(|&m| keys[m].clone()).collect();
        async move { load_from(shared, &slot, ks, sizes).await }
    }));
    let Ok(loads) = tokio::time::timeout_at(load_deadline, loads).await else { return false };
    for (k, b, t) in loads {
        out.loaded_keys += k;
        out.loaded_bytes += b;
        if out.trouble.is_none() {
            out.trouble = t;
        }
    }
    drop(pins);
    true
}

/// An L1 write reservation as the target of a direct load.
struct L1Sink(WriteReservation);

impl PayloadSink for L1Sink {
    fn payload_mut(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

/// What loading from one adapter came to: counted into the adapter's and the tier's stats
/// once, by [`Tally::finish`], whichever path (direct or buffered) the keys took.
struct Tally<'a> {
    shared: &'a Shared,
    slot: &'a AdapterSlot,
    keys: usize,
    bytes: u64,
    error: Option<lmcache_l2::L2Error>,
    placed: Vec<ObjectKey>,
    trouble: Option<PrefetchTrouble>,
}

impl<'a> Tally<'a> {
    fn new(shared: &'a Shared, slot: &'a AdapterSlot) -> Self {
        Self { shared, slot, keys: 0, bytes: 0, error: None, placed: Vec::new(), trouble: None }
    }

    /// A key committed to L1.
    fn placed(&mut self, key: &ObjectKey, raw_len: u64) {
        self.keys += 1;
        self.bytes += raw_len;
        self.placed.push(key.clone());
    }

    /// A key the adapter did not return (absent, or the load failed).
    fn missed(&mut self, error: Option<lmcache_l2::L2Error>) {
        self.slot.stats.load_failures.fetch_add(1, Ordering::Relaxed);
        if let Some(e) = error {
            self.trouble.get_or_insert_with(|| PrefetchTrouble::l2(self.slot, &e));
            self.error = Some(e);
        }
    }

    /// A blob that failed verification or decoding: a miss, counted and reported.
    fn refused(&mut self, key: &ObjectKey, reason: &str) {
        let slot = self.slot;
        slot.stats.corrupt_blobs.fetch_add(1, Ordering::Relaxed);
        self.trouble.get_or_insert_with(|| PrefetchTrouble::BlobRefused {
            adapter: adapter_name(slot),
            reason: reason.to_owned(),
        });
        tracing::warn!(key = %key, adapter = slot.id, reason, "L2 blob refused; treated as a miss");
        self.shared.observe(|o| o.blob_refused(slot.id, key, reason));
    }

    /// L1 reservations for loaded keys, in one batch; `None` where the key is already
    /// resident or there is no room (counted). When L1 is short of room while the
    /// write-behind still has objects to write (which eviction spares), waits for it, at most
    /// the tier's write-behind wait, as a store does: otherwise a DRAM staging area full of
    /// objects on their way to a slab or any L2 turns every read-back into a miss.
    async fn reserve(&self, reqs: &[WriteRequest]) -> Vec<Option<WriteReservation>> {
        let l1 = &self.shared.l1;
        let mut got = l1.reserve_write(reqs);
        let deadline = tokio::time::Instant::now() + self.shared.config.write_behind_wait;
        loop {
            // Registered before the check, so a batch the write-behind finishes in between
            // still wakes this wait.
            let progressed = self.shared.progress_wake.notified();
            tokio::pin!(progressed);
            progressed.as_mut().enable();
            let (short, retry) = crate::manager::short_of_memory(reqs, &got);
            if short.is_empty() || l1.unwritten() == 0 {
                break;
            }
            // Woken as the write-behind finishes a batch (L1 may have room now), not polled.
            if tokio::time::timeout_at(deadline, progressed).await.is_err() {
                break;
            }
            for (i, r) in short.into_iter().zip(l1.reserve_write(&retry)) {
                got[i] = r;
            }
        }
        let refused = &self.shared.stats.prefetch_l1_refused;
        got.into_iter()
            .map(|r| match r {
                Ok(w) => Some(w),
                Err(L1Error::NotWritable) => None, // already resident (or being written)
                Err(_) => {
                    refused.fetch_add(1, Ordering::Relaxed);
                    None
                }
            })
            .collect()
    }

    fn finish(self) -> (usize, u64, Option<PrefetchTrouble>) {
        let (slot, shared) = (self.slot, self.shared);
        match &self.error {
            Some(e) => slot.failed(shared.epoch, e),
            None => slot.ok(),
        }
        slot.ledger.touch(&self.placed);
        // Loaded from L2: nothing for the write-behind to do.
        shared.l1.mark_written(&self.placed);
        slot.stats.loaded_keys.fetch_add(self.keys as u64, Ordering::Relaxed);
        slot.stats.loaded_bytes.fetch_add(self.bytes, Ordering::Relaxed);
        shared.stats.prefetch_loaded_keys.fetch_add(self.keys as u64, Ordering::Relaxed);
        shared.stats.prefetch_loaded_bytes.fetch_add(self.bytes, Ordering::Relaxed);
        (self.keys, self.bytes, self.trouble)
    }
}

/// Loads `keys` from one adapter into L1: straight into L1 reservations when the codec is
/// `none` and the stored length is known, through a buffer and the codec otherwise.
async fn load_from(
    shared: &Shared,
    slot: &AdapterSlot,
    keys: Vec<ObjectKey>,
    sizes: Vec<Option<u64>>,
) -> (usize, u64, Option<PrefetchTrouble>) {
    let direct_ok = matches!(*slot.built.codec, Codec::None);
    let mut tally = Tally::new(shared, slot);
    let mut sized: Vec<(usize, WriteRequest)> = Vec::new();
    let mut buffered: Vec<ObjectKey> = Vec::new();
    for (k, size) in keys.into_iter().zip(sizes) {
        let hlen = lmcache_l2::blob::header_len(&k);
        match size {
            Some(sz) if direct_ok && sz >= hlen as u64 => {
                sized.push((hlen, WriteRequest::new(k, sz - hlen as u64)));
            }
            _ => buffered.push(k),
        }
    }
    let reqs: Vec<WriteRequest> = sized.iter().map(|(_, r)| r.clone()).collect();
    let reserved = tally.reserve(&reqs).await;
    let direct: Vec<lmcache_l2::DirectItem> = sized
        .into_iter()
        .zip(reserved)
        .filter_map(|((hlen, req), w)| {
            let sink: Box<dyn PayloadSink> = Box::new(L1Sink(w?));
            Some((req.key, hlen, sink))
        })
        .collect();
    if !direct.is_empty() {
        let item_keys: Vec<ObjectKey> = direct.iter().map(|(k, _, _)| k.clone()).collect();
        for (key, (sink, r)) in item_keys.iter().zip(slot.built.adapter.load_direct(direct).await) {
            let Ok(w) = sink.into_any().downcast::<L1Sink>() else { continue };
            let w = w.0;
            match r {
                Ok(Some(header)) => {
                    let (bytes, xxh3) = (&header.bytes, header.payload_xxh3);
                    match lmcache_l2::blob::verify_parts_hashed(key, bytes, w.as_slice(), xxh3) {
                        Ok(h) if h.codec == slot.built.codec.id() => {
                            if w.commit().is_ok() {
                                tally.placed(key, h.raw_len);
                            }
                        }
                        Ok(h) => tally.refused(key, &format!("codec {} in blob", h.codec)),
                        Err(e) => tally.refused(key, &e.to_string()),
                    }
                }
                Ok(None) => tally.missed(None),
                Err(lmcache_l2::L2Error::Corrupt { source: e }) => {
                    tally.refused(key, &e.to_string())
                }
                Err(e) => tally.missed(Some(e)),
            }
            // A reservation not committed is discarded here, when `w` drops.
        }
    }
    if !buffered.is_empty() {
        let results = slot.built.adapter.load(&buffered).await;
        place(&mut tally, &buffered, results).await;
    }
    tally.finish()
}

/// Verifies, decodes and commits loaded blobs into L1.
async fn place(
    tally: &mut Tally<'_>,
    keys: &[ObjectKey],
    results: Vec<Result<Option<bytes::Bytes>, lmcache_l2::L2Error>>,
) {
    let codec = &tally.slot.built.codec;
    for (key, r) in keys.iter().zip(results) {
        let bytes = match r {
            Ok(Some(b)) => b,
            Ok(None) => {
                tally.missed(None);
                continue;
            }
            Err(e) => {
                tally.missed(Some(e));
                continue;
            }
        };
        let (header, payload) = match codec.open(key, &bytes) {
            Ok(x) => x,
            Err(e) => {
                tally.refused(key, &e.to_string());
                continue;
            }
        };
        let req = WriteRequest::new(key.clone(), header.raw_len);
        let Some(Some(mut w)) = tally.reserve(&[req]).await.pop() else { continue };
        if let Err(e) = codec.decode_into(key, payload, w.as_mut_slice()) {
            tally.refused(key, &e.to_string());
            continue; // the reservation is discarded on drop
        }
        if w.commit().is_ok() {
            tally.placed(key, header.raw_len);
        }
    }
}
