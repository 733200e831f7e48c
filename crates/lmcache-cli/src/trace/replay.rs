//! Replaying a storage-level trace against a fresh storage manager (ours, built from the
//! replay side's `server` flags), as LMCache's `lmcache trace replay` replays one against its
//! own:
//!
//! | recorded call | replayed as |
//! |---|---|
//! | `submit_prefetch_task(spec)` | one lookup per key group (shards by `kv_rank`), `num_kv_readers` locks per hit; an L2 prefetch settles in the background |
//! | `reserve_write(keys, layout_desc)` | L1 reservations of the layout's size (refusals counted, not failures: LMCache's call returns what it could reserve) |
//! | `finish_write(keys)` | commits those reservations |
//! | `finish_read_prefetched(keys, read_locks)` | releases that many locks per key |
//! | `read_prefetched_results.__enter__/__exit__(keys)` | read-locks the keys (a miss is counted) / releases them |
//!
//! Beyond LMCache's per-call latency, the replay reports what the storage did: lookup hit
//! rate (L1 and L2), reservations refused, reads that missed.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use lmcache_core::ObjectKey;
use lmcache_l1::{ReadLease, WriteRequest, WriteReservation};
use lmcache_storage::{Lookup, LookupRequest, StorageManager};
use lmcache_workload::trace::Record;
use lmcache_workload::trace::codec::{self, LayoutDesc, PrefetchSpec};

/// How long a read waits for a lookup's L2 prefetch to settle.
const SETTLE_WAIT: Duration = Duration::from_secs(10);

/// What the replayed calls did to the storage.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Outcome {
    /// Key groups looked up.
    pub lookups: u64,
    /// Chunks asked for (per shard).
    pub lookup_chunks: u64,
    /// Chunks found in L1 at lookup.
    pub l1_hit_chunks: u64,
    /// Chunks L2 prefetches added.
    pub l2_hit_chunks: u64,
    /// Keys reserved for writing.
    pub reserved: u64,
    /// Keys L1 refused to reserve (out of memory, already resident or being written).
    pub reserve_refused: u64,
    /// Reservations committed.
    pub committed: u64,
    /// Keys a `finish_write` named with no reservation held.
    pub finish_without_reserve: u64,
    /// Locks released by `finish_read_prefetched`.
    pub locks_released: u64,
    /// Locks `finish_read_prefetched` asked to release that no lookup held (a lookup that
    /// missed here but hit when recorded).
    pub locks_not_held: u64,
    /// Keys read-locked by `read_prefetched_results`.
    pub reads: u64,
    /// Keys `read_prefetched_results` did not find.
    pub read_misses: u64,
}

impl Outcome {
    /// Hit chunks over chunks asked for.
    pub fn hit_rate(&self) -> f64 {
        if self.lookup_chunks == 0 {
            0.0
        } else {
            (self.l1_hit_chunks + self.l2_hit_chunks) as f64 / self.lookup_chunks as f64
        }
    }
}

/// A record that could not be replayed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// No handler for it (a newer trace level, or a call this build does not replay).
    #[error("no handler for {0}")]
    Unknown(String),
    /// Its arguments do not decode.
    #[error(transparent)]
    Decode(#[from] codec::CodecError),
}

struct PendingEntry {
    lookup: Lookup,
    shards: Vec<(u32, Vec<ObjectKey>)>,
    readers: u32,
}

/// The replay state: the storage manager and what the replayed calls hold.
pub struct Replayer {
    storage: StorageManager,
    writes: HashMap<ObjectKey, VecDeque<WriteReservation>>,
    locks: HashMap<ObjectKey, VecDeque<ReadLease>>,
    pending: Vec<PendingEntry>,
    open_reads: HashMap<Vec<ObjectKey>, VecDeque<Vec<ReadLease>>>,
    /// What the calls did.
    pub outcome: Outcome,
}

fn keys_arg(r: &Record) -> Result<Vec<ObjectKey>, codec::CodecError> {
    let v = r.arg("keys").ok_or_else(|| codec::CodecError {
        what: "keys".into(),
        why: format!("{} without keys", r.qualname),
    })?;
    codec::read_object_keys(v, "keys")
}

