//! One streaming request to an OpenAI-compatible engine (`/v1/chat/completions`, or
//! `/v1/completions` with `--completions`), timed as LMCache's `lmcache bench engine` times it:
//! TTFT from submission to the first content, decode speed over the tokens after it, latency
//! to the stream's end; token counts from the usage chunk (`stream_options.include_usage`),
//! and the prompt tokens the engine's prefix cache served
//! (`usage.prompt_tokens_details.cached_tokens`, as vLLM reports them).

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

/// A chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: &'static str,
    /// Its text.
    pub content: String,
}

impl Message {
    /// A user message.
    pub fn user(content: String) -> Self {
        Self { role: "user", content }
    }
}

/// What one request measured (LMCache's `RequestResult`, plus the cached tokens).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestResult {
    /// The workload's id of it.
    pub request_id: String,
    /// Whether any content came back.
    pub successful: bool,
    /// Seconds to the first content (-1 when none).
    pub ttft: f64,
    /// Seconds to the end of the stream.
    pub request_latency: f64,
    /// Prompt tokens (the engine's count).
    pub num_input_tokens: u64,
    /// Generated tokens.
    pub num_output_tokens: u64,
    /// Prompt tokens the engine's cache served; `None` when the engine does not say.
    pub cached_tokens: Option<u64>,
    /// Output tokens per second after the first.
    pub decode_speed: f64,
    /// Unix seconds: submitted, first content, finished.
    pub submit_time: f64,
    /// Unix seconds of the first content (0 when none).
    pub first_token_time: f64,
    /// Unix seconds of the end.
    pub finish_time: f64,
    /// Why it failed, empty when it did not.
    pub error: String,
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// `engine_url` with a scheme and ending in `/v1`, as LMCache normalizes it.
pub fn normalize_url(engine_url: &str) -> String {
    let mut url = engine_url.trim_end_matches('/').to_owned();
    if !url.starts_with("http://") && !url.starts_with("https://") {
        url = format!("http://{url}");
    }
    if !url.ends_with("/v1") {
        url.push_str("/v1");
    }
    url
}

/// Sends requests to one engine.
#[derive(Clone)]
pub struct Sender {
    agent: ureq::Agent,
    base: String,
    model: String,
    completions: bool,
    ignore_eos: bool,
    api_key: String,
    extra_body: serde_json::Map<String, Value>,
}

/// The API key: `OPENAI_API_KEY`, else a dummy one (as LMCache's).
pub fn api_key() -> String {
    std::env::var("OPENAI_API_KEY")
        .ok()
        .filter(|k| !k.is_empty())
        .unwrap_or_else(|| "sk-dummy".into())
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sender").field("base", &self.base).field("model", &self.model).finish()
    }
}

/// The content of one streamed chunk, if any (chat: `delta.content`, else the reasoning
/// fields; completions: `text`).
fn content(chunk: &Value, completions: bool) -> Option<&str> {
    let choice = chunk.get("choices")?.get(0)?;
    if completions {
        return choice.get("text")?.as_str().filter(|s| !s.is_empty());
    }
    let delta = choice.get("delta")?;
    ["content", "reasoning_content", "reasoning"]
        .iter()
        .find_map(|k| delta.get(*k).and_then(Value::as_str))
        .filter(|s| !s.is_empty())
}

