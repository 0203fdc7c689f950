//! The simulator's ledger: the driver's truth, for tests to compare against.

use kvvm_hal::{AccessDescriptor, DeviceAddress, DeviceId, PhysicalHandle};

/// A live reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerReservation {
    /// Base address.
    pub address: DeviceAddress,
    /// Reserved bytes.
    pub size: u64,
}

/// A live (not yet released) handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerHandle {
    /// The handle.
    pub handle: PhysicalHandle,
    /// The physical allocation it refers to.
    pub allocation: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Its device.
    pub device: DeviceId,
}

/// A live physical allocation (it lives while a handle or a mapping refers to it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerAllocation {
    /// The simulator's allocation id.
    pub id: u64,
    /// Its device.
    pub device: DeviceId,
    /// Its size in bytes.
    pub size: u64,
    /// Unreleased handles referring to it.
    pub handles: u64,
    /// Mappings of it.
    pub mappings: u64,
}

/// A live mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerMapping {
    /// Mapped address.
    pub address: DeviceAddress,
    /// Mapped bytes.
    pub size: u64,
    /// The allocation mapped there.
    pub allocation: u64,
    /// The access each device has (devices with no access are omitted).
    pub access: Vec<AccessDescriptor>,
}

/// Everything live in the simulated driver at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ledger {
    /// Live reservations, by address.
    pub reservations: Vec<LedgerReservation>,
    /// Live handles, by handle value.
    pub handles: Vec<LedgerHandle>,
    /// Live physical allocations, by id.
    pub allocations: Vec<LedgerAllocation>,
    /// Live mappings, by address.
    pub mappings: Vec<LedgerMapping>,
    /// Physical bytes in use per device (allocations whose free is deferred included).
    pub physical_bytes: Vec<u64>,
    /// Host bytes holding the data written into live allocations: the simulator stores bytes
    /// only where they were written, and a chunk of equal bytes as one byte
    /// ([`SimBackend::stored_bytes`](crate::SimBackend::stored_bytes)).
    pub stored_bytes: u64,
    /// Live page-locked host buffers and their sizes.
    pub host_buffers: Vec<(kvvm_hal::HostBuffer, u64)>,
    /// Live events.
    pub events: usize,
}

impl Ledger {
    /// Nothing is live: no reservation, handle, allocation, mapping, host buffer or event.
    pub fn is_empty(&self) -> bool {
        self.reservations.is_empty()
            && self.handles.is_empty()
            && self.allocations.is_empty()
            && self.mappings.is_empty()
            && self.host_buffers.is_empty()
            && self.events == 0
    }

    /// Bytes of the live page-locked host buffers.
    pub fn host_bytes(&self) -> u64 {
        self.host_buffers.iter().map(|(_, n)| *n).sum()
    }

    /// Physical bytes in use on all devices.
    pub fn total_physical_bytes(&self) -> u64 {
        self.physical_bytes.iter().sum()
    }

    /// Bytes mapped inside `[address, address + size)`.
    pub fn mapped_bytes_in(&self, address: DeviceAddress, size: u64) -> u64 {
        let spans = self.mappings.iter().map(|m| (m.address.0, m.size));
        kvvm_hal::model::bytes_within(spans, address.0, size)
    }

    /// The reservation starting at `address`, if any.
    pub fn reservation(&self, address: DeviceAddress) -> Option<&LedgerReservation> {
        self.reservations.iter().find(|r| r.address == address)
    }
}
