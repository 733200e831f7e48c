//! What the kernel tells of a device-dax character device (`/dev/daxX.Y`): its size and the
//! alignment every mapping of it must keep, read from sysfs.
//!
//! A device-dax node takes only `mmap`, and `drivers/dax/device.c` refuses (EINVAL) a mapping
//! whose start or end is not a multiple of the device's alignment (2 MiB unless the operator
//! chose otherwise with `daxctl`), so a 4 KiB mapping of a superblock fails there though it
//! works on a file. Nor does the node have a length (`st_size` is 0): a mapping past the
//! device's end faults with SIGBUS on first touch. Every mapping of a character device goes
//! through [`DaxDevice::check`], which rounds its length up to the alignment and bounds it by
//! the size, and a character device sysfs does not describe as device-dax (`/dev/zero`, a
//! terminal) is refused by name before anything is mapped or written.

use std::fs::Metadata;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use crate::error::MemoryError;

/// Where sysfs is mounted.
const SYSFS: &str = "/sys";
/// The kernel's alignment of a device-dax device when sysfs does not say (kernels before the
/// per-device `align` attribute): a PMD, 2 MiB.
const DEFAULT_ALIGN: u64 = 2 << 20;

/// A device-dax character device's size and mapping alignment, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DaxDevice {
    /// Bytes the device holds.
    pub size: u64,
    /// Every mapping's offset and length must be a multiple of this.
    pub align: u64,
}

