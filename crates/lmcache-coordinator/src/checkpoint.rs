//! The coordinator's checkpoint: one file, replaced atomically (temporary file in the same
//! directory, fsync, rename, fsync of the directory), holding the registry, the emitters'
//! stream cursors, the capacity declarations and the directory image.
//!
//! Layout: `LMRSCKPT`, format version (u32 LE), payload length (u64 LE), payload, BLAKE3 of
//! the payload. The payload is a length-prefixed JSON header (registry, cursors,
//! declarations) followed by the directory image ([`lmcache_directory::Directory::encode`]).
//! A file that fails any check is not used: the coordinator starts cold and every emitter's
//! next batch is a gap, which the repair thread resyncs. Wrong answers never come from it.

use std::io::Write as _;
use std::path::Path;

/// Why a checkpoint was not used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The file is damaged or not ours.
    #[error("corrupt checkpoint: {0}")]
    Corrupt(String),
    /// Something that is not an lmcache-rs checkpoint sits at the path: it is never
    /// overwritten.
    #[error(
        "{path} exists and is not an lmcache-rs checkpoint ({why}); it is left alone: \
         point --checkpoint-path at a new file or at an earlier checkpoint"
    )]
    NotOurs {
        /// The path.
        path: String,
        /// What it is instead.
        why: &'static str,
    },
}

const MAGIC: &[u8; 8] = b"LMRSCKPT";
const VERSION: u32 = 1;

/// Frames `header` (JSON) and `image` into a checkpoint.
pub fn frame(header: &[u8], image: &[u8]) -> Vec<u8> {
    let mut payload = Vec::with_capacity(8 + header.len() + image.len());
    payload.extend_from_slice(&(header.len() as u64).to_le_bytes());
    payload.extend_from_slice(header);
    payload.extend_from_slice(image);
    let mut out = Vec::with_capacity(payload.len() + 52);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&payload);
    out.extend_from_slice(blake3::hash(&payload).as_bytes());
    out
}

/// The (header, image) of a checkpoint, after every check.
pub fn unframe(bytes: &[u8]) -> Result<(&[u8], &[u8]), CheckpointError> {
    let bad = |m: &str| CheckpointError::Corrupt(m.to_string());
    if bytes.len() < 52 || &bytes[..8] != MAGIC {
        return Err(bad("not an lmcache-rs checkpoint"));
    }
    let mut v = [0u8; 4];
    v.copy_from_slice(&bytes[8..12]);
    if u32::from_le_bytes(v) != VERSION {
        return Err(bad("another format version"));
    }
    let mut l = [0u8; 8];
    l.copy_from_slice(&bytes[12..20]);
    let len = usize::try_from(u64::from_le_bytes(l)).map_err(|_| bad("length"))?;
    if bytes.len() != 20usize.saturating_add(len).saturating_add(32) {
        return Err(bad("truncated or extended"));
    }
    let payload = &bytes[20..20 + len];
    if blake3::hash(payload).as_bytes() != &bytes[20 + len..] {
        return Err(bad("checksum mismatch"));
    }
    if payload.len() < 8 {
        return Err(bad("payload"));
    }
    l.copy_from_slice(&payload[..8]);
    let hlen = usize::try_from(u64::from_le_bytes(l)).map_err(|_| bad("header length"))?;
    if hlen > payload.len() - 8 {
        return Err(bad("header length"));
    }
    Ok((&payload[8..8 + hlen], &payload[8 + hlen..]))
}

/// Checks that `path` may be replaced by a checkpoint: it does not exist, or it is a regular
/// file that starts with the checkpoint magic (ours, possibly damaged). Anything else was not
/// written by us and is never overwritten.
pub fn check_replaceable(path: &Path) -> Result<(), CheckpointError> {
    use std::io::Read as _;
    let not_ours = |why| CheckpointError::NotOurs { path: path.display().to_string(), why };
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    if !meta.file_type().is_file() {
        return Err(not_ours("not a regular file"));
    }
    let mut head = [0u8; 8];
    let mut f = std::fs::File::open(path)?;
    match f.read_exact(&mut head) {
        Ok(()) if &head == MAGIC => Ok(()),
        Ok(()) => Err(not_ours("it does not start with the checkpoint magic")),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Err(not_ours("shorter than a checkpoint header"))
        }
        Err(e) => Err(e.into()),
    }
}

/// Replaces the checkpoint at `path` with `bytes` atomically, unless `path` holds something
/// that is not a checkpoint ([`check_replaceable`]).
pub fn write_checkpoint(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    check_replaceable(path)?;
    write_atomic(path, bytes)
}

/// Replaces `path` with `bytes` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("checkpoint");
    let tmp = dir.join(format!(".{name}.lmcache-rs.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Ok(result?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_check_magic_length_and_checksum() {
        let f = frame(b"{}", b"image");
        assert_eq!(unframe(&f).unwrap(), (&b"{}"[..], &b"image"[..]));
        for i in 0..f.len() {
            let mut bad = f.clone();
            bad[i] ^= 0x40;
            assert!(unframe(&bad).is_err(), "a flip at byte {i} went unnoticed");
        }
        assert!(unframe(&f[..f.len() - 1]).is_err());
        let mut long = f.clone();
        long.push(0);
        assert!(unframe(&long).is_err());
    }

    #[test]
    fn a_file_that_is_not_a_checkpoint_is_never_overwritten() {
        let dir = std::env::temp_dir().join(format!("lmcache_rs_ckpt_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let theirs = dir.join("notes.txt");
        std::fs::write(&theirs, b"someone's file, long enough").unwrap();
        let err = write_checkpoint(&theirs, &frame(b"{}", b"")).unwrap_err();
        assert!(matches!(err, CheckpointError::NotOurs { .. }), "{err}");
        assert_eq!(std::fs::read(&theirs).unwrap(), b"someone's file, long enough");
        let empty = dir.join("empty");
        std::fs::write(&empty, b"").unwrap();
        assert!(write_checkpoint(&empty, &frame(b"{}", b"")).is_err());
        assert!(check_replaceable(&dir).is_err(), "a directory is not a checkpoint");
        // A new path, then our own file (even damaged), are replaced.
        let ours = dir.join("coord.ckpt");
        write_checkpoint(&ours, &frame(b"{}", b"a")).unwrap();
        let mut damaged = std::fs::read(&ours).unwrap();
        let n = damaged.len();
        damaged[n - 1] ^= 1;
        std::fs::write(&ours, &damaged).unwrap();
        write_checkpoint(&ours, &frame(b"{}", b"b")).unwrap();
        assert_eq!(unframe(&std::fs::read(&ours).unwrap()).unwrap().1, b"b");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
