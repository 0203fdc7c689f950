//! The backend's bookkeeping: reservations, physical allocations, handles and mappings.
//!
//! The kernel would let many misuses through (a `MAP_FIXED` map over a live mapping replaces
//! it, a map outside a reservation clobbers whatever lives there, a second `close` of a number
//! closes someone else's descriptor), so the backend keeps what it needs to refuse exactly
//! what the CUDA driver refuses (`docs/driver-semantics.md`), in the driver's order, and to
//! make every `MAP_FIXED`, `mprotect` and `munmap` provably touch only its own ranges. The
//! methods here only check and record; `backend.rs` makes the system calls in between. The
//! records and the ledger are here; the checks of each kind of call are `address.rs`
//! (reserve, free), `physical.rs` (create, release, export) and `mapping.rs` (map, set
//! access, unmap, copies).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;

use kvvm_hal::{Access, BackendResult, DeviceId, Operation};

use crate::conv::is_multiple;
use crate::error::invalid;
use crate::HostLedger;

/// A physical allocation is one memfd, identified by its file (`st_dev`, `st_ino`): a handle
/// imported from a descriptor of a memfd this process already holds is the same allocation.
pub(crate) type AllocationKey = (u64, u64);

#[derive(Debug)]
pub(crate) struct Reservation {
    pub(crate) size: u64,
}

#[derive(Debug)]
pub(crate) struct Mapping {
    pub(crate) size: u64,
    pub(crate) allocation: AllocationKey,
    pub(crate) access: Access,
}

#[derive(Debug)]
pub(crate) struct Handle {
    /// The memfd (closed when the handle is released).
    pub(crate) fd: OwnedFd,
    pub(crate) allocation: AllocationKey,
    /// Created exportable (`ShareableHandleType::PosixFd`) or imported.
    pub(crate) exportable: bool,
}

#[derive(Debug)]
pub(crate) struct Allocation {
    pub(crate) size: u64,
    /// Live handles of it in this backend.
    pub(crate) handles: u64,
    /// Live mappings of it in this backend.
    pub(crate) mappings: u64,
}

#[derive(Debug)]
pub(crate) struct State {
    /// The minimum granularity: the page size.
    pub(crate) granule: u64,
    /// Physical bytes the backend may hold.
    pub(crate) capacity: u64,
    /// Bytes of live allocations.
    pub(crate) used: u64,
    pub(crate) reservations: BTreeMap<u64, Reservation>,
    pub(crate) mappings: BTreeMap<u64, Mapping>,
    pub(crate) handles: HashMap<u64, Handle>,
    pub(crate) allocations: HashMap<AllocationKey, Allocation>,
    /// Handle ids are never reused, so a second release is always detected.
    pub(crate) next_handle: u64,
}

impl State {
    pub(crate) fn new(granule: u64, capacity: u64) -> Self {
        State {
            granule,
            capacity,
            used: 0,
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            handles: HashMap::new(),
            allocations: HashMap::new(),
            next_handle: 0x1000,
        }
    }

