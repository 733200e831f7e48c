//! Token hashing: LMCache 0.5.6's BLAKE3 prefix chain, reproduced bit for bit.
//!
//! `h(prefix, tokens)` is BLAKE3-256 over the 32 prefix bytes followed by every token as a
//! 4-byte big-endian unsigned integer. The chain starts at [`NONE_HASH`] (BLAKE3 of 12 zero
//! bytes, i.e. LMCache's `h(0, [0])`), and chunk `i` is `H_i = h(H_{i-1}, tokens[iC..(i+1)C])`.
//! Only complete chunks are hashed. Model, shard, group and salt are not part of the hash;
//! they are separate [`crate::ObjectKey`] fields.
//!
//! [`TokenHasher`] hashes a whole sequence; [`PrefixHasher`] keeps the chain's state so that a
//! request that grows by one chunk costs exactly one chunk of hashing.

use crate::error::KeyError;
use crate::key::ChunkHash;

/// LMCache's default chunk size in tokens.
pub const DEFAULT_CHUNK_SIZE: usize = 256;

/// The hash the chain starts from: BLAKE3 of 12 zero bytes (LMCache's `h(0, [0])`: an 8-byte
/// big-endian zero prefix then the token 0).
pub const NONE_HASH: ChunkHash = ChunkHash([
    0x7e, 0x3e, 0xff, 0x9e, 0xf7, 0x61, 0x3a, 0x50, 0x34, 0x0e, 0xb1, 0x26, 0x77, 0xee, 0x03, 0xb8,
    0x3a, 0xc7, 0x59, 0xfc, 0xba, 0x9b, 0xb3, 0x27, 0x05, 0xf0, 0x72, 0x48, 0xd5, 0x6d, 0x47, 0x3b,
]);

/// Tokens are converted to big-endian bytes through a stack buffer of this many tokens.
const ENCODE_BATCH: usize = 256;

/// Hashes one chunk given the previous hash of the chain.
pub fn hash_chunk(prefix: &ChunkHash, tokens: &[u32]) -> ChunkHash {
    if tokens.len() <= ENCODE_BATCH {
        // One contiguous message and a single `blake3::hash` call: the common case (chunks of
        // 256 tokens) costs what BLAKE3 itself costs for 32 + 1024 bytes.
        let mut buf = [0u8; 32 + ENCODE_BATCH * 4];
        buf[..32].copy_from_slice(prefix.as_bytes());
        for (dst, tok) in buf[32..].chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&tok.to_be_bytes());
        }
        return ChunkHash(*blake3::hash(&buf[..32 + tokens.len() * 4]).as_bytes());
    }
    let mut hasher = blake3::Hasher::new();
    hasher.update(prefix.as_bytes());
    let mut buf = [0u8; ENCODE_BATCH * 4];
    for group in tokens.chunks(ENCODE_BATCH) {
        for (dst, tok) in buf.chunks_exact_mut(4).zip(group) {
            dst.copy_from_slice(&tok.to_be_bytes());
        }
        hasher.update(&buf[..group.len() * 4]);
    }
    ChunkHash(*hasher.finalize().as_bytes())
}

/// Converts token ids as the wire carries them (signed 64-bit) to `u32`, refusing any id
/// outside `[0, 2^32)` with its position.
pub fn tokens_from_i64(tokens: &[i64]) -> Result<Vec<u32>, KeyError> {
    tokens
        .iter()
        .enumerate()
        .map(|(position, &token)| {
            u32::try_from(token).map_err(|_| KeyError::TokenOutOfRange { token, position })
        })
        .collect()
}

/// Hashes whole token sequences into chunk hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenHasher {
    chunk_size: usize,
}

impl Default for TokenHasher {
    fn default() -> Self {
        Self { chunk_size: DEFAULT_CHUNK_SIZE }
    }
}

impl TokenHasher {
    /// A hasher with the given chunk size in tokens (at least 1).
    pub fn new(chunk_size: usize) -> Result<Self, KeyError> {
        if chunk_size == 0 {
            return Err(KeyError::ZeroChunkSize);
        }
        Ok(Self { chunk_size })
    }

    /// The chunk size in tokens.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }

    /// The hashes of every complete chunk of `tokens`, chained from [`NONE_HASH`].
    pub fn hash_tokens(&self, tokens: &[u32]) -> Vec<ChunkHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.chunk_size);
        let mut prev = NONE_HASH;
        for chunk in tokens.chunks_exact(self.chunk_size) {
            prev = hash_chunk(&prev, chunk);
            out.push(prev);
        }
        out
    }

    /// The chunk hashes of several requests at once, on up to `threads` threads. Each
    /// request's chain is sequential (a chunk's hash takes the previous one), but requests are
    /// independent, so a batch of them scales with cores. Results are in request order and
    /// equal [`Self::hash_tokens`] of each. With one thread, or one request, no thread is
    /// spawned.
    pub fn hash_many(&self, requests: &[&[u32]], threads: usize) -> Vec<Vec<ChunkHash>> {
        let threads = threads.clamp(1, requests.len().max(1));
        if threads == 1 {
            return requests.iter().map(|r| self.hash_tokens(r)).collect();
        }
        // Greedy balance by token count: each request goes to the least loaded thread.
        let mut order: Vec<usize> = (0..requests.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(requests[i].len()));
        let mut bins: Vec<(usize, Vec<usize>)> = vec![(0, Vec::new()); threads];
        for i in order {
            if let Some(bin) = bins.iter_mut().min_by_key(|b| b.0) {
                bin.0 += requests[i].len();
                bin.1.push(i);
            }
        }
        let mut out: Vec<Vec<ChunkHash>> = vec![Vec::new(); requests.len()];
        std::thread::scope(|s| {
            let mut own = Vec::new();
            let mut handles = Vec::new();
            for (n, (_, idx)) in bins.into_iter().enumerate() {
                let work = move || {
                    idx.into_iter().map(|i| (i, self.hash_tokens(requests[i]))).collect::<Vec<_>>()
                };
                if n == 0 {
                    own.push(work); // the calling thread takes one bin itself
                } else {
                    handles.push(s.spawn(work));
                }
            }
            let mut done: Vec<(usize, Vec<ChunkHash>)> =
                own.into_iter().flat_map(|w| w()).collect();
            for h in handles {
                // A hashing thread cannot panic short of allocation failure; if it does, its
                // requests are hashed here instead.
                if let Ok(v) = h.join() {
                    done.extend(v);
                }
            }
            for (i, v) in done {
                out[i] = v;
            }
        });
        for (i, r) in requests.iter().enumerate() {
            if out[i].len() != r.len() / self.chunk_size {
                out[i] = self.hash_tokens(r);
            }
        }
        out
    }

    /// A fresh incremental hasher with this chunk size.
    pub fn prefix_hasher(&self) -> PrefixHasher {
        PrefixHasher { chunk_size: self.chunk_size, hashes: Vec::new(), pending: Vec::new() }
    }
}

/// Incremental prefix-chain hasher: feed tokens as a request grows; each complete chunk is
/// hashed once, when its last token arrives.
#[derive(Debug, Clone)]
pub struct PrefixHasher {
    chunk_size: usize,
    hashes: Vec<ChunkHash>,
    /// Tokens of the incomplete trailing chunk (always fewer than `chunk_size`).
    pending: Vec<u32>,
}

impl PrefixHasher {
    /// Appends tokens and returns the hashes of the chunks they completed (possibly none).
    pub fn extend(&mut self, mut tokens: &[u32]) -> &[ChunkHash] {
        let first_new = self.hashes.len();
        if !self.pending.is_empty() {
            let need = self.chunk_size - self.pending.len();
            let take = need.min(tokens.len());
            self.pending.extend_from_slice(&tokens[..take]);
            tokens = &tokens[take..];
            if self.pending.len() == self.chunk_size {
                let h = hash_chunk(self.last(), &self.pending);
                self.hashes.push(h);
                self.pending.clear();
            }
        }
        let mut whole = tokens.chunks_exact(self.chunk_size);
        for chunk in whole.by_ref() {
            let h = hash_chunk(self.last(), chunk);
            self.hashes.push(h);
        }
        self.pending.extend_from_slice(whole.remainder());
        &self.hashes[first_new..]
    }

    /// Every chunk hash so far.
    pub fn hashes(&self) -> &[ChunkHash] {
        &self.hashes
    }

    /// Tokens fed so far.
    pub fn tokens_seen(&self) -> usize {
        self.hashes.len() * self.chunk_size + self.pending.len()
    }

