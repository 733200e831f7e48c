//! Trace recording (`--trace-level storage|events --trace-output FILE`): LMCache's `.lct`
//! files, readable by `lmcache trace info|replay|replay-events` and by ours.
//!
//! - **storage**: the storage calls a request makes, under LMCache's qualified names and
//!   argument shapes: a lookup is `submit_prefetch_task(spec, external_request_id, skip_l2)`,
//!   a store `reserve_write(keys, layout_desc)` then `finish_write(keys)`, a retrieve
//!   `finish_read_prefetched(keys, read_locks)` once its copy is done, and a request's unspent
//!   lookup locks `finish_read_prefetched` with their count.
//! - **events**: each cache-event batch, as `POST /events` carries it (`events.batch`), and a
//!   `start` / `stop` mark (`events.lifecycle`). Recorded with or without a coordinator.
//!
//! Records are built on the request path only when a recorder exists, and written by one
//! thread behind a bounded queue: a request never waits for the disk. When the queue is full
//! a record is dropped, counted (`lmcache_rs_trace_dropped_records`) and the first drop
//! logged. The header (with the storage configuration as JSON and its SHA-256, credentials
//! redacted) is written at start, so even a recorder killed at once leaves a readable file;
//! a torn last frame is what LMCache's reader and ours both tolerate.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lmcache_core::ObjectKey;
use lmcache_workload::trace::codec::{self, KeyGroup, LayoutDesc, PrefetchSpec};
use lmcache_workload::trace::{Header, Level, Record, TraceWriter};

use crate::registry::ObjectShape;
use parking_lot::Mutex;
use rmpv::Value;
use sha2::Digest;

/// `--trace-level` and `--trace-output`.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceConfig {
    /// What to record.
    pub level: Level,
    /// The file (created or truncated).
    pub path: PathBuf,
}

/// LMCache's default output: `$TMPDIR/lmcache-trace-<pid>-<UTC %Y%m%d-%H%M%S>.lct`.
pub fn default_trace_path() -> PathBuf {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let stamp = crate::lookup_log::utc_stamp(secs).replace('_', "-");
    std::env::temp_dir().join(format!("lmcache-trace-{}-{stamp}.lct", std::process::id()))
}

/// Records queued before new ones are dropped.
const QUEUE: usize = 65_536;

enum Msg {
    Record(Box<Record>),
    Close,
}

/// The recorder: a queue to the writer thread.
#[derive(Debug)]
pub struct TraceRecorder {
    level: Level,
    tx: SyncSender<Msg>,
    started: Instant,
    dropped: AtomicU64,
    writer: Mutex<Option<JoinHandle<()>>>,
    path: PathBuf,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Msg::Record(_) => "Record",
            Msg::Close => "Close",
        })
    }
}

/// Seconds of `CLOCK_MONOTONIC`, as Python's `time.monotonic()`.
fn monotonic_now() -> f64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map_or(0.0, |t| t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9)
}

fn wall_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// Field names whose values never go into a trace header.
fn is_secret(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    ["password", "secret", "token", "credential", "access_key", "session_key"]
        .iter()
        .any(|s| n.contains(s))
        || matches!(n.as_str(), "key" | "master_key" | "encryption_key" | "auth")
}

/// `v` with every credential-like field replaced by `"<redacted>"`.
pub fn redact(v: &serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(o) => serde_json::Value::Object(
            o.iter()
                .map(|(k, x)| {
                    let x = if is_secret(k) && !x.is_null() {
                        serde_json::Value::from("<redacted>")
                    } else {
                        redact(x)
                    };
                    (k.clone(), x)
                })
                .collect(),
        ),
        serde_json::Value::Array(a) => serde_json::Value::Array(a.iter().map(redact).collect()),
        other => other.clone(),
    }
}

/// The header's config JSON (keys sorted, as LMCache's `json.dumps(sort_keys=True)`) and its
/// SHA-256 in hex.
pub fn config_digest(config: &serde_json::Value) -> (String, String) {
    // serde_json's map is ordered by key: the text is canonical.
    let text = redact(config).to_string();
    let digest = sha2::Sha256::digest(text.as_bytes());
    (text, hex::encode(digest))
}

