//! The workloads of `lmcache bench engine`, as LMCache 0.5.6 writes its prompts (the same
//! text, so an engine tokenizes them alike) and paces its requests:
//!
//! - `long-doc-qa`: documents of `--ldqa-document-length` tokens ("Document i: hi hi ..."),
//!   as many as `--kv-cache-volume` holds; warmup sends each once; then
//!   `--ldqa-query-per-document` questions about each, shuffled (`random`, seeded) or in
//!   query-major order (`tile`), at most `--ldqa-num-inflight-requests` at once.
//! - `multi-round-chat`: as many users as the volume holds, each a system prompt and a chat
//!   history; warmup says "Hello" once per user; then round-robin queries at `--mrc-qps` for
//!   `--mrc-duration` seconds, one in flight per user, each answer appended to its history.
//! - `random-prefill`: `--rp-num-requests` prompts of `--rp-request-length` tokens, all at
//!   once, one output token each, no warmup.
//!
//! The three that promise exact token lengths use the model's tokenizer
//! ([`super::tokenizer`]), each in its own module: [`long_doc_permutator`],
//! [`prefix_suffix_tuner`], [`rag_qa_quality`].
//!
//! A workload answers "what next?" ([`Workload::next`]); the runner sends, waits and reports
//! each finished request back ([`Workload::finished`]).

pub mod long_doc_permutator;
pub mod prefix_suffix_tuner;
pub mod rag_qa_quality;

use std::path::PathBuf;
use std::time::Duration;

use rand::SeedableRng;
use rand::seq::SliceRandom;
use serde_json::Value;

use super::openai::{Message, RequestResult};

/// One request to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// Its id (LMCache's naming: `doc3_q1`, `s0_r7`, `prefill_12`, `warmup_doc3`).
    pub id: String,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Tokens to generate.
    pub max_tokens: u32,
}

/// When the runner asks again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Wake {
    /// At once.
    Now,
    /// At this many seconds since the measured run began (finished requests are taken in
    /// meanwhile, but the workload is not asked before).
    At(f64),
    /// When a request in flight finishes.
    Finished,
}

/// The workload's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Send these, then wait.
    Send(Vec<Job>, Wake),
    /// Send nothing yet.
    Wait(Wake),
    /// Nothing more will be sent; the run ends when nothing is in flight.
    Done,
}

/// A section a workload adds to the summary (LMCache's `MetricSection`): a key, a label,
/// and (key, label, value) entries.
#[derive(Debug, Clone, PartialEq)]
pub struct Section {
    /// Its key in the JSON document.
    pub key: &'static str,
    /// Its title in the table.
    pub label: &'static str,
    /// Its figures.
    pub entries: Vec<(&'static str, &'static str, Value)>,
}

/// A workload.
pub trait Workload: Send {
    /// Its name (`--workload`).
    fn name(&self) -> &'static str;
    /// Its settings, for the header and the JSON document.
    fn settings(&self) -> Vec<(&'static str, String)>;
    /// Warmup requests, sent one after the other before the measured run.
    fn warmup(&mut self) -> Vec<Job>;
    /// How long to wait after the warmup before measuring (prefix-suffix-tuner lets the
    /// cache's eviction catch up).
    fn settle(&self) -> Duration {
        Duration::ZERO
    }
    /// What to do at `elapsed` seconds into the run with `in_flight` requests out.
    fn next(&mut self, elapsed: f64, in_flight: usize) -> Next;
    /// A measured request finished with this output text.
    fn finished(&mut self, _result: &RequestResult, _output: &str) {}
    /// Sections of its own for the summary (rag-qa-quality's answer quality).
    fn sections(&self) -> Vec<Section> {
        Vec::new()
    }
    /// A results file of its own, written after the run: where, and what.
    fn results_file(&self) -> Option<(PathBuf, Value)> {
        None
    }
}

fn hi_words(n: u64) -> String {
    vec!["hi"; n as usize].join(" ")
}

/// `long-doc-qa`.
#[derive(Debug)]
pub struct LongDocQa {
    documents: Vec<String>,
    schedule: Vec<(usize, u32)>,
    at: usize,
    inflight: usize,
    max_output: u32,
    policy: String,
    document_length: u64,
    queries: u32,
}

const QUESTIONS: [&str; 4] = [
    "What is this document about?",
    "Summarize the key points.",
    "What is the main topic discussed?",
    "Provide a brief overview.",
];

/// `long-doc-qa`'s flags.
#[derive(Debug, Clone, PartialEq)]
pub struct LongDocQaConfig {
    /// Tokens per document.
    pub document_length: u64,
    /// Questions per document.
    pub queries: u32,
    /// `random` or `tile`.
    pub policy: String,
    /// Requests in flight at most.
    pub inflight: usize,
    /// Tokens to generate per question.
    pub max_output: u32,
}

impl LongDocQa {
    /// `num_documents` from the volume: `max(volume * tokens_per_gb / length, 1)`.
    pub fn new(volume_gb: f64, tokens_per_gb: u64, c: LongDocQaConfig, seed: u64) -> Self {
        let LongDocQaConfig { document_length, queries, policy, inflight, max_output } = c;
        let n =
            ((volume_gb * tokens_per_gb as f64 / document_length.max(1) as f64) as usize).max(1);
        let documents = (0..n)
            .map(|i| {
                format!("Document {i}: {}", hi_words(document_length.saturating_sub(10).max(1)))
            })
            .collect();
        let mut schedule: Vec<(usize, u32)> =
            (0..queries).flat_map(|q| (0..n).map(move |d| (d, q))).collect();
        if policy == "random" {
            schedule.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(seed));
        }
        Self {
            documents,
            schedule,
            at: 0,
            inflight: inflight.max(1),
            max_output,
            policy,
            document_length,
            queries,
        }
    }
}

