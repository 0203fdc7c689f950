//! [`CallCounts`]: driver calls counted per [`Operation`], the one counter the simulated driver
//! (its call counts and fault plans) and the workload's counting wrapper share.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::Operation;

/// Calls per operation, counted atomically (`&self` everywhere: safe to share).
#[derive(Debug, Default)]
pub struct CallCounts {
    counts: [AtomicU64; Operation::ALL.len()],
}

impl CallCounts {
    /// Counts one call of `op`; returns the count including it.
    pub fn record(&self, op: Operation) -> u64 {
        self.counts[op.index()]
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1)
    }

    /// Calls of `op` so far.
    pub fn get(&self, op: Operation) -> u64 {
        self.counts[op.index()].load(Ordering::Relaxed)
    }

    /// Calls of every operation, indexed by [`Operation::index`].
    pub fn snapshot(&self) -> [u64; Operation::ALL.len()] {
        std::array::from_fn(|i| self.counts[i].load(Ordering::Relaxed))
    }

    /// Calls of `ops` together.
    pub fn total(&self, ops: &[Operation]) -> u64 {
        ops.iter()
            .map(|op| self.get(*op))
            .fold(0u64, u64::saturating_add)
    }

    /// Sets every count back to 0.
    pub fn reset(&self) {
        for c in &self.counts {
            c.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_operation() {
        let c = CallCounts::default();
        assert_eq!(c.record(Operation::Map), 1);
        assert_eq!(c.record(Operation::Map), 2);
        c.record(Operation::Unmap);
        assert_eq!(c.get(Operation::Map), 2);
        assert_eq!(c.total(&Operation::VMM_CALLS), 3);
        assert_eq!(c.snapshot()[Operation::Unmap.index()], 1);
        c.reset();
        assert_eq!(c.total(&Operation::ALL), 0);
    }
}
