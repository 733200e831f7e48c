//! `lmcache-rs bench engine`: what LMCache's `lmcache bench engine` does, with its flags:
//! a workload of chat requests streamed to an OpenAI-compatible engine (vLLM, SGLang, or the
//! engine simulator of `benches/engine_simulator/`), measuring TTFT, decode speed, latency
//! and throughput, plus what LMCache's leaves out: how much of the prompts the cache served,
//! as the engine reports it per request (`usage.prompt_tokens_details.cached_tokens`) and as
//! the cache server counts it (`--lmcache-url`: its lookup hit and requested tokens over the
//! measured run).
//!
//! - [`openai`]: one streaming request, timed.
//! - [`workloads`]: LMCache's six: long-doc-qa, multi-round-chat, random-prefill (its prompts
//!   and pacing), and long-doc-permutator, prefix-suffix-tuner, rag-qa-quality, which size
//!   their prompts in exact tokens with the model's tokenizer ([`tokenizer`]).
//! - [`stats`]: LMCache's summary figures, field for field, and its CSV.
//! - [`config`]: `--config FILE` (a JSON file of flags, as LMCache's `--export-config`
//!   writes it) and `--export-config FILE`; the questions asked for missing flags on a
//!   terminal (LMCache's interactive mode, as plain prompts).
//!
//! Warmup requests go one after the other and are not measured. A live display redraws on
//! stderr every second (off with `-q`); `--json` writes `bench_summary.json` and the CSV
//! `bench_results.csv` (unless `--no-csv`) into `--output-dir`, as LMCache's; `--format json`
//! prints the summary document; `--plot` draws TTFT and latency histograms and throughput.

pub mod config;
pub mod openai;
pub mod stats;
pub mod tokenizer;
pub mod workloads;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use parking_lot::Mutex;
use serde_json::{Value, json};

use super::Format;
use super::live::Live;
use openai::{RequestResult, Sender};
use stats::Summary;
use workloads::{Job, Next, Section, Wake, Workload};

/// `--workload`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkloadKind {
    /// Repeated questions over long documents.
    LongDocQa,
    /// Users in multi-round conversations at a fixed rate.
    MultiRoundChat,
    /// Long distinct prompts all at once, one output token each.
    RandomPrefill,
    /// Permutations of shared contexts, exact token lengths (needs the model's tokenizer).
    LongDocPermutator,
    /// A prefix pool just over one cache tier, sent twice; prefix + breaker + shared suffix.
    PrefixSuffixTuner,
    /// RAG answer quality over a QA dataset: passages prefilled alone, then composed
    /// (needs the model's tokenizer and --rag-dataset).
    RagQaQuality,
}

