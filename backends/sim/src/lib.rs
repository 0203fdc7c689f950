//! # kvvm-sim: a simulated GPU virtual-memory driver
//!
//! [`SimBackend`] implements [`VirtualMemoryBackend`] in process, reproducing the semantics the
//! CUDA driver showed on an NVIDIA H200 (`docs/driver-semantics.md`, summarised in the
//! `kvvm-hal` crate docs): the same [`ErrorKind`] for the same misuse, deferred free of a
//! released-but-mapped handle, unreported double unmap, access enforcement on copies, and
//! granularity rules. Where the real driver is silent about a misuse (a map that runs past the
//! end of its reservation), the simulator refuses with `InvalidValue` so that bugs in the
//! layers above surface in tests.
//!
//! It adds what tests need and a real driver cannot give:
//!
//! * **Configurable devices** ([`SimConfig`]): count, granularity (4 KiB to 1 GiB and more),
//!   physical capacity (`OutOfMemory` past it).
//! * **Byte-accurate data** behind every handle, stored only where it was written, in 64 KiB
//!   chunks, a chunk of equal bytes as one byte ([`SimBackend::stored_bytes`] counts the host
//!   memory it holds): a 64 TiB reservation or a 140 GiB device costs nothing until bytes are
//!   written, and bytes never written read as zeros. The device's memory is the host's, so
//!   a server's default budget on the simulator is bounded by the host
//!   ([`default_budget`], [`host_memory_budget`]).
//! * **Fault injection** ([`FaultRule`]): fail the Nth call of an operation, every call from the
//!   Nth on, a seeded random plan, or every synchronize. An injected fault has no side effect.
//! * **A ledger** ([`Ledger`]): the driver's truth (live reservations, handles, allocations,
//!   mappings, bytes) that tests compare with the manager's bookkeeping.
//! * **A latency model** ([`LatencyModel`]), by default the H200 fit, which charges each
//!   call for what it covers as the driver does (a handle by its size, `set_access` by its
//!   fresh mappings, `unmap` by its mappings), accounted
//!   ([`SimBackend::estimated_driver_time`]) or also spent ([`LatencyMode::Spin`]).
//! * **Probe kernels** ([`KernelProbe`]): loads and stores checked against the access of the
//!   device that launches them, so a peer's read-only mapping refuses its stores. A fault is
//!   `DeviceLost`, as on a GPU, but the simulated device stays usable.
//! * **Quirks** ([`SimQuirks`]): deliberately wrong semantics, to prove the conformance suite
//!   can fail, and the ROCm multi-unmap bug, to exercise the manager's capability handling.
//!
//! ```
//! use kvvm_hal::{AccessDescriptor, AllocationProperties, DeviceId, VirtualMemoryBackend};
//! use kvvm_sim::{SimBackend, SimConfig};
//!
//! # fn main() -> Result<(), kvvm_hal::BackendError> {
//! let sim = SimBackend::new(SimConfig::single(2 << 20, 64 << 20));
//! let g = 2 << 20;
//! let va = sim.reserve(4 * g, 0, None)?;
//! let h = sim.create(g, &AllocationProperties::device(DeviceId(0)))?;
//! sim.map(va, g, h)?;
//! sim.set_access(va, g, &[AccessDescriptor::read_write(DeviceId(0))])?;
//! sim.copy_to_device(va, b"kv")?;
//! let mut back = [0u8; 2];
//! sim.copy_from_device(&mut back, va)?;
//! assert_eq!(&back, b"kv");
//! sim.unmap(va, g)?;
//! sim.release(h)?;
//! sim.free(va, 4 * g)?;
//! assert!(sim.ledger().is_empty());
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]

mod config;
mod faults;
mod host;
mod ledger;
mod state;
mod store;

