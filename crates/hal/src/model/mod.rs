//! [`DriverModel`]: the driver's state, kept once for every backend and decorator that must
//! know it.
//!
//! The simulator is a driver, the host backend keeps the driver's bookkeeping over `mmap`,
//! and the recording and counting decorators follow what a driver underneath holds. All four
//! need the same books (address ranges, physical allocations and the handles that refer to
//! them, mappings and their access) and the checks the trait's contract table names
//! (`kvvm-hal`'s crate docs), in the driver's order. They live here; each user keeps only what
//! is its own: the simulator its address picking, data, cost and faults; the host its system
//! calls and descriptors; the recorder its anomalies; the counter its tallies.
//!
//! The model only checks and records: `check_*` methods refuse what the driver refuses and
//! change nothing, the others record a call that succeeded. A refusal is made by the
//! [`Refusal`] the model was built with, so each backend's errors keep its own codes. Handle
//! ids are either the model's own (never reused, so a second release is always detected) or
//! the ones a driver underneath returned ([`DriverModel::adopt_handle`]).
//!
//! The methods are split by what they touch: `address.rs` (reserve, free, ranges),
//! `physical.rs` (allocations and handles), `mapping.rs` (map, set access, unmap) and
//! `access.rs` (what a copy may touch).

mod access;
mod address;
mod mapping;
mod physical;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};

use crate::{Access, BackendError, DeviceId, ErrorKind, Operation};

pub use access::{Need, Piece};
pub use physical::Released;

/// Makes the error a refusal of the model is reported as: the backend's own constructor (its
/// codes and names), or [`BackendError::raised`].
pub type Refusal = fn(Operation, ErrorKind, String) -> BackendError;

/// The model's id of a physical allocation (the memory a handle refers to; several handles
/// refer to one allocation after an import).
pub type AllocationId = u64;

/// A physical allocation: it lives while a handle or a mapping refers to it (a handle released
/// while mapped defers the free to the last unmap).
#[derive(Debug)]
pub struct Allocation<A> {
    /// The device whose memory it is.
    pub device: DeviceId,
    /// Its size in bytes.
    pub size: u64,
    /// Live handles referring to it.
    pub handles: u64,
    /// Live mappings of it.
    pub mappings: u64,
    /// What the model's user keeps with it (the simulator's bytes, the host's file identity).
    pub extra: A,
}

/// A live handle.
#[derive(Debug)]
pub struct Handle<H> {
    /// The allocation it refers to.
    pub allocation: AllocationId,
    /// What the model's user keeps with it (the host's memfd).
    pub extra: H,
}

/// A live mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// Mapped bytes.
    pub size: u64,
    /// The allocation mapped there.
    pub allocation: AllocationId,
    /// The access of each device, by ordinal (a device past the end has none).
    pub access: Vec<Access>,
}

impl Mapping {
    /// The access `device` has through this mapping.
    pub fn access_of(&self, device: DeviceId) -> Access {
        self.access
            .get(device.0 as usize)
            .copied()
            .unwrap_or(Access::None)
    }

    /// Whether no device has been given access yet (what a set access charges as fresh).
    pub fn has_no_access(&self) -> bool {
        self.access.iter().all(|a| *a == Access::None)
    }
}

/// The driver's state: reserved ranges, allocations, handles and mappings, with the checks of
/// the driver's contract (see the module docs). `A` is kept with each allocation, `H` with
/// each handle.
#[derive(Debug)]
pub struct DriverModel<A = (), H = ()> {
    refusal: Refusal,
    /// Reserved ranges: start -> size.
    ranges: BTreeMap<u64, u64>,
    allocations: HashMap<AllocationId, Allocation<A>>,
    handles: HashMap<u64, Handle<H>>,
    mappings: BTreeMap<u64, Mapping>,
    /// Bytes of live allocations per device ordinal.
    used: Vec<u64>,
    next_handle: u64,
    next_allocation: AllocationId,
}

