//! [`Stats`]: the summary (min, median, p90 by nearest rank) of one case's samples.

use std::time::Duration;

/// Summary of the samples of one case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    /// Number of samples.
    pub samples: usize,
    /// Fastest sample.
    pub min: Duration,
    /// Median (nearest rank).
    pub median: Duration,
    /// 90th percentile (nearest rank).
    pub p90: Duration,
}

impl Stats {
    /// Summarises samples (`None` if there are none).
    pub fn from_samples(mut samples: Vec<Duration>) -> Option<Stats> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let n = samples.len();
        let rank = |p: usize| {
            // Nearest rank: ceil(p/100 * n), 1-based.
            let r = (p.saturating_mul(n)).div_ceil(100).clamp(1, n);
            samples.get(r - 1).copied().unwrap_or_default()
        };
        Some(Stats {
            samples: n,
            min: samples.first().copied().unwrap_or_default(),
            median: rank(50),
            p90: rank(90),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn stats_nearest_rank() {
        let v: Vec<Duration> = (1..=10).map(Duration::from_micros).collect();
        let s = Stats::from_samples(v).unwrap();
        assert_eq!(
            (s.samples, s.min, s.median, s.p90),
            (
                10,
                Duration::from_micros(1),
                Duration::from_micros(5),
                Duration::from_micros(9)
            )
        );
        assert_eq!(Stats::from_samples(Vec::new()), None);
        let one = Stats::from_samples(vec![Duration::from_micros(7)]).unwrap();
        assert_eq!(
            (one.median, one.p90),
            (Duration::from_micros(7), Duration::from_micros(7))
        );
    }
}
