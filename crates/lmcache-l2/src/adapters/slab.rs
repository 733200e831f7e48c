//! `gds_slab`: the slab file of a CPU GDS L1 (`--gds-l1-path DIR`).
//!
//! LMCache's GDS L1 keeps its objects in one preallocated slab file on NVMe and moves them
//! between the GPU and the slab by DMA. Without a GPU, lmcache-rs keeps the same slab and
//! copies through DRAM: objects are stored into a DRAM staging L1, written through to the
//! slab (O_DIRECT by default), and read back from it into staging on a lookup that misses in
//! DRAM. This adapter is the slab's side of that: one file, `DIR/lmcache-rs-gds-l1.slab`,
//! laid out as a [`raw_block`](super::raw_block) device (fixed slots, a journal and
//! checkpoints, every blob checksummed), so a torn or foreign slot is a miss, never served.
//!
//! The slot size is `slot_bytes` when the operator gives it (`--gds-l1-slot-mb`), otherwise
//! the first stored batch's largest object, rounded up to the I/O alignment: the server learns
//! the size of a chunk only when an engine registers, and every full chunk of a model has the
//! same size. An object larger than a slot is refused by the slab (counted as a failed L2
//! store, and logged once with the flag to raise) and lives in DRAM staging only. A slab file left by an earlier process is kept
//! and served when `keep` is set (the server's `--l1-warm-restart`), with the slot size it was
//! formatted with; otherwise it is removed at start, as LMCache clears its slab. A file at the
//! slab's name that is not a raw_block device is never removed or overwritten.
//!
//! One process per directory: the adapter holds an exclusive `flock` on [`LOCK_FILE`] from
//! its opening to its close, so a second server on the same `--gds-l1-path` is refused with
//! the holder's pid before it touches the slab (it would clear or overwrite it), and a
//! `--take-over` finds whom to stop by that lock.

use std::path::{Path, PathBuf};

use async_trait::async_trait;
use bytes::Bytes;
use lmcache_core::ObjectKey;
use tokio::sync::OnceCell;

use super::raw_block::{self, RawBlockAdapter, RawBlockConfig};
use crate::adapter::{DirectItem, DirectResult, KeyFilter, KeyPage, L2Adapter, Stored};
use crate::blob::Blob;
use crate::error::L2Error;

/// The slab's file name inside `--gds-l1-path`: ours by name.
pub const SLAB_FILE: &str = "lmcache-rs-gds-l1.slab";

/// The lock file beside the slab (ours by name; empty, never removed).
pub const LOCK_FILE: &str = "lmcache-rs-gds-l1.lock";

/// The lock file of the slab in `dir`: the file whose holder serves that slab.
pub fn lock_path(dir: &Path) -> PathBuf {
    dir.join(LOCK_FILE)
}

/// I/O alignment of the slab (O_DIRECT and LMCache's GDS `align_bytes`).
pub const SLAB_ALIGN: u64 = 4096;

/// Settings of the slab.
#[derive(Debug, Clone)]
pub struct SlabConfig {
    /// The directory (`--gds-l1-path`); the slab is [`SLAB_FILE`] in it.
    pub dir: PathBuf,
    /// Bytes of the slab file (`--l1-size-gb` under GDS).
    pub capacity_bytes: u64,
    /// Open the slab with O_DIRECT (`--gds-l1-use-direct-io`).
    pub use_odirect: bool,
    /// Serve a slab an earlier process left (`--l1-warm-restart`); otherwise it starts empty.
    pub keep: bool,
    /// Bytes per slot (`--gds-l1-slot-mb`); `None`: the first stored batch's largest object.
    pub slot_bytes: Option<u64>,
}

/// The slab of a CPU GDS L1. Until its slot size is known (the first store, or a kept slab)
/// it holds nothing: lookups miss.
#[derive(Debug)]
pub struct SlabAdapter {
    config: SlabConfig,
    path: PathBuf,
    device: OnceCell<Device>,
    /// Whether an object too large for the slots has been logged (once per process).
    told_too_large: std::sync::atomic::AtomicBool,
    /// The directory's lock, held until [`L2Adapter::close`]; `None` once closed (a store
    /// then fails: another process may own the slab).
    lock: parking_lot::Mutex<Option<nix::fcntl::Flock<std::fs::File>>>,
}