    pub(crate) fn granule(&self) -> u64 {
        self.granule
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    pub(crate) fn used(&self) -> u64 {
        self.used
    }

    /// `InvalidValue` unless `device` is the host (device 0).
    pub(crate) fn check_device(op: Operation, device: DeviceId) -> BackendResult<()> {
        if device == DeviceId(0) {
            Ok(())
        } else {
            Err(invalid(op, format!("no {device} (the host is device 0)")))
        }
    }

    pub(crate) fn check_size(&self, op: Operation, size: u64) -> BackendResult<()> {
        if size != 0 && is_multiple(size, self.granule) {
            Ok(())
        } else {
            Err(invalid(
                op,
                format!("size {size} is not a non-zero multiple of {}", self.granule),
            ))
        }
    }

    /// The allocation a descriptor's file is, if this backend holds it already.
    pub(crate) fn allocation_size(&self, key: AllocationKey) -> Option<u64> {
        self.allocations.get(&key).map(|a| a.size)
    }

    pub(crate) fn ledger(&self) -> HostLedger {
        HostLedger {
            reservations: self.reservations.len(),
            reserved_bytes: self.reservations.values().map(|r| r.size).sum(),
            handles: self.handles.len(),
            allocations: self.allocations.len(),
            mappings: self.mappings.len(),
            mapped_bytes: self.mappings.values().map(|m| m.size).sum(),
            used_bytes: self.used,
        }
    }

    /// Forgets everything (teardown, after the ranges were unmapped); returns the memfds.
    pub(crate) fn clear(&mut self) -> Vec<OwnedFd> {
        self.reservations.clear();
        self.mappings.clear();
        self.allocations.clear();
        self.used = 0;
        self.handles.drain().map(|(_, h)| h.fd).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvvm_hal::{AccessDescriptor, DeviceAddress, ErrorKind};

    const G: u64 = 4096;

    fn fd() -> OwnedFd {
        // Any descriptor will do for bookkeeping tests.
        match std::fs::File::open("/dev/null") {
            Ok(f) => f.into(),
            Err(e) => panic!("cannot open /dev/null: {e}"),
        }
    }

    fn kind<T: std::fmt::Debug>(r: BackendResult<T>) -> ErrorKind {
        match r {
            Ok(v) => panic!("expected an error, got {v:?}"),
            Err(e) => e.kind,
        }
    }

    #[test]
    fn map_checks_follow_the_driver_order() {
        let mut s = State::new(G, 64 * G);
        s.record_reservation(16 * G, 8 * G);
        let h = s.record_handle(fd(), (1, 1), 2 * G, false);
        // Part of a handle: NotSupported even at a bad address.
        assert_eq!(
            kind(s.check_map(DeviceAddress(G / 2), G, h)),
            ErrorKind::NotSupported
        );
        assert_eq!(
            kind(s.check_map(DeviceAddress(16 * G + 1), 2 * G, h)),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            kind(s.check_map(DeviceAddress(4 * G), 2 * G, h)),
            ErrorKind::InvalidValue
        );
        // Runs past the end of the reservation.
        assert_eq!(
            kind(s.check_map(DeviceAddress(23 * G), 2 * G, h)),
            ErrorKind::InvalidValue
        );
        assert!(s.check_map(DeviceAddress(16 * G), 2 * G, h).is_ok());
        s.record_map(DeviceAddress(16 * G), 2 * G, h);
        assert_eq!(
            kind(s.check_map(DeviceAddress(17 * G), 2 * G, h)),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            kind(s.check_free(DeviceAddress(16 * G), 8 * G)),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            kind(s.check_unmap(DeviceAddress(16 * G), G)),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            s.check_unmap(DeviceAddress(16 * G), 8 * G).ok(),
            Some(vec![(16 * G, 2 * G)])
        );
        assert_eq!(
            s.check_unmap(DeviceAddress(20 * G), 4 * G).ok(),
            Some(vec![])
        );
    }

    #[test]
    fn release_defers_the_free_until_the_last_unmap() {
        let mut s = State::new(G, 64 * G);
        s.record_reservation(16 * G, 8 * G);
        let h = s.record_handle(fd(), (1, 2), G, false);
        s.record_map(DeviceAddress(16 * G), G, h);
        assert_eq!(s.used(), G);
        assert!(s.release(h).is_ok());
        assert_eq!(kind(s.release(h)), ErrorKind::InvalidValue);
        assert_eq!(s.used(), G, "still mapped: not freed");
        assert_eq!(s.record_unmap(16 * G, G), 1);
        assert_eq!(s.used(), 0);
        s.remove_reservation(16 * G);
        assert!(s.ledger().is_empty());
    }

    #[test]
    fn an_import_of_a_held_allocation_is_counted_once() {
        let mut s = State::new(G, 4 * G);
        let a = s.record_handle(fd(), (1, 3), 2 * G, true);
        let b = s.record_handle(fd(), (1, 3), 2 * G, true);
        assert_eq!(s.used(), 2 * G);
        assert_eq!(s.allocation_size((1, 3)), Some(2 * G));
        assert!(s.check_create(2 * G).is_ok());
        assert_eq!(kind(s.check_create(3 * G)), ErrorKind::OutOfMemory);
        assert!(s.release(a).is_ok());
        assert_eq!(s.used(), 2 * G);
        assert!(s.release(b).is_ok());
        assert_eq!(s.used(), 0);
    }

    #[test]
    fn copies_need_access_on_every_byte() {
        let mut s = State::new(G, 64 * G);
        s.record_reservation(16 * G, 8 * G);
        let a = s.record_handle(fd(), (1, 4), G, false);
        let b = s.record_handle(fd(), (1, 5), G, false);
        s.record_map(DeviceAddress(16 * G), G, a);
        s.record_map(DeviceAddress(17 * G), G, b);
        let op = Operation::CopyToDevice;
        assert_eq!(
            kind(s.check_range(op, 16 * G, 10, Some(false))),
            ErrorKind::InvalidValue
        );
        assert!(s.check_range(op, 16 * G, 10, None).is_ok());
        assert_eq!(
            s.check_set_access(
                DeviceAddress(16 * G),
                2 * G,
                &[AccessDescriptor::read_write(DeviceId(0))]
            )
            .ok(),
            Some(Access::ReadWrite)
        );
        s.record_access(DeviceAddress(16 * G), G, Access::ReadWrite);
        s.record_access(DeviceAddress(17 * G), G, Access::Read);
        assert!(s.check_range(op, 16 * G, 2 * G, Some(false)).is_ok());
        assert!(s.check_range(op, 16 * G, G, Some(true)).is_ok());
        assert_eq!(
            kind(s.check_range(op, 17 * G - 1, 2, Some(true))),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            kind(s.check_range(op, 18 * G - 1, 2, Some(false))),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            kind(s.check_set_access(
                DeviceAddress(16 * G),
                G,
                &[AccessDescriptor::read_write(DeviceId(1))]
            )),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            kind(s.check_set_access(
                DeviceAddress(18 * G),
                G,
                &[AccessDescriptor::read_write(DeviceId(0))]
            )),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            s.check_unmap(DeviceAddress(16 * G), 2 * G).ok(),
            Some(vec![(16 * G, 2 * G)]),
            "adjacent mappings unmap in one run"
        );
    }

    #[test]
    fn sizes_must_be_granule_multiples() {
        let s = State::new(G, 64 * G);
        assert_eq!(kind(s.check_create(G + 1)), ErrorKind::InvalidValue);
        assert_eq!(kind(s.check_create(0)), ErrorKind::InvalidValue);
        assert_eq!(kind(s.check_reserve(G + G / 2, 0)), ErrorKind::InvalidValue);
        assert_eq!(kind(s.check_reserve(G, 3 * G)), ErrorKind::InvalidValue);
        assert_eq!(s.check_reserve(G, 0).ok(), Some(G));
        assert_eq!(s.check_reserve(G, 8 * G).ok(), Some(8 * G));
    }
}
