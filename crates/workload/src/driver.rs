//! Driver-call accounting: a counting wrapper around any backend, and the cost model of the
//! policies that do not use the virtual-memory API.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvvm_hal::{
    AccessDescriptor, AllocationProperties, BackendResult, CallCounts, Capabilities, DeviceAddress,
    DeviceId, DeviceInfo, Granularity, KernelProbe, LatencyModel, MemoryInfo, Operation,
    PhysicalHandle, VirtualMemoryBackend,
};

/// The operations counted as driver calls (copies of KV bytes are counted apart).
const COUNTED: [Operation; 8] = Operation::VMM_CALLS;

fn slot(op: Operation) -> Option<usize> {
    COUNTED.iter().position(|o| *o == op)
}

/// Time spent in one operation (its calls are in the backend's [`CallCounts`]).
#[derive(Debug, Default)]
struct OpTime {
    modelled_ns: AtomicU64,
    measured_ns: AtomicU64,
}

/// Driver calls of a run, with their modelled and measured time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverTally {
    /// Calls of the counted operations (reserve, free, create, release, map, set access,
    /// unmap, synchronize).
    pub calls: u64,
    /// Time the H200 latency model attributes to them.
    pub modelled: Duration,
    /// Wall time measured around them (meaningful on a real GPU only).
    pub measured: Duration,
    /// Reserve calls (part of `calls`).
    pub reserves: u64,
    /// Free calls (part of `calls`).
    pub frees: u64,
    /// Host-to-device copies of KV bytes (not part of `calls`).
    pub kv_copies: u64,
    /// Bytes copied by them.
    pub kv_copy_bytes: u64,
}

/// A [`VirtualMemoryBackend`] that forwards every call to another one and counts the calls of
/// each operation, their modelled cost ([`LatencyModel::h200`]) and their measured wall time.
pub struct CountingBackend {
    inner: Arc<dyn VirtualMemoryBackend>,
    granule: u64,
    model: LatencyModel,
    calls: CallCounts,
    ops: [OpTime; 8],
    kv_copies: AtomicU64,
    kv_copy_bytes: AtomicU64,
}

impl std::fmt::Debug for CountingBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CountingBackend")
            .field("inner", &self.inner.name())
            .field("tally", &self.tally())
            .finish()
    }
}

impl CountingBackend {
    /// Wraps `inner`; `granule` converts sizes to granules for the latency model.
    pub fn new(inner: Arc<dyn VirtualMemoryBackend>, granule: u64) -> Self {
        CountingBackend {
            inner,
            granule: granule.max(1),
            model: LatencyModel::h200(),
            calls: CallCounts::default(),
            ops: Default::default(),
            kv_copies: AtomicU64::new(0),
            kv_copy_bytes: AtomicU64::new(0),
        }
    }

    /// What was counted so far.
    pub fn tally(&self) -> DriverTally {
        let mut t = DriverTally::default();
        for (op, c) in COUNTED.iter().zip(&self.ops) {
            let calls = self.calls.get(*op);
            t.calls = t.calls.saturating_add(calls);
            t.modelled = t
                .modelled
                .saturating_add(Duration::from_nanos(c.modelled_ns.load(Ordering::Relaxed)));
            t.measured = t
                .measured
                .saturating_add(Duration::from_nanos(c.measured_ns.load(Ordering::Relaxed)));
            match op {
                Operation::Reserve => t.reserves = calls,
                Operation::Free => t.frees = calls,
                _ => {}
            }
        }
        t.kv_copies = self.kv_copies.load(Ordering::Relaxed);
        t.kv_copy_bytes = self.kv_copy_bytes.load(Ordering::Relaxed);
        t
    }

    fn timed<T>(&self, op: Operation, units: u64, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        let took = start.elapsed();
        if let Some(c) = slot(op).and_then(|i| self.ops.get(i)) {
            self.calls.record(op);
            let modelled = u64::try_from(self.model.cost(op, units).as_nanos()).unwrap_or(u64::MAX);
            c.modelled_ns.fetch_add(modelled, Ordering::Relaxed);
            let measured = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
            c.measured_ns.fetch_add(measured, Ordering::Relaxed);
        }
        out
    }

    fn granules(&self, size: u64) -> u64 {
        size.div_ceil(self.granule).max(1)
    }
}

