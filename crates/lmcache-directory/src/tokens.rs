//! Token bindings: the tokens and position of each chunk hash, as the store events carried
//! them, for answers that echo a chunk's tokens. Only chunks stored with tokens have one.
//! Bounded: past the limit new chunks are indexed without their tokens (LMCache's contract
//! allows "empty when unknown"), counted.

use std::collections::HashMap;
use std::sync::Arc;

/// The tokens of one chunk hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBinding {
    /// The chunk's token ids (empty when unknown).
    pub tokens: Arc<[u32]>,
    /// Position of its first token in the sequence it was stored under; -1 when unknown.
    pub offset: i64,
    /// Keys (ranks, groups) with this chunk hash that the directory holds.
    pub(crate) refs: u32,
}

#[derive(Debug)]
pub(crate) struct Bindings {
    map: HashMap<[u8; 32], TokenBinding, foldhash::fast::RandomState>,
    limit: usize,
    pub(crate) dropped: u64,
}

impl Bindings {
    pub(crate) fn new(limit: usize) -> Self {
        Self { map: HashMap::default(), limit, dropped: 0 }
    }

    /// Whether a binding exists for `hash`.
    pub(crate) fn holds(&self, hash: &[u8; 32]) -> bool {
        self.map.contains_key(hash)
    }

    /// One more key holds `hash`: joins its binding, or creates it from `tokens` (non-empty).
    /// Returns whether the key now holds a reference (false when over the limit, counted).
    pub(crate) fn add_ref(&mut self, hash: &[u8; 32], tokens: &[u32], offset: i64) -> bool {
        if let Some(b) = self.map.get_mut(hash) {
            b.refs += 1;
            if !tokens.is_empty() {
                self.set(hash, tokens, offset);
            }
            return true;
        }
        if tokens.is_empty() {
            return false;
        }
        if self.map.len() >= self.limit {
            self.dropped += 1;
            return false;
        }
        self.map.insert(*hash, TokenBinding { tokens: tokens.into(), offset, refs: 1 });
        true
    }

    /// One key with `hash` left.
    pub(crate) fn release(&mut self, hash: &[u8; 32]) {
        if let Some(b) = self.map.get_mut(hash) {
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                self.map.remove(hash);
            }
        }
    }

    /// Replaces the tokens of an existing binding.
    pub(crate) fn set(&mut self, hash: &[u8; 32], tokens: &[u32], offset: i64) {
        let Some(b) = self.map.get_mut(hash) else { return };
        if *b.tokens != *tokens {
            b.tokens = tokens.into();
            b.offset = offset;
        } else if offset >= 0 {
            // The same tokens reported without their position keep the known one.
            b.offset = offset;
        }
    }

    pub(crate) fn get(&self, hash: &[u8; 32]) -> Option<&TokenBinding> {
        self.map.get(hash)
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bindings_follow_their_keys_and_stay_bounded() {
        let mut b = Bindings::new(1);
        assert!(!b.add_ref(&[1; 32], &[], -1), "no tokens, no binding");
        assert!(b.add_ref(&[1; 32], &[7, 8], 0));
        assert!(b.add_ref(&[1; 32], &[], -1), "a later key joins it");
        assert!(!b.add_ref(&[2; 32], &[9], 256), "over the limit: dropped");
        assert_eq!(b.dropped, 1);
        b.release(&[1; 32]);
        assert_eq!(b.get(&[1; 32]).map(|x| &*x.tokens), Some(&[7u32, 8][..]));
        b.release(&[1; 32]);
        assert!(b.get(&[1; 32]).is_none());
        assert!(b.add_ref(&[2; 32], &[9], 256), "room again after release");
        assert_eq!(b.get(&[2; 32]).map(|x| x.offset), Some(256));
    }
}
