//! Where `bench engine`'s flags come from besides the command line:
//!
//! - [`expand`]: `--config FILE`, a JSON object of flags by their long names (`ldqa_document_length`
//!   or `ldqa-document-length`), as `--export-config` writes it (ours, or LMCache's
//!   `lmcache bench engine --export-config`); flags on the command line win.
//! - [`export`]: what `--export-config FILE` writes: the resolved model, workload, volume,
//!   tokens per GB and the workload's own flags, without the environment's URLs, so the file
//!   replays against another engine (`--engine-url URL --config FILE`).
//! - [`complete`]: required flags that are missing (`--engine-url`, `--workload`, the
//!   cache-size source where the workload needs one, `--rag-dataset`) are asked for on a
//!   terminal, one question each (LMCache asks in a full-screen form); with
//!   `--no-interactive`, `--export-config`, `--config` or no terminal, the run fails naming
//!   them.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::{Context, bail};
use clap::ValueEnum;
use serde_json::{Map, Value, json};

use super::{EngineArgs, WorkloadKind};

/// Keys LMCache writes that are not flags (its form's own state).
const NOT_FLAGS: [&str; 1] = ["has_lmcache"];

/// Expands `--config FILE` in `bench engine`'s arguments (those after `engine`) into flags.
pub fn expand(args: Vec<String>) -> anyhow::Result<Vec<String>> {
    // `--config` stays: `complete` knows from it that the flags came from a file.
    let (path, rest) = crate::config_file::take_config(args, true)?;
    let Some(path) = path else { return Ok(rest) };
    let text = std::fs::read_to_string(&path).with_context(|| format!("--config {path}"))?;
    let doc: Value = serde_json::from_str(&text).with_context(|| format!("--config {path}"))?;
    let Value::Object(map) = doc else { bail!("--config {path}: expected a JSON object of flags") };
    let given = crate::config_file::given_flags(&rest);
    let mut out = Vec::new();
    for (key, value) in map {
        let flag = key.replace('_', "-");
        if NOT_FLAGS.contains(&key.as_str()) || given.contains(&flag) {
            continue;
        }
        let scalar = |v: &Value| -> anyhow::Result<String> {
            match v {
                Value::String(s) => Ok(s.clone()),
                Value::Number(n) => Ok(n.to_string()),
                other => bail!("--config {path}: {key} = {other} is not a flag value"),
            }
        };
        match &value {
            Value::Null | Value::Bool(false) => {}
            Value::Bool(true) => out.push(format!("--{flag}")),
            Value::Array(items) => {
                for v in items {
                    out.push(format!("--{flag}"));
                    out.push(scalar(v)?);
                }
            }
            v => {
                out.push(format!("--{flag}"));
                out.push(scalar(v)?);
            }
        }
    }
    out.extend(rest);
    Ok(out)
}

fn kind_name(kind: WorkloadKind) -> String {
    kind.to_possible_value().map_or_else(String::new, |v| v.get_name().to_owned())
}

