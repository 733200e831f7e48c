//! The tokens behind the chunks of an L1 that restarts warm, in a file beside the L1 file, so
//! a restarted server can announce what it adopted as a storing one does.
//!
//! The L1 file keeps each object's key and bytes, not the prompt that made it. But a KV event
//! `stored` record (`subscribe_kv_events`, re-published by the coordinator in vLLM's format)
//! carries the chunk's tokens and parent hash, and the coordinator routes by tokens. So each
//! chunk that becomes resident is also appended here, once per (model, chunk hash): its
//! parent, its position in the prompt and its tokens. At a warm start the server reads the
//! file, announces every adopted chunk found in it (a KV event and the coordinator's token
//! binding, parents first), and rewrites the file with those chunks only.
//!
//! Records are appended whole, each with its length and an xxh3 of its bytes; reading stops
//! at the first record that does not check (a torn tail after a SIGKILL). Past [`MAX_BYTES`]
//! the file is compacted to the chunks L1 still holds, so it stays bounded by what L1 holds.
//! It is ours by name (`<L1 file>.lmcache-rs-tokens`), and removed at a cold start.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use lmcache_core::ChunkHash;
use parking_lot::Mutex;

/// What ends the L1 file's name to name its tokens file.
pub const SUFFIX: &str = ".lmcache-rs-tokens";
/// Past this size the file is compacted to the resident chunks.
pub const MAX_BYTES: u64 = 256 << 20;
const HEADER: usize = 12;

/// One chunk's tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkTokens {
    /// The model.
    pub model: String,
    /// The chunk's hash.
    pub hash: ChunkHash,
    /// The preceding chunk's hash (`None` for a prompt's first chunk).
    pub parent: Option<ChunkHash>,
    /// Its first token's position in the prompt.
    pub position: u64,
    /// Its tokens.
    pub tokens: Vec<u32>,
}

/// Chunks read back, by (model, hash).
pub type Saved = HashMap<(String, ChunkHash), ChunkTokens>;

/// The tokens file of one L1 file.
#[derive(Debug)]
pub struct ChunkTokensFile {
    path: PathBuf,
    max_bytes: u64,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    file: Option<File>,
    written: HashSet<(String, ChunkHash)>,
    bytes: u64,
    full_logged: bool,
}

/// The tokens file beside `l1_file`.
pub fn path_for(l1_file: &Path) -> PathBuf {
    crate::l1_sidecar::path_for(l1_file, SUFFIX)
}