/// The formatted slab and its slot size.
#[derive(Debug)]
struct Device {
    dev: RawBlockAdapter,
    slot: u64,
}

/// Metadata bytes for a slab of `capacity` bytes in slots of `slot` bytes: room for a
/// checkpoint of every slot with keys of up to ~200 bytes, at least raw_block's 16 MiB.
fn meta_bytes(capacity: u64, slot: u64) -> u64 {
    let slots = capacity / slot.max(1);
    let per_container = slots.saturating_mul(256).saturating_add(8192);
    // Each checkpoint container gets 3/8 of the metadata (raw_block's layout).
    per_container.saturating_mul(8).div_ceil(3).next_multiple_of(SLAB_ALIGN).max(16 << 20)
}

impl SlabAdapter {
    /// Prepares the slab in `config.dir`: a kept slab is opened and recovered now; otherwise
    /// a slab an earlier process left is removed. A file at [`SLAB_FILE`] that is not a
    /// raw_block device is refused, never touched.
    pub fn open(config: SlabConfig) -> Result<Self, L2Error> {
        let meta = std::fs::metadata(&config.dir).map_err(|e| {
            L2Error::unavailable(format!("gds slab directory {}: {e}", config.dir.display()))
        })?;
        if !meta.is_dir() {
            return Err(L2Error::unavailable(format!(
                "gds slab directory {}: not a directory",
                config.dir.display()
            )));
        }
        let lock = take_lock(&config.dir)?;
        let path = config.dir.join(SLAB_FILE);
        let existing = std::fs::symlink_metadata(&path).ok();
        if existing.as_ref().is_some_and(|m| m.file_type().is_symlink()) {
            return Err(L2Error::unavailable(format!(
                "{}: is a symbolic link; the slab is only ever a file of ours",
                path.display()
            )));
        }
        let found = raw_block::formatted_geometry(&path)?;
        let nonempty = existing.is_some_and(|m| !m.is_file() || m.len() > 0);
        if found.is_none() && nonempty {
            return Err(L2Error::unavailable(format!(
                "{}: holds data that is not an lmcache-rs slab; refusing to touch it",
                path.display()
            )));
        }
        let adapter = Self {
            config,
            path,
            device: OnceCell::new(),
            told_too_large: std::sync::atomic::AtomicBool::new(false),
            lock: parking_lot::Mutex::new(Some(lock)),
        };
        match found {
            Some(g) if adapter.config.keep => {
                let dev = RawBlockAdapter::open(adapter.device_config(
                    g.slot_bytes,
                    g.capacity_bytes,
                    g.meta_total_bytes,
                ))?;
                tracing::info!(
                    path = %adapter.path.display(),
                    slot_bytes = g.slot_bytes,
                    capacity_bytes = g.capacity_bytes,
                    "gds slab kept from the previous process, with the geometry it was formatted \
                     with"
                );
                let device = Device { dev, slot: g.slot_bytes };
                adapter.device.set(device).map_err(|_| L2Error::transient("slab opened twice"))?;
            }
            Some(_) => {
                std::fs::remove_file(&adapter.path)?;
                tracing::info!(path = %adapter.path.display(), "gds slab cleared at start");
            }
            None => {}
        }
        Ok(adapter)
    }

    /// The slab file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes per slot, once known.
    pub fn slot_bytes(&self) -> Option<u64> {
        self.device.get().map(|d| d.slot)
    }

    fn dev(&self) -> Option<&RawBlockAdapter> {
        self.device.get().map(|d| &d.dev)
    }

    fn device_config(&self, slot: u64, capacity: u64, meta: u64) -> RawBlockConfig {
        RawBlockConfig {
            device_path: self.path.clone(),
            slot_bytes: slot,
            capacity_bytes: capacity,
            use_odirect: self.config.use_odirect,
            block_align: SLAB_ALIGN,
            meta_total_bytes: meta,
            sync_journal: false,
            format: false,
        }
    }

