//! `raw_block`: fixed-size slots on a block device or a preallocated file, with the index
//! kept durable by a checkpoint plus a journal.
//!
//! ```text
//! [0, 4 KiB)                    superblock: magic, geometry, checksum
//! [4 KiB, 4 KiB + J)            journal: 64-byte records (put/delete slot), each checksummed
//! two checkpoint containers      header block (magic, sequence, length, checksum) + index
//! [meta_total_bytes, ...)        slots of slot_bytes, each holding one blob
//! ```
//! A store writes the blob into a free slot, then appends a `put` record naming the slot and
//! the blob's header checksum; only then does it report success. A delete (or the FIFO
//! eviction of a full device) appends a `delete` record before the slot is reused. When the
//! journal fills, the whole index is written to the older checkpoint container and the
//! journal restarts under the new checkpoint's sequence number.
//!
//! Recovery reads the newest valid checkpoint and replays the journal records of its
//! sequence, stopping at the first torn record; a `put` is accepted only when the slot's blob
//! header carries the recorded checksum. A kill -9 therefore loses at most the stores still in
//! flight, and every load re-verifies the whole blob, so a wrong or torn payload is a miss.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::blob::xxh3_64;
use async_trait::async_trait;
use bytes::Bytes;
use lmcache_core::ObjectKey;
use parking_lot::Mutex;

use lmcache_memory::FileRegion;

use super::aligned::{AlignedBuf, with_scratch};
use super::{blocking, blocking_each};
use crate::adapter::{
    DirectHeader, DirectItem, DirectResult, KeyFilter, KeyPage, L2Adapter, Stored,
};
use crate::blob::{self, Blob, PieceHasher};
use crate::error::L2Error;
use crate::wire_key;

const SUPER_MAGIC: &[u8; 8] = b"LMRSRBK1";
const CKPT_MAGIC: &[u8; 8] = b"LMRSCKP1";
const REC_MAGIC: u32 = 0x4a52_4e31;
const REC: usize = 64;
const OP_PUT: u8 = 1;
const OP_DEL: u8 = 2;
/// Checkpoint bytes of one entry with the shortest key: slot, length and checksum (24),
/// key length (2), and the wire key of a one-letter model without salt (77).
const MIN_CKPT_ENTRY: u64 = 24 + 2 + 77;

/// Settings of the raw_block adapter.
#[derive(Debug, Clone)]
pub struct RawBlockConfig {
    /// Block device or file.
    pub device_path: PathBuf,
    /// Bytes per slot (a multiple of `block_align`).
    pub slot_bytes: u64,
    /// Bytes of the device used; 0 = the device's (or existing file's) size.
    pub capacity_bytes: u64,
    /// Bypass the page cache for slot I/O.
    pub use_odirect: bool,
    /// I/O alignment (power of two).
    pub block_align: u64,
    /// Bytes reserved for superblock, journal and checkpoints.
    pub meta_total_bytes: u64,
    /// fdatasync after each journal append (survives power loss, slower).
    pub sync_journal: bool,
    /// Format a device or file that holds data but no raw_block superblock of this geometry
    /// (without it only a new or empty file, or one already ours, is used; anything else is
    /// refused and left as it was).
    pub format: bool,
}

/// Whether `sb` (the first 4 KiB) is a raw_block superblock of any geometry.
fn is_superblock(sb: &[u8]) -> bool {
    sb.len() >= 56 && &sb[0..8] == SUPER_MAGIC && xxh3_64(&sb[..48]) == le64(sb, 48)
}

/// The geometry a raw_block superblock records: what a device or file was formatted with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FormattedGeometry {
    /// I/O alignment.
    pub block_align: u64,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Bytes of the device used.
    pub capacity_bytes: u64,
    /// Bytes reserved for superblock, journal and checkpoints.
    pub meta_total_bytes: u64,
}

