//! The reorder planner (`cb_reorder_plan`, `--enable-blend-reorder`): serve a prompt in an
//! order that starts with an exact copy of the beginning of a prompt stored before, so that
//! copy is an ordinary prefix hit; the rest of the prompt follows in its own order.
//!
//! The rules are LMCache 0.5.6's planner's, so both servers answer the same permutation:
//! - the copy is laid out of pieces of the prompt at least [`LMIN`] tokens long, each the
//!   longest unused run of the prompt equal to what the stored prompt has next (the leftmost
//!   of equals); where no piece fits, up to [`GLUE`] tokens (a separator) may bridge to the
//!   next piece, glue beside copied text first;
//! - the prompt's last [`LMIN`] tokens are never moved (the question stays last), nor its
//!   first `keep_prefix` (they stay in place, and only stored prompts sharing them count);
//! - among the candidates the best copies the most whole chunks, then the most tokens, then
//!   uses the fewest pieces; the newest wins ties; a plan must copy more whole chunks than the
//!   prompt's own exact prefix hit already gives, or the prompt is kept;
//! - after the copy, the stored prompt's next token is served too if the prompt has it beside
//!   a cut (a separator kept at the junction);
//! - planning stops at its deadline and the best plan finished by then counts.
//!
//! [`PromptStore`] keeps the stored prompts the candidates come from (LMCache's
//! `PromptStore`): per namespace, bounded by their total tokens, oldest out, with the newest
//! prompt that recorded each chunk hash.
//!
//! Where this differs from LMCache, invisibly in the answers: windows are matched by their
//! tokens (a map of each [`LMIN`]-token window to its positions), not by a 64-bit hash whose
//! collisions are then rejected, and the prompt store's namespaces are [`Namespace`]s.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use crate::matcher::Namespace;

/// The shortest run of the prompt copied as one piece; the prompt's last `LMIN` tokens are
/// never moved.
pub const LMIN: usize = 16;
/// The longest bridge (a separator) between two pieces.
pub const GLUE: usize = 3;

/// Planning ran past its deadline.
struct OutOfTime;

/// A run of the prompt, `start..end`.
type Piece = (usize, usize);

/// Step one for one prompt against any number of stored prompts.
struct Copier<'p> {
    p: &'p [u32],
    /// Each `LMIN`-token window of the prompt, with the positions it starts at, ascending.
    windows: HashMap<&'p [u32], Vec<usize>>,
    deadline: Instant,
}

impl<'p> Copier<'p> {
    fn new(p: &'p [u32], deadline: Instant) -> Result<Self, OutOfTime> {
        let mut windows: HashMap<&[u32], Vec<usize>> = HashMap::new();
        for (i, w) in p.windows(LMIN).enumerate() {
            windows.entry(w).or_default().push(i);
        }
        let c = Self { p, windows, deadline };
        c.check()?;
        Ok(c)
    }

    fn check(&self) -> Result<(), OutOfTime> {
        if Instant::now() > self.deadline { Err(OutOfTime) } else { Ok(()) }
    }

    /// Positions of the prompt whose window equals `h[k..k + LMIN]`, ascending.
    fn starts(&self, h: &[u32], k: usize) -> &[usize] {
        h.get(k..k + LMIN).and_then(|w| self.windows.get(w)).map_or(&[], Vec::as_slice)
    }

    /// `(start, length)` of the longest unused run of the prompt equal to `h[k..]`, at least
    /// `LMIN` long; the leftmost of equals.
    fn longest(
        &self,
        h: &[u32],
        k: usize,
        used: &[bool],
    ) -> Result<Option<(usize, usize)>, OutOfTime> {
        let mut best: Option<(usize, usize)> = None;
        for &i in self.starts(h, k) {
            if used[i] {
                continue;
            }
            let n = (self.p.len() - i).min(h.len() - k); // shrinks as i grows
            if best.is_some_and(|(_, m)| n <= m) {
                break; // later starts can only tie
            }
            self.check()?;
            let m = (0..n).find(|&t| self.p[i + t] != h[k + t] || used[i + t]).unwrap_or(n);
            if m >= LMIN && best.is_none_or(|(_, b)| m > b) {
                best = Some((i, m));
            }
        }
        Ok(best)
    }

