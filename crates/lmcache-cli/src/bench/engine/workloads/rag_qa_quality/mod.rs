//! `rag-qa-quality` (LMCache's): does reusing cached KV change the model's answers? Each
//! distinct passage is prefilled on its own (the warmup), then each question goes out as
//! `[system block][passage]…[passage][question]`, so passages are reused at positions they
//! were never cached at, the RAG pattern. One arm per run: answers are scored (F1 against
//! the gold answers, [`scoring`]) and written per sample to `--rag-output`, to diff two runs
//! (with and without the cache, or two cache servers) by sample id.
//!
//! Passages and the system block are padded with one-token words to whole multiples of
//! `--rag-doc-align-tokens` (the cache's chunk size), counting the chat template's own
//! prefix, so each passage occupies whole chunks at the same phase in its prefill and in
//! every question ([`Aligner`]). Requests go one at a time.
//!
//! Run fingerprints are a SHA-256 of what determines the prompts; they compare lmcache-rs
//! runs with each other (LMCache's are computed over Python's JSON spelling).

pub mod dataset;
pub mod scoring;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use serde_json::{Value, json};
use sha2::Digest as _;

use super::{Job, Next, Section, Wake, Workload};
use crate::bench::engine::openai::{Message, RequestResult};
use crate::bench::engine::tokenizer::{ModelTokenizer, TokenPool, TokenizerError};
use dataset::Sample;

/// LMCache's default chunk size.
pub const DEFAULT_DOC_ALIGN_TOKENS: usize = 256;
const FILLER_VOCAB_SIZE: usize = 4096;
const PAD_ATTEMPTS: usize = 8;
const PREFILL_PREFIX: &str = "prefill_doc";
const MEASURED_PREFIX: &str = "sample";

/// LMCache's QA system prompt, byte for byte.
pub const QA_SYSTEM_PROMPT: &str = "Answer the question using only the given passages. You may reason through the problem, but put only the concise final answer between <final_answer> and </final_answer>. Always emit both tags.\n\nThe following are the given passages.\n";

/// LMCache's question template; `{question}` is replaced.
pub const QA_QUESTION_TEMPLATE: &str = "\n\nAnswer the question using only the passages above. End with exactly one concise answer in this form: <final_answer>answer</final_answer>.\n\nQuestion: {question}\nAnswer:";

/// Parses repeatable `KEY=VALUE` chat-template variables, typed as LMCache types them
/// (true/false, integers, else strings).
pub fn parse_template_kwargs(items: &[String]) -> Result<serde_json::Map<String, Value>, String> {
    let mut out = serde_json::Map::new();
    for item in items {
        let (key, raw) = item
            .split_once('=')
            .map(|(k, v)| (k.trim(), v.trim()))
            .filter(|(k, _)| !k.is_empty())
            .ok_or_else(|| format!("invalid template kwarg {item:?}; expected KEY=VALUE"))?;
        let digits = raw.strip_prefix('-').unwrap_or(raw);
        let value = if raw.eq_ignore_ascii_case("true") || raw.eq_ignore_ascii_case("false") {
            Value::Bool(raw.eq_ignore_ascii_case("true"))
        } else if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            raw.parse::<i64>().map_or_else(|_| Value::String(raw.to_owned()), Value::from)
        } else {
            Value::String(raw.to_owned())
        };
        out.insert(key.to_owned(), value);
    }
    Ok(out)
}

/// Pads blocks to whole chunks (LMCache's `ChunkAligner`): deterministic for a tokenizer,
/// chunk size, seed and text, so two runs build identical prompts.
pub struct Aligner {
    tokenizer: Arc<ModelTokenizer>,
    align: usize,
    seed: u64,
    pool: TokenPool,
}

impl Aligner {
    /// With `tokenizer`'s one-token filler words.
    pub fn new(
        tokenizer: Arc<ModelTokenizer>,
        align: usize,
        seed: u64,
    ) -> Result<Self, TokenizerError> {
        let pool = tokenizer.single_token_pool(FILLER_VOCAB_SIZE, seed)?;
        Ok(Self { tokenizer, align: align.max(1), seed, pool })
    }

    /// `text` plus filler so `offset` + its tokens is a whole number of chunks; corrected
    /// against re-encoding (a merged boundary token shifts the count).
    fn pad(&self, text: &str, offset: usize, rng: &mut SmallRng) -> Result<String, TokenizerError> {
        let total = offset + self.tokenizer.count(text)?;
        let target = total.div_ceil(self.align) * self.align;
        if target == total {
            return Ok(text.to_owned());
        }
        let mut words = (target - total) as i64;
        let mut padded = text.to_owned();
        for _ in 0..PAD_ATTEMPTS {
            let fill: Vec<&String> =
                (0..words.max(0)).filter_map(|_| self.pool.words.choose(rng)).collect();
            padded = format!("{text}\n{}", self.pool.join(&fill));
            let actual = (offset + self.tokenizer.count(&padded)?) as i64;
            if actual == target as i64 {
                return Ok(padded);
            }
            words += target as i64 - actual;
        }
        tracing::warn!(
            align = self.align,
            "a block could not be padded to a chunk boundary; reuse will be partial"
        );
        Ok(padded)
    }

