//! Mappings: map, set access and unmap, with the checks of the driver's contract in its
//! order (measured on the H200, `docs/driver-semantics.md`).

use crate::PhysicalHandle;
use crate::{
    Access, AccessDescriptor, BackendError, DeviceAddress, DeviceId, ErrorKind, Operation,
};

use super::{DriverModel, Handle, Mapping};

impl<A, H> DriverModel<A, H> {
    /// Checks a map of `handle` at `address`, in the driver's order: the handle is live; the
    /// size is the handle's (a part of a handle, or a size off the `granule`, is
    /// `NotSupported`, before any address check); the address is aligned to `granule`,
    /// reserved to the end of the map, and not mapped (`InvalidValue`). Returns the handle.
    pub fn check_map(
        &self,
        address: DeviceAddress,
        size: u64,
        handle: PhysicalHandle,
        granule: u64,
    ) -> Result<&Handle<H>, BackendError> {
        let op = Operation::Map;
        let h = self.handle(op, handle)?;
        let whole = self
            .allocation(h.allocation)
            .map(|a| a.size)
            .ok_or_else(|| self.invalid(op, format!("{handle} has no allocation")))?;
        let g = granule.max(1);
        if size == 0 {
            return Err(self.invalid(op, "size 0"));
        }
        if size > whole {
            return Err(self.invalid(op, format!("size {size} exceeds the handle's {whole}")));
        }
        if size != whole || !size.is_multiple_of(g) {
            return Err(self.refuse(
                op,
                ErrorKind::NotSupported,
                format!("map of {size} bytes of a {whole}-byte handle (a handle is mapped whole)"),
            ));
        }
        if !address.0.is_multiple_of(g) {
            return Err(self.invalid(op, format!("{address} is not aligned to {g}")));
        }
        self.check_map_target(op, address, size)?;
        Ok(h)
    }

    /// Checks where a map would go: `[address, address + size)` lies in one reserved range,
    /// to its end, and no live mapping overlaps it (`InvalidValue` otherwise). No real driver
    /// checks the end; the simulator refuses a map past it so that bugs surface, the host
    /// because `MAP_FIXED` would replace memory beyond the reservation.
    pub fn check_map_target(
        &self,
        op: Operation,
        address: DeviceAddress,
        size: u64,
    ) -> Result<(), BackendError> {
        let end = self.end_of(op, address.0, size)?;
        let (start, reserved) = self
            .range_containing(address.0)
            .ok_or_else(|| self.invalid(op, format!("{address} is not reserved")))?;
        if end > start.saturating_add(reserved) {
            return Err(self.invalid(
                op,
                format!("{size} bytes at {address} run past their reservation"),
            ));
        }
        let overlaps = self
            .mappings
            .range(..end)
            .next_back()
            .is_some_and(|(s, m)| s.saturating_add(m.size) > address.0);
        if overlaps {
            return Err(self.invalid(op, format!("{address} is already mapped")));
        }
        Ok(())
    }

    /// Records a map the driver made, with no access yet; false (and nothing recorded) if
    /// `handle` is not live.
    pub fn insert_mapping(
        &mut self,
        address: DeviceAddress,
        size: u64,
        handle: PhysicalHandle,
    ) -> bool {
        let Some(allocation) = self.handles.get(&handle.0).map(|h| h.allocation) else {
            return false;
        };
        if let Some(a) = self.allocations.get_mut(&allocation) {
            a.mappings = a.mappings.saturating_add(1);
        }
        let mapping = Mapping {
            size,
            allocation,
            access: Vec::new(),
        };
        self.mappings.insert(address.0, mapping);
        true
    }

    /// The starts of the mappings that cover `[start, end)` exactly and contiguously, or
    /// `InvalidValue` (a range that starts or ends inside a mapping, or has a hole).
    pub fn whole_mappings(
        &self,
        op: Operation,
        start: u64,
        end: u64,
    ) -> Result<Vec<u64>, BackendError> {
        if let Some((s, m)) = self.mappings.range(..start).next_back() {
            if s.saturating_add(m.size) > start {
                return Err(self.invalid(op, "range starts inside a mapping"));
            }
        }
        let mut cursor = start;
        let mut out = Vec::new();
        for (&s, m) in self.mappings.range(start..end) {
            if s != cursor {
                return Err(self.invalid(op, format!("{cursor:#x} is not mapped")));
            }
            let e = s.saturating_add(m.size);
            if e > end {
                return Err(self.invalid(op, "range ends inside a mapping"));
            }
            out.push(s);
            cursor = e;
        }
        if cursor != end {
            return Err(self.invalid(op, format!("{cursor:#x} is not mapped")));
        }
        Ok(out)
    }

