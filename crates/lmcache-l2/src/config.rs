//! Adapter configuration: LMCache's `--l2-adapter '{"type": ...}'` JSON (and the same objects
//! under `[[l2_adapter]]` in a TOML file), checked field by field.
//!
//! Common fields: `type` (required), `serde` (codec, see [`crate::codec`]), and LMCache's
//! `affinity_tag`, `shared`, `persist_enabled`, `eviction` (accepted; see each adapter for
//! what it honours). Unknown fields are refused by name, so a typo never passes silently.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::adapter::L2Adapter;
use crate::adapters::fault_inject::{FaultConfig, FaultInjectAdapter, FaultMode, FaultOp};
use crate::adapters::fs::{FsAdapter, FsConfig, FsyncMode};
use crate::adapters::mock::{MockAdapter, MockConfig};
use crate::adapters::raw_block::{RawBlockAdapter, RawBlockConfig};
use crate::adapters::redis::{RedisAdapter, RedisConfig};
use crate::adapters::s3::{S3Adapter, S3Config};
use crate::codec::Codec;
use crate::error::ConfigError;

/// The adapter types this build knows.
pub const ADAPTER_TYPES: &[&str] = &[
    "fs",
    "fs_native",
    "raw_block",
    "gds_slab",
    "redis",
    "resp",
    "valkey",
    "s3",
    "dax",
    "native_plugin",
    "mock",
    "fault_inject",
];

/// Whether `spec` (or a spec nested in it) loads a native plugin: running a library's code,
/// which only the operator may ask for at start, never a caller at run time.
pub fn loads_native_code(spec: &Value) -> bool {
    match spec {
        Value::Object(o) => {
            o.get("type").and_then(Value::as_str) == Some("native_plugin")
                || o.values().any(loads_native_code)
        }
        Value::Array(a) => a.iter().any(loads_native_code),
        _ => false,
    }
}

const COMMON: &[&str] =
    &["type", "serde", "affinity_tag", "shared", "persist_enabled", "eviction", "max_capacity_gb"];

/// The eviction policies LMCache accepts in an adapter's `eviction` block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L2EvictionPolicy {
    /// Least recently stored or loaded first.
    Lru,
    /// Adaptive replacement (recency and frequency).
    Arc,
    /// One LRU per cache_salt; a salt over its quota is evicted first, and a salt without a
    /// quota has none (LMCache's allowlist semantics).
    IsolatedLru,
    /// Never evicts (the capacity still bounds admission).
    Noop,
}

impl L2EvictionPolicy {
    /// LMCache's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Lru => "LRU",
            Self::Arc => "ARC",
            Self::IsolatedLru => "IsolatedLRU",
            Self::Noop => "noop",
        }
    }
}

/// LMCache's `eviction` block: `{"eviction_policy": "LRU", "trigger_watermark": 0.8,
/// "eviction_ratio": 0.2}`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvictionSpec {
    /// The policy.
    pub policy: L2EvictionPolicy,
    /// Eviction starts when usage reaches this fraction of the capacity (0 < w ≤ 1).
    pub trigger_watermark: f64,
    /// Fraction of the used bytes one eviction pass frees (0 < r ≤ 1).
    pub eviction_ratio: f64,
}

fn eviction_spec(v: Option<&Value>) -> Result<Option<EvictionSpec>, ConfigError> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    let obj = v.as_object().ok_or_else(|| ConfigError::field("eviction", "must be an object"))?;
    for k in obj.keys() {
        if !["eviction_policy", "trigger_watermark", "eviction_ratio"].contains(&k.as_str()) {
            return Err(ConfigError::field(
                format!("eviction.{k}"),
                "unknown field (known: eviction_policy, eviction_ratio, trigger_watermark)",
            ));
        }
    }
    let policy = match obj.get("eviction_policy").and_then(Value::as_str) {
        Some(p) => match p.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "lru" => L2EvictionPolicy::Lru,
            "arc" => L2EvictionPolicy::Arc,
            "isolatedlru" => L2EvictionPolicy::IsolatedLru,
            "noop" | "none" => L2EvictionPolicy::Noop,
            _ => {
                return Err(ConfigError::field(
                    "eviction.eviction_policy",
                    format!("{p:?}: LRU|ARC|IsolatedLRU|noop"),
                ));
            }
        },
        None => return Err(ConfigError::field("eviction.eviction_policy", "missing")),
    };
    let frac = |k: &str, d: f64| -> Result<f64, ConfigError> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(d),
            Some(v) => v.as_f64().filter(|x| *x > 0.0 && *x <= 1.0).ok_or_else(|| {
                ConfigError::field(format!("eviction.{k}"), "must be a number in (0, 1]")
            }),
        }
    };
    Ok(Some(EvictionSpec {
        policy,
        trigger_watermark: frac("trigger_watermark", 0.8)?,
        eviction_ratio: frac("eviction_ratio", 0.2)?,
    }))
}

