//! Byte-size helpers.

/// One kibibyte.
pub const KIB: u64 = 1 << 10;
/// One mebibyte.
pub const MIB: u64 = 1 << 20;
/// One gibibyte.
pub const GIB: u64 = 1 << 30;

/// Converts a size in GiB, as LMCache's `--l1-size-gb` takes it, to bytes.
///
/// Returns `None` for negative, non-finite or absurdly large values (more than 2^60 bytes).
pub fn gib_to_bytes(gib: f64) -> Option<u64> {
    if !gib.is_finite() || gib < 0.0 {
        return None;
    }
    let bytes = gib * GIB as f64;
    if bytes > (1u64 << 60) as f64 {
        return None;
    }
    Some(bytes as u64)
}

/// Rounds `value` up to a multiple of `align` (a power of two). `None` on overflow.
pub fn align_up(value: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    value.checked_add(align - 1).map(|v| v & !(align - 1))
}

/// Renders a byte count for humans: `1.50 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.2} {}", UNITS[unit]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gib_conversion_rejects_bad_values() {
        assert_eq!(gib_to_bytes(1.0), Some(GIB));
        assert_eq!(gib_to_bytes(0.5), Some(GIB / 2));
        assert_eq!(gib_to_bytes(-1.0), None);
        assert_eq!(gib_to_bytes(f64::NAN), None);
        assert_eq!(gib_to_bytes(f64::INFINITY), None);
        assert_eq!(gib_to_bytes(1e12), None);
    }

    #[test]
    fn align_up_rounds_and_detects_overflow() {
        assert_eq!(align_up(0, 4096), Some(0));
        assert_eq!(align_up(1, 4096), Some(4096));
        assert_eq!(align_up(4096, 4096), Some(4096));
        assert_eq!(align_up(u64::MAX, 4096), None);
    }

    #[test]
    fn human_bytes_picks_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 * MIB / 2), "1.50 MiB");
        assert_eq!(human_bytes(4 * GIB), "4.00 GiB");
    }
}
