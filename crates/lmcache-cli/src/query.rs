//! `lmcache-rs query coordinator --api NAME`: LMCache's read-only coordinator queries
//! (usage, instances, health, directory, keys, quota, quota-config, prefetch, metrics),
//! against our coordinator or LMCache's, as a table or `--format json`.

use anyhow::bail;
use clap::{Args, Subcommand, ValueEnum};
use serde_json::Value;

use crate::ops::{Common, Format, base, call, emit, segment};

#[derive(Debug, Subcommand)]
pub enum QueryCommand {
    /// Query a fleet coordinator's read-only HTTP APIs.
    Coordinator(CoordinatorQuery),
}

/// Which coordinator API to read.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Api {
    /// Per-instance memory usage against declared capacity.
    Usage,
    /// Registered cache servers.
    Instances,
    /// Coordinator liveness.
    Health,
    /// Key-directory size, streams and blend-index stats.
    Directory,
    /// A page of directory keys and their placements.
    Keys,
    /// Per-salt usage against quota.
    Quota,
    /// Default quota for salts with no explicit entry.
    QuotaConfig,
    /// Status of one prefetch request (needs --instance and --request-id).
    Prefetch,
    /// Prometheus metrics, verbatim.
    Metrics,
}

#[derive(Debug, Args)]
pub struct CoordinatorQuery {
    /// Which API to read.
    #[arg(long, value_enum)]
    pub api: Api,
    /// Coordinator base URL.
    #[arg(long, default_value = "http://127.0.0.1:9300")]
    pub url: String,
    /// Instance id: narrows --api usage to one server; needed by --api prefetch.
    #[arg(long)]
    pub instance: Option<String>,
    /// Cache salt: narrows --api quota to one tenant (an empty string is the un-salted one).
    #[arg(long)]
    pub cache_salt: Option<String>,
    /// Prefetch request id (--api prefetch).
    #[arg(long)]
    pub request_id: Option<String>,
    /// Rows to request for --api keys.
    #[arg(long, default_value_t = 20)]
    pub limit: u32,
    /// Output format.
    #[arg(long, value_enum, default_value = "terminal")]
    pub format: Format,
    /// Also write the result (JSON) to this file.
    #[arg(long)]
    pub output: Option<std::path::PathBuf>,
    /// Print nothing; the exit code says whether it worked.
    #[arg(short, long)]
    pub quiet: bool,
}

fn bytes(v: &Value) -> String {
    let b = v.as_f64().unwrap_or(0.0);
    if b <= 0.0 {
        return "--".into();
    }
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    format!("{x:.1} {}", units[u])
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "--".into(),
        other => other.to_string(),
    }
}

