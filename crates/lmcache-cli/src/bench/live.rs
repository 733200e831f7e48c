//! What the benchmarks measure while they run, shared by `bench server` and `bench l2`:
//!
//! - a [`Tracker`] of timed samples per operation (latency, bytes, ok), safe to fill from
//!   several client threads;
//! - a [`Live`] display on stderr that redraws in place every second (progress, ops/s,
//!   p50/p99 so far, GB/s, errors), off with `-q` or when stderr is not a terminal;
//! - the `--plot` figure (latency histograms, throughput over time) and the `--csv` rows.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// One timed operation.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Seconds since the run started, at the operation's end.
    pub at: f64,
    /// Its latency, milliseconds.
    pub ms: f64,
    /// Bytes it moved.
    pub bytes: u64,
    /// Whether it did what it should.
    pub ok: bool,
}

/// Samples per operation, in a fixed order, and the run's progress.
#[derive(Debug)]
pub struct Tracker {
    started: Instant,
    names: Vec<&'static str>,
    samples: Mutex<Vec<Vec<Sample>>>,
    done: AtomicU64,
    total: Option<u64>,
    unit: &'static str,
}

/// Figures of one operation so far.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct OpFigures {
    /// Operations.
    pub count: u64,
    /// Of them, failed.
    pub errors: u64,
    /// Mean latency, ms.
    pub mean_ms: f64,
    /// Smallest, ms.
    pub min_ms: f64,
    /// Largest, ms.
    pub max_ms: f64,
    /// Median (nearest rank), ms.
    pub p50_ms: f64,
    /// 90th percentile, ms.
    pub p90_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Operations per second of the run so far.
    pub ops_per_s: f64,
    /// Gigabytes (1e9) per second of time spent in it.
    pub gb_per_s: f64,
    /// Bytes moved.
    pub bytes: u64,
}

/// A 30-column progress bar: `[####----] done/total unit` (an empty total shows full).
pub fn bar(done: u64, total: u64, unit: &str) -> String {
    const WIDTH: u64 = 30;
    let filled = (done.min(total) * WIDTH).checked_div(total).unwrap_or(WIDTH) as usize;
    format!("[{}{}] {done}/{total} {unit}", "#".repeat(filled), "-".repeat(WIDTH as usize - filled))
}

/// Nearest-rank percentile (LMCache's benches: `ceil(p * n) - 1`) of ascending `v`.
pub fn nearest_rank(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let idx = ((v.len() as f64 * p).ceil() as usize).saturating_sub(1);
    v[idx.min(v.len() - 1)]
}