impl Replayer {
    /// A replay into `storage` (fresh: nothing held).
    pub fn new(storage: StorageManager) -> Self {
        Self {
            storage,
            writes: HashMap::new(),
            locks: HashMap::new(),
            pending: Vec::new(),
            open_reads: HashMap::new(),
            outcome: Outcome::default(),
        }
    }

    /// The storage manager replayed into.
    #[cfg(test)]
    pub fn storage(&self) -> &StorageManager {
        &self.storage
    }

    /// Locks the replay holds (from lookups, not yet released).
    #[cfg(test)]
    pub fn locks_held(&self) -> usize {
        self.locks.values().map(VecDeque::len).sum()
    }

    /// Replays one record.
    pub fn apply(&mut self, r: &Record) -> Result<(), ReplayError> {
        self.settle(false);
        match r.qualname.as_str() {
            codec::SUBMIT_PREFETCH => {
                let spec = r.arg("spec").ok_or_else(|| codec::CodecError {
                    what: "spec".into(),
                    why: "submit_prefetch_task without a spec".into(),
                })?;
                let spec = PrefetchSpec::read(spec)?;
                self.lookup(&spec);
            }
            codec::RESERVE_WRITE => {
                let keys = keys_arg(r)?;
                let layout = r.arg("layout_desc").ok_or_else(|| codec::CodecError {
                    what: "layout_desc".into(),
                    why: "reserve_write without a layout".into(),
                })?;
                let layout = LayoutDesc::read(layout)?;
                let size = layout.bytes().ok_or_else(|| codec::CodecError {
                    what: "layout_desc".into(),
                    why: format!("cannot size {:?} of {:?}", layout.shapes, layout.dtypes),
                })?;
                let reqs: Vec<WriteRequest> =
                    keys.iter().map(|k| WriteRequest::new(k.clone(), size)).collect();
                for (k, res) in keys.into_iter().zip(self.storage.reserve_write(&reqs)) {
                    match res {
                        Ok(w) => {
                            self.outcome.reserved += 1;
                            self.writes.entry(k).or_default().push_back(w);
                        }
                        Err(_) => self.outcome.reserve_refused += 1,
                    }
                }
            }
            codec::FINISH_WRITE => {
                let mut batch = Vec::new();
                for k in keys_arg(r)? {
                    match self.writes.get_mut(&k).and_then(VecDeque::pop_front) {
                        Some(w) => batch.push(w),
                        None => self.outcome.finish_without_reserve += 1,
                    }
                    if self.writes.get(&k).is_some_and(VecDeque::is_empty) {
                        self.writes.remove(&k);
                    }
                }
                let ok = self.storage.commit(batch).into_iter().filter(Result::is_ok).count();
                self.outcome.committed += ok as u64;
            }
            codec::FINISH_READ => {
                let keys = keys_arg(r)?;
                let n = r.arg("read_locks").and_then(rmpv::Value::as_u64).unwrap_or(1);
                self.settle(true);
                for k in &keys {
                    for _ in 0..n {
                        match self.locks.get_mut(k).and_then(VecDeque::pop_front) {
                            Some(lease) => {
                                drop(lease);
                                self.outcome.locks_released += 1;
                            }
                            None => self.outcome.locks_not_held += 1,
                        }
                    }
                    if self.locks.get(k).is_some_and(VecDeque::is_empty) {
                        self.locks.remove(k);
                    }
                }
                self.storage.touch(&keys);
            }
            codec::READ_ENTER => {
                let keys = keys_arg(r)?;
                self.settle(true);
                let mut held = Vec::with_capacity(keys.len());
                for res in self.storage.retrieve_leases(Vec::new(), &keys) {
                    match res {
                        Ok(l) => {
                            self.outcome.reads += 1;
                            held.push(l);
                        }
                        Err(_) => self.outcome.read_misses += 1,
                    }
                }
                self.open_reads.entry(keys).or_default().push_back(held);
            }
            codec::READ_EXIT => {
                let keys = keys_arg(r)?;
                if let Some(q) = self.open_reads.get_mut(&keys) {
                    q.pop_front();
                    if q.is_empty() {
                        self.open_reads.remove(&keys);
                    }
                } else {
                    tracing::warn!(
                        keys = keys.len(),
                        "read_prefetched_results.__exit__ with no matching __enter__; ignored"
                    );
                }
            }
            other => return Err(ReplayError::Unknown(other.to_owned())),
        }
        Ok(())
    }

