//! The seeded random generator (SplitMix64) and the distributions synthetic traces draw from.
//! No external crate: the sequence for a seed is fixed forever, so a seed names a trace, a
//! fault plan or a benchmark's data.

/// SplitMix64's finalizer: a stateless avalanche of 64 bits (what a hash wants for its last
/// step). `SplitMix64::new(x).next_u64()` is `mix64(x + 0x9E37_79B9_7F4A_7C15)`.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64 (Steele, Lea, Flood 2014): 64 bits of state, passes BigCrush, trivially seeded.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.state)
    }

    /// A uniform float in `[0, 1)` (53 random bits).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// An exponential variate of rate `rate` (mean `1 / rate`).
    pub fn exponential(&mut self, rate: f64) -> f64 {
        let u = self.next_f64();
        -(1.0 - u).ln() / rate
    }

    /// A standard normal variate (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// A log-normal variate with the given median and log-space standard deviation.
    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        median * (sigma * self.normal()).exp()
    }

    /// `true` with probability `p`.
    pub fn bernoulli(&mut self, p: f64) -> bool {
        self.next_f64() < p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_is_the_first_draw_of_the_previous_state() {
        assert_eq!(
            mix64(5u64.wrapping_add(0x9E37_79B9_7F4A_7C15)),
            SplitMix64::new(5).next_u64()
        );
    }

    #[test]
    fn same_seed_same_sequence_and_sane_moments() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut r = SplitMix64::new(1);
        let n = 20_000;
        let mean: f64 = (0..n).map(|_| r.exponential(4.0)).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.01, "{mean}");
        let mut below = 0;
        for _ in 0..n {
            if r.lognormal(400.0, 0.8) < 400.0 {
                below += 1;
            }
        }
        assert!((below as f64 / n as f64 - 0.5).abs() < 0.02);
    }
}
