//! `fs`: one file per key under `base_path`, in 256 directories named by the first byte of the
//! chunk hash (directory operations of concurrent stores rarely contend; ext4's hashed
//! directories keep lookups fast at millions of files).
//!
//! A store writes `.lmcache-rs-<name>.<pid>.<n>.tmp` beside the final name (in its shard
//! directory, or in `relative_tmp_dir` when one is set): the payload first, hashed a piece at a
//! time as it is written, then the header that hash seals ([`Blob::header`]). It optionally
//! fsyncs the file, then renames it over the final name, so a reader sees a whole blob or
//! nothing; a crash leaves at most a temporary file. The rename stays in one directory: a
//! rename across directories takes both directories' locks, and when every store renamed out
//! of one shared temporary directory the writers queued on its lock (22 % of a store
//! benchmark's samples; BENCHMARKS.md, twenty-third session). Start-up removes only crash leftovers: files of that name pattern,
//! older than [`STALE_TMP`] (younger ones may be in-flight writes of another server sharing
//! the directory), in the shard directories (by a background sweep, so a large store does not
//! delay start-up), in `relative_tmp_dir`, or in `.lmcache-rs-tmp`, where earlier versions
//! wrote them. Nothing else under `base_path` is ever removed at start. Keys already on disk are
//! skipped. Lookups are a `stat` per key, so files written by an earlier run (or another
//! server sharing the directory) are found. With `use_odirect` the page cache is bypassed
//! (writes are padded to the block size, then the file is truncated to its length).

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, IoSliceMut, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use lmcache_core::ObjectKey;
use parking_lot::Mutex;

use super::aligned::{AlignedBuf, with_scratch};
use super::{blocking, blocking_each};
use crate::adapter::{
    DirectHeader, DirectItem, DirectResult, KeyFilter, KeyPage, L2Adapter, Stored,
};
use crate::blob::{Blob, PieceHasher};
use crate::error::L2Error;
use crate::wire_key;

const ALIGN: usize = 4096;

/// When stores call fsync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncMode {
    /// Never (a process crash loses nothing; a power loss may).
    Never,
    /// The file before its rename.
    File,
    /// The file, and the directory after the rename.
    FileAndDir,
}

/// Settings of the fs adapter.
#[derive(Debug, Clone)]
pub struct FsConfig {
    /// Root directory (created).
    pub base_path: PathBuf,
    /// Where temporary files go, relative to `base_path`; beside their final name if `None`.
    pub relative_tmp_dir: Option<PathBuf>,
    /// Bypass the page cache.
    pub use_odirect: bool,
    /// Durability of stores.
    pub fsync: FsyncMode,
}

#[derive(Debug)]
struct Inner {
    config: FsConfig,
    odirect: bool,
    made_dirs: Mutex<HashSet<PathBuf>>,
    tmp_seq: AtomicU64,
    /// The start-up sweep of crash leftovers, while it runs.
    sweep: Mutex<Option<Sweep>>,
}

