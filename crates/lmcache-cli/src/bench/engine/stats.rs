//! The run's figures, as LMCache's `lmcache bench engine` computes them (its `FinalStats`,
//! field for field, so the JSON documents compare), plus the cache's share: the prompt
//! tokens the engine says its cache served.

use serde::Serialize;

use super::openai::RequestResult;

/// Linear-interpolated percentile of ascending `v`, LMCache's method:
/// `k = (n - 1) * p / 100`, between the ranks either side of `k`.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    match v.len() {
        0 => 0.0,
        1 => v[0],
        n => {
            let k = (n - 1) as f64 * p / 100.0;
            let (lo, hi) = (k.floor() as usize, (k.ceil() as usize).min(n - 1));
            v[lo] + (v[hi] - v[lo]) * (k - lo as f64)
        }
    }
}

/// LMCache's `FinalStats`, then ours.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Summary {
    /// Requests finished, either way.
    pub total_requests: u64,
    /// With content back.
    pub successful_requests: u64,
    /// Without.
    pub failed_requests: u64,
    /// Seconds of the measured run.
    pub elapsed_time: f64,
    /// Mean time to first token, ms.
    pub mean_ttft_ms: f64,
    /// Mean output tokens per second after the first.
    pub mean_decode_speed: f64,
    /// Mean latency, ms.
    pub mean_request_latency_ms: f64,
    /// Prompt tokens per second of the run.
    pub input_throughput: f64,
    /// Output tokens per second of the run.
    pub output_throughput: f64,
    /// Prompt tokens.
    pub total_input_tokens: u64,
    /// Output tokens.
    pub total_output_tokens: u64,
    /// TTFT percentiles, ms.
    pub p50_ttft_ms: f64,
    /// 90th.
    pub p90_ttft_ms: f64,
    /// 99th.
    pub p99_ttft_ms: f64,
    /// Decode speed percentiles.
    pub p50_decode_speed: f64,
    /// 90th.
    pub p90_decode_speed: f64,
    /// 99th.
    pub p99_decode_speed: f64,
    /// Latency percentiles, ms.
    pub p50_request_latency_ms: f64,
    /// 90th.
    pub p90_request_latency_ms: f64,
    /// 99th.
    pub p99_request_latency_ms: f64,
    /// Prompt tokens the engine's cache served (`usage.prompt_tokens_details.cached_tokens`),
    /// over requests that reported it; `None` when none did.
    pub cached_tokens: Option<u64>,
    /// `cached_tokens` over the prompt tokens of the requests that reported it.
    pub engine_cache_hit_rate: Option<f64>,
}

impl Summary {
    /// The figures of `results` over `elapsed` seconds.
    pub fn of(results: &[RequestResult], elapsed: f64) -> Self {
        let ok: Vec<&RequestResult> = results.iter().filter(|r| r.successful).collect();
        let n_ok = ok.len().max(1) as f64;
        let sorted = |f: &dyn Fn(&RequestResult) -> f64| {
            let mut v: Vec<f64> = ok.iter().map(|r| f(r)).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let ttft = sorted(&|r| r.ttft * 1e3);
        let decode = sorted(&|r| r.decode_speed);
        let latency = sorted(&|r| r.request_latency * 1e3);
        let input: u64 = results.iter().map(|r| r.num_input_tokens).sum();
        let output: u64 = results.iter().map(|r| r.num_output_tokens).sum();
        let reporting: Vec<&RequestResult> =
            results.iter().filter(|r| r.cached_tokens.is_some()).collect();
        let cached: Option<u64> =
            (!reporting.is_empty()).then(|| reporting.iter().filter_map(|r| r.cached_tokens).sum());
        let prompt_reporting: u64 = reporting.iter().map(|r| r.num_input_tokens).sum();
        let wall = elapsed.max(1e-9);
        Self {
            total_requests: results.len() as u64,
            successful_requests: ok.len() as u64,
            failed_requests: (results.len() - ok.len()) as u64,
            elapsed_time: elapsed,
            mean_ttft_ms: ttft.iter().sum::<f64>() / n_ok,
            mean_decode_speed: decode.iter().sum::<f64>() / n_ok,
            mean_request_latency_ms: latency.iter().sum::<f64>() / n_ok,
            input_throughput: input as f64 / wall,
            output_throughput: output as f64 / wall,
            total_input_tokens: input,
            total_output_tokens: output,
            p50_ttft_ms: percentile(&ttft, 50.0),
            p90_ttft_ms: percentile(&ttft, 90.0),
            p99_ttft_ms: percentile(&ttft, 99.0),
            p50_decode_speed: percentile(&decode, 50.0),
            p90_decode_speed: percentile(&decode, 90.0),
            p99_decode_speed: percentile(&decode, 99.0),
            p50_request_latency_ms: percentile(&latency, 50.0),
            p90_request_latency_ms: percentile(&latency, 90.0),
            p99_request_latency_ms: percentile(&latency, 99.0),
            cached_tokens: cached,
            engine_cache_hit_rate: cached
                .filter(|_| prompt_reporting > 0)
                .map(|c| c as f64 / prompt_reporting as f64),
        }
    }
}

/// LMCache's `bench_results.csv`: one row per request, its columns, then ours.
pub fn to_csv(results: &[RequestResult]) -> String {
    let mut out = String::from(
        "request_id,successful,ttft,request_latency,num_input_tokens,num_output_tokens,\
         decode_speed,submit_time,first_token_time,finish_time,error,cached_tokens\n",
    );
    for r in results {
        let error = if r.error.contains([',', '"', '\n']) {
            format!("\"{}\"", r.error.replace('"', "\"\""))
        } else {
            r.error.clone()
        };
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{},{},{}\n",
            r.request_id,
            if r.successful { "True" } else { "False" },
            r.ttft,
            r.request_latency,
            r.num_input_tokens,
            r.num_output_tokens,
            r.decode_speed,
            r.submit_time,
            r.first_token_time,
            r.finish_time,
            error,
            r.cached_tokens.map_or(String::new(), |c| c.to_string()),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_as_lmcaches() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 90.0) - 3.7).abs() < 1e-12);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn the_summary_counts_only_successes_in_latencies_and_all_tokens() {
        let ok = |id: &str, ttft: f64, cached: Option<u64>| RequestResult {
            request_id: id.into(),
            successful: true,
            ttft,
            request_latency: ttft + 1.0,
            num_input_tokens: 1000,
            num_output_tokens: 10,
            cached_tokens: cached,
            decode_speed: 10.0,
            ..RequestResult::default()
        };
        let failed =
            RequestResult { request_id: "x".into(), ttft: -1.0, ..RequestResult::default() };
        let s = Summary::of(&[ok("a", 0.1, Some(768)), ok("b", 0.3, Some(0)), failed], 2.0);
        assert_eq!((s.total_requests, s.successful_requests, s.failed_requests), (3, 2, 1));
        assert!((s.mean_ttft_ms - 200.0).abs() < 1e-9);
        assert_eq!(s.total_input_tokens, 2000);
        assert_eq!(s.input_throughput, 1000.0);
        assert_eq!(s.cached_tokens, Some(768));
        assert_eq!(s.engine_cache_hit_rate, Some(768.0 / 2000.0));
        let none = Summary::of(&[ok("c", 0.1, None)], 1.0);
        assert_eq!((none.cached_tokens, none.engine_cache_hit_rate), (None, None));
        assert!(to_csv(&[failed_with("a, b")]).contains("\"a, b\""));
    }

    fn failed_with(e: &str) -> RequestResult {
        RequestResult { error: e.into(), ..RequestResult::default() }
    }
}
