//! Per-operation latency of a replay, summed up as LMCache's `trace replay` does (count,
//! errors, mean, p50/p90/p99 by its index rule, min, max), with its CSV and JSON files.

use std::collections::BTreeMap;

/// One operation's figures (milliseconds).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OpStats {
    /// Successful calls.
    pub count: u64,
    /// Calls that failed (no latency sample, as LMCache counts them).
    pub errors: u64,
    /// Mean latency.
    pub mean_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Smallest.
    pub min_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

/// Latency samples per qualname.
#[derive(Debug, Clone, Default)]
pub struct ReplayStats {
    samples: BTreeMap<String, (Vec<f64>, u64)>,
}

/// The `pct` percentile of ascending `sorted` by LMCache's rule: the sample at index
/// `int(pct / 100 * n)`, clamped; 0 for none.
pub fn percentile(sorted: &[f64], pct: f64) -> f64 {
    let Some(&last) = sorted.last() else { return 0.0 };
    if pct <= 0.0 {
        return sorted[0];
    }
    if pct >= 100.0 {
        return last;
    }
    let idx = ((pct / 100.0) * sorted.len() as f64) as usize;
    sorted[idx.min(sorted.len() - 1)]
}

impl ReplayStats {
    /// Records one call of `qualname` that took `latency_s` (a failed one only counts).
    pub fn record(&mut self, qualname: &str, latency_s: f64, failed: bool) {
        let e = self.samples.entry(qualname.to_owned()).or_default();
        if failed {
            e.1 += 1;
        } else {
            e.0.push(latency_s * 1000.0);
        }
    }

    /// The figures per qualname.
    pub fn summary(&self) -> BTreeMap<String, OpStats> {
        self.samples
            .iter()
            .map(|(q, (lat, errors))| {
                let mut v = lat.clone();
                v.sort_by(f64::total_cmp);
                let mean = if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
                (
                    q.clone(),
                    OpStats {
                        count: v.len() as u64,
                        errors: *errors,
                        mean_ms: mean,
                        p50_ms: percentile(&v, 50.0),
                        p90_ms: percentile(&v, 90.0),
                        p99_ms: percentile(&v, 99.0),
                        min_ms: v.first().copied().unwrap_or(0.0),
                        max_ms: v.last().copied().unwrap_or(0.0),
                    },
                )
            })
            .collect()
    }

    /// LMCache's `trace_replay_ops.csv`.
    pub fn to_csv(&self) -> String {
        let mut out =
            String::from("qualname,count,errors,mean_ms,p50_ms,p90_ms,p99_ms,min_ms,max_ms\r\n");
        for (q, s) in self.summary() {
            out.push_str(&format!(
                "{q},{},{},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6}\r\n",
                s.count, s.errors, s.mean_ms, s.p50_ms, s.p90_ms, s.p99_ms, s.min_ms, s.max_ms
            ));
        }
        out
    }

    /// LMCache's `trace_replay_summary.json`.
    pub fn to_json(&self, duration_s: f64) -> serde_json::Value {
        serde_json::json!({ "duration_s": duration_s, "ops": self.summary() })
    }
}

/// LMCache's short label of a qualname: the method name, or `method.enter` / `method.exit`
/// for a context manager's two halves.
pub fn short_op_name(qualname: &str) -> String {
    let parts: Vec<&str> = qualname.split('.').collect();
    match parts.as_slice() {
        [.., owner, last @ ("__enter__" | "__exit__")] => {
            format!("{owner}.{}", last.trim_matches('_'))
        }
        [.., last] => (*last).to_owned(),
        [] => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_follow_lmcaches_index_rule() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 6.0);
        assert_eq!(percentile(&v, 90.0), 10.0);
        assert_eq!(percentile(&v, 99.0), 10.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
        assert_eq!(percentile(&[3.0], 0.0), 3.0);
    }

    #[test]
    fn failures_count_without_a_sample_and_files_have_lmcaches_columns() {
        let mut s = ReplayStats::default();
        s.record("a.b.reserve_write", 0.002, false);
        s.record("a.b.reserve_write", 0.004, false);
        s.record("a.b.reserve_write", 9.0, true);
        let sum = s.summary();
        let r = &sum["a.b.reserve_write"];
        assert_eq!((r.count, r.errors), (2, 1));
        assert!((r.mean_ms - 3.0).abs() < 1e-9);
        assert!(
            s.to_csv().starts_with(
                "qualname,count,errors,mean_ms,p50_ms,p90_ms,p99_ms,min_ms,max_ms\r\n"
            )
        );
        assert!(s.to_csv().contains("a.b.reserve_write,2,1,3.000000,4.000000,"));
        assert_eq!(s.to_json(1.5)["ops"]["a.b.reserve_write"]["count"], 2);
    }

    #[test]
    fn short_names() {
        assert_eq!(
            short_op_name("x.StorageManager.read_prefetched_results.__enter__"),
            "read_prefetched_results.enter"
        );
        assert_eq!(short_op_name("x.StorageManager.reserve_write"), "reserve_write");
    }
}