impl ChunkTokensFile {
    /// Reads what the previous process left beside a warm-restarting L1 file. The file is
    /// rewritten by [`Self::keep`] before anything is appended.
    pub fn open(l1_file: &Path) -> (Self, Saved) {
        let path = path_for(l1_file);
        let saved = match std::fs::read(&path) {
            Ok(bytes) => decode_all(&bytes),
            Err(e) => {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %path.display(), error = %e, "cannot read the tokens file");
                }
                Saved::new()
            }
        };
        let inner = Inner { file: None, written: HashSet::new(), bytes: 0, full_logged: false };
        (Self { path, max_bytes: MAX_BYTES, inner: Mutex::new(inner) }, saved)
    }

    /// Removes the tokens file of an L1 file that starts cold.
    pub fn remove_for(l1_file: &Path) {
        crate::l1_sidecar::remove(l1_file, SUFFIX, "tokens");
    }

    /// Rewrites the file with `keep` (the adopted chunks) and opens it for appending.
    pub fn keep<'a>(&self, keep: impl IntoIterator<Item = &'a ChunkTokens>) {
        let mut g = self.inner.lock();
        self.rewrite(&mut g, keep);
    }

    fn rewrite<'a>(&self, g: &mut Inner, keep: impl IntoIterator<Item = &'a ChunkTokens>) {
        let mut bytes = Vec::new();
        g.written.clear();
        for c in keep {
            if g.written.insert((c.model.clone(), c.hash)) {
                encode(c, &mut bytes);
            }
        }
        match crate::l1_sidecar::replace(&self.path, &bytes) {
            Ok(f) => {
                g.file = Some(f);
                g.bytes = bytes.len() as u64;
            }
            Err(e) => {
                g.file = None;
                tracing::warn!(path = %self.path.display(), error = %e,
                    "cannot write the tokens file: a restart will not announce tokens");
            }
        }
    }

    /// Appends the chunks not written yet, in one write. When the file would pass
    /// [`MAX_BYTES`], it is first compacted to the chunks `resident` names (the L1's, asked
    /// only then); what still does not fit is not kept (logged once).
    pub fn record(
        &self,
        chunks: impl IntoIterator<Item = ChunkTokens>,
        resident: impl FnOnce() -> HashSet<(String, ChunkHash)>,
    ) {
        let mut g = self.inner.lock();
        if g.file.is_none() {
            return;
        }
        let mut bytes = Vec::new();
        let mut fresh = Vec::new();
        for c in chunks {
            let k = (c.model, c.hash);
            if g.written.contains(&k) || fresh.contains(&k) {
                continue;
            }
            // The model's name moves into the record and back out to its key: no copy.
            let c = ChunkTokens { model: k.0, hash: k.1, ..c };
            encode(&c, &mut bytes);
            fresh.push((c.model, c.hash));
        }
        if bytes.is_empty() {
            return;
        }
        if g.bytes + bytes.len() as u64 > self.max_bytes {
            let live = resident();
            let kept: Vec<ChunkTokens> = std::fs::read(&self.path)
                .map(|b| decode_all(&b))
                .unwrap_or_default()
                .into_values()
                .filter(|c| live.contains(&(c.model.clone(), c.hash)))
                .collect();
            self.rewrite(&mut g, &kept);
            tracing::info!(path = %self.path.display(), kept = kept.len(), "compacted the tokens file");
            if g.file.is_none() || g.bytes + bytes.len() as u64 > self.max_bytes {
                if !std::mem::replace(&mut g.full_logged, true) {
                    tracing::warn!(path = %self.path.display(), max_bytes = self.max_bytes,
                        "the tokens file is full of resident chunks: newer ones restart without their tokens");
                }
                return;
            }
        }
        let write = g.file.as_mut().map(|f| f.write_all(&bytes));
        match write {
            Some(Ok(())) => {
                g.bytes += bytes.len() as u64;
                g.written.extend(fresh);
            }
            Some(Err(e)) => {
                tracing::warn!(path = %self.path.display(), error = %e, "tokens file write failed; not written again");
                g.file = None;
            }
            None => {}
        }
    }
}

fn encode(c: &ChunkTokens, out: &mut Vec<u8>) {
    let model = c.model.as_bytes();
    let model = &model[..model.len().min(u16::MAX as usize)];
    let mut body = Vec::with_capacity(2 + model.len() + 32 + 33 + 12 + 4 * c.tokens.len());
    body.extend_from_slice(&(model.len() as u16).to_le_bytes());
    body.extend_from_slice(model);
    body.extend_from_slice(&c.hash.0);
    match c.parent {
        Some(p) => {
            body.push(1);
            body.extend_from_slice(&p.0);
        }
        None => body.push(0),
    }
    body.extend_from_slice(&c.position.to_le_bytes());
    body.extend_from_slice(&(c.tokens.len() as u32).to_le_bytes());
    for t in &c.tokens {
        body.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&twox_hash::XxHash3_64::oneshot(&body).to_le_bytes());
    out.extend_from_slice(&body);
}

/// Every record up to the first that does not check.
fn decode_all(mut bytes: &[u8]) -> Saved {
    let mut saved = Saved::new();
    while let Some((c, rest)) = decode_one(bytes) {
        saved.insert((c.model.clone(), c.hash), c);
        bytes = rest;
    }
    saved
}

