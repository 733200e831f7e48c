//! `dax`: LMCache's DAX L2 adapter: fixed-size slots in a `/dev/dax` device, pmem, or any
//! file, and an index in memory. As LMCache's, nothing survives a restart (the index is
//! volatile; the device starts empty each time). A device (`/dev/dax` takes only `mmap`) is
//! mapped and objects are copied in and out (bounds-checked, through [`FileRegion`]); a
//! regular file (a DAX or pmem file system, tmpfs) takes positional reads and writes, which
//! run in parallel and spare the page zeroing that first touches of a shared mapping cost on
//! a page-cache file system (BENCHMARKS.md, nineteenth session).
//!
//! ```text
//! [0, 2 MiB)            superblock: magic, slot_bytes, slots, checksum
//! [2 MiB, ...)          slots of slot_bytes, each holding one blob
//! ```
//! `{"type": "dax", "device_path": "/dev/dax0.0", "max_dax_size_gb": 64, "slot_bytes": N}`
//! (LMCache's fields; `"format": true` to take a device that holds something else). Only a
//! missing or empty file, or one whose superblock is ours, is used otherwise, and the device
//! is `flock`ed while mapped: an L1 on it (`--l1-devdax-path`), or another server's L2, is
//! refused by name rather than shared. A blob longer than a slot, or a store into a full
//! device, fails as full; the tier's capacity ledger (`max_capacity_gb` with an `eviction`
//! block) evicts ahead of that. A slot deleted while being read may be rewritten under the
//! reader: the blob checks turn that into a miss.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use lmcache_core::ObjectKey;
use lmcache_memory::FileRegion;
use nix::fcntl::{Flock, FlockArg};
use parking_lot::{Mutex, RwLock};

use super::{blocking, blocking_each};
use crate::adapter::{
    DirectHeader, DirectItem, DirectResult, KeyFilter, KeyPage, L2Adapter, Stored,
};
use crate::blob::{Blob, PieceHasher, xxh3_64};
use crate::error::L2Error;

const MAGIC: &[u8; 8] = b"LMRSDAX1";
/// The superblock's block: the slots start here (a DAX device maps in 2 MiB pages).
const HEADER: u64 = 2 << 20;
const SUPER_LEN: usize = 40;

/// Settings of the dax adapter.
#[derive(Debug, Clone)]
pub struct DaxConfig {
    /// The device or file.
    pub device_path: PathBuf,
    /// Bytes of it to use.
    pub size: u64,
    /// Bytes per slot (at least a blob's header).
    pub slot_bytes: u64,
    /// Take a device or file that holds something other than our superblock.
    pub format: bool,
}

#[derive(Debug, Default)]
struct Index {
    objects: HashMap<ObjectKey, (u32, u64)>,
    free: Vec<u32>,
}

/// How the slots are reached.
#[derive(Debug)]
enum Media {
    /// A device: mapped (a write excludes other copies).
    Mapped(RwLock<FileRegion>),
    /// A regular file: `pread`/`pwrite`, in parallel.
    File(File),
}

impl Media {
    fn write(&self, at: u64, parts: [&[u8]; 2]) -> Result<(), L2Error> {
        match self {
            Media::Mapped(r) => {
                let mut r = r.write();
                let mut off = at as usize;
                for p in parts {
                    r.write(off, p)
                        .map_err(|e| L2Error::Invalid { reason: format!("dax write: {e}") })?;
                    off += p.len();
                }
                Ok(())
            }
            Media::File(f) => {
                let mut off = at;
                for p in parts {
                    std::os::unix::fs::FileExt::write_all_at(f, p, off)?;
                    off += p.len() as u64;
                }
                Ok(())
            }
        }
    }

    fn read(&self, at: u64, dst: &mut [u8]) -> Result<(), L2Error> {
        match self {
            Media::Mapped(r) => r
                .read()
                .read(at as usize, dst)
                .map_err(|e| L2Error::Invalid { reason: format!("dax read: {e}") }),
            Media::File(f) => Ok(std::os::unix::fs::FileExt::read_exact_at(f, dst, at)?),
        }
    }
}

/// The dax adapter.
#[derive(Debug)]
pub struct DaxAdapter {
    config: DaxConfig,
    media: Arc<Media>,
    index: Arc<Mutex<Index>>,
    slots: u32,
    // Last: unlocks the device once the mapping is gone.
    _lock: Flock<File>,
}