    /// Pieces `(i, j)` of the prompt that, end to end, equal the beginning of `h`; the first
    /// is the prompt's first `keep_prefix` tokens, in place.
    fn copy(&self, h: &[u32], keep_prefix: usize) -> Result<Vec<(usize, usize)>, OutOfTime> {
        let l = self.p.len();
        let mut used = vec![false; l];
        used[..keep_prefix].iter_mut().for_each(|u| *u = true);
        used[l.saturating_sub(LMIN)..].iter_mut().for_each(|u| *u = true);
        let mut pieces = if keep_prefix > 0 { vec![(0, keep_prefix)] } else { Vec::new() };
        let mut k = keep_prefix;
        while k < h.len() {
            let piece = match self.longest(h, k, &used)? {
                Some(p) => p,
                None => {
                    let Some(((i, j), piece)) = self.glue(h, k, &mut used, &pieces)? else {
                        break;
                    };
                    pieces.push((i, j));
                    used[i..j].iter_mut().for_each(|u| *u = true);
                    k += j - i;
                    piece
                }
            };
            let (i, m) = piece;
            pieces.push((i, i + m));
            used[i..i + m].iter_mut().for_each(|u| *u = true);
            k += m;
        }
        Ok(pieces)
    }

    /// Up to `GLUE` tokens of the prompt equal to `h[k..]`, then a piece for what follows:
    /// glue beside copied text first, then the leftmost; never glue from past the copy.
    fn glue(
        &self,
        h: &[u32],
        k: usize,
        used: &mut [bool],
        pieces: &[(usize, usize)],
    ) -> Result<Option<(Piece, Piece)>, OutOfTime> {
        let l = self.p.len();
        for gl in 1..=GLUE {
            if k + gl >= h.len() {
                break;
            }
            if self.starts(h, k + gl).is_empty() {
                continue; // no piece can follow
            }
            let want = &h[k..k + gl];
            let mut cands: Vec<usize> = (0..l)
                .filter(|&i| {
                    i + gl <= l && !used[i..i + gl].iter().any(|&u| u) && &self.p[i..i + gl] == want
                })
                .collect();
            let beside = |i: usize| (i > 0 && used[i - 1]) || (i + gl < l && used[i + gl]);
            cands.sort_by_key(|&i| (!beside(i), i));
            let copied_end = pieces.iter().map(|&(_, j)| j).max();
            for i in cands {
                self.check()?;
                used[i..i + gl].iter_mut().for_each(|u| *u = true);
                let next = self.longest(h, k + gl, used);
                used[i..i + gl].iter_mut().for_each(|u| *u = false);
                if let Some(nxt) = next? {
                    let end = copied_end.map_or(nxt.0 + nxt.1, |e| e.max(nxt.0 + nxt.1));
                    if i + gl <= end {
                        return Ok(Some(((i, i + gl), nxt)));
                    }
                }
            }
        }
        Ok(None)
    }
}