impl TraceRecorder {
    /// Creates the file, writes the header and starts the writer thread.
    pub fn start(
        config: &TraceConfig,
        storage_config: &serde_json::Value,
        level_meta: Vec<(String, Value)>,
    ) -> std::io::Result<Self> {
        let file = std::fs::File::create(&config.path)?;
        let mut header = Header::new(config.level, monotonic_now(), wall_now());
        let (json, digest) = config_digest(storage_config);
        header.sm_config_json = json;
        header.sm_config_digest = digest;
        header.level_meta = level_meta;
        let mut writer = TraceWriter::new(std::io::BufWriter::new(file));
        writer.write_header(&header)?;
        writer.flush()?;
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let path = config.path.clone();
        let shown = path.clone();
        let join = std::thread::Builder::new()
            .name("trace-recorder".into())
            .spawn(move || write_loop(writer, rx, &shown))?;
        tracing::info!(path = %path.display(), level = config.level.as_str(), "trace recording");
        Ok(Self {
            level: config.level,
            tx,
            started: Instant::now(),
            dropped: AtomicU64::new(0),
            writer: Mutex::new(Some(join)),
            path,
        })
    }

    /// The level recorded.
    pub fn level(&self) -> Level {
        self.level
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Queues one record, stamped now (dropped and counted when the writer is behind).
    pub fn record(&self, qualname: &str, args: Value) {
        let record = Record {
            t_mono: self.started.elapsed().as_secs_f64(),
            t_wall: wall_now(),
            qualname: qualname.to_owned(),
            args,
        };
        match self.tx.try_send(Msg::Record(Box::new(record))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                if self.dropped.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!(path = %self.path.display(), "trace recorder is behind; dropping records (counted)");
                }
            }
        }
    }

    /// Records dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Writes what is queued, syncs the file and stops the thread. Later records are dropped.
    pub fn close(&self) {
        // Blocking send: the close mark queues behind every record already accepted.
        let _ = self.tx.send(Msg::Close);
        if let Some(j) = self.writer.lock().take() {
            let _ = j.join();
        }
        let dropped = self.dropped();
        if dropped > 0 {
            tracing::warn!(dropped, path = %self.path.display(), "trace closed; records were dropped");
        } else {
            tracing::info!(path = %self.path.display(), "trace closed cleanly");
        }
    }
}

fn write_loop(
    mut w: TraceWriter<std::io::BufWriter<std::fs::File>>,
    rx: Receiver<Msg>,
    path: &Path,
) {
    let mut failed = false;
    let mut dirty = false;
    loop {
        let msg = match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(m) => Some(m),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Some(Msg::Close),
        };
        match msg {
            Some(Msg::Record(r)) => {
                if !failed && let Err(e) = w.write_record(&r) {
                    tracing::warn!(error = %e, path = %path.display(), "trace write failed; recording stops");
                    failed = true;
                }
                dirty = true;
            }
            Some(Msg::Close) => break,
            None if dirty => {
                // Idle: push what is buffered to the file, so a killed server loses little.
                let _ = w.flush();
                dirty = false;
            }
            None => {}
        }
    }
    let _ = w.flush();
    let file = w.into_inner();
    if let Ok(f) = file.into_inner() {
        let _ = f.sync_all();
    }
}

/// The storage-level records, in LMCache's argument shapes.
impl TraceRecorder {
    /// `reserve_write(keys, layout_desc)`.
    pub fn reserve_write(&self, keys: &[ObjectKey], object: Option<&ObjectShape>) {
        self.record(
            codec::RESERVE_WRITE,
            codec::args(vec![
                ("keys", codec::object_keys(keys)),
                ("layout_desc", layout_desc(object).to_value()),
            ]),
        );
    }

    /// `finish_write(keys)`.
    pub fn finish_write(&self, keys: &[ObjectKey]) {
        if !keys.is_empty() {
            self.record(codec::FINISH_WRITE, codec::args(vec![("keys", codec::object_keys(keys))]));
        }
    }

