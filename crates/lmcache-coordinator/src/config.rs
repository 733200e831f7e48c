//! The coordinator's settings, with LMCache's `MPCoordinatorConfig` defaults.

use std::path::PathBuf;
use std::time::Duration;

/// Settings. [`Default`] is LMCache's defaults.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// Address to bind (`127.0.0.1`; LMCache binds `0.0.0.0`).
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
    /// Bearer token of the servers' HTTP APIs (their `--http-auth-token`), sent on the calls
    /// the coordinator makes to them: snapshot pages, relays, eviction orders.
    pub server_http_auth_token: Option<String>,
    /// The coordinator's own bearer token. When set, registration, heartbeats, event
    /// reports, deregistration and every write route require it (see
    /// `allow_unauthenticated_registration`). Only an instance that registered with it is
    /// trusted: sent `server_http_auth_token` and this coordinator's calls.
    pub auth_token: Option<String>,
    /// With `auth_token` set, still accept registration, heartbeats, event reports and
    /// deregistration without it (LMCache's servers send no token); such instances are never
    /// trusted. Without `auth_token` every instance is untrusted anyway.
    pub allow_unauthenticated_registration: bool,
    /// Index stored chunk contents for `/directory/blend-lookup` (LMCache's
    /// `--enable-blend-lookup`, off by default).
    pub enable_blend_lookup: bool,
    /// Query positions between blend probes (1: every position).
    pub blend_probe_stride: usize,
    /// The checkpoint file (registry, stream cursors, declarations, directory): restored at
    /// start, written every `checkpoint_interval` and at stop. `None`: no checkpoint.
    pub checkpoint_path: Option<PathBuf>,
    /// Seconds between checkpoints (60; zero writes only at stop).
    pub checkpoint_interval: Duration,
    /// The metadata document (pins and quotas, LMCache's JSON shape), loaded at start and
    /// rewritten by every request that changes them. `None`: kept in memory only.
    pub metadata_path: Option<PathBuf>,
    /// Seconds between fleet L2 eviction passes (5; zero disables).
    pub eviction_check_interval: Duration,
    /// Share of an over-quota salt's L2 keys a pass deletes (0.2).
    pub eviction_ratio: f64,
    /// Usage / limit at which a salt is evicted (1.0).
    pub trigger_watermark: f64,
    /// Whether `/metrics` is served (true).
    pub metrics_enabled: bool,
    /// Where cache events arrive (HTTP by default).
    pub event_transport: crate::transport::EventTransport,
    /// Re-publish admitted cache events in vLLM's KV-event format ([`crate::vllm_events`]);
    /// `None`: off.
    pub vllm_kv_events: Option<crate::vllm_events::VllmEventsConfig>,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 9300,
            instance_timeout: Duration::from_secs(30),
            health_check_interval: Duration::from_secs(10),
            chunk_size: 256,
            hash_algorithm: "blake3".into(),
            max_token_bindings: 262_144,
            server_http_auth_token: None,
            auth_token: None,
            allow_unauthenticated_registration: false,
            enable_blend_lookup: false,
            blend_probe_stride: 1,
            checkpoint_path: None,
            checkpoint_interval: Duration::from_secs(60),
            metadata_path: None,
            eviction_check_interval: Duration::from_secs(5),
            eviction_ratio: 0.2,
            trigger_watermark: 1.0,
            metrics_enabled: true,
            event_transport: crate::transport::EventTransport::Http,
            vllm_kv_events: None,
        }
    }
}

impl CoordinatorConfig {
    /// The directory's settings these imply.
    pub fn directory(&self) -> lmcache_directory::DirectoryConfig {
        lmcache_directory::DirectoryConfig {
            max_token_bindings: self.max_token_bindings,
            blend: self.enable_blend_lookup.then_some(lmcache_directory::BlendConfig {
                chunk_size: self.chunk_size,
                probe_stride: self.blend_probe_stride,
            }),
        }
    }
}