    fn lookup(&mut self, spec: &PrefetchSpec) {
        let readers = spec.num_kv_readers.max(1);
        for g in &spec.key_groups {
            // Shards in order of first appearance, each with its keys in prefix order.
            let mut shards: Vec<(u32, Vec<ObjectKey>)> = Vec::new();
            for k in &g.keys {
                let w = k.kv_rank.worker_id();
                match shards.iter_mut().find(|(x, _)| *x == w) {
                    Some((_, ks)) => ks.push(k.clone()),
                    None => shards.push((w, vec![k.clone()])),
                }
            }
            let Some(world) = g.keys.first().map(|k| k.kv_rank.world_size()) else { continue };
            let req = LookupRequest { shards: shards.clone(), world_size: world, readers };
            let chunks = req.chunks() as u64;
            self.outcome.lookups += 1;
            self.outcome.lookup_chunks += chunks;
            let lookup = self.storage.lookup(&req);
            self.outcome.l1_hit_chunks += lookup.l1_hit() as u64;
            let entry = PendingEntry { lookup, shards, readers };
            if entry.lookup.is_pending() {
                self.pending.push(entry);
            } else {
                self.hold(entry);
            }
        }
    }

    /// Moves a ready lookup's locks into the per-key table, one lease per lock.
    fn hold(&mut self, mut e: PendingEntry) {
        let Some(hits) = e.lookup.hits() else { return };
        let leases = e.lookup.leases_mut();
        for (w, keys) in &e.shards {
            for (i, k) in keys.iter().enumerate().take(hits) {
                for _ in 0..e.readers {
                    if let Some(Some(l)) = leases.take_one(*w as usize, i..i + 1).pop() {
                        self.locks.entry(k.clone()).or_default().push_back(l);
                    }
                }
            }
        }
    }

    /// Joins finished L2 prefetches' locks (waiting for them when `wait`).
    fn settle(&mut self, wait: bool) {
        if self.pending.is_empty() {
            return;
        }
        let deadline = Instant::now() + SETTLE_WAIT;
        let mut still = Vec::new();
        for mut e in std::mem::take(&mut self.pending) {
            if wait && let Some(w) = e.lookup.waiter() {
                w.wait(deadline.saturating_duration_since(Instant::now()));
            }
            match e.lookup.settle() {
                Some(s) => {
                    self.outcome.l2_hit_chunks += s.l2_hits as u64;
                    self.hold(e);
                }
                None => still.push(e),
            }
        }
        self.pending = still;
    }