/// The geometry `path` was formatted with, if its first block is a raw_block superblock;
/// `None` for a missing or empty file, or one holding anything else.
pub fn formatted_geometry(path: &std::path::Path) -> Result<Option<FormattedGeometry>, L2Error> {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let mut sb = [0u8; 64];
    let mut got = 0;
    while got < sb.len() {
        match std::io::Read::read(&mut f, &mut sb[got..])? {
            0 => break,
            n => got += n,
        }
    }
    if !is_superblock(&sb[..got]) {
        return Ok(None);
    }
    Ok(Some(FormattedGeometry {
        block_align: le64(&sb, 16),
        slot_bytes: le64(&sb, 24),
        capacity_bytes: le64(&sb, 32),
        meta_total_bytes: le64(&sb, 40),
    }))
}

/// Writes an empty device's metadata: the superblock, a zeroed journal, empty checkpoints.
fn write_format(f: &std::fs::File, g: &Geometry) -> std::io::Result<()> {
    f.write_all_at(&g.superblock(), 0)?;
    f.write_all_at(&vec![0u8; g.journal_len as usize], g.journal_off)?;
    for off in g.ckpt_off {
        f.write_all_at(&[0u8; 4096], off)?;
    }
    Ok(())
}

/// A new (missing or empty) regular file is created whole under a temporary name, formatted,
/// synced and renamed into place: a crash while formatting leaves no half-made device that a
/// restart would then refuse as foreign.
fn create_formatted(c: &RawBlockConfig) -> Result<(), L2Error> {
    let fresh = match std::fs::metadata(&c.device_path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Ok(m) => m.is_file() && m.len() == 0,
        Err(e) => return Err(e.into()),
    };
    if !fresh {
        return Ok(());
    }
    let g = Geometry::new(c, c.capacity_bytes).map_err(|reason| L2Error::Invalid { reason })?;
    let name =
        c.device_path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = c.device_path.with_file_name(format!(".{name}.lmcache-rs-format.tmp"));
    let made = (|| -> std::io::Result<()> {
        let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&tmp)?;
        if let Err(e) =
            nix::fcntl::posix_fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, g.capacity as i64)
        {
            tracing::warn!(error = %e, "raw_block: cannot preallocate; using a sparse file");
            f.set_len(g.capacity)?;
        }
        write_format(&f, &g)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &c.device_path)
    })();
    if let Err(e) = made {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.into());
    }
    Ok(())
}

/// Refuses, before anything is written, a device or file that holds data but is not ours:
/// only a missing or empty regular file, or one whose first block is our superblock, may be
/// opened for writing unless `format` is set.
fn check_not_foreign(path: &std::path::Path, format: bool) -> Result<(), L2Error> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    if format || (meta.is_file() && meta.len() == 0) || formatted_geometry(path)?.is_some() {
        return Ok(());
    }
    Err(L2Error::unavailable(format!(
        "{}: holds data that is not an lmcache-rs raw_block device; refusing to touch it \
         (set \"format\": true in the adapter spec to format it)",
        path.display()
    )))
}

#[derive(Debug, Clone, Copy)]
struct Geometry {
    align: u64,
    slot: u64,
    capacity: u64,
    meta: u64,
    journal_off: u64,
    journal_len: u64,
    ckpt_off: [u64; 2],
    ckpt_len: u64,
    slots: u64,
}

impl Geometry {
    fn new(c: &RawBlockConfig, capacity: u64) -> Result<Self, String> {
        let a = c.block_align;
        if !a.is_power_of_two() || a < 512 {
            return Err(format!("block_align {a} must be a power of two >= 512"));
        }
        if c.slot_bytes == 0 || c.slot_bytes % a != 0 {
            return Err(format!("slot_bytes {} must be a positive multiple of {a}", c.slot_bytes));
        }
        if c.meta_total_bytes % a != 0 || c.meta_total_bytes < 16 * a {
            return Err(format!(
                "meta_total_bytes must be a multiple of {a} and at least {}",
                16 * a
            ));
        }
        let journal_off = a.max(4096);
        let journal_len = (c.meta_total_bytes / 4) / a * a;
        let ckpt_len = ((c.meta_total_bytes - journal_off - journal_len) / 2) / a * a;
        let ckpt_off = [journal_off + journal_len, journal_off + journal_len + ckpt_len];
        if capacity < c.meta_total_bytes + c.slot_bytes {
            return Err(format!(
                "capacity {capacity} cannot hold the {} metadata bytes and one slot",
                c.meta_total_bytes
            ));
        }
        let slots = (capacity - c.meta_total_bytes) / c.slot_bytes;
        // A checkpoint of a full device must fit its container, at least with the shortest
        // keys; longer keys make the checkpoint drop the oldest entries (see `checkpoint`).
        let need = slots.saturating_mul(MIN_CKPT_ENTRY).saturating_add(4096);
        if ckpt_len < need {
            let meta = c.meta_total_bytes;
            let want = (need * 2 + journal_off + meta / 4).next_multiple_of(a) * 4 / 3;
            return Err(format!(
                "meta_total_bytes {meta} cannot checkpoint the index of {slots} slots (each \
                 checkpoint container needs at least {need} bytes); use at least {want}"
            ));
        }
        Ok(Self {
            align: a,
            slot: c.slot_bytes,
            capacity,
            meta: c.meta_total_bytes,
            journal_off,
            journal_len,
            ckpt_off,
            ckpt_len,
            slots,
        })
    }