/// The order to serve `prompt` in (`prompt[perm[t]]` at `t`), starting with the longest copy
/// of one candidate's beginning (candidates newest first), or `None` to keep the prompt.
/// `baseline_chunks` is the exact prefix hit the prompt already has, in chunks.
pub fn plan(
    prompt: &[u32],
    candidates: &[&[u32]],
    chunk_size: usize,
    baseline_chunks: usize,
    deadline: Instant,
    keep_prefix: usize,
) -> Option<Vec<usize>> {
    if keep_prefix > prompt.len() || chunk_size == 0 {
        return None;
    }
    /// Whole chunks copied, tokens copied, fewer pieces.
    type Score = (usize, usize, isize);
    let mut best: Option<(Score, Vec<Piece>, &[u32])> = None;
    if let Ok(copier) = Copier::new(prompt, deadline) {
        let mut seen: HashSet<&[u32]> = HashSet::new();
        for &h in candidates {
            if h.get(..keep_prefix) != prompt.get(..keep_prefix) || !seen.insert(h) {
                continue;
            }
            let Ok(pieces) = copier.copy(h, keep_prefix) else { break };
            let k: usize = pieces.iter().map(|(i, j)| j - i).sum();
            let score = (k / chunk_size, k, -(pieces.len() as isize));
            if best.as_ref().is_none_or(|(b, _, _)| score > *b) {
                best = Some((score, pieces, h));
            }
        }
    }
    let ((chunks, k, _), pieces, h) = best?;
    if chunks <= baseline_chunks {
        return None;
    }
    let mut used = vec![false; prompt.len()];
    let mut perm = Vec::with_capacity(prompt.len());
    for &(i, j) in &pieces {
        perm.extend(i..j);
        used[i..j].iter_mut().for_each(|u| *u = true);
    }
    // The stored prompt's next token (often a separator), if the prompt has it beside a cut
    // before the copy's end: later copies then find that junction too.
    if let Some(&next) = h.get(k) {
        let end = pieces.iter().map(|&(_, j)| j).max().unwrap_or(0);
        let l = prompt.len();
        if let Some(i) = (0..end).find(|&i| {
            !used[i] && prompt[i] == next && ((i > 0 && used[i - 1]) || (i + 1 < l && used[i + 1]))
        }) {
            perm.push(i);
            used[i] = true;
        }
    }
    perm.extend((0..prompt.len()).filter(|&i| !used[i]));
    if perm.iter().enumerate().all(|(t, &i)| t == i) { None } else { Some(perm) }
}

/// A stored prompt.
#[derive(Debug)]
struct Entry {
    /// When it was first recorded (candidates come newest first).
    seq: u64,
    /// When it was last recorded (its place in the recency order).
    touched: u64,
    tokens: Vec<u32>,
    hashes: HashSet<[u8; 32]>,
}

type PromptKey = (Namespace, String);

/// The stored prompts a plan may copy: per namespace and request, the prompt's tokens and
/// its chunk hashes, bounded by their total tokens (the least recently stored out first).
#[derive(Debug)]
pub struct PromptStore {
    max_tokens: usize,
    tokens: usize,
    seq: u64,
    entries: HashMap<PromptKey, Entry>,
    /// Every entry by its `touched`, least recently recorded first.
    recency: BTreeMap<u64, PromptKey>,
    /// The newest prompt that recorded each chunk hash.
    owner: HashMap<(Namespace, [u8; 32]), PromptKey>,
    /// Per namespace, its prompts and its newest one.
    namespaces: HashMap<Namespace, (usize, PromptKey)>,
}

/// Stored prompts' tokens kept by default (LMCache's `1 << 24`).
pub const PROMPT_STORE_TOKENS: usize = 1 << 24;

impl Default for PromptStore {
    fn default() -> Self {
        Self::new(PROMPT_STORE_TOKENS)
    }
}

impl PromptStore {
    /// A store keeping up to `max_tokens` tokens of prompts (always at least the newest).
    pub fn new(max_tokens: usize) -> Self {
        Self {
            max_tokens,
            tokens: 0,
            seq: 0,
            entries: HashMap::new(),
            recency: BTreeMap::new(),
            owner: HashMap::new(),
            namespaces: HashMap::new(),
        }
    }

    /// Records a store of request `request_id` that committed KV: its first record's
    /// `tokens` are the prompt; `chain` is the request's chunk hashes from chunk 0.
    pub fn record(&mut self, ns: &Namespace, request_id: &str, tokens: &[u32], chain: &[[u8; 32]]) {
        let key: PromptKey = (ns.clone(), request_id.to_owned());
        self.seq += 1;
        let stamp = self.seq;
        match self.entries.get_mut(&key) {
            Some(e) => {
                self.recency.remove(&e.touched);
                e.touched = stamp;
            }
            None => {
                let e = Entry {
                    seq: stamp,
                    touched: stamp,
                    tokens: tokens.to_vec(),
                    hashes: HashSet::new(),
                };
                self.entries.insert(key.clone(), e);
                self.tokens += tokens.len();
                let n = self.namespaces.entry(ns.clone()).or_insert_with(|| (0, key.clone()));
                n.0 += 1;
                n.1 = key.clone();
            }
        }
        self.recency.insert(stamp, key.clone());
        for h in chain {
            self.owner.insert((ns.clone(), *h), key.clone());
        }
        if let Some(e) = self.entries.get_mut(&key) {
            e.hashes.extend(chain.iter().copied());
        }
        while self.entries.len() > 1 && self.tokens > self.max_tokens {
            let Some((_, old)) = self.recency.pop_first() else { break };
            self.remove(&old);
        }
    }

