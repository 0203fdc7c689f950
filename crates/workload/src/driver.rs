//! Driver-call accounting: a counting wrapper around any backend, and the cost model of the
//! policies that do not use the virtual-memory API.

use kvvm_hal::sync::Unpoison;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvvm_hal::model::DriverModel;
use kvvm_hal::{
    AccessDescriptor, AllocationProperties, BackendError, BackendResult, CallCounts, DeviceAddress,
    DeviceId, LatencyModel, Operation, PhysicalHandle, VirtualMemoryBackend,
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
    /// Mappings made (successful maps).
    pub mappings: u64,
    /// Handles created (successful creates; a handle from the manager's pool is not created
    /// again).
    pub handles: u64,
    /// Most mappings live at once.
    pub peak_mappings: u64,
}

/// What the model charges depends on: the size of each live handle, and each live mapping's
/// size and whether a device has access to it yet: the driver's state as the calls that
/// succeeded through the wrapper left it (a handle imported through it has no known size and
/// is charged as 0 bytes).
#[derive(Debug)]
struct Books {
    model: DriverModel,
    /// Mappings made, handles created, most mappings live at once.
    made: u64,
    created: u64,
    peak: u64,
}

impl Default for Books {
    fn default() -> Self {
        Books {
            model: DriverModel::new(0, BackendError::raised),
            made: 0,
            created: 0,
            peak: 0,
        }
    }
}

/// A [`VirtualMemoryBackend`] that forwards every call to another one and counts the calls of
/// each operation, their modelled cost ([`LatencyModel::h200`], charged for what each call
/// covers: handle sizes, fresh mappings, unmapped mappings) and their measured wall time.
pub struct CountingBackend {
    inner: Arc<dyn VirtualMemoryBackend>,
    model: LatencyModel,
    books: Mutex<Books>,
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
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn VirtualMemoryBackend>) -> Self {
        CountingBackend {
            inner,
            model: LatencyModel::h200(),
            books: Mutex::new(Books::default()),
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
        let books = self.books();
        t.mappings = books.made;
        t.handles = books.created;
        t.peak_mappings = books.peak;
        t
    }

    /// The books; each edit is one step under the lock, so a poisoned lock is recovered.
    fn books(&self) -> MutexGuard<'_, Books> {
        self.books.lock().unpoisoned()
    }

    /// Runs one call of `op`, counts it, and charges the model for `(bytes, mappings)` when
    /// it succeeded (a failed call as covering nothing, as the simulator does).
    fn timed<T>(
        &self,
        op: Operation,
        (bytes, mappings): (u64, u64),
        f: impl FnOnce() -> BackendResult<T>,
    ) -> BackendResult<T> {
        let start = Instant::now();
        let out = f();
        let took = start.elapsed();
        if let Some(c) = slot(op).and_then(|i| self.ops.get(i)) {
            self.calls.record(op);
            let cost = if out.is_ok() {
                self.model.cost(op, bytes, mappings)
            } else {
                self.model.cost(op, 0, 0)
            };
            let modelled = u64::try_from(cost.as_nanos()).unwrap_or(u64::MAX);
            c.modelled_ns.fetch_add(modelled, Ordering::Relaxed);
            let measured = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
            c.measured_ns.fetch_add(measured, Ordering::Relaxed);
        }
        out
    }
}