    /// The device, formatted with slots of the largest of `items` when it is not yet.
    async fn device_for(&self, items: &[(ObjectKey, Blob)]) -> Result<&RawBlockAdapter, L2Error> {
        let device = self
            .device
            .get_or_try_init(|| async {
                let largest = items.iter().map(|(_, b)| b.len() as u64).max().unwrap_or(0);
                let slot =
                    self.config.slot_bytes.unwrap_or(largest).max(1).next_multiple_of(SLAB_ALIGN);
                let capacity = self.config.capacity_bytes;
                let meta = meta_bytes(capacity, slot);
                if capacity < meta + slot {
                    return Err(L2Error::Invalid {
                        reason: format!(
                            "the gds slab of {capacity} bytes cannot hold its {meta} metadata \
                             bytes and one slot of {slot} (raise --l1-size-gb)"
                        ),
                    });
                }
                let config = self.device_config(slot, capacity, meta);
                let dev = super::blocking(move || RawBlockAdapter::open(config)).await??;
                tracing::info!(
                    path = %self.path.display(),
                    slot_bytes = slot,
                    slots = (capacity - meta) / slot,
                    use_odirect = self.config.use_odirect,
                    "gds slab formatted"
                );
                Ok(Device { dev, slot })
            })
            .await?;
        Ok(&device.dev)
    }
}

