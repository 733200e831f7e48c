//! The physical floor for KV transfers: a plain single-threaded memcpy of N bytes (default
//! 64 MiB, one `lmcache bench server` store), between two already-touched buffers.
//! Prints `p50_ms=...` over 30 runs. Run: `cargo bench -p lmcache-memory --bench memcpy -- 67108864`.

fn main() {
    let n: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(64 << 20);
    let src = vec![7u8; n];
    let mut dst = vec![1u8; n];
    let mut times = Vec::new();
    for _ in 0..30 {
        let t = std::time::Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    println!("bytes={n} p50_ms={:.3} min_ms={:.3}", times[times.len() / 2], times[0]);
}
