//! The model's tokenizer, for the workloads that promise prompts of an exact token length
//! (long-doc-permutator, prefix-suffix-tuner, rag-qa-quality), as LMCache's
//! `engine_bench/tokenizers.py` does it with `transformers`:
//!
//! - [`ModelTokenizer::load`]: `--model` as a local path (a `tokenizer.json`, or a directory
//!   holding one) or a Hugging Face repo id already in the local hub cache (`HF_HUB_CACHE`,
//!   `HF_HOME/hub`, `~/.cache/huggingface/hub`). Nothing is downloaded: these machines have
//!   no hub access, and a bench that fetched a tokenizer behind the user's back would time
//!   something else.
//! - [`ModelTokenizer::single_token_pool`]: words that each encode to exactly one token in
//!   context, and how to join them, so `n` words make `n` tokens (LMCache's algorithm; its
//!   seeded sample is drawn with our RNG, so the words differ from LMCache's, the counts not).
//! - [`ModelTokenizer::chat_prefix_tokens`]: the tokens the model's chat template puts before a
//!   user message's content (rendered with minijinja), which rag-qa-quality pads around.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use serde_json::Value;

/// Why a tokenizer could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// `--model` names no local tokenizer and no cached hub repo.
    #[error(
        "no tokenizer for model {model:?}: not a tokenizer.json or a directory holding one, and \
         not a Hugging Face repo in the local hub cache ({cache}). Pass --model with a local \
         path, or download the repo first (huggingface-cli download {model})"
    )]
    NotFound {
        /// `--model`.
        model: String,
        /// The hub cache looked in.
        cache: String,
    },
    /// The file is not a tokenizer this crate reads.
    #[error("cannot read the tokenizer at {path}: {reason}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// What the tokenizers crate said.
        reason: String,
    },
    /// Encoding or decoding failed.
    #[error("the tokenizer failed: {0}")]
    Codec(String),
    /// Too few one-token words for a pool.
    #[error(
        "the tokenizer yielded only {found} words that stay a single token in context, need \
         {need}; use a model whose tokenizer marks word starts (byte-level BPE or \
         SentencePiece do; WordPiece does not)"
    )]
    PoolTooSmall {
        /// Usable words.
        found: usize,
        /// Words asked for.
        need: usize,
    },
    /// The words are one token each but their join is not `size` tokens.
    #[error(
        "a {size}-word pool encodes to {actual} tokens: this tokenizer does not segment words \
         independently, so exact token lengths cannot be honoured for it"
    )]
    PoolDoesNotCompose {
        /// Words.
        size: usize,
        /// Tokens their join encodes to.
        actual: usize,
    },
}

/// Words that each cost one token, and how to join them (LMCache's `TokenPool`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenPool {
    /// The words.
    pub words: Vec<String>,
    /// Whether the text opens with a space (most tokenizers fold it into the first word).
    pub leading_space: bool,
}

impl TokenPool {
    /// `words` as text that encodes to `words.len()` tokens.
    pub fn join<S: AsRef<str>>(&self, words: &[S]) -> String {
        let mut text = String::with_capacity(words.len() * 8);
        for (i, w) in words.iter().enumerate() {
            if i > 0 || self.leading_space {
                text.push(' ');
            }
            text.push_str(w.as_ref());
        }
        text
    }
}

/// A model's tokenizer and chat template.
pub struct ModelTokenizer {
    inner: tokenizers::Tokenizer,
    /// Where it was read from.
    pub path: PathBuf,
    special_ids: HashSet<u32>,
    config: Option<Value>,
    chat_template: Option<String>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer").field("path", &self.path).finish()
    }
}

