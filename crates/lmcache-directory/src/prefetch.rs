//! A read-prefetch hint, so a store batch's table probes overlap their cache misses: the home
//! line of each key a few keys ahead is asked for before the key is stored.
//!
//! A prefetch is advice to the cache, never a load: it cannot fault, changes no program state,
//! and the hardware may ignore it. It takes a reference, so what it names is live memory in any
//! case. This is the crate's one unsafe line.

/// Asks the cache for the line holding `value` (first-level, to be read soon). A no-op on
/// targets other than x86-64.
#[inline(always)]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetcht0` is a hint: it never faults, reads nothing into a register and
    // writes nothing; the address comes from a live reference besides.
    unsafe {
        use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<{ _MM_HINT_T0 }>(std::ptr::from_ref(value).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

#[cfg(test)]
mod tests {
    use super::prefetch;

    #[test]
    fn a_prefetch_changes_nothing() {
        let lines = vec![[7u64; 8]; 64];
        for line in &lines {
            prefetch(line);
        }
        prefetch(&lines[63][7]);
        assert!(lines.iter().flatten().all(|&v| v == 7));
    }
}