    fn remove(&mut self, key: &PromptKey) {
        let Some(e) = self.entries.remove(key) else { return };
        self.recency.remove(&e.touched);
        self.tokens -= e.tokens.len();
        for h in e.hashes {
            let k = (key.0.clone(), h);
            if self.owner.get(&k) == Some(key) {
                self.owner.remove(&k);
            }
        }
        if let Some(n) = self.namespaces.get_mut(&key.0) {
            n.0 -= 1;
            if n.0 == 0 {
                self.namespaces.remove(&key.0);
            }
        }
    }

    /// The one recorded namespace a caller's may mean: the salt equal, an empty model or a
    /// zero world size matching any. `None` when no namespace or several do.
    pub fn resolve(&self, model: &str, world_size: u32, cache_salt: &str) -> Option<Namespace> {
        let mut hits = self.namespaces.keys().filter(|ns| {
            &*ns.cache_salt == cache_salt
                && (model.is_empty() || &*ns.model == model)
                && (world_size == 0 || ns.world_size == world_size)
        });
        let first = hits.next()?;
        hits.next().is_none().then(|| first.clone())
    }

    /// The candidates for a prompt, newest first: the `top_k` stored prompts owning the most
    /// of `hit_hashes` (the matcher's finds), the one holding the prompt's own exact prefix,
    /// and the namespace's newest; with the prompt's exact prefix in chunks (`chain` is its
    /// chunk hashes from chunk 0).
    pub fn candidates(
        &self,
        ns: &Namespace,
        hit_hashes: &[[u8; 32]],
        chain: &[[u8; 32]],
        top_k: usize,
    ) -> (Vec<&[u32]>, usize) {
        let mut votes: HashMap<&PromptKey, usize> = HashMap::new();
        for h in hit_hashes {
            if let Some(k) = self.owner.get(&(ns.clone(), *h)) {
                *votes.entry(k).or_default() += 1;
            }
        }
        let seq = |k: &PromptKey| self.entries.get(k).map_or(0, |e| e.seq);
        let mut ranked: Vec<(&PromptKey, usize)> = votes.into_iter().collect();
        ranked.sort_by_key(|&(k, v)| (std::cmp::Reverse(v), std::cmp::Reverse(seq(k))));
        let mut keys: HashSet<&PromptKey> =
            ranked.into_iter().take(top_k).map(|(k, _)| k).collect();
        let base = chain.iter().take_while(|h| self.owner.contains_key(&(ns.clone(), **h))).count();
        if let Some(k) = base.checked_sub(1).and_then(|b| self.owner.get(&(ns.clone(), chain[b]))) {
            keys.insert(k);
        }
        if let Some((_, newest)) = self.namespaces.get(ns)
            && self.entries.contains_key(newest)
        {
            keys.insert(newest);
        }
        let mut entries: Vec<&Entry> =
            keys.into_iter().filter_map(|k| self.entries.get(k)).collect();
        entries.sort_by_key(|e| std::cmp::Reverse(e.seq));
        (entries.into_iter().map(|e| e.tokens.as_slice()).collect(), base)
    }

    /// Prompts and tokens held.
    pub fn len(&self) -> (usize, usize) {
        (self.entries.len(), self.tokens)
    }