fn superblock(slot_bytes: u64, slots: u32) -> Vec<u8> {
    let mut sb = vec![0u8; SUPER_LEN];
    sb[..8].copy_from_slice(MAGIC);
    sb[8..16].copy_from_slice(&slot_bytes.to_le_bytes());
    sb[16..20].copy_from_slice(&slots.to_le_bytes());
    let sum = xxh3_64(&sb[..32]);
    sb[32..40].copy_from_slice(&sum.to_le_bytes());
    sb
}

fn is_ours(sb: &[u8]) -> bool {
    sb.len() >= SUPER_LEN && &sb[..8] == MAGIC && sb[32..40] == xxh3_64(&sb[..32]).to_le_bytes()
}

impl DaxAdapter {
    /// Opens (creating a missing file) and maps the device; the index starts empty.
    pub fn open(config: DaxConfig) -> Result<Self, L2Error> {
        let invalid = |reason: String| L2Error::Invalid { reason };
        if config.slot_bytes < 4096 {
            return Err(invalid(format!("slot_bytes {} is under 4096", config.slot_bytes)));
        }
        let slots = (config.size.saturating_sub(HEADER) / config.slot_bytes).min(u32::MAX as u64);
        if slots == 0 {
            return Err(invalid(format!(
                "{} bytes hold no {}-byte slot after the 2 MiB header",
                config.size, config.slot_bytes
            )));
        }
        let path = &config.device_path;
        let file =
            OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|_| {
            L2Error::Unavailable {
                reason: format!(
                    "{} is in use (by an L1 on it, or another server's L2): not shared",
                    path.display()
                ),
            }
        })?;
        let meta = lock.metadata()?;
        let total = HEADER + slots * config.slot_bytes;
        let foreign = || {
            invalid(format!(
                "{} holds something other than an lmcache-rs dax L2; left as it was \
                 (\"format\": true takes it)",
                path.display()
            ))
        };
        let media = if meta.is_file() {
            // Checked before anything is written: a file of data that is not ours stays as
            // it was, length included.
            if meta.len() > 0 && !config.format {
                let mut sb = vec![0u8; SUPER_LEN];
                let whole = meta.len() >= SUPER_LEN as u64
                    && std::os::unix::fs::FileExt::read_exact_at(&*lock, &mut sb, 0).is_ok();
                if !whole || !is_ours(&sb) {
                    return Err(foreign());
                }
            }
            if meta.len() < total {
                lock.set_len(total)?;
            }
            Media::File(lock.try_clone()?)
        } else {
            let len = usize::try_from(total)
                .map_err(|_| invalid("larger than the address space".into()))?;
            let region = FileRegion::map(&lock, 0, len)
                .map_err(|e| invalid(format!("cannot map {}: {e}", path.display())))?;
            // A device has no length to go by: all zeros counts as empty.
            let mut sb = vec![0u8; SUPER_LEN];
            region.read(0, &mut sb).map_err(|e| invalid(e.to_string()))?;
            if !config.format && !is_ours(&sb) && sb.iter().any(|&b| b != 0) {
                return Err(foreign());
            }
            Media::Mapped(RwLock::new(region))
        };
        media.write(0, [&superblock(config.slot_bytes, slots as u32), &[]])?;
        let index = Index { objects: HashMap::new(), free: (0..slots as u32).rev().collect() };
        Ok(Self {
            config,
            media: Arc::new(media),
            index: Arc::new(Mutex::new(index)),
            slots: slots as u32,
            _lock: lock,
        })
    }

    fn offset(&self, slot: u32) -> u64 {
        HEADER + u64::from(slot) * self.config.slot_bytes
    }
}