    fn slot_offset(&self, slot: u64) -> u64 {
        self.meta + slot * self.slot
    }

    fn superblock(&self) -> Vec<u8> {
        let mut b = vec![0u8; 4096];
        b[0..8].copy_from_slice(SUPER_MAGIC);
        for (i, v) in [1, self.align, self.slot, self.capacity, self.meta].iter().enumerate() {
            b[8 + i * 8..16 + i * 8].copy_from_slice(&v.to_le_bytes());
        }
        let sum = xxh3_64(&b[..48]);
        b[48..56].copy_from_slice(&sum.to_le_bytes());
        b
    }
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[derive(Debug, Clone)]
struct Entry {
    slot: u64,
    len: u64,
    hdr_sum: u64,
}

#[derive(Debug, Default)]
struct State {
    index: HashMap<ObjectKey, Entry>,
    by_slot: HashMap<u64, ObjectKey>,
    free: Vec<u64>,
    /// Slots in the order they were filled, for FIFO eviction when no slot is free.
    order: VecDeque<u64>,
    /// Sequence of the checkpoint the journal follows.
    epoch: u64,
    /// Next record number in the journal.
    next_rec: u64,
    /// Which container the next checkpoint goes to.
    next_ckpt: usize,
    evictions: u64,
    /// The journal region mapped: appends are copies into it (see [`FileRegion`]); `None`
    /// where it cannot be mapped, and appends are `pwrite`s.
    journal: Option<FileRegion>,
}

/// What recovery found, for logs and benchmarks.
#[derive(Debug, Clone, Copy, Default)]
pub struct Recovery {
    /// Keys in the recovered index.
    pub keys: usize,
    /// Journal records replayed.
    pub replayed: u64,
    /// Journal `put`s refused because the slot did not hold the recorded blob, and checkpoint
    /// entries refused as impossible (a length no slot holds, a slot or key named twice).
    pub refused: u64,
    /// Time recovery took.
    pub seconds: f64,
}

#[derive(Debug)]
struct Inner {
    config: RawBlockConfig,
    geo: Geometry,
    data: File,
    meta: File,
    state: Mutex<State>,
    recovery: Recovery,
}

/// The raw_block adapter.
#[derive(Debug, Clone)]
pub struct RawBlockAdapter {
    inner: Arc<Inner>,
}

impl RawBlockAdapter {
    /// Opens (formatting when blank) and recovers the index.
    pub fn open(config: RawBlockConfig) -> Result<Self, L2Error> {
        let t0 = Instant::now();
        check_not_foreign(&config.device_path, config.format)?;
        create_formatted(&config)?;
        let mut opts = OpenOptions::new();
        opts.read(true).write(true).create(true).truncate(false);
        let meta = opts.open(&config.device_path)?;
        let mut size = meta.metadata()?.len();
        if size == 0 {
            // A block device reports 0 here; ask it by seeking.
            use std::io::Seek;
            size = (&meta).seek(std::io::SeekFrom::End(0))?;
        }
        let capacity = if config.capacity_bytes > 0 { config.capacity_bytes } else { size };
        if capacity > size {
            // Allocate the blocks now (not a sparse file): writes into holes cost an
            // allocation each, and the device may fill up later instead of now.
            if let Err(e) = nix::fcntl::posix_fallocate(
                std::os::fd::AsRawFd::as_raw_fd(&meta),
                0,
                capacity as i64,
            ) {
                tracing::warn!(error = %e, "raw_block: cannot preallocate; using a sparse file");
                meta.set_len(capacity)?;
            }
        }
        let geo = Geometry::new(&config, capacity).map_err(|reason| L2Error::Invalid { reason })?;
        let mut dopts = OpenOptions::new();
        dopts.read(true).write(true);
        if config.use_odirect {
            dopts.custom_flags(libc::O_DIRECT);
        }
        let data = match dopts.open(&config.device_path) {
            Ok(f) => f,
            Err(e) if config.use_odirect => {
                tracing::warn!(error = %e, "raw_block: O_DIRECT refused; using buffered I/O");
                OpenOptions::new().read(true).write(true).open(&config.device_path)?
            }
            Err(e) => return Err(e.into()),
        };
        let mut inner = Inner {
            config,
            geo,
            data,
            meta,
            state: Mutex::new(State::default()),
            recovery: Recovery::default(),
        };
        inner.recovery = inner.recover()?;
        match usize::try_from(geo.journal_len).map_err(|e| e.to_string()).and_then(|len| {
            FileRegion::map(&inner.meta, geo.journal_off, len).map_err(|e| e.to_string())
        }) {
            Ok(j) => inner.state.get_mut().journal = Some(j),
            Err(e) => {
                tracing::warn!(error = %e, "raw_block: journal not mapped; appending with pwrite")
            }
        }
        inner.recovery.seconds = t0.elapsed().as_secs_f64();
        tracing::info!(
            keys = inner.recovery.keys,
            replayed = inner.recovery.replayed,
            refused = inner.recovery.refused,
            seconds = inner.recovery.seconds,
            "raw_block: index recovered"
        );
        Ok(Self { inner: Arc::new(inner) })
    }

