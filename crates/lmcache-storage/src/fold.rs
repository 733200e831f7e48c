//! What a prefix hit means when a model stores several object groups (LMCache's
//! `bitmap_ops/fold.py`): a row is one (object group, shard) over the request's chunks, with
//! the chunks present in it and its window. A prefix of `L` chunks is servable by a row when
//! its last `min(w, L)` chunks are present (full attention: all `L`); the hit is the longest
//! prefix every row serves. [`fold`] finds it; [`needed`] names the cells it needs, which are
//! all a lookup locks and all a retrieve restores.

/// Chunks a row needs for a prefix: `None` for full attention, `Some(w)` for the last `w`.
pub type Window = Option<usize>;

/// Whether `present` (one flag per chunk) serves a prefix of `len` chunks under `window`.
pub fn serves(present: &[bool], window: Window, len: usize) -> bool {
    if len > present.len() {
        return false;
    }
    let from = match window {
        None => 0,
        Some(w) => len.saturating_sub(w.max(1)),
    };
    present[from..len].iter().all(|&p| p)
}

/// The longest prefix every row serves (0 when none serves even one chunk). Rows may differ
/// in length; a prefix longer than the shortest row is not servable.
pub fn fold(rows: &[(&[bool], Window)]) -> usize {
    let n = rows.iter().map(|(p, _)| p.len()).min().unwrap_or(0);
    (1..=n).rev().find(|&len| rows.iter().all(|(p, w)| serves(p, *w, len))).unwrap_or(0)
}

/// The chunks of a row a prefix of `len` chunks needs: `[0, len)`, or `[len - w, len)`.
pub fn needed(window: Window, len: usize) -> std::ops::Range<usize> {
    match window {
        None => 0..len,
        Some(w) => len.saturating_sub(w.max(1))..len,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn full_attention_is_the_common_prefix_and_windows_need_their_tail() {
        let full = [true, true, true, false];
        let sw = [false, false, true, true];
        assert_eq!(fold(&[(&full, None)]), 3);
        assert_eq!(fold(&[(&full, None), (&sw, Some(1))]), 3);
        assert_eq!(fold(&[(&full, None), (&sw, Some(2))]), 0, "every length misses a window chunk");
        let sw2 = [false, true, true, true];
        assert_eq!(fold(&[(&full, None), (&sw2, Some(2))]), 3);
        // A recurrent group (window 1) without its last chunk of a 3-chunk prefix.
        let rec = [true, true, false, true];
        assert_eq!(fold(&[(&full, None), (&rec, Some(1))]), 2);
        // Not monotone: 2 chunks fail, 3 serve; the longest wins.
        let holes = [false, false, true];
        assert_eq!(fold(&[(&holes, Some(1))]), 3);
        assert_eq!(needed(Some(2), 3), 1..3);
        assert_eq!(needed(None, 3), 0..3);
        assert_eq!(needed(Some(5), 3), 0..3);
        assert_eq!(fold(&[]), 0);
    }

    /// The reference: try every length, brute force, straight from the definition.
    fn reference(rows: &[(Vec<bool>, Window)]) -> usize {
        let n = rows.iter().map(|(p, _)| p.len()).min().unwrap_or(0);
        let mut best = 0;
        for len in 0..=n {
            let ok = rows.iter().all(|(p, w)| {
                let k = match w {
                    None => len,
                    Some(w) => (*w).max(1).min(len),
                };
                (len - k..len).all(|i| p[i])
            });
            if ok {
                best = len;
            }
        }
        best
    }

    proptest! {
        #[test]
        fn fold_equals_the_reference_and_needed_cells_are_present(
            rows in prop::collection::vec(
                (prop::collection::vec(any::<bool>(), 0..12), prop::option::of(1usize..5)),
                1..5,
            )
        ) {
            let view: Vec<(&[bool], Window)> = rows.iter().map(|(p, w)| (p.as_slice(), *w)).collect();
            let hit = fold(&view);
            prop_assert_eq!(hit, reference(&rows));
            for (p, w) in &rows {
                // Everything the hit needs is present: nothing is promised that is not there.
                for i in needed(*w, hit) {
                    prop_assert!(p[i], "row {:?} window {:?} hit {} needs missing chunk {}", p, w, hit, i);
                }
                // And a full-attention row's needs are exactly the prefix.
                if w.is_none() {
                    prop_assert_eq!(needed(None, hit), 0..hit);
                }
            }
            // No longer prefix is servable by every row.
            let n = rows.iter().map(|(p, _)| p.len()).min().unwrap_or(0);
            for len in hit + 1..=n {
                prop_assert!(!view.iter().all(|(p, w)| serves(p, *w, len)));
            }
        }
    }
}