/// A built adapter with its codec.
#[derive(Debug, Clone)]
pub struct BuiltAdapter {
    /// The adapter.
    pub adapter: Arc<dyn L2Adapter>,
    /// Its codec.
    pub codec: Arc<Codec>,
    /// The configured type name.
    pub kind: String,
    /// The configuration as given (secrets masked), for /config.
    pub spec: Value,
    /// Bytes the tier may keep in it: `max_capacity_gb`, else what the backend declares
    /// (raw_block's slots, mock's size). `None`: unbounded.
    pub capacity: Option<u64>,
    /// The `eviction` block, if any.
    pub eviction: Option<EvictionSpec>,
}

/// Parses JSON text of one adapter.
pub fn parse_json(text: &str) -> Result<Value, ConfigError> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| ConfigError::field("l2-adapter", format!("not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ConfigError::field("l2-adapter", "must be a JSON object"));
    }
    Ok(v)
}

/// Reads the `[[l2_adapter]]` tables of a TOML file.
pub fn parse_toml_file(path: &std::path::Path) -> Result<Vec<Value>, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::field("l2-config", format!("{}: {e}", path.display())))?;
    let doc: toml::Table = toml::from_str(&text)
        .map_err(|e| ConfigError::field("l2-config", format!("{}: {e}", path.display())))?;
    let json =
        serde_json::to_value(doc).map_err(|e| ConfigError::field("l2-config", e.to_string()))?;
    let obj = json.as_object().cloned().unwrap_or_default();
    for k in obj.keys() {
        if k != "l2_adapter" {
            return Err(ConfigError::field(
                format!("l2-config.{k}"),
                "unknown table (expected [[l2_adapter]])",
            ));
        }
    }
    match obj.get("l2_adapter") {
        None => Ok(Vec::new()),
        Some(Value::Array(a)) => Ok(a.clone()),
        Some(_) => Err(ConfigError::field("l2-config.l2_adapter", "must be an array of tables")),
    }
}

/// Masks secret fields for display.
pub fn masked(spec: &Value) -> Value {
    let mut v = spec.clone();
    if let Some(o) = v.as_object_mut() {
        for k in ["password", "aws_secret_access_key", "secret_access_key"] {
            if o.contains_key(k) {
                o.insert(k.into(), Value::from("***"));
            }
        }
        if let Some(inner) = o.get("inner").map(masked) {
            o.insert("inner".into(), inner);
        }
    }
    v
}

