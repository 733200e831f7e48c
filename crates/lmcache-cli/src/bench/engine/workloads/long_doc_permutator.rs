//! `long-doc-permutator` (LMCache's): permutations of a set of context documents, each
//! request `[system prompt][doc_i1]\n\n[doc_i2]...` — how much KV survives reordering (a
//! prefix cache reuses only the shared head; CacheBlend reuses the documents too).
//!
//! Context and system-prompt lengths are exact token counts: the text is made of words the
//! model's tokenizer encodes to one token each ([`TokenPool`]). One warmup request
//! ("warmup" x 500) primes the engine; then the permutations go out, at most
//! `--ldp-num-inflight-requests` at once.

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;

use super::{Job, Next, Wake, Workload};
use crate::bench::engine::openai::Message;
use crate::bench::engine::tokenizer::{ModelTokenizer, TokenPool, TokenizerError};

/// LMCache fixes the word pool at 8,000 words (no flag).
pub const VOCAB_SIZE: usize = 8000;

/// `long-doc-permutator`'s flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LongDocPermutatorConfig {
    /// Distinct context documents.
    pub num_contexts: usize,
    /// Tokens per context.
    pub context_length: usize,
    /// Tokens of the shared system prompt (0: none).
    pub system_prompt_length: usize,
    /// Permutations to send (at most N!).
    pub num_permutations: usize,
    /// Requests in flight at most.
    pub inflight: usize,
    /// Tokens to generate per request.
    pub max_output: u32,
}

/// `long-doc-permutator`.
#[derive(Debug)]
pub struct LongDocPermutator {
    config: LongDocPermutatorConfig,
    requests: Vec<(Vec<Message>, usize)>,
    at: usize,
    tokens_per_request: usize,
}

/// `n!`, saturating.
fn factorial(n: usize) -> u64 {
    (1..=n as u64).try_fold(1u64, |acc, k| acc.checked_mul(k)).unwrap_or(u64::MAX)
}

/// The next permutation in lexicographic order, in place; false after the last.
fn next_permutation(p: &mut [usize]) -> bool {
    let Some(i) = (1..p.len()).rev().find(|&i| p[i - 1] < p[i]) else { return false };
    let j = (i..p.len()).rev().find(|&j| p[j] > p[i - 1]).unwrap_or(i);
    p.swap(i - 1, j);
    p[i..].reverse();
    true
}

/// Up to `wanted` distinct permutations of `0..n` (LMCache's rule): all of them in
/// lexicographic order when `wanted >= n!`; a seeded random sample, sorted, when `n!` is
/// more than ten times `wanted`; else the first `wanted` in lexicographic order.
pub fn permutations(n: usize, wanted: usize, seed: u64) -> Vec<Vec<usize>> {
    let total = factorial(n);
    let wanted = wanted.max(1);
    if total > (wanted as u64).saturating_mul(10) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut seen = std::collections::BTreeSet::new();
        let mut p: Vec<usize> = (0..n).collect();
        while seen.len() < wanted {
            p.shuffle(&mut rng);
            seen.insert(p.clone());
        }
        return seen.into_iter().collect();
    }
    let mut out = Vec::new();
    let mut p: Vec<usize> = (0..n).collect();
    loop {
        out.push(p.clone());
        if out.len() >= wanted || !next_permutation(&mut p) {
            return out;
        }
    }
}

/// `length` words drawn (with replacement) from the pool by a generator seeded `seed`.
fn text(pool: &TokenPool, length: usize, seed: u64) -> String {
    let mut rng = SmallRng::seed_from_u64(seed);
    let words: Vec<&String> = (0..length).filter_map(|_| pool.words.choose(&mut rng)).collect();
    pool.join(&words)
}

impl LongDocPermutator {
    /// Builds every request up front, with `tokenizer`'s one-token words.
    pub fn new(
        tokenizer: &ModelTokenizer,
        config: LongDocPermutatorConfig,
        seed: u64,
    ) -> Result<Self, TokenizerError> {
        let pool = tokenizer.single_token_pool(VOCAB_SIZE, seed)?;
        Self::with_pool(&pool, config, seed, |t| tokenizer.count(t))
    }

    fn with_pool(
        pool: &TokenPool,
        config: LongDocPermutatorConfig,
        seed: u64,
        count: impl Fn(&str) -> Result<usize, TokenizerError>,
    ) -> Result<Self, TokenizerError> {
        let system = if config.system_prompt_length == 0 {
            String::new()
        } else {
            text(pool, config.system_prompt_length, seed)
        };
        let contexts: Vec<String> = (0..config.num_contexts)
            .map(|i| text(pool, config.context_length, seed.wrapping_add(1 + i as u64)))
            .collect();
        let requests: Vec<(Vec<Message>, usize)> =
            permutations(config.num_contexts, config.num_permutations, seed)
                .into_iter()
                .enumerate()
                .map(|(perm_idx, perm)| {
                    let joined: Vec<&str> = perm.iter().map(|&i| contexts[i].as_str()).collect();
                    let mut messages = Vec::new();
                    if !system.is_empty() {
                        messages.push(Message { role: "system", content: system.clone() });
                    }
                    messages.push(Message::user(joined.join("\n\n")));
                    (messages, perm_idx)
                })
                .collect();
        // Measured, not derived: the separators between contexts cost tokenizer-specific
        // tokens.
        let tokens_per_request = match requests.first() {
            Some((m, _)) => m.iter().map(|m| count(&m.content)).sum::<Result<usize, _>>()?,
            None => 0,
        };
        Ok(Self { config, requests, at: 0, tokens_per_request })
    }
}