impl Tracker {
    /// A tracker of the operations `names`; `total` units of progress (`None`: open-ended),
    /// counted in `unit`s (e.g. "requests").
    pub fn new(names: &[&'static str], total: Option<u64>, unit: &'static str) -> Arc<Self> {
        Arc::new(Self {
            started: Instant::now(),
            names: names.to_vec(),
            samples: Mutex::new(vec![Vec::new(); names.len()]),
            done: AtomicU64::new(0),
            total,
            unit,
        })
    }

    /// The operations' names.
    pub fn names(&self) -> &[&'static str] {
        &self.names
    }

    /// Seconds since the start.
    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Records one operation `op` (an index into the names) that took `ms`.
    pub fn record(&self, op: usize, ms: f64, bytes: u64, ok: bool) {
        let s = Sample { at: self.elapsed(), ms, bytes, ok };
        if let Some(v) = self.samples.lock().get_mut(op) {
            v.push(s);
        }
    }

    /// Times `f` as one operation `op`; `f` returns (bytes moved, ok).
    pub fn time<E>(
        &self,
        op: usize,
        f: impl FnOnce() -> Result<(u64, bool), E>,
    ) -> Result<(u64, bool), E> {
        let t = Instant::now();
        let r = f();
        let ms = t.elapsed().as_secs_f64() * 1e3;
        match &r {
            Ok((bytes, ok)) => self.record(op, ms, *bytes, *ok),
            Err(_) => self.record(op, ms, 0, false),
        }
        r
    }

    /// One more unit of progress done.
    pub fn step(&self) {
        self.done.fetch_add(1, Ordering::Relaxed);
    }

    /// Units done.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// A copy of every sample, per operation.
    pub fn samples(&self) -> Vec<Vec<Sample>> {
        self.samples.lock().clone()
    }

    /// The figures of every operation so far.
    pub fn figures(&self) -> Vec<OpFigures> {
        let wall = self.elapsed().max(1e-9);
        self.samples()
            .iter()
            .map(|v| {
                let mut ms: Vec<f64> = v.iter().map(|s| s.ms).collect();
                ms.sort_by(f64::total_cmp);
                let busy_s: f64 = ms.iter().sum::<f64>() / 1e3;
                let bytes: u64 = v.iter().map(|s| s.bytes).sum();
                OpFigures {
                    count: v.len() as u64,
                    errors: v.iter().filter(|s| !s.ok).count() as u64,
                    mean_ms: if ms.is_empty() {
                        0.0
                    } else {
                        ms.iter().sum::<f64>() / ms.len() as f64
                    },
                    min_ms: ms.first().copied().unwrap_or(0.0),
                    max_ms: ms.last().copied().unwrap_or(0.0),
                    p50_ms: nearest_rank(&ms, 0.50),
                    p90_ms: nearest_rank(&ms, 0.90),
                    p99_ms: nearest_rank(&ms, 0.99),
                    ops_per_s: v.len() as f64 / wall,
                    gb_per_s: if busy_s > 0.0 { bytes as f64 / busy_s / 1e9 } else { 0.0 },
                    bytes,
                }
            })
            .collect()
    }

    /// The live display's lines.
    pub fn screen(&self, title: &str) -> Vec<String> {
        let done = self.done();
        let progress = match self.total {
            Some(t) if t > 0 => bar(done, t, self.unit),
            _ => format!("{done} {}", self.unit),
        };
        let mut lines = vec![format!("{title}  {progress}  {:.1} s", self.elapsed())];
        lines.push(format!(
            "  {:<14}{:>8}{:>9}{:>10}{:>10}{:>9}{:>8}",
            "op", "count", "ops/s", "p50 ms", "p99 ms", "GB/s", "errors"
        ));
        for (name, f) in self.names.iter().zip(self.figures()) {
            lines.push(format!(
                "  {name:<14}{:>8}{:>9.1}{:>10.2}{:>10.2}{:>9.2}{:>8}",
                f.count, f.ops_per_s, f.p50_ms, f.p99_ms, f.gb_per_s, f.errors
            ));
        }
        lines
    }

    /// Per-sample CSV: `op,seq,at_s,latency_ms,bytes,ok`, in time order.
    pub fn to_csv(&self) -> String {
        let mut rows: Vec<(f64, &str, usize, Sample)> = Vec::new();
        for (name, v) in self.names.iter().zip(self.samples()) {
            for (i, s) in v.into_iter().enumerate() {
                rows.push((s.at, name, i, s));
            }
        }
        rows.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut out = String::from("op,seq,at_s,latency_ms,bytes,ok\n");
        for (_, name, i, s) in rows {
            out.push_str(&format!("{name},{i},{:.6},{:.6},{},{}\n", s.at, s.ms, s.bytes, s.ok));
        }
        out
    }
}

/// The in-place display: a thread redrawing the tracker's screen every `period`.
pub struct Live {
    stop: Arc<AtomicBool>,
    join: Option<JoinHandle<()>>,
}

fn draw(out: &mut impl Write, lines: &[String], previous: usize) {
    // Up to the first line of the previous frame, then each line cleared and rewritten.
    if previous > 0 {
        let _ = write!(out, "\x1b[{previous}A");
    }
    for l in lines {
        let _ = write!(out, "\r\x1b[2K{l}\n");
    }
    let _ = out.flush();
}

impl Live {
    /// Starts redrawing `tracker` under `title` every second on stderr, when `on` and stderr
    /// is a terminal; otherwise nothing is drawn.
    pub fn start(tracker: Arc<Tracker>, title: String, on: bool) -> Self {
        Self::start_screen(move || tracker.screen(&title), on)
    }

