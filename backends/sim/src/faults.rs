//! Fault injection: make chosen driver calls fail with a chosen [`ErrorKind`].

use kvvm_hal::{ErrorKind, Operation};
use kvvm_num::SplitMix64;

/// One rule of a [`FaultPlan`]. Call numbers count calls of that operation from the moment
/// the rule was installed, starting at 1.
#[derive(Debug, Clone, PartialEq)]
pub enum FaultRule {
    /// Fail the `n`th call of `op` (only that one).
    Nth {
        /// The operation.
        op: Operation,
        /// Which call, from 1.
        n: u64,
        /// The error kind it fails with.
        kind: ErrorKind,
    },
    /// Fail every call of `op` from the `n`th on.
    FromNth {
        /// The operation.
        op: Operation,
        /// The first failing call, from 1.
        n: u64,
        /// The error kind they fail with.
        kind: ErrorKind,
    },
    /// Fail each call of one of `ops` with probability `probability`, drawing from a
    /// generator seeded with `seed` (the same seed and call sequence give the same faults).
    Random {
        /// The seed.
        seed: u64,
        /// Probability in `[0, 1]` that a call fails.
        probability: f64,
        /// The operations that may fail (empty: every operation).
        ops: Vec<Operation>,
        /// The error kind they fail with.
        kind: ErrorKind,
    },
}

impl FaultRule {
    /// Fail the `n`th call of `op` (1-based) with `kind`.
    pub fn nth(op: Operation, n: u64, kind: ErrorKind) -> Self {
        FaultRule::Nth { op, n, kind }
    }

    /// Fail every call of `op` from the `n`th (1-based) on with `kind`.
    pub fn from_nth(op: Operation, n: u64, kind: ErrorKind) -> Self {
        FaultRule::FromNth { op, n, kind }
    }

    /// A seeded random rule.
    pub fn random(seed: u64, probability: f64, ops: Vec<Operation>, kind: ErrorKind) -> Self {
        FaultRule::Random {
            seed,
            probability,
            ops,
            kind,
        }
    }

    /// Every call of `synchronize` fails with `DeviceLost` (a teardown that cannot prove the
    /// device idle).
    pub fn failing_synchronize() -> Self {
        FaultRule::from_nth(Operation::Synchronize, 1, ErrorKind::DeviceLost)
    }
}

#[derive(Debug, Clone)]
struct Installed {
    rule: FaultRule,
    base: [u64; Operation::ALL.len()],
    rng: SplitMix64,
}

/// A set of fault rules, consulted on every call.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    rules: Vec<Installed>,
}

impl FaultPlan {
    pub(crate) fn install(&mut self, rule: FaultRule, counts: &[u64; Operation::ALL.len()]) {
        let rng = SplitMix64::new(match &rule {
            FaultRule::Random { seed, .. } => *seed,
            _ => 0,
        });
        self.rules.push(Installed {
            rule,
            base: *counts,
            rng,
        });
    }

    pub(crate) fn clear(&mut self) {
        self.rules.clear();
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Decides whether the call of `op` that has just been counted (`counts` already
    /// includes it) fails.
    pub(crate) fn check(
        &mut self,
        op: Operation,
        counts: &[u64; Operation::ALL.len()],
    ) -> Option<ErrorKind> {
        let i = op.index();
        let mut hit = None;
        for installed in &mut self.rules {
            let n_since = counts[i].saturating_sub(installed.base[i]);
            let fires = match &installed.rule {
                FaultRule::Nth { op: o, n, .. } => *o == op && n_since == *n,
                FaultRule::FromNth { op: o, n, .. } => *o == op && n_since >= *n,
                FaultRule::Random {
                    probability, ops, ..
                } => {
                    if ops.is_empty() || ops.contains(&op) {
                        // 53 random bits as a uniform value in [0, 1).
                        installed.rng.next_f64() < *probability
                    } else {
                        false
                    }
                }
            };
            if fires && hit.is_none() {
                hit = Some(match &installed.rule {
                    FaultRule::Nth { kind, .. }
                    | FaultRule::FromNth { kind, .. }
                    | FaultRule::Random { kind, .. } => *kind,
                });
            }
        }
        hit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts_with(op: Operation, n: u64) -> [u64; Operation::ALL.len()] {
        let mut c = [0; Operation::ALL.len()];
        c[op.index()] = n;
        c
    }

    #[test]
    fn nth_fires_once() {
        let mut plan = FaultPlan::default();
        plan.install(
            FaultRule::nth(Operation::Map, 2, ErrorKind::OutOfMemory),
            &counts_with(Operation::Map, 5),
        );
        assert_eq!(
            plan.check(Operation::Map, &counts_with(Operation::Map, 6)),
            None
        );
        assert_eq!(
            plan.check(Operation::Map, &counts_with(Operation::Map, 7)),
            Some(ErrorKind::OutOfMemory)
        );
        assert_eq!(
            plan.check(Operation::Map, &counts_with(Operation::Map, 8)),
            None
        );
        assert_eq!(
            plan.check(Operation::Create, &counts_with(Operation::Create, 7)),
            None
        );
    }

    #[test]
    fn from_nth_keeps_firing() {
        let mut plan = FaultPlan::default();
        plan.install(
            FaultRule::from_nth(Operation::Unmap, 1, ErrorKind::DeviceLost),
            &[0; Operation::ALL.len()],
        );
        for n in 1..10 {
            assert_eq!(
                plan.check(Operation::Unmap, &counts_with(Operation::Unmap, n)),
                Some(ErrorKind::DeviceLost)
            );
        }
    }

    #[test]
    fn random_is_reproducible_and_roughly_calibrated() {
        let run = |seed| {
            let mut plan = FaultPlan::default();
            plan.install(
                FaultRule::random(seed, 0.25, vec![Operation::Create], ErrorKind::OutOfMemory),
                &[0; Operation::ALL.len()],
            );
            (1..=4000)
                .map(|n| {
                    plan.check(Operation::Create, &counts_with(Operation::Create, n))
                        .is_some()
                })
                .collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7));
        assert_ne!(a, run(8));
        let hits = a.iter().filter(|h| **h).count();
        assert!((800..1200).contains(&hits), "{hits} hits of 4000 at p=0.25");
    }
}
