//! The backend's bookkeeping: reservations, physical allocations, handles and mappings.
//!
//! The kernel would let many misuses through (a `MAP_FIXED` map over a live mapping replaces
//! it, a map outside a reservation clobbers whatever lives there, a second `close` of a number
//! closes someone else's descriptor), so the backend keeps what it needs to refuse exactly
//! what the CUDA driver refuses (`docs/driver-semantics.md`), in the driver's order, and to
//! make every `MAP_FIXED`, `mprotect` and `munmap` provably touch only its own ranges. The
//! methods here only check and record; `backend.rs` makes the system calls in between.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use kvvm_hal::{
    Access, AccessDescriptor, BackendResult, DeviceAddress, DeviceId, ErrorKind, Operation,
    PhysicalHandle,
};

use crate::conv::{end_of, is_multiple};
use crate::error::{invalid, not_supported, refused};
use crate::HostLedger;

/// A physical allocation is one memfd, identified by its file (`st_dev`, `st_ino`): a handle
/// imported from a descriptor of a memfd this process already holds is the same allocation.
pub(crate) type AllocationKey = (u64, u64);

#[derive(Debug)]
struct Reservation {
    size: u64,
}

#[derive(Debug)]
struct Mapping {
    size: u64,
    allocation: AllocationKey,
    access: Access,
}

#[derive(Debug)]
struct Handle {
    /// The memfd (closed when the handle is released).
    fd: OwnedFd,
    allocation: AllocationKey,
    /// Created exportable (`ShareableHandleType::PosixFd`) or imported.
    exportable: bool,
}

#[derive(Debug)]
struct Allocation {
    size: u64,
    /// Live handles of it in this backend.
    handles: u64,
    /// Live mappings of it in this backend.
    mappings: u64,
}

#[derive(Debug)]
pub(crate) struct State {
    /// The minimum granularity: the page size.
    granule: u64,
    /// Physical bytes the backend may hold.
    capacity: u64,
    /// Bytes of live allocations.
    used: u64,
    reservations: BTreeMap<u64, Reservation>,
    mappings: BTreeMap<u64, Mapping>,
    handles: HashMap<u64, Handle>,
    allocations: HashMap<AllocationKey, Allocation>,
    /// Handle ids are never reused, so a second release is always detected.
    next_handle: u64,
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

    fn check_size(&self, op: Operation, size: u64) -> BackendResult<()> {
        if size != 0 && is_multiple(size, self.granule) {
            Ok(())
        } else {
            Err(invalid(
                op,
                format!("size {size} is not a non-zero multiple of {}", self.granule),
            ))
        }
    }

    // ---- address space ----