/// Where the Hugging Face hub cache is, as `huggingface_hub` finds it.
pub fn hub_cache() -> PathBuf {
    if let Some(p) = std::env::var_os("HF_HUB_CACHE").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("HF_HOME").filter(|p| !p.is_empty()) {
        return PathBuf::from(p).join("hub");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/"), PathBuf::from);
    home.join(".cache").join("huggingface").join("hub")
}

/// The snapshot directory of `repo` (`org/name`) in the hub cache that holds a
/// tokenizer.json: the one `refs/main` names, else any.
fn cached_snapshot(cache: &Path, repo: &str) -> Option<PathBuf> {
    let (org, name) = repo.split_once('/')?;
    if org.is_empty() || name.is_empty() || name.contains('/') || repo.contains("..") {
        return None;
    }
    let dir = cache.join(format!("models--{org}--{name}"));
    let snapshots = dir.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(dir.join("refs").join("main")) {
        let snap = snapshots.join(rev.trim());
        if snap.join("tokenizer.json").is_file() {
            return Some(snap);
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(&snapshots)
        .ok()?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.join("tokenizer.json").is_file())
        .collect();
    found.sort();
    found.pop()
}

fn read_json(path: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// A special token's text in tokenizer_config.json: a string, or `{"content": ...}`.
fn token_text(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned).or_else(|| v.get("content")?.as_str().map(str::to_owned))
}

impl ModelTokenizer {
    /// The tokenizer of `model`: a path, or a cached hub repo id.
    pub fn load(model: &str) -> Result<Self, TokenizerError> {
        let direct = Path::new(model);
        let cache = hub_cache();
        let file = if direct.is_file() {
            direct.to_path_buf()
        } else if direct.join("tokenizer.json").is_file() {
            direct.join("tokenizer.json")
        } else if let Some(snap) = cached_snapshot(&cache, model) {
            snap.join("tokenizer.json")
        } else {
            return Err(TokenizerError::NotFound {
                model: model.to_owned(),
                cache: cache.display().to_string(),
            });
        };
        let inner = tokenizers::Tokenizer::from_file(&file).map_err(|e| {
            TokenizerError::Unreadable { path: file.clone(), reason: e.to_string() }
        })?;
        let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
        let config = read_json(&dir.join("tokenizer_config.json"));
        let chat_template = config
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .and_then(|t| match t {
                Value::String(s) => Some(s.clone()),
                // A list of named templates: the default one.
                Value::Array(list) => list
                    .iter()
                    .find(|e| e.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|e| e.get("template")?.as_str().map(str::to_owned)),
                _ => None,
            })
            .or_else(|| std::fs::read_to_string(dir.join("chat_template.jinja")).ok());
        let mut special_ids: HashSet<u32> = inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| *id)
            .collect();
        if let Some(c) = &config {
            for key in ["bos_token", "eos_token", "unk_token", "pad_token"] {
                if let Some(id) =
                    c.get(key).and_then(token_text).and_then(|t| inner.token_to_id(&t))
                {
                    special_ids.insert(id);
                }
            }
        }
        Ok(Self { inner, path: file, special_ids, config, chat_template })
    }

    /// Token ids of `text`, without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc =
            self.inner.encode(text, false).map_err(|e| TokenizerError::Codec(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Tokens of `text`, without special tokens.
    pub fn count(&self, text: &str) -> Result<usize, TokenizerError> {
        Ok(self.encode(text)?.len())
    }

    /// Text of `ids`, special tokens skipped (ids outside the vocabulary are dropped, as
    /// `transformers` does).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner.decode(ids, true).map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    /// The candidates of `words` that still cost one token after `prefix` (which costs
    /// `base`).
    fn verify(
        &self,
        words: &[String],
        prefix: &str,
        base: usize,
    ) -> Result<Vec<String>, TokenizerError> {
        let texts: Vec<String> = words.iter().map(|w| format!("{prefix}{w}")).collect();
        let encoded = self
            .inner
            .encode_batch(texts, false)
            .map_err(|e| TokenizerError::Codec(e.to_string()))?;
        Ok(words
            .iter()
            .zip(encoded)
            .filter(|(_, e)| e.get_ids().len() == base + 1)
            .map(|(w, _)| w.clone())
            .collect())
    }

    /// `size` words that each encode to exactly one token in a prompt (LMCache's
    /// `build_single_token_pool`): vocabulary entries that start a word (a space, GPT-2's `Ġ`
    /// or SentencePiece's `▁`) followed by lowercase ASCII letters, each checked by encoding
    /// it as it will appear, then a seeded sample, then a check of the whole.
    pub fn single_token_pool(&self, size: usize, seed: u64) -> Result<TokenPool, TokenizerError> {
        let mut words: Vec<String> = self
            .inner
            .get_vocab(true)
            .into_iter()
            .filter(|(_, id)| !self.special_ids.contains(id))
            .filter_map(|(key, _)| {
                let rest = key
                    .strip_prefix(' ')
                    .or_else(|| key.strip_prefix('Ġ'))
                    .or_else(|| key.strip_prefix('▁'))?;
                (!rest.is_empty() && rest.bytes().all(|b| b.is_ascii_lowercase()))
                    .then(|| rest.to_owned())
            })
            .collect();
        words.sort();
        words.dedup();
        let mut verified = Vec::new();
        let mut leading_space = true;
        if !words.is_empty() {
            verified = self.verify(&words, " ", 0)?;
            if verified.len() < size {
                // A tokenizer that charges for an explicit leading space (Phi-3): words are
                // separated, not prefixed.
                let base = self.count("x")?;
                let separated = self.verify(&words, "x ", base)?;
                if separated.len() > verified.len() {
                    verified = separated;
                    leading_space = false;
                }
            }
        }
        if verified.len() < size {
            return Err(TokenizerError::PoolTooSmall { found: verified.len(), need: size });
        }
        let mut rng = SmallRng::seed_from_u64(seed);
        let words: Vec<String> = verified.choose_multiple(&mut rng, size).cloned().collect();
        let pool = TokenPool { words, leading_space };
        let actual = self.count(&pool.join(&pool.words))?;
        if actual != size {
            return Err(TokenizerError::PoolDoesNotCompose { size, actual });
        }
        Ok(pool)
    }

    /// The chat template rendered for one user message whose content is `content`, with the
    /// generation prompt; `None` when the model has none or it does not render.
    pub fn render_chat(&self, content: &str) -> Option<String> {
        let template = self.chat_template.as_deref()?;
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        let special = |k: &str| {
            self.config.as_ref().and_then(|c| c.get(k)).and_then(token_text).unwrap_or_default()
        };
        let ctx = minijinja::context! {
            messages => vec![minijinja::context! { role => "user", content => content }],
            add_generation_prompt => true,
            bos_token => special("bos_token"),
            eos_token => special("eos_token"),
        };
        match env.render_str(template, ctx) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "the model's chat template did not render");
                None
            }
        }
    }

    /// Tokens the chat template puts before a user message's content (0 without a template,
    /// as LMCache: alignment is then approximate).
    pub fn chat_prefix_tokens(&self) -> Result<usize, TokenizerError> {
        const SENTINEL: &str = "██SENTINEL██";
        let Some(rendered) = self.render_chat(SENTINEL) else { return Ok(0) };
        let head = rendered.split(SENTINEL).next().unwrap_or("");
        self.count(head)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A word-level tokenizer over `words` with GPT-2's byte-level pre-tokenizer: each
    /// `Ġword` one token, plus single characters so anything encodes.
    pub(crate) fn write_test_tokenizer(dir: &Path, words: &[&str], template: Option<&str>) {
        let mut vocab = serde_json::Map::new();
        let mut id = 0u32;
        let mut add = |t: String, vocab: &mut serde_json::Map<String, Value>| {
            if !vocab.contains_key(&t) {
                vocab.insert(t, Value::from(id));
                id += 1;
            }
        };
        add("<|endoftext|>".into(), &mut vocab);
        for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:.,?!\n_-".chars() {
            add(c.to_string(), &mut vocab);
        }
        add("Ġ".into(), &mut vocab);
        add("Ċ".into(), &mut vocab);
        for w in words {
            add(format!("Ġ{w}"), &mut vocab);
            add((*w).to_owned(), &mut vocab);
        }
        let tok = serde_json::json!({
            "version": "1.0",
            "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                "use_regex": true},
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<|endoftext|>"},
        });
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        let mut cfg = serde_json::json!({"eos_token": "<|endoftext|>"});
        if let Some(t) = template {
            cfg["chat_template"] = Value::from(t);
        }
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    }

    pub(crate) fn pseudo_words(n: usize) -> Vec<String> {
        // Distinct lowercase words: base-26 spellings, 3 letters and up.
        (0..n)
            .map(|mut i| {
                let mut w = String::new();
                for _ in 0..3 {
                    w.push((b'a' + (i % 26) as u8) as char);
                    i /= 26;
                }
                while i > 0 {
                    w.push((b'a' + (i % 26) as u8) as char);
                    i /= 26;
                }
                w
            })
            .collect()
    }

    #[test]
    fn a_pool_of_one_token_words_joins_to_exactly_its_length() {
        let dir = tempfile::tempdir().unwrap();
        let words = pseudo_words(300);
        let refs: Vec<&str> = words.iter().map(String::as_str).collect();
        write_test_tokenizer(dir.path(), &refs, None);
        let t = ModelTokenizer::load(dir.path().to_str().unwrap()).unwrap();
        let pool = t.single_token_pool(200, 7).unwrap();
        assert_eq!(pool.words.len(), 200);
        assert!(pool.leading_space);
        let text = pool.join(&pool.words[..57]);
        assert!(text.starts_with(' '));
        assert_eq!(t.count(&text).unwrap(), 57);
        // Seeded: the same pool again, another seed another order.
        assert_eq!(t.single_token_pool(200, 7).unwrap(), pool);
        assert_ne!(t.single_token_pool(200, 8).unwrap().words, pool.words);
        // Asking for more words than the vocabulary has names how many there were.
        let e = t.single_token_pool(1000, 7).unwrap_err();
        assert!(matches!(e, TokenizerError::PoolTooSmall { found: 300, need: 1000 }), "{e}");
    }

    #[test]
    fn a_model_is_found_as_a_file_a_directory_or_a_cached_hub_repo_and_nowhere_else() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m");
        write_test_tokenizer(&model, &["hello"], None);
        assert!(ModelTokenizer::load(model.to_str().unwrap()).is_ok());
        assert!(ModelTokenizer::load(model.join("tokenizer.json").to_str().unwrap()).is_ok());
        // A hub cache laid out as huggingface_hub lays it out.
        let hub = dir.path().join("hub");
        let snap = hub.join("models--org--name/snapshots/abc123");
        write_test_tokenizer(&snap, &["hello"], None);
        std::fs::create_dir_all(hub.join("models--org--name/refs")).unwrap();
        std::fs::write(hub.join("models--org--name/refs/main"), "abc123").unwrap();
        assert_eq!(cached_snapshot(&hub, "org/name"), Some(snap));
        assert_eq!(cached_snapshot(&hub, "org/other"), None);
        assert_eq!(cached_snapshot(&hub, "../x"), None);
        assert_eq!(cached_snapshot(&hub, "noslash"), None);
        let e = ModelTokenizer::load("surely/not-a-cached-repo-here").unwrap_err().to_string();
        assert!(e.contains("surely/not-a-cached-repo-here") && e.contains("hub cache"), "{e}");
    }

    #[test]
    fn the_chat_prefix_is_what_the_template_puts_before_the_content() {
        let dir = tempfile::tempdir().unwrap();
        write_test_tokenizer(
            dir.path(),
            &["user", "says"],
            Some("{% for m in messages %}{{ m['role'] }} says: {{ m['content'] }}\n{% endfor %}"),
        );
        let t = ModelTokenizer::load(dir.path().to_str().unwrap()).unwrap();
        // "user", " says", ":", " " (the space before the content).
        assert_eq!(t.render_chat("hi").unwrap(), "user says: hi\n");
        assert_eq!(t.chat_prefix_tokens().unwrap(), t.count("user says: ").unwrap());
        assert!(t.chat_prefix_tokens().unwrap() >= 3);
        // No template: 0, as LMCache.
        let plain = tempfile::tempdir().unwrap();
        write_test_tokenizer(plain.path(), &["user"], None);
        let t = ModelTokenizer::load(plain.path().to_str().unwrap()).unwrap();
        assert_eq!(t.chat_prefix_tokens().unwrap(), 0);
    }
}