impl Workload for LongDocPermutator {
    fn name(&self) -> &'static str {
        "long-doc-permutator"
    }

    fn settings(&self) -> Vec<(&'static str, String)> {
        let c = &self.config;
        let possible = match factorial(c.num_contexts) {
            u64::MAX => "more than 2^64".to_owned(),
            n => n.to_string(),
        };
        vec![
            ("Contexts", c.num_contexts.to_string()),
            ("Context length", format!("{} tokens", c.context_length)),
            ("System prompt", format!("{} tokens", c.system_prompt_length)),
            ("Permutations", format!("{} (of {possible} possible)", self.requests.len())),
            ("Total requests", self.requests.len().to_string()),
            ("Tokens per request", format!("{} (measured)", self.tokens_per_request)),
            ("Vocab size", VOCAB_SIZE.to_string()),
            ("Max inflight", c.inflight.to_string()),
            ("Max output length", format!("{} tokens", c.max_output)),
        ]
    }

    fn warmup(&mut self) -> Vec<Job> {
        vec![Job {
            id: "warmup_0".into(),
            messages: vec![
                Message { role: "system", content: "You are a helpful assistant.".into() },
                Message::user(vec!["warmup"; 500].join(" ")),
            ],
            max_tokens: 1,
        }]
    }

    fn next(&mut self, _elapsed: f64, in_flight: usize) -> Next {
        if let Some((messages, perm_idx)) = self.requests.get(self.at) {
            if in_flight >= self.config.inflight.max(1) {
                return Next::Wait(Wake::Finished);
            }
            let job = Job {
                id: format!("perm{perm_idx}_req{}", self.at),
                messages: messages.clone(),
                max_tokens: self.config.max_output,
            };
            self.at += 1;
            return Next::Send(vec![job], Wake::Now);
        }
        if in_flight > 0 { Next::Wait(Wake::Finished) } else { Next::Done }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::engine::tokenizer::tests::{pseudo_words, write_test_tokenizer};

    #[test]
    fn permutations_follow_lmcaches_rule() {
        // All of them, in lexicographic order.
        let all = permutations(3, 100, 0);
        assert_eq!(all.len(), 6);
        assert_eq!(all[0], vec![0, 1, 2]);
        assert_eq!(all[1], vec![0, 2, 1]);
        assert_eq!(all[5], vec![2, 1, 0]);
        // The first few, in order, when N! is not much more than asked.
        assert_eq!(permutations(3, 4, 0).len(), 4);
        assert_eq!(permutations(3, 4, 0)[3], vec![1, 2, 0]);
        // A sample, distinct and sorted, when N! is far more.
        let sample = permutations(8, 10, 42);
        assert_eq!(sample.len(), 10);
        assert!(sample.windows(2).all(|w| w[0] < w[1]), "sorted and distinct");
        assert_eq!(sample, permutations(8, 10, 42), "seeded");
        assert!(sample.iter().all(|p| {
            let mut s = p.clone();
            s.sort();
            s == (0..8).collect::<Vec<_>>()
        }));
        // 25! overflows u64: still a sample.
        assert_eq!(permutations(25, 3, 1).len(), 3);
    }

    #[test]
    fn requests_are_the_contexts_in_each_order_at_exact_token_lengths() {
        let dir = tempfile::tempdir().unwrap();
        let words = pseudo_words(VOCAB_SIZE + 100);
        let refs: Vec<&str> = words.iter().map(String::as_str).collect();
        write_test_tokenizer(dir.path(), &refs, None);
        let t = ModelTokenizer::load(dir.path().to_str().unwrap()).unwrap();
        let config = LongDocPermutatorConfig {
            num_contexts: 3,
            context_length: 300,
            system_prompt_length: 100,
            num_permutations: 4,
            inflight: 2,
            max_output: 8,
        };
        let mut w = LongDocPermutator::new(&t, config, 42).unwrap();
        assert_eq!(w.requests.len(), 4);
        let (first, _) = &w.requests[0];
        assert_eq!(first[0].role, "system");
        assert_eq!(t.count(&first[0].content).unwrap(), 100);
        let docs: Vec<&str> = first[1].content.split("\n\n").collect();
        assert_eq!(docs.len(), 3);
        for d in &docs {
            assert_eq!(t.count(d).unwrap(), 300);
        }
        // The second request (0, 2, 1) holds the same contexts, the last two swapped.
        let second: Vec<&str> = w.requests[1].0[1].content.split("\n\n").collect();
        assert_eq!((second[0], second[1], second[2]), (docs[0], docs[2], docs[1]));
        assert_eq!(w.warmup().len(), 1);
        let Next::Send(a, _) = w.next(0.0, 0) else { panic!() };
        assert_eq!(a[0].id, "perm0_req0");
        let Next::Send(_, _) = w.next(0.0, 1) else { panic!() };
        assert_eq!(w.next(0.0, 2), Next::Wait(Wake::Finished), "two in flight at most");
        // Without a system prompt there is only the user message.
        let none = LongDocPermutator::new(
            &t,
            LongDocPermutatorConfig { system_prompt_length: 0, ..config },
            42,
        )
        .unwrap();
        assert_eq!(none.requests[0].0.len(), 1);
    }
}
