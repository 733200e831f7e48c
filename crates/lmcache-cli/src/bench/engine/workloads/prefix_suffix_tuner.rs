//! `prefix-suffix-tuner` (LMCache's): a pool of prefixes just larger than one cache tier,
//! sent twice in the same order, one request at a time; each request is
//! `[prefix_i] [random breaker] [shared suffix]`, so a prefix cache can reuse the prefix
//! only (the breaker is fresh every time) and CacheBlend the suffix too.
//!
//! - The pool: `--psf-thrash` GB x 1.05 of KV, in requests of `--psf-context-length` tokens
//!   (`num_prefixes = thrash * 1.05 * tokens_per_gb / context_length`): under LRU, pass 2
//!   then misses the targeted tier on every request.
//! - Pass 1 (the warmup: one throwaway "Hello", then every prefix) fills the cache; 5 s let
//!   the cache's eviction catch up; pass 2 is measured, one output token per request.
//! - Text is random token ids of the model's tokenizer, decoded (about the configured
//!   length, unique per prefix); without a tokenizer, "hi" filler, as LMCache.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{Job, Next, Wake, Workload};
use crate::bench::engine::openai::Message;
use crate::bench::engine::tokenizer::{ModelTokenizer, TokenizerError};

const BREAKER_TOKENS: usize = 32;
const MIN_SUFFIX_TOKENS: usize = 100;
/// About what `PREFIX_<8 hex digits>` costs.
const UNIQUE_ID_TOKENS: usize = 4;
const OVERFLOW_FACTOR: f64 = 1.05;
const SETTLE: Duration = Duration::from_secs(5);
/// Token ids drawn for random text: clear of byte fallbacks and specials at the low end and
/// of reserved tokens at the high end (LMCache's range).
const TOKEN_ID_RANGE: std::ops::Range<u32> = 256..50000;

/// `prefix-suffix-tuner`'s flags, resolved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixSuffixTunerConfig {
    /// Tokens per request.
    pub context_length: usize,
    /// The prefix's share of them.
    pub prefix_ratio: f64,
    /// GB of the tier to overflow.
    pub thrash: f64,
    /// Prefixes in the pool.
    pub num_prefixes: usize,
    /// Tokens per prefix.
    pub prefix_tokens: usize,
    /// Tokens of the shared suffix.
    pub suffix_tokens: usize,
}

/// Why the flags do not make a workload.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// `--psf-prefix-ratio` outside (0, 1).
    #[error("--psf-prefix-ratio must be in (0.0, 1.0), got {0}")]
    Ratio(f64),
    /// A non-positive length or size.
    #[error("--psf-context-length and --psf-thrash must be positive")]
    NotPositive,
    /// Too little left for the suffix.
    #[error(
        "the suffix would be {0} tokens, under the minimum of {MIN_SUFFIX_TOKENS}; lower \
         --psf-prefix-ratio or raise --psf-context-length"
    )]
    SuffixTooShort(i64),
}

impl PrefixSuffixTunerConfig {
    /// The pool and token split from the flags (LMCache's `resolve`).
    pub fn resolve(
        tokens_per_gb: u64,
        context_length: usize,
        prefix_ratio: f64,
        thrash: f64,
    ) -> Result<Self, ConfigError> {
        if !(prefix_ratio > 0.0 && prefix_ratio < 1.0) {
            return Err(ConfigError::Ratio(prefix_ratio));
        }
        if context_length == 0 || thrash.is_nan() || thrash <= 0.0 {
            return Err(ConfigError::NotPositive);
        }
        let prefix_tokens = ((context_length as f64 * prefix_ratio).round() as usize).max(1);
        let suffix = context_length as i64 - prefix_tokens as i64 - BREAKER_TOKENS as i64;
        if suffix < MIN_SUFFIX_TOKENS as i64 {
            return Err(ConfigError::SuffixTooShort(suffix));
        }
        let pool_gb = thrash * OVERFLOW_FACTOR;
        let num_prefixes =
            ((pool_gb * tokens_per_gb as f64 / context_length as f64) as usize).max(1);
        Ok(Self {
            context_length,
            prefix_ratio,
            thrash,
            num_prefixes,
            prefix_tokens,
            suffix_tokens: suffix as usize,
        })
    }
}