    /// Starts redrawing whatever `screen` gives every second on stderr, when `on` and stderr
    /// is a terminal; otherwise nothing is drawn.
    pub fn start_screen(screen: impl Fn() -> Vec<String> + Send + 'static, on: bool) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        if !(on && std::io::stderr().is_terminal()) {
            return Self { stop, join: None };
        }
        let flag = Arc::clone(&stop);
        let join = std::thread::Builder::new()
            .name("bench-live".into())
            .spawn(move || {
                let mut shown = 0usize;
                let mut next = Instant::now();
                loop {
                    let last = flag.load(Ordering::Acquire);
                    if last || Instant::now() >= next {
                        let lines = screen();
                        draw(&mut std::io::stderr().lock(), &lines, shown);
                        shown = lines.len();
                        next = Instant::now() + Duration::from_secs(1);
                    }
                    if last {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
            .ok();
        Self { stop, join }
    }

    /// Draws the final frame and stops.
    pub fn finish(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

/// The `--plot` figure: one latency histogram per operation with samples, then throughput
/// (GB/s, per second of the run) and operations per second over time.
pub fn plot(tracker: &Tracker, title: &str, path: &Path) -> anyhow::Result<()> {
    use crate::plot::{Histogram, Lines, Panel};
    let samples = tracker.samples();
    let lat: Vec<(String, Vec<f64>)> = tracker
        .names()
        .iter()
        .zip(&samples)
        .filter(|(_, v)| !v.is_empty())
        .map(|(n, v)| (format!("{n} latency"), v.iter().map(|s| s.ms).collect()))
        .collect();
    let end = samples.iter().flatten().map(|s| s.at).fold(0.0, f64::max);
    let seconds = (end.ceil() as usize).max(1);
    let per_second = |v: &[Sample], f: &dyn Fn(&Sample) -> f64| {
        let mut b = vec![0.0; seconds];
        for s in v {
            b[(s.at as usize).min(seconds - 1)] += f(s);
        }
        b.into_iter().enumerate().map(|(i, x)| (i as f64 + 0.5, x)).collect::<Vec<_>>()
    };
    let moving: Vec<(String, Vec<(f64, f64)>)> = tracker
        .names()
        .iter()
        .zip(&samples)
        .filter(|(_, v)| v.iter().any(|s| s.bytes > 0))
        .map(|(n, v)| ((*n).to_owned(), per_second(v, &|s| s.bytes as f64 / 1e9)))
        .collect();
    let rates: Vec<(String, Vec<(f64, f64)>)> = tracker
        .names()
        .iter()
        .zip(&samples)
        .filter(|(_, v)| !v.is_empty())
        .map(|(n, v)| ((*n).to_owned(), per_second(v, &|_| 1.0)))
        .collect();
    let mut panels: Vec<Panel<'_>> = lat
        .iter()
        .map(|(t, v)| {
            Panel::Histogram(Histogram {
                title: t,
                x_label: "latency (ms)",
                y_label: "operations",
                values: v,
                bins: 40,
                range: None,
                note: Some(format!(
                    "p50 {:.2} ms\np99 {:.2} ms",
                    nearest_rank(&sorted(v), 0.5),
                    nearest_rank(&sorted(v), 0.99)
                )),
            })
        })
        .collect();
    if !moving.is_empty() {
        panels.push(Panel::Lines(Lines {
            title: "throughput over time",
            x_label: "time (s)",
            y_label: "GB/s",
            series: moving,
            log_x: false,
            y_range: None,
            markers: true,
        }));
    }
    panels.push(Panel::Lines(Lines {
        title: "operations per second over time",
        x_label: "time (s)",
        y_label: "ops/s",
        series: rates,
        log_x: false,
        y_range: None,
        markers: true,
    }));
    crate::plot::figure(path, title, 3, (620, 420), &panels)
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_and_screen_follow_the_samples() {
        let t = Tracker::new(&["store", "load"], Some(4), "requests");
        for i in 1..=4 {
            t.record(0, f64::from(i), 1_000_000, true);
            t.step();
        }
        t.record(1, 2.0, 0, false);
        let f = t.figures();
        assert_eq!((f[0].count, f[0].errors, f[1].errors), (4, 0, 1));
        assert_eq!((f[0].p50_ms, f[0].p99_ms, f[0].min_ms), (2.0, 4.0, 1.0));
        // 4 MB over 10 ms of time spent storing.
        assert!((f[0].gb_per_s - 0.4).abs() < 1e-9, "{}", f[0].gb_per_s);
        let s = t.screen("bench");
        assert!(s[0].contains("[##############################] 4/4 requests"), "{}", s[0]);
        assert!(
            s[3].trim_start().starts_with("load") && s[3].trim_end().ends_with('1'),
            "{}",
            s[3]
        );
        let csv = t.to_csv();
        assert!(csv.starts_with("op,seq,at_s,latency_ms,bytes,ok\n"));
        assert_eq!(csv.lines().count(), 6);
    }

    #[test]
    fn frames_redraw_in_place() {
        let mut out = Vec::new();
        draw(&mut out, &["a".into(), "b".into()], 0);
        draw(&mut out, &["c".into(), "d".into()], 2);
        let s = String::from_utf8(out).unwrap();
        assert_eq!(s, "\r\x1b[2Ka\n\r\x1b[2Kb\n\x1b[2A\r\x1b[2Kc\n\r\x1b[2Kd\n");
    }

    #[test]
    fn nearest_rank_is_lmcaches() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!((nearest_rank(&v, 0.5), nearest_rank(&v, 0.99)), (2.0, 4.0));
        assert_eq!(nearest_rank(&[], 0.5), 0.0);
    }
}
