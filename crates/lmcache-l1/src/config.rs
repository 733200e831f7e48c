//! L1 settings, named and defaulted as LMCache's.

use std::time::Duration;

use crate::error::L1ConfigError;
use crate::eviction::EvictionPolicyKind;

/// LMCache's default read-lock TTL (`--l1-read-ttl-seconds`).
pub const DEFAULT_READ_TTL: Duration = Duration::from_secs(300);
/// LMCache's default write-lock TTL (`--l1-write-ttl-seconds`).
pub const DEFAULT_WRITE_TTL: Duration = Duration::from_secs(600);
/// LMCache's clamp on read locks taken by one call.
pub const MAX_READ_LOCK_COUNT: u32 = 128;

/// Settings of the L1 index (the arena is configured separately).
#[derive(Debug, Clone, PartialEq)]
pub struct L1Config {
    /// Which objects leave first.
    pub eviction_policy: EvictionPolicyKind,
    /// The background pass evicts once used bytes reach this fraction of capacity (0.8).
    pub trigger_watermark: f64,
    /// ... and then evicts this fraction of the used bytes (0.2). LMCache applies its ratio to
    /// key counts; here it is bytes, which is what the setting means.
    pub eviction_ratio: f64,
    /// A parked read lease expires after this long (300 s): only a safety net against a dead
    /// client, never the way a live reader's lock ends.
    pub read_ttl: Duration,
    /// A parked write reservation expires after this long (600 s).
    pub write_ttl: Duration,
    /// Most read locks one call may take (128).
    pub max_read_locks: u32,
    /// Period of the background watermark, quota and lease pass (1 s).
    pub maintenance_interval: Duration,
}

impl Default for L1Config {
    fn default() -> Self {
        Self {
            eviction_policy: EvictionPolicyKind::Lru,
            trigger_watermark: 0.8,
            eviction_ratio: 0.2,
            read_ttl: DEFAULT_READ_TTL,
            write_ttl: DEFAULT_WRITE_TTL,
            max_read_locks: MAX_READ_LOCK_COUNT,
            maintenance_interval: Duration::from_secs(1),
        }
    }
}

impl L1Config {
    /// Checks every setting.
    pub fn validate(&self) -> Result<(), L1ConfigError> {
        for (name, value) in [
            ("eviction trigger watermark", self.trigger_watermark),
            ("eviction ratio", self.eviction_ratio),
        ] {
            if !(value > 0.0 && value <= 1.0) {
                return Err(L1ConfigError::Fraction { name, value });
            }
        }
        for (name, d) in [
            ("read TTL", self.read_ttl),
            ("write TTL", self.write_ttl),
            ("maintenance interval", self.maintenance_interval),
        ] {
            if d.is_zero() {
                return Err(L1ConfigError::Zero { name });
            }
        }
        if self.max_read_locks == 0 {
            return Err(L1ConfigError::Zero { name: "max read locks" });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_lmcache_defaults_and_valid() {
        let c = L1Config::default();
        assert_eq!((c.trigger_watermark, c.eviction_ratio), (0.8, 0.2));
        assert_eq!((c.read_ttl.as_secs(), c.write_ttl.as_secs()), (300, 600));
        c.validate().unwrap();
    }

    #[test]
    fn bad_values_are_named() {
        let c = L1Config { trigger_watermark: 1.5, ..L1Config::default() };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("watermark") && e.contains("1.5"), "{e}");
        let c = L1Config { eviction_ratio: f64::NAN, ..L1Config::default() };
        assert!(c.validate().is_err());
        let c = L1Config { read_ttl: Duration::ZERO, ..L1Config::default() };
        assert!(c.validate().unwrap_err().to_string().contains("read TTL"));
    }
}