/// The counted calls are timed and charged; creates, maps, set accesses and unmaps are booked
/// for what later calls cover; the rest forward.
impl kvvm_hal::decorate::Forward for CountingBackend {
    fn inner(&self) -> &dyn VirtualMemoryBackend {
        &*self.inner
    }
    fn reserve(
        &self,
        size: u64,
        alignment: u64,
        fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress> {
        self.timed(Operation::Reserve, (0, 0), || {
            self.inner.reserve(size, alignment, fixed_address)
        })
    }
    fn free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        self.timed(Operation::Free, (0, 0), || self.inner.free(address, size))
    }
    fn create(
        &self,
        size: u64,
        properties: &AllocationProperties,
    ) -> BackendResult<PhysicalHandle> {
        let h = self.timed(Operation::Create, (size, 0), || {
            self.inner.create(size, properties)
        })?;
        let mut books = self.books();
        books.model.adopt_handle(h, properties.device, size, (), ());
        books.created = books.created.saturating_add(1);
        Ok(h)
    }
    fn release(&self, handle: PhysicalHandle) -> BackendResult<()> {
        let size = {
            let books = self.books();
            let id = books.model.allocation_of(Operation::Release, handle).ok();
            id.and_then(|id| books.model.allocation(id))
                .map_or(0, |a| a.size)
        };
        self.timed(Operation::Release, (size, 0), || self.inner.release(handle))?;
        // A handle the books do not know (made around the wrapper) is charged as 0 bytes.
        let _ = self.books().model.release(handle);
        Ok(())
    }
    fn map(&self, address: DeviceAddress, size: u64, handle: PhysicalHandle) -> BackendResult<()> {
        self.timed(Operation::Map, (size, 1), || {
            self.inner.map(address, size, handle)
        })?;
        let mut books = self.books();
        books.model.insert_mapping(address, size, handle);
        books.made = books.made.saturating_add(1);
        books.peak = books.peak.max(books.model.mapping_count() as u64);
        Ok(())
    }
    fn set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> BackendResult<()> {
        let (count, bytes) = self.books().model.extent_in(address, size, true);
        self.timed(Operation::SetAccess, (bytes, count), || {
            self.inner.set_access(address, size, access)
        })?;
        self.books().model.set_access(address, size, access);
        Ok(())
    }
    fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        let (count, bytes) = self.books().model.extent_in(address, size, false);
        self.timed(Operation::Unmap, (bytes, count), || {
            self.inner.unmap(address, size)
        })?;
        self.books().model.unmap(address, size);
        Ok(())
    }
    fn synchronize(&self, device: DeviceId) -> BackendResult<()> {
        self.timed(Operation::Synchronize, (0, 0), || {
            self.inner.synchronize(device)
        })
    }
    fn copy_to_device(&self, dst: DeviceAddress, src: &[u8]) -> BackendResult<()> {
        self.kv_copies.fetch_add(1, Ordering::Relaxed);
        self.kv_copy_bytes
            .fetch_add(src.len() as u64, Ordering::Relaxed);
        self.inner.copy_to_device(dst, src)
    }
    fn import_posix_fd(
        &self,
        device: DeviceId,
        fd: BorrowedFd<'_>,
    ) -> BackendResult<PhysicalHandle> {
        let h = self.inner.import_posix_fd(device, fd)?;
        self.books().model.adopt_handle(h, device, 0, (), ());
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvvm_sim::{SimBackend, SimConfig};

    /// The wrapper's books charge every call as the simulated driver, which knows the truth,
    /// does: handles by size, set access by fresh mappings, unmap by mappings.
    #[test]
    fn charges_what_the_simulator_charges() {
        let g = 2 << 20;
        let sim = Arc::new(SimBackend::new(SimConfig::single(g, 1 << 30)));
        let c = CountingBackend::new(sim.clone());
        let props = AllocationProperties::device(DeviceId(0));
        let rw = [AccessDescriptor::read_write(DeviceId(0))];
        let va = c.reserve(64 * g, 0, None).unwrap();
        // One handle of 16 granules, then 4 of one granule after it.
        let big = c.create(16 * g, &props).unwrap();
        c.map(va, 16 * g, big).unwrap();
        c.set_access(va, 16 * g, &rw).unwrap();
        let small: Vec<_> = (0..4)
            .map(|i| {
                let h = c.create(g, &props).unwrap();
                c.map(va.offset((16 + i) * g), g, h).unwrap();
                h
            })
            .collect();
        // Over the whole range: only the four new mappings are fresh.
        c.set_access(va, 20 * g, &rw).unwrap();
        c.set_access(va, 20 * g, &rw).unwrap();
        assert!(c.unmap(va.offset(g / 2), g).is_err());
        c.unmap(va, 20 * g).unwrap();
        c.release(big).unwrap();
        for h in small {
            c.release(h).unwrap();
        }
        c.free(va, 64 * g).unwrap();
        assert!(sim.ledger().is_empty());
        let t = c.tally();
        assert_eq!((t.mappings, t.handles, t.peak_mappings), (5, 5, 5));
        assert_eq!(t.calls, sim.driver_calls());
        assert_eq!(t.modelled, sim.estimated_driver_time());
        let model = LatencyModel::h200();
        let set_access = model.cost(Operation::SetAccess, 16 * g, 1)
            + model.cost(Operation::SetAccess, 4 * g, 4)
            + model.cost(Operation::SetAccess, 0, 0);
        let unmap = model.cost(Operation::Unmap, 0, 0) + model.cost(Operation::Unmap, 20 * g, 5);
        let create =
            model.cost(Operation::Create, 16 * g, 0) + model.cost(Operation::Create, g, 0) * 4;
        let release =
            model.cost(Operation::Release, 16 * g, 0) + model.cost(Operation::Release, g, 0) * 4;
        let expected =
            model.reserve + model.free + model.map * 5 + set_access + unmap + create + release;
        assert_eq!(t.modelled, expected);
    }
}

/// Modelled cost of the calls of the policies that use `cudaMalloc`-style allocations instead
/// of the virtual-memory API: an allocation is priced as one handle of its size by the same
/// latency model as the kvvm policies' calls ([`LatencyModel::h200`]), a growth by the H200's
/// measured allocate-copy-free.
pub mod classic {
    use std::time::Duration;

    use kvvm_hal::LatencyModel;

    /// One allocation of `bytes`: create + map + set access of one handle of that size (a
    /// 4 GiB allocation 314 us, a 2 MiB one 35 us).
    pub fn alloc(bytes: u64) -> Duration {
        LatencyModel::h200().commit(1, bytes)
    }

    /// One free of `bytes`: unmap + release of one handle of that size (4 GiB: 1.4 ms, most
    /// of it the release; 2 MiB: 26 us).
    pub fn free(bytes: u64) -> Duration {
        LatencyModel::h200().teardown(1, bytes)
    }

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
        fn an_allocation_costs_by_its_size() {
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            // The H200 table: one 128 MiB handle 46 us to commit, 74 us to tear down; one
            // 4 GiB handle 313 us and 1451 us.
            assert!((us(alloc(128 << 20)) - 46.0).abs() < 5.0);
            assert!((us(free(128 << 20)) - 74.0).abs() < 8.0);
            assert!((us(alloc(4 << 30)) - 313.0).abs() < 10.0);
            assert!((us(free(4 << 30)) - 1451.0).abs() < 50.0);
            assert!(alloc(2 << 20) < alloc(4 << 30));
        }

        #[test]
        fn growth_hits_the_measured_points() {
            assert_eq!(growth(1 << 30), Duration::from_micros(1330));
            assert_eq!(growth(16 << 30), Duration::from_micros(15821));
            assert!(growth(32 << 30) > growth(16 << 30));
            assert!(growth(0) > Duration::ZERO);
        }
    }
}