impl<A, H> DriverModel<A, H> {
    /// An empty model of `devices` devices (more are counted as they appear) whose refusals
    /// are made by `refusal`.
    pub fn new(devices: usize, refusal: Refusal) -> Self {
        DriverModel {
            refusal,
            ranges: BTreeMap::new(),
            allocations: HashMap::new(),
            handles: HashMap::new(),
            mappings: BTreeMap::new(),
            used: vec![0; devices],
            next_handle: 0x1000,
            next_allocation: 1,
        }
    }

    /// A refusal of `op` with `kind`, made as this model's user reports errors.
    pub fn refuse(
        &self,
        op: Operation,
        kind: ErrorKind,
        detail: impl Into<String>,
    ) -> BackendError {
        (self.refusal)(op, kind, detail.into())
    }

    /// An `InvalidValue` refusal of `op`.
    pub fn invalid(&self, op: Operation, detail: impl Into<String>) -> BackendError {
        self.refuse(op, ErrorKind::InvalidValue, detail)
    }

    /// `start + len`, or `InvalidValue` on overflow.
    pub fn end_of(&self, op: Operation, start: u64, len: u64) -> Result<u64, BackendError> {
        start.checked_add(len).ok_or_else(|| {
            self.invalid(op, format!("range of {len} bytes at {start:#x} overflows"))
        })
    }

    /// Bytes of live allocations on each device, by ordinal.
    pub fn used(&self) -> &[u64] {
        &self.used
    }

    /// Bytes of live allocations on `device`.
    pub fn used_on(&self, device: DeviceId) -> u64 {
        self.used.get(device.0 as usize).copied().unwrap_or(0)
    }

    /// Reserved ranges `(start, size)`, by address.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(a, s)| (*a, *s))
    }

    /// Live allocations, in no particular order.
    pub fn allocations(&self) -> impl Iterator<Item = (AllocationId, &Allocation<A>)> + '_ {
        self.allocations.iter().map(|(id, a)| (*id, a))
    }

    /// Live handles (by value) and what they refer to, in no particular order.
    pub fn handles(&self) -> impl Iterator<Item = (u64, &Handle<H>)> + '_ {
        self.handles.iter().map(|(h, v)| (*h, v))
    }

    /// Live mappings, by address.
    pub fn mappings(&self) -> impl Iterator<Item = (u64, &Mapping)> + '_ {
        self.mappings.iter().map(|(a, m)| (*a, m))
    }

    /// How many mappings are live.
    pub fn mapping_count(&self) -> usize {
        self.mappings.len()
    }

    /// Whether nothing is live: no range, handle, allocation or mapping.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
            && self.handles.is_empty()
            && self.allocations.is_empty()
            && self.mappings.is_empty()
    }

    /// Forgets everything (a teardown that gave it all back); returns what the handles kept.
    pub fn clear(&mut self) -> Vec<H> {
        self.ranges.clear();
        self.mappings.clear();
        self.allocations.clear();
        self.used.iter_mut().for_each(|u| *u = 0);
        self.handles.drain().map(|(_, h)| h.extra).collect()
    }

    fn add_used(&mut self, device: DeviceId, bytes: u64) {
        let i = device.0 as usize;
        if self.used.len() <= i {
            self.used.resize(i.saturating_add(1), 0);
        }
        if let Some(u) = self.used.get_mut(i) {
            *u = u.saturating_add(bytes);
        }
    }

    fn sub_used(&mut self, device: DeviceId, bytes: u64) {
        if let Some(u) = self.used.get_mut(device.0 as usize) {
            *u = u.saturating_sub(bytes);
        }
    }
}

/// Bytes of the `(address, size)` mappings that lie wholly inside `[address, address + size)`
/// (what ledgers and records answer `mapped_bytes_in` with).
pub fn bytes_within(mappings: impl Iterator<Item = (u64, u64)>, address: u64, size: u64) -> u64 {
    let end = address.saturating_add(size);
    mappings
        .filter(|(a, s)| *a >= address && a.saturating_add(*s) <= end)
        .map(|(_, s)| s)
        .fold(0u64, u64::saturating_add)
}