struct Fields<'a> {
    obj: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn check_known(&self, extra: &[&str]) -> Result<(), ConfigError> {
        for k in self.obj.keys() {
            if !COMMON.contains(&k.as_str()) && !extra.contains(&k.as_str()) {
                let mut all: Vec<&str> = extra.to_vec();
                all.sort_unstable();
                return Err(ConfigError::field(
                    k,
                    format!("unknown field (known: {})", all.join(", ")),
                ));
            }
        }
        Ok(())
    }
    fn str_opt(&self, k: &str) -> Result<Option<String>, ConfigError> {
        match self.obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ConfigError::field(k, "must be a string")),
        }
    }
    fn str_req(&self, k: &str) -> Result<String, ConfigError> {
        self.str_opt(k)?.filter(|s| !s.is_empty()).ok_or_else(|| ConfigError::field(k, "missing"))
    }
    fn bool_or(&self, k: &str, d: bool) -> Result<bool, ConfigError> {
        match self.obj.get(k) {
            None | Some(Value::Null) => Ok(d),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ConfigError::field(k, "must be true or false")),
        }
    }
    fn f64_opt(&self, k: &str) -> Result<Option<f64>, ConfigError> {
        match self.obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .map(Some)
                .ok_or_else(|| ConfigError::field(k, "must be a non-negative number")),
        }
    }
    fn u64_opt(&self, k: &str) -> Result<Option<u64>, ConfigError> {
        match self.obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| ConfigError::field(k, "must be a non-negative integer")),
        }
    }
    fn u64_or(&self, k: &str, d: u64) -> Result<u64, ConfigError> {
        Ok(self.u64_opt(k)?.unwrap_or(d))
    }
}

fn gib(x: f64) -> u64 {
    (x * (1u64 << 30) as f64) as u64
}

/// Builds adapter number `index` from its spec, connecting to its backend.
pub async fn build(index: usize, spec: &Value) -> Result<BuiltAdapter, ConfigError> {
    let kind = spec.get("type").and_then(Value::as_str).unwrap_or("?").to_owned();
    build_inner(spec).await.map_err(|mut e| {
        e.index = index;
        e.kind = kind;
        e
    })
}