impl Workload for LongDocQa {
    fn name(&self) -> &'static str {
        "long-doc-qa"
    }

    fn settings(&self) -> Vec<(&'static str, String)> {
        vec![
            ("Documents", self.documents.len().to_string()),
            ("Queries/doc", self.queries.to_string()),
            ("Total requests", self.schedule.len().to_string()),
            ("Document length", format!("{} tokens", self.document_length)),
            ("Max inflight", self.inflight.to_string()),
            ("Shuffle policy", self.policy.clone()),
        ]
    }

    fn warmup(&mut self) -> Vec<Job> {
        self.documents
            .iter()
            .enumerate()
            .map(|(i, d)| Job {
                id: format!("warmup_doc{i}"),
                messages: vec![Message::user(d.clone())],
                max_tokens: 1,
            })
            .collect()
    }

    fn next(&mut self, _elapsed: f64, in_flight: usize) -> Next {
        if let Some(&(d, q)) = self.schedule.get(self.at) {
            if in_flight >= self.inflight {
                return Next::Wait(Wake::Finished);
            }
            self.at += 1;
            let question = QUESTIONS[q as usize % QUESTIONS.len()];
            let content = format!("{}\n\nQuestion {q}: {question}", self.documents[d]);
            let job = Job {
                id: format!("doc{d}_q{q}"),
                messages: vec![Message::user(content)],
                max_tokens: self.max_output,
            };
            return Next::Send(vec![job], Wake::Now);
        }
        if in_flight > 0 { Next::Wait(Wake::Finished) } else { Next::Done }
    }
}

/// One user of `multi-round-chat`.
#[derive(Debug)]
struct Session {
    system: String,
    history: String,
    exchanges: Vec<(String, String)>,
    in_flight: Option<String>,
}

impl Session {
    fn messages(&self, query: &str) -> Vec<Message> {
        let mut m = vec![Message { role: "system", content: self.system.clone() }];
        if !self.history.is_empty() {
            m.push(Message::user(self.history.clone()));
            m.push(Message {
                role: "assistant",
                content: "Understood, I have read the context above.".into(),
            });
        }
        for (q, a) in &self.exchanges {
            m.push(Message::user(q.clone()));
            m.push(Message { role: "assistant", content: a.clone() });
        }
        m.push(Message::user(query.to_owned()));
        m
    }
}

/// `multi-round-chat`.
#[derive(Debug)]
pub struct MultiRoundChat {
    sessions: Vec<Session>,
    index: u64,
    interval: f64,
    duration: f64,
    query: String,
    output: u32,
    lengths: (u64, u64, u64),
    qps: f64,
}

/// `multi-round-chat`'s flags.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MultiRoundChatConfig {
    /// System prompt tokens.
    pub shared_prompt: u64,
    /// Pre-filled history tokens.
    pub history: u64,
    /// Tokens per query.
    pub user_input: u64,
    /// Tokens per answer.
    pub output: u32,
    /// Queries per second.
    pub qps: f64,
    /// Seconds of the measured run.
    pub duration: f64,
}