    /// Whether no prompt is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    /// A document of `n` tokens no other document shares a window with.
    fn doc(id: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|t| id * 10_000 + t).collect()
    }

    fn ns(salt: &str) -> Namespace {
        Namespace { model: Arc::from("m"), world_size: 1, cache_salt: Arc::from(salt) }
    }

    fn apply(p: &[u32], perm: &[usize]) -> Vec<u32> {
        perm.iter().map(|&i| p[i]).collect()
    }

    #[test]
    fn documents_in_a_new_order_are_served_in_the_stored_order() {
        let (a, b, c) = (doc(1, 40), doc(2, 40), doc(3, 40));
        let stored: Vec<u32> = [&a[..], &b, &c, &doc(9, 20)].concat();
        let question = doc(8, 20);
        let prompt: Vec<u32> = [&c[..], &a, &b, &question].concat();
        let perm = plan(&prompt, &[&stored], 32, 0, later(), 0).expect("a plan");
        let served = apply(&prompt, &perm);
        assert_eq!(served, [&a[..], &b, &c, &question].concat());
    }

    #[test]
    fn the_prompt_is_kept_when_no_plan_beats_its_own_prefix() {
        let (a, b) = (doc(1, 64), doc(2, 64));
        let stored: Vec<u32> = [&a[..], &b].concat();
        let prompt: Vec<u32> = [&b[..], &a, &doc(8, 20)].concat();
        // The copy gives 128 tokens: 4 chunks of 32; a prompt already hitting 4 keeps itself.
        assert!(plan(&prompt, &[&stored], 32, 4, later(), 0).is_none());
        assert!(plan(&prompt, &[&stored], 32, 3, later(), 0).is_some());
        // Nothing stored shares anything: keep.
        assert!(plan(&prompt, &[&doc(5, 100)], 32, 0, later(), 0).is_none());
        // Already in the stored order: the plan is the identity, so keep.
        let same: Vec<u32> = [&a[..], &b, &doc(8, 20)].concat();
        assert!(plan(&same, &[&stored], 32, 0, later(), 0).is_none());
    }

    #[test]
    fn the_kept_prefix_stays_and_only_candidates_sharing_it_count() {
        let (sys, a, b) = (doc(7, 20), doc(1, 40), doc(2, 40));
        let stored: Vec<u32> = [&sys[..], &a, &b].concat();
        let prompt: Vec<u32> = [&sys[..], &b, &a, &doc(8, 20)].concat();
        let perm = plan(&prompt, &[&stored], 16, 0, later(), 20).expect("a plan");
        assert_eq!(&perm[..20], &(0..20).collect::<Vec<_>>()[..]);
        assert_eq!(apply(&prompt, &perm)[..100], stored[..]);
        let other: Vec<u32> = [&doc(6, 20)[..], &a, &b].concat();
        assert!(plan(&prompt, &[&other], 16, 0, later(), 20).is_none());
        // A kept prefix past the prompt is no plan, not a panic.
        assert!(plan(&prompt, &[&stored], 16, 0, later(), prompt.len() + 1).is_none());
    }

    #[test]
    fn a_separator_bridges_two_pieces() {
        let (a, b) = (doc(1, 40), doc(2, 40));
        let sep = 99_999;
        let stored: Vec<u32> = [&a[..], &[sep], &b, &[sep], &doc(9, 20)].concat();
        let prompt: Vec<u32> = [&b[..], &[sep], &a, &[sep], &doc(8, 20)].concat();
        let served = apply(&prompt, &plan(&prompt, &[&stored], 16, 0, later(), 0).unwrap());
        assert_eq!(served[..82], stored[..82]);
    }

    #[test]
    fn a_plan_past_its_deadline_keeps_the_prompt() {
        let (a, b) = (doc(1, 40), doc(2, 40));
        let stored: Vec<u32> = [&a[..], &b].concat();
        let prompt: Vec<u32> = [&b[..], &a, &doc(8, 20)].concat();
        let past = Instant::now().checked_sub(Duration::from_millis(1)).unwrap();
        assert!(plan(&prompt, &[&stored], 16, 0, past, 0).is_none());
    }

    #[test]
    fn the_most_whole_chunks_win_then_the_newest() {
        let (a, b, c) = (doc(1, 40), doc(2, 40), doc(3, 40));
        let short: Vec<u32> = [&b[..], &doc(5, 40)].concat(); // copies 40
        let long: Vec<u32> = [&a[..], &c].concat(); // copies 80
        let prompt: Vec<u32> = [&c[..], &b, &a, &doc(8, 20)].concat();
        let served = apply(&prompt, &plan(&prompt, &[&short, &long], 16, 0, later(), 0).unwrap());
        assert_eq!(served[..80], long[..]);
        // Equal copies: the first (newest) candidate wins.
        let also: Vec<u32> = [&a[..], &c, &doc(6, 3)].concat();
        let p2: Vec<u32> = [&c[..], &a, &doc(8, 20)].concat();
        let perm = plan(&p2, &[&also, &long], 16, 0, later(), 0).unwrap();
        assert_eq!(apply(&p2, &perm)[..80], also[..80]);
    }

    #[test]
    fn the_store_evicts_the_least_recently_recorded_and_its_owners() {
        let mut s = PromptStore::new(250);
        let n = ns("");
        s.record(&n, "r1", &doc(1, 100), &[[1; 32]]);
        s.record(&n, "r2", &doc(2, 100), &[[2; 32]]);
        s.record(&n, "r1", &doc(1, 100), &[[3; 32]]); // r1 recorded again: r2 is older now
        s.record(&n, "r3", &doc(3, 100), &[[4; 32]]);
        assert_eq!(s.len(), (2, 200));
        let (c, base) = s.candidates(&n, &[[2; 32], [1; 32]], &[[1; 32], [3; 32], [9; 32]], 4);
        assert_eq!(base, 2, "r1 owns the prompt's first two chunk hashes");
        assert_eq!(c, vec![&doc(3, 100)[..], &doc(1, 100)[..]], "newest first, r2 gone");
    }

    #[test]
    fn a_namespace_resolves_only_when_exactly_one_fits() {
        let mut s = PromptStore::default();
        s.record(&ns("a"), "r1", &doc(1, 10), &[]);
        assert_eq!(s.resolve("", 0, "a"), Some(ns("a")));
        assert_eq!(s.resolve("m", 1, "a"), Some(ns("a")));
        assert_eq!(s.resolve("m", 2, "a"), None);
        assert_eq!(s.resolve("m", 1, "b"), None, "the salt must be equal");
        let two = Namespace { world_size: 2, ..ns("a") };
        s.record(&two, "r2", &doc(2, 10), &[]);
        assert_eq!(s.resolve("", 0, "a"), None, "two fit");
        assert_eq!(s.resolve("", 2, "a"), Some(two));
    }

    proptest! {
        /// Any plan is a permutation that keeps the kept prefix in place and the prompt's last
        /// LMIN tokens last, and starts with the beginning of one candidate.
        #[test]
        fn every_plan_is_a_permutation_serving_a_candidates_beginning(
            docs in proptest::collection::vec(0u32..6, 2..10),
            order in proptest::collection::vec(0u32..6, 2..10),
            keep in 0usize..20,
        ) {
            let text = |ids: &[u32]| -> Vec<u32> {
                ids.iter().flat_map(|&d| doc(d + 1, 20)).collect()
            };
            let stored = text(&docs);
            let prompt = [&stored[..keep.min(stored.len())], &text(&order)[..], &doc(50, 20)[..]].concat();
            if let Some(perm) = plan(&prompt, &[&stored], 16, 0, later(), keep) {
                let mut sorted = perm.clone();
                sorted.sort_unstable();
                prop_assert_eq!(sorted, (0..prompt.len()).collect::<Vec<_>>());
                prop_assert!(perm[..keep].iter().enumerate().all(|(t, &i)| t == i));
                let l = prompt.len();
                prop_assert_eq!(&perm[l - LMIN..], &(l - LMIN..l).collect::<Vec<_>>()[..]);
                let served = apply(&prompt, &perm);
                prop_assert!(served[..16] == stored[..16]);
            }
        }
    }
}