    /// Ends the replay: waits for prefetches, then releases every lock and reservation held
    /// (LMCache's replay force-exits dangling read contexts the same way).
    pub fn finish(&mut self) {
        self.settle(true);
        self.pending.clear();
        self.open_reads.clear();
        self.locks.clear();
        self.writes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lmcache_memory::{Arena, ArenaAllocator, ArenaBacking, ArenaConfig};
    use lmcache_workload::trace::codec::{KeyGroup, args, object_keys};

    fn storage(bytes: u64) -> StorageManager {
        let arena = Arena::create(&ArenaConfig {
            size: bytes,
            backing: ArenaBacking::Anonymous,
            mlock: false,
        })
        .unwrap();
        let mem = ArenaAllocator::new(arena, 4096).unwrap();
        let l1 = lmcache_l1::L1Cache::new(lmcache_l1::L1Config::default(), mem).unwrap();
        StorageManager::new(l1, None)
    }

    fn key(i: u8) -> ObjectKey {
        ObjectKey::new([i; 32], "m", 1, 0, 0, "").unwrap()
    }

    fn rec(q: &str, a: rmpv::Value) -> Record {
        Record { t_mono: 0.0, t_wall: 0.0, qualname: q.into(), args: a }
    }

    fn layout() -> LayoutDesc {
        LayoutDesc { shapes: vec![vec![2, 2, 16, 64]], dtypes: vec!["torch.float16".into()] }
    }

    fn lookup(keys: &[ObjectKey], readers: u32) -> Record {
        let spec = PrefetchSpec {
            key_groups: vec![KeyGroup {
                keys: keys.to_vec(),
                object_group_id: 0,
                layout: Some(layout()),
                sliding_window_size: -1,
            }],
            num_kv_readers: readers,
            fetching_policy: "prefix".into(),
            lock_mode: "LOCK".into(),
        };
        rec(codec::SUBMIT_PREFETCH, args(vec![("spec", spec.to_value())]))
    }

    #[test]
    fn a_cold_then_warm_request_replays_as_a_miss_then_a_hit_and_releases_its_locks() {
        let mut r = Replayer::new(storage(16 << 20));
        let keys: Vec<ObjectKey> = (1..=4).map(key).collect();
        r.apply(&lookup(&keys, 1)).unwrap();
        r.apply(&rec(
            codec::RESERVE_WRITE,
            args(vec![("keys", object_keys(&keys)), ("layout_desc", layout().to_value())]),
        ))
        .unwrap();
        r.apply(&rec(codec::FINISH_WRITE, args(vec![("keys", object_keys(&keys))]))).unwrap();
        r.apply(&lookup(&keys, 2)).unwrap();
        assert_eq!(r.locks_held(), 8);
        r.apply(&rec(
            codec::FINISH_READ,
            args(vec![("keys", object_keys(&keys)), ("read_locks", 1.into())]),
        ))
        .unwrap();
        assert_eq!(r.locks_held(), 4);
        let o = r.outcome.clone();
        assert_eq!((o.lookups, o.lookup_chunks, o.l1_hit_chunks), (2, 8, 4));
        assert_eq!((o.reserved, o.committed, o.locks_released), (4, 4, 4));
        assert!((o.hit_rate() - 0.5).abs() < 1e-9);
        // A lock still held keeps its object from eviction; finishing releases it.
        r.finish();
        assert_eq!(r.locks_held(), 0);
        assert_eq!(r.storage().l1().usage().locked_objects, 0);
    }

    #[test]
    fn reads_of_missing_keys_are_counted_and_unknown_calls_are_refused_by_name() {
        let mut r = Replayer::new(storage(16 << 20));
        let keys = vec![key(9)];
        r.apply(&rec(codec::READ_ENTER, args(vec![("keys", object_keys(&keys))]))).unwrap();
        r.apply(&rec(codec::READ_EXIT, args(vec![("keys", object_keys(&keys))]))).unwrap();
        assert_eq!(r.outcome.read_misses, 1);
        r.apply(&rec(
            codec::FINISH_READ,
            args(vec![("keys", object_keys(&keys)), ("read_locks", 2.into())]),
        ))
        .unwrap();
        assert_eq!(r.outcome.locks_not_held, 2);
        let e = r.apply(&rec("x.y.z", args(vec![]))).unwrap_err();
        assert!(matches!(e, ReplayError::Unknown(ref q) if q == "x.y.z"), "{e}");
        let e = r
            .apply(&rec(codec::RESERVE_WRITE, args(vec![("keys", object_keys(&keys))])))
            .unwrap_err();
        assert!(e.to_string().contains("layout"), "{e}");
    }

    #[test]
    fn a_full_l1_refuses_reservations_without_failing_the_record() {
        let mut r = Replayer::new(storage(1 << 20));
        let keys: Vec<ObjectKey> = (1..=20).map(key).collect();
        let big =
            LayoutDesc { shapes: vec![vec![2, 2, 64, 512]], dtypes: vec!["torch.bfloat16".into()] };
        r.apply(&rec(
            codec::RESERVE_WRITE,
            args(vec![("keys", object_keys(&keys)), ("layout_desc", big.to_value())]),
        ))
        .unwrap();
        assert!(r.outcome.reserve_refused > 0);
        assert_eq!(r.outcome.reserved + r.outcome.reserve_refused, 20);
    }
}
