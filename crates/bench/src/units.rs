//! How the benchmark reports write sizes, times and ratios.

use std::time::Duration;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// `b` in the largest binary unit that divides it (`512 MiB`, `4 GiB`, `3 B`).
pub(crate) fn fmt_bytes(b: u64) -> String {
    let multiple = |unit: u64| b >= unit && b.checked_rem(unit) == Some(0);
    if multiple(GIB) {
        format!("{} GiB", b / GIB)
    } else if multiple(MIB) {
        format!("{} MiB", b / MIB)
    } else if multiple(1024) {
        format!("{} KiB", b / 1024)
    } else {
        format!("{b} B")
    }
}

/// `d` in microseconds, one decimal.
pub(crate) fn us(d: Duration) -> String {
    format!("{:.1} us", d.as_secs_f64() * 1e6)
}

/// `a / b` as `1.23x` (`-` when `b` is zero).
pub(crate) fn ratio(a: Duration, b: Duration) -> String {
    if b.is_zero() {
        "-".to_owned()
    } else {
        format!("{:.2}x", a.as_secs_f64() / b.as_secs_f64())
    }
}