impl MultiRoundChat {
    /// Users from the volume: `max(1, volume * tokens_per_gb / (prompt + history))`.
    pub fn new(volume_gb: f64, tokens_per_gb: u64, c: MultiRoundChatConfig) -> Self {
        let MultiRoundChatConfig { shared_prompt, history, user_input, output, qps, duration } = c;
        let per_session = (shared_prompt + history).max(1) as f64;
        let users = ((volume_gb * tokens_per_gb as f64 / per_session) as usize).max(1);
        let words = |s: &str| s.split_whitespace().count() as u64;
        let sessions = (0..users)
            .map(|i| {
                let prefix = format!("Session {i}. You are a helpful assistant. ");
                let system = format!(
                    "{prefix}{}",
                    vec!["help"; shared_prompt.saturating_sub(words(&prefix)) as usize].join(" ")
                );
                let prefix = format!("[Session {i} history] ");
                let history =
                    format!("{prefix}{}", hi_words(history.saturating_sub(words(&prefix))));
                Session { system, history, exchanges: Vec::new(), in_flight: None }
            })
            .collect();
        Self {
            sessions,
            index: 0,
            interval: 1.0 / qps.max(1e-9),
            duration,
            query: vec!["tell"; user_input.max(1) as usize].join(" "),
            output,
            lengths: (shared_prompt, history, user_input),
            qps,
        }
    }
}

impl Workload for MultiRoundChat {
    fn name(&self) -> &'static str {
        "multi-round-chat"
    }

    fn settings(&self) -> Vec<(&'static str, String)> {
        vec![
            ("Concurrent users", self.sessions.len().to_string()),
            ("Prompt length", format!("{} tokens", self.lengths.0)),
            ("History length", format!("{} tokens", self.lengths.1)),
            ("Query length", format!("{} tokens", self.lengths.2)),
            ("Output length", format!("{} tokens", self.output)),
            ("QPS", self.qps.to_string()),
            ("Duration", format!("{}s", self.duration)),
        ]
    }

    fn warmup(&mut self) -> Vec<Job> {
        self.sessions
            .iter()
            .enumerate()
            .map(|(i, s)| Job {
                id: format!("warmup_s{i}"),
                messages: s.messages("Hello"),
                max_tokens: 1,
            })
            .collect()
    }

    fn next(&mut self, elapsed: f64, in_flight: usize) -> Next {
        if elapsed >= self.duration {
            return if in_flight > 0 { Next::Wait(Wake::Finished) } else { Next::Done };
        }
        let n = self.sessions.len();
        let target = (self.index % n as u64) as usize;
        let session = &mut self.sessions[target];
        if session.in_flight.is_some() {
            return Next::Wait(Wake::At(elapsed + 0.01));
        }
        let id = format!("s{target}_r{}", self.index);
        let job = Job {
            id: id.clone(),
            messages: session.messages(&self.query),
            max_tokens: self.output,
        };
        session.in_flight = Some(id);
        self.index += 1;
        Next::Send(vec![job], Wake::At(self.index as f64 * self.interval))
    }

    fn finished(&mut self, result: &RequestResult, output: &str) {
        let query = self.query.clone();
        let id = result.request_id.as_str();
        if let Some(s) = self.sessions.iter_mut().find(|s| s.in_flight.as_deref() == Some(id)) {
            s.exchanges.push((query, output.to_owned()));
            s.in_flight = None;
        }
    }
}

/// `random-prefill`.
#[derive(Debug)]
pub struct RandomPrefill {
    prompts: Vec<String>,
    sent: bool,
    length: u64,
}

impl RandomPrefill {
    /// `num` prompts of about `length` tokens.
    pub fn new(length: u64, num: usize) -> Self {
        let prompts = (0..num.max(1))
            .map(|i| format!("Request {i}: {}", hi_words(length.saturating_sub(10).max(1))))
            .collect();
        Self { prompts, sent: false, length }
    }
}