pub use config::{
    LatencyMode, PeerLinks, SimConfig, SimDeviceConfig, SimQuirks, GIB, H200_GRANULE,
    H200_GRANULES, MIB,
};
pub use faults::{FaultPlan, FaultRule};
pub use host::{
    bounded_by_host, default_budget, host_memory_budget, host_memory_budget_from,
    host_memory_ceiling, HOST_BUDGET_DIVISOR, HOST_BUDGET_FALLBACK,
};
/// The cost model (defined in `kvvm-hal`, re-exported where the simulator is configured).
pub use kvvm_hal::LatencyModel;
pub use ledger::{Ledger, LedgerAllocation, LedgerHandle, LedgerMapping, LedgerReservation};
/// The bytes of a chunk of simulated memory's data ([`SimBackend::stored_bytes`]).
pub use store::CHUNK as DATA_CHUNK_BYTES;

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvvm_hal::{
    traced, AccessDescriptor, AllocationProperties, BackendError, BackendResult, Capabilities,
    DeviceAddress, DeviceId, DeviceInfo, ErrorKind, EventHandle, Granularity, HostBuffer, HostCopy,
    KernelProbe, KernelProbeOp, MemoryInfo, Operation, PhysicalHandle, RowCopy, StreamHandle,
    VirtualMemoryBackend,
};

use state::State;

/// The simulated driver. Cheap to share behind an `Arc`; every method takes `&self`.
#[derive(Debug)]
pub struct SimBackend {
    config: SimConfig,
    state: Mutex<State>,
}

impl Default for SimBackend {
    fn default() -> Self {
        SimBackend::new(SimConfig::default())
    }
}

impl SimBackend {
    /// A simulator with `config` (a config with no device gets one simulated H200).
    pub fn new(mut config: SimConfig) -> Self {
        if config.devices.is_empty() {
            config.devices.push(SimDeviceConfig::h200());
        }
        let state = State::new(&config);
        SimBackend {
            config,
            state: Mutex::new(state),
        }
    }

    /// One simulated H200 (2 MiB granule, 139.3 GiB).
    pub fn h200() -> Self {
        SimBackend::new(SimConfig::default())
    }

    /// The configuration this simulator was made with.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave `State` half-updated in a way that
        // matters more than losing the simulator, and library code must not panic: recover.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Adds a fault rule; its call numbers count from now.
    pub fn inject(&self, rule: FaultRule) {
        self.lock().inject(rule);
    }

    /// Removes every fault rule.
    pub fn clear_faults(&self) {
        self.lock().clear_faults();
    }

    /// The driver's truth: everything live right now.
    pub fn ledger(&self) -> Ledger {
        self.lock().ledger()
    }

    /// Host bytes holding the data written into live allocations (what the simulated device's
    /// memory costs the host): 64 KiB per written chunk of mixed bytes, one byte per chunk of
    /// equal bytes, nothing for bytes never written or written as zeros over a whole chunk.
    /// Released allocations give theirs back.
    pub fn stored_bytes(&self) -> u64 {
        self.lock().stored_bytes()
    }

    /// How many calls of `op` were made (failed ones included) since creation or the last
    /// [`reset_counters`](Self::reset_counters).
    pub fn calls(&self, op: Operation) -> u64 {
        self.lock().calls(op)
    }

    /// Total driver calls of the mutating and copying operations (reserve, free, create,
    /// release, map, set access, unmap, synchronize, copies, export, import).
    pub fn driver_calls(&self) -> u64 {
        let s = self.lock();
        Operation::VMM_CALLS
            .iter()
            .chain(&[
                Operation::CopyToDevice,
                Operation::CopyFromDevice,
                Operation::Export,
                Operation::Import,
            ])
            .map(|op| s.calls(*op))
            .sum()
    }

    /// The driver time the latency model attributes to all calls so far.
    pub fn estimated_driver_time(&self) -> Duration {
        self.lock().driver_time()
    }

    /// Resets the call counters and the estimated driver time (fault rules keep their own
    /// bases and are cleared as well).
    pub fn reset_counters(&self) {
        self.lock().reset_counters();
    }

