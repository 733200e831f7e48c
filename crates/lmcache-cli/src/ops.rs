//! Operator commands, as LMCache's CLI names them: `ping kvcache`, `describe kvcache`,
//! `kvcache clear`, `quota set|get|list|delete`, and ours: `explain REQUEST_ID`. Each talks to a server's HTTP API (ours or
//! LMCache's), prints a human table or `--format json`, can write the result to `--output`,
//! and exits non-zero when the server cannot be reached or refuses.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};
use serde_json::{Value, json};

/// Output format.
#[derive(Debug, Clone, Copy, ValueEnum, Default)]
pub enum Format {
    /// A human table.
    #[default]
    Terminal,
    /// One JSON document.
    Json,
}

/// Flags every operator command takes.
#[derive(Debug, Clone, Args)]
pub struct Common {
    /// HTTP API of the cache server.
    #[arg(long, default_value = "http://localhost:8080")]
    pub url: String,
    /// Output format.
    #[arg(long, value_enum, default_value = "terminal")]
    pub format: Format,
    /// Also write the JSON result to this file.
    #[arg(long)]
    pub output: Option<std::path::PathBuf>,
    /// Print nothing; the exit code tells the result.
    #[arg(short, long)]
    pub quiet: bool,
    /// Bearer token of a server started with --http-auth-token.
    #[arg(long, env = "LMCACHE_RS_HTTP_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// What `ping` and `describe` talk to.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Target {
    /// The KV cache server.
    Kvcache,
}

/// `kvcache` subcommands.
#[derive(Debug, Subcommand)]
pub enum KvcacheCommand {
    /// Drop every unlocked object from L1 (`--force` drops locked ones too once released).
    Clear {
        /// Also unindex objects that are locked.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        common: Common,
    },
}

/// Which tier a quota applies to.
#[derive(Debug, Clone, clap::Args)]
pub struct QuotaTier {
    /// The tier: l1 (CPU memory) or l2 (every L2 adapter).
    #[arg(long, default_value = "l1", value_parser = ["l1", "l2"])]
    pub tier: String,
}

/// `quota` subcommands (`_default` names the empty cache_salt).
#[derive(Debug, Subcommand)]
pub enum QuotaCommand {
    /// Set a tenant's limit.
    Set {
        /// The cache_salt.
        salt: String,
        /// Limit in GiB.
        #[arg(long)]
        limit_gb: f64,
        #[command(flatten)]
        tier: QuotaTier,
        #[command(flatten)]
        common: Common,
    },
    /// Show a tenant's limit and usage.
    Get {
        /// The cache_salt.
        salt: String,
        #[command(flatten)]
        tier: QuotaTier,
        #[command(flatten)]
        common: Common,
    },
    /// List every tenant with a limit.
    List {
        #[command(flatten)]
        tier: QuotaTier,
        #[command(flatten)]
        common: Common,
    },
    /// Remove a tenant's limit.
    Delete {
        /// The cache_salt.
        salt: String,
        #[command(flatten)]
        tier: QuotaTier,
        #[command(flatten)]
        common: Common,
    },
}