    fn last(&self) -> &ChunkHash {
        self.hashes.last().unwrap_or(&NONE_HASH)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hash_many_equals_hashing_each_request_whatever_the_threads() {
        let h = TokenHasher::new(16).unwrap();
        let reqs: Vec<Vec<u32>> =
            (0..9u32).map(|r| (0..(r * 37 + 5)).map(|t| t ^ (r << 20)).collect()).collect();
        let refs: Vec<&[u32]> = reqs.iter().map(Vec::as_slice).collect();
        let want: Vec<Vec<ChunkHash>> = refs.iter().map(|r| h.hash_tokens(r)).collect();
        for threads in [0, 1, 2, 3, 8, 64] {
            assert_eq!(h.hash_many(&refs, threads), want, "{threads} threads");
        }
        assert!(h.hash_many(&[], 4).is_empty());
    }

    fn hex(h: &ChunkHash) -> String {
        h.to_hex()
    }

    #[test]
    fn none_hash_is_blake3_of_12_zero_bytes() {
        assert_eq!(blake3::hash(&[0u8; 12]).as_bytes(), NONE_HASH.as_bytes());
        assert_eq!(
            hex(&NONE_HASH),
            "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"
        );
    }

    /// Vectors from lmcache-mp-protocol.md section 7.1 (bench sequence 0, C = 256).
    #[test]
    fn lmcache_bench_sequence_vectors() {
        let mut tokens = vec![0u32];
        tokens.extend(std::iter::repeat_n(9906u32, 512));
        let hashes = TokenHasher::default().hash_tokens(&tokens);
        // 513 tokens: two complete chunks, the trailing token is not hashed.
        assert_eq!(hashes.len(), 2);
        assert_eq!(
            hex(&hashes[0]),
            "d65391f7dcbfb7f8472e8942ce76f5ca70a3ab0ffd0978c0640a27d07a9a336f"
        );
        assert_eq!(
            hex(&hashes[1]),
            "4d033f8a28112da0d40257c88d086c2816f3827becdbb9056a484d19d8ea4b64"
        );
    }

    #[test]
    fn lmcache_ascending_vector() {
        let tokens: Vec<u32> = (0..256).collect();
        let hashes = TokenHasher::default().hash_tokens(&tokens);
        assert_eq!(
            hex(&hashes[0]),
            "084547b6c40ed5b05ba8cd0305db5bf74d5617673948d9ed193ab7d6cbc484d4"
        );
    }

    #[test]
    fn partial_chunks_are_not_hashed() {
        let h = TokenHasher::default();
        assert!(h.hash_tokens(&[]).is_empty());
        assert!(h.hash_tokens(&[1; 255]).is_empty());
        assert_eq!(h.hash_tokens(&[1; 256]).len(), 1);
        assert_eq!(h.hash_tokens(&[1; 767]).len(), 2);
    }

    #[test]
    fn long_chunks_hash_like_short_ones() {
        // Chunk sizes above the stack buffer take the streaming path; both are BLAKE3 of the
        // same bytes.
        let tokens: Vec<u32> = (0..1000).collect();
        let mut bytes = NONE_HASH.as_bytes().to_vec();
        tokens.iter().for_each(|t| bytes.extend_from_slice(&t.to_be_bytes()));
        let want = ChunkHash(*blake3::hash(&bytes).as_bytes());
        assert_eq!(TokenHasher::new(1000).unwrap().hash_tokens(&tokens), vec![want]);
    }

    #[test]
    fn zero_chunk_size_is_refused() {
        assert_eq!(TokenHasher::new(0), Err(KeyError::ZeroChunkSize));
    }

    #[test]
    fn tokens_from_i64_names_the_bad_position() {
        assert_eq!(tokens_from_i64(&[0, 5, 4_294_967_295]).unwrap(), vec![0, 5, u32::MAX]);
        assert_eq!(
            tokens_from_i64(&[1, -1]),
            Err(KeyError::TokenOutOfRange { token: -1, position: 1 })
        );
        assert_eq!(
            tokens_from_i64(&[1 << 32]),
            Err(KeyError::TokenOutOfRange { token: 1 << 32, position: 0 })
        );
    }

    #[test]
    fn incremental_growth_hashes_each_chunk_once() {
        let hasher = TokenHasher::new(4).unwrap();
        let mut inc = hasher.prefix_hasher();
        assert!(inc.extend(&[1, 2, 3]).is_empty());
        let new = inc.extend(&[4, 5]).to_vec();
        assert_eq!(new.len(), 1);
        assert_eq!(inc.tokens_seen(), 5);
        let new = inc.extend(&[6, 7, 8, 9, 10, 11, 12]).to_vec();
        assert_eq!(new.len(), 2);
        assert_eq!(inc.hashes(), hasher.hash_tokens(&(1..=12).collect::<Vec<_>>()).as_slice());
    }

    proptest! {
        /// Feeding a sequence in arbitrary pieces gives the same chain as hashing it whole.
        #[test]
        fn incremental_equals_batch(
            tokens in proptest::collection::vec(any::<u32>(), 0..200),
            cuts in proptest::collection::vec(0usize..200, 0..8),
            chunk in 1usize..17,
        ) {
            let hasher = TokenHasher::new(chunk).unwrap();
            let mut inc = hasher.prefix_hasher();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(tokens.len())).collect();
            cuts.sort_unstable();
            let mut start = 0;
            for c in cuts.into_iter().chain([tokens.len()]) {
                inc.extend(&tokens[start..c]);
                start = c;
            }
            let whole = hasher.hash_tokens(&tokens);
            prop_assert_eq!(inc.hashes(), whole.as_slice());
        }

        /// A chunk hash depends on its whole prefix: changing any earlier token changes it.
        #[test]
        fn chain_depends_on_prefix(pos in 0usize..32, delta in 1u32..1000) {
            let hasher = TokenHasher::new(8).unwrap();
            let a: Vec<u32> = (0..32).collect();
            let mut b = a.clone();
            b[pos] = b[pos].wrapping_add(delta);
            prop_assert_ne!(hasher.hash_tokens(&a)[3], hasher.hash_tokens(&b)[3]);
        }
    }
}
