//! [`RetryPolicy`]: how `retry_after` is estimated from the recent release rate.

use std::time::Duration;

/// How `retry_after` is estimated (see the crate docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The window over which the release rate is measured.
    pub window: Duration,
    /// The shortest `retry_after` ever suggested.
    pub floor: Duration,
    /// The longest `retry_after` ever suggested (also used when nothing was freed recently).
    pub cap: Duration,
}

impl Default for RetryPolicy {
    /// A 1 s window, a 10 ms floor and a 5 s cap.
    fn default() -> Self {
        RetryPolicy {
            window: Duration::from_secs(1),
            floor: Duration::from_millis(10),
            cap: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// The estimate for a `shortfall` of bytes when `freed_in_window` bytes were freed during
    /// the last [`window`](Self::window): `clamp(shortfall / (freed / window), floor, cap)`,
    /// `cap` when nothing was freed, `floor` when there is no shortfall.
    pub fn estimate(&self, shortfall: u64, freed_in_window: u64) -> Duration {
        let (floor, cap) = (self.floor, self.cap.max(self.floor));
        if shortfall == 0 {
            return floor;
        }
        if freed_in_window == 0 {
            return cap;
        }
        // shortfall / rate = shortfall * window / freed, in nanoseconds, in u128 (no overflow).
        let window_ns = self.window.as_nanos();
        let ns = u128::from(shortfall)
            .saturating_mul(window_ns)
            .checked_div(u128::from(freed_in_window))
            .unwrap_or(u128::MAX);
        let ns = u64::try_from(ns).unwrap_or(u64::MAX);
        Duration::from_nanos(ns).clamp(floor, cap)
    }
}