/// `prefix-suffix-tuner`.
#[derive(Debug)]
pub struct PrefixSuffixTuner {
    config: PrefixSuffixTunerConfig,
    tokenizer: Option<Arc<ModelTokenizer>>,
    prefixes: Vec<String>,
    suffix: String,
    breaker_rng: SmallRng,
    pass2: usize,
}

/// About `tokens` tokens of random content: random ids decoded, or "hi" filler.
fn random_body(
    tokens: usize,
    tokenizer: Option<&ModelTokenizer>,
    rng: &mut SmallRng,
) -> Result<String, TokenizerError> {
    let Some(t) = tokenizer else { return Ok(vec!["hi"; tokens].join(" ")) };
    let ids: Vec<u32> = (0..tokens).map(|_| rng.gen_range(TOKEN_ID_RANGE)).collect();
    t.decode(&ids)
}

impl PrefixSuffixTuner {
    /// The prefixes and the suffix, generated up front; breakers are drawn per request.
    pub fn new(
        config: PrefixSuffixTunerConfig,
        tokenizer: Option<Arc<ModelTokenizer>>,
        seed: u64,
    ) -> Result<Self, TokenizerError> {
        let body = config.prefix_tokens.saturating_sub(UNIQUE_ID_TOKENS).max(1);
        let prefixes = (0..config.num_prefixes)
            .map(|i| {
                let mut rng = SmallRng::seed_from_u64(seed.wrapping_add(1000 + i as u64));
                Ok(format!("PREFIX_{i:08x} {}", random_body(body, tokenizer.as_deref(), &mut rng)?))
            })
            .collect::<Result<Vec<_>, TokenizerError>>()?;
        let mut rng = SmallRng::seed_from_u64(seed.wrapping_add(1));
        let suffix = format!(
            "SUFFIX {}",
            random_body(
                config.suffix_tokens.saturating_sub(1).max(1),
                tokenizer.as_deref(),
                &mut rng
            )?
        );
        Ok(Self {
            config,
            tokenizer,
            prefixes,
            suffix,
            breaker_rng: SmallRng::seed_from_u64(seed.wrapping_add(2)),
            pass2: 0,
        })
    }

    /// The request for prefix `i`, with a fresh breaker.
    fn messages(&mut self, i: usize) -> Vec<Message> {
        let id: u32 = self.breaker_rng.r#gen();
        let body = random_body(
            BREAKER_TOKENS - UNIQUE_ID_TOKENS,
            self.tokenizer.as_deref(),
            &mut self.breaker_rng,
        )
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e, "decoding a breaker failed; using filler");
            vec!["hi"; BREAKER_TOKENS].join(" ")
        });
        vec![Message::user(format!("{} BR_{id:08x} {body} {}", self.prefixes[i], self.suffix))]
    }
}

