//! Multi-passage QA datasets for rag-qa-quality, read as LMCache reads them: MuSiQue's
//! `paragraphs`, CacheBlend-style `ctxs`/`contexts`, RAGAS-style `retrieved_contexts`, and
//! HotpotQA's `context` (both of its shapes); answers from `answers`/`answer`/`reference`
//! plus `answer_aliases`. Records without passages, a question or an answer are skipped.
//!
//! A `.json` list or a `.jsonl` file. The known names (`musique`, `hotpotqa`) are looked up
//! in the local Hugging Face hub cache, never downloaded. Parquet is refused by name: convert
//! it to JSONL (`python -c "import pandas as p; p.read_parquet(F).to_json(O, orient='records',
//! lines=True)"`).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// One question over its passages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// The dataset's id (pairs samples across runs).
    pub sample_id: String,
    /// Its passages, in dataset order, empty ones dropped.
    pub documents: Vec<String>,
    /// The question.
    pub question: String,
    /// Gold answers, the primary one first.
    pub answers: Vec<String>,
}

/// Why a dataset cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// Neither a known name in the cache nor a file.
    #[error(
        "dataset {0:?} is not an existing file, and not a known dataset (musique, hotpotqa) in \
         the local Hugging Face hub cache; pass a local .json or .jsonl file"
    )]
    NotFound(String),
    /// Parquet.
    #[error("{0}: Parquet datasets are not read by lmcache-rs; convert it to JSONL")]
    Parquet(PathBuf),
    /// Unreadable or not JSON.
    #[error("{path}: {reason}")]
    Bad {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// Nothing usable in it.
    #[error(
        "{0}: no usable QA samples found; records need passages \
         (paragraphs/ctxs/retrieved_contexts/context), a question, and gold answers"
    )]
    Empty(PathBuf),
}

/// The known datasets: (name, hub repo, file in it).
const HUB: [(&str, &str, &str); 2] = [
    ("musique", "dgslibisey/MuSiQue", "musique_ans_v1.0_dev.jsonl"),
    ("hotpotqa", "hotpotqa/hotpot_qa", "distractor/validation-00000-of-00001.parquet"),
];

/// The file `dataset` names: a known name found in `hub_cache`, else a path.
pub fn resolve(dataset: &str, hub_cache: &Path) -> Result<PathBuf, DatasetError> {
    if let Some((_, repo, file)) = HUB.iter().find(|(n, _, _)| *n == dataset) {
        let dir = hub_cache.join(format!("datasets--{}", repo.replace('/', "--")));
        let rev = std::fs::read_to_string(dir.join("refs").join("main")).unwrap_or_default();
        let snap = dir.join("snapshots").join(rev.trim()).join(file);
        if !rev.trim().is_empty() && snap.is_file() {
            return Ok(snap);
        }
        return Err(DatasetError::NotFound(dataset.to_owned()));
    }
    let path = PathBuf::from(dataset);
    if path.is_file() { Ok(path) } else { Err(DatasetError::NotFound(dataset.to_owned())) }
}

fn records(path: &Path) -> Result<Vec<Value>, DatasetError> {
    let lower = path.to_string_lossy().to_lowercase();
    if lower.ends_with(".parquet") || lower.ends_with(".pq") {
        return Err(DatasetError::Parquet(path.to_path_buf()));
    }
    let bad = |reason: String| DatasetError::Bad { path: path.to_path_buf(), reason };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    if lower.ends_with(".jsonl") {
        return text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| serde_json::from_str(l).map_err(|e| bad(format!("line {}: {e}", i + 1))))
            .collect();
    }
    match serde_json::from_str(&text).map_err(|e| bad(e.to_string()))? {
        Value::Array(list) => Ok(list),
        _ => Err(bad("expected a JSON list of QA records".into())),
    }
}

/// Python's `str()` of a JSON scalar, for ids and answers.
fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::Number(n)) => n.as_f64().is_some_and(|f| f != 0.0),
    }
}