fn build_inner(
    spec: &Value,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<BuiltAdapter, ConfigError>> + Send + '_>,
> {
    Box::pin(async move {
        let obj = spec
            .as_object()
            .ok_or_else(|| ConfigError::field("l2-adapter", "must be a JSON object"))?;
        let f = Fields { obj };
        let kind = f.str_opt("type")?.ok_or_else(|| {
            ConfigError::field("type", format!("missing (one of {})", ADAPTER_TYPES.join(", ")))
        })?;
        let codec = Arc::new(Codec::from_spec(obj.get("serde"))?);
        let max_capacity = match f.f64_opt("max_capacity_gb")? {
            Some(x) if x > 0.0 => Some(gib(x)),
            Some(_) => return Err(ConfigError::field("max_capacity_gb", "must be > 0")),
            None => None,
        };
        let eviction = eviction_spec(obj.get("eviction"))?;
        let adapter: Arc<dyn L2Adapter> = match kind.as_str() {
            "fs" | "fs_native" => {
                f.check_known(&[
                    "base_path",
                    "relative_tmp_dir",
                    "use_odirect",
                    "fsync",
                    "read_ahead_size",
                    "num_workers",
                ])?;
                let base = PathBuf::from(f.str_req("base_path")?);
                let tmp =
                    f.str_opt("relative_tmp_dir")?.filter(|s| !s.is_empty()).map(PathBuf::from);
                if let Some(t) = &tmp
                    && (t.is_absolute() || t.components().any(|c| c.as_os_str() == ".."))
                {
                    return Err(ConfigError::field(
                        "relative_tmp_dir",
                        "must be relative, without ..",
                    ));
                }
                let fsync = match f.str_opt("fsync")?.as_deref() {
                    None | Some("none") | Some("never") => FsyncMode::Never,
                    Some("file") => FsyncMode::File,
                    Some("file_and_dir") | Some("always") => FsyncMode::FileAndDir,
                    Some(o) => {
                        return Err(ConfigError::field(
                            "fsync",
                            format!("{o:?}: none|file|file_and_dir"),
                        ));
                    }
                };
                let a = FsAdapter::open(FsConfig {
                    base_path: base.clone(),
                    relative_tmp_dir: tmp,
                    use_odirect: f.bool_or("use_odirect", false)?,
                    fsync,
                })
                .map_err(|e| ConfigError::field("base_path", format!("{}: {e}", base.display())))?;
                Arc::new(a)
            }
            "raw_block" => {
                f.check_known(&[
                    "device_path",
                    "slot_bytes",
                    "capacity_bytes",
                    "use_odirect",
                    "block_align",
                    "meta_total_bytes",
                    "sync_journal",
                    "format",
                    "header_bytes",
                    "meta_checkpoint_interval_sec",
                    "load_checkpoint_on_init",
                    "meta_verify_on_load",
                ])?;
                if !f.bool_or("persist_enabled", true)? {
                    return Err(ConfigError::field("persist_enabled", "raw_block always persists"));
                }
                let path = PathBuf::from(f.str_req("device_path")?);
                let slot = f
                    .u64_opt("slot_bytes")?
                    .ok_or_else(|| ConfigError::field("slot_bytes", "missing"))?;
                let a = RawBlockAdapter::open(RawBlockConfig {
                    device_path: path.clone(),
                    slot_bytes: slot,
                    capacity_bytes: f.u64_or("capacity_bytes", 0)?,
                    use_odirect: f.bool_or("use_odirect", true)?,
                    block_align: f.u64_or("block_align", 4096)?,
                    meta_total_bytes: f.u64_or("meta_total_bytes", 16 << 20)?,
                    sync_journal: f.bool_or("sync_journal", false)?,
                    format: f.bool_or("format", false)?,
                })
                .map_err(|e| {
                    ConfigError::field("device_path", format!("{}: {e}", path.display()))
                })?;
                Arc::new(a)
            }
            "gds_slab" => {
                f.check_known(&[
                    "path",
                    "capacity_bytes",
                    "use_odirect",
                    "warm_restart",
                    "slot_bytes",
                ])?;
                let dir = PathBuf::from(f.str_req("path")?);
                let capacity = f
                    .u64_opt("capacity_bytes")?
                    .filter(|c| *c > 0)
                    .ok_or_else(|| ConfigError::field("capacity_bytes", "missing or 0"))?;
                let a =
                    crate::adapters::slab::SlabAdapter::open(crate::adapters::slab::SlabConfig {
                        dir: dir.clone(),
                        capacity_bytes: capacity,
                        use_odirect: f.bool_or("use_odirect", true)?,
                        keep: f.bool_or("warm_restart", false)?,
                        slot_bytes: f.u64_opt("slot_bytes")?.filter(|b| *b > 0),
                    })
                    .map_err(|e| ConfigError::field("path", format!("{}: {e}", dir.display())))?;
                Arc::new(a)
            }
            "redis" | "resp" | "valkey" => {
                f.check_known(&[
                    "host",
                    "port",
                    "startup_nodes",
                    "cluster_mode",
                    "username",
                    "password",
                    "tls_enable",
                    "database_id",
                    "key_prefix",
                    "num_workers",
                    "pipeline_depth",
                    "ttl_seconds",
                    "request_timeout",
                    "connection_timeout",
                ])?;
                let env = |k: &str| std::env::var(k).ok().filter(|s| !s.is_empty());
                let nodes: Vec<String> = match (f.str_opt("startup_nodes")?, f.str_opt("host")?) {
                    (Some(n), _) => n
                        .split(',')
                        .map(|s| s.trim().to_owned())
                        .filter(|s| !s.is_empty())
                        .collect(),
                    (None, h) => {
                        let host = h.or_else(|| env("LMCACHE_RESP_HOST")).ok_or_else(|| {
                            ConfigError::field("host", "missing (or give startup_nodes)")
                        })?;
                        let port = match f.u64_opt("port")? {
                            Some(p) => p,
                            None => env("LMCACHE_RESP_PORT")
                                .and_then(|p| p.parse().ok())
                                .ok_or_else(|| ConfigError::field("port", "missing"))?,
                        };
                        vec![format!("{host}:{port}")]
                    }
                };
                if nodes.is_empty() || nodes.iter().any(|n| !n.contains(':')) {
                    return Err(ConfigError::field(
                        "startup_nodes",
                        "expected host:port[,host:port...]",
                    ));
                }
                let secs = |k: &str, d: f64| -> Result<Duration, ConfigError> {
                    Ok(Duration::from_secs_f64(f.f64_opt(k)?.unwrap_or(d).max(0.001)))
                };
                let cfg = RedisConfig {
                    nodes,
                    cluster_mode: f.bool_or("cluster_mode", false)?,
                    username: f.str_opt("username")?.or_else(|| env("LMCACHE_RESP_USERNAME")),
                    password: f.str_opt("password")?.or_else(|| env("LMCACHE_RESP_PASSWORD")),
                    tls: f.bool_or("tls_enable", false)?,
                    database: f.u64_or("database_id", 0)? as i64,
                    key_prefix: f.str_opt("key_prefix")?.unwrap_or_default(),
                    num_workers: f.u64_or("num_workers", 4)?.clamp(1, 64) as usize,
                    pipeline_depth: f.u64_opt("pipeline_depth")?.map(|d| d.clamp(1, 1024) as usize),
                    ttl_seconds: f.u64_opt("ttl_seconds")?.filter(|&t| t > 0),
                    request_timeout: secs("request_timeout", 5.0)?,
                    connection_timeout: secs("connection_timeout", 5.0)?,
                };
                let first = cfg.nodes[0].clone();
                let a = RedisAdapter::connect(cfg).await.map_err(|e| {
                    ConfigError::field("host", format!("cannot reach {first}: {e}"))
                })?;
                Arc::new(a)
            }
            "s3" => {
                f.check_known(&[
                    "s3_endpoint",
                    "endpoint_url",
                    "bucket",
                    "s3_region",
                    "aws_access_key_id",
                    "aws_secret_access_key",
                    "disable_tls",
                    "s3_prefix",
                    "multipart_threshold_bytes",
                    "part_size_bytes",
                    "max_retries",
                    "request_timeout",
                    "connection_timeout",
                    "s3_num_io_threads",
                    "s3_prefer_http2",
                    "s3_enable_s3express",
                ])?;
                let region = f.str_opt("s3_region")?.unwrap_or_else(|| "us-east-1".into());
                let disable_tls = f.bool_or("disable_tls", false)?;
                // Either LMCache's virtual-hosted "bucket.host" or an endpoint URL plus bucket.
                let (endpoint, bucket, virtual_hosted) =
                    match (f.str_opt("endpoint_url")?, f.str_opt("s3_endpoint")?) {
                        (Some(url), _) => (Some(url), f.str_req("bucket")?, false),
                        (None, Some(ep)) => {
                            let ep = ep.trim_start_matches("s3://").to_owned();
                            let (b, host) = ep.split_once('.').ok_or_else(|| {
                                ConfigError::field("s3_endpoint", "expected <bucket>.<host>")
                            })?;
                            let scheme = if disable_tls { "http" } else { "https" };
                            (Some(format!("{scheme}://{b}.{host}")), b.to_owned(), true)
                        }
                        (None, None) => (None, f.str_req("bucket")?, false),
                    };
                let allow_http =
                    disable_tls || endpoint.as_deref().is_some_and(|e| e.starts_with("http://"));
                let secs = |k: &str, d: f64| -> Result<Duration, ConfigError> {
                    Ok(Duration::from_secs_f64(f.f64_opt(k)?.unwrap_or(d).max(0.001)))
                };
                let cfg = S3Config {
                    endpoint,
                    bucket: bucket.clone(),
                    region,
                    access_key_id: f.str_opt("aws_access_key_id")?,
                    secret_access_key: f.str_opt("aws_secret_access_key")?,
                    virtual_hosted,
                    allow_http,
                    prefix: f.str_opt("s3_prefix")?.unwrap_or_default(),
                    multipart_threshold: f.u64_or("multipart_threshold_bytes", 16 << 20)? as usize,
                    part_size: f.u64_or("part_size_bytes", 8 << 20)?.max(5 << 20) as usize,
                    max_retries: f.u64_or("max_retries", 2)? as usize,
                    request_timeout: secs("request_timeout", 10.0)?,
                    connect_timeout: secs("connection_timeout", 5.0)?,
                };
                let a = S3Adapter::connect(cfg).await.map_err(|e| {
                    ConfigError::field("bucket", format!("cannot reach bucket {bucket}: {e}"))
                })?;
                Arc::new(a)
            }
            "dax" => {
                f.check_known(&[
                    "device_path",
                    "max_dax_size_gb",
                    "slot_bytes",
                    "format",
                    "devices",
                    "hotplug_enabled",
                ])?;
                if obj.get("devices").is_some() || f.bool_or("hotplug_enabled", false)? {
                    return Err(ConfigError::field(
                        "devices",
                        "one device per dax adapter in lmcache-rs (no hot-plug): give each \
                         device its own --l2-adapter",
                    ));
                }
                let size = f
                    .f64_opt("max_dax_size_gb")?
                    .filter(|&x| x > 0.0)
                    .ok_or_else(|| ConfigError::field("max_dax_size_gb", "missing or not > 0"))?;
                let slot_bytes = f
                    .u64_opt("slot_bytes")?
                    .ok_or_else(|| ConfigError::field("slot_bytes", "missing"))?;
                let cfg = crate::adapters::dax::DaxConfig {
                    device_path: PathBuf::from(f.str_req("device_path")?),
                    size: gib(size),
                    slot_bytes,
                    format: f.bool_or("format", false)?,
                };
                let a = crate::adapters::dax::DaxAdapter::open(cfg)
                    .map_err(|e| ConfigError::field("device_path", e.to_string()))?;
                Arc::new(a)
            }
            "native_plugin" => {
                f.check_known(&["path", "config", "timeout_secs"])?;
                let path = PathBuf::from(f.str_req("path")?);
                if !path.is_absolute() {
                    return Err(ConfigError::field("path", "must be an absolute path"));
                }
                let config = match obj.get("config") {
                    None | Some(Value::Null) => "{}".to_owned(),
                    Some(v @ Value::Object(_)) => v.to_string(),
                    Some(_) => return Err(ConfigError::field("config", "must be a JSON object")),
                };
                let timeout = f.f64_opt("timeout_secs")?.unwrap_or(10.0);
                if !(timeout.is_finite() && timeout > 0.0) {
                    return Err(ConfigError::field("timeout_secs", "must be > 0"));
                }
                let a = crate::adapters::native_plugin::NativePluginAdapter::load(
                    &path,
                    &config,
                    Duration::from_secs_f64(timeout),
                )
                .map_err(|e| ConfigError::field("path", e.to_string()))?;
                Arc::new(a)
            }
            "mock" => {
                f.check_known(&["max_size_gb", "mock_bandwidth_gb", "latency_ms"])?;
                let size = f
                    .f64_opt("max_size_gb")?
                    .filter(|&x| x > 0.0)
                    .ok_or_else(|| ConfigError::field("max_size_gb", "missing or not > 0"))?;
                let bw = f.f64_opt("mock_bandwidth_gb")?.unwrap_or(0.0);
                Arc::new(MockAdapter::new(MockConfig {
                    capacity: gib(size),
                    bandwidth: bw * 1e9,
                    latency: Duration::from_secs_f64(f.f64_opt("latency_ms")?.unwrap_or(0.0) / 1e3),
                }))
            }
            "fault_inject" => {
                f.check_known(&["inner", "rate", "seed", "ops", "mode", "delay_ms"])?;
                let inner_spec =
                    obj.get("inner").ok_or_else(|| ConfigError::field("inner", "missing"))?;
                let inner = build_inner(inner_spec).await.map_err(|mut e| {
                    e.field = format!("inner.{}", e.field);
                    e
                })?;
                let rate = f.f64_opt("rate")?.unwrap_or(0.0);
                if rate > 1.0 {
                    return Err(ConfigError::field("rate", "must be within 0..=1"));
                }
                let ops = match obj.get("ops") {
                    None => vec![FaultOp::Load],
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|o| match o.as_str() {
                            Some("store") => Ok(FaultOp::Store),
                            Some("lookup") => Ok(FaultOp::Lookup),
                            Some("load") => Ok(FaultOp::Load),
                            Some("delete") => Ok(FaultOp::Delete),
                            _ => Err(ConfigError::field(
                                "ops",
                                format!("{o}: store|lookup|load|delete"),
                            )),
                        })
                        .collect::<Result<_, _>>()?,
                    Some(_) => return Err(ConfigError::field("ops", "must be a list")),
                };
                let mode = match f.str_opt("mode")?.as_deref().unwrap_or("fail") {
                    "fail" => FaultMode::Fail,
                    "corrupt" => FaultMode::Corrupt,
                    "truncate" => FaultMode::Truncate,
                    "miss" => FaultMode::Miss,
                    "delay" => FaultMode::Delay(Duration::from_millis(f.u64_or("delay_ms", 100)?)),
                    o => {
                        return Err(ConfigError::field(
                            "mode",
                            format!("{o:?}: fail|corrupt|truncate|miss|delay"),
                        ));
                    }
                };
                // The codec of the wrapped spec applies.
                return Ok(BuiltAdapter {
                    adapter: Arc::new(FaultInjectAdapter::new(
                        inner.adapter,
                        FaultConfig { rate, seed: f.u64_or("seed", 0)?, ops, mode },
                    )),
                    codec: if obj.contains_key("serde") { codec } else { inner.codec },
                    kind,
                    spec: masked(spec),
                    capacity: max_capacity.or(inner.capacity),
                    eviction: eviction.or(inner.eviction),
                });
            }
            other => {
                return Err(ConfigError::field(
                    "type",
                    format!("unknown adapter type {other:?} (one of {})", ADAPTER_TYPES.join(", ")),
                ));
            }
        };
        let capacity = max_capacity.or_else(|| adapter.capacity());
        Ok(BuiltAdapter { adapter, codec, kind, spec: masked(spec), capacity, eviction })
    })
}