    /// Runs `f` on the locked state inside one tracing span (the driver call), accounts its
    /// latency for what `f` says the call covered ([`Covered`]), and spins for it if
    /// configured. A failed call is charged as one that covered nothing.
    fn call<T>(
        &self,
        op: Operation,
        f: impl FnOnce(&mut State) -> Result<(T, Covered), BackendError>,
    ) -> BackendResult<T> {
        traced(tracing::debug_span!("kvvm_sim", op = op.as_str()), || {
            self.call_untraced(op, f)
        })
    }

    fn call_untraced<T>(
        &self,
        op: Operation,
        f: impl FnOnce(&mut State) -> Result<(T, Covered), BackendError>,
    ) -> BackendResult<T> {
        let (result, cost) = {
            let mut s = self.lock();
            let fault = s.count_and_check(op);
            let (result, covered) = match fault {
                Some(kind) => (Err(injected(op, kind)), Covered::NOTHING),
                None => match f(&mut s) {
                    Ok((v, covered)) => (Ok(v), covered),
                    Err(e) => (Err(e), Covered::NOTHING),
                },
            };
            let cost = self
                .config
                .latency
                .cost(op, covered.bytes, covered.mappings);
            s.add_driver_time(cost);
            (result, cost)
        };
        if self.config.latency_mode == LatencyMode::Spin && !cost.is_zero() {
            let start = Instant::now();
            while start.elapsed() < cost {
                std::hint::spin_loop();
            }
        }
        result
    }
}

/// What one call covered, as the latency model charges it ([`LatencyModel::cost`]): the
/// handle's bytes for create and release, the mappings and their bytes for map, set access
/// (the fresh mappings only) and unmap, the bytes of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Covered {
    bytes: u64,
    mappings: u64,
}

impl Covered {
    const NOTHING: Covered = Covered {
        bytes: 0,
        mappings: 0,
    };

    fn bytes(bytes: u64) -> Self {
        Covered { bytes, mappings: 0 }
    }

    fn mappings((mappings, bytes): (u64, u64)) -> Self {
        Covered { bytes, mappings }
    }
}

pub(crate) fn code_for(kind: ErrorKind) -> (i64, &'static str) {
    // The numbers are the CUDA driver's for the same condition, so logs read alike.
    match kind {
        ErrorKind::OutOfMemory => (2, "SIM_ERROR_OUT_OF_MEMORY"),
        ErrorKind::InvalidValue => (1, "SIM_ERROR_INVALID_VALUE"),
        ErrorKind::NotSupported => (801, "SIM_ERROR_NOT_SUPPORTED"),
        ErrorKind::Unavailable => (100, "SIM_ERROR_NO_DEVICE"),
        ErrorKind::DeviceLost => (700, "SIM_ERROR_ILLEGAL_ADDRESS"),
        ErrorKind::Other => (999, "SIM_ERROR_UNKNOWN"),
    }
}

pub(crate) fn sim_error(op: Operation, kind: ErrorKind, detail: impl Into<String>) -> BackendError {
    let (code, name) = code_for(kind);
    BackendError::new(op, kind, code, name).with_detail(detail)
}

fn injected(op: Operation, kind: ErrorKind) -> BackendError {
    sim_error(op, kind, "injected fault")
}