impl Workload for RandomPrefill {
    fn name(&self) -> &'static str {
        "random-prefill"
    }

    fn settings(&self) -> Vec<(&'static str, String)> {
        vec![
            ("Requests", self.prompts.len().to_string()),
            ("Request length", format!("{} tokens", self.length)),
            ("Max output", "1 token".into()),
        ]
    }

    fn warmup(&mut self) -> Vec<Job> {
        Vec::new()
    }

    fn next(&mut self, _elapsed: f64, in_flight: usize) -> Next {
        if !self.sent {
            self.sent = true;
            let jobs = self
                .prompts
                .iter()
                .enumerate()
                .map(|(i, p)| Job {
                    id: format!("prefill_{i}"),
                    messages: vec![Message::user(p.clone())],
                    max_tokens: 1,
                })
                .collect();
            return Next::Send(jobs, Wake::Finished);
        }
        if in_flight > 0 { Next::Wait(Wake::Finished) } else { Next::Done }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_doc_qa_sends_every_question_once_within_its_inflight_limit() {
        let cfg = |length, policy: &str, inflight| LongDocQaConfig {
            document_length: length,
            queries: 2,
            policy: policy.into(),
            inflight,
            max_output: 16,
        };
        let mut w = LongDocQa::new(0.01, 1_000_000, cfg(2000, "random", 3), 42);
        assert_eq!(w.documents.len(), 5);
        assert_eq!(w.warmup().len(), 5);
        assert!(w.documents[0].starts_with("Document 0: hi hi"));
        assert_eq!(w.documents[0].split(' ').count(), 2 + 1990);
        let mut ids = Vec::new();
        let mut in_flight = 0;
        loop {
            match w.next(0.0, in_flight) {
                Next::Send(jobs, _) => {
                    in_flight += jobs.len();
                    assert!(in_flight <= 3);
                    ids.extend(jobs.into_iter().map(|j| j.id));
                }
                Next::Wait(Wake::Finished) => in_flight -= 1,
                Next::Wait(other) => panic!("{other:?}"),
                Next::Done => break,
            }
        }
        ids.sort();
        let mut want: Vec<String> =
            (0..5).flat_map(|d| (0..2).map(move |q| format!("doc{d}_q{q}"))).collect();
        want.sort();
        assert_eq!(ids, want);
        // Tile: query-major order.
        let mut t = LongDocQa::new(0.01, 1_000_000, cfg(5000, "tile", 9), 42);
        let Next::Send(first, _) = t.next(0.0, 0) else { panic!() };
        let Next::Send(second, _) = t.next(0.0, 1) else { panic!() };
        assert_eq!((first[0].id.as_str(), second[0].id.as_str()), ("doc0_q0", "doc1_q0"));
        assert!(first[0].messages[0].content.ends_with("Question 0: What is this document about?"));
    }

    #[test]
    fn multi_round_chat_keeps_one_request_per_user_and_grows_its_history() {
        let cfg = MultiRoundChatConfig {
            shared_prompt: 200,
            history: 300,
            user_input: 5,
            output: 8,
            qps: 10.0,
            duration: 1.0,
        };
        let mut w = MultiRoundChat::new(0.001, 1_000_000, cfg);
        assert_eq!(w.sessions.len(), 2);
        let Next::Send(a, Wake::At(t)) = w.next(0.0, 0) else { panic!() };
        assert!((t - 0.1).abs() < 1e-9);
        assert_eq!(a[0].id, "s0_r0");
        assert_eq!(a[0].messages.len(), 4, "system, history, its ack, the query");
        let Next::Send(b, _) = w.next(0.1, 1) else { panic!() };
        assert_eq!(b[0].id, "s1_r1");
        // User 0 is still out: wait.
        let Next::Wait(Wake::At(t)) = w.next(0.2, 2) else { panic!("user 0 is busy") };
        assert!((t - 0.21).abs() < 1e-9);
        let done = RequestResult { request_id: "s0_r0".into(), ..RequestResult::default() };
        w.finished(&done, " hi hi");
        let Next::Send(c, _) = w.next(0.2, 1) else { panic!() };
        assert_eq!(c[0].id, "s0_r2");
        assert_eq!(c[0].messages.len(), 6, "the first exchange is part of the history");
        assert_eq!(c[0].messages[4].content, " hi hi");
        assert_eq!(w.next(1.0, 0), Next::Done);
        assert!(w.sessions[0].system.starts_with("Session 0. You are a helpful assistant. help"));
        assert_eq!(w.sessions[0].system.split_whitespace().count(), 200);
    }

    #[test]
    fn random_prefill_sends_everything_at_once() {
        let mut w = RandomPrefill::new(100, 4);
        assert!(w.warmup().is_empty());
        let Next::Send(jobs, _) = w.next(0.0, 0) else { panic!() };
        assert_eq!(jobs.len(), 4);
        assert!(jobs.iter().all(|j| j.max_tokens == 1));
        assert_eq!(w.next(0.0, 4), Next::Wait(Wake::Finished));
        assert_eq!(w.next(0.0, 0), Next::Done);
    }
}