/// With `roots` set (`--l2-allowed-root`), refuses an adapter spec whose `fs` `base_path` or
/// `raw_block` `device_path` (nested specs included) is not inside one of them, before
/// anything is opened. A path must be absolute and free of `..`; symlinks in its existing part
/// are resolved, so a link cannot lead out of a root. The error names the path asked for,
/// never an OS error about it.
pub fn check_allowed_paths(
    index: usize,
    spec: &Value,
    roots: &[PathBuf],
) -> Result<(), ConfigError> {
    if roots.is_empty() {
        return Ok(());
    }
    let kind = spec.get("type").and_then(Value::as_str).unwrap_or("?").to_owned();
    check_paths_in(spec, roots).map_err(|mut e| {
        e.index = index;
        e.kind = kind;
        e
    })
}

fn check_paths_in(spec: &Value, roots: &[PathBuf]) -> Result<(), ConfigError> {
    let Some(obj) = spec.as_object() else { return Ok(()) };
    let field = match obj.get("type").and_then(Value::as_str) {
        Some("fs" | "fs_native") => Some("base_path"),
        Some("raw_block" | "dax") => Some("device_path"),
        Some("gds_slab") => Some("path"),
        _ => None,
    };
    if let Some(field) = field
        && let Some(raw) = obj.get(field).and_then(Value::as_str)
    {
        let outside = || {
            ConfigError::field(
                field,
                format!("{raw} is outside the allowed roots (--l2-allowed-root)"),
            )
        };
        let p = std::path::Path::new(raw);
        if !p.is_absolute() || p.components().any(|c| c == std::path::Component::ParentDir) {
            return Err(ConfigError::field(
                field,
                format!(
                    "{raw} must be an absolute path without `..` when --l2-allowed-root is set"
                ),
            ));
        }
        let resolved = resolve_existing(p).ok_or_else(outside)?;
        let inside = roots
            .iter()
            .filter_map(|r| std::fs::canonicalize(r).ok())
            .any(|r| resolved.starts_with(&r));
        if !inside {
            return Err(outside());
        }
    }
    // Nested specs (fault_inject wraps another adapter).
    for v in obj.values() {
        if v.is_object() {
            check_paths_in(v, roots)?;
        }
    }
    Ok(())
}