/// Flags of `lmcache-rs bench engine` (LMCache's names and defaults).
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// The engine's OpenAI-compatible URL (e.g. http://localhost:8000). Set OPENAI_API_KEY
    /// if it needs one. Asked for on a terminal when missing.
    #[arg(long)]
    pub engine_url: Option<String>,
    /// The LMCache (or lmcache-rs) server's HTTP URL: tokens per GB come from its /status,
    /// and its lookup counters give the run's cache hit rate.
    #[arg(long)]
    pub lmcache_url: Option<String>,
    /// Model name (default: the engine's first, from /v1/models). The tokenizer workloads
    /// load its tokenizer from it: a local path, or a Hugging Face repo in the local hub
    /// cache.
    #[arg(long)]
    pub model: Option<String>,
    /// The workload. Asked for on a terminal when missing.
    #[arg(long, value_enum)]
    pub workload: Option<WorkloadKind>,
    /// Flags from a JSON file (as --export-config writes it, ours or LMCache's); flags on
    /// the command line win.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Write the resolved configuration to a JSON file and exit, without running.
    #[arg(long, value_name = "FILE")]
    pub export_config: Option<PathBuf>,
    /// Target active KV cache in GB: sizes long-doc-qa's documents and multi-round-chat's
    /// users.
    #[arg(long, default_value_t = 100.0)]
    pub kv_cache_volume: f64,
    /// Tokens per GB of KV cache (needed without --lmcache-url).
    #[arg(long)]
    pub tokens_per_gb_kvcache: Option<u64>,
    /// Random seed (long-doc-qa's shuffle).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Where bench_results.csv and bench_summary.json go.
    #[arg(long, default_value = ".")]
    pub output_dir: PathBuf,
    /// No CSV.
    #[arg(long)]
    pub no_csv: bool,
    /// Write bench_summary.json.
    #[arg(long)]
    pub json: bool,
    /// No live display.
    #[arg(short, long)]
    pub quiet: bool,
    /// Ask the engine to ignore EOS (vLLM's extension), so every request decodes its full
    /// output length.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Skip the warmup: measure a cold start.
    #[arg(long)]
    pub no_warmup: bool,
    /// Never ask for missing flags: fail naming them.
    #[arg(long)]
    pub no_interactive: bool,
    /// Send /v1/completions instead of /v1/chat/completions.
    #[arg(long)]
    pub completions: bool,
    /// The summary on stdout: a table, or the JSON document.
    #[arg(long, value_enum, default_value = "terminal")]
    pub format: Format,
    /// Draw TTFT and latency histograms and throughput over time to this PNG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// long-doc-qa: tokens per document.
    #[arg(long, default_value_t = 10000)]
    pub ldqa_document_length: u64,
    /// long-doc-qa: questions per document.
    #[arg(long, default_value_t = 2)]
    pub ldqa_query_per_document: u32,
    /// long-doc-qa: request order, `random` (seeded) or `tile` (query-major).
    #[arg(long, default_value = "random", value_parser = ["random", "tile"])]
    pub ldqa_shuffle_policy: String,
    /// long-doc-qa: requests in flight at most.
    #[arg(long, default_value_t = 3)]
    pub ldqa_num_inflight_requests: usize,
    /// long-doc-qa: tokens to generate per question.
    #[arg(long, default_value_t = 128)]
    pub ldqa_max_output_length: u32,
    /// multi-round-chat: system prompt tokens.
    #[arg(long, default_value_t = 2000)]
    pub mrc_shared_prompt_length: u64,
    /// multi-round-chat: pre-filled history tokens.
    #[arg(long, default_value_t = 10000)]
    pub mrc_chat_history_length: u64,
    /// multi-round-chat: tokens per user query.
    #[arg(long, default_value_t = 50)]
    pub mrc_user_input_length: u64,
    /// multi-round-chat: tokens to generate per answer.
    #[arg(long, default_value_t = 200)]
    pub mrc_output_length: u32,
    /// multi-round-chat: queries per second.
    #[arg(long, default_value_t = 1.0)]
    pub mrc_qps: f64,
    /// multi-round-chat: seconds of the measured run.
    #[arg(long, default_value_t = 60.0)]
    pub mrc_duration: f64,
    /// long-doc-permutator: distinct context documents.
    #[arg(long, default_value_t = 5)]
    pub ldp_num_contexts: usize,
    /// long-doc-permutator: exact tokens per context.
    #[arg(long, default_value_t = 5000)]
    pub ldp_context_length: usize,
    /// long-doc-permutator: exact tokens of the shared system prompt (0: none).
    #[arg(long, default_value_t = 1000)]
    pub ldp_system_prompt_length: usize,
    /// long-doc-permutator: distinct permutations to send (at most N!).
    #[arg(long, default_value_t = 10)]
    pub ldp_num_permutations: usize,
    /// long-doc-permutator: requests in flight at most.
    #[arg(long, default_value_t = 1)]
    pub ldp_num_inflight_requests: usize,
    /// long-doc-permutator: tokens to generate per request (1: prefill only).
    #[arg(long, default_value_t = 128)]
    pub ldp_max_output_length: u32,
    /// prefix-suffix-tuner: tokens per request (prefix + 32-token breaker + suffix).
    #[arg(long, default_value_t = 8000)]
    pub psf_context_length: usize,
    /// prefix-suffix-tuner: the prefix's share of the request, in (0, 1).
    #[arg(long, default_value_t = 0.8)]
    pub psf_prefix_ratio: f64,
    /// prefix-suffix-tuner: GB of the cache tier to overflow (the pool is 5% more).
    #[arg(long, default_value_t = 20.0)]
    pub psf_thrash: f64,
    /// rag-qa-quality: a local .json/.jsonl QA file, or musique/hotpotqa from the local hub
    /// cache.
    #[arg(long)]
    pub rag_dataset: Option<String>,
    /// rag-qa-quality: questions to measure, in dataset order.
    #[arg(long, default_value_t = 50)]
    pub rag_num_samples: usize,
    /// rag-qa-quality: tokens per answer (room for a reasoning block and the tags).
    #[arg(long, default_value_t = 1024)]
    pub rag_max_output_length: u32,
    /// rag-qa-quality: pad passages to multiples of this many tokens (the cache's chunk
    /// size).
    #[arg(long, default_value_t = workloads::rag_qa_quality::DEFAULT_DOC_ALIGN_TOKENS)]
    pub rag_doc_align_tokens: usize,
    /// rag-qa-quality: a chat-template variable KEY=VALUE (repeatable), sent as
    /// chat_template_kwargs.
    #[arg(long, value_name = "KEY=VALUE")]
    pub rag_template_kwargs: Vec<String>,
    /// rag-qa-quality: the per-sample results file (default: OUTPUT_DIR/rag_qa_quality.json).
    #[arg(long, value_name = "FILE")]
    pub rag_output: Option<PathBuf>,
    /// random-prefill: tokens per request.
    #[arg(long, default_value_t = 10000)]
    pub rp_request_length: u64,
    /// random-prefill: requests.
    #[arg(long, default_value_t = 50)]
    pub rp_num_requests: usize,
}

