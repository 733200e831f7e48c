//! The ceiling of an fs store or load on this host: the system calls of one, and nothing else.
//!
//! `lmcache bench l2`'s round shape (`--in-flight` writers of `--num-keys` files each, files
//! kept across rounds, MiB/s = a round's payload over the mean round time), with what a store
//! of the `fs` adapter asks of the kernel per file and no more: a `stat` of the final name,
//! `open(O_CREAT | O_EXCL)` of a temporary file beside it in one of 256 shard directories, one
//! write of header and payload (the adapter writes 256 KiB pieces, then the header:
//! `--store-piece-kb 256`), `close`, `rename`. Loads `open`, `fstat` and read each file into
//! buffers made before the clock starts. With `--hash`, each payload is also hashed (xxh3, the
//! adapter's checksum) before its write and as it is read, 256 KiB at a time: the ceiling with
//! the checksum at its hardware speed. No header is built or checked, no runtime schedules
//! anything.
//!
//! `scripts/bench-l2-vs-lmcache` runs it in the same sitting as `lmcache bench l2` (fs_native)
//! and `lmcache-rs bench l2` (fs), so each ratio is against a ceiling measured in that run.
//!
//! `--io` picks how the kernel is asked, to see what would move the ceiling itself (issue 24
//! §4: O_DIRECT, preallocated files, io_uring):
//! - `buffered` (the default): what the `fs` adapter does, as above;
//! - `prealloc`: the same, with the file's blocks reserved (`fallocate`) before its write;
//! - `direct`: O_DIRECT for stores and loads, from and into 4 KiB-aligned buffers, the header
//!   padded to a 4 KiB block of its own so the payload needs no copy (payloads must be whole
//!   4 KiB blocks);
//! - `uring`: one io_uring per writer or reader, all its files submitted at once, each file a
//!   linked chain (open into a registered file slot, write header, write payload, close,
//!   rename; loads: open, read header, read payload, close), one system call per round and
//!   thread instead of five per file. A store's chain starts with `statx` of the final name.
//!
//! `--store-piece-kb N` writes the payload in `pwrite`s of N KiB, each piece hashed just
//! before (with `--hash`), then the header: what the adapter does when the header is not sealed
//! yet, as in `bench l2`. `--dest-offset N` starts each load destination N bytes past a page
//! boundary, as `malloc` places large buffers.
//!
//! `cargo run --release -p lmcache-l2 --example fs_ceiling -- DIR [--num-keys 32]
//! [--in-flight 4] [--data-size-kb 256] [--rounds 5] [--warmup-rounds 1] [--header-bytes N]
//! [--hash] [--io buffered|prealloc|direct|uring] [--store-piece-kb N] [--dest-offset N]`.
//! Prints one JSON line. DIR must not exist; it is removed at the end.

use std::fs::OpenOptions;
use std::io::{IoSlice, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use lmcache_core::ObjectKey;
use lmcache_l2::blob::PieceHasher;

/// How files are written and read; see the module docs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Io {
    Buffered,
    Prealloc,
    Direct,
    Uring,
}

impl Io {
    fn name(self) -> &'static str {
        match self {
            Io::Buffered => "buffered",
            Io::Prealloc => "prealloc",
            Io::Direct => "direct",
            Io::Uring => "uring",
        }
    }
}