impl DaxDevice {
    /// The device-dax facts of a file, from its `stat`, when it is a character device
    /// (refused when sysfs does not describe it as device-dax); `None` for a regular file or a
    /// block device, which need none of this.
    pub fn of(meta: &Metadata) -> Result<Option<Self>, MemoryError> {
        if !meta.file_type().is_char_device() {
            return Ok(None);
        }
        let rdev = meta.rdev();
        let (major, minor) = (nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev));
        Self::from_sysfs(Path::new(SYSFS), major, minor).map(Some)
    }

    /// Reads `<root>/dev/char/<major>:<minor>/{size,align}`.
    fn from_sysfs(root: &Path, major: u64, minor: u64) -> Result<Self, MemoryError> {
        let dir = root.join(format!("dev/char/{major}:{minor}"));
        let read = |name: &str| -> Result<Option<u64>, MemoryError> {
            match std::fs::read_to_string(dir.join(name)) {
                Ok(s) => s.trim().parse::<u64>().map(Some).map_err(|_| MemoryError::DaxDevice {
                    reason: format!("{}/{name} holds {:?}, not a number", dir.display(), s.trim()),
                }),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(MemoryError::DaxDevice {
                    reason: format!("cannot read {}/{name}: {e}", dir.display()),
                }),
            }
        };
        let Some(size) = read("size")? else {
            return Err(MemoryError::DaxDevice {
                reason: format!(
                    "character device {major}:{minor} is not a device-dax device ({}/size is \
                     missing); only a /dev/dax device, a block device or a file can hold this",
                    dir.display()
                ),
            });
        };
        let align = read("align")?.unwrap_or(DEFAULT_ALIGN);
        if align < 4096 || !align.is_power_of_two() {
            return Err(MemoryError::DaxDevice {
                reason: format!(
                    "{}/align is {align}, not a power of two of 4096 or more",
                    dir.display()
                ),
            });
        }
        Ok(Self { size, align })
    }

    /// The length to map for `len` bytes at `offset`: `len` rounded up to the alignment.
    /// Refused when `offset` is not aligned or the mapping would run past the device's end.
    pub fn check(&self, offset: u64, len: u64) -> Result<u64, MemoryError> {
        if offset % self.align != 0 {
            return Err(MemoryError::DaxDevice {
                reason: format!(
                    "a mapping at byte {offset} is not on the device's {}-byte alignment \
                     (`daxctl reconfigure-device --align 2M` sets the usual one)",
                    self.align
                ),
            });
        }
        let mapped = len.checked_next_multiple_of(self.align).filter(|&m| m > 0);
        match mapped.and_then(|m| offset.checked_add(m).map(|end| (m, end))) {
            Some((m, end)) if end <= self.size => Ok(m),
            _ => Err(MemoryError::DaxDevice {
                reason: format!(
                    "{len} bytes at byte {offset} (mapped in {}-byte steps) do not fit the \
                     device's {} bytes",
                    self.align, self.size
                ),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sysfs(size: Option<&str>, align: Option<&str>) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("dev/char/251:3");
        std::fs::create_dir_all(&dir).unwrap();
        if let Some(s) = size {
            std::fs::write(dir.join("size"), s).unwrap();
        }
        if let Some(a) = align {
            std::fs::write(dir.join("align"), a).unwrap();
        }
        root
    }

    #[test]
    fn size_and_alignment_come_from_the_devices_sysfs_directory() {
        let root = sysfs(Some("17179869184\n"), Some("2097152\n"));
        let d = DaxDevice::from_sysfs(root.path(), 251, 3).unwrap();
        assert_eq!(d, DaxDevice { size: 16 << 30, align: 2 << 20 });
        // Without the `align` attribute (older kernels): the kernel's default, 2 MiB.
        let root = sysfs(Some("1073741824"), None);
        assert_eq!(DaxDevice::from_sysfs(root.path(), 251, 3).unwrap().align, 2 << 20);
    }

    #[test]
    fn a_character_device_without_a_dax_size_is_refused_by_name() {
        let root = sysfs(None, None);
        let e = DaxDevice::from_sysfs(root.path(), 251, 3).unwrap_err().to_string();
        assert!(e.contains("not a device-dax device") && e.contains("251:3/size"), "{e}");
        let root = sysfs(Some("lots"), None);
        let e = DaxDevice::from_sysfs(root.path(), 251, 3).unwrap_err().to_string();
        assert!(e.contains("\"lots\", not a number"), "{e}");
        let root = sysfs(Some("1073741824"), Some("3000"));
        let e = DaxDevice::from_sysfs(root.path(), 251, 3).unwrap_err().to_string();
        assert!(e.contains("align is 3000"), "{e}");
    }

    #[test]
    fn mappings_are_rounded_to_the_alignment_and_bounded_by_the_size() {
        let d = DaxDevice { size: 64 << 20, align: 2 << 20 };
        // A 4 KiB superblock maps as one 2 MiB step; an aligned length stays as it is.
        assert_eq!(d.check(0, 4096).unwrap(), 2 << 20);
        assert_eq!(d.check(2 << 20, 8 << 20).unwrap(), 8 << 20);
        assert_eq!(d.check(0, 64 << 20).unwrap(), 64 << 20);
        // Off the alignment, past the end, empty, or overflowing: refused, naming why.
        let e = d.check(4096, 4096).unwrap_err().to_string();
        assert!(e.contains("not on the device's 2097152-byte alignment"), "{e}");
        let e = d.check(2 << 20, (62 << 20) + 1).unwrap_err().to_string();
        assert!(e.contains("do not fit the device's 67108864 bytes"), "{e}");
        assert!(d.check(0, 0).is_err());
        assert!(d.check(u64::MAX - (2 << 20) + 1, 1).is_err());
        assert!(d.check(0, u64::MAX).is_err());
    }

    #[test]
    fn files_need_no_device_facts_and_dev_zero_is_not_device_dax() {
        let f = tempfile::tempfile().unwrap();
        assert_eq!(DaxDevice::of(&f.metadata().unwrap()).unwrap(), None);
        // /dev/zero is a character device that maps, but no device-dax one; opened read-only,
        // nothing is written.
        let zero = std::fs::File::open("/dev/zero").unwrap();
        let e = DaxDevice::of(&zero.metadata().unwrap()).unwrap_err().to_string();
        assert!(e.contains("1:5 is not a device-dax device"), "{e}");
    }
}