/// `p` with its longest existing prefix canonicalized (symlinks resolved) and the rest
/// appended as written.
fn resolve_existing(p: &std::path::Path) -> Option<PathBuf> {
    let mut existing = p.to_path_buf();
    let mut rest = Vec::new();
    loop {
        if let Ok(c) = std::fs::canonicalize(&existing) {
            return Some(rest.iter().rev().fold(c, |acc: PathBuf, part| acc.join(part)));
        }
        rest.push(existing.file_name()?.to_owned());
        if !existing.pop() {
            return None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_file_lists_adapters_in_order_and_refuses_unknown_tables() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("l2.toml");
        std::fs::write(
            &p,
            "[[l2_adapter]]\ntype = \"fs\"\nbase_path = \"/tmp/a\"\n\n\
             [[l2_adapter]]\ntype = \"redis\"\nhost = \"h\"\nport = 6379\npassword = \"pw\"\n",
        )
        .unwrap();
        let specs = parse_toml_file(&p).unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0]["type"], "fs");
        assert_eq!(specs[1]["port"], 6379);
        assert_eq!(masked(&specs[1])["password"], "***");
        std::fs::write(&p, "[server]\nport = 1\n").unwrap();
        assert_eq!(parse_toml_file(&p).unwrap_err().field, "l2-config.server");
        std::fs::write(&p, "not toml [").unwrap();
        assert_eq!(parse_toml_file(&p).unwrap_err().field, "l2-config");
        assert_eq!(parse_json("[1]").unwrap_err().field, "l2-adapter");
    }

    #[test]
    fn allowed_roots_confine_fs_and_raw_block_paths() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let roots = vec![root.path().to_path_buf()];
        let fs = |p: &std::path::Path| serde_json::json!({"type": "fs", "base_path": p});
        assert!(check_allowed_paths(0, &fs(&root.path().join("kv/new")), &roots).is_ok());
        assert!(check_allowed_paths(0, &fs(outside.path()), &[]).is_ok(), "no roots: no limit");
        let e = check_allowed_paths(2, &fs(outside.path()), &roots).unwrap_err();
        assert_eq!((e.index, e.field.as_str()), (2, "base_path"), "{e}");
        assert!(e.to_string().contains("outside the allowed roots"), "{e}");
        let dotdot = root.path().join("..").join(outside.path().file_name().unwrap());
        assert!(check_allowed_paths(0, &fs(&dotdot), &roots).is_err(), "`..` escapes");
        assert!(
            check_allowed_paths(0, &serde_json::json!({"type": "fs", "base_path": "rel"}), &roots)
                .is_err()
        );
        // A symlink inside the root that leads out of it.
        std::os::unix::fs::symlink(outside.path(), root.path().join("link")).unwrap();
        assert!(check_allowed_paths(0, &fs(&root.path().join("link/x")), &roots).is_err());
        // raw_block, and a spec nested in fault_inject.
        let rb =
            serde_json::json!({"type": "raw_block", "device_path": "/dev/sda", "slot_bytes": 4096});
        assert_eq!(check_allowed_paths(0, &rb, &roots).unwrap_err().field, "device_path");
        let nested = serde_json::json!({"type": "fault_inject", "inner": fs(outside.path())});
        assert!(check_allowed_paths(0, &nested, &roots).is_err());
        // dax: its device path too (an HTTP caller cannot point it at a device of its choice).
        let dax = serde_json::json!({"type": "dax", "device_path": "/dev/dax0.0",
                                     "max_dax_size_gb": 1, "slot_bytes": 4096});
        assert_eq!(check_allowed_paths(0, &dax, &roots).unwrap_err().field, "device_path");
        // gds_slab: the directory its slab goes in.
        let slab = serde_json::json!({"type": "gds_slab", "path": outside.path(),
                                      "capacity_bytes": 1 << 30});
        assert_eq!(check_allowed_paths(0, &slab, &roots).unwrap_err().field, "path");
    }

    #[test]
    fn native_code_is_found_nested() {
        let plugin = serde_json::json!({"type": "native_plugin", "path": "/x.so"});
        assert!(loads_native_code(&plugin));
        let nested = serde_json::json!({"type": "fault_inject", "inner": plugin});
        assert!(loads_native_code(&nested));
        assert!(!loads_native_code(&serde_json::json!({"type": "fs", "base_path": "/x"})));
    }
}