fn decode_one(bytes: &[u8]) -> Option<(ChunkTokens, &[u8])> {
    let (head, rest) = bytes.split_at_checked(HEADER)?;
    let len = u32::from_le_bytes(head[..4].try_into().ok()?) as usize;
    let sum = u64::from_le_bytes(head[4..].try_into().ok()?);
    let (body, rest) = rest.split_at_checked(len)?;
    if twox_hash::XxHash3_64::oneshot(body) != sum {
        return None;
    }
    let mut r = body;
    let mut take = |n: usize| -> Option<&[u8]> {
        let (h, t) = r.split_at_checked(n)?;
        r = t;
        Some(h)
    };
    let model_len = u16::from_le_bytes(take(2)?.try_into().ok()?) as usize;
    let model = String::from_utf8(take(model_len)?.to_vec()).ok()?;
    let hash = ChunkHash::from_slice(take(32)?).ok()?;
    let parent = match take(1)? {
        [0] => None,
        [1] => Some(ChunkHash::from_slice(take(32)?).ok()?),
        _ => return None,
    };
    let position = u64::from_le_bytes(take(8)?.try_into().ok()?);
    let n = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
    let raw = take(n.checked_mul(4)?)?;
    if !r.is_empty() {
        return None;
    }
    let tokens =
        raw.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    Some((ChunkTokens { model, hash, parent, position, tokens }, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(i: u8, parent: Option<u8>) -> ChunkTokens {
        ChunkTokens {
            model: "m".into(),
            hash: ChunkHash([i; 32]),
            parent: parent.map(|p| ChunkHash([p; 32])),
            position: u64::from(i) * 256,
            tokens: (0..256).map(|t| t * 7 + u32::from(i)).collect(),
        }
    }

    #[test]
    fn chunks_come_back_once_and_a_torn_tail_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let l1 = dir.path().join("l1");
        let (file, saved) = ChunkTokensFile::open(&l1);
        assert!(saved.is_empty());
        file.record([chunk(1, None)], HashSet::new); // not opened for appending yet: nothing written
        file.keep([]);
        file.record([chunk(1, None), chunk(2, Some(1))], HashSet::new);
        file.record([chunk(2, Some(1)), chunk(3, Some(2))], HashSet::new); // chunk 2 only once
        let len = std::fs::metadata(path_for(&l1)).unwrap().len();
        let (file, saved) = ChunkTokensFile::open(&l1);
        assert_eq!(saved.len(), 3);
        assert_eq!(saved[&("m".to_owned(), ChunkHash([2; 32]))], chunk(2, Some(1)));
        let mut once = Vec::new();
        for c in [chunk(1, None), chunk(2, Some(1)), chunk(3, Some(2))] {
            encode(&c, &mut once);
        }
        assert_eq!(len, once.len() as u64, "each chunk written once");
        // A torn last record (a SIGKILL in the middle of a write) is not read back.
        let f = std::fs::OpenOptions::new().write(true).open(path_for(&l1)).unwrap();
        f.set_len(len - 5).unwrap();
        let (_, torn) = ChunkTokensFile::open(&l1);
        assert_eq!(torn.len(), 2);
        assert!(!torn.contains_key(&("m".to_owned(), ChunkHash([3; 32]))));
        // keep() compacts to the chunks given.
        file.keep([&chunk(1, None)]);
        let (_, kept) = ChunkTokensFile::open(&l1);
        assert_eq!(kept.into_values().collect::<Vec<_>>(), vec![chunk(1, None)]);
        ChunkTokensFile::remove_for(&l1);
        assert!(!path_for(&l1).exists());
    }

    #[test]
    fn a_full_file_is_compacted_to_the_resident_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let l1 = dir.path().join("l1");
        let (mut file, _) = ChunkTokensFile::open(&l1);
        let mut one = Vec::new();
        encode(&chunk(9, Some(8)), &mut one);
        file.max_bytes = 3 * one.len() as u64; // three records
        file.keep([]);
        file.record((1..=3).map(|i| chunk(i, Some(i - 1))), || panic!("compacted too early"));
        let resident = |ids: &[u8]| -> HashSet<(String, ChunkHash)> {
            ids.iter().map(|&i| ("m".to_owned(), ChunkHash([i; 32]))).collect()
        };
        // The fourth does not fit: the file keeps the resident 2 and 3, then takes 4.
        file.record([chunk(4, Some(3))], || resident(&[2, 3]));
        let (_, back) = ChunkTokensFile::open(&l1);
        let mut ids: Vec<u8> = back.keys().map(|(_, h)| h.0[0]).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![2, 3, 4]);
        // All resident and full: a new chunk is not kept, nothing is lost.
        file.record([chunk(5, Some(4))], || resident(&[2, 3, 4]));
        assert_eq!(ChunkTokensFile::open(&l1).1.len(), 3);
        // Chunk 1 was compacted away: it is written again when it is stored again.
        file.record([chunk(1, None)], || resident(&[1]));
        let (_, back) = ChunkTokensFile::open(&l1);
        assert_eq!(back.keys().map(|(_, h)| h.0[0]).collect::<Vec<_>>(), vec![1]);
    }

    #[test]
    fn a_flipped_byte_ends_the_read_there() {
        let mut bytes = Vec::new();
        for i in 1..=3 {
            encode(&chunk(i, None), &mut bytes);
        }
        let first = {
            let mut one = Vec::new();
            encode(&chunk(1, None), &mut one);
            one.len()
        };
        bytes[first + 20] ^= 1; // inside the second record
        assert_eq!(decode_all(&bytes).len(), 1);
        assert!(decode_all(b"\xff\xff\xff\xff").is_empty());
    }
}