/// Runs one query.
pub fn run(cmd: &QueryCommand) -> anyhow::Result<()> {
    let QueryCommand::Coordinator(q) = cmd;
    let common = Common {
        url: q.url.clone(),
        format: q.format,
        output: q.output.clone(),
        quiet: q.quiet,
        token: None,
    };
    let root = base(&q.url);
    let path = match q.api {
        Api::Usage => match &q.instance {
            Some(i) => format!("/instances/{}/usage", segment(i)),
            None => "/instances/usage".into(),
        },
        Api::Instances => "/instances".into(),
        Api::Health => "/healthz".into(),
        Api::Directory => "/directory/stats".into(),
        Api::Keys => format!("/directory/keys?limit={}", q.limit),
        Api::Quota => match &q.cache_salt {
            Some(salt) if salt.is_empty() => "/quota/_default".into(),
            Some(salt) => format!("/quota/{}", segment(salt)),
            None => "/quota".into(),
        },
        Api::QuotaConfig => "/quota/config".into(),
        Api::Prefetch => match (&q.instance, &q.request_id) {
            (Some(i), Some(r)) => format!("/cache/prefetches/{}/{}", segment(i), segment(r)),
            _ => bail!("--api prefetch requires --instance and --request-id"),
        },
        Api::Metrics => "/metrics".into(),
    };
    let url = format!("{root}{path}");
    let doc = call(&common, "GET", &url, None)?;
    if let Api::Metrics = q.api {
        if !q.quiet {
            print!("{}", doc.as_str().unwrap_or_default());
        }
        return Ok(());
    }
    let mut rows: Vec<(String, String)> = Vec::new();
    match q.api {
        Api::Usage => {
            let instances = doc
                .get("instances")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_else(|| vec![doc.clone()]);
            for i in &instances {
                for m in i["modules"].as_array().into_iter().flatten() {
                    rows.push(usage_row(&s(&i["instance_id"]), m));
                }
            }
            for m in doc["shared_modules"].as_array().into_iter().flatten() {
                rows.push(usage_row("(fleet-shared)", m));
            }
        }
        Api::Instances => {
            for i in doc["instances"].as_array().into_iter().flatten() {
                rows.push((
                    s(&i["instance_id"]),
                    format!("{}:{}", s(&i["ip"]), s(&i["http_port"])),
                ));
            }
        }
        Api::Health => rows.push(("Status".into(), s(&doc["status"]))),
        Api::Directory => {
            rows.push(("Keys".into(), s(&doc["num_keys"])));
            rows.push(("Placements".into(), s(&doc["num_placements"])));
            rows.push((
                "L1 placements".into(),
                format!("{} ({})", s(&doc["l1_count"]), bytes(&doc["l1_size_bytes"])),
            ));
            rows.push((
                "L2 placements".into(),
                format!("{} ({})", s(&doc["l2_count"]), bytes(&doc["l2_size_bytes"])),
            ));
            for st in doc["streams"].as_array().into_iter().flatten() {
                let gap =
                    if st["gap_detected"].as_bool() == Some(true) { ", gap open" } else { "" };
                rows.push((
                    format!("Stream {}", s(&st["instance_id"])),
                    format!("seq {}, {} repairs{gap}", s(&st["last_seq"]), s(&st["repairs"])),
                ));
            }
        }
        Api::Keys => {
            rows.push(("Matching keys".into(), s(&doc["total"])));
            for k in doc["keys"].as_array().into_iter().flatten() {
                let key = &k["key"];
                let places: Vec<String> = k["placements"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|p| {
                        format!("{}:{}/{}", s(&p["instance_id"]), s(&p["tier"]), s(&p["backend"]))
                    })
                    .collect();
                let hash = s(&key["chunk_hash_hex"]);
                rows.push((
                    format!(
                        "{} {} rank {:#x}",
                        &hash[..hash.len().min(12)],
                        s(&key["model_name"]),
                        key["kv_rank"].as_u64().unwrap_or(0)
                    ),
                    places.join(", "),
                ));
            }
        }
        Api::Quota => {
            if let Some(list) = doc["by_cache_salt"].as_array() {
                rows.push(("Total usage (GiB)".into(), s(&doc["total_gb"])));
                for r in list {
                    rows.push((
                        s(&r["cache_salt"]),
                        format!("{} of {} GiB", s(&r["usage_gb"]), s(&r["quota_limit_gb"])),
                    ));
                }
            } else {
                for k in ["cache_salt", "quota_limit_gb", "quota_exists", "usage_gb"] {
                    rows.push((k.into(), s(&doc[k])));
                }
            }
        }
        Api::QuotaConfig => rows.push(("Default limit (GiB)".into(), s(&doc["default_limit_gb"]))),
        Api::Prefetch => {
            for (k, v) in doc.as_object().into_iter().flatten() {
                rows.push((k.clone(), s(v)));
            }
        }
        Api::Metrics => {}
    }
    emit(&common, &format!("Coordinator: {:?}", q.api).to_lowercase(), &rows, &doc)
}

fn usage_row(instance: &str, m: &Value) -> (String, String) {
    let ratio = m["usage_ratio"]
        .as_f64()
        .map_or_else(|| "unknown".to_string(), |r| format!("{:.1}%", r * 100.0));
    (
        format!("{instance} {}/{}", s(&m["tier"]), s(&m["backend"])),
        format!("{} of {} ({ratio})", bytes(&m["used_bytes"]), bytes(&m["capacity_bytes"])),
    )
}
