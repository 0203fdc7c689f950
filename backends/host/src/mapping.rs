//! Bookkeeping of mappings: map, set access, unmap, and the ranges copies may touch.

use std::os::fd::{AsFd, BorrowedFd};

use kvvm_hal::{Access, AccessDescriptor, BackendResult, DeviceAddress, Operation, PhysicalHandle};

use crate::conv::{end_of, is_multiple};
use crate::error::{invalid, not_supported};
use crate::state::{Mapping, State};

impl State {
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
    pub(crate) fn whole_mappings(
        &self,
        op: Operation,
        start: u64,
        end: u64,
    ) -> BackendResult<Vec<u64>> {
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
}
