//! The simulated driver's state: its records (reservations, allocations, mappings), the call
//! counts and fault plan, the devices, and the ledger of its truth. The semantics of the calls
//! are in `address.rs` (reserve, free), `physical.rs` (create, release, export, import),
//! `mapping.rs` (map, set access, unmap) and `data.rs` (copies).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::time::Duration;

use kvvm_hal::{
    Access, AccessDescriptor, BackendError, CallCounts, DeviceAddress, DeviceId, ErrorKind,
    MemoryInfo, Operation, PhysicalHandle, ShareableHandleType,
};

use crate::config::{SimConfig, SimDeviceConfig, SimQuirks};
use crate::faults::{FaultPlan, FaultRule};
use crate::ledger::{Ledger, LedgerAllocation, LedgerHandle, LedgerMapping, LedgerReservation};
use crate::sim_error;

/// Lowest simulated virtual address (1 TiB).
pub(crate) const VA_BASE: u64 = 1 << 40;

#[derive(Debug)]
pub(crate) struct Reservation {
    pub(crate) size: u64,
    /// Set by a multi-mapping unmap under the `multi_unmap_breaks_free` quirk.
    pub(crate) broken_by_multi_unmap: bool,
}

#[derive(Debug)]
pub(crate) struct Allocation {
    pub(crate) device: DeviceId,
    pub(crate) size: u64,
    pub(crate) handle_type: ShareableHandleType,
    pub(crate) handles: u64,
    pub(crate) mappings: u64,
    /// The bytes written into it, stored only where written (`store.rs`).
    pub(crate) data: crate::store::ChunkStore,
    /// A duplicate of each exported descriptor, kept so that its inode identifies the
    /// allocation on import for as long as the allocation lives.
    pub(crate) exports: Vec<(u64, OwnedFd)>,
}

#[derive(Debug)]
pub(crate) struct Mapping {
    pub(crate) size: u64,
    pub(crate) allocation: u64,
    /// Access per device ordinal.
    pub(crate) access: Vec<Access>,
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) devices: Vec<SimDeviceConfig>,
    pub(crate) peers: crate::config::PeerLinks,
    pub(crate) quirks: SimQuirks,
    pub(crate) address_space: u64,
    pub(crate) va_granule: u64,
    pub(crate) used: Vec<u64>,
    pub(crate) reservations: BTreeMap<u64, Reservation>,
    pub(crate) mappings: BTreeMap<u64, Mapping>,
    pub(crate) handles: HashMap<u64, u64>,
    pub(crate) allocations: HashMap<u64, Allocation>,
    pub(crate) next_handle: u64,
    pub(crate) next_allocation: u64,
    pub(crate) counts: CallCounts,
    pub(crate) faults: FaultPlan,
    pub(crate) driver_time: Duration,
}

pub(crate) fn invalid(op: Operation, detail: impl Into<String>) -> BackendError {
    sim_error(op, ErrorKind::InvalidValue, detail)
}

pub(crate) fn not_supported(op: Operation, detail: impl Into<String>) -> BackendError {
    sim_error(op, ErrorKind::NotSupported, detail)
}

pub(crate) fn end_of(op: Operation, start: u64, size: u64) -> Result<u64, BackendError> {
    start
        .checked_add(size)
        .ok_or_else(|| invalid(op, "address range overflows"))
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
            used: vec![0; config.devices.len()],
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            handles: HashMap::new(),
            allocations: HashMap::new(),
            next_handle: 0x1000,
            next_allocation: 1,
            counts: CallCounts::default(),
            faults: FaultPlan::default(),
            driver_time: Duration::ZERO,
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
        let used = self.used.get(device.0 as usize).copied().unwrap_or(0);
        Ok(MemoryInfo {
            free: d.capacity.saturating_sub(used),
            total: d.capacity,
        })
    }

    pub(crate) fn ledger(&self) -> Ledger {
        let mut handles: Vec<LedgerHandle> = self
            .handles
            .iter()
            .filter_map(|(h, id)| {
                self.allocations.get(id).map(|a| LedgerHandle {
                    handle: PhysicalHandle(*h),
                    allocation: *id,
                    size: a.size,
                    device: a.device,
                })
            })
            .collect();
        handles.sort_by_key(|h| h.handle);
        let mut allocations: Vec<LedgerAllocation> = self
            .allocations
            .iter()
            .map(|(id, a)| LedgerAllocation {
                id: *id,
                device: a.device,
                size: a.size,
                handles: a.handles,
                mappings: a.mappings,
            })
            .collect();
        allocations.sort_by_key(|a| a.id);
        Ledger {
            reservations: self
                .reservations
                .iter()
                .map(|(a, r)| LedgerReservation {
                    address: DeviceAddress(*a),
                    size: r.size,
                })
                .collect(),
            handles,
            allocations,
            mappings: self
                .mappings
                .iter()
                .map(|(a, m)| LedgerMapping {
                    address: DeviceAddress(*a),
                    size: m.size,
                    allocation: m.allocation,
                    access: m
                        .access
                        .iter()
                        .enumerate()
                        .filter(|(_, acc)| **acc != Access::None)
                        .map(|(i, acc)| AccessDescriptor {
                            device: DeviceId(u32::try_from(i).unwrap_or(u32::MAX)),
                            access: *acc,
                        })
                        .collect(),
                })
                .collect(),
            physical_bytes: self.used.clone(),
            stored_bytes: self.stored_bytes(),
        }
    }

    /// Host bytes holding the data written into every live allocation (`store.rs`).
    pub(crate) fn stored_bytes(&self) -> u64 {
        self.allocations
            .values()
            .map(|a| a.data.stored_bytes())
            .fold(0u64, u64::saturating_add)
    }
}