/// The JSON `--export-config` writes.
pub fn export(
    args: &EngineArgs,
    kind: WorkloadKind,
    model: &str,
    tokens_per_gb: Option<u64>,
) -> Value {
    let mut m = Map::new();
    m.insert("model".into(), json!(model));
    m.insert("workload".into(), json!(kind_name(kind)));
    m.insert("kv_cache_volume".into(), json!(args.kv_cache_volume));
    if let Some(t) = tokens_per_gb {
        m.insert("tokens_per_gb_kvcache".into(), json!(t));
    }
    m.insert("ignore_eos".into(), json!(args.ignore_eos));
    m.insert("no_warmup".into(), json!(args.no_warmup));
    let own: Vec<(&str, Value)> = match kind {
        WorkloadKind::LongDocQa => vec![
            ("ldqa_document_length", json!(args.ldqa_document_length)),
            ("ldqa_query_per_document", json!(args.ldqa_query_per_document)),
            ("ldqa_shuffle_policy", json!(args.ldqa_shuffle_policy)),
            ("ldqa_num_inflight_requests", json!(args.ldqa_num_inflight_requests)),
            ("ldqa_max_output_length", json!(args.ldqa_max_output_length)),
        ],
        WorkloadKind::MultiRoundChat => vec![
            ("mrc_shared_prompt_length", json!(args.mrc_shared_prompt_length)),
            ("mrc_chat_history_length", json!(args.mrc_chat_history_length)),
            ("mrc_user_input_length", json!(args.mrc_user_input_length)),
            ("mrc_output_length", json!(args.mrc_output_length)),
            ("mrc_qps", json!(args.mrc_qps)),
            ("mrc_duration", json!(args.mrc_duration)),
        ],
        WorkloadKind::RandomPrefill => vec![
            ("rp_request_length", json!(args.rp_request_length)),
            ("rp_num_requests", json!(args.rp_num_requests)),
        ],
        WorkloadKind::LongDocPermutator => vec![
            ("ldp_num_contexts", json!(args.ldp_num_contexts)),
            ("ldp_context_length", json!(args.ldp_context_length)),
            ("ldp_system_prompt_length", json!(args.ldp_system_prompt_length)),
            ("ldp_num_permutations", json!(args.ldp_num_permutations)),
            ("ldp_num_inflight_requests", json!(args.ldp_num_inflight_requests)),
            ("ldp_max_output_length", json!(args.ldp_max_output_length)),
        ],
        WorkloadKind::PrefixSuffixTuner => vec![
            ("psf_context_length", json!(args.psf_context_length)),
            ("psf_prefix_ratio", json!(args.psf_prefix_ratio)),
            ("psf_thrash", json!(args.psf_thrash)),
        ],
        WorkloadKind::RagQaQuality => vec![
            ("rag_dataset", json!(args.rag_dataset)),
            ("rag_num_samples", json!(args.rag_num_samples)),
            ("rag_max_output_length", json!(args.rag_max_output_length)),
            ("rag_doc_align_tokens", json!(args.rag_doc_align_tokens)),
        ],
    };
    for (k, v) in own {
        m.insert(k.into(), v);
    }
    Value::Object(m)
}

/// The required flags `args` lacks, by name.
pub fn missing(args: &EngineArgs) -> Vec<&'static str> {
    let mut out = Vec::new();
    if args.engine_url.is_none() {
        out.push("--engine-url");
    }
    match args.workload {
        None => out.push("--workload"),
        Some(WorkloadKind::RagQaQuality) if args.rag_dataset.is_none() => out.push("--rag-dataset"),
        _ => {}
    }
    let sized = matches!(
        args.workload,
        Some(
            WorkloadKind::LongDocQa
                | WorkloadKind::MultiRoundChat
                | WorkloadKind::PrefixSuffixTuner
        )
    );
    if sized && args.tokens_per_gb_kvcache.is_none() && args.lmcache_url.is_none() {
        out.push("--tokens-per-gb-kvcache or --lmcache-url");
    }
    out
}

/// `args` with its missing required flags asked for on the terminal, or an error naming
/// them.
pub fn complete(args: EngineArgs) -> anyhow::Result<EngineArgs> {
    let stdin = std::io::stdin();
    let ask = args.config.is_none()
        && args.export_config.is_none()
        && !args.no_interactive
        && stdin.is_terminal();
    complete_with(args, ask.then(|| stdin.lock()), &mut std::io::stderr())
}