    /// Checks a set access: a non-empty range and list, over whole mappings, and every device
    /// given access to memory of another one `linked` to it (`linked(owner, device)`;
    /// `NotSupported` otherwise, the driver refusing the whole call). The devices themselves
    /// are the caller's to check.
    pub fn check_set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
        linked: impl Fn(DeviceId, DeviceId) -> bool,
    ) -> Result<(), BackendError> {
        let op = Operation::SetAccess;
        if size == 0 || access.is_empty() {
            return Err(self.invalid(op, "empty range or access list"));
        }
        let end = self.end_of(op, address.0, size)?;
        for start in self.whole_mappings(op, address.0, end)? {
            let owner = self
                .mappings
                .get(&start)
                .and_then(|m| self.allocation(m.allocation))
                .map(|a| a.device);
            let Some(owner) = owner else { continue };
            if let Some(d) = access
                .iter()
                .find(|d| d.access != Access::None && !linked(owner, d.device))
            {
                return Err(self.refuse(
                    op,
                    ErrorKind::NotSupported,
                    format!("{} has no peer link to {owner}", d.device),
                ));
            }
        }
        Ok(())
    }

    /// The mappings starting in `[address, address + size)`, as `(count, bytes)`; with
    /// `fresh`, only those no device has access to yet.
    pub fn extent_in(&self, address: DeviceAddress, size: u64, fresh: bool) -> (u64, u64) {
        let end = address.0.saturating_add(size);
        self.mappings
            .range(address.0..end)
            .filter(|(_, m)| !fresh || m.has_no_access())
            .fold((0u64, 0u64), |(n, b), (_, m)| {
                (n.saturating_add(1), b.saturating_add(m.size))
            })
    }

    /// Records a set access the driver made on the mappings starting in
    /// `[address, address + size)`; returns the fresh ones' `(count, bytes)` (those that had
    /// no access before: what the call is charged for).
    pub fn set_access(
        &mut self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> (u64, u64) {
        let fresh = self.extent_in(address, size, true);
        let end = address.0.saturating_add(size);
        for (_, m) in self.mappings.range_mut(address.0..end) {
            for d in access {
                let i = d.device.0 as usize;
                if m.access.len() <= i {
                    m.access.resize(i.saturating_add(1), Access::None);
                }
                if let Some(slot) = m.access.get_mut(i) {
                    *slot = d.access;
                }
            }
        }
        fresh
    }

    /// Checks an unmap: every mapping in `[address, address + size)` is covered whole
    /// (`InvalidValue` otherwise); none at all is fine. Returns the mappings `(start, size)`
    /// it unmaps, by address.
    pub fn check_unmap(
        &self,
        address: DeviceAddress,
        size: u64,
    ) -> Result<Vec<(u64, u64)>, BackendError> {
        let op = Operation::Unmap;
        if size == 0 {
            return Err(self.invalid(op, "size 0"));
        }
        let end = self.end_of(op, address.0, size)?;
        if let Some((s, m)) = self.mappings.range(..address.0).next_back() {
            if s.saturating_add(m.size) > address.0 {
                return Err(self.invalid(op, "unmap of part of a mapping"));
            }
        }
        let inside: Vec<(u64, u64)> = self
            .mappings
            .range(address.0..end)
            .map(|(s, m)| (*s, m.size))
            .collect();
        if inside.iter().any(|(s, len)| s.saturating_add(*len) > end) {
            return Err(self.invalid(op, "unmap of part of a mapping"));
        }
        Ok(inside)
    }

    /// Records an unmap the driver made: forgets the mappings starting in
    /// `[address, address + size)` and frees each allocation nothing refers to any more.
    /// Returns the mappings removed as `(count, bytes)`.
    pub fn unmap(&mut self, address: DeviceAddress, size: u64) -> (u64, u64) {
        let end = address.0.saturating_add(size);
        let starts: Vec<u64> = self
            .mappings
            .range(address.0..end)
            .map(|(s, _)| *s)
            .collect();
        let (mut count, mut bytes) = (0u64, 0u64);
        for s in starts {
            let Some(m) = self.mappings.remove(&s) else {
                continue;
            };
            count = count.saturating_add(1);
            bytes = bytes.saturating_add(m.size);
            if let Some(a) = self.allocations.get_mut(&m.allocation) {
                a.mappings = a.mappings.saturating_sub(1);
            }
            self.free_if_dead(m.allocation);
        }
        (count, bytes)
    }
}
