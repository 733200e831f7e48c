//! The worker registrations a warm restart takes back, in a file beside the L1 file.
//!
//! A server that restarts warm (or takes over with `--take-over`) adopts the L1 of the
//! process before it, but the workers registered with that process: LMCache's `lmcache bench
//! server` client registers its KV caches once and never again, and vLLM's adapter only after
//! a ping answered `false` and a heartbeat (2-3 s without hits). So every registration that
//! succeeded is also written here, as the request that made it, and a warm start replays
//! each one through the same handler, with the same checks, before the server takes requests.
//! One that no longer applies (the client's segment is gone, the L1 pool has another name or
//! size than the one an engine-driven worker mapped) is dropped and logged, and that worker
//! is told by its next ping, as after any restart.
//!
//! The file (`<L1 file>.lmcache-rs-workers`) is ours by name: it is replaced whole (a
//! temporary file renamed over it) each time a registration comes or goes, read at a warm
//! start, and removed at a cold one. A file that does not decode is logged and ignored.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use lmcache_protocol::Op;
use parking_lot::Mutex;
use rmpv::Value;

use crate::registry::Family;

/// What ends the L1 file's name to name its registrations file.
pub const SUFFIX: &str = ".lmcache-rs-workers";
const MAGIC: &str = "lmcache-rs workers";
const VERSION: u64 = 1;

/// One registration as it was made.
#[derive(Debug, Clone, PartialEq)]
pub struct Saved {
    /// Its family.
    pub family: Family,
    /// The worker's instance id.
    pub id: u64,
    /// The registering request's parameters (its operation is the family's
    /// [`Family::register_op`]), as decoded from the wire.
    pub params: Vec<Value>,
    /// For an engine-driven worker: the pool it was told to map (name, bytes).
    pub segment: Option<(String, u64)>,
}

/// The registrations file of one L1 file.
#[derive(Debug)]
pub struct RegistryFile {
    path: PathBuf,
    saved: Mutex<BTreeMap<(bool, u64), Saved>>,
}

/// The registrations file beside `l1_file`.
pub fn path_for(l1_file: &Path) -> PathBuf {
    crate::l1_sidecar::path_for(l1_file, SUFFIX)
}

impl RegistryFile {
    /// Opens the file beside a warm-restarting L1 file and returns what it holds (to replay).
    /// The returned file starts empty: each replayed registration is written back by the
    /// handler that takes it.
    pub fn open(l1_file: &Path) -> (Self, Vec<Saved>) {
        let path = path_for(l1_file);
        let saved = match std::fs::read(&path) {
            Ok(bytes) => decode(&bytes).unwrap_or_else(|e| {
                tracing::warn!(path = %path.display(), error = %e, "ignoring the registrations file");
                Vec::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the registrations file");
                Vec::new()
            }
        };
        (Self { path, saved: Mutex::default() }, saved)
    }

    /// Removes the registrations file of an L1 file that starts cold (its workers registered
    /// with a process whose L1 is gone).
    pub fn remove_for(l1_file: &Path) {
        crate::l1_sidecar::remove(l1_file, SUFFIX, "registrations");
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records a registration that succeeded (replacing one of the same worker).
    pub fn put(&self, saved: Saved) {
        let mut map = self.saved.lock();
        map.insert((saved.family == Family::EngineDriven, saved.id), saved);
        self.write(&map);
    }

    /// Forgets the registrations of `keys` (unregistered, refused or reaped); writes only when
    /// one was known.
    pub fn remove(&self, keys: &[(Family, u64)]) {
        let mut map = self.saved.lock();
        let before = map.len();
        for (family, id) in keys {
            map.remove(&(*family == Family::EngineDriven, *id));
        }
        if map.len() != before {
            self.write(&map);
        }
    }

    /// Replaces the file with `map` (a temporary file renamed over it, so a reader sees the
    /// old set or the new one). A failure is logged: the registrations still serve; only a
    /// restart would not take them back.
    fn write(&self, map: &BTreeMap<(bool, u64), Saved>) {
        // No fsync: the registrations serve only while their clients live, and no client
        // outlives a reboot; a process crash leaves the page cache as it was.
        if let Err(e) = crate::l1_sidecar::replace(&self.path, &encode(map.values())) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot save the registrations");
        }
    }
}

fn encode<'a>(saved: impl Iterator<Item = &'a Saved>) -> Vec<u8> {
    encode_as(saved, |s| s.family.register_op())
}