/// The background sweep of stale temporary files through the shard directories.
#[derive(Debug)]
struct Sweep {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

/// The fs adapter.
#[derive(Debug, Clone)]
pub struct FsAdapter {
    inner: Arc<Inner>,
}

/// File name of a key: its wire key with every byte outside `[A-Za-z0-9._@-]` percent-escaped.
fn file_name(key: &ObjectKey) -> String {
    let wk = wire_key::encode(key);
    let mut s = String::with_capacity(wk.len() + 5);
    for b in wk.bytes() {
        if b.is_ascii_alphanumeric() || b"._@-".contains(&b) {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s.push_str(".blob");
    s
}

fn unescape(name: &str) -> Option<String> {
    wire_key::percent_decode(name.strip_suffix(".blob")?)
}

impl FsAdapter {
    /// Opens (creating) the directory, probes O_DIRECT support, and removes temporary files
    /// left by a crash.
    pub fn open(config: FsConfig) -> Result<Self, L2Error> {
        std::fs::create_dir_all(&config.base_path)?;
        let odirect = config.use_odirect && probe_odirect(&config.base_path);
        if config.use_odirect && !odirect {
            tracing::warn!(path = %config.base_path.display(),
                "fs L2: the file system refuses O_DIRECT; using buffered I/O");
        }
        let mut sweep = None;
        if let Some(rel) = &config.relative_tmp_dir {
            // One directory the operator named: swept now.
            let tmp_dir = config.base_path.join(rel);
            std::fs::create_dir_all(&tmp_dir)?;
            log_removed(remove_stale_tmp_files(&tmp_dir, STALE_TMP, &AtomicBool::new(false)));
        } else {
            let base = config.base_path.clone();
            let stop = Arc::new(AtomicBool::new(false));
            let flag = stop.clone();
            let thread = std::thread::Builder::new()
                .name("fs-l2-tmp-sweep".into())
                .spawn(move || log_removed(sweep_shards(&base, STALE_TMP, &flag)))?;
            sweep = Some(Sweep { stop, thread });
        }
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                odirect,
                made_dirs: Mutex::new(HashSet::new()),
                tmp_seq: AtomicU64::new(0),
                sweep: Mutex::new(sweep),
            }),
        })
    }

    /// The final path of `key`.
    pub fn path_of(&self, key: &ObjectKey) -> PathBuf {
        self.inner.path_of(key)
    }
}

impl Inner {
    fn dir_of(&self, key: &ObjectKey) -> PathBuf {
        self.config.base_path.join(format!("{:02x}", key.chunk_hash.as_bytes()[0]))
    }

    fn path_of(&self, key: &ObjectKey) -> PathBuf {
        self.dir_of(key).join(file_name(key))
    }

    fn ensure_dir(&self, dir: &Path) -> std::io::Result<()> {
        if self.made_dirs.lock().contains(dir) {
            return Ok(());
        }
        std::fs::create_dir_all(dir)?;
        self.made_dirs.lock().insert(dir.to_owned());
        Ok(())
    }

    fn store_one(&self, key: &ObjectKey, blob: &Blob) -> Result<Stored, L2Error> {
        let dir = self.dir_of(key);
        let name = file_name(key);
        let fin = dir.join(&name);
        if fin.exists() {
            return Ok(Stored::AlreadyPresent);
        }
        self.ensure_dir(&dir)?;
        let n = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp_dir = match &self.config.relative_tmp_dir {
            Some(rel) => self.config.base_path.join(rel),
            None => dir.clone(),
        };
        let tmp =
            tmp_dir.join(format!("{TMP_PREFIX}{name}.{}.{n}{TMP_SUFFIX}", std::process::id()));
        let written = self.write_file(&tmp, blob).and_then(|()| {
            std::fs::rename(&tmp, &fin)?;
            if self.config.fsync == FsyncMode::FileAndDir {
                File::open(&dir)?.sync_all()?;
            }
            Ok(())
        });
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
        Ok(Stored::Written(blob.len() as u64))
    }

    fn write_file(&self, path: &Path, blob: &Blob) -> std::io::Result<()> {
        let mut opts = OpenOptions::new();
        opts.write(true).create_new(true);
        if self.odirect {
            opts.custom_flags(libc::O_DIRECT);
            let mut f = opts.open(path)?;
            let len = blob.len();
            let padded = len.div_ceil(ALIGN) * ALIGN;
            with_scratch(padded, ALIGN, |b| {
                blob.write_into(&mut b[..len]);
                b[len..].fill(0);
                f.write_all(b)
            })?;
            f.set_len(len as u64)?;
            if self.config.fsync != FsyncMode::Never {
                f.sync_all()?;
            }
            return Ok(());
        }
        let f = opts.open(path)?;
        // The payload after the header's place, a piece at a time, then the header. Unsealed
        // (the usual first write of a blob), each piece is hashed right before its write
        // copies it, so the copy reads it from cache, and the header is sealed with that
        // checksum. Sealed already (another tier wrote the blob first), the same pieces go
        // out unhashed: one write of a whole 32 MiB payload stored at 0.56-0.58 GB/s in two
        // of three runs here, against 3.3-4.0 in 256 KiB pieces (BENCHMARKS, thirty-first
        // session). The file is renamed into place only after both.
        let sealed = blob.sealed_header().cloned();
        let mut hasher = PieceHasher::new();
        let mut at = blob.header_len() as u64;
        for piece in blob.payload.chunks(PieceHasher::PIECE) {
            if sealed.is_none() {
                hasher.piece(piece);
            }
            f.write_all_at(piece, at)?;
            at += piece.len() as u64;
        }
        let header = match sealed {
            Some(h) => h,
            None => blob.seal_with(hasher.finish()),
        };
        f.write_all_at(&header, 0)?;
        if self.config.fsync != FsyncMode::Never {
            f.sync_data()?;
        }
        Ok(())
    }