    /// The system prompt padded so the chat template's prefix plus it ends on a boundary.
    pub fn system_block(&self, system: &str) -> Result<String, TokenizerError> {
        let prefix = self.tokenizer.chat_prefix_tokens()?;
        self.pad(system, prefix, &mut SmallRng::seed_from_u64(self.seed))
    }

    /// A passage padded to whole chunks, its filler seeded by its text.
    pub fn passage_block(&self, passage: &str) -> Result<String, TokenizerError> {
        let digest = sha2::Sha256::digest(format!("{}:{passage}", self.seed).as_bytes());
        let mut seed = [0u8; 8];
        seed.copy_from_slice(&digest[..8]);
        self.pad(passage, 0, &mut SmallRng::seed_from_u64(u64::from_le_bytes(seed)))
    }
}

/// `rag-qa-quality`'s flags.
#[derive(Debug, Clone, PartialEq)]
pub struct RagQaQualityConfig {
    /// `--rag-dataset` as given.
    pub dataset: String,
    /// Samples to measure.
    pub num_samples: usize,
    /// Tokens per answer.
    pub max_output: u32,
    /// Chunk size to align to.
    pub doc_align_tokens: usize,
    /// Chat-template variables (sent by the sender; here for the fingerprint and the file).
    pub template_kwargs: serde_json::Map<String, Value>,
    /// The per-sample results file.
    pub output: PathBuf,
}

/// One sample's measured quality.
#[derive(Debug, Clone, PartialEq)]
struct Score {
    sample_id: String,
    parsed: bool,
    f1: f64,
    answer: String,
    ttft: f64,
    num_output_tokens: u64,
}

/// `rag-qa-quality`.
pub struct RagQaQuality {
    config: RagQaQualityConfig,
    model: String,
    seed: u64,
    samples: Vec<Sample>,
    system_block: String,
    blocks: HashMap<String, String>,
    corpus: Vec<String>,
    index: usize,
    scores: Vec<Score>,
}

impl std::fmt::Debug for RagQaQuality {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RagQaQuality").field("samples", &self.samples.len()).finish()
    }
}

impl RagQaQuality {
    /// Builds every prompt up front.
    pub fn new(
        config: RagQaQualityConfig,
        samples: Vec<Sample>,
        tokenizer: Arc<ModelTokenizer>,
        model: &str,
        seed: u64,
    ) -> Result<Self, TokenizerError> {
        let aligner = Aligner::new(tokenizer, config.doc_align_tokens, seed)?;
        let samples: Vec<Sample> = samples.into_iter().take(config.num_samples.max(1)).collect();
        let system_block = aligner.system_block(QA_SYSTEM_PROMPT)?;
        let mut blocks = HashMap::new();
        let mut corpus = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for doc in samples.iter().flat_map(|s| &s.documents) {
            if !blocks.contains_key(doc) {
                let block = aligner.passage_block(doc)?;
                if seen.insert(block.clone()) {
                    corpus.push(block.clone());
                }
                blocks.insert(doc.clone(), block);
            }
        }
        Ok(Self {
            config,
            model: model.to_owned(),
            seed,
            samples,
            system_block,
            blocks,
            corpus,
            index: 0,
            scores: Vec::new(),
        })
    }

    fn question(&self, sample: &Sample) -> Vec<Message> {
        let passages: String = sample.documents.iter().map(|d| self.blocks[d].as_str()).collect();
        let q = QA_QUESTION_TEMPLATE.replace("{question}", &sample.question);
        vec![Message::user(format!("{}{passages}{q}", self.system_block))]
    }

    /// What determines the prompts, hashed: two runs compare only when it matches.
    pub fn fingerprint(&self) -> String {
        let material = json!({
            "dataset": self.config.dataset,
            "num_samples": self.config.num_samples,
            "max_output_length": self.config.max_output,
            "template_kwargs": self.config.template_kwargs,
            "doc_align_tokens": self.config.doc_align_tokens,
            "model": self.model,
            "seed": self.seed,
            "sample_ids": self.samples.iter().map(|s| &s.sample_id).collect::<Vec<_>>(),
            "system_prompt": QA_SYSTEM_PROMPT,
            "question_template": QA_QUESTION_TEMPLATE,
        });
        let digest = sha2::Sha256::digest(material.to_string().as_bytes());
        digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
    }

