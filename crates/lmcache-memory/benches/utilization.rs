//! Utilization after a long random workload (not a timing: a figure of merit).
//!
//! The workload fills the arena, then for many rounds frees a random share of the live
//! objects and allocates until the first failure. Utilization is allocated / capacity at each
//! failure, averaged over rounds: how much of L1 is really usable before a store must evict.
//! Target: >= 0.95 for uniform chunk sizes.
//!
//! Run: `cargo bench -p lmcache-memory --bench utilization`.

use lmcache_memory::{AllocError, Allocator};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const CAPACITY: u64 = 4 << 30;
const ROUNDS: usize = 2_000;

fn run(name: &str, mut size: impl FnMut(&mut SmallRng) -> u64) {
    let mut rng = SmallRng::seed_from_u64(42);
    let mut a = Allocator::new(CAPACITY, 4096).expect("allocator");
    let mut live = Vec::new();
    let mut samples = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        loop {
            match a.allocate(size(&mut rng)) {
                Ok(b) => live.push(b),
                Err(AllocError::OutOfMemory { .. }) => break,
                Err(e) => panic!("{e}"),
            }
        }
        samples.push(a.allocated_bytes() as f64 / a.capacity() as f64);
        // Free 1-20 % of live objects at random.
        let n = live.len() * rng.gen_range(1..=20) / 100;
        for _ in 0..n.max(1) {
            let i = rng.gen_range(0..live.len());
            a.free(live.swap_remove(i));
        }
    }
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    let min = samples.iter().cloned().fold(f64::INFINITY, f64::min);
    println!("{name:<44} mean {mean:.4}  min {min:.4}  ({ROUNDS} rounds, 4 GiB arena)");
}

fn main() {
    println!("utilization at allocation failure");
    // Llama-3-8B-like chunk: 256 tokens x 128 KiB/token / 32 layers... any fixed size works.
    run("uniform 2 MiB chunks", |_| 2 << 20);
    run("uniform 1.5 MiB + 100 B (unaligned) chunks", |_| (3 << 19) + 100);
    run(
        "two models: 2 MiB and 512 KiB, 50/50",
        |r| if r.gen_bool(0.5) { 2 << 20 } else { 512 << 10 },
    );
    run("mixed 4 KiB .. 4 MiB uniform random", |r| r.gen_range(4096..(4 << 20)));
}