impl VirtualMemoryBackend for SimBackend {
    fn name(&self) -> &str {
        "sim"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            unmap_spans_mappings: !self.config.quirks.multi_unmap_breaks_free,
            posix_fd_handles: self.config.devices.iter().all(|d| d.posix_fd),
            kernels: true,
            set_access_retries: 0,
            checks_reservation_bounds: true,
            host_copies: true,
        }
    }

    fn devices(&self) -> BackendResult<Vec<DeviceInfo>> {
        self.call(Operation::Devices, |_| {
            let devices = self
                .config
                .devices
                .iter()
                .enumerate()
                .map(|(i, d)| DeviceInfo {
                    id: DeviceId(u32::try_from(i).unwrap_or(u32::MAX)),
                    name: d.name.clone(),
                    total_memory: d.capacity,
                    vmm_supported: true,
                    posix_fd_supported: d.posix_fd,
                    driver_version: format!("kvvm-sim {}", env!("CARGO_PKG_VERSION")),
                })
                .collect();
            Ok((devices, Covered::NOTHING))
        })
    }

    fn memory_info(&self, device: DeviceId) -> BackendResult<MemoryInfo> {
        self.call(Operation::MemoryInfo, |s| {
            Ok((s.memory_info(device)?, Covered::NOTHING))
        })
    }

    fn granularity(&self, properties: &AllocationProperties) -> BackendResult<Granularity> {
        self.call(Operation::Granularity, |s| {
            Ok((
                s.device(Operation::Granularity, properties.device)?
                    .granularity,
                Covered::NOTHING,
            ))
        })
    }

    fn reserve(
        &self,
        size: u64,
        alignment: u64,
        fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress> {
        self.call(Operation::Reserve, |s| {
            Ok((s.reserve(size, alignment, fixed_address)?, Covered::NOTHING))
        })
    }

    fn free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        self.call(Operation::Free, |s| {
            Ok((s.free(address, size)?, Covered::NOTHING))
        })
    }

    fn create(
        &self,
        size: u64,
        properties: &AllocationProperties,
    ) -> BackendResult<PhysicalHandle> {
        self.call(Operation::Create, |s| {
            Ok((s.create(size, properties)?, Covered::bytes(size)))
        })
    }

    fn release(&self, handle: PhysicalHandle) -> BackendResult<()> {
        self.call(Operation::Release, |s| {
            Ok(((), Covered::bytes(s.release(handle)?)))
        })
    }

    fn map(&self, address: DeviceAddress, size: u64, handle: PhysicalHandle) -> BackendResult<()> {
        self.call(Operation::Map, |s| {
            s.map(address, size, handle)?;
            Ok(((), Covered::mappings((1, size))))
        })
    }

    fn set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> BackendResult<()> {
        self.call(Operation::SetAccess, |s| {
            let fresh = s.set_access(address, size, access)?;
            Ok(((), Covered::mappings(fresh)))
        })
    }

    fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        self.call(Operation::Unmap, |s| {
            let removed = s.unmap(address, size)?;
            Ok(((), Covered::mappings(removed)))
        })
    }

    fn synchronize(&self, device: DeviceId) -> BackendResult<()> {
        self.call(Operation::Synchronize, |s| {
            s.device(Operation::Synchronize, device)?;
            Ok(((), Covered::NOTHING))
        })
    }

    fn copy_to_device(&self, dst: DeviceAddress, src: &[u8]) -> BackendResult<()> {
        self.call(Operation::CopyToDevice, |s| {
            s.copy_to_device(dst, src)?;
            Ok(((), Covered::bytes(src.len() as u64)))
        })
    }

    fn copy_from_device(&self, dst: &mut [u8], src: DeviceAddress) -> BackendResult<()> {
        self.call(Operation::CopyFromDevice, |s| {
            let n = dst.len() as u64;
            s.copy_from_device(dst, src)?;
            Ok(((), Covered::bytes(n)))
        })
    }

    fn copy_rows_async(&self, copy: &RowCopy, _stream: StreamHandle) -> BackendResult<()> {
        self.call(Operation::CopyRows, |s| {
            s.copy_rows(copy)?;
            Ok(((), Covered::bytes(copy.width.saturating_mul(copy.rows))))
        })
    }

    fn host_alloc(&self, device: DeviceId, bytes: u64) -> BackendResult<HostBuffer> {
        self.call(Operation::HostAlloc, |s| {
            Ok((s.host_alloc(device, bytes)?, Covered::NOTHING))
        })
    }

    fn host_free(&self, buffer: HostBuffer) -> BackendResult<()> {
        self.call(Operation::HostFree, |s| {
            Ok((s.host_free(buffer)?, Covered::NOTHING))
        })
    }

    fn copy_to_host_async(&self, copy: &HostCopy, _stream: StreamHandle) -> BackendResult<()> {
        self.call(Operation::CopyToHost, |s| {
            s.copy_to_host(copy)?;
            Ok(((), Covered::bytes(copy.bytes)))
        })
    }

    fn copy_from_host_async(&self, copy: &HostCopy, _stream: StreamHandle) -> BackendResult<()> {
        self.call(Operation::CopyFromHost, |s| {
            s.copy_from_host(copy)?;
            Ok(((), Covered::bytes(copy.bytes)))
        })
    }

    fn copy_stream(&self, device: DeviceId) -> BackendResult<StreamHandle> {
        self.call(Operation::Stream, |s| {
            s.device(Operation::Stream, device)?;
            Ok((StreamHandle(0), Covered::NOTHING))
        })
    }

    fn event_record(&self, device: DeviceId, stream: StreamHandle) -> BackendResult<EventHandle> {
        self.call(Operation::Event, |s| {
            Ok((s.event_record(device, stream)?, Covered::NOTHING))
        })
    }

    fn event_query(&self, event: EventHandle) -> BackendResult<bool> {
        self.call(Operation::Event, |s| {
            s.check_event(event)?;
            Ok((true, Covered::NOTHING))
        })
    }

    fn event_wait(&self, event: EventHandle) -> BackendResult<()> {
        self.call(Operation::Event, |s| {
            Ok((s.check_event(event)?, Covered::NOTHING))
        })
    }

    fn stream_wait_event(&self, _stream: StreamHandle, event: EventHandle) -> BackendResult<()> {
        self.call(Operation::Event, |s| {
            Ok((s.check_event(event)?, Covered::NOTHING))
        })
    }

    /// Neither counted nor failed by a fault plan: destroying a live event always succeeds,
    /// as on a driver, and it is what every cleanup after a failure does.
    fn event_destroy(&self, event: EventHandle) -> BackendResult<()> {
        let span = tracing::debug_span!("kvvm_sim", op = "event_destroy");
        traced(span, || self.lock().event_destroy(event))
    }

    fn export_posix_fd(&self, handle: PhysicalHandle) -> BackendResult<OwnedFd> {
        self.call(Operation::Export, |s| {
            Ok((s.export(handle)?, Covered::NOTHING))
        })
    }

    fn import_posix_fd(
        &self,
        device: DeviceId,
        fd: BorrowedFd<'_>,
    ) -> BackendResult<PhysicalHandle> {
        self.call(Operation::Import, |s| {
            s.device(Operation::Import, device)?;
            Ok((s.import(device, fd)?, Covered::NOTHING))
        })
    }

    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> BackendResult<bool> {
        self.call(Operation::Devices, |s| {
            s.device(Operation::Devices, device)?;
            s.device(Operation::Devices, peer)?;
            Ok((s.peers.linked(device.0, peer.0), Covered::NOTHING))
        })
    }

    fn kernel_probe(&self) -> Option<&dyn KernelProbe> {
        Some(self)
    }
}

/// The probe kernels on the simulated device: loads and stores checked against the access of
/// the launching device (`state/kernel.rs`); a fault is `DeviceLost` and leaves the device
/// usable.
impl KernelProbe for SimBackend {
    fn run(
        &self,
        device: DeviceId,
        op: KernelProbeOp,
        address: DeviceAddress,
        len: u64,
        value: u8,
    ) -> BackendResult<u64> {
        self.call(Operation::Kernel, |s| {
            s.device(Operation::Kernel, device)?;
            Ok((s.kernel(device, op, address, len, value)?, Covered::NOTHING))
        })
    }

    fn faults_are_recoverable(&self) -> bool {
        true
    }
}
