//! Lookup-hash logs (`--lookup-hash-log-dir`): one JSONL line per lookup, in LMCache's format,
//! so LMCache's `lmcache tool cache-simulator` (and ours) can size a cache from real traffic.
//!
//! Files are `lookup_hashes_<UTC %Y%m%d_%H%M%S>_<n, 6 digits>.jsonl` and rotate when the
//! rotation interval has passed or the file reached its size limit; past `max_files` the
//! oldest file of that name pattern in the directory goes (files of any other name are left
//! alone). Lines are written by one thread from a bounded queue: a lookup never waits for the
//! disk; when the queue is full the line is dropped and counted.
//!
//! A line: `{"timestamp", "request_id", "model_name", "chunk_size", "seq_len", "dtypes",
//! "shapes", "chunk_hashes"}`, dtypes spelled as torch prints them (`torch.float16`), shapes of
//! the model's stored object (one per kernel group), hashes as `0x` + hex.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Settings (LMCache's flag defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupHashLogConfig {
    /// Directory of the files (created when missing).
    pub dir: PathBuf,
    /// A file is rotated once this old (6 h).
    pub rotation_interval: Duration,
    /// ... or once this large (100 MiB).
    pub rotation_max_size: u64,
    /// Files kept (100).
    pub max_files: usize,
}

impl LookupHashLogConfig {
    /// LMCache's defaults for `dir`.
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            rotation_interval: Duration::from_secs(6 * 3600),
            rotation_max_size: 100 << 20,
            max_files: 100,
        }
    }
}

/// One lookup, as a line.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LookupLine {
    /// Unix seconds.
    pub timestamp: f64,
    /// The request.
    pub request_id: String,
    /// The model.
    pub model_name: String,
    /// Tokens per chunk.
    pub chunk_size: usize,
    /// Tokens of the request (with its partial last chunk).
    pub seq_len: usize,
    /// Each object part's dtype, torch-spelled.
    pub dtypes: Vec<String>,
    /// Each object part's shape.
    pub shapes: Vec<Vec<u64>>,
    /// The chunk hashes, `0x` + hex.
    pub chunk_hashes: Vec<String>,
}

/// The logger: a queue to the writer thread.
#[derive(Debug)]
pub struct LookupHashLog {
    tx: SyncSender<LookupLine>,
    dropped: AtomicU64,
}

/// Lines queued before new ones are dropped.
const QUEUE: usize = 8192;

impl LookupHashLog {
    /// Creates the directory and starts the writer thread.
    pub fn start(config: LookupHashLogConfig) -> std::io::Result<Self> {
        std::fs::create_dir_all(&config.dir)?;
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let mut writer = Writer::new(config);
        std::thread::Builder::new().name("lookup-hash-log".into()).spawn(move || writer.run(rx))?;
        Ok(Self { tx, dropped: AtomicU64::new(0) })
    }

    /// Queues a line (dropped and counted when the writer is behind).
    pub fn record(&self, line: LookupLine) {
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                if self.dropped.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!(
                        "lookup-hash log: the writer is behind; dropping lines (counted)"
                    );
                }
            }
        }
    }

    /// Lines dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// `lookup_hashes_YYYYMMDD_HHMMSS_NNNNNN.jsonl`: the files this log writes (and LMCache's).
pub fn is_log_file(name: &str) -> bool {
    let Some(mid) = name.strip_prefix("lookup_hashes_").and_then(|s| s.strip_suffix(".jsonl"))
    else {
        return false;
    };
    let b = mid.as_bytes();
    b.len() >= 22
        && b[..8].iter().all(u8::is_ascii_digit)
        && b[8] == b'_'
        && b[9..15].iter().all(u8::is_ascii_digit)
        && b[15] == b'_'
        && b[16..].iter().all(u8::is_ascii_digit)
}