/// The first of `keys` that is truthy.
fn first<'a>(r: &'a Map<String, Value>, keys: &[&str]) -> Option<&'a Value> {
    keys.iter().filter_map(|k| r.get(*k)).find(|v| truthy(Some(v)))
}

fn passage(p: &Value) -> String {
    match p {
        Value::Object(o) => {
            let title = o.get("title").map(text_of).unwrap_or_default().trim().to_owned();
            let body = first(o, &["text", "paragraph_text"]).map(text_of).unwrap_or_default();
            let body = body.trim();
            if title.is_empty() { body.to_owned() } else { format!("{title}\n{body}") }
        }
        other => text_of(other).trim().to_owned(),
    }
}

fn joined(sentences: &Value) -> String {
    match sentences {
        Value::Array(s) => s.iter().map(text_of).collect(),
        other => text_of(other),
    }
}

fn titled(title: &Value, body: String) -> String {
    let mut o = Map::new();
    o.insert("title".into(), title.clone());
    o.insert("text".into(), Value::String(body));
    passage(&Value::Object(o))
}

/// HotpotQA's `context`: `{title: [...], sentences: [[...]]}` or `[[title, [sentence]]]`.
fn from_context(context: &Value) -> Vec<String> {
    match context {
        Value::Object(o) => match (o.get("title"), o.get("sentences")) {
            (Some(Value::Array(t)), Some(Value::Array(s))) => {
                t.iter().zip(s).map(|(t, s)| titled(t, joined(s))).collect()
            }
            _ => Vec::new(),
        },
        Value::Array(entries) => entries
            .iter()
            .filter_map(|e| match e.as_array().map(Vec::as_slice) {
                Some([title, sentences]) => Some(titled(title, joined(sentences))),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

fn documents(r: &Map<String, Value>) -> Vec<String> {
    if let Some(Value::Array(p)) = r.get("paragraphs").filter(|v| truthy(Some(v))) {
        return p.iter().map(passage).collect();
    }
    if let Some(Value::Array(p)) = first(r, &["ctxs", "contexts", "retrieved_contexts"]) {
        return p.iter().map(passage).collect();
    }
    match r.get("context") {
        Some(c) if !c.is_null() => from_context(c),
        _ => Vec::new(),
    }
}

fn answers(r: &Map<String, Value>) -> Vec<String> {
    let raw =
        ["answers", "answer", "reference"].iter().find_map(|k| r.get(*k).filter(|v| !v.is_null()));
    let mut out: Vec<String> = Vec::new();
    let items: Vec<&Value> = match raw {
        Some(Value::Array(a)) => a.iter().collect(),
        Some(v) => vec![v],
        None => Vec::new(),
    };
    for item in items {
        match item {
            Value::Array(inner) => out.extend(inner.iter().map(text_of)),
            Value::Null => {}
            v => out.push(text_of(v)),
        }
    }
    let extra = r.get("extra").and_then(Value::as_object).and_then(|e| e.get("answer_aliases"));
    for aliases in [r.get("answer_aliases"), extra].into_iter().flatten() {
        if let Value::Array(a) = aliases {
            out.extend(a.iter().map(text_of));
        }
    }
    let mut unique: Vec<String> = Vec::new();
    for a in out.iter().map(|a| a.trim()).filter(|a| !a.is_empty()) {
        if !unique.iter().any(|u| u == a) {
            unique.push(a.to_owned());
        }
    }
    unique
}

/// The usable samples of the file at `path`, in dataset order.
pub fn load(path: &Path) -> Result<Vec<Sample>, DatasetError> {
    let mut samples = Vec::new();
    for (index, record) in records(path)?.iter().enumerate() {
        let Some(r) = record.as_object() else { continue };
        let docs: Vec<String> = documents(r).into_iter().filter(|d| !d.is_empty()).collect();
        let question = first(r, &["question", "query", "user_input"])
            .map(text_of)
            .unwrap_or_default()
            .trim()
            .to_owned();
        let answers = answers(r);
        if docs.is_empty() || question.is_empty() || answers.is_empty() {
            continue;
        }
        let sample_id = first(r, &["_id", "id"]).map_or_else(|| index.to_string(), text_of);
        samples.push(Sample { sample_id, documents: docs, question, answers });
    }
    if samples.is_empty() {
        return Err(DatasetError::Empty(path.to_path_buf()));
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_schema_lmcache_reads_is_read_and_unusable_records_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qa.jsonl");
        let lines = [
            // MuSiQue.
            json!({"id": "m1", "question": "Who?", "answer": "Ada", "answer_aliases": ["A. L."],
                "paragraphs": [{"title": "T", "paragraph_text": "Ada wrote it."},
                               {"title": "", "paragraph_text": ""}]}),
            // HotpotQA, JSON shape.
            json!({"_id": "h1", "question": "Where?", "answer": "Paris",
                "context": [["France", ["Paris is ", "the capital."]], ["bad"]]}),
            // HotpotQA, Parquet-struct shape.
            json!({"id": "h2", "question": "When?", "answers": [["1900", "1900"]],
                "context": {"title": ["Y"], "sentences": [["In 1900."]]}}),
            // CacheBlend-style, no id.
            json!({"query": "What?", "reference": "x", "ctxs": ["plain passage"]}),
            // Unusable: no answer; no passages.
            json!({"question": "q", "ctxs": ["p"]}),
            json!({"question": "q", "answer": "a"}),
        ];
        let text: Vec<String> = lines.iter().map(Value::to_string).collect();
        std::fs::write(&path, text.join("\n") + "\n\n").unwrap();
        let s = load(&path).unwrap();
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].sample_id, "m1");
        assert_eq!(s[0].documents, ["T\nAda wrote it."]);
        assert_eq!(s[0].answers, ["Ada", "A. L."]);
        assert_eq!(s[1].documents, ["France\nParis is the capital."]);
        assert_eq!(s[2].answers, ["1900"], "duplicates folded");
        assert_eq!(s[2].documents, ["Y\nIn 1900."]);
        assert_eq!((s[3].sample_id.as_str(), s[3].question.as_str()), ("3", "What?"));
        // A JSON list works too; a JSON object does not; Parquet is refused by name.
        let list = dir.path().join("qa.json");
        std::fs::write(&list, Value::Array(lines.to_vec()).to_string()).unwrap();
        assert_eq!(load(&list).unwrap().len(), 4);
        std::fs::write(&list, "{}").unwrap();
        assert!(load(&list).unwrap_err().to_string().contains("JSON list"));
        let pq = dir.path().join("x.parquet");
        std::fs::write(&pq, "PAR1").unwrap();
        assert!(matches!(load(&pq), Err(DatasetError::Parquet(_))));
        std::fs::write(&list, "[{\"question\": \"q\"}]").unwrap();
        assert!(matches!(load(&list), Err(DatasetError::Empty(_))));
    }

    #[test]
    fn known_names_come_from_the_hub_cache_only() {
        let hub = tempfile::tempdir().unwrap();
        assert!(matches!(resolve("musique", hub.path()), Err(DatasetError::NotFound(_))));
        let dir = hub.path().join("datasets--dgslibisey--MuSiQue");
        std::fs::create_dir_all(dir.join("refs")).unwrap();
        std::fs::write(dir.join("refs/main"), "r1\n").unwrap();
        let snap = dir.join("snapshots/r1");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("musique_ans_v1.0_dev.jsonl"), "").unwrap();
        assert_eq!(
            resolve("musique", hub.path()).unwrap(),
            snap.join("musique_ans_v1.0_dev.jsonl")
        );
        assert!(matches!(
            resolve("/no/such/file.jsonl", hub.path()),
            Err(DatasetError::NotFound(_))
        ));
    }
}