pub(crate) fn base(url: &str) -> String {
    let url = if url.starts_with("http://") || url.starts_with("https://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    };
    url.trim_end_matches('/').to_owned()
}

/// Percent-encodes one path segment (RFC 3986 unreserved characters pass through).
pub(crate) fn segment(raw: &str) -> String {
    raw.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn quota_url(common: &Common, salt: &str, tier: &QuotaTier) -> String {
    format!("{}/quota/{}?tier={}", base(&common.url), segment(salt), tier.tier)
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .http_status_as_error(false)
        .build()
        .into()
}

/// Sends a request; returns the JSON body of a 2xx reply, or the server's error message.
pub(crate) fn call(
    common: &Common,
    method: &str,
    url: &str,
    body: Option<Value>,
) -> anyhow::Result<Value> {
    let a = agent();
    let auth = common.token.as_ref().map(|t| format!("Bearer {t}"));
    let auth = auth.as_deref().unwrap_or("");
    let resp = match (method, body) {
        ("GET", _) => a.get(url).header("Authorization", auth).call(),
        ("DELETE", _) => a.delete(url).header("Authorization", auth).call(),
        ("PUT", Some(b)) => a.put(url).header("Authorization", auth).send_json(b),
        ("POST", Some(b)) => a.post(url).header("Authorization", auth).send_json(b),
        (m, _) => bail!("unsupported method {m}"),
    }
    .with_context(|| format!("cannot reach {url}"))?;
    let status = resp.status();
    let mut resp = resp;
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    if !status.is_success() {
        let msg = ["detail", "error", "message"]
            .iter()
            .find_map(|k| v.get(k).map(|m| m.to_string()))
            .unwrap_or_else(|| v.to_string());
        bail!("HTTP {} from {url}: {msg}", status.as_u16());
    }
    Ok(v)
}

/// Prints `rows` as a two-column table under `title`, or `doc` as JSON.
pub(crate) fn emit(
    common: &Common,
    title: &str,
    rows: &[(String, String)],
    doc: &Value,
) -> anyhow::Result<()> {
    if let Some(path) = &common.output {
        std::fs::write(path, serde_json::to_string_pretty(doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if common.quiet {
        return Ok(());
    }
    match common.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(doc)?),
        Format::Terminal => {
            let width = rows
                .iter()
                .map(|(k, v)| k.len() + v.len() + 4)
                .max()
                .unwrap_or(20)
                .max(title.len() + 4);
            println!("{:=^width$}", format!(" {title} "));
            for (k, v) in rows {
                println!("{k}:{v:>pad$}", pad = width - k.len() - 1);
            }
            println!("{}", "=".repeat(width));
        }
    }
    Ok(())
}

fn gb(v: &Value) -> String {
    v.as_f64().map_or("-".into(), |b| format!("{:.2}", b / (1u64 << 30) as f64))
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// `ping kvcache`.
pub fn ping(_target: Target, common: &Common) -> anyhow::Result<()> {
    let url = format!("{}/healthcheck", base(&common.url));
    let t = Instant::now();
    let result = call(common, "GET", &url, None);
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let ok = result.is_ok();
    let doc = json!({"url": common.url, "status": if ok { "OK" } else { "FAIL" }, "round_trip_ms": ms,
        "error": result.as_ref().err().map(|e| format!("{e:#}"))});
    let mut rows = vec![
        ("Status".to_owned(), s(&doc["status"])),
        ("Round trip time (ms)".to_owned(), format!("{ms:.2}")),
    ];
    if let Err(e) = &result {
        rows.push(("Error".into(), format!("{e:#}")));
    }
    emit(common, "Ping", &rows, &doc)?;
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

/// `describe kvcache`.
pub fn describe(_target: Target, common: &Common) -> anyhow::Result<()> {
    let st = call(common, "GET", &format!("{}/status", base(&common.url)), None)?;
    let l1 = &st["storage_manager"]["l1_manager"];
    let used = l1["memory_used_bytes"].as_f64().unwrap_or(0.0);
    let ratio = l1["memory_usage_ratio"].as_f64().unwrap_or(0.0) * 100.0;
    let mut rows = vec![
        (
            "Health".to_owned(),
            if st["is_healthy"] == json!(true) { "OK".into() } else { "FAIL".into() },
        ),
        ("URL".into(), common.url.clone()),
        ("Engine type".into(), s(&st["engine_type"])),
        ("Chunk size".into(), s(&st["chunk_size"])),
        ("L1 capacity (GB)".into(), gb(&l1["memory_total_bytes"])),
        ("L1 used (GB)".into(), format!("{} ({ratio:.1}%)", gb(&json!(used)))),
        (
            "Eviction policy".into(),
            s(&st["storage_manager"]["eviction_controller"]["eviction_policy"]),
        ),
        ("Cached objects".into(), s(&l1["total_object_count"])),
        ("Active sessions".into(), s(&st["active_sessions"])),
    ];
    // Several L1s (--l1-manager, repeated): each by its tag, in write order.
    if let Some(list) = l1["l1s"].as_array().filter(|l| l.len() > 1) {
        for t in list {
            rows.push((
                format!("L1 {}", s(&t["tag"])),
                format!(
                    "{}, {} / {} GB used, {} objects",
                    s(&t["type"]),
                    gb(&t["used_bytes"]),
                    gb(&t["capacity_bytes"]),
                    s(&t["resident_objects"])
                ),
            ));
        }
    }
    if let Some(list) = st["storage_manager"]["l2_adapters"].as_array() {
        for (n, a) in list.iter().enumerate() {
            let health = if a["is_healthy"] == json!(false) { "DOWN" } else { "healthy" };
            let mut line = format!("{} ({health})", s(&a["type"]));
            if let Some(used) = a["used_bytes"].as_u64() {
                let g = |b: u64| format!("{:.2}", b as f64 / (1u64 << 30) as f64);
                match a["capacity_bytes"].as_u64() {
                    Some(cap) => line.push_str(&format!(", {} / {} GB used", g(used), g(cap))),
                    None => line.push_str(&format!(", {} GB used", g(used))),
                }
            }
            if let Some(k) = a["stored_keys"].as_u64() {
                line.push_str(&format!(", {k} stored, {} loaded", s(&a["loaded_keys"])));
            }
            rows.push((format!("L2 adapter {n}"), line));
        }
    }
    if let Some(list) = st["registered_instances"].as_array() {
        for i in list {
            rows.push((
                format!("Worker {}", s(&i["instance_id"])),
                format!(
                    "{} (world size {}, {})",
                    s(&i["model_name"]),
                    s(&i["world_size"]),
                    s(&i["transfer_mode"])
                ),
            ));
            let layout = &st["cache_context_meta"][s(&i["instance_id"])]["kv_cache_layout"];
            let groups = layout["kernel_groups"].as_array().map_or(&[][..], Vec::as_slice);
            if groups.len() > 1 {
                for g in groups {
                    let window = match g["sw_size_tokens"].as_i64() {
                        Some(w) if w >= 0 => format!(", window {w} tokens"),
                        _ => String::new(),
                    };
                    let recurrent =
                        if g["recurrent_state"] == json!(true) { ", recurrent state" } else { "" };
                    let mla = if g["is_mla"] == json!(true) { " MLA" } else { "" };
                    rows.push((
                        format!("  KV group {}", s(&g["kernel_group_idx"])),
                        format!(
                            "{} layers {}{mla}{window}{recurrent}, object group {}",
                            s(&g["num_layers"]),
                            s(&g["dtype"]),
                            s(&g["object_group_idx"])
                        ),
                    ));
                }
            }
        }
    }
    if let Some(b) = st["blend"].as_object() {
        let on = |k: &str| if b.get(k) == Some(&json!(true)) { "on" } else { "off" };
        rows.push((
            "Blend fingerprints".into(),
            format!(
                "{} chunks, {} distinct contents",
                s(&b["fingerprinted_chunks"]),
                s(&b["fingerprint_contents"])
            ),
        ));
        let ropes: Vec<String> = b["registered_cb_rope_instances"]
            .as_array()
            .map_or_else(Vec::new, |l| l.iter().map(s).collect());
        rows.push((
            "Blend rope workers".into(),
            if ropes.is_empty() { "none".into() } else { ropes.join(", ") },
        ));
        rows.push((
            "Blend options".into(),
            format!(
                "segmented prefix {}, dedup content {}, reorder {} ({} prompts), coordinator leg {}",
                on("segmented_prefix"),
                on("dedup_content"),
                on("reorder"),
                s(&b["reorder_prompts"]),
                on("coordinator_leg")
            ),
        ));
    }
    if let Some(list) = st["refused_instances"].as_array() {
        for i in list {
            rows.push((
                format!("Worker {} REFUSED", s(&i["instance_id"])),
                format!(
                    "{} ({}): {}",
                    s(&i["model_name"]),
                    s(&i["transfer_mode"]),
                    s(&i["reason"])
                ),
            ));
        }
    }
    emit(common, "KV Cache Service", &rows, &st)
}

/// `kvcache clear`.
pub fn kvcache(cmd: &KvcacheCommand) -> anyhow::Result<()> {
    let KvcacheCommand::Clear { force, common } = cmd;
    let r = call(
        common,
        "POST",
        &format!("{}/cache/clear", base(&common.url)),
        Some(json!({"tier": "l1", "force": force})),
    )?;
    emit(common, "Clear", &[("Status".into(), s(&r["status"]))], &r)
}

/// `quota ...`.
pub fn quota(cmd: &QuotaCommand) -> anyhow::Result<()> {
    match cmd {
        QuotaCommand::Set { salt, limit_gb, tier, common } => {
            let url = quota_url(common, salt, tier);
            let r = call(common, "PUT", &url, Some(json!({"limit_gb": limit_gb})))?;
            emit(
                common,
                "Quota",
                &[
                    ("Cache salt".into(), s(&r["cache_salt"])),
                    ("Limit (GB)".into(), s(&r["limit_gb"])),
                    ("Status".into(), s(&r["status"])),
                ],
                &r,
            )
        }
        QuotaCommand::Get { salt, tier, common } => {
            let r = call(common, "GET", &quota_url(common, salt, tier), None)?;
            emit(
                common,
                "Quota",
                &[
                    ("Cache salt".into(), s(&r["cache_salt"])),
                    ("Limit (GB)".into(), s(&r["limit_gb"])),
                    ("Current usage (GB)".into(), s(&r["current_usage_gb"])),
                    ("Exists".into(), s(&r["exists"])),
                ],
                &r,
            )
        }
        QuotaCommand::List { tier, common } => {
            let url = format!("{}/quota?tier={}", base(&common.url), tier.tier);
            let r = call(common, "GET", &url, None)?;
            let rows: Vec<(String, String)> = r["users"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| {
                            (
                                k.clone(),
                                format!(
                                    "{} GB limit, {} GB used",
                                    s(&v["limit_gb"]),
                                    s(&v["current_usage_gb"])
                                ),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            emit(common, "Quotas", &rows, &r)
        }
        QuotaCommand::Delete { salt, tier, common } => {
            let r = call(common, "DELETE", &quota_url(common, salt, tier), None)?;
            emit(
                common,
                "Quota",
                &[("Cache salt".into(), s(&r["cache_salt"])), ("Status".into(), s(&r["status"]))],
                &r,
            )
        }
    }
}

/// `explain REQUEST_ID`: why the request's last lookup missed, chunk by chunk.
pub fn explain(request_id: &str, common: &Common) -> anyhow::Result<()> {
    let url = format!("{}/cache/requests/{}/explain", base(&common.url), segment(request_id));
    let r = call(common, "GET", &url, None)?;
    emit(common, &format!("Lookup of {request_id}"), &explain_rows(&r), &r)
}

/// The rows of `explain`'s table: the lookup, then one row per run of chunks.
fn explain_rows(r: &Value) -> Vec<(String, String)> {
    let mut rows = vec![
        ("Model".to_owned(), s(&r["model"])),
        (
            "Cache salt".to_owned(),
            if r["cache_salt"] == "" { "-".into() } else { s(&r["cache_salt"]) },
        ),
        ("World size".to_owned(), s(&r["world_size"])),
        (
            "Hit".to_owned(),
            format!(
                "{} of {} chunks ({} tokens; {} loaded from L2 or a peer)",
                s(&r["hit_chunks"]),
                s(&r["chunks"]),
                s(&r["hit_tokens"]),
                s(&r["loaded_chunks"])
            ),
        ),
        ("Looked up".to_owned(), format!("{:.1} s ago", r["seconds_ago"].as_f64().unwrap_or(0.0))),
    ];
    if r["pending"] == json!(true) {
        rows.push(("Prefetch".into(), "still running: ask again".into()));
    }
    for run in r["runs"].as_array().map(Vec::as_slice).unwrap_or_default() {
        let first = run["first_chunk"].as_u64().unwrap_or(0);
        let n = run["chunks"].as_u64().unwrap_or(0);
        let chunks = if n == 1 {
            format!("chunk {first}")
        } else {
            format!("chunks {first}-{}", first + n.saturating_sub(1))
        };
        let tokens = &run["tokens"];
        let what = if run["outcome"] == "hit" {
            format!("hit ({})", s(&run["tier"]))
        } else {
            format!("miss [{}]: {}", s(&run["reason"]), s(&run["detail"]))
        };
        rows.push((format!("{chunks}, tokens {}-{}", s(&tokens[0]), s(&tokens[1])), what));
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explanation_reads_as_one_row_per_run() {
        let r = json!({"model": "m", "cache_salt": "", "world_size": 1, "hit_chunks": 1,
            "chunks": 3, "hit_tokens": 256, "loaded_chunks": 0, "seconds_ago": 2.0,
            "pending": false, "runs": [
                {"first_chunk": 0, "chunks": 1, "tokens": [0, 256], "outcome": "hit", "tier": "L1"},
                {"first_chunk": 1, "chunks": 2, "tokens": [256, 768], "outcome": "miss",
                 "reason": "evicted", "detail": "evicted from L1 by LRU (memory) 1.0 s ago"}]});
        let rows = explain_rows(&r);
        assert_eq!(rows[1], ("Cache salt".to_owned(), "-".to_owned()));
        assert_eq!(rows[3].1, "1 of 3 chunks (256 tokens; 0 loaded from L2 or a peer)");
        assert_eq!(rows[5], ("chunk 0, tokens 0-256".to_owned(), "hit (L1)".to_owned()));
        assert_eq!(
            rows[6],
            (
                "chunks 1-2, tokens 256-768".to_owned(),
                "miss [evicted]: evicted from L1 by LRU (memory) 1.0 s ago".to_owned()
            )
        );
    }

    #[test]
    fn segments_and_urls_are_normalized() {
        assert_eq!(segment("tenant-1_a.b~"), "tenant-1_a.b~");
        assert_eq!(segment("a/b c"), "a%2Fb%20c");
        assert_eq!(base("localhost:8080/"), "http://localhost:8080");
        assert_eq!(base("https://h"), "https://h");
    }
}