/// `YYYYMMDD_HHMMSS` of a Unix time, in UTC.
pub fn utc_stamp(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}_{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

struct Writer {
    config: LookupHashLogConfig,
    file: Option<(std::io::BufWriter<std::fs::File>, f64, u64)>,
    /// Files of the pattern, oldest first.
    files: Vec<PathBuf>,
    count: usize,
}

impl Writer {
    fn new(config: LookupHashLogConfig) -> Self {
        let mut files: Vec<(SystemTime, PathBuf)> = std::fs::read_dir(&config.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_str().is_some_and(is_log_file))
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        files.sort();
        let files: Vec<PathBuf> = files.into_iter().map(|(_, p)| p).collect();
        let count = files.len();
        Self { config, file: None, files, count }
    }

    fn run(&mut self, rx: Receiver<LookupLine>) {
        while let Ok(line) = rx.recv() {
            if let Err(e) = self.write(&line) {
                tracing::warn!(error = %e, dir = %self.config.dir.display(), "lookup-hash log: write failed");
                self.file = None;
            }
        }
        if let Some((mut f, _, _)) = self.file.take() {
            let _ = f.flush();
        }
    }

    fn write(&mut self, line: &LookupLine) -> std::io::Result<()> {
        let rotate = match &self.file {
            None => true,
            Some((_, opened, size)) => {
                line.timestamp - opened >= self.config.rotation_interval.as_secs_f64()
                    || *size >= self.config.rotation_max_size
            }
        };
        if rotate {
            self.rotate(line.timestamp)?;
        }
        let mut text = serde_json::to_vec(line).map_err(std::io::Error::other)?;
        text.push(b'\n');
        if let Some((f, _, size)) = &mut self.file {
            f.write_all(&text)?;
            f.flush()?;
            *size += text.len() as u64;
        }
        Ok(())
    }

    fn rotate(&mut self, now: f64) -> std::io::Result<()> {
        if let Some((mut f, _, _)) = self.file.take() {
            f.flush()?;
        }
        let name =
            format!("lookup_hashes_{}_{:06}.jsonl", utc_stamp(now.max(0.0) as u64), self.count);
        let path = self.config.dir.join(name);
        let file = std::fs::OpenOptions::new().create_new(true).write(true).open(&path)?;
        self.file = Some((std::io::BufWriter::new(file), now, 0));
        self.count += 1;
        self.files.push(path);
        while self.files.len() > self.config.max_files.max(1) {
            let oldest = self.files.remove(0);
            if let Err(e) = remove_own(&oldest) {
                tracing::warn!(error = %e, file = %oldest.display(), "lookup-hash log: cannot delete an old file");
            }
        }
        Ok(())
    }
}

/// Deletes `path` only if its name is one of the log's (never anything else).
fn remove_own(path: &Path) -> std::io::Result<()> {
    match path.file_name().and_then(|n| n.to_str()) {
        Some(n) if is_log_file(n) => match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        },
        _ => Ok(()),
    }
}

/// Now, in Unix seconds.
pub fn now_unix() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(ts: f64, id: &str) -> LookupLine {
        LookupLine {
            timestamp: ts,
            request_id: id.into(),
            model_name: "m".into(),
            chunk_size: 256,
            seq_len: 513,
            dtypes: vec!["torch.float16".into()],
            shapes: vec![vec![2, 32, 256, 1024]],
            chunk_hashes: vec![format!("0x{}", "ab".repeat(32))],
        }
    }

    #[test]
    fn stamps_are_utc_civil_dates() {
        assert_eq!(utc_stamp(0), "19700101_000000");
        assert_eq!(utc_stamp(1_796_151_425), "20261201_185705");
        assert_eq!(utc_stamp(951_782_400), "20000229_000000", "a leap day");
        assert!(is_log_file("lookup_hashes_20261201_185705_000000.jsonl"));
        assert!(!is_log_file("lookup_hashes_notes.jsonl"));
        assert!(!is_log_file("other_20261201_185705_000000.jsonl"));
    }

    #[test]
    fn files_rotate_by_size_and_time_and_only_ours_are_pruned() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("keep-me.jsonl"), "x").unwrap();
        std::fs::write(dir.path().join("lookup_hashes_19990101_000000_000000.jsonl"), "{}\n")
            .unwrap();
        let mut w = Writer::new(LookupHashLogConfig {
            dir: dir.path().to_path_buf(),
            rotation_interval: Duration::from_secs(60),
            rotation_max_size: 600,
            max_files: 3,
        });
        assert_eq!(w.count, 1, "the existing log file counts");
        for i in 0..10 {
            // 2 lines fill a file; one more minute also rotates.
            w.write(&line(1_796_151_425.0 + f64::from(i) * 10.0, &format!("r{i}"))).unwrap();
        }
        w.write(&line(1_796_151_425.0 + 500.0, "late")).unwrap();
        if let Some((f, _, _)) = &mut w.file {
            f.flush().unwrap();
        }
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert!(names.contains(&"keep-me.jsonl".to_owned()), "{names:?}");
        let logs: Vec<&String> = names.iter().filter(|n| is_log_file(n)).collect();
        assert_eq!(logs.len(), 3, "max_files: {names:?}");
        assert!(!names.iter().any(|n| n.contains("19990101")), "the oldest went first");
        assert!(w.count >= 5, "rotated by size and by time: {} files", w.count);
        let last = logs.last().unwrap();
        let text = std::fs::read_to_string(dir.path().join(last)).unwrap();
        let v: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        assert_eq!(v["request_id"], "late");
        assert_eq!(v["dtypes"][0], "torch.float16");
        assert_eq!(v["chunk_hashes"][0].as_str().unwrap().len(), 66);
    }
}