fn complete_with(
    mut args: EngineArgs,
    input: Option<impl BufRead>,
    out: &mut impl Write,
) -> anyhow::Result<EngineArgs> {
    let gaps = missing(&args);
    if gaps.is_empty() {
        return Ok(args);
    }
    let Some(mut input) = input else {
        let why = if args.no_interactive {
            "remove --no-interactive to be asked for them"
        } else if args.export_config.is_some() {
            "--export-config does not ask"
        } else if args.config.is_some() {
            "add them to the --config file or the command line"
        } else {
            "there is no terminal to ask on"
        };
        bail!("missing required arguments: {} ({why})", gaps.join(", "));
    };
    let mut line = |question: &str| -> anyhow::Result<String> {
        write!(out, "{question}: ")?;
        out.flush()?;
        let mut answer = String::new();
        if input.read_line(&mut answer)? == 0 {
            bail!("no answer to {question:?}");
        }
        Ok(answer.trim().to_owned())
    };
    if args.engine_url.is_none() {
        let url = line("Engine URL (e.g. http://localhost:8000)")?;
        if url.is_empty() {
            bail!("an engine URL is required");
        }
        args.engine_url = Some(url);
    }
    if args.workload.is_none() {
        let names: Vec<String> =
            WorkloadKind::value_variants().iter().map(|k| kind_name(*k)).collect();
        let answer = line(&format!("Workload ({})", names.join(", ")))?;
        args.workload = Some(
            WorkloadKind::from_str(&answer, true)
                .map_err(|_| anyhow::anyhow!("{answer:?} is not one of {}", names.join(", ")))?,
        );
    }
    if args.workload == Some(WorkloadKind::RagQaQuality) && args.rag_dataset.is_none() {
        args.rag_dataset = Some(line("QA dataset (a .json/.jsonl file, or musique/hotpotqa)")?);
    }
    if missing(&args).iter().any(|m| m.starts_with("--tokens-per-gb")) {
        let answer = line("LMCache server HTTP URL (empty: give tokens per GB instead)")?;
        if answer.is_empty() {
            let t = line("Tokens per GB of KV cache")?;
            args.tokens_per_gb_kvcache =
                Some(t.parse().with_context(|| format!("{t:?} is not a number of tokens"))?);
        } else {
            args.lmcache_url = Some(answer);
        }
    }
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: EngineArgs,
    }

    fn parse(argv: &[&str]) -> EngineArgs {
        let mut v = vec!["x".to_owned()];
        v.extend(expand(argv.iter().map(|s| (*s).to_owned()).collect()).unwrap());
        Cli::try_parse_from(v).unwrap().args
    }

    #[test]
    fn an_exported_config_replays_and_the_command_line_wins() {
        let a = parse(&[
            "--engine-url",
            "http://e",
            "--workload",
            "long-doc-permutator",
            "--model",
            "m",
            "--ldp-num-contexts",
            "3",
            "--ldp-context-length",
            "700",
            "--ignore-eos",
        ]);
        let doc = export(&a, WorkloadKind::LongDocPermutator, "m", Some(4096));
        assert_eq!(doc["ldp_context_length"], json!(700));
        assert_eq!(doc["tokens_per_gb_kvcache"], json!(4096));
        assert!(doc.get("engine_url").is_none() && doc.get("ldqa_document_length").is_none());
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.json");
        // What LMCache's export adds that is not a flag is passed over.
        let mut with_extra = doc.clone();
        with_extra["has_lmcache"] = json!(true);
        std::fs::write(&file, with_extra.to_string()).unwrap();
        let f = file.to_str().unwrap();
        let b = parse(&["--engine-url", "http://other", "--config", f, "--ldp-num-contexts", "4"]);
        assert_eq!(b.workload, Some(WorkloadKind::LongDocPermutator));
        assert_eq!((b.ldp_context_length, b.ldp_num_contexts), (700, 4));
        assert!(b.ignore_eos && !b.no_warmup);
        assert_eq!(b.tokens_per_gb_kvcache, Some(4096));
        assert_eq!(b.engine_url.as_deref(), Some("http://other"));
        // A file that is not an object of flags is refused, naming it.
        std::fs::write(&file, "[1]").unwrap();
        let e = expand(vec!["--config".into(), f.into()]).unwrap_err().to_string();
        assert!(e.contains("JSON object"), "{e}");
    }

    #[test]
    fn missing_flags_are_asked_for_or_named() {
        let a = parse(&["--no-interactive"]);
        assert_eq!(missing(&a), ["--engine-url", "--workload"]);
        let e = complete_with(a.clone(), None::<&[u8]>, &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("--engine-url, --workload") && e.contains("--no-interactive"), "{e}");
        let answers: &[u8] = b"http://e:8000\nprefix-suffix-tuner\n\n123456\n";
        let mut shown = Vec::new();
        let b = complete_with(a, Some(answers), &mut shown).unwrap();
        assert_eq!(b.engine_url.as_deref(), Some("http://e:8000"));
        assert_eq!(b.workload, Some(WorkloadKind::PrefixSuffixTuner));
        assert_eq!(b.tokens_per_gb_kvcache, Some(123_456));
        assert!(String::from_utf8(shown).unwrap().contains("Workload (long-doc-qa, "));
        // rag-qa-quality needs its dataset; random-prefill needs no cache size.
        let r = parse(&["--engine-url", "e", "--workload", "rag-qa-quality"]);
        assert_eq!(missing(&r), ["--rag-dataset"]);
        assert!(missing(&parse(&["--engine-url", "e", "--workload", "random-prefill"])).is_empty());
        let bad: &[u8] = b"e\nnot-a-workload\n";
        let e = complete_with(parse(&[]), Some(bad), &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("not-a-workload"), "{e}");
    }
}