    /// What recovery found at open.
    pub fn recovery(&self) -> Recovery {
        self.inner.recovery
    }

    /// Writes a checkpoint now (also done when the journal fills, and at close).
    pub fn checkpoint(&self) -> Result<(), L2Error> {
        let mut st = self.inner.state.lock();
        self.inner.checkpoint(&mut st)
    }
}

impl Inner {
    fn recover(&self) -> Result<Recovery, L2Error> {
        let g = self.geo;
        let mut sb = vec![0u8; 4096];
        self.meta.read_exact_at(&mut sb, 0)?;
        let mut rec = Recovery::default();
        let mut st = self.state.lock();
        let ours = is_superblock(&sb) && sb[..56] == g.superblock()[..56];
        if self.config.format && !ours {
            // Formatting was asked (new files were formatted whole before open).
            write_format(&self.meta, &g)?;
            st.free = (0..g.slots).rev().collect();
            return Ok(rec);
        }
        if !is_superblock(&sb) {
            return Err(L2Error::unavailable(format!(
                "{}: not an lmcache-rs raw_block device (bad superblock); refusing to overwrite it",
                self.config.device_path.display()
            )));
        }
        if sb[..56] != g.superblock()[..56] {
            return Err(L2Error::unavailable(format!(
                "{}: formatted with another geometry (slot_bytes, block_align, capacity or \
                 meta_total_bytes differ)",
                self.config.device_path.display()
            )));
        }
        // Newest valid checkpoint.
        let mut best: Option<(u64, usize, Vec<u8>)> = None;
        for (i, &off) in g.ckpt_off.iter().enumerate() {
            let mut h = [0u8; 4096];
            self.meta.read_exact_at(&mut h, off)?;
            if &h[0..8] != CKPT_MAGIC || xxh3_64(&h[..32]) != le64(&h, 32) {
                continue;
            }
            let (seq, len, sum) = (le64(&h, 8), le64(&h, 16), le64(&h, 24));
            if len > g.ckpt_len - 4096 {
                continue;
            }
            let mut p = vec![0u8; len as usize];
            self.meta.read_exact_at(&mut p, off + 4096)?;
            if xxh3_64(&p) != sum {
                continue;
            }
            if best.as_ref().is_none_or(|b| seq > b.0) {
                best = Some((seq, i, p));
            }
        }
        if let Some((seq, i, p)) = best {
            st.epoch = seq;
            st.next_ckpt = 1 - i;
            let mut at = 0;
            while at + 26 <= p.len() {
                let (slot, len, sum) = (le64(&p, at), le64(&p, at + 8), le64(&p, at + 16));
                let kl = u16::from_le_bytes([p[at + 24], p[at + 25]]) as usize;
                let Some(kb) = p.get(at + 26..at + 26 + kl) else { break };
                at += 26 + kl;
                let Some(key) = std::str::from_utf8(kb).ok().and_then(wire_key::decode) else {
                    continue;
                };
                // A checkpoint is checksummed, but what it says is still checked: a length
                // no slot can hold (a load would allocate it), or a slot or key named twice,
                // is dropped rather than trusted.
                let sane = slot < g.slots && len > 0 && len <= g.slot;
                if sane && !st.by_slot.contains_key(&slot) && !st.index.contains_key(&key) {
                    st.by_slot.insert(slot, key.clone());
                    st.index.insert(key, Entry { slot, len, hdr_sum: sum });
                    st.order.push_back(slot);
                } else {
                    rec.refused += 1;
                }
            }
        } else {
            st.next_ckpt = 0;
        }
        // Replay the journal of this epoch.
        let mut jr = vec![0u8; g.journal_len as usize];
        self.meta.read_exact_at(&mut jr, g.journal_off)?;
        let mut n = 0u64;
        for r in jr.chunks_exact(REC) {
            let ok = u32::from_le_bytes([r[0], r[1], r[2], r[3]]) == REC_MAGIC
                && xxh3_64(&r[..56]) == le64(r, 56)
                && le64(r, 8) == st.epoch
                && le64(r, 16) == n;
            if !ok {
                break;
            }
            let (op, slot, len, sum) = (r[4], le64(r, 24), le64(r, 32), le64(r, 40));
            n += 1;
            rec.replayed += 1;
            if slot >= g.slots {
                continue;
            }
            if let Some(old) = st.by_slot.remove(&slot) {
                st.index.remove(&old);
                st.order.retain(|&s| s != slot);
            }
            if op == OP_PUT {
                match self.read_header(slot) {
                    Some(h) if h.1 == sum && h.0.blob_len() == len => {
                        if let Some(key) = wire_key::decode(&h.0.wire_key) {
                            if let Some(prev) =
                                st.index.insert(key.clone(), Entry { slot, len, hdr_sum: sum })
                            {
                                st.by_slot.remove(&prev.slot);
                                st.order.retain(|&s| s != prev.slot);
                            }
                            st.by_slot.insert(slot, key);
                            st.order.push_back(slot);
                        }
                    }
                    _ => rec.refused += 1,
                }
            }
        }
        st.next_rec = n;
        let used: std::collections::HashSet<u64> = st.by_slot.keys().copied().collect();
        st.free = (0..g.slots).rev().filter(|s| !used.contains(s)).collect();
        rec.keys = st.index.len();
        if n > 0 {
            self.checkpoint(&mut st)?;
        }
        Ok(rec)
    }