impl Workload for PrefixSuffixTuner {
    fn name(&self) -> &'static str {
        "prefix-suffix-tuner"
    }

    fn settings(&self) -> Vec<(&'static str, String)> {
        let c = &self.config;
        vec![
            ("Context length", format!("{} tokens", c.context_length)),
            ("Prefix tokens", format!("{} (ratio={})", c.prefix_tokens, c.prefix_ratio)),
            ("Breaker tokens", format!("{BREAKER_TOKENS} (random per request)")),
            ("Suffix tokens", format!("{} (shared, deterministic)", c.suffix_tokens)),
            (
                "Target tier",
                format!(
                    "{:.2} GB (overflow x{OVERFLOW_FACTOR:.2} = {:.2} GB)",
                    c.thrash,
                    c.thrash * OVERFLOW_FACTOR
                ),
            ),
            ("Prefix pool size", c.num_prefixes.to_string()),
            ("Pool tokens", format!("{:.2}M", (c.num_prefixes * c.prefix_tokens) as f64 / 1e6)),
            ("Total measured", format!("{} requests (pass 2 of 2)", c.num_prefixes)),
            (
                "Tokenizer",
                if self.tokenizer.is_some() { "the model's" } else { "none: filler" }.into(),
            ),
        ]
    }

    fn warmup(&mut self) -> Vec<Job> {
        let mut jobs = vec![Job {
            id: "engine_warmup".into(),
            messages: vec![Message::user("Hello".into())],
            max_tokens: 1,
        }];
        for i in 0..self.config.num_prefixes {
            jobs.push(Job { id: format!("pass1_p{i}"), messages: self.messages(i), max_tokens: 1 });
        }
        jobs
    }

    fn settle(&self) -> Duration {
        SETTLE
    }

    fn next(&mut self, _elapsed: f64, in_flight: usize) -> Next {
        if in_flight > 0 {
            return Next::Wait(Wake::Finished);
        }
        if self.pass2 >= self.config.num_prefixes {
            return Next::Done;
        }
        let i = self.pass2;
        self.pass2 += 1;
        let job = Job { id: format!("pass2_p{i}"), messages: self.messages(i), max_tokens: 1 };
        Next::Send(vec![job], Wake::Finished)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_overflows_the_tier_by_five_percent() {
        let c = PrefixSuffixTunerConfig::resolve(1_000_000, 8000, 0.8, 20.0).unwrap();
        assert_eq!(c.prefix_tokens, 6400);
        assert_eq!(c.suffix_tokens, 8000 - 6400 - 32);
        assert_eq!(c.num_prefixes, (21.0 * 1_000_000.0 / 8000.0) as usize);
        assert_eq!(
            PrefixSuffixTunerConfig::resolve(1, 8000, 0.99, 1.0),
            Err(ConfigError::SuffixTooShort(8000 - 7920 - 32))
        );
        assert_eq!(
            PrefixSuffixTunerConfig::resolve(1, 8000, 1.0, 1.0),
            Err(ConfigError::Ratio(1.0))
        );
        assert_eq!(
            PrefixSuffixTunerConfig::resolve(1, 8000, 0.5, 0.0),
            Err(ConfigError::NotPositive)
        );
        // A tiny tier still makes one prefix.
        assert_eq!(PrefixSuffixTunerConfig::resolve(1, 8000, 0.5, 1.0).unwrap().num_prefixes, 1);
    }

    #[test]
    fn both_passes_send_each_prefix_once_in_order_one_at_a_time_with_fresh_breakers() {
        let c = PrefixSuffixTunerConfig::resolve(10_000, 400, 0.5, 0.1).unwrap();
        assert_eq!(c.num_prefixes, 2);
        let mut w = PrefixSuffixTuner::new(c, None, 42).unwrap();
        let warm = w.warmup();
        let ids: Vec<&str> = warm.iter().map(|j| j.id.as_str()).collect();
        assert_eq!(ids, ["engine_warmup", "pass1_p0", "pass1_p1"]);
        assert_eq!(w.settle(), Duration::from_secs(5));
        let Next::Send(a, Wake::Finished) = w.next(0.0, 0) else { panic!() };
        assert_eq!(a[0].id, "pass2_p0");
        assert_eq!(w.next(0.0, 1), Next::Wait(Wake::Finished), "one at a time");
        let Next::Send(b, _) = w.next(0.0, 0) else { panic!() };
        assert_eq!(b[0].id, "pass2_p1");
        assert_eq!(w.next(0.0, 0), Next::Done);
        // Same prefix and suffix in both passes, another breaker.
        let (p1, p2) = (&warm[1].messages[0].content, &a[0].messages[0].content);
        assert!(p1.starts_with("PREFIX_00000000 hi hi") && p2.starts_with("PREFIX_00000000 hi"));
        let breaker = |s: &str| s.split(" BR_").nth(1).map(|r| r[..8].to_owned());
        assert_ne!(breaker(p1), breaker(p2));
        let suffix = |s: &str| s.split(" SUFFIX ").nth(1).map(str::to_owned);
        assert_eq!(suffix(p1), suffix(p2));
        assert!(warm[2].messages[0].content.starts_with("PREFIX_00000001 "));
    }
}
