//! Finding `libnixl_capi.so`: an explicit path, or the NIXL wheel in a Python environment.

use std::path::{Path, PathBuf};

use crate::NixlError;

/// The C API library's file name.
pub const LIBRARY: &str = "libnixl_capi.so";

/// The wheels' library folders under site-packages, in the order LMCache imports them
/// (`nixl`, `nixl_cu12`, `nixl_cu13`).
const WHEEL_DIRS: [&str; 3] =
    [".nixl.mesonpy.libs", ".nixl_cu12.mesonpy.libs", ".nixl_cu13.mesonpy.libs"];

/// The library to load: `explicit` when given (a file, or a folder holding it), else the
/// first NIXL wheel in the site-packages of `python` (run once to ask where they are).
pub fn locate(explicit: Option<&Path>, python: &str) -> Result<PathBuf, NixlError> {
    if let Some(p) = explicit {
        let file = if p.is_dir() { p.join(LIBRARY) } else { p.to_path_buf() };
        return if file.is_file() {
            Ok(file)
        } else {
            Err(NixlError::NotFound(format!("no NIXL library at {}", file.display())))
        };
    }
    let script = "import site, sysconfig; print('\\n'.join([sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']] + site.getsitepackages()))";
    let out = std::process::Command::new(python).args(["-c", script]).output().map_err(|e| {
        NixlError::NotFound(format!("cannot run {python} to find the NIXL wheel: {e}"))
    })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut dirs: Vec<&Path> = Vec::new();
    for d in text.lines().map(Path::new) {
        if !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    first_in(&dirs).ok_or_else(|| {
        NixlError::NotFound(format!(
            "no NIXL wheel in {python}'s site-packages ({}); install it with `pip install nixl-cu12==1.5.1`, or name the library with --nixl-library",
            dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
        ))
    })
}

fn first_in(site_dirs: &[&Path]) -> Option<PathBuf> {
    WHEEL_DIRS
        .iter()
        .flat_map(|w| site_dirs.iter().map(move |d| d.join(w).join(LIBRARY)))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_wheel_in_lmcache_import_order_and_names_what_is_missing() {
        let site = std::env::temp_dir().join(format!("lmcache-nixl-locate-{}", std::process::id()));
        for w in [".nixl_cu13.mesonpy.libs", ".nixl_cu12.mesonpy.libs"] {
            std::fs::create_dir_all(site.join(w)).unwrap();
            std::fs::write(site.join(w).join(LIBRARY), b"").unwrap();
        }
        let found = first_in(&[site.as_path()]).unwrap();
        assert!(found.ends_with(".nixl_cu12.mesonpy.libs/libnixl_capi.so"), "{found:?}");
        assert_eq!(locate(Some(&site.join(".nixl_cu12.mesonpy.libs")), "python3").unwrap(), found);
        let e = locate(Some(&site.join("nowhere")), "python3").unwrap_err().to_string();
        assert!(e.contains("no NIXL library at"), "{e}");
        let e = locate(None, "/nonexistent/python").unwrap_err().to_string();
        assert!(e.contains("cannot run /nonexistent/python"), "{e}");
        std::fs::remove_dir_all(&site).unwrap();
    }
}