struct Args {
    dir: PathBuf,
    num_keys: usize,
    in_flight: usize,
    size: usize,
    rounds: usize,
    warmup: usize,
    header: Option<usize>,
    hash: bool,
    io: Io,
    /// Stores write the payload in pieces of this many bytes (`pwrite` each, hashed just
    /// before), as the adapter does when the header is not sealed yet; 0: one `writev`.
    store_piece: usize,
    /// Load destinations start this many bytes past a 4 KiB boundary.
    dest_offset: usize,
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
        io: Io::Buffered,
        store_piece: 0,
        dest_offset: 0,
    };
    while let Some(flag) = it.next() {
        if flag == "--hash" {
            a.hash = true;
            continue;
        }
        if flag == "--io" {
            let v = it.next().unwrap_or_default();
            a.io = [Io::Buffered, Io::Prealloc, Io::Direct, Io::Uring]
                .into_iter()
                .find(|io| io.name() == v)
                .ok_or_else(|| format!("--io {v:?}: one of buffered, prealloc, direct, uring"))?;
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
            "--store-piece-kb" => a.store_piece = v << 10,
            "--dest-offset" => a.dest_offset = v % BLOCK,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.num_keys == 0 || a.in_flight == 0 || a.size == 0 || a.rounds == 0 {
        return Err(
            "--num-keys, --in-flight, --data-size-kb and --rounds must be at least 1".into()
        );
    }
    if a.io == Io::Uring && a.store_piece > 0 {
        return Err("--store-piece-kb: not with --io uring (one write per file there)".into());
    }
    if a.io == Io::Direct && (a.size % BLOCK != 0 || a.store_piece % BLOCK != 0) {
        return Err(format!("--io direct needs a payload and pieces of whole {BLOCK}-byte blocks"));
    }
    Ok(a)
}

/// O_DIRECT's alignment (of buffers, offsets and lengths) used here.
const BLOCK: usize = 4096;

/// A zeroed buffer of `len` bytes whose start is `BLOCK`-aligned, in safe code: a longer
/// vector and the offset of its first aligned byte.
struct Aligned {
    buf: Vec<u8>,
    at: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Self {
        Self::past_boundary(len, 0)
    }

    /// `len` bytes starting `offset` bytes past a `BLOCK` boundary (`offset < BLOCK`).
    fn past_boundary(len: usize, offset: usize) -> Self {
        let buf = vec![0u8; len + offset + BLOCK];
        let at = buf.as_ptr().align_offset(BLOCK) + offset;
        Self { buf, at, len }
    }

    fn get(&self) -> &[u8] {
        &self.buf[self.at..self.at + self.len]
    }

    fn get_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.at..self.at + self.len]
    }
}

/// File `i` of round `r`: its shard directory and name.
fn path(dir: &Path, r: usize, i: usize) -> (PathBuf, String) {
    let shard = dir.join(format!("{:02x}", (r * 131 + i * 7) % 256));
    (shard, format!("bench-model@0x00000001@0@{r:08x}{i:056x}.data"))
}

fn hash_all(payload: &[u8]) {
    let mut h = PieceHasher::new();
    for piece in payload.chunks(PieceHasher::PIECE) {
        h.piece(piece);
    }
    std::hint::black_box(h.finish());
}

