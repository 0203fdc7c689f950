//! Where the bytes of a cached prefix came from: a prefix's tokens as runs, each run written
//! by one request's prefill (its *origin*, a number never given twice in a process) and since
//! then only mapped read-only or copied (to a request's windows, to the host level and back).
//!
//! Two sequences whose first `n` tokens have the same runs hold the same bytes there. An origin
//! is minted when a request's new blocks are published (or a prefix made elsewhere is
//! inserted), after the runs the request was admitted with, which are fixed from then on: the
//! origin of the run holding token `n - 1` therefore fixes every run before it, and the pair
//! (that origin, `n`) identifies the first `n` tokens' bytes
//! ([`AdmissionInfo::hit_origin`](crate::AdmissionInfo::hit_origin)). Token ids alone
//! do not: a prefix evicted and computed again holds the bytes of another prefill.

use std::sync::atomic::{AtomicU64, Ordering};

/// The next origin (0 is none).
static NEXT_ORIGIN: AtomicU64 = AtomicU64::new(1);

/// A new origin, never given before in this process.
fn mint() -> u64 {
    NEXT_ORIGIN.fetch_add(1, Ordering::Relaxed)
}

/// The runs of a prefix's tokens (see the module): `(end, origin)` by increasing `end`, the
/// first run from token 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Lineage {
    runs: Vec<(u64, u64)>,
}

impl Lineage {
    /// Tokens `0..tokens` of one new origin (a prefix made elsewhere, inserted); none for 0.
    pub(crate) fn fresh(tokens: u64) -> Lineage {
        Lineage::default().extended(tokens)
    }

    /// Tokens the runs cover.
    pub(crate) fn tokens(&self) -> u64 {
        self.runs.last().map_or(0, |r| r.0)
    }

    /// The runs of the first `n` tokens (all of them when `n` is past the end).
    pub(crate) fn truncated(&self, n: u64) -> Lineage {
        let mut runs = Vec::new();
        let mut from = 0;
        for &(end, origin) in &self.runs {
            if from >= n {
                break;
            }
            runs.push((end.min(n), origin));
            from = end;
        }
        Lineage { runs }
    }

    /// These runs, then tokens up to `end` of a new origin (this one unchanged when `end` is
    /// not past its end): what a request publishes, written past its hit by its prefill.
    pub(crate) fn extended(&self, end: u64) -> Lineage {
        let mut out = self.clone();
        if end > self.tokens() {
            out.runs.push((end, mint()));
        }
        out
    }

    /// The origin of token `n - 1` (0 for `n == 0` or past the end): with `n`, what
    /// identifies the first `n` tokens' bytes.
    pub(crate) fn origin_at(&self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        self.runs
            .iter()
            .find(|(end, _)| *end >= n)
            .map_or(0, |(_, origin)| *origin)
    }

    /// Whether the first `n` tokens have the same runs in both (both covering them).
    pub(crate) fn agrees(&self, other: &Lineage, n: u64) -> bool {
        n == 0
            || (self.tokens() >= n
                && other.tokens() >= n
                && self.truncated(n) == other.truncated(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_origin_is_new_and_none_is_zero() {
        let a = Lineage::fresh(32);
        let b = Lineage::fresh(32);
        assert_ne!(a.origin_at(32), b.origin_at(32));
        assert_ne!(a.origin_at(1), 0);
        assert_eq!(a.origin_at(0), 0);
        assert_eq!(a.origin_at(33), 0, "past the end: no origin");
        assert_eq!(Lineage::fresh(0), Lineage::default());
        assert!(!a.agrees(&b, 1) && a.agrees(&b, 0));
    }

    #[test]
    fn a_publication_keeps_the_runs_it_was_admitted_with() {
        // A prefix of 64 tokens; a request hits 48 of them and writes up to 80.
        let first = Lineage::fresh(64);
        let second = first.truncated(48).extended(80);
        assert_eq!(second.tokens(), 80);
        assert_eq!(second.origin_at(48), first.origin_at(48));
        assert!(second.agrees(&first, 48));
        assert!(
            !second.agrees(&first, 49),
            "token 48 is the second request's"
        );
        assert_ne!(second.origin_at(49), first.origin_at(49));
        // A third request hitting 48 tokens of the second's entry: the first's bytes.
        let third = second.truncated(48);
        assert_eq!(third, first.truncated(48));
        assert_eq!(third.origin_at(48), first.origin_at(48));
        // Truncation past the end, extension not past it: unchanged.
        assert_eq!(second.truncated(1000), second);
        assert_eq!(second.extended(80), second);
        assert_eq!(second.extended(10), second);
    }

    #[test]
    fn the_same_tokens_prefilled_again_have_another_origin() {
        let before = Lineage::fresh(64);
        let again = Lineage::fresh(64);
        assert!(!before.agrees(&again, 16));
        assert_ne!(before.origin_at(16), again.origin_at(16));
        // An origin with its token count fixes every earlier run.
        let a = before.truncated(16).extended(40);
        let b = again.truncated(16).extended(40);
        assert_ne!(a.origin_at(40), b.origin_at(40));
    }

    #[test]
    fn agreement_needs_both_to_cover_the_tokens() {
        let a = Lineage::fresh(20);
        assert!(a.agrees(&a, 20));
        assert!(!a.agrees(&a, 21));
        assert!(!a.agrees(&a.truncated(10), 15));
        assert!(a.agrees(&a.truncated(10), 10));
    }
}