    /// The blob header stored in `slot` and its header checksum.
    fn read_header(&self, slot: u64) -> Option<(blob::Header, u64)> {
        let a = self.geo.align as usize;
        let mut buf = AlignedBuf::new(a.max(4096), a);
        self.data.read_exact_at(buf.as_mut_slice(), self.geo.slot_offset(slot)).ok()?;
        let b = buf.as_mut_slice();
        let h = blob::parse_header(b).ok()?;
        Some((h, le64(b, 56)))
    }

    fn append(&self, st: &mut State, op: u8, slot: u64, len: u64, sum: u64) -> Result<(), L2Error> {
        if (st.next_rec + 1) * REC as u64 > self.geo.journal_len {
            self.checkpoint(st)?;
        }
        let mut r = [0u8; REC];
        r[0..4].copy_from_slice(&REC_MAGIC.to_le_bytes());
        r[4] = op;
        for (i, v) in [st.epoch, st.next_rec, slot, len, sum].iter().enumerate() {
            r[8 + i * 8..16 + i * 8].copy_from_slice(&v.to_le_bytes());
        }
        let s = xxh3_64(&r[..56]);
        r[56..64].copy_from_slice(&s.to_le_bytes());
        let at = st.next_rec * REC as u64;
        match st.journal.as_mut() {
            // A copy into the mapped journal takes no inode lock, where a `pwrite` would wait
            // for every O_DIRECT slot write in flight (and hold back the next ones).
            Some(j) => j
                .write(at as usize, &r)
                .map_err(|e| L2Error::transient(format!("raw_block journal: {e}")))?,
            None => self.meta.write_all_at(&r, self.geo.journal_off + at)?,
        }
        if self.config.sync_journal {
            self.meta.sync_data()?;
        }
        st.next_rec += 1;
        Ok(())
    }

