//! The reorder planner against LMCache 0.5.6's own, `lmcache.v1.multiprocess.modules.blend.
//! reorder.plan`, run by the Python of LMCache's virtualenv (`LMCACHE_RS_TEST_NIXL_PYTHON`, set
//! by scripts/test; required there through `LMCACHE_RS_REQUIRE_SERVICES=1`). Both plan the
//! same 400 prompts, built from documents in a new order, with separators, noise, kept
//! prefixes and several candidates; every permutation (or "keep the prompt") must be equal.

use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CASES: usize = 400;

fn python() -> Option<String> {
    match std::env::var("LMCACHE_RS_TEST_NIXL_PYTHON") {
        Ok(p) => Some(p),
        Err(_) if std::env::var("LMCACHE_RS_REQUIRE_SERVICES").is_ok_and(|v| v == "1") => {
            panic!("LMCACHE_RS_TEST_NIXL_PYTHON is not set, but LMCACHE_RS_REQUIRE_SERVICES=1")
        }
        Err(_) => {
            eprintln!("LMCACHE_RS_TEST_NIXL_PYTHON not set: LMCache's planner not run");
            None
        }
    }
}

/// Reads cases from stdin, one per line: `chunk baseline keep|P|H1;H2;...` (tokens
/// space-separated); writes each plan as its permutation, or `-` for none.
const THEIRS: &str = r#"
import sys, time
from lmcache.v1.multiprocess.modules.blend.reorder import plan
for line in sys.stdin:
    head, p, hs = line.rstrip("\n").split("|")
    chunk, base, keep = map(int, head.split())
    P = [int(t) for t in p.split()]
    H = [[int(t) for t in h.split()] for h in hs.split(";")]
    perm = plan(P, H, chunk, base, time.monotonic() + 60, keep)
    print("-" if perm is None else " ".join(map(str, perm)), flush=True)
"#;

/// A small deterministic generator (xorshift).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Case {
    chunk: usize,
    baseline: usize,
    keep: usize,
    prompt: Vec<u32>,
    candidates: Vec<Vec<u32>>,
}

fn cases() -> Vec<Case> {
    let mut rng = Rng(0x2026_1204);
    // Eight documents; two share a 24-token passage (so pieces can be ambiguous).
    let shared: Vec<u32> = (0..24).map(|t| 50_000 + t).collect();
    let docs: Vec<Vec<u32>> = (0..8u32)
        .map(|d| {
            let mut v: Vec<u32> = (0..16 + (d * 7) % 40).map(|t| d * 1000 + t).collect();
            if d < 2 {
                v.extend(&shared);
            }
            v
        })
        .collect();
    let sep = 9_999u32;
    let text = |rng: &mut Rng, ids: &[usize], seps: bool| -> Vec<u32> {
        let mut v = Vec::new();
        for &d in ids {
            v.extend(&docs[d]);
            if seps {
                v.push(sep);
            }
            if rng.below(5) == 0 {
                v.push(20_000 + rng.below(3) as u32); // noise: a short stray run
            }
        }
        v
    };
    (0..CASES)
        .map(|_| {
            let seps = rng.below(2) == 0;
            let sys_len = [0usize, 0, 8, 20][rng.below(4) as usize];
            let system: Vec<u32> = (0..sys_len as u32).map(|t| 30_000 + t).collect();
            let pick = |rng: &mut Rng| -> Vec<usize> {
                let n = 2 + rng.below(4) as usize;
                let mut ids: Vec<usize> = (0..8).collect();
                for i in (1..ids.len()).rev() {
                    ids.swap(i, rng.below(i as u64 + 1) as usize);
                }
                ids.truncate(n);
                ids
            };
            let n_cands = 1 + rng.below(3) as usize;
            let first = pick(&mut rng);
            let mut candidates = Vec::new();
            for c in 0..n_cands {
                let ids = if c == 0 { first.clone() } else { pick(&mut rng) };
                candidates.push([&system[..], &text(&mut rng, &ids, seps)].concat());
            }
            // Mostly the first candidate's documents in another order, maybe one more.
            let mut prompt_ids = if rng.below(4) == 0 { pick(&mut rng) } else { first };
            let turn = (1 + rng.below(2) as usize) % prompt_ids.len();
            prompt_ids.rotate_left(turn);
            if rng.below(3) == 0 {
                prompt_ids.insert(rng.below(prompt_ids.len() as u64) as usize, 7);
            }
            let question: Vec<u32> = (0..(10 + rng.below(20)) as u32).map(|t| 40_000 + t).collect();
            let prompt = [&system[..], &text(&mut rng, &prompt_ids, seps), &question].concat();
            let keep = if sys_len > 0 && rng.below(2) == 0 { sys_len } else { 0 };
            Case {
                chunk: [8usize, 16, 32][rng.below(3) as usize],
                baseline: rng.below(2) as usize,
                keep,
                prompt,
                candidates,
            }
        })
        .collect()
}

fn join(v: &[u32]) -> String {
    v.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}

#[test]
fn plans_equal_lmcaches_own() {
    let Some(python) = python() else { return };
    let cases = cases();
    let mut input = String::new();
    for c in &cases {
        let hs: Vec<String> = c.candidates.iter().map(|h| join(h)).collect();
        writeln!(
            input,
            "{} {} {}|{}|{}",
            c.chunk,
            c.baseline,
            c.keep,
            join(&c.prompt),
            hs.join(";")
        )
        .unwrap();
    }
    let mut child = Command::new(&python)
        .arg("-c")
        .arg(THEIRS)
        .env("LMCACHE_TRACK_USAGE", "false")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Fed from a thread: the answers fill the pipe while the cases are still being written.
    let mut stdin = child.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        use std::io::Write as _;
        stdin.write_all(input.as_bytes()).unwrap();
    });
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    assert!(
        out.status.success(),
        "LMCache's planner failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs: Vec<String> =
        String::from_utf8(out.stdout).unwrap().lines().map(str::to_owned).collect();
    assert_eq!(theirs.len(), cases.len());
    let mut planned = 0;
    for (i, (c, t)) in cases.iter().zip(&theirs).enumerate() {
        let cands: Vec<&[u32]> = c.candidates.iter().map(Vec::as_slice).collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        let ours = lmcache_blend::plan(&c.prompt, &cands, c.chunk, c.baseline, deadline, c.keep);
        let ours = ours.map_or_else(
            || "-".to_owned(),
            |p| p.iter().map(usize::to_string).collect::<Vec<_>>().join(" "),
        );
        planned += usize::from(ours != "-");
        assert_eq!(&ours, t, "case {i}: chunk {} baseline {} keep {}", c.chunk, c.baseline, c.keep);
    }
    // The cases must exercise plans, not only "keep the prompt".
    assert!(planned > CASES / 2, "only {planned} of {CASES} cases planned a reorder");
    eprintln!("{planned} of {CASES} plans equal LMCache's, and every keep");
}