impl Sender {
    /// A sender to `engine_url` for `model`. The API key is `OPENAI_API_KEY`, else a dummy one
    /// (as LMCache's).
    pub fn new(engine_url: &str, model: &str, completions: bool, ignore_eos: bool) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_connect(Some(Duration::from_secs(10)))
            .http_status_as_error(false)
            .build()
            .into();
        Self {
            agent,
            base: normalize_url(engine_url),
            model: model.to_owned(),
            completions,
            ignore_eos,
            api_key: api_key(),
            extra_body: serde_json::Map::new(),
        }
    }

    /// Fields merged into every request body (rag-qa-quality's `chat_template_kwargs`).
    pub fn with_extra_body(mut self, extra: serde_json::Map<String, Value>) -> Self {
        self.extra_body = extra;
        self
    }

    fn body(&self, messages: &[Message], max_tokens: u32) -> Value {
        let mut body = if self.completions {
            let prompt: String = messages.iter().map(|m| m.content.as_str()).collect();
            json!({"model": self.model, "prompt": prompt, "max_tokens": max_tokens})
        } else {
            let msgs: Vec<Value> =
                messages.iter().map(|m| json!({"role": m.role, "content": m.content})).collect();
            json!({"model": self.model, "messages": msgs, "max_tokens": max_tokens})
        };
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        if self.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        for (k, v) in &self.extra_body {
            body[k] = v.clone();
        }
        body
    }

    /// Sends one streaming request and measures it. Never fails: a failure is a result
    /// with `successful` false and the error.
    pub fn send(
        &self,
        request_id: &str,
        messages: &[Message],
        max_tokens: u32,
    ) -> (RequestResult, String) {
        let submit = unix_now();
        let started = Instant::now();
        let mut r = RequestResult {
            request_id: request_id.to_owned(),
            ttft: -1.0,
            submit_time: submit,
            ..RequestResult::default()
        };
        let mut text = String::new();
        let path = if self.completions { "completions" } else { "chat/completions" };
        let outcome = (|| -> anyhow::Result<()> {
            let resp = self
                .agent
                .post(&format!("{}/{path}", self.base))
                .header("Authorization", &format!("Bearer {}", self.api_key))
                .send_json(self.body(messages, max_tokens))?;
            let status = resp.status();
            let mut lines = BufReader::new(resp.into_body().into_reader());
            if !status.is_success() {
                let mut body = String::new();
                let _ = std::io::Read::read_to_string(&mut lines, &mut body);
                anyhow::bail!("HTTP {}: {}", status.as_u16(), body.trim());
            }
            let (mut first_chunk, mut first_token) = (None::<f64>, None::<f64>);
            let mut chunks = 0u64;
            let mut line = String::new();
            loop {
                line.clear();
                if lines.read_line(&mut line)? == 0 {
                    break;
                }
                let Some(data) = line.trim_end().strip_prefix("data:") else { continue };
                let data = data.trim_start();
                if data == "[DONE]" {
                    break;
                }
                let Ok(chunk) = serde_json::from_str::<Value>(data) else { continue };
                let now = started.elapsed().as_secs_f64();
                first_chunk.get_or_insert(now);
                if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
                    let n = |k: &str| u.get(k).and_then(Value::as_u64).filter(|&n| n > 0);
                    if let Some(p) = n("prompt_tokens") {
                        r.num_input_tokens = p;
                    }
                    if let Some(c) = n("completion_tokens") {
                        r.num_output_tokens = c;
                    }
                    if let Some(c) = u
                        .get("prompt_tokens_details")
                        .and_then(|d| d.get("cached_tokens"))
                        .and_then(Value::as_u64)
                    {
                        r.cached_tokens = Some(c);
                    }
                }
                if let Some(c) = content(&chunk, self.completions) {
                    first_token.get_or_insert(now);
                    chunks += 1;
                    text.push_str(c);
                }
            }
            let finish = started.elapsed().as_secs_f64();
            let first = first_token.or(if r.num_output_tokens > 0 {
                first_chunk.or(Some(finish))
            } else {
                None
            });
            r.request_latency = finish;
            r.finish_time = submit + finish;
            if r.num_output_tokens == 0 {
                r.num_output_tokens = chunks;
            }
            if let Some(first) = first {
                r.successful = true;
                r.ttft = first;
                r.first_token_time = submit + first;
                let decode = finish - first;
                if decode > 0.0 {
                    r.decode_speed = r.num_output_tokens as f64 / decode;
                }
            } else {
                r.error = "no content in the stream".into();
            }
            Ok(())
        })();
        if let Err(e) = outcome {
            r.successful = false;
            r.ttft = -1.0;
            r.request_latency = started.elapsed().as_secs_f64();
            r.finish_time = submit + r.request_latency;
            r.error = format!("{e:#}");
        }
        (r, text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_normalized_as_lmcache_does() {
        assert_eq!(normalize_url("localhost:8000"), "http://localhost:8000/v1");
        assert_eq!(normalize_url("http://h:1/v1/"), "http://h:1/v1");
        assert_eq!(normalize_url("https://h/"), "https://h/v1");
    }

    #[test]
    fn content_is_read_from_chat_and_completion_chunks() {
        let chat = json!({"choices": [{"delta": {"content": " hi"}}]});
        assert_eq!(content(&chat, false), Some(" hi"));
        let reasoning = json!({"choices": [{"delta": {"reasoning_content": "r"}}]});
        assert_eq!(content(&reasoning, false), Some("r"));
        let role_only = json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]});
        assert_eq!(content(&role_only, false), None);
        assert_eq!(content(&json!({"choices": [{"text": "x"}]}), true), Some("x"));
        assert_eq!(content(&json!({"choices": [], "usage": {}}), false), None);
    }
}
