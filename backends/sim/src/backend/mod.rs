//! [`SimBackend`]: the simulated driver behind the driver's interface. Its impl blocks live in
//! the files of this folder, as the other backends' do:
//!
//! * `mod.rs`: the type, making it, what tests read from it (the ledger, call counts, the
//!   modelled driver time, fault rules), and [`VirtualMemoryBackend`], each call a step on the
//!   driver's state (`state/`);
//! * `call.rs`: how one call runs: the fault check, the state's lock, the tracing span and the
//!   latency the model charges for what the call covered;
//! * `kernel.rs`: [`KernelProbe`](kvvm_hal::KernelProbe), loads and stores checked against
//!   the launching device's access.

use kvvm_hal::sync::Unpoison;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use kvvm_hal::{
    traced, AccessDescriptor, AllocationProperties, BackendResult, Capabilities, DeviceAddress,
    DeviceId, DeviceInfo, EventHandle, Granularity, HostBuffer, HostCopy, KernelProbe, MemoryInfo,
    Operation, PhysicalHandle, RowCopy, StreamHandle, VirtualMemoryBackend,
};

use crate::config::{SimConfig, SimDeviceConfig};
use crate::faults::FaultRule;
use crate::ledger::Ledger;
use crate::state::State;

use call::Covered;

mod call;
mod kernel;

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

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave `State` half-updated in a way that
        // matters more than losing the simulator, and library code must not panic: recover.
        self.state.lock().unpoisoned()
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
            s.host_copy(copy, true)?;
            Ok(((), Covered::bytes(copy.bytes)))
        })
    }

    fn copy_from_host_async(&self, copy: &HostCopy, _stream: StreamHandle) -> BackendResult<()> {
        self.call(Operation::CopyFromHost, |s| {
            s.host_copy(copy, false)?;
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
