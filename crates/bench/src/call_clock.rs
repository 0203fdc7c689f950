//! [`CallClock`]: a backend that wraps another and times its calls that make and unmake
//! commits (create, map, set access, unmap, release), so that a benchmark can say where a
//! manager operation's time went, call by call, on any backend.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvvm::hal::decorate::Forward;
use kvvm::hal::{
    AccessDescriptor, AllocationProperties, BackendResult, DeviceAddress, Operation,
    PhysicalHandle, VirtualMemoryBackend,
};

/// The operations a [`CallClock`] times, in the order of [`CallTimes::ops`].
pub const TIMED_OPS: [Operation; 5] = [
    Operation::Create,
    Operation::Map,
    Operation::SetAccess,
    Operation::Unmap,
    Operation::Release,
];

/// Calls and the wall time they took, per operation of [`TIMED_OPS`], and the first of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallTimes {
    /// `(calls, time)` per operation, in the order of [`TIMED_OPS`].
    pub ops: [(u64, Duration); 5],
    /// The first timed call and its time (summed by [`add`](Self::add) over calls of the
    /// same operation): a driver that defers work of earlier calls (a release) to the next
    /// call shows it there.
    pub first: Option<(Operation, Duration)>,
}

impl CallTimes {
    /// The calls and time of `op` (zero for an operation not timed).
    pub fn of(&self, op: Operation) -> (u64, Duration) {
        TIMED_OPS
            .iter()
            .position(|o| *o == op)
            .and_then(|i| self.ops.get(i).copied())
            .unwrap_or_default()
    }

    /// Adds `other` to these.
    pub fn add(&mut self, other: &CallTimes) {
        for (a, b) in self.ops.iter_mut().zip(other.ops) {
            a.0 = a.0.saturating_add(b.0);
            a.1 = a.1.saturating_add(b.1);
        }
        self.first = match (self.first, other.first) {
            (Some((a, x)), Some((b, y))) if a == b => Some((a, x.saturating_add(y))),
            (None, f) | (f, None) => f,
            (Some(_), Some(_)) => None,
        };
    }

    /// These divided by `n` (calls rounded down; `n` = 0 gives them unchanged).
    pub fn per(&self, n: u64) -> CallTimes {
        let n32 = u32::try_from(n.max(1)).unwrap_or(u32::MAX);
        let mut out = *self;
        for (calls, time) in &mut out.ops {
            *calls /= n.max(1);
            *time /= n32;
        }
        out.first = out.first.map(|(op, t)| (op, t / n32));
        out
    }
}

/// Wraps a backend and adds up the wall time of each call of [`TIMED_OPS`]; every other
/// call goes to the backend underneath untouched.
pub struct CallClock {
    inner: Arc<dyn VirtualMemoryBackend>,
    spent: Mutex<CallTimes>,
}

impl CallClock {
    /// A clock over `inner`, at zero.
    pub fn new(inner: Arc<dyn VirtualMemoryBackend>) -> Self {
        CallClock {
            inner,
            spent: Mutex::new(CallTimes::default()),
        }
    }

    /// The calls and times since the last take (or creation), and the clock back at zero.
    pub fn take(&self) -> CallTimes {
        std::mem::take(&mut *self.spent.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn timed<T>(&self, op: Operation, call: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let out = call();
        let took = t0.elapsed();
        if let Some(i) = TIMED_OPS.iter().position(|o| *o == op) {
            let mut spent = self.spent.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(slot) = spent.ops.get_mut(i) {
                slot.0 = slot.0.saturating_add(1);
                slot.1 = slot.1.saturating_add(took);
            }
            spent.first.get_or_insert((op, took));
        }
        out
    }
}

impl Forward for CallClock {
    fn inner(&self) -> &dyn VirtualMemoryBackend {
        &*self.inner
    }

    fn create(
        &self,
        size: u64,
        properties: &AllocationProperties,
    ) -> BackendResult<PhysicalHandle> {
        self.timed(Operation::Create, || self.inner.create(size, properties))
    }

    fn release(&self, handle: PhysicalHandle) -> BackendResult<()> {
        self.timed(Operation::Release, || self.inner.release(handle))
    }

    fn map(&self, address: DeviceAddress, size: u64, handle: PhysicalHandle) -> BackendResult<()> {
        self.timed(Operation::Map, || self.inner.map(address, size, handle))
    }

    fn set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> BackendResult<()> {
        self.timed(Operation::SetAccess, || {
            self.inner.set_access(address, size, access)
        })
    }

    fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        self.timed(Operation::Unmap, || self.inner.unmap(address, size))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvvm::hal::DeviceId;
    use kvvm::sim::{SimBackend, SimConfig};

    #[test]
    fn counts_each_timed_call_and_starts_again_at_zero() {
        let g = 64 << 10;
        let sim = Arc::new(SimBackend::new(SimConfig::single(g, 16 * g)));
        let clock = CallClock::new(sim.clone());
        let b: &dyn VirtualMemoryBackend = &clock;
        let props = AllocationProperties::device(DeviceId(0));
        let base = b.reserve(2 * g, 0, None).unwrap();
        let h = b.create(g, &props).unwrap();
        b.map(base, g, h).unwrap();
        b.set_access(base, g, &[AccessDescriptor::read_write(DeviceId(0))])
            .unwrap();
        b.unmap(base, g).unwrap();
        b.release(h).unwrap();
        b.free(base, 2 * g).unwrap();
        let t = clock.take();
        for op in TIMED_OPS {
            assert_eq!(t.of(op).0, 1, "{op}");
        }
        assert_eq!(t.first.map(|f| f.0), Some(Operation::Create));
        assert_eq!(t.of(Operation::Reserve), (0, Duration::ZERO));
        assert_eq!(clock.take(), CallTimes::default());
        let mut sum = t;
        sum.add(&t);
        assert_eq!(sum.of(Operation::Map).0, 2);
        assert_eq!(sum.per(2).of(Operation::Map).0, 1);
        assert_eq!(sum.per(2).first, t.first.map(|(op, d)| (op, d * 2 / 2)));
        assert!(sim.ledger().is_empty());
    }
}
