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

    /// The aligned slice.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.v[self.start..self.start + self.len]
    }

    /// The first `n` bytes of the aligned slice, without copying.
    pub(crate) fn into_bytes(self, n: usize) -> Bytes {
        Bytes::from(self.v).slice(self.start..self.start + n.min(self.len))
    }
}

/// Largest scratch buffer a thread keeps between calls of [`with_scratch`].
const SCRATCH_KEEP: usize = 128 << 20;

thread_local! {
    static SCRATCH: std::cell::RefCell<Option<AlignedBuf>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` on `len` bytes aligned to `align`, from a buffer this thread keeps (up to 128 MiB)
/// for its next call: a 32 MiB chunk's O_DIRECT read or write then reuses memory whose pages
/// are already in, where a new buffer costs a page fault per 4 KiB (as much time here as the
/// disk's own transfer). The bytes are whatever the last call left: `f` fills what it reads.
pub(crate) fn with_scratch<R>(len: usize, align: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    SCRATCH.with(|cell| {
        // A call nested in `f` (none today) would find the cell borrowed: it gets its own.
        let Ok(mut slot) = cell.try_borrow_mut() else {
            return f(AlignedBuf::new(len, align).as_mut_slice());
        };
        let mut buf = match slot.take() {
            Some(b) if b.v.len() >= len + align => b,
            _ => AlignedBuf::new(len, align),
        };
        // As in `new`: an aligned start within the first `align` bytes, `len` bytes after it.
        buf.start = buf.v.as_ptr().align_offset(align).min(align);
        buf.len = len;
        let r = f(buf.as_mut_slice());
        if buf.v.len() <= SCRATCH_KEEP + align {
            *slot = Some(buf);
        }
        r
    })
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
        let mut f = AlignedBuf::new(8192, 4096);
        f.as_mut_slice()[..4].copy_from_slice(b"abcd");
        assert!(f.as_mut_slice()[4..].iter().all(|&x| x == 0));
        assert_eq!(&f.into_bytes(3)[..], b"abc");
    }

    #[test]
    fn scratch_is_aligned_reused_and_grows() {
        let first = with_scratch(10_000, 4096, |b| {
            assert_eq!((b.len(), b.as_ptr() as usize % 4096), (10_000, 0));
            b.fill(7);
            b.as_ptr() as usize
        });
        // Reused: same memory, smaller view, the old bytes still there.
        with_scratch(5000, 4096, |b| {
            assert_eq!((b.as_ptr() as usize, b.len()), (first, 5000));
            assert!(b.iter().all(|&x| x == 7));
        });
        with_scratch(1 << 20, 4096, |b| {
            assert_eq!((b.len(), b.as_ptr() as usize % 4096), (1 << 20, 0));
        });
        // Too large to keep: served, then dropped.
        with_scratch(SCRATCH_KEEP + 4096, 4096, |b| assert_eq!(b.len(), SCRATCH_KEEP + 4096));
        with_scratch(8, 4096, |b| assert_eq!(b.len(), 8));
    }
}