    /// Reads the header into a new buffer and the payload straight into `dest`, when the file
    /// is exactly `hlen + dest.len()` bytes (`None` otherwise, or when absent), hashing the
    /// payload a piece at a time as it lands in `dest`.
    fn load_direct_one(
        &self,
        key: &ObjectKey,
        hlen: usize,
        dest: &mut [u8],
    ) -> Result<Option<DirectHeader>, L2Error> {
        let Some(mut f) = self.open_object(key)? else { return Ok(None) };
        let len = hlen + dest.len();
        if f.metadata()?.len() != len as u64 {
            return Ok(None);
        }
        if self.odirect {
            // O_DIRECT needs aligned buffers and the payload is not aligned in the file: read
            // through this thread's scratch buffer (no allocation per load), then copy.
            let padded = len.div_ceil(ALIGN).max(1) * ALIGN;
            return with_scratch(padded, ALIGN, |buf| -> Result<Option<DirectHeader>, L2Error> {
                if read_full(&mut f, buf)? < len {
                    return Ok(None); // shrank under us
                }
                let xxh3 = PieceHasher::copy(dest, &buf[hlen..len]);
                Ok(Some(DirectHeader { bytes: buf[..hlen].to_vec(), payload_xxh3: Some(xxh3) }))
            });
        }
        let mut header = vec![0u8; hlen];
        let Some(xxh3) = read_hashed(&mut f, &mut header, dest)? else {
            return Ok(None); // shrank under us
        };
        Ok(Some(DirectHeader { bytes: header, payload_xxh3: Some(xxh3) }))
    }

