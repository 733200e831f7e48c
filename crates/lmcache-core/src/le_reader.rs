//! A bounds-checked cursor over little-endian bytes: what the binary formats above read with
//! (the directory's checkpoint image, the JetStream feed's batches). Every read checks the
//! length first and names the offset where the input ran out; nothing here panics on input.

/// The input ended before a read: the offset of the read that did not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("truncated at byte {0}")]
pub struct Truncated(pub usize);

/// A cursor over `bytes`, from offset 0.
#[derive(Debug, Clone)]
pub struct LeReader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> LeReader<'a> {
    /// A cursor at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, at: 0 }
    }

    /// The offset of the next read.
    pub fn at(&self) -> usize {
        self.at
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], Truncated> {
        let end =
            self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or(Truncated(self.at))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], Truncated> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    /// A byte.
    pub fn u8(&mut self) -> Result<u8, Truncated> {
        Ok(self.take(1)?[0])
    }

    /// A little-endian `u16`.
    pub fn u16(&mut self) -> Result<u16, Truncated> {
        self.array().map(u16::from_le_bytes)
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32, Truncated> {
        self.array().map(u32::from_le_bytes)
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64, Truncated> {
        self.array().map(u64::from_le_bytes)
    }

    /// Whether `n` items of at least `min` bytes each fit in what is left: a count read from
    /// the input is checked with this before anything is reserved for it, so a forged count
    /// cannot make the reader allocate.
    pub fn holds(&self, n: usize, min: usize) -> bool {
        n.checked_mul(min).is_some_and(|need| need <= self.remaining())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_little_endian_and_names_where_the_input_ran_out() {
        let mut r = LeReader::new(&[1, 2, 0, 3, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 9]);
        assert_eq!(r.u8(), Ok(1));
        assert_eq!(r.u16(), Ok(2));
        assert_eq!(r.u32(), Ok(3));
        assert_eq!(r.u64(), Ok(4));
        assert_eq!((r.at(), r.remaining()), (15, 1));
        assert!(r.holds(1, 1) && !r.holds(2, 1) && !r.holds(usize::MAX, 2));
        assert_eq!(r.u16(), Err(Truncated(15)));
        assert_eq!(r.take(usize::MAX), Err(Truncated(15)));
        assert_eq!(r.at(), 15, "a failed read moves nothing");
        assert_eq!(r.array::<1>(), Ok([9]));
        assert_eq!(r.u8(), Err(Truncated(16)));
    }
}
