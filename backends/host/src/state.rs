//! The backend's bookkeeping: the driver's books (`kvvm_hal::model::DriverModel`, shared with
//! the simulator and the decorators) with what the host keeps of its own: each handle's memfd,
//! each allocation's file identity, the capacity and the page size.
//!
//! The kernel would let many misuses through (a `MAP_FIXED` map over a live mapping replaces
//! it, a map outside a reservation clobbers whatever lives there, a second `close` of a number
//! closes someone else's descriptor), so the backend keeps what it needs to refuse exactly
//! what the CUDA driver refuses (`docs/driver-semantics.md`), in the driver's order, and to
//! make every `MAP_FIXED`, `mprotect` and `munmap` provably touch only its own ranges. The
//! methods here only check and record; `backend/linux.rs` makes the system calls in
//! between.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use kvvm_hal::model::{DriverModel, Need};
use kvvm_hal::{
    Access, AccessDescriptor, BackendError, BackendResult, DeviceAddress, DeviceId, ErrorKind,
    Operation, PhysicalHandle,
};

use crate::error::{invalid, refused};
use crate::HostLedger;

/// A physical allocation is one memfd, identified by its file (`st_dev`, `st_ino`): a handle
/// imported from a descriptor of a memfd this process already holds is the same allocation.
pub(crate) type AllocationKey = (u64, u64);

/// What the host keeps with each handle.
#[derive(Debug)]
pub(crate) struct HostHandle {
    /// The memfd (closed when the handle is released).
    pub(crate) fd: OwnedFd,
    /// Created exportable (`ShareableHandleType::PosixFd`) or imported.
    pub(crate) exportable: bool,
}

/// The host is device 0.
const HOST: DeviceId = DeviceId(0);

#[derive(Debug)]
pub(crate) struct State {
    /// The minimum granularity: the page size.
    pub(crate) granule: u64,
    /// Physical bytes the backend may hold.
    pub(crate) capacity: u64,
    /// The driver's books; handle ids are never reused, so a second release is detected.
    pub(crate) model: DriverModel<AllocationKey, HostHandle>,
}

/// How the model refuses: with the `errno` of the driver's answer.
fn refusal(op: Operation, kind: ErrorKind, detail: String) -> BackendError {
    refused(op, kind, detail)
}

impl State {
    pub(crate) fn new(granule: u64, capacity: u64) -> Self {
        State {
            granule,
            capacity,
            model: DriverModel::new(1, refusal),
        }
    }

    pub(crate) fn granule(&self) -> u64 {
        self.granule
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes of live allocations.
    pub(crate) fn used(&self) -> u64 {
        self.model.used_on(HOST)
    }

    /// `InvalidValue` unless `device` is the host (device 0).
    pub(crate) fn check_device(op: Operation, device: DeviceId) -> BackendResult<()> {
        if device == HOST {
            Ok(())
        } else {
            Err(invalid(op, format!("no {device} (the host is device 0)")))
        }
    }

    /// The size of the allocation a descriptor's file is, if this backend holds it already.
    pub(crate) fn allocation_size(&self, key: AllocationKey) -> Option<u64> {
        let id = self.model.find_allocation(|a| a.extra == key)?;
        self.model.allocation(id).map(|a| a.size)
    }

    pub(crate) fn ledger(&self) -> HostLedger {
        let m = &self.model;
        HostLedger {
            reservations: m.ranges().count(),
            reserved_bytes: m.ranges().map(|(_, size)| size).sum(),
            handles: m.handles().count(),
            allocations: m.allocations().count(),
            mappings: m.mappings().count(),
            mapped_bytes: m.mappings().map(|(_, map)| map.size).sum(),
            used_bytes: self.used(),
            ..HostLedger::default()
        }
    }

    /// Forgets everything (teardown, after the ranges were unmapped); returns the memfds.
    pub(crate) fn clear(&mut self) -> Vec<OwnedFd> {
        self.model.clear().into_iter().map(|h| h.fd).collect()
    }

    /// Checks a reservation's size and alignment; returns the alignment to honour.
    pub(crate) fn check_reserve(&self, size: u64, alignment: u64) -> BackendResult<u64> {
        self.model.check_reserve(size, alignment, self.granule)
    }

    pub(crate) fn record_reservation(&mut self, address: u64, size: u64) {
        self.model.insert_range(address, size);
    }

    /// Checks that `[address, address + size)` is exactly a live reservation holding no
    /// live mapping.
    pub(crate) fn check_free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        self.model.check_free(address, size)
    }

    pub(crate) fn remove_reservation(&mut self, address: u64) {
        self.model.remove_range(address);
    }

    /// Every live reservation (for teardown).
    pub(crate) fn reservation_ranges(&self) -> Vec<(u64, u64)> {
        self.model.ranges().collect()
    }