    /// `submit_prefetch_task(spec, external_request_id, skip_l2=False)`: one key group per
    /// object group, each listing every shard's keys.
    pub fn submit_prefetch(&self, request_id: &str, groups: Vec<KeyGroup>, readers: u32) {
        let spec = PrefetchSpec {
            key_groups: groups,
            num_kv_readers: readers,
            fetching_policy: "prefix".into(),
            lock_mode: "LOCK".into(),
        };
        self.record(
            codec::SUBMIT_PREFETCH,
            codec::args(vec![
                ("spec", spec.to_value()),
                ("external_request_id", Value::from(request_id)),
                ("skip_l2", Value::Boolean(false)),
            ]),
        );
    }

    /// `finish_read_prefetched(keys, read_locks)`: a retrieve released its locks.
    pub fn finish_read(&self, keys: &[ObjectKey], read_locks: u32) {
        if !keys.is_empty() {
            self.record(
                codec::FINISH_READ,
                codec::args(vec![
                    ("keys", codec::object_keys(keys)),
                    ("read_locks", Value::from(read_locks)),
                ]),
            );
        }
    }
}

/// LMCache's `MemoryLayoutDesc` of an object: one `[kv, layers, slots, hidden]` shape and a
/// torch-spelled dtype per part (also what a lookup-hash log line names).
pub fn layout_desc(object: Option<&ObjectShape>) -> LayoutDesc {
    let parts = object.map(|o| o.parts.as_slice()).unwrap_or_default();
    LayoutDesc {
        shapes: parts.iter().map(|p| vec![p.kv, p.layers, p.slots, p.hidden]).collect(),
        dtypes: parts.iter().map(|p| format!("torch.{}", p.dtype.as_str())).collect(),
    }
}

/// A key group of a prefetch spec: `keys` of object group `og` of `object`.
pub fn key_group(og: u32, keys: Vec<ObjectKey>, object: Option<&ObjectShape>) -> KeyGroup {
    KeyGroup {
        keys,
        object_group_id: og,
        layout: Some(layout_desc(object)),
        // LMCache writes -1 for full attention.
        sliding_window_size: object.and_then(|o| o.window_chunks).map_or(-1, |w| w as i64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lmcache_workload::trace::TraceReader;

    #[test]
    fn a_recording_reads_back_with_its_header_and_records_in_order() {
        let dir = std::env::temp_dir().join(format!("lmcrs-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.lct");
        let cfg = TraceConfig { level: Level::Storage, path: path.clone() };
        let storage = serde_json::json!({"l1": {"size_bytes": 1}, "l2_adapters": [{"type": "redis", "password": "pw"}]});
        let rec = TraceRecorder::start(&cfg, &storage, Vec::new()).unwrap();
        for i in 0..100u32 {
            rec.record("q", Value::Map(vec![(Value::from("i"), Value::from(i))]));
        }
        rec.close();
        rec.record("late", Value::Map(vec![]));
        let mut r = TraceReader::new(std::fs::File::open(&path).unwrap()).unwrap();
        assert_eq!(r.header().level, "storage");
        assert!(!r.header().sm_config_json.contains("pw"), "{}", r.header().sm_config_json);
        assert!(r.header().sm_config_json.contains("<redacted>"));
        assert_eq!(r.header().sm_config_digest.len(), 64);
        let recs = r.read_all().unwrap();
        assert_eq!(recs.len(), 100);
        assert!(recs.windows(2).all(|w| w[0].t_mono <= w[1].t_mono));
        assert_eq!(recs[99].arg("i"), Some(&Value::from(99)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn digests_are_sha256_of_the_sorted_json() {
        let (text, digest) = config_digest(&serde_json::json!({"b": 1, "a": 2}));
        assert_eq!(text, r#"{"a":2,"b":1}"#);
        assert_eq!(digest, hex::encode(sha2::Sha256::digest(br#"{"a":2,"b":1}"#)));
        assert!(
            is_secret("aws_secret_access_key") && is_secret("password") && !is_secret("key_prefix")
        );
    }

    #[test]
    fn the_default_path_is_lmcaches() {
        let p = default_trace_path();
        let name = p.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with(&format!("lmcache-trace-{}-", std::process::id())), "{name}");
        assert!(name.ends_with(".lct") && name.len() > 30, "{name}");
    }
}