    fn checkpoint(&self, st: &mut State) -> Result<(), L2Error> {
        let g = self.geo;
        // Keys too long for the container: drop the oldest entries (it is a cache; their
        // slots become free) rather than fail every store, or every restart, from now on.
        let size = |k: &ObjectKey| 26 + wire_key::encode(k).len() as u64;
        let mut total: u64 = st.index.keys().map(size).sum();
        let mut dropped = 0u64;
        while total > g.ckpt_len - 4096 {
            let Some(victim) = st.order.pop_front() else { break };
            if let Some(k) = st.by_slot.remove(&victim) {
                total -= size(&k);
                st.index.remove(&k);
                st.free.push(victim);
                st.evictions += 1;
                dropped += 1;
            }
        }
        if dropped > 0 {
            tracing::warn!(
                dropped,
                path = %self.config.device_path.display(),
                "raw_block: keys too long for the checkpoint area; dropped the oldest entries \
                 (raise meta_total_bytes)"
            );
        }
        let mut p = Vec::with_capacity(st.index.len() * 128);
        for (k, e) in &st.index {
            let wk = wire_key::encode(k);
            p.extend_from_slice(&e.slot.to_le_bytes());
            p.extend_from_slice(&e.len.to_le_bytes());
            p.extend_from_slice(&e.hdr_sum.to_le_bytes());
            p.extend_from_slice(&(wk.len() as u16).to_le_bytes());
            p.extend_from_slice(wk.as_bytes());
        }
        if p.len() as u64 > g.ckpt_len - 4096 {
            return Err(L2Error::Full {
                what: "checkpoint area (raise meta_total_bytes)",
                needed: p.len() as u64,
                limit: g.ckpt_len - 4096,
            });
        }
        let seq = st.epoch + 1;
        let mut h = vec![0u8; 4096];
        h[0..8].copy_from_slice(CKPT_MAGIC);
        h[8..16].copy_from_slice(&seq.to_le_bytes());
        h[16..24].copy_from_slice(&(p.len() as u64).to_le_bytes());
        h[24..32].copy_from_slice(&xxh3_64(&p).to_le_bytes());
        let hs = xxh3_64(&h[..32]);
        h[32..40].copy_from_slice(&hs.to_le_bytes());
        let off = g.ckpt_off[st.next_ckpt];
        // Payload first, header last: a torn pair fails its checksum and the other container
        // (with the journal of its epoch, untouched until now) is used.
        self.meta.write_all_at(&p, off + 4096)?;
        self.meta.write_all_at(&h, off)?;
        if self.config.sync_journal {
            self.meta.sync_data()?;
        }
        st.epoch = seq;
        st.next_rec = 0;
        st.next_ckpt = 1 - st.next_ckpt;
        Ok(())
    }