impl VirtualMemoryBackend for CountingBackend {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn devices(&self) -> BackendResult<Vec<DeviceInfo>> {
        self.inner.devices()
    }
    fn memory_info(&self, device: DeviceId) -> BackendResult<MemoryInfo> {
        self.inner.memory_info(device)
    }
    fn granularity(&self, properties: &AllocationProperties) -> BackendResult<Granularity> {
        self.inner.granularity(properties)
    }
    fn reserve(
        &self,
        size: u64,
        alignment: u64,
        fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress> {
        self.timed(Operation::Reserve, 1, || {
            self.inner.reserve(size, alignment, fixed_address)
        })
    }
    fn free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        self.timed(Operation::Free, 1, || self.inner.free(address, size))
    }
    fn create(
        &self,
        size: u64,
        properties: &AllocationProperties,
    ) -> BackendResult<PhysicalHandle> {
        self.timed(Operation::Create, 1, || self.inner.create(size, properties))
    }
    fn release(&self, handle: PhysicalHandle) -> BackendResult<()> {
        self.timed(Operation::Release, 1, || self.inner.release(handle))
    }
    fn map(&self, address: DeviceAddress, size: u64, handle: PhysicalHandle) -> BackendResult<()> {
        self.timed(Operation::Map, 1, || self.inner.map(address, size, handle))
    }
    fn set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> BackendResult<()> {
        self.timed(Operation::SetAccess, self.granules(size), || {
            self.inner.set_access(address, size, access)
        })
    }
    fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        self.timed(Operation::Unmap, self.granules(size), || {
            self.inner.unmap(address, size)
        })
    }
    fn synchronize(&self, device: DeviceId) -> BackendResult<()> {
        self.timed(Operation::Synchronize, 1, || self.inner.synchronize(device))
    }
    fn copy_to_device(&self, dst: DeviceAddress, src: &[u8]) -> BackendResult<()> {
        self.kv_copies.fetch_add(1, Ordering::Relaxed);
        self.kv_copy_bytes
            .fetch_add(src.len() as u64, Ordering::Relaxed);
        self.inner.copy_to_device(dst, src)
    }
    fn copy_from_device(&self, dst: &mut [u8], src: DeviceAddress) -> BackendResult<()> {
        self.inner.copy_from_device(dst, src)
    }
    fn export_posix_fd(&self, handle: PhysicalHandle) -> BackendResult<OwnedFd> {
        self.inner.export_posix_fd(handle)
    }
    fn import_posix_fd(
        &self,
        device: DeviceId,
        fd: BorrowedFd<'_>,
    ) -> BackendResult<PhysicalHandle> {
        self.inner.import_posix_fd(device, fd)
    }

    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> BackendResult<bool> {
        self.inner.can_access_peer(device, peer)
    }
    fn kernel_probe(&self) -> Option<&dyn KernelProbe> {
        self.inner.kernel_probe()
    }
}

/// Modelled cost of the calls of the policies that use `cudaMalloc`-style allocations instead
/// of the virtual-memory API, derived from the H200 measurements of `docs/driver-semantics.md`.
pub mod classic {
    use std::time::Duration;

    /// One allocation of any size: create + map + set access of one handle
    /// (11.8 + 1.1 + 29.4 us).
    pub const ALLOC: Duration = Duration::from_nanos(42_300);
    /// One free: unmap + release of one handle (22.4 + 14.0 us).
    pub const FREE: Duration = Duration::from_nanos(36_400);

    /// Measured naive growth on the H200 (`cuMemAlloc` of size + 2 MiB, `cuMemcpyDtoD`, free of
    /// the old block), best of 3: (bytes, microseconds).
    const GROWTH: [(u64, f64); 5] = [
        (0, 78.7),
        (256 << 20, 416.0),
        (1 << 30, 1330.0),
        (4 << 30, 4227.0),
        (16 << 30, 15821.0),
    ];

    /// Modelled time of one allocate-copy-free growth to `bytes`, interpolated linearly
    /// between the measured points (and extrapolated past 16 GiB with the last slope).
    pub fn growth(bytes: u64) -> Duration {
        let x = bytes as f64;
        let mut us = 0.0;
        for pair in GROWTH.windows(2) {
            let ((x0, y0), (x1, y1)) = match pair {
                [a, b] => (*a, *b),
                _ => continue,
            };
            let (x0, x1) = (x0 as f64, x1 as f64);
            us = y0 + (y1 - y0) * (x - x0) / (x1 - x0);
            if x <= x1 {
                break;
            }
        }
        Duration::from_nanos((us.max(0.0) * 1000.0) as u64)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn growth_hits_the_measured_points() {
            assert_eq!(growth(1 << 30), Duration::from_micros(1330));
            assert_eq!(growth(16 << 30), Duration::from_micros(15821));
            assert!(growth(32 << 30) > growth(16 << 30));
            assert!(growth(0) > Duration::ZERO);
        }
    }
}
