//! Mappings: map, set access and unmap, in the driver's semantics (and its quirks).

use kvvm_hal::{Access, AccessDescriptor, BackendError, DeviceAddress, Operation, PhysicalHandle};

use crate::state::{end_of, invalid, not_supported, Mapping, State};

impl State {
    pub(crate) fn map(
        &mut self,
        address: DeviceAddress,
        size: u64,
        handle: PhysicalHandle,
    ) -> Result<(), BackendError> {
        let op = Operation::Map;
        let id = self.allocation_of(op, handle)?;
        let a = self
            .allocations
            .get(&id)
            .ok_or_else(|| invalid(op, format!("{handle} has no allocation")))?;
        let g = self.device(op, a.device)?.granularity.minimum.max(1);
        let a_size = a.size;
        if size == 0 {
            return Err(invalid(op, "size 0"));
        }
        if size > a_size {
            return Err(invalid(
                op,
                format!("size {size} exceeds the handle's {a_size}"),
            ));
        }
        // Measured on the H200 (driver 580.159.04): a handle is mapped whole. A map of part of
        // a handle is refused with NOT_SUPPORTED before any address check; with the whole
        // handle, a bad address (unaligned, unreserved, already mapped) is INVALID_VALUE.
        if size != a_size || !size.is_multiple_of(g) {
            return Err(not_supported(
                op,
                format!("map of {size} bytes of a {a_size}-byte handle (a handle is mapped whole)"),
            ));
        }
        if !address.0.is_multiple_of(g) {
            return Err(invalid(op, format!("{address} not aligned to {g}")));
        }
        let end = end_of(op, address.0, size)?;
        let (r_start, r) = self
            .reservation_containing(address.0)
            .ok_or_else(|| invalid(op, format!("{address} is not reserved")))?;
        if end > r_start.saturating_add(r.size) {
            // The real driver does not check this; the simulator does, so that bugs surface.
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
        self.mappings.insert(
            address.0,
            Mapping {
                size,
                allocation: id,
                access: vec![Access::None; self.devices.len()],
            },
        );
        if let Some(a) = self.allocations.get_mut(&id) {
            a.mappings += 1;
        }
        Ok(())
    }

    /// Mapping starts covering `[start, end)` exactly and contiguously, or an error.
    pub(crate) fn whole_mappings(
        &self,
        op: Operation,
        start: u64,
        end: u64,
    ) -> Result<Vec<u64>, BackendError> {
        let mut cursor = start;
        let mut out = Vec::new();
        if let Some((s, m)) = self.mappings.range(..start).next_back() {
            if s.saturating_add(m.size) > start {
                return Err(invalid(op, "range starts inside a mapping"));
            }
        }
        for (&s, m) in self.mappings.range(start..end) {
            if s != cursor {
                return Err(invalid(op, format!("{:#x} is not mapped", cursor)));
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

    /// Sets access; returns the number and bytes of the mappings that had no access before
    /// (the fresh mappings, what the call is charged for).
    pub(crate) fn set_access(
        &mut self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> Result<(u64, u64), BackendError> {
        let op = Operation::SetAccess;
        if size == 0 || access.is_empty() {
            return Err(invalid(op, "empty range or access list"));
        }
        for d in access {
            self.device(op, d.device)?;
        }
        let end = end_of(op, address.0, size)?;
        let starts = self.whole_mappings(op, address.0, end)?;
        // Access from another device needs a peer link to the memory's device (the driver
        // refuses the whole call otherwise).
        for s in &starts {
            let owner = self
                .mappings
                .get(s)
                .and_then(|m| self.allocations.get(&m.allocation))
                .map(|a| a.device);
            for d in access {
                if let Some(owner) = owner {
                    if d.access != Access::None && !self.peers.linked(owner.0, d.device.0) {
                        return Err(not_supported(
                            op,
                            format!("{} has no peer link to {owner}", d.device),
                        ));
                    }
                }
            }
        }
        let (mut fresh, mut fresh_bytes) = (0u64, 0u64);
        for s in starts {
            if let Some(m) = self.mappings.get_mut(&s) {
                if m.access.iter().all(|a| *a == Access::None) {
                    fresh = fresh.saturating_add(1);
                    fresh_bytes = fresh_bytes.saturating_add(m.size);
                }
                for d in access {
                    if let Some(slot) = m.access.get_mut(d.device.0 as usize) {
                        *slot = d.access;
                    }
                }
            }
        }
        Ok((fresh, fresh_bytes))
    }

    /// Unmaps; returns the number of mappings removed and their bytes.
    pub(crate) fn unmap(
        &mut self,
        address: DeviceAddress,
        size: u64,
    ) -> Result<(u64, u64), BackendError> {
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
        let starts: Vec<(u64, u64)> = self
            .mappings
            .range(address.0..end)
            .map(|(s, m)| (*s, m.size))
            .collect();
        if starts.iter().any(|(s, sz)| s.saturating_add(*sz) > end) {
            return Err(invalid(op, "unmap of part of a mapping"));
        }
        if starts.is_empty() && self.quirks.report_double_unmap {
            return Err(invalid(op, "nothing mapped (quirk: double unmap reported)"));
        }
        if starts.len() > 1 && self.quirks.multi_unmap_breaks_free {
            if let Some((rs, _)) = self.reservation_containing(address.0) {
                if let Some(r) = self.reservations.get_mut(&rs) {
                    r.broken_by_multi_unmap = true;
                }
            }
        }
        for (s, _) in &starts {
            if let Some(m) = self.mappings.remove(s) {
                if let Some(a) = self.allocations.get_mut(&m.allocation) {
                    a.mappings = a.mappings.saturating_sub(1);
                }
                self.maybe_free_allocation(m.allocation);
            }
        }
        let bytes = starts.iter().fold(0u64, |b, (_, sz)| b.saturating_add(*sz));
        Ok((starts.len() as u64, bytes))
    }
}