    fn store_one(&self, key: &ObjectKey, blob: &Blob) -> Result<Stored, L2Error> {
        let g = self.geo;
        let len = blob.len() as u64;
        if len > g.slot {
            return Err(L2Error::Full { what: "slot_bytes", needed: len, limit: g.slot });
        }
        let slot = {
            let mut st = self.state.lock();
            if st.index.contains_key(key) {
                return Ok(Stored::AlreadyPresent);
            }
            match st.free.pop() {
                Some(s) => s,
                None => {
                    // FIFO eviction: the oldest filled slot.
                    let Some(victim) = st.order.pop_front() else {
                        return Err(L2Error::Full { what: "free slots", needed: 1, limit: 0 });
                    };
                    self.append(&mut st, OP_DEL, victim, 0, 0)?;
                    if let Some(k) = st.by_slot.remove(&victim) {
                        st.index.remove(&k);
                    }
                    st.evictions += 1;
                    victim
                }
            }
        };
        let written = {
            let a = g.align as usize;
            let padded = (len as usize).div_ceil(a) * a;
            let n = blob.len();
            with_scratch(padded, a, |buf| {
                blob.write_into(&mut buf[..n]);
                buf[n..].fill(0);
                self.data.write_all_at(buf, g.slot_offset(slot))
            })
        };
        let mut st = self.state.lock();
        if let Err(e) = written {
            st.free.push(slot);
            return Err(e.into());
        }
        let sum = le64(blob.header(), 56);
        if let Err(e) = self.append(&mut st, OP_PUT, slot, len, sum) {
            st.free.push(slot);
            return Err(e);
        }
        if let Some(prev) = st.index.insert(key.clone(), Entry { slot, len, hdr_sum: sum }) {
            // A concurrent store of the same key won the race; keep the newer slot.
            st.by_slot.remove(&prev.slot);
            st.order.retain(|&s| s != prev.slot);
            st.free.push(prev.slot);
        }
        st.by_slot.insert(slot, key.clone());
        st.order.push_back(slot);
        Ok(Stored::Written(len))
    }

    fn load_one(&self, key: &ObjectKey) -> Result<Option<Bytes>, L2Error> {
        let Some(e) = self.state.lock().index.get(key).cloned() else { return Ok(None) };
        let a = self.geo.align as usize;
        let padded = (e.len as usize).div_ceil(a) * a;
        let mut buf = AlignedBuf::new(padded, a);
        self.data.read_exact_at(buf.as_mut_slice(), self.geo.slot_offset(e.slot))?;
        Ok(Some(buf.into_bytes(e.len as usize)))
    }

    /// Loads `key`'s blob whose header is `hlen` bytes: the payload into `dest` (through this
    /// thread's aligned scratch buffer), the header returned. A blob of another length is a
    /// miss; the caller verifies both parts.
    fn load_direct_one(
        &self,
        key: &ObjectKey,
        hlen: usize,
        dest: &mut [u8],
    ) -> Result<Option<DirectHeader>, L2Error> {
        let Some(e) = self.state.lock().index.get(key).cloned() else { return Ok(None) };
        if e.len != (hlen + dest.len()) as u64 {
            return Ok(None);
        }
        let a = self.geo.align as usize;
        let padded = (e.len as usize).div_ceil(a) * a;
        with_scratch(padded, a, |buf| {
            self.data.read_exact_at(buf, self.geo.slot_offset(e.slot))?;
            let xxh3 = PieceHasher::copy(dest, &buf[hlen..hlen + dest.len()]);
            Ok(Some(DirectHeader { bytes: buf[..hlen].to_vec(), payload_xxh3: Some(xxh3) }))
        })
    }

    fn delete_one(&self, key: &ObjectKey) -> Result<bool, L2Error> {
        let mut st = self.state.lock();
        let Some(e) = st.index.get(key).cloned() else { return Ok(false) };
        self.append(&mut st, OP_DEL, e.slot, 0, 0)?;
        st.index.remove(key);
        st.by_slot.remove(&e.slot);
        st.order.retain(|&s| s != e.slot);
        st.free.push(e.slot);
        Ok(true)
    }
}

#[async_trait]
impl L2Adapter for RawBlockAdapter {
    fn kind(&self) -> &'static str {
        "raw_block"
    }

    async fn store(&self, items: Vec<(ObjectKey, Blob)>) -> Vec<Result<Stored, L2Error>> {
        let inner = self.inner.clone();
        blocking_each(items, move |(k, b)| inner.store_one(k, b)).await
    }

