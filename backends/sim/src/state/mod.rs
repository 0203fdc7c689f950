//! The simulated driver's state: the driver's books (`kvvm_hal::model::DriverModel`, shared
//! with the host backend and the decorators), what the simulator keeps of its own (each
//! allocation's bytes and exports, the quirks' marks), the call counts and fault plan, the
//! devices, and the ledger of its truth. The semantics of the calls are in `address.rs`
//! (reserve, free), `physical.rs` (create, release, export, import), `mapping.rs` (map, set
//! access, unmap), `data.rs` (copies) and `kernel.rs` (the probe kernels).
//!
//! [`State`] is the whole of one simulated driver: a `SimBackend` holds one behind its mutex,
//! and every call of the backend is one method of it, run with the lock held. The invariants
//! it keeps:
//!
//! * the model's books are the driver's truth: the ledger, the memory info and every check
//!   read them, and nothing else records a reservation, a handle, an allocation or a mapping;
//! * an allocation's bytes live in its `ChunkStore` (`store.rs`), only where they were written,
//!   and go with the allocation when it is freed;
//! * the misuses the CUDA driver refuses are refused here with the same kind, in the driver's
//!   order (the shared model's checks; a quirk changes that on purpose), and a copy, a row
//!   copy or a probe kernel checks every byte before it touches any, so a refused one writes
//!   nothing;
//! * every call is counted, and the fault plan is consulted after the count and before the
//!   call's semantics, so an injected fault has no side effect.

use std::collections::BTreeSet;
use std::os::fd::OwnedFd;
use std::time::Duration;

use kvvm_hal::model::DriverModel;
use kvvm_hal::{
    Access, AccessDescriptor, BackendError, CallCounts, DeviceAddress, DeviceId, ErrorKind,
    MemoryInfo, Operation, PhysicalHandle, ShareableHandleType,
};

use crate::config::{SimConfig, SimDeviceConfig, SimQuirks};
use crate::error::sim_error;
use crate::faults::{FaultPlan, FaultRule};
use crate::ledger::{Ledger, LedgerAllocation, LedgerHandle, LedgerMapping, LedgerReservation};

mod address;
mod data;
mod host;
mod kernel;
mod mapping;
mod physical;

/// Lowest simulated virtual address (1 TiB).
pub(crate) const VA_BASE: u64 = 1 << 40;

/// What the simulator keeps with each allocation of the model.
#[derive(Debug)]
pub(crate) struct SimAllocation {
    pub(crate) handle_type: ShareableHandleType,
    /// The bytes written into it, stored only where written (`store.rs`).
    pub(crate) data: crate::store::ChunkStore,
    /// A duplicate of each exported descriptor, kept so that its inode identifies the
    /// allocation on import for as long as the allocation lives.
    pub(crate) exports: Vec<(u64, OwnedFd)>,
}

/// The simulated driver's state (see the module documentation).
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) devices: Vec<SimDeviceConfig>,
    pub(crate) peers: crate::config::PeerLinks,
    pub(crate) quirks: SimQuirks,
    pub(crate) address_space: u64,
    pub(crate) va_granule: u64,
    /// The driver's books.
    pub(crate) model: DriverModel<SimAllocation>,
    /// Reservations a multi-mapping unmap broke under the `multi_unmap_breaks_free` quirk.
    pub(crate) broken_by_multi_unmap: BTreeSet<u64>,
    pub(crate) counts: CallCounts,
    pub(crate) faults: FaultPlan,
    pub(crate) driver_time: Duration,
    /// Page-locked host buffers and events (`host.rs`).
    pub(crate) host: host::HostState,
}

pub(crate) fn invalid(op: Operation, detail: impl Into<String>) -> BackendError {
    sim_error(op, ErrorKind::InvalidValue, detail)
}

/// How the model refuses: with the simulator's codes.
fn refusal(op: Operation, kind: ErrorKind, detail: String) -> BackendError {
    sim_error(op, kind, detail)
}