#[async_trait]
impl L2Adapter for SlabAdapter {
    fn kind(&self) -> &'static str {
        "gds_slab"
    }

    async fn store(&self, items: Vec<(ObjectKey, Blob)>) -> Vec<Result<Stored, L2Error>> {
        if self.lock.lock().is_none() {
            return items
                .iter()
                .map(|_| Err(L2Error::unavailable("the gds slab is closed")))
                .collect();
        }
        match self.device_for(&items).await {
            Ok(dev) => {
                let results = dev.store(items).await;
                let too_large = results.iter().find_map(|r| match r {
                    Err(L2Error::Full { what: "slot_bytes", needed, limit }) => {
                        Some((*needed, *limit))
                    }
                    _ => None,
                });
                if let Some((needed, slot)) = too_large
                    && !self.told_too_large.swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::warn!(
                        needed,
                        slot,
                        path = %self.path.display(),
                        "an object is larger than the gds slab's slots: it stays in DRAM staging \
                         only (give --gds-l1-slot-mb of the largest chunk, then start cold)"
                    );
                }
                results
            }
            Err(e) => {
                let msg = e.to_string();
                items.iter().map(|_| Err(L2Error::transient(msg.clone()))).collect()
            }
        }
    }

    async fn lookup(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, L2Error> {
        match self.dev() {
            Some(dev) => dev.lookup(keys).await,
            None => Ok(vec![false; keys.len()]),
        }
    }

    async fn lookup_sized(&self, keys: &[ObjectKey]) -> Result<Vec<Option<u64>>, L2Error> {
        match self.dev() {
            Some(dev) => dev.lookup_sized(keys).await,
            None => Ok(vec![None; keys.len()]),
        }
    }

    async fn load(&self, keys: &[ObjectKey]) -> Vec<Result<Option<Bytes>, L2Error>> {
        match self.dev() {
            Some(dev) => dev.load(keys).await,
            None => keys.iter().map(|_| Ok(None)).collect(),
        }
    }

    async fn load_direct(&self, items: Vec<DirectItem>) -> Vec<DirectResult> {
        match self.dev() {
            Some(dev) => dev.load_direct(items).await,
            None => items.into_iter().map(|(_, _, sink)| (sink, Ok(None))).collect(),
        }
    }

    async fn delete(&self, keys: &[ObjectKey]) -> Result<u64, L2Error> {
        match self.dev() {
            Some(dev) => dev.delete(keys).await,
            None => Ok(0),
        }
    }

    async fn list(
        &self,
        filter: &KeyFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<KeyPage, L2Error> {
        match self.dev() {
            Some(dev) => dev.list(filter, cursor, limit).await,
            None => Ok(crate::adapter::page_keys(std::iter::empty(), filter, cursor, limit)),
        }
    }

    fn capacity(&self) -> Option<u64> {
        match self.dev() {
            Some(dev) => dev.capacity(),
            None => Some(self.config.capacity_bytes),
        }
    }

    fn describe(&self) -> serde_json::Value {
        let mut d = serde_json::json!({
            "type": "gds_slab",
            "path": self.path,
            "capacity_bytes": self.config.capacity_bytes,
            "use_odirect": self.config.use_odirect,
            "warm_restart": self.config.keep,
            "formatted": self.device.get().is_some(),
        });
        if let (Some(dev), Some(o)) = (self.dev(), d.as_object_mut()) {
            o.insert("device".into(), dev.describe());
        }
        d
    }

    async fn close(&self) {
        if let Some(dev) = self.dev() {
            dev.close().await;
        }
        // Checkpointed: a successor (a --take-over) may open the slab now.
        drop(self.lock.lock().take());
    }
}

/// Takes the exclusive lock of the slab directory `dir`, or names the process holding it.
fn take_lock(dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, L2Error> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = lock_path(dir);
    // O_NOFOLLOW: a link planted at our lock's name is refused, not followed.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| L2Error::unavailable(format!("gds slab lock {}: {e}", path.display())))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|(_, e)| {
        let holder = lmcache_memory::file_arena::lock_holder(&path).ok().flatten();
        L2Error::unavailable(format!(
            "the gds slab in {} is in use by {} (one server per --gds-l1-path; --take-over \
             replaces it): {e}",
            dir.display(),
            holder.map_or_else(|| "another process".to_owned(), |p| format!("pid {p}"))
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> ObjectKey {
        ObjectKey::new([i; 32], "m", 1, 0, 0, "").unwrap()
    }

    fn blob(k: &ObjectKey, len: usize, fill: u8) -> Blob {
        crate::Codec::None.encode(k, Bytes::from(vec![fill; len])).unwrap()
    }

    fn config(dir: &Path, keep: bool) -> SlabConfig {
        // Not O_DIRECT: a test's temporary directory may be on tmpfs, which refuses it
        // (raw_block then falls back to buffered I/O, which would hide nothing here).
        SlabConfig {
            dir: dir.to_path_buf(),
            capacity_bytes: 64 << 20,
            use_odirect: false,
            keep,
            slot_bytes: None,
        }
    }

    async fn payload(a: &SlabAdapter, k: &ObjectKey) -> Option<Vec<u8>> {
        let got = a.load(std::slice::from_ref(k)).await.pop().unwrap().unwrap()?;
        let (_, payload) = crate::blob::verify(k, &got).unwrap();
        Some(payload.to_vec())
    }

    #[tokio::test]
    async fn slots_take_the_first_objects_size_and_larger_objects_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let a = SlabAdapter::open(config(dir.path(), false)).unwrap();
        assert_eq!(a.lookup(&[key(1)]).await.unwrap(), vec![false]);
        assert!(!dir.path().join(SLAB_FILE).exists(), "nothing is made before the first store");
        let (k1, k2, k3) = (key(1), key(2), key(3));
        let r = a.store(vec![(k1.clone(), blob(&k1, 300_000, 7))]).await;
        assert!(matches!(r[0], Ok(Stored::Written(_))), "{r:?}");
        let slot = raw_block::formatted_geometry(a.path()).unwrap().unwrap().slot_bytes;
        assert_eq!(a.slot_bytes(), Some(slot));
        assert_eq!(slot, (300_000 + crate::blob::header_len(&k1) as u64).next_multiple_of(4096));
        // A smaller object fits a slot; a larger one is refused by name.
        let r = a.store(vec![(k2.clone(), blob(&k2, 1000, 8))]).await;
        assert!(matches!(r[0], Ok(Stored::Written(_))), "{r:?}");
        let r = a.store(vec![(k3.clone(), blob(&k3, 400_000, 9))]).await;
        assert!(matches!(r[0], Err(L2Error::Full { what: "slot_bytes", .. })), "{r:?}");
        assert_eq!(payload(&a, &k1).await.unwrap(), vec![7u8; 300_000]);
        assert_eq!(payload(&a, &k2).await.unwrap(), vec![8u8; 1000]);
        assert_eq!(a.lookup(&[k1, k2, k3]).await.unwrap(), vec![true, true, false]);
    }

    #[tokio::test]
    async fn a_slot_size_given_by_the_operator_is_used() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = SlabConfig { slot_bytes: Some(1 << 20), ..config(dir.path(), false) };
        let a = SlabAdapter::open(cfg).unwrap();
        let (small, large) = (key(5), key(6));
        a.store(vec![(small.clone(), blob(&small, 100, 1))]).await.pop().unwrap().unwrap();
        assert_eq!(a.slot_bytes(), Some(1 << 20), "not the first object's 4 KiB");
        let r = a.store(vec![(large.clone(), blob(&large, 900_000, 2))]).await;
        assert!(matches!(r[0], Ok(Stored::Written(_))), "{r:?}");
        assert_eq!(payload(&a, &large).await.unwrap(), vec![2u8; 900_000]);
    }

    #[tokio::test]
    async fn a_kept_slab_serves_what_the_last_process_stored_and_a_cold_one_is_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let k = key(4);
        {
            let a = SlabAdapter::open(config(dir.path(), false)).unwrap();
            a.store(vec![(k.clone(), blob(&k, 50_000, 3))]).await.pop().unwrap().unwrap();
            a.close().await;
        }
        let kept = SlabAdapter::open(config(dir.path(), true)).unwrap();
        assert_eq!(payload(&kept, &k).await.unwrap(), vec![3u8; 50_000]);
        assert!(kept.describe()["formatted"].as_bool().unwrap());
        kept.close().await;
        drop(kept);
        let cold = SlabAdapter::open(config(dir.path(), false)).unwrap();
        assert!(!dir.path().join(SLAB_FILE).exists());
        assert_eq!(cold.lookup(&[k]).await.unwrap(), vec![false]);
    }

    #[test]
    fn a_foreign_file_at_the_slab_name_is_never_touched() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SLAB_FILE);
        std::fs::write(&path, b"someone else's data").unwrap();
        for keep in [false, true] {
            let e = SlabAdapter::open(config(dir.path(), keep)).unwrap_err();
            assert!(e.to_string().contains("not an lmcache-rs slab"), "{e}");
        }
        assert_eq!(std::fs::read(&path).unwrap(), b"someone else's data");
        // Nor is a link planted at its name followed, even to a slab of ours.
        std::fs::remove_file(&path).unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(elsewhere.path().join(SLAB_FILE), &path).unwrap();
        let e = SlabAdapter::open(config(dir.path(), false)).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let e = SlabAdapter::open(config(&dir.path().join("missing"), false)).unwrap_err();
        assert!(e.to_string().contains("gds slab directory"), "{e}");
    }

    #[tokio::test]
    async fn one_process_at_a_time_serves_a_slab_directory() {
        let dir = tempfile::tempdir().unwrap();
        let k = key(9);
        let first = SlabAdapter::open(config(dir.path(), true)).unwrap();
        first.store(vec![(k.clone(), blob(&k, 10_000, 1))]).await.pop().unwrap().unwrap();
        // This process holds the lock (flock is per open file: a second open is refused
        // as another process's would be), and the slab is left as it was.
        let e = SlabAdapter::open(config(dir.path(), false)).unwrap_err();
        let me = format!("pid {}", std::process::id());
        assert!(e.to_string().contains("in use by") && e.to_string().contains(&me), "{e}");
        assert!(dir.path().join(SLAB_FILE).exists(), "a refused opener cleared the slab");
        first.close().await;
        // Closed: no more writes from it, and a successor opens the slab warm.
        let late = first.store(vec![(k.clone(), blob(&k, 10_000, 2))]).await.pop().unwrap();
        assert!(late.is_err());
        let next = SlabAdapter::open(config(dir.path(), true)).unwrap();
        assert_eq!(payload(&next, &k).await.unwrap(), vec![1u8; 10_000]);
        // A link at the lock's name is not followed.
        next.close().await;
        drop((first, next));
        std::fs::remove_file(lock_path(dir.path())).unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(elsewhere.path().join("x"), lock_path(dir.path())).unwrap();
        let e = SlabAdapter::open(config(dir.path(), true)).unwrap_err();
        assert!(e.to_string().contains("gds slab lock"), "{e}");
        assert!(!elsewhere.path().join("x").exists());
    }

    #[test]
    fn metadata_grows_with_the_slot_count() {
        assert_eq!(meta_bytes(1 << 30, 32 << 20), 16 << 20);
        let many = meta_bytes(100 << 30, 64 << 10);
        assert!(many > 16 << 20);
        // raw_block accepts the geometry: its checkpoints hold every slot.
        let dir = tempfile::tempdir().unwrap();
        let (capacity, slot) = (1u64 << 30, 64u64 << 10);
        let cfg = RawBlockConfig {
            device_path: dir.path().join("d"),
            slot_bytes: slot,
            capacity_bytes: capacity,
            use_odirect: false,
            block_align: SLAB_ALIGN,
            meta_total_bytes: meta_bytes(capacity, slot),
            sync_journal: false,
            format: false,
        };
        RawBlockAdapter::open(cfg).unwrap();
    }
}
