//! The ceiling of an fs store or load on this host: the system calls of one, and nothing else.
//!
//! `lmcache bench l2`'s round shape (`--in-flight` writers of `--num-keys` files each, files
//! kept across rounds, MiB/s = a round's payload over the mean round time), with what a store
//! of the `fs` adapter asks of the kernel per file and no more: a `stat` of the final name,
//! `open(O_CREAT | O_EXCL)` of a temporary file beside it in one of 256 shard directories, one
//! write of header and payload, `close`, `rename`. Loads `open`, `fstat` and read each file into
//! buffers made before the clock starts. With `--hash`, each payload is also hashed (xxh3, the
//! adapter's checksum) before its write and as it is read, 256 KiB at a time: the ceiling with
//! the checksum at its hardware speed. No header is built or checked, no runtime schedules
//! anything.
//!
//! `scripts/bench-l2-vs-lmcache` runs it in the same sitting as `lmcache bench l2` (fs_native)
//! and `lmcache-rs bench l2` (fs), so each ratio is against a ceiling measured in that run.
//!
//! `cargo run --release -p lmcache-l2 --example fs_ceiling -- DIR [--num-keys 32]
//! [--in-flight 4] [--data-size-kb 256] [--rounds 5] [--warmup-rounds 1] [--header-bytes N]
//! [--hash]`. Prints one JSON line. DIR must not exist; it is removed at the end.

use std::fs::{File, OpenOptions};
use std::io::{IoSlice, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use lmcache_core::ObjectKey;
use lmcache_l2::blob::PieceHasher;

struct Args {
    dir: PathBuf,
    num_keys: usize,
    in_flight: usize,
    size: usize,
    rounds: usize,
    warmup: usize,
    header: Option<usize>,
    hash: bool,
}

fn args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let dir = PathBuf::from(it.next().ok_or("usage: fs_ceiling DIR [flags]")?);
    let mut a = Args {
        dir,
        num_keys: 32,
        in_flight: 4,
        size: 256 << 10,
        rounds: 5,
        warmup: 1,
        header: None,
        hash: false,
    };
    while let Some(flag) = it.next() {
        if flag == "--hash" {
            a.hash = true;
            continue;
        }
        let v: usize = it
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{flag} needs a number"))?;
        match flag.as_str() {
            "--num-keys" => a.num_keys = v,
            "--in-flight" => a.in_flight = v,
            "--data-size-kb" => a.size = v << 10,
            "--rounds" => a.rounds = v,
            "--warmup-rounds" => a.warmup = v,
            "--header-bytes" => a.header = Some(v),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.num_keys == 0 || a.in_flight == 0 || a.size == 0 || a.rounds == 0 {
        return Err(
            "--num-keys, --in-flight, --data-size-kb and --rounds must be at least 1".into()
        );
    }
    Ok(a)
}

/// File `i` of round `r`: its shard directory and name.
fn path(dir: &Path, r: usize, i: usize) -> (PathBuf, String) {
    let shard = dir.join(format!("{:02x}", (r * 131 + i * 7) % 256));
    (shard, format!("bench-model@0x00000001@0@{r:08x}{i:056x}.data"))
}

fn store_file(dir: &Path, r: usize, i: usize, header: &[u8], payload: &[u8], hash: bool) {
    let (shard, name) = path(dir, r, i);
    let fin = shard.join(&name);
    assert!(!fin.exists(), "{} exists", fin.display());
    if hash {
        let mut h = PieceHasher::new();
        for piece in payload.chunks(PieceHasher::PIECE) {
            h.piece(piece);
        }
        std::hint::black_box(h.finish());
    }
    let tmp = shard.join(format!(".{name}.{i}.tmp"));
    let mut f = OpenOptions::new().write(true).create_new(true).mode(0o644).open(&tmp).unwrap();
    let mut bufs = [IoSlice::new(header), IoSlice::new(payload)];
    let mut slices: &mut [IoSlice<'_>] = &mut bufs;
    while !slices.is_empty() {
        let n = f.write_vectored(slices).unwrap();
        IoSlice::advance_slices(&mut slices, n);
    }
    drop(f);
    std::fs::rename(&tmp, &fin).unwrap();
}

fn load_file(dir: &Path, r: usize, i: usize, header: &mut [u8], dest: &mut [u8], hash: bool) {
    let (shard, name) = path(dir, r, i);
    let mut f = File::open(shard.join(name)).unwrap();
    assert_eq!(f.metadata().unwrap().len() as usize, header.len() + dest.len());
    f.read_exact(header).unwrap();
    if !hash {
        f.read_exact(dest).unwrap();
        return;
    }
    // As the adapter verifies: each piece hashed right after it lands.
    let hash = PieceHasher::fill(dest, |_, piece| f.read_exact(piece)).unwrap();
    std::hint::black_box(hash);
}

/// Mean round time over the measured rounds, in seconds.
fn rounds(a: &Args, mut round: impl FnMut(usize)) -> f64 {
    let mut total = 0.0;
    for r in 0..a.warmup + a.rounds {
        let t = Instant::now();
        round(r);
        if r >= a.warmup {
            total += t.elapsed().as_secs_f64();
        }
    }
    total / a.rounds as f64
}

fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("fs_ceiling: {e}");
            std::process::exit(2);
        }
    };
    std::fs::create_dir(&a.dir).unwrap_or_else(|e| panic!("{}: {e}", a.dir.display()));
    for s in 0..256 {
        std::fs::create_dir(a.dir.join(format!("{s:02x}"))).unwrap();
    }
    let n = a.num_keys * a.in_flight;
    let payloads: Vec<Vec<u8>> =
        (0..n).map(|i| (0..a.size).map(|j| (i * 31 + j) as u8).collect()).collect();
    // The header the adapter writes for `bench l2`'s keys, unless told otherwise.
    let key = ObjectKey::new([0; 32], "bench-model", 1, 0, 0, "").unwrap();
    let header = vec![7u8; a.header.unwrap_or_else(|| lmcache_l2::blob::header_len(&key))];
    let store = rounds(&a, |r| {
        std::thread::scope(|s| {
            for w in 0..a.in_flight {
                let (a, header, payloads) = (&a, &header, &payloads);
                s.spawn(move || {
                    for j in 0..a.num_keys {
                        let i = w * a.num_keys + j;
                        store_file(&a.dir, r, i, header, &payloads[i], a.hash);
                    }
                });
            }
        });
    });
    let mut dests: Vec<(Vec<u8>, Vec<u8>)> =
        (0..n).map(|_| (vec![0u8; header.len()], vec![0u8; a.size])).collect();
    let load = rounds(&a, |r| {
        std::thread::scope(|s| {
            for (w, part) in dests.chunks_mut(a.num_keys).enumerate() {
                let a = &a;
                s.spawn(move || {
                    for (j, (h, d)) in part.iter_mut().enumerate() {
                        load_file(&a.dir, r, w * a.num_keys + j, h, d, a.hash);
                    }
                });
            }
        });
    });
    std::fs::remove_dir_all(&a.dir).unwrap();
    let mib = (n * a.size) as f64 / (1 << 20) as f64;
    println!(
        "{{\"who\": \"fs ceiling{}\", \"store\": {{\"mib_per_s\": {:.1}}}, \"load\": {{\"mib_per_s\": {:.1}}}}}",
        if a.hash { " + xxh3" } else { "" },
        mib / store,
        mib / load
    );
}