fn store_file(dir: &Path, r: usize, i: usize, header: &[u8], payload: &[u8], a: &Args) {
    let (shard, name) = path(dir, r, i);
    let fin = shard.join(&name);
    assert!(!fin.exists(), "{} exists", fin.display());
    if a.hash && a.store_piece == 0 {
        hash_all(payload);
    }
    let tmp = shard.join(format!(".{name}.{i}.tmp"));
    let mut opts = OpenOptions::new();
    opts.write(true).create_new(true).mode(0o644);
    if a.io == Io::Direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let mut f = opts.open(&tmp).unwrap();
    if a.io == Io::Prealloc {
        let len = (header.len() + payload.len()) as i64;
        nix::fcntl::fallocate(f.as_raw_fd(), nix::fcntl::FallocateFlags::empty(), 0, len).unwrap();
    }
    if a.store_piece > 0 {
        let mut h = PieceHasher::new();
        let mut at = header.len() as u64;
        for piece in payload.chunks(a.store_piece) {
            if a.hash {
                for p in piece.chunks(PieceHasher::PIECE) {
                    h.piece(p);
                }
            }
            f.write_all_at(piece, at).unwrap();
            at += piece.len() as u64;
        }
        std::hint::black_box(h.finish());
        f.write_all_at(header, 0).unwrap();
    } else {
        let mut bufs = [IoSlice::new(header), IoSlice::new(payload)];
        let mut slices: &mut [IoSlice<'_>] = &mut bufs;
        while !slices.is_empty() {
            let n = f.write_vectored(slices).unwrap();
            IoSlice::advance_slices(&mut slices, n);
        }
    }
    drop(f);
    std::fs::rename(&tmp, &fin).unwrap();
}

fn load_file(dir: &Path, r: usize, i: usize, header: &mut [u8], dest: &mut [u8], a: &Args) {
    let (shard, name) = path(dir, r, i);
    let mut opts = OpenOptions::new();
    opts.read(true);
    if a.io == Io::Direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let mut f = opts.open(shard.join(name)).unwrap();
    assert_eq!(f.metadata().unwrap().len() as usize, header.len() + dest.len());
    f.read_exact(header).unwrap();
    if !a.hash {
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

/// The `uring` mode's stores and loads.
mod uring {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::path::{Path, PathBuf};

    use io_uring::{IoUring, opcode, squeue, types};

    fn c(p: &Path) -> CString {
        CString::new(p.as_os_str().as_bytes()).unwrap()
    }

    /// Submits `entries` and waits for all their completions; panics on any failure, except
    /// that a `statx` (user data with the top bit set) must fail with ENOENT.
    fn run(ring: &mut IoUring, entries: &[squeue::Entry]) {
        for e in entries {
            // SAFETY: every pointer in these entries (paths, buffers, the statx record) points
            // into memory the caller keeps alive and does not touch until this function has
            // seen all their completions, below.
            unsafe { ring.submission().push(e).unwrap() };
        }
        let mut left = entries.len();
        while left > 0 {
            ring.submit_and_wait(1).unwrap();
            for cqe in ring.completion() {
                left -= 1;
                if cqe.user_data() >> 63 == 1 {
                    assert_eq!(cqe.result(), -libc::ENOENT, "the final name is new");
                } else {
                    let (file, op) = (cqe.user_data() >> 8, cqe.user_data() & 0xff);
                    assert!(
                        cqe.result() >= 0,
                        "file {file}, op {op} of its chain: {}",
                        std::io::Error::from_raw_os_error(-cqe.result())
                    );
                }
            }
        }
    }

    /// Opens `path` into registered file slot `j`, first of its file's linked chain.
    fn open_into(path: &CString, j: usize, flags: i32, mode: libc::mode_t) -> squeue::Entry {
        let slot = types::DestinationSlot::try_from_slot_target(j as u32).unwrap();
        opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), path.as_ptr())
            .file_index(Some(slot))
            .flags(flags)
            .mode(mode)
            .build()
            .flags(squeue::Flags::IO_LINK)
            .user_data((j as u64) << 8)
    }

    /// A ring for `files` files at a time, each with a registered file slot.
    pub fn ring(files: usize) -> IoUring {
        let ring = IoUring::new((files * 8).next_power_of_two() as u32).unwrap();
        ring.submitter().register_files_sparse(files as u32).unwrap();
        ring
    }

    /// Stores `files` (temporary path, final path, header, payload) in one submission.
    pub fn store(ring: &mut IoUring, files: &[(PathBuf, PathBuf, &[u8], &[u8])]) {
        let paths: Vec<(CString, CString)> = files.iter().map(|f| (c(&f.0), c(&f.1))).collect();
        // (io_uring's own `statx` type is opaque, of no size: the record is libc's.)
        let mut stats: Vec<libc::statx> =
            // SAFETY: `statx` is a plain C record of integers, valid all zero.
            files.iter().map(|_| unsafe { std::mem::zeroed() }).collect();
        let mut entries = Vec::with_capacity(files.len() * 6);
        let cwd = types::Fd(libc::AT_FDCWD);
        let link = squeue::Flags::IO_LINK;
        for (j, ((tmp, fin), (_, _, header, payload))) in paths.iter().zip(files).enumerate() {
            let fd = types::Fixed(j as u32);
            let st = (&mut stats[j] as *mut libc::statx).cast::<types::statx>();
            entries.push(
                // Linked, so that it runs before the rename; a hard link, so that its ENOENT
                // does not cancel the chain.
                opcode::Statx::new(cwd, fin.as_ptr(), st)
                    .mask(libc::STATX_SIZE)
                    .build()
                    .flags(squeue::Flags::IO_HARDLINK)
                    .user_data(1 << 63 | j as u64),
            );
            let ud = (j as u64) << 8;
            entries.push(open_into(tmp, j, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o644));
            entries.push(
                opcode::Write::new(fd, header.as_ptr(), header.len() as u32)
                    .offset(0)
                    .build()
                    .flags(link)
                    .user_data(ud | 1),
            );
            entries.push(
                opcode::Write::new(fd, payload.as_ptr(), payload.len() as u32)
                    .offset(header.len() as u64)
                    .build()
                    .flags(link)
                    .user_data(ud | 2),
            );
            entries.push(opcode::Close::new(fd).build().flags(link).user_data(ud | 3));
            entries.push(
                opcode::RenameAt::new(cwd, tmp.as_ptr(), cwd, fin.as_ptr())
                    .build()
                    .user_data(ud | 4),
            );
        }
        run(ring, &entries);
        drop((paths, stats));
    }

    /// Loads `files` (path, header buffer, payload buffer) in one submission.
    pub fn load(ring: &mut IoUring, files: &mut [(PathBuf, &mut [u8], &mut [u8])]) {
        let paths: Vec<CString> = files.iter().map(|f| c(&f.0)).collect();
        let mut entries = Vec::with_capacity(files.len() * 4);
        let link = squeue::Flags::IO_LINK;
        for (j, (p, (_, header, dest))) in paths.iter().zip(files.iter_mut()).enumerate() {
            let fd = types::Fixed(j as u32);
            let ud = (j as u64) << 8;
            entries.push(open_into(p, j, libc::O_RDONLY, 0));
            entries.push(
                opcode::Read::new(fd, header.as_mut_ptr(), header.len() as u32)
                    .offset(0)
                    .build()
                    .flags(link)
                    .user_data(ud | 1),
            );
            entries.push(
                opcode::Read::new(fd, dest.as_mut_ptr(), dest.len() as u32)
                    .offset(header.len() as u64)
                    .build()
                    .flags(link)
                    .user_data(ud | 2),
            );
            entries.push(opcode::Close::new(fd).build().user_data(ud | 3));
        }
        run(ring, &entries);
        drop(paths);
    }
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
    let direct = a.io == Io::Direct;
    let payloads: Vec<Aligned> = (0..n)
        .map(|i| {
            let mut p = Aligned::new(a.size);
            for (j, b) in p.get_mut().iter_mut().enumerate() {
                *b = (i * 31 + j) as u8;
            }
            p
        })
        .collect();
    // The header the adapter writes for `bench l2`'s keys, unless told otherwise; O_DIRECT
    // gives it a block of its own.
    let key = ObjectKey::new([0; 32], "bench-model", 1, 0, 0, "").unwrap();
    let header_len = a.header.unwrap_or_else(|| lmcache_l2::blob::header_len(&key));
    let header_len = if direct { header_len.next_multiple_of(BLOCK) } else { header_len };
    let mut header = Aligned::new(header_len);
    header.get_mut().fill(7);
    let store = rounds(&a, |r| {
        std::thread::scope(|s| {
            for w in 0..a.in_flight {
                let (a, header, payloads) = (&a, header.get(), &payloads);
                s.spawn(move || {
                    let mine = w * a.num_keys..(w + 1) * a.num_keys;
                    if a.io != Io::Uring {
                        for i in mine {
                            store_file(&a.dir, r, i, header, payloads[i].get(), a);
                        }
                        return;
                    }
                    let mut ring = uring::ring(a.num_keys);
                    let files: Vec<_> = mine
                        .map(|i| {
                            let (shard, name) = path(&a.dir, r, i);
                            if a.hash {
                                hash_all(payloads[i].get());
                            }
                            let tmp = shard.join(format!(".{name}.{i}.tmp"));
                            (tmp, shard.join(name), header, payloads[i].get())
                        })
                        .collect();
                    uring::store(&mut ring, &files);
                });
            }
        });
    });
    let mut dests: Vec<(Aligned, Aligned)> = (0..n)
        .map(|_| (Aligned::new(header_len), Aligned::past_boundary(a.size, a.dest_offset)))
        .collect();
    let load = rounds(&a, |r| {
        std::thread::scope(|s| {
            for (w, part) in dests.chunks_mut(a.num_keys).enumerate() {
                let a = &a;
                s.spawn(move || {
                    if a.io != Io::Uring {
                        for (j, (h, d)) in part.iter_mut().enumerate() {
                            load_file(&a.dir, r, w * a.num_keys + j, h.get_mut(), d.get_mut(), a);
                        }
                        return;
                    }
                    let mut ring = uring::ring(a.num_keys);
                    let mut files: Vec<_> = part
                        .iter_mut()
                        .enumerate()
                        .map(|(j, (h, d))| {
                            let (shard, name) = path(&a.dir, r, w * a.num_keys + j);
                            (shard.join(name), h.get_mut(), d.get_mut())
                        })
                        .collect();
                    uring::load(&mut ring, &mut files);
                    if a.hash {
                        for (_, _, d) in &files {
                            hash_all(d);
                        }
                    }
                });
            }
        });
    });
    std::fs::remove_dir_all(&a.dir).unwrap();
    let mib = (n * a.size) as f64 / (1 << 20) as f64;
    println!(
        "{{\"who\": \"fs ceiling{}{}\", \"store\": {{\"mib_per_s\": {:.1}}}, \"load\": {{\"mib_per_s\": {:.1}}}}}",
        if a.io == Io::Buffered { String::new() } else { format!(" ({})", a.io.name()) },
        if a.hash { " + xxh3" } else { "" },
        mib / store,
        mib / load
    );
}
