//! A heap buffer whose usable slice starts at an aligned address, for O_DIRECT I/O (fs and
//! raw_block).

use bytes::Bytes;

/// `len` usable bytes starting at a multiple of the alignment.
pub(crate) struct AlignedBuf {
    v: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// `len` zero bytes aligned to `align`.
    pub(crate) fn new(len: usize, align: usize) -> Self {
        let v = vec![0u8; len + align];
        let start = v.as_ptr().align_offset(align).min(align);
        Self { v, start, len }
    }

    /// `len` bytes aligned to `align` holding `parts`, then zeros; written once (no zeroing
    /// pass over what is copied in).
    pub(crate) fn filled(parts: &[&[u8]], len: usize, align: usize) -> Self {
        let mut v: Vec<u8> = Vec::with_capacity(len + align);
        let start = v.as_ptr().align_offset(align).min(align);
        v.resize(start, 0);
        for p in parts {
            v.extend_from_slice(p);
        }
        v.resize(start + len, 0);
        Self { v, start, len }
    }

    /// The aligned slice.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.v[self.start..self.start + self.len]
    }

    /// The first `n` bytes of the aligned slice, without copying.
    pub(crate) fn into_bytes(self, n: usize) -> Bytes {
        Bytes::from(self.v).slice(self.start..self.start + n.min(self.len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_hold_their_parts() {
        for len in [1, 4096, 10_000] {
            let mut b = AlignedBuf::new(len, 4096);
            let s = b.as_mut_slice();
            assert_eq!(s.len(), len);
            assert_eq!(s.as_ptr() as usize % 4096, 0);
        }
        let mut f = AlignedBuf::filled(&[b"ab", b"cd"], 8192, 4096);
        let s = f.as_mut_slice();
        assert_eq!(s.as_ptr() as usize % 4096, 0);
        assert_eq!(&s[..4], b"abcd");
        assert!(s[4..].iter().all(|&x| x == 0));
        assert_eq!(&f.into_bytes(3)[..], b"abc");
    }
}
