//! The coordinator's settings, with LMCache's `MPCoordinatorConfig` defaults.

use std::path::PathBuf;
use std::time::Duration;

/// Settings. [`Default`] is LMCache's defaults.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// Address to bind (LMCache: `0.0.0.0`).
    pub host: String,
    /// Port (9300).
    pub port: u16,
    /// An instance silent this long is dropped (30 s).
    pub instance_timeout: Duration,
    /// How often silent instances are looked for (10 s; zero disables).
    pub health_check_interval: Duration,
    /// Tokens per chunk, as the fleet hashes them (256).
    pub chunk_size: usize,
    /// Token hash algorithm; only `blake3` (LMCache's default) is served.
    pub hash_algorithm: String,
    /// Chunk hashes whose tokens are kept for answers that echo them.
    pub max_token_bindings: usize,
    /// The checkpoint file (registry, stream cursors, declarations, directory): restored at
    /// start, written every `checkpoint_interval` and at stop. `None`: no checkpoint.
    pub checkpoint_path: Option<PathBuf>,
    /// Seconds between checkpoints (60; zero writes only at stop).
    pub checkpoint_interval: Duration,
    /// Where pins and quotas would be kept (not written yet).
    pub metadata_path: Option<PathBuf>,
    /// Whether `/metrics` is served (true).
    pub metrics_enabled: bool,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            host: "0.0.0.0".into(),
            port: 9300,
            instance_timeout: Duration::from_secs(30),
            health_check_interval: Duration::from_secs(10),
            chunk_size: 256,
            hash_algorithm: "blake3".into(),
            max_token_bindings: 262_144,
            checkpoint_path: None,
            checkpoint_interval: Duration::from_secs(60),
            metadata_path: None,
            metrics_enabled: true,
        }
    }
}