    /// Checks a reservation's size and alignment; returns the alignment to honour.
    pub(crate) fn check_reserve(&self, size: u64, alignment: u64) -> BackendResult<u64> {
        let op = Operation::Reserve;
        self.check_size(op, size)?;
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(invalid(
                op,
                format!("alignment {alignment} is not a power of two"),
            ));
        }
        Ok(alignment.max(self.granule))
    }

    pub(crate) fn record_reservation(&mut self, address: u64, size: u64) {
        self.reservations.insert(address, Reservation { size });
    }

    /// Checks that `[address, address + size)` is exactly a live reservation holding no
    /// live mapping.
    pub(crate) fn check_free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        let op = Operation::Free;
        let r = self
            .reservations
            .get(&address.0)
            .ok_or_else(|| invalid(op, format!("no reservation at {address}")))?;
        if r.size != size {
            return Err(invalid(
                op,
                format!("size {size} differs from the reserved {}", r.size),
            ));
        }
        let end = end_of(op, address.0, size)?;
        if self.mappings.range(address.0..end).next().is_some() {
            return Err(invalid(op, "a mapping inside the range is still live"));
        }
        Ok(())
    }

    pub(crate) fn remove_reservation(&mut self, address: u64) {
        self.reservations.remove(&address);
    }

    /// Every live reservation (for teardown).
    pub(crate) fn reservation_ranges(&self) -> Vec<(u64, u64)> {
        self.reservations
            .iter()
            .map(|(a, r)| (*a, r.size))
            .collect()
    }

    fn reservation_containing(&self, address: u64) -> Option<(u64, u64)> {
        self.reservations
            .range(..=address)
            .next_back()
            .filter(|(s, r)| address < s.saturating_add(r.size))
            .map(|(s, r)| (*s, r.size))
    }

    // ---- physical memory ----

    /// Checks a creation of `size` bytes against the granularity and the capacity.
    pub(crate) fn check_create(&self, size: u64) -> BackendResult<()> {
        let op = Operation::Create;
        self.check_size(op, size)?;
        if self
            .used
            .checked_add(size)
            .is_none_or(|u| u > self.capacity)
        {
            return Err(refused(
                op,
                ErrorKind::OutOfMemory,
                format!(
                    "{size} bytes requested, {} of the capacity of {} free",
                    self.capacity.saturating_sub(self.used),
                    self.capacity
                ),
            ));
        }
        Ok(())
    }

    /// Records a new handle of the allocation `key` (of `size` bytes) that owns `fd`.
    pub(crate) fn record_handle(
        &mut self,
        fd: OwnedFd,
        key: AllocationKey,
        size: u64,
        exportable: bool,
    ) -> PhysicalHandle {
        let a = self.allocations.entry(key).or_insert_with(|| Allocation {
            size,
            handles: 0,
            mappings: 0,
        });
        if a.handles == 0 && a.mappings == 0 {
            self.used = self.used.saturating_add(size);
        }
        a.handles = a.handles.saturating_add(1);
        let id = self.next_handle;
        self.next_handle = self.next_handle.saturating_add(0x10);
        self.handles.insert(
            id,
            Handle {
                fd,
                allocation: key,
                exportable,
            },
        );
        PhysicalHandle(id)
    }

    /// Forgets a handle and returns its memfd (closing it releases the handle); the
    /// allocation lives on while a mapping of it does.
    pub(crate) fn release(&mut self, handle: PhysicalHandle) -> BackendResult<OwnedFd> {
        let h = self
            .handles
            .remove(&handle.0)
            .ok_or_else(|| invalid(Operation::Release, format!("{handle} is not live")))?;
        if let Some(a) = self.allocations.get_mut(&h.allocation) {
            a.handles = a.handles.saturating_sub(1);
        }
        self.maybe_free_allocation(h.allocation);
        Ok(h.fd)
    }

    fn maybe_free_allocation(&mut self, key: AllocationKey) {
        let dead = self
            .allocations
            .get(&key)
            .is_some_and(|a| a.handles == 0 && a.mappings == 0);
        if dead {
            if let Some(a) = self.allocations.remove(&key) {
                self.used = self.used.saturating_sub(a.size);
            }
        }
    }

    fn handle(&self, op: Operation, handle: PhysicalHandle) -> BackendResult<&Handle> {
        self.handles
            .get(&handle.0)
            .ok_or_else(|| invalid(op, format!("{handle} is not live")))
    }

    /// The memfd of a handle that may be exported (`InvalidValue` otherwise, like a handle
    /// created without `ShareableHandleType::PosixFd` on CUDA).
    pub(crate) fn check_export(&self, handle: PhysicalHandle) -> BackendResult<BorrowedFd<'_>> {
        let op = Operation::Export;
        let h = self.handle(op, handle)?;
        if !h.exportable {
            return Err(invalid(
                op,
                format!("{handle} was not created exportable as a POSIX fd"),
            ));
        }
        Ok(h.fd.as_fd())
    }

    // ---- mappings ----

    /// Checks a map of `handle` at `address`, in the driver's order: the handle is live; the
    /// size is the handle's (a part of a handle is `NotSupported`, before any address
    /// check); the address is aligned, inside one reservation to its end, and not mapped.
    /// Returns the memfd to map.
    pub(crate) fn check_map(
        &self,
        address: DeviceAddress,
        size: u64,
        handle: PhysicalHandle,
    ) -> BackendResult<BorrowedFd<'_>> {
        let op = Operation::Map;
        let h = self.handle(op, handle)?;
        let a_size = self
            .allocations
            .get(&h.allocation)
            .map(|a| a.size)
            .ok_or_else(|| invalid(op, format!("{handle} has no allocation")))?;
        if size == 0 {
            return Err(invalid(op, "size 0"));
        }
        if size > a_size {
            return Err(invalid(
                op,
                format!("size {size} exceeds the handle's {a_size}"),
            ));
        }
        if size != a_size {
            return Err(not_supported(
                op,
                format!("map of {size} bytes of a {a_size}-byte handle (a handle is mapped whole)"),
            ));
        }
        if !is_multiple(address.0, self.granule) {
            return Err(invalid(
                op,
                format!("{address} is not aligned to {}", self.granule),
            ));
        }
        let end = end_of(op, address.0, size)?;
        let (r_start, r_size) = self
            .reservation_containing(address.0)
            .ok_or_else(|| invalid(op, format!("{address} is not reserved")))?;
        if end > r_start.saturating_add(r_size) {
            // CUDA does not check this; the host must, or MAP_FIXED would replace whatever the
            // process has mapped after the reservation.
            return Err(invalid(
                op,
                format!("map of {size} bytes at {address} runs past its reservation"),
            ));
        }
        let overlaps = self
            .mappings
            .range(..end)
            .next_back()
            .is_some_and(|(s, m)| s.saturating_add(m.size) > address.0);
        if overlaps {
            return Err(invalid(op, format!("{address} is already mapped")));
        }
        Ok(h.fd.as_fd())
    }

    /// Records a map that [`check_map`](Self::check_map) allowed and the kernel made.
    pub(crate) fn record_map(&mut self, address: DeviceAddress, size: u64, handle: PhysicalHandle) {
        let Some(key) = self.handles.get(&handle.0).map(|h| h.allocation) else {
            return;
        };
        if let Some(a) = self.allocations.get_mut(&key) {
            a.mappings = a.mappings.saturating_add(1);
        }
        self.mappings.insert(
            address.0,
            Mapping {
                size,
                allocation: key,
                access: Access::None,
            },
        );
    }

    /// The starts of the mappings that cover `[start, end)` exactly and contiguously.
    fn whole_mappings(&self, op: Operation, start: u64, end: u64) -> BackendResult<Vec<u64>> {
        if let Some((s, m)) = self.mappings.range(..start).next_back() {
            if s.saturating_add(m.size) > start {
                return Err(invalid(op, "range starts inside a mapping"));
            }
        }
        let mut cursor = start;
        let mut out = Vec::new();
        for (&s, m) in self.mappings.range(start..end) {
            if s != cursor {
                return Err(invalid(op, format!("{cursor:#x} is not mapped")));
            }
            let e = s.saturating_add(m.size);
            if e > end {
                return Err(invalid(op, "range ends inside a mapping"));
            }
            out.push(s);
            cursor = e;
        }
        if cursor != end {
            return Err(invalid(op, format!("{cursor:#x} is not mapped")));
        }
        Ok(out)
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
        let last = access
            .last()
            .ok_or_else(|| invalid(op, "empty access list"))?;
        for d in access {
            Self::check_device(op, d.device)?;
        }
        if size == 0 {
            return Err(invalid(op, "size 0"));
        }
        let end = end_of(op, address.0, size)?;
        self.whole_mappings(op, address.0, end)?;
        Ok(last.access)
    }

    /// Records the access of the mappings in `[address, address + size)`.
    pub(crate) fn record_access(&mut self, address: DeviceAddress, size: u64, access: Access) {
        let end = address.0.saturating_add(size);
        for (_, m) in self.mappings.range_mut(address.0..end) {
            m.access = access;
        }
    }

    /// The mappings `[address, address + size)` unmaps, merged into runs of adjacent
    /// mappings `(start, len)`: every mapping must be covered whole; none is fine.
    pub(crate) fn check_unmap(
        &self,
        address: DeviceAddress,
        size: u64,
    ) -> BackendResult<Vec<(u64, u64)>> {
        let op = Operation::Unmap;
        if size == 0 {
            return Err(invalid(op, "size 0"));
        }
        let end = end_of(op, address.0, size)?;
        if let Some((s, m)) = self.mappings.range(..address.0).next_back() {
            if s.saturating_add(m.size) > address.0 {
                return Err(invalid(op, "unmap of part of a mapping"));
            }
        }
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (&s, m) in self.mappings.range(address.0..end) {
            let e = end_of(op, s, m.size)?;
            if e > end {
                return Err(invalid(op, "unmap of part of a mapping"));
            }
            match runs.last_mut() {
                Some((rs, rl)) if rs.saturating_add(*rl) == s => *rl = rl.saturating_add(m.size),
                _ => runs.push((s, m.size)),
            }
        }
        Ok(runs)
    }

    /// Forgets the mappings inside `[start, start + len)` (a run the kernel has unmapped);
    /// an allocation with no handle nor mapping left is freed. Returns the mappings removed.
    pub(crate) fn record_unmap(&mut self, start: u64, len: u64) -> u64 {
        let end = start.saturating_add(len);
        let starts: Vec<u64> = self.mappings.range(start..end).map(|(s, _)| *s).collect();
        for s in &starts {
            if let Some(m) = self.mappings.remove(s) {
                if let Some(a) = self.allocations.get_mut(&m.allocation) {
                    a.mappings = a.mappings.saturating_sub(1);
                }
                self.maybe_free_allocation(m.allocation);
            }
        }
        u64::try_from(starts.len()).unwrap_or(u64::MAX)
    }

    /// Checks that every byte of `[start, start + len)` is mapped, with write access when
    /// `write` and read access otherwise; `need_access: false` checks only that it is mapped
    /// (the probes, whose accesses the MMU checks).
    pub(crate) fn check_range(
        &self,
        op: Operation,
        start: u64,
        len: u64,
        need: Option<bool>,
    ) -> BackendResult<()> {
        let end = end_of(op, start, len)?;
        let mut cursor = start;
        while cursor < end {
            let (ms, m) = self
                .mappings
                .range(..=cursor)
                .next_back()
                .filter(|(s, m)| cursor < s.saturating_add(m.size))
                .ok_or_else(|| invalid(op, format!("{cursor:#x} is not mapped")))?;
            if let Some(write) = need {
                let allowed = if write {
                    m.access.can_write()
                } else {
                    m.access.can_read()
                };
                if !allowed {
                    return Err(invalid(
                        op,
                        format!(
                            "{cursor:#x} has access {:?}, {} needed",
                            m.access,
                            if write { "write" } else { "read" }
                        ),
                    ));
                }
            }
            cursor = ms.saturating_add(m.size);
        }
        Ok(())
    }

    // ---- import ----

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