    /// `key`'s file opened for reading (with O_DIRECT when on); `None` when absent.
    fn open_object(&self, key: &ObjectKey) -> Result<Option<File>, L2Error> {
        let mut opts = OpenOptions::new();
        opts.read(true);
        if self.odirect {
            opts.custom_flags(libc::O_DIRECT);
        }
        match opts.open(self.path_of(key)) {
            Ok(f) => Ok(Some(f)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn load_one(&self, key: &ObjectKey) -> Result<Option<Bytes>, L2Error> {
        let Some(mut f) = self.open_object(key)? else { return Ok(None) };
        let len = usize::try_from(f.metadata()?.len())
            .map_err(|_| L2Error::transient("file too large"))?;
        if self.odirect {
            let mut buf = AlignedBuf::new(len.div_ceil(ALIGN).max(1) * ALIGN, ALIGN);
            let got = read_full(&mut f, buf.as_mut_slice())?;
            return Ok(Some(buf.into_bytes(got.min(len))));
        }
        // One read of the file's length, plus one to see that the file did not grow.
        let mut v = Vec::with_capacity(len + 1);
        f.read_to_end(&mut v)?;
        Ok(Some(Bytes::from(v)))
    }
}

/// Reads `header` and then `dest` from `f`, hashing `dest` a piece at a time right after each
/// piece lands (the first piece in the same `readv` as the header); `None` when the file ends
/// first.
fn read_hashed(f: &mut File, header: &mut [u8], dest: &mut [u8]) -> std::io::Result<Option<u64>> {
    let mut hasher = PieceHasher::new();
    let (first, rest) = dest.split_at_mut(dest.len().min(PieceHasher::PIECE));
    let mut bufs = [IoSliceMut::new(header), IoSliceMut::new(first)];
    let mut slices: &mut [IoSliceMut<'_>] = &mut bufs;
    while !slices.is_empty() {
        match f.read_vectored(slices) {
            Ok(0) => return Ok(None),
            Ok(n) => IoSliceMut::advance_slices(&mut slices, n),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    hasher.piece(first);
    for piece in rest.chunks_mut(PieceHasher::PIECE) {
        if read_full(f, piece)? < piece.len() {
            return Ok(None);
        }
        hasher.piece(piece);
    }
    Ok(Some(hasher.finish()))
}

fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

fn probe_odirect(dir: &Path) -> bool {
    let p = dir.join(format!(".odirect-probe.{}", std::process::id()));
    let ok = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
        .and_then(|mut f| f.write_all(AlignedBuf::new(ALIGN, ALIGN).as_mut_slice()))
        .is_ok();
    let _ = std::fs::remove_file(&p);
    ok
}

/// Our temporary files' names: `.lmcache-rs-<final name>.<pid>.<n>.tmp`.
const TMP_PREFIX: &str = ".lmcache-rs-";
const TMP_SUFFIX: &str = ".tmp";
/// How old a temporary file must be before start-up takes it for a crash's leftover.
pub const STALE_TMP: std::time::Duration = std::time::Duration::from_secs(600);

/// Where earlier versions put every temporary file (swept at start-up, never written now).
const LEGACY_TMP_DIR: &str = ".lmcache-rs-tmp";

fn log_removed(removed: usize) {
    if removed > 0 {
        tracing::info!(removed, "fs L2: removed temporary files of an interrupted run");
    }
}

/// Whether `name` is one of our shard directories: two lowercase hex digits.
fn is_shard_name(name: &str) -> bool {
    name.len() == 2 && name.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Removes our stale temporary files from the shard directories under `base` and from the
/// legacy temporary directory, until `stop`; returns how many.
fn sweep_shards(base: &Path, age: std::time::Duration, stop: &AtomicBool) -> usize {
    let mut removed = remove_stale_tmp_files(&base.join(LEGACY_TMP_DIR), age, stop);
    let Ok(rd) = std::fs::read_dir(base) else { return removed };
    for e in rd.flatten() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && is_shard_name(&e.file_name().to_string_lossy()) {
            removed += remove_stale_tmp_files(&e.path(), age, stop);
        }
    }
    removed
}

/// Removes our temporary files older than `age` from `dir` (not below it), until `stop`;
/// returns how many.
fn remove_stale_tmp_files(dir: &Path, age: std::time::Duration, stop: &AtomicBool) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else { return 0 };
    let now = std::time::SystemTime::now();
    let mut removed = 0;
    for e in rd.flatten() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with(TMP_PREFIX) && name.ends_with(TMP_SUFFIX)) {
            continue;
        }
        let Ok(meta) = e.metadata() else { continue };
        let old =
            meta.modified().ok().and_then(|m| now.duration_since(m).ok()).is_some_and(|d| d >= age);
        if meta.is_file() && old && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[async_trait]
impl L2Adapter for FsAdapter {
    fn kind(&self) -> &'static str {
        "fs"
    }

    async fn store(&self, items: Vec<(ObjectKey, Blob)>) -> Vec<Result<Stored, L2Error>> {
        let inner = self.inner.clone();
        blocking_each(items, move |(k, b)| inner.store_one(k, b)).await
    }

    async fn lookup(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, L2Error> {
        let inner = self.inner.clone();
        let keys = keys.to_vec();
        blocking(move || keys.iter().map(|k| inner.path_of(k).exists()).collect()).await
    }

    async fn load(&self, keys: &[ObjectKey]) -> Vec<Result<Option<Bytes>, L2Error>> {
        let inner = self.inner.clone();
        blocking_each(keys.to_vec(), move |k| inner.load_one(k)).await
    }

    async fn delete(&self, keys: &[ObjectKey]) -> Result<u64, L2Error> {
        let inner = self.inner.clone();
        let keys = keys.to_vec();
        blocking(move || {
            keys.iter().filter(|k| std::fs::remove_file(inner.path_of(k)).is_ok()).count() as u64
        })
        .await
    }

    async fn lookup_sized(&self, keys: &[ObjectKey]) -> Result<Vec<Option<u64>>, L2Error> {
        let inner = self.inner.clone();
        let keys = keys.to_vec();
        blocking(move || {
            keys.iter().map(|k| std::fs::metadata(inner.path_of(k)).ok().map(|m| m.len())).collect()
        })
        .await
    }

    /// Header and payload in one `readv` per file, the payload straight into the sink. If the
    /// I/O task itself fails, the sinks are dropped (an L1 reservation is then discarded) and
    /// fewer results than items come back: every missing one is a miss.
    async fn load_direct(&self, items: Vec<DirectItem>) -> Vec<DirectResult> {
        let inner = self.inner.clone();
        blocking(move || {
            items
                .into_iter()
                .map(|(k, hlen, mut sink)| {
                    let r = inner.load_direct_one(&k, hlen, sink.payload_mut());
                    (sink, r)
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap_or_default()
    }

    async fn ping(&self) -> Result<(), L2Error> {
        let base = self.inner.config.base_path.clone();
        blocking(move || std::fs::metadata(&base).map(|_| ()).map_err(L2Error::from)).await?
    }

    /// One walk of the shard directories (no sorting).
    async fn scan(&self, limit: usize) -> Result<Vec<(ObjectKey, u64)>, L2Error> {
        let base = self.inner.config.base_path.clone();
        blocking(move || {
            let found = walk(&base, limit, |_| true)?;
            Ok(found.into_iter().map(|(_, k, n)| (k, n)).collect())
        })
        .await?
    }

    async fn list(
        &self,
        filter: &KeyFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<KeyPage, L2Error> {
        let base = self.inner.config.base_path.clone();
        let filter = filter.clone();
        let cursor = cursor.map(str::to_owned);
        blocking(move || {
            let mut all = walk(&base, usize::MAX, |k| filter.matches(k))?;
            all.sort_by(|a, b| a.0.cmp(&b.0));
            Ok(crate::adapter::page_sorted(all, cursor.as_deref(), limit))
        })
        .await?
    }

    async fn close(&self) {
        let sweep = self.inner.sweep.lock().take();
        if let Some(s) = sweep {
            s.stop.store(true, Ordering::Relaxed);
            let _ = blocking(move || s.thread.join()).await;
        }
    }

    fn describe(&self) -> serde_json::Value {
        let c = &self.inner.config;
        serde_json::json!({
            "type": "fs",
            "base_path": c.base_path,
            "relative_tmp_dir": c.relative_tmp_dir,
            "use_odirect": c.use_odirect,
            "odirect_active": self.inner.odirect,
            "fsync": format!("{:?}", c.fsync).to_lowercase(),
        })
    }
}

/// The blob files under `base` (one level of shard directories) whose names parse as wire
/// keys and whose key passes `keep`: (wire key, key, size), at most `limit`, unsorted.
fn walk(
    base: &Path,
    limit: usize,
    keep: impl Fn(&ObjectKey) -> bool,
) -> Result<Vec<(String, ObjectKey, u64)>, L2Error> {
    let mut out = Vec::new();
    for shard in std::fs::read_dir(base)?.flatten() {
        let Ok(files) = std::fs::read_dir(shard.path()) else { continue };
        for f in files.flatten() {
            let Some(wk) = unescape(&f.file_name().to_string_lossy()) else { continue };
            let Some(key) = wire_key::decode(&wk) else { continue };
            if !keep(&key) {
                continue;
            }
            let Ok(meta) = f.metadata() else { continue };
            out.push((wk, key, meta.len()));
            if out.len() >= limit {
                return Ok(out);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_escape_and_round_trip() {
        let k = ObjectKey::new([0xcd; 32], "org/Model 7B", 1, 0, 0, "t").unwrap();
        let n = file_name(&k);
        assert!(!n.contains('/') && !n.contains(' '), "{n}");
        assert_eq!(wire_key::decode(&unescape(&n).unwrap()), Some(k));
    }
}