    fn summary(&self) -> (usize, usize, f64, f64) {
        let parsed: Vec<&Score> = self.scores.iter().filter(|s| s.parsed).collect();
        let n = self.scores.len();
        let rate = if n == 0 { 0.0 } else { parsed.len() as f64 / n as f64 };
        let f1 = if parsed.is_empty() {
            0.0
        } else {
            parsed.iter().map(|s| s.f1).sum::<f64>() / parsed.len() as f64
        };
        (n, parsed.len(), rate, f1)
    }
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

impl Workload for RagQaQuality {
    fn name(&self) -> &'static str {
        "rag-qa-quality"
    }

    fn settings(&self) -> Vec<(&'static str, String)> {
        let c = &self.config;
        let kwargs = if c.template_kwargs.is_empty() {
            "model default".to_owned()
        } else {
            Value::Object(c.template_kwargs.clone()).to_string()
        };
        vec![
            ("Dataset", c.dataset.clone()),
            ("Samples", self.samples.len().to_string()),
            ("Distinct docs", self.corpus.len().to_string()),
            ("Max output", format!("{} tokens", c.max_output)),
            ("Doc alignment", format!("{} tokens", c.doc_align_tokens)),
            ("Template kwargs", kwargs),
            ("Run fingerprint", self.fingerprint()),
            ("Results", c.output.display().to_string()),
        ]
    }

    fn warmup(&mut self) -> Vec<Job> {
        self.corpus
            .iter()
            .enumerate()
            .map(|(i, block)| Job {
                id: format!("{PREFILL_PREFIX}{i}"),
                messages: vec![Message::user(format!("{}{block}", self.system_block))],
                max_tokens: 1,
            })
            .collect()
    }

    fn next(&mut self, _elapsed: f64, in_flight: usize) -> Next {
        if in_flight > 0 {
            return Next::Wait(Wake::Finished);
        }
        let Some(sample) = self.samples.get(self.index) else { return Next::Done };
        let job = Job {
            id: format!("{MEASURED_PREFIX}{}", self.index),
            messages: self.question(sample),
            max_tokens: self.config.max_output,
        };
        self.index += 1;
        Next::Send(vec![job], Wake::Finished)
    }

    fn finished(&mut self, result: &RequestResult, output: &str) {
        let Some(i) =
            result.request_id.strip_prefix(MEASURED_PREFIX).and_then(|i| i.parse::<usize>().ok())
        else {
            return;
        };
        let Some(sample) = self.samples.get(i) else { return };
        let answer = scoring::extract_final_answer(output);
        let parsed = !answer.is_empty() && result.successful;
        self.scores.push(Score {
            sample_id: sample.sample_id.clone(),
            parsed,
            f1: if parsed { scoring::best_f1(&answer, &sample.answers) } else { 0.0 },
            answer,
            ttft: result.ttft,
            num_output_tokens: result.num_output_tokens,
        });
    }

    fn sections(&self) -> Vec<Section> {
        let (n, parsed, rate, f1) = self.summary();
        vec![Section {
            key: "quality",
            label: "Answer Quality",
            entries: vec![
                ("samples", "Samples measured", json!(n)),
                ("parsed", "Samples scored", json!(parsed)),
                ("parse_rate", "Parse rate", json!(round4(rate))),
                ("f1_mean", "Mean F1 (scored only)", json!(round4(f1))),
                ("fingerprint", "Run fingerprint", json!(self.fingerprint())),
            ],
        }]
    }