/// The body of `GET url` (10 s at most; a non-2xx status is an error), with a bearer token
/// when given.
fn http_get(url: &str, bearer: Option<&str>) -> anyhow::Result<String> {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(10))).build().into();
    let mut req = agent.get(url);
    if let Some(token) = bearer {
        req = req.header("Authorization", &format!("Bearer {token}"));
    }
    let mut resp = req.call().with_context(|| format!("cannot reach {url}"))?;
    resp.body_mut().read_to_string().with_context(|| format!("reading {url}"))
}

fn http_json(url: &str, bearer: Option<&str>) -> anyhow::Result<Value> {
    let text = http_get(url, bearer)?;
    serde_json::from_str(&text).with_context(|| format!("{url} did not answer JSON"))
}

fn http_base(url: &str) -> String {
    let url = url.trim_end_matches('/');
    if url.starts_with("http://") || url.starts_with("https://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    }
}

/// Tokens per GB of `model`'s KV from the server's /status, as LMCache computes it:
/// `2^30 / (cache_size_per_token * world_size)`.
pub fn tokens_per_gb(status: &Value, model: &str) -> anyhow::Result<u64> {
    let meta = status
        .get("cache_context_meta")
        .and_then(Value::as_object)
        .filter(|m| !m.is_empty())
        .or_else(|| status.get("cb_gpu_context_meta").and_then(Value::as_object))
        .filter(|m| !m.is_empty())
        .context("the cache server lists no registered model: is the engine connected to it?")?;
    let entry = meta
        .values()
        .find(|m| m.get("model_name").and_then(Value::as_str) == Some(model))
        .with_context(|| {
            let names: Vec<&str> =
                meta.values().filter_map(|m| m.get("model_name")?.as_str()).collect();
            format!("model {model:?} is not registered at the cache server (it has {names:?})")
        })?;
    let per_token = entry
        .pointer("/kv_cache_layout/cache_size_per_token")
        .and_then(Value::as_u64)
        .filter(|&b| b > 0)
        .with_context(|| format!("no cache_size_per_token for {model:?}"))?;
    let world = entry.get("world_size").and_then(Value::as_u64).unwrap_or(1).max(1);
    Ok((1u64 << 30) / (per_token * world))
}

/// (hit tokens, requested tokens) of the cache server's lookups so far, from its /metrics.
fn server_lookups(lmcache_url: &str) -> anyhow::Result<(f64, f64)> {
    let text = http_get(&format!("{}/metrics", http_base(lmcache_url)), None)?;
    let sum = |name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter(|l| l[name.len()..].starts_with([' ', '{']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    Ok((sum("lmcache_mp_lookup_hit_tokens_total"), sum("lmcache_mp_lookup_requested_tokens_total")))
}

/// What the live display shows.
#[derive(Debug, Default)]
struct Progress {
    started: Option<Instant>,
    results: Vec<RequestResult>,
    in_flight: usize,
    phase: &'static str,
}

fn screen(p: &Progress, workload: &str) -> Vec<String> {
    let elapsed = p.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
    let s = Summary::of(&p.results, elapsed);
    let hit = s.engine_cache_hit_rate.map_or("-".into(), |h| format!("{:.1} %", h * 100.0));
    vec![
        format!("bench engine: {workload} ({})  {elapsed:.0} s", p.phase),
        format!(
            "  {} successful   {} in flight   {} failed",
            s.successful_requests, p.in_flight, s.failed_requests
        ),
        format!(
            "  TTFT mean {:.1} ms (p90 {:.1})   decode {:.1} tok/s   cache served {hit} of prompts",
            s.mean_ttft_ms, s.p90_ttft_ms, s.mean_decode_speed
        ),
        format!(
            "  tokens in {} / out {}   throughput {:.1} in / {:.1} out tok/s",
            s.total_input_tokens, s.total_output_tokens, s.input_throughput, s.output_throughput
        ),
    ]
}

/// The model's tokenizer, for the workloads that need one.
fn load_tokenizer(model: &str, workload: &str) -> anyhow::Result<Arc<tokenizer::ModelTokenizer>> {
    let t = tokenizer::ModelTokenizer::load(model)
        .with_context(|| format!("{workload} sizes its prompts in the model's tokens"))?;
    tracing::info!(path = %t.path.display(), "loaded the model's tokenizer");
    Ok(Arc::new(t))
}

fn build(
    args: &EngineArgs,
    kind: WorkloadKind,
    model: &str,
    tokens_per_gb: Option<u64>,
    template_kwargs: &serde_json::Map<String, Value>,
) -> anyhow::Result<Box<dyn Workload>> {
    let need = || {
        tokens_per_gb.context("--tokens-per-gb-kvcache is required when --lmcache-url is not set")
    };
    Ok(match kind {
        WorkloadKind::LongDocQa => {
            if args.ldqa_document_length == 0 || args.ldqa_query_per_document == 0 {
                bail!("--ldqa-document-length and --ldqa-query-per-document must be positive");
            }
            let config = workloads::LongDocQaConfig {
                document_length: args.ldqa_document_length,
                queries: args.ldqa_query_per_document,
                policy: args.ldqa_shuffle_policy.clone(),
                inflight: args.ldqa_num_inflight_requests,
                max_output: args.ldqa_max_output_length.max(1),
            };
            Box::new(workloads::LongDocQa::new(args.kv_cache_volume, need()?, config, args.seed))
        }
        WorkloadKind::MultiRoundChat => {
            if args.mrc_qps.is_nan()
                || args.mrc_qps <= 0.0
                || args.mrc_duration.is_nan()
                || args.mrc_duration <= 0.0
            {
                bail!("--mrc-qps and --mrc-duration must be positive");
            }
            let config = workloads::MultiRoundChatConfig {
                shared_prompt: args.mrc_shared_prompt_length.max(1),
                history: args.mrc_chat_history_length.max(1),
                user_input: args.mrc_user_input_length.max(1),
                output: args.mrc_output_length.max(1),
                qps: args.mrc_qps,
                duration: args.mrc_duration,
            };
            Box::new(workloads::MultiRoundChat::new(args.kv_cache_volume, need()?, config))
        }
        WorkloadKind::RandomPrefill => Box::new(workloads::RandomPrefill::new(
            args.rp_request_length.max(1),
            args.rp_num_requests,
        )),
        WorkloadKind::LongDocPermutator => {
            use workloads::long_doc_permutator::{LongDocPermutator, LongDocPermutatorConfig};
            if args.ldp_num_contexts == 0
                || args.ldp_context_length == 0
                || args.ldp_num_permutations == 0
                || args.ldp_num_inflight_requests == 0
                || args.ldp_max_output_length == 0
            {
                bail!(
                    "--ldp-num-contexts, --ldp-context-length, --ldp-num-permutations, \
                     --ldp-num-inflight-requests and --ldp-max-output-length must be positive"
                );
            }
            let t = load_tokenizer(model, "long-doc-permutator")?;
            let config = LongDocPermutatorConfig {
                num_contexts: args.ldp_num_contexts,
                context_length: args.ldp_context_length,
                system_prompt_length: args.ldp_system_prompt_length,
                num_permutations: args.ldp_num_permutations,
                inflight: args.ldp_num_inflight_requests,
                max_output: args.ldp_max_output_length,
            };
            Box::new(LongDocPermutator::new(&t, config, args.seed)?)
        }
        WorkloadKind::PrefixSuffixTuner => {
            use workloads::prefix_suffix_tuner::{PrefixSuffixTuner, PrefixSuffixTunerConfig};
            let config = PrefixSuffixTunerConfig::resolve(
                need()?,
                args.psf_context_length,
                args.psf_prefix_ratio,
                args.psf_thrash,
            )?;
            // Best effort, as LMCache: without the tokenizer the text is "hi" filler.
            let t = match tokenizer::ModelTokenizer::load(model) {
                Ok(t) => Some(Arc::new(t)),
                Err(e) => {
                    tracing::warn!(error = %e, "prefix-suffix-tuner falls back to filler text");
                    None
                }
            };
            Box::new(PrefixSuffixTuner::new(config, t, args.seed)?)
        }
        WorkloadKind::RagQaQuality => {
            use workloads::rag_qa_quality::{RagQaQuality, RagQaQualityConfig, dataset};
            let name = args.rag_dataset.as_deref().context("rag-qa-quality needs --rag-dataset")?;
            if args.rag_num_samples == 0
                || args.rag_max_output_length == 0
                || args.rag_doc_align_tokens == 0
            {
                bail!(
                    "--rag-num-samples, --rag-max-output-length and --rag-doc-align-tokens must \
                     be positive"
                );
            }
            let t = load_tokenizer(model, "rag-qa-quality")?;
            let path = dataset::resolve(name, &tokenizer::hub_cache())?;
            let samples = dataset::load(&path)?;
            let config = RagQaQualityConfig {
                dataset: name.to_owned(),
                num_samples: args.rag_num_samples,
                max_output: args.rag_max_output_length,
                doc_align_tokens: args.rag_doc_align_tokens,
                template_kwargs: template_kwargs.clone(),
                output: args
                    .rag_output
                    .clone()
                    .unwrap_or_else(|| args.output_dir.join("rag_qa_quality.json")),
            };
            Box::new(RagQaQuality::new(config, samples, t, model, args.seed)?)
        }
    })
}

fn template_kwargs(args: &EngineArgs) -> anyhow::Result<serde_json::Map<String, Value>> {
    workloads::rag_qa_quality::parse_template_kwargs(&args.rag_template_kwargs)
        .map_err(|e| anyhow::anyhow!("--rag-template-kwargs: {e}"))
}

/// Runs the measured part: asks the workload, sends (a thread per request), takes results.
fn measure(
    workload: &mut dyn Workload,
    sender: &Sender,
    progress: &Arc<Mutex<Progress>>,
) -> (Vec<RequestResult>, f64) {
    let (tx, rx) = mpsc::channel::<(RequestResult, String)>();
    let started = Instant::now();
    {
        let mut p = progress.lock();
        p.started = Some(started);
        p.results.clear();
        p.phase = "measuring";
    }
    let mut in_flight = 0usize;
    let mut results = Vec::new();
    let mut take = |r: (RequestResult, String), in_flight: &mut usize, w: &mut dyn Workload| {
        *in_flight -= 1;
        w.finished(&r.0, &r.1);
        let mut p = progress.lock();
        p.in_flight = *in_flight;
        p.results.push(r.0.clone());
        results.push(r.0);
    };
    loop {
        while let Ok(r) = rx.try_recv() {
            take(r, &mut in_flight, workload);
        }
        let elapsed = started.elapsed().as_secs_f64();
        let (jobs, wake) = match workload.next(elapsed, in_flight) {
            Next::Done => break,
            Next::Send(jobs, wake) => (jobs, wake),
            Next::Wait(wake) => (Vec::new(), wake),
        };
        for Job { id, messages, max_tokens } in jobs {
            in_flight += 1;
            let (sender, tx) = (sender.clone(), tx.clone());
            std::thread::spawn(move || {
                let _ = tx.send(sender.send(&id, &messages, max_tokens));
            });
        }
        progress.lock().in_flight = in_flight;
        match wake {
            Wake::Now => {}
            Wake::Finished if in_flight > 0 => {
                if let Ok(r) = rx.recv() {
                    take(r, &mut in_flight, workload);
                }
            }
            Wake::Finished => {}
            Wake::At(t) => loop {
                let left = t - started.elapsed().as_secs_f64();
                if left <= 0.0 {
                    break;
                }
                match rx.recv_timeout(Duration::from_secs_f64(left)) {
                    Ok(r) => take(r, &mut in_flight, workload),
                    Err(_) => break,
                }
            },
        }
    }
    while in_flight > 0 {
        match rx.recv() {
            Ok(r) => take(r, &mut in_flight, workload),
            Err(_) => break,
        }
    }
    (results, started.elapsed().as_secs_f64())
}

fn table(config: &Value, s: &Summary, server_hit: Option<f64>, sections: &[Section]) -> String {
    let line = |k: &str, v: String| format!("{k:<34}{v:>22}\n");
    let head = |t: &str| format!("{:-^56}\n", format!(" {t} "));
    let mut out = format!(
        "\n{:=^56}\n",
        format!(" Engine Benchmark Result ({}) ", config["workload"].as_str().unwrap_or(""))
    );
    out += &head("Configuration");
    out += &line("Engine URL:", config["engine_url"].as_str().unwrap_or("").into());
    out += &line("Model:", config["model"].as_str().unwrap_or("").into());
    out += &line("Workload:", config["workload"].as_str().unwrap_or("").into());
    out += &head("Results");
    out += &line("Successful requests:", s.successful_requests.to_string());
    out += &line("Failed requests:", s.failed_requests.to_string());
    out += &line("Benchmark duration (s):", format!("{:.2}", s.elapsed_time));
    out += &line("Total input tokens:", s.total_input_tokens.to_string());
    out += &line("Total output tokens:", s.total_output_tokens.to_string());
    out += &line("Input throughput (tok/s):", format!("{:.2}", s.input_throughput));
    out += &line("Output throughput (tok/s):", format!("{:.2}", s.output_throughput));
    out += &head("Time to First Token");
    out += &line("Mean TTFT (ms):", format!("{:.2}", s.mean_ttft_ms));
    out += &line("P50 TTFT (ms):", format!("{:.2}", s.p50_ttft_ms));
    out += &line("P90 TTFT (ms):", format!("{:.2}", s.p90_ttft_ms));
    out += &line("P99 TTFT (ms):", format!("{:.2}", s.p99_ttft_ms));
    out += &head("Decoding Speed");
    out += &line("Mean decode (tok/s):", format!("{:.2}", s.mean_decode_speed));
    out += &line("P99 decode (tok/s):", format!("{:.2}", s.p99_decode_speed));
    out += &head("KV Cache");
    out += &line(
        "Prompt tokens served by cache:",
        s.engine_cache_hit_rate.map_or("not reported".into(), |h| format!("{:.1} %", h * 100.0)),
    );
    out += &line(
        "Cache server lookup hits:",
        server_hit.map_or("-".into(), |h| format!("{:.1} %", h * 100.0)),
    );
    for section in sections {
        out += &head(section.label);
        for (_, label, value) in &section.entries {
            let v = value.as_str().map_or_else(|| value.to_string(), str::to_owned);
            out += &line(&format!("{label}:"), v);
        }
    }
    out += &"=".repeat(56);
    out.push('\n');
    out
}

fn plot(results: &[RequestResult], title: &str, path: &std::path::Path) -> anyhow::Result<()> {
    use crate::plot::{Histogram, Lines, Panel};
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.successful).collect();
    let ttft: Vec<f64> = ok.iter().map(|r| r.ttft * 1e3).collect();
    let latency: Vec<f64> = ok.iter().map(|r| r.request_latency * 1e3).collect();
    let start = results.iter().map(|r| r.submit_time).fold(f64::INFINITY, f64::min);
    let mut ttft_over_time: Vec<(f64, f64)> =
        ok.iter().map(|r| (r.submit_time - start, r.ttft * 1e3)).collect();
    ttft_over_time.sort_by(|a, b| a.0.total_cmp(&b.0));
    let note = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        Some(format!(
            "p50 {:.1} ms\np90 {:.1} ms",
            stats::percentile(&s, 50.0),
            stats::percentile(&s, 90.0)
        ))
    };
    let panels = [
        Panel::Histogram(Histogram {
            title: "time to first token",
            x_label: "TTFT (ms)",
            y_label: "requests",
            values: &ttft,
            bins: 30,
            range: None,
            note: note(&ttft),
        }),
        Panel::Histogram(Histogram {
            title: "request latency",
            x_label: "latency (ms)",
            y_label: "requests",
            values: &latency,
            bins: 30,
            range: None,
            note: note(&latency),
        }),
        Panel::Lines(Lines {
            title: "TTFT by submission time",
            x_label: "submitted at (s)",
            y_label: "TTFT (ms)",
            series: vec![("TTFT".into(), ttft_over_time)],
            log_x: false,
            y_range: None,
            markers: true,
        }),
    ];
    crate::plot::figure(path, title, 3, (620, 420), &panels)
}

/// Runs `lmcache-rs bench engine`.
pub fn run(args: EngineArgs) -> anyhow::Result<()> {
    let args = config::complete(args)?;
    let (Some(engine_url), Some(kind)) = (args.engine_url.clone(), args.workload) else {
        bail!("--engine-url and --workload are required");
    };
    if args.kv_cache_volume.is_nan() || args.kv_cache_volume <= 0.0 {
        bail!("--kv-cache-volume must be positive");
    }
    let model = match &args.model {
        Some(m) => m.clone(),
        None => {
            let url = format!("{}/models", openai::normalize_url(&engine_url));
            let key = openai::api_key();
            let v = http_json(&url, Some(&key))?;
            v.pointer("/data/0/id")
                .and_then(Value::as_str)
                .map(str::to_owned)
                .with_context(|| format!("{url} lists no model; pass --model"))?
        }
    };
    let tokens_per_gb = match (args.tokens_per_gb_kvcache, &args.lmcache_url) {
        (Some(t), _) => Some(t),
        (None, Some(url)) => {
            let status = http_json(&format!("{}/status", http_base(url)), None)?;
            Some(tokens_per_gb(&status, &model)?)
        }
        (None, None) => None,
    };
    if let Some(path) = &args.export_config {
        let doc = config::export(&args, kind, &model, tokens_per_gb);
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        println!("Configuration exported to {}", path.display());
        println!(
            "Replay with: lmcache-rs bench engine --engine-url <URL> --config {}",
            path.display()
        );
        return Ok(());
    }
    let kwargs = template_kwargs(&args)?;
    let mut workload = build(&args, kind, &model, tokens_per_gb, &kwargs)?;
    let extra_body = if kwargs.is_empty() {
        serde_json::Map::new()
    } else {
        serde_json::Map::from_iter([("chat_template_kwargs".to_owned(), Value::Object(kwargs))])
    };
    let sender = Sender::new(&engine_url, &model, args.completions, args.ignore_eos)
        .with_extra_body(extra_body);
    let name = workload.name();
    if matches!(args.format, Format::Terminal) {
        println!("Workload: {name}");
        for (k, v) in workload.settings() {
            println!("  {:<20}{v}", format!("{k}:"));
        }
    }
    let progress = Arc::new(Mutex::new(Progress { phase: "warmup", ..Progress::default() }));
    let live = {
        let p = Arc::clone(&progress);
        Live::start_screen(move || screen(&p.lock(), name), !args.quiet)
    };
    if !args.no_warmup {
        progress.lock().started = Some(Instant::now());
        for job in workload.warmup() {
            let (r, _) = sender.send(&job.id, &job.messages, job.max_tokens);
            if !r.successful {
                tracing::warn!(request = %r.request_id, error = %r.error, "warmup request failed");
            }
            progress.lock().results.push(r);
        }
        let settle = workload.settle();
        if !settle.is_zero() {
            progress.lock().phase = "settling";
            std::thread::sleep(settle);
        }
    }
    let before = args.lmcache_url.as_deref().map(server_lookups).transpose()?;
    let (results, elapsed) = measure(workload.as_mut(), &sender, &progress);
    let after = args.lmcache_url.as_deref().map(server_lookups).transpose()?;
    progress.lock().phase = "done";
    live.finish();
    let server_hit = match (before, after) {
        (Some((h0, r0)), Some((h1, r1))) if r1 > r0 => Some((h1 - h0) / (r1 - r0)),
        _ => None,
    };
    let summary = Summary::of(&results, elapsed);
    let settings: serde_json::Map<String, Value> =
        workload.settings().into_iter().map(|(k, v)| (k.to_owned(), json!(v))).collect();
    let config = json!({
        "engine_url": engine_url,
        "model": model,
        "workload": name,
        "kv_cache_volume_gb": args.kv_cache_volume,
        "tokens_per_gb_kvcache": tokens_per_gb,
        "seed": args.seed,
        "output_dir": args.output_dir,
        "export_csv": !args.no_csv,
        "export_json": args.json,
        "quiet": args.quiet,
        "ignore_eos": args.ignore_eos,
        "warmup_policy": if args.no_warmup { "skip" } else { "run" },
        "workload_settings": settings,
    });
    let mut doc = json!({"config": config, "results": summary});
    doc["results"]["cache_server_hit_rate"] = json!(server_hit);
    let sections = workload.sections();
    for section in &sections {
        let entries: serde_json::Map<String, Value> =
            section.entries.iter().map(|(k, _, v)| ((*k).to_owned(), v.clone())).collect();
        doc[section.key] = Value::Object(entries);
    }
    if !args.no_csv || args.json {
        std::fs::create_dir_all(&args.output_dir)
            .with_context(|| format!("creating {}", args.output_dir.display()))?;
    }
    if !args.no_csv {
        let path = args.output_dir.join("bench_results.csv");
        std::fs::write(&path, stats::to_csv(&results))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        let path = args.output_dir.join("bench_summary.json");
        std::fs::write(&path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some((path, body)) = workload.results_file() {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(&path, serde_json::to_string_pretty(&body)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        if matches!(args.format, Format::Terminal) {
            println!("Quality results written to {}", path.display());
        }
    }
    if let Some(path) = &args.plot {
        plot(&results, &format!("lmcache-rs bench engine: {name}"), path)?;
    }
    match args.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&doc)?),
        Format::Terminal => print!("{}", table(&doc["config"], &summary, server_hit, &sections)),
    }
    if summary.successful_requests == 0 && summary.total_requests > 0 {
        bail!("every request failed; the first: {}", results[0].error);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_per_gb_follow_lmcaches_formula_and_name_what_is_missing() {
        let status = json!({"cache_context_meta": {"7": {
            "model_name": "m", "world_size": 2,
            "kv_cache_layout": {"cache_size_per_token": 2048}}}});
        assert_eq!(tokens_per_gb(&status, "m").unwrap(), (1 << 30) / 4096);
        let e = tokens_per_gb(&status, "other").unwrap_err().to_string();
        assert!(e.contains("\"other\"") && e.contains("\"m\""), "{e}");
        let e = tokens_per_gb(&json!({"cache_context_meta": {}}), "m").unwrap_err().to_string();
        assert!(e.contains("no registered model"), "{e}");
    }
}