impl State {
    pub(crate) fn new(config: &SimConfig) -> Self {
        let va_granule = config
            .devices
            .iter()
            .map(|d| d.granularity.minimum.max(1))
            .min()
            .unwrap_or(1);
        State {
            devices: config.devices.clone(),
            peers: config.peers.clone(),
            quirks: config.quirks,
            address_space: config.address_space,
            va_granule,
            model: DriverModel::new(config.devices.len(), refusal),
            broken_by_multi_unmap: BTreeSet::new(),
            counts: CallCounts::default(),
            faults: FaultPlan::default(),
            driver_time: Duration::ZERO,
            host: host::HostState::default(),
        }
    }

    pub(crate) fn inject(&mut self, rule: FaultRule) {
        let counts = self.counts.snapshot();
        self.faults.install(rule, &counts);
    }

    pub(crate) fn clear_faults(&mut self) {
        self.faults.clear();
    }

    pub(crate) fn calls(&self, op: Operation) -> u64 {
        self.counts.get(op)
    }

    pub(crate) fn driver_time(&self) -> Duration {
        self.driver_time
    }

    pub(crate) fn add_driver_time(&mut self, d: Duration) {
        self.driver_time = self.driver_time.saturating_add(d);
    }

    pub(crate) fn reset_counters(&mut self) {
        self.counts.reset();
        self.driver_time = Duration::ZERO;
        self.faults.clear();
    }

    pub(crate) fn count_and_check(&mut self, op: Operation) -> Option<ErrorKind> {
        self.counts.record(op);
        if self.faults.is_empty() {
            return None;
        }
        let counts = self.counts.snapshot();
        self.faults.check(op, &counts)
    }

    pub(crate) fn device(
        &self,
        op: Operation,
        device: DeviceId,
    ) -> Result<&SimDeviceConfig, BackendError> {
        self.devices
            .get(device.0 as usize)
            .ok_or_else(|| invalid(op, format!("no {device}")))
    }

    pub(crate) fn memory_info(&self, device: DeviceId) -> Result<MemoryInfo, BackendError> {
        let d = self.device(Operation::MemoryInfo, device)?;
        let used = self.model.used_on(device);
        Ok(MemoryInfo {
            free: d.capacity.saturating_sub(used),
            total: d.capacity,
        })
    }

    pub(crate) fn ledger(&self) -> Ledger {
        let m = &self.model;
        let mut handles: Vec<LedgerHandle> = m
            .handles()
            .filter_map(|(h, handle)| {
                m.allocation(handle.allocation).map(|a| LedgerHandle {
                    handle: PhysicalHandle(h),
                    allocation: handle.allocation,
                    size: a.size,
                    device: a.device,
                })
            })
            .collect();
        handles.sort_by_key(|h| h.handle);
        let mut allocations: Vec<LedgerAllocation> = m
            .allocations()
            .map(|(id, a)| LedgerAllocation {
                id,
                device: a.device,
                size: a.size,
                handles: a.handles,
                mappings: a.mappings,
            })
            .collect();
        allocations.sort_by_key(|a| a.id);
        Ledger {
            reservations: m
                .ranges()
                .map(|(a, size)| LedgerReservation {
                    address: DeviceAddress(a),
                    size,
                })
                .collect(),
            handles,
            allocations,
            mappings: m
                .mappings()
                .map(|(a, map)| LedgerMapping {
                    address: DeviceAddress(a),
                    size: map.size,
                    allocation: map.allocation,
                    access: granted(&map.access),
                })
                .collect(),
            physical_bytes: m.used().to_vec(),
            stored_bytes: self.stored_bytes(),
            host_buffers: self.host.buffers(),
            events: self.host.event_count(),
        }
    }

    /// Host bytes holding the data written into every live allocation and host buffer
    /// (`store.rs`).
    pub(crate) fn stored_bytes(&self) -> u64 {
        self.model
            .allocations()
            .map(|(_, a)| a.extra.data.stored_bytes())
            .fold(self.host.stored_bytes(), u64::saturating_add)
    }
}

/// The devices given access, as descriptors (those with none omitted).
fn granted(access: &[Access]) -> Vec<AccessDescriptor> {
    access
        .iter()
        .enumerate()
        .filter(|(_, acc)| **acc != Access::None)
        .map(|(i, acc)| AccessDescriptor {
            device: DeviceId(u32::try_from(i).unwrap_or(u32::MAX)),
            access: *acc,
        })
        .collect()
}