    async fn lookup(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, L2Error> {
        let st = self.inner.state.lock();
        Ok(keys.iter().map(|k| st.index.contains_key(k)).collect())
    }

    async fn lookup_sized(&self, keys: &[ObjectKey]) -> Result<Vec<Option<u64>>, L2Error> {
        let st = self.inner.state.lock();
        Ok(keys.iter().map(|k| st.index.get(k).map(|e| e.len)).collect())
    }

    async fn load(&self, keys: &[ObjectKey]) -> Vec<Result<Option<Bytes>, L2Error>> {
        let inner = self.inner.clone();
        blocking_each(keys.to_vec(), move |k| inner.load_one(k)).await
    }

    /// Each item on its own blocking thread: the device serves several reads at once (a
    /// request's chunks read back in parallel, where one after the other left it idle between
    /// them).
    async fn load_direct(&self, items: Vec<DirectItem>) -> Vec<DirectResult> {
        let reads = items.into_iter().map(|(k, hlen, mut sink)| {
            let inner = self.inner.clone();
            async move {
                blocking(move || {
                    let r = inner.load_direct_one(&k, hlen, sink.payload_mut());
                    (sink, r)
                })
                .await
            }
        });
        // A read whose thread failed took its sink with it: answer none rather than a list
        // the caller would pair with the wrong keys (their reservations are discarded).
        futures_util::future::join_all(reads)
            .await
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap_or_default()
    }

    async fn delete(&self, keys: &[ObjectKey]) -> Result<u64, L2Error> {
        let inner = self.inner.clone();
        let keys = keys.to_vec();
        blocking(move || {
            let mut n = 0;
            for k in &keys {
                if inner.delete_one(k)? {
                    n += 1;
                }
            }
            Ok(n)
        })
        .await?
    }

    async fn list(
        &self,
        filter: &KeyFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<KeyPage, L2Error> {
        let st = self.inner.state.lock();
        let keys = st.index.iter().map(|(k, e)| (k, e.len));
        Ok(crate::adapter::page_keys(keys, filter, cursor, limit))
    }

    fn capacity(&self) -> Option<u64> {
        Some(self.inner.geo.slots * self.inner.geo.slot)
    }

    fn describe(&self) -> serde_json::Value {
        let g = self.inner.geo;
        let st = self.inner.state.lock();
        serde_json::json!({
            "type": "raw_block",
            "device_path": self.inner.config.device_path,
            "slot_bytes": g.slot,
            "slots": g.slots,
            "slots_used": st.index.len(),
            "use_odirect": self.inner.config.use_odirect,
            "evictions": st.evictions,
            "recovery_seconds": self.inner.recovery.seconds,
            "recovered_keys": self.inner.recovery.keys,
        })
    }

    async fn close(&self) {
        if let Err(e) = self.checkpoint() {
            tracing::warn!(error = %e, "raw_block: final checkpoint failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(path: PathBuf) -> RawBlockConfig {
        RawBlockConfig {
            device_path: path,
            slot_bytes: 8192,
            capacity_bytes: (64 << 10) + 16 * 8192,
            use_odirect: false,
            block_align: 4096,
            meta_total_bytes: 64 << 10,
            sync_journal: false,
            format: false,
        }
    }

    /// A checkpoint's entries are checksummed but still checked: one whose length no slot can
    /// hold (a load allocated it: overflow or abort), or that names a slot or key twice, is
    /// refused at recovery, and the rest of the index is kept. (Found writing the
    /// raw_block_recovery fuzz target.)
    #[test]
    fn impossible_checkpoint_entries_are_refused_at_recovery() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev");
        let a = RawBlockAdapter::open(config(path.clone())).unwrap();
        let keys: Vec<ObjectKey> =
            (0..4u8).map(|i| ObjectKey::new([i; 32], "m", 1, 0, 0, "").unwrap()).collect();
        for k in &keys {
            let blob = crate::Codec::None.encode(k, Bytes::from(vec![1u8; 100])).unwrap();
            a.inner.store_one(k, &blob).unwrap();
        }
        {
            let mut st = a.inner.state.lock();
            st.index.get_mut(&keys[0]).unwrap().len = u64::MAX / 2;
            let slot1 = st.index[&keys[1]].slot;
            st.index.get_mut(&keys[2]).unwrap().slot = slot1;
            a.inner.checkpoint(&mut st).unwrap();
        }
        drop(a);
        let b = RawBlockAdapter::open(config(path)).unwrap();
        assert!(b.recovery().refused >= 2, "{:?}", b.recovery());
        for k in &keys[..1] {
            assert!(b.inner.load_one(k).unwrap().is_none(), "an impossible length was kept");
        }
        assert!(b.inner.load_one(&keys[3]).unwrap().is_some(), "a sound entry was dropped");
    }
}