/// [`encode`], naming each entry's operation by `op` (the file keeps it, for whoever reads
/// it; a test writes a wrong one).
fn encode_as<'a>(saved: impl Iterator<Item = &'a Saved>, op: impl Fn(&Saved) -> Op) -> Vec<u8> {
    let entries: Vec<Value> = saved
        .map(|s| {
            let segment = match &s.segment {
                Some((name, len)) => Value::Array(vec![name.as_str().into(), (*len).into()]),
                None => Value::Nil,
            };
            Value::Map(vec![
                ("family".into(), s.family.as_str().into()),
                ("id".into(), s.id.into()),
                ("op".into(), op(s).name().into()),
                ("params".into(), Value::Array(s.params.clone())),
                ("segment".into(), segment),
            ])
        })
        .collect();
    let doc = Value::Array(vec![MAGIC.into(), VERSION.into(), Value::Array(entries)]);
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &doc);
    out
}

fn decode(bytes: &[u8]) -> Result<Vec<Saved>, String> {
    let mut cursor = bytes;
    let doc = rmpv::decode::read_value(&mut cursor).map_err(|e| format!("not msgpack: {e}"))?;
    let [magic, version, entries] = doc.as_array().map(Vec::as_slice).unwrap_or_default() else {
        return Err("not a registrations file".into());
    };
    if magic.as_str() != Some(MAGIC) || version.as_u64() != Some(VERSION) {
        return Err(format!("not a version {VERSION} registrations file"));
    }
    let entries = entries.as_array().ok_or("entries: not a list")?;
    entries
        .iter()
        .enumerate()
        .map(|(i, e)| entry(e).map_err(|r| format!("entry {i}: {r}")))
        .collect()
}

fn entry(e: &Value) -> Result<Saved, String> {
    let map = e.as_map().ok_or("not a map")?;
    let get = |k: &str| {
        map.iter()
            .find(|(key, _)| key.as_str() == Some(k))
            .map(|(_, v)| v)
            .ok_or(format!("{k}: missing"))
    };
    let family = match get("family")?.as_str() {
        Some("lmcache_driven") => Family::LmcacheDriven,
        Some("engine_driven") => Family::EngineDriven,
        other => return Err(format!("family: {other:?}")),
    };
    let id = get("id")?.as_u64().ok_or("id: not a count")?;
    let op = get("op")?.as_str().and_then(Op::from_name).ok_or("op: unknown")?;
    if op != family.register_op() {
        return Err(format!("op: {} does not register the {} family", op.name(), family.as_str()));
    }
    let params = get("params")?.as_array().ok_or("params: not a list")?.clone();
    let segment = match get("segment")? {
        Value::Nil => None,
        Value::Array(a) => match a.as_slice() {
            [name, len] => Some((
                name.as_str().ok_or("segment: name")?.to_owned(),
                len.as_u64().ok_or("segment: size")?,
            )),
            _ => return Err("segment: not [name, size]".into()),
        },
        _ => return Err("segment: not [name, size]".into()),
    };
    Ok(Saved { family, id, params, segment })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved(family: Family, id: u64) -> Saved {
        let segment = (family == Family::EngineDriven).then(|| ("pool".to_owned(), 1 << 30));
        Saved { family, id, params: vec![Value::from(id), Value::from("m")], segment }
    }

    #[test]
    fn registrations_come_back_after_a_restart_and_go_with_their_workers() {
        let dir = tempfile::tempdir().unwrap();
        let l1 = dir.path().join("l1.dax");
        let (file, before) = RegistryFile::open(&l1);
        assert!(before.is_empty());
        assert_eq!(file.path(), dir.path().join("l1.dax.lmcache-rs-workers"));
        file.put(saved(Family::LmcacheDriven, 7));
        file.put(saved(Family::EngineDriven, 7));
        file.put(saved(Family::EngineDriven, 9));
        file.remove(&[(Family::EngineDriven, 9), (Family::LmcacheDriven, 1)]);
        let (_again, back) = RegistryFile::open(&l1);
        assert_eq!(back, vec![saved(Family::LmcacheDriven, 7), saved(Family::EngineDriven, 7)]);
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(path_for(&l1)).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        // No temporary file is left beside it.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        RegistryFile::remove_for(&l1);
        assert!(RegistryFile::open(&l1).1.is_empty());
    }

    #[test]
    fn a_damaged_or_foreign_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let l1 = dir.path().join("l1");
        for bytes in [
            b"garbage".to_vec(),
            encode(std::iter::empty()).into_iter().map(|b| b ^ 1).collect(),
            // An operation that is not the family's registration.
            encode_as([saved(Family::LmcacheDriven, 1)].iter(), |_| Op::Store),
        ] {
            std::fs::write(path_for(&l1), &bytes).unwrap();
            assert!(RegistryFile::open(&l1).1.is_empty());
        }
    }
}