#[async_trait]
impl L2Adapter for DaxAdapter {
    fn kind(&self) -> &'static str {
        "dax"
    }

    async fn store(&self, items: Vec<(ObjectKey, Blob)>) -> Vec<Result<Stored, L2Error>> {
        let (media, index) = (Arc::clone(&self.media), Arc::clone(&self.index));
        let (slot_bytes, base) = (self.config.slot_bytes, self.offset(0));
        blocking_each(items, move |(key, blob)| {
            let len = blob.len() as u64;
            if len > slot_bytes {
                return Err(L2Error::Full { what: "slot_bytes", needed: len, limit: slot_bytes });
            }
            let slot = {
                let mut ix = index.lock();
                if ix.objects.contains_key(key) {
                    return Ok(Stored::AlreadyPresent);
                }
                ix.free.pop().ok_or(L2Error::Full { what: "free slots", needed: 1, limit: 0 })?
            };
            let written =
                media.write(base + u64::from(slot) * slot_bytes, [blob.header(), &blob.payload]);
            let mut ix = index.lock();
            match written {
                Err(e) => {
                    ix.free.push(slot);
                    Err(e)
                }
                Ok(()) => {
                    // Published once its bytes are in place; a racing store of the same key
                    // keeps the first and frees this slot.
                    if ix.objects.contains_key(key) {
                        ix.free.push(slot);
                        return Ok(Stored::AlreadyPresent);
                    }
                    ix.objects.insert(key.clone(), (slot, len));
                    Ok(Stored::Written(len))
                }
            }
        })
        .await
    }

    async fn lookup(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, L2Error> {
        let ix = self.index.lock();
        Ok(keys.iter().map(|k| ix.objects.contains_key(k)).collect())
    }

    async fn lookup_sized(&self, keys: &[ObjectKey]) -> Result<Vec<Option<u64>>, L2Error> {
        let ix = self.index.lock();
        Ok(keys.iter().map(|k| ix.objects.get(k).map(|&(_, n)| n)).collect())
    }

    async fn load(&self, keys: &[ObjectKey]) -> Vec<Result<Option<Bytes>, L2Error>> {
        let found: Vec<Option<(u32, u64)>> = {
            let ix = self.index.lock();
            keys.iter().map(|k| ix.objects.get(k).copied()).collect()
        };
        let media = Arc::clone(&self.media);
        let (slot_bytes, base) = (self.config.slot_bytes, self.offset(0));
        blocking_each(found, move |f| {
            let Some((slot, len)) = *f else { return Ok(None) };
            let mut buf = vec![0u8; len as usize];
            media.read(base + u64::from(slot) * slot_bytes, &mut buf)?;
            Ok(Some(Bytes::from(buf)))
        })
        .await
    }

    /// The header into a buffer and the payload straight into each sink (one copy); a
    /// stored blob of another length is a miss.
    async fn load_direct(&self, items: Vec<DirectItem>) -> Vec<DirectResult> {
        let found: Vec<Option<(u32, u64)>> = {
            let ix = self.index.lock();
            items.iter().map(|(k, _, _)| ix.objects.get(k).copied()).collect()
        };
        let media = Arc::clone(&self.media);
        let (slot_bytes, base) = (self.config.slot_bytes, self.offset(0));
        let n = items.len();
        let done = blocking(move || {
            items
                .into_iter()
                .zip(found)
                .map(|((_, hlen, mut sink), f)| {
                    let r = (|| {
                        let Some((slot, len)) = f else { return Ok(None) };
                        let dest = sink.payload_mut();
                        if len != (hlen + dest.len()) as u64 {
                            return Ok(None);
                        }
                        let at = base + u64::from(slot) * slot_bytes;
                        let mut header = vec![0u8; hlen];
                        media.read(at, &mut header)?;
                        // A piece at a time, each hashed while still in cache.
                        let from = at + hlen as u64;
                        let xxh3 = PieceHasher::fill(dest, |off, piece| {
                            media.read(from + off as u64, piece)
                        })?;
                        Ok(Some(DirectHeader { bytes: header, payload_xxh3: Some(xxh3) }))
                    })();
                    (sink, r)
                })
                .collect::<Vec<_>>()
        })
        .await;
        match done {
            Ok(v) => v,
            // The blocking task itself failed: the sinks went with it.
            Err(_) => Vec::with_capacity(n),
        }
    }

    async fn delete(&self, keys: &[ObjectKey]) -> Result<u64, L2Error> {
        let mut ix = self.index.lock();
        let mut n = 0;
        for k in keys {
            if let Some((slot, _)) = ix.objects.remove(k) {
                ix.free.push(slot);
                n += 1;
            }
        }
        Ok(n)
    }

    async fn list(
        &self,
        filter: &KeyFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<KeyPage, L2Error> {
        let ix = self.index.lock();
        Ok(crate::adapter::page_keys(
            ix.objects.iter().map(|(k, &(_, n))| (k, n)),
            filter,
            cursor,
            limit,
        ))
    }

    fn capacity(&self) -> Option<u64> {
        Some(u64::from(self.slots) * self.config.slot_bytes)
    }

    fn describe(&self) -> serde_json::Value {
        let used = self.index.lock().objects.len();
        serde_json::json!({"type": self.kind(), "device_path": self.config.device_path,
                           "slot_bytes": self.config.slot_bytes, "slots": self.slots,
                           "slots_used": used})
    }
}
