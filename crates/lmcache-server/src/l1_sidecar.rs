//! Files the server keeps beside a warm-restarting L1 file (`<L1 file><suffix>`): the
//! registrations ([`crate::registry_file`]) and the chunks' tokens
//! ([`crate::chunk_tokens_file`]). Ours by their suffix; each is replaced whole through a
//! temporary file created exclusively (never through a link planted at its name) and renamed
//! over it, so a reader sees the old contents or the new ones.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// `<l1_file><suffix>`.
pub fn path_for(l1_file: &Path, suffix: &str) -> PathBuf {
    let mut name = l1_file.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// Replaces `path` with `bytes` (mode 0600) and returns the new file, open for writing at
/// its end.
pub fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<File> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    // A leftover of this pid (or anything planted at the name) goes; then only a new file.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let result = (|| {
        let mut f =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        f.write_all(bytes)?;
        std::fs::rename(&tmp, path)?;
        Ok(f)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Removes `<l1_file><suffix>` if it is there (a cold start); `what` names it in the log.
pub fn remove(l1_file: &Path, suffix: &str, what: &str) {
    let path = path_for(l1_file, suffix);
    match std::fs::remove_file(&path) {
        Ok(()) => tracing::info!(path = %path.display(), "cold start: removed the saved {what}"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove the saved {what}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_at_the_temporary_name_is_never_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"not ours").unwrap();
        let path = path_for(&dir.path().join("l1"), ".side");
        let tmp = PathBuf::from(format!("{}.{}.tmp", path.display(), std::process::id()));
        std::os::unix::fs::symlink(&victim, &tmp).unwrap();
        let mut f = replace(&path, b"ours").unwrap();
        f.write_all(b"+more").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"not ours");
        assert_eq!(std::fs::read(&path).unwrap(), b"ours+more");
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&path).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        remove(&dir.path().join("l1"), ".side", "test file");
        assert!(!path.exists());
        assert!(victim.exists());
    }
}