    fn results_file(&self) -> Option<(PathBuf, Value)> {
        let (n, parsed, rate, f1) = self.summary();
        let c = &self.config;
        let per_sample: Vec<Value> = self
            .scores
            .iter()
            .map(|s| {
                json!({
                    "sample_id": s.sample_id,
                    // Unscored: null, not zero, so a diff pairs by id and skips it.
                    "f1": if s.parsed { json!(round4(s.f1)) } else { Value::Null },
                    "parsed": s.parsed,
                    "answer": s.answer,
                    "ttft": round4(s.ttft),
                    "num_output_tokens": s.num_output_tokens,
                })
            })
            .collect();
        let doc = json!({
            "run_fingerprint": self.fingerprint(),
            "config": {
                "dataset": c.dataset,
                "num_samples": c.num_samples,
                "max_output_length": c.max_output,
                "doc_align_tokens": c.doc_align_tokens,
                "template_kwargs": c.template_kwargs,
                "output_path": c.output,
            },
            "model": self.model,
            "summary": {"num_samples": n, "num_parsed": parsed, "parse_rate": rate, "f1_mean": f1},
            "per_sample": per_sample,
        });
        Some((c.output.clone(), doc))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::engine::tokenizer::tests::{pseudo_words, write_test_tokenizer};

    fn tokenizer(dir: &std::path::Path) -> Arc<ModelTokenizer> {
        let words = pseudo_words(FILLER_VOCAB_SIZE + 200);
        let mut refs: Vec<&str> = words.iter().map(String::as_str).collect();
        refs.extend(["user", "says"]);
        write_test_tokenizer(
            dir,
            &refs,
            Some("{% for m in messages %}{{ m['role'] }} says: {{ m['content'] }}{% endfor %}"),
        );
        Arc::new(ModelTokenizer::load(dir.to_str().unwrap()).unwrap())
    }

    #[test]
    fn template_kwargs_are_typed_as_lmcache_types_them() {
        let m = parse_template_kwargs(&[
            "enable_thinking=False".into(),
            "n=-3".into(),
            "effort= high ".into(),
        ])
        .unwrap();
        assert_eq!(Value::Object(m), json!({"enable_thinking": false, "n": -3, "effort": "high"}));
        assert!(parse_template_kwargs(&["novalue".into()]).is_err());
        assert!(parse_template_kwargs(&["=x".into()]).is_err());
    }

    #[test]
    fn every_block_ends_on_a_chunk_boundary_counting_the_chat_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let t = tokenizer(dir.path());
        let a = Aligner::new(Arc::clone(&t), 64, 42).unwrap();
        let prefix = t.chat_prefix_tokens().unwrap();
        assert!(prefix > 0);
        let system = a.system_block(QA_SYSTEM_PROMPT).unwrap();
        assert_eq!((prefix + t.count(&system).unwrap()) % 64, 0);
        assert!(system.starts_with(QA_SYSTEM_PROMPT));
        let p = a.passage_block("Ada wrote the first program.").unwrap();
        assert_eq!(t.count(&p).unwrap() % 64, 0);
        // Deterministic per text; another text gets other filler.
        assert_eq!(a.passage_block("Ada wrote the first program.").unwrap(), p);
        let q = a.passage_block("Another passage entirely.").unwrap();
        assert_ne!(p.split('\n').nth(1), q.split('\n').nth(1));
    }

    #[test]
    fn passages_are_prefilled_once_then_each_question_is_scored() {
        let dir = tempfile::tempdir().unwrap();
        let t = tokenizer(dir.path());
        let sample = |id: &str, docs: &[&str], answer: &str| Sample {
            sample_id: id.into(),
            documents: docs.iter().map(|d| (*d).to_owned()).collect(),
            question: format!("question {id}?"),
            answers: vec![answer.into()],
        };
        let samples = vec![
            sample("a", &["doc one", "doc two"], "Paris"),
            sample("b", &["doc two", "doc three"], "Lyon"),
            sample("c", &["doc one"], "Nice"),
        ];
        let config = RagQaQualityConfig {
            dataset: "test".into(),
            num_samples: 2,
            max_output: 32,
            doc_align_tokens: 32,
            template_kwargs: serde_json::Map::new(),
            output: dir.path().join("r.json"),
        };
        let mut w = RagQaQuality::new(config, samples, t, "m", 42).unwrap();
        let warm = w.warmup();
        assert_eq!(warm.len(), 3, "three distinct passages in the first two samples");
        assert!(warm[0].messages[0].content.starts_with(QA_SYSTEM_PROMPT));
        let Next::Send(a, Wake::Finished) = w.next(0.0, 0) else { panic!() };
        assert_eq!(a[0].id, "sample0");
        let content = &a[0].messages[0].content;
        assert!(content.contains(&w.blocks["doc one"]) && content.contains(&w.blocks["doc two"]));
        assert!(content.ends_with("Question: question a?\nAnswer:"));
        assert_eq!(w.next(0.0, 1), Next::Wait(Wake::Finished), "one at a time");
        let ok = |id: &str| RequestResult {
            request_id: id.into(),
            successful: true,
            ..RequestResult::default()
        };
        w.finished(&ok("sample0"), "thinking... <final_answer>paris</final_answer>");
        let Next::Send(_, _) = w.next(0.0, 0) else { panic!() };
        w.finished(&ok("sample1"), "<final_answer>Ly");
        assert_eq!(w.next(0.0, 0), Next::Done);
        let s = &w.sections()[0];
        assert_eq!(s.entries[0].2, json!(2));
        assert_eq!(s.entries[1].2, json!(1));
        assert_eq!(s.entries[3].2, json!(1.0));
        let (path, doc) = w.results_file().unwrap();
        assert_eq!(path, dir.path().join("r.json"));
        assert_eq!(doc["per_sample"][0]["f1"], json!(1.0));
        assert_eq!(doc["per_sample"][1]["f1"], Value::Null, "unscored is null");
        assert_eq!(doc["run_fingerprint"].as_str().unwrap().len(), 16);
    }
}
