//! The cache simulator on a lookup-hash log: the one-pass sweep over N capacities against one
//! LMCache-style replay per capacity, same events, same process.
//!
//! `cargo bench -p lmcache-workload --bench sweep -- LOG.jsonl [points] [replays]`
//! (defaults 100 points; 3 replays timed, scaled to the points). Logs: tests/interop/gen_lookup_log.py.

use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let Some(path) = args.first() else {
        eprintln!("usage: sweep LOG.jsonl [points] [replays]");
        std::process::exit(2);
    };
    let points: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(100);
    let replays: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    let t = Instant::now();
    let text = std::fs::read_to_string(path).expect("read the log");
    let events = lmcache_workload::parse_lines(path, &text, None).expect("parse the log");
    let parse_s = t.elapsed().as_secs_f64();
    let bpc = 32u64 << 20;
    let caps = lmcache_workload::capacity_range_bytes(0.5, 500.0, points);
    let chunks: Vec<u64> = caps.iter().map(|&b| (b / bpc).max(1)).collect();
    let t = Instant::now();
    let rates = lmcache_workload::sweep(&events, &chunks);
    let sweep_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let step = (caps.len() / replays.max(1)).max(1);
    let mut checked = 0;
    for (i, &c) in caps.iter().enumerate().step_by(step).take(replays) {
        let r = lmcache_workload::simulate(&events, c, bpc).token_hit_rate();
        assert!((r - rates[i]).abs() < 1e-12, "capacity {c}: sweep {} replay {r}", rates[i]);
        checked += 1;
    }
    let replay_s = t.elapsed().as_secs_f64() / checked as f64;
    println!(
        "{} requests: parse {parse_s:.2} s; sweep of {} capacities in one pass {sweep_s:.3} s; one replay {replay_s:.3} s (x{} = {:.1} s); hit rate {:.2}% .. {:.2}%",
        events.len(),
        caps.len(),
        caps.len(),
        replay_s * caps.len() as f64,
        rates.first().copied().unwrap_or(0.0) * 100.0,
        rates.last().copied().unwrap_or(0.0) * 100.0
    );
}