    /// Checks a creation of `size` bytes against the granularity and the capacity.
    pub(crate) fn check_create(&self, size: u64) -> BackendResult<()> {
        let op = Operation::Create;
        self.model.check_size(op, size, self.granule)?;
        self.model.check_capacity(op, HOST, size, self.capacity)
    }

    /// Records the handle of a memfd just created: a new allocation of `size` bytes.
    pub(crate) fn record_created(
        &mut self,
        key: AllocationKey,
        size: u64,
        h: HostHandle,
    ) -> PhysicalHandle {
        let id = self.model.new_allocation(HOST, size, key);
        self.model.new_handle(id, h)
    }

    /// Records a new handle of the allocation `key` (of `size` bytes) that owns `fd`: an
    /// import, of a memfd this backend may hold already (then the same allocation).
    pub(crate) fn record_handle(
        &mut self,
        fd: OwnedFd,
        key: AllocationKey,
        size: u64,
        exportable: bool,
    ) -> PhysicalHandle {
        let handle = HostHandle { fd, exportable };
        match self.model.find_allocation(|a| a.extra == key) {
            Some(id) => self.model.new_handle(id, handle),
            None => self.record_created(key, size, handle),
        }
    }

    /// Forgets a handle and returns its memfd (closing it releases the handle); the
    /// allocation lives on while a mapping of it does.
    pub(crate) fn release(&mut self, handle: PhysicalHandle) -> BackendResult<OwnedFd> {
        self.model.release(handle).map(|r| r.extra.fd)
    }

    /// The memfd of a handle that may be exported (`InvalidValue` otherwise, like a handle
    /// created without `ShareableHandleType::PosixFd` on CUDA).
    pub(crate) fn check_export(&self, handle: PhysicalHandle) -> BackendResult<BorrowedFd<'_>> {
        let op = Operation::Export;
        let h = self.model.handle(op, handle)?;
        if !h.extra.exportable {
            return Err(invalid(
                op,
                format!("{handle} was not created exportable as a POSIX fd"),
            ));
        }
        Ok(h.extra.fd.as_fd())
    }

    /// Checks a map of `handle` at `address` in the driver's order (the model's
    /// [`check_map`](DriverModel::check_map)); returns the memfd to map.
    pub(crate) fn check_map(
        &self,
        address: DeviceAddress,
        size: u64,
        handle: PhysicalHandle,
    ) -> BackendResult<BorrowedFd<'_>> {
        let h = self.model.check_map(address, size, handle, self.granule)?;
        Ok(h.extra.fd.as_fd())
    }

    /// Records a map that [`check_map`](Self::check_map) allowed and the kernel made.
    pub(crate) fn record_map(&mut self, address: DeviceAddress, size: u64, handle: PhysicalHandle) {
        self.model.insert_mapping(address, size, handle);
    }

    /// Checks a set access over whole mappings; returns the access to apply (the last
    /// descriptor's, all of them being the host's).
    pub(crate) fn check_set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> BackendResult<Access> {
        let op = Operation::SetAccess;
        for d in access {
            Self::check_device(op, d.device)?;
        }
        self.model
            .check_set_access(address, size, access, |_, _| true)?;
        let last = access.last().map_or(Access::None, |d| d.access);
        Ok(last)
    }

    /// Records the access of the mappings in `[address, address + size)`.
    pub(crate) fn record_access(&mut self, address: DeviceAddress, size: u64, access: Access) {
        let host = [AccessDescriptor {
            device: HOST,
            access,
        }];
        self.model.set_access(address, size, &host);
    }

    /// The mappings `[address, address + size)` unmaps, merged into runs of adjacent
    /// mappings `(start, len)` (one placeholder `mmap` each): every mapping must be covered
    /// whole; none is fine.
    pub(crate) fn check_unmap(
        &self,
        address: DeviceAddress,
        size: u64,
    ) -> BackendResult<Vec<(u64, u64)>> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (s, len) in self.model.check_unmap(address, size)? {
            match runs.last_mut() {
                Some((rs, rl)) if rs.saturating_add(*rl) == s => *rl = rl.saturating_add(len),
                _ => runs.push((s, len)),
            }
        }
        Ok(runs)
    }

    /// Forgets the mappings inside `[start, start + len)` (a run the kernel has unmapped);
    /// an allocation with no handle nor mapping left is freed. Returns the mappings removed.
    pub(crate) fn record_unmap(&mut self, start: u64, len: u64) -> u64 {
        self.model.unmap(DeviceAddress(start), len).0
    }

    /// Checks that every byte of `[start, start + len)` is mapped, with write access when
    /// `need` is `Some(true)`, read access when `Some(false)`, and only mapped when `None`
    /// (the probes, whose accesses the MMU checks).
    pub(crate) fn check_range(
        &self,
        op: Operation,
        start: u64,
        len: u64,
        need: Option<bool>,
    ) -> BackendResult<()> {
        let need = match need {
            None => Need::Mapped,
            Some(false) => Need::Read,
            Some(true) => Need::Write,
        };
        self.model.pieces(op, start, len, need, None).map(|_| ())
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
