//! Mappings: map, set access and unmap, in the driver's semantics (the shared model's checks)
//! and with the simulator's quirks.

use kvvm_hal::{AccessDescriptor, BackendError, DeviceAddress, Operation, PhysicalHandle};

use super::{invalid, State};

impl State {
    pub(crate) fn map(
        &mut self,
        address: DeviceAddress,
        size: u64,
        handle: PhysicalHandle,
    ) -> Result<(), BackendError> {
        let op = Operation::Map;
        let id = self.model.allocation_of(op, handle)?;
        let device = self
            .model
            .allocation(id)
            .map(|a| a.device)
            .ok_or_else(|| invalid(op, format!("{handle} has no allocation")))?;
        let granule = self.device(op, device)?.granularity.minimum.max(1);
        // Measured on the H200 (driver 580.159.04): a handle is mapped whole. A map of part of
        // a handle is refused with NOT_SUPPORTED before any address check; with the whole
        // handle, a bad address (unaligned, unreserved, already mapped) is INVALID_VALUE. A
        // map past the end of its reservation is refused too (the real driver does not check
        // it; the simulator does, so that bugs surface).
        self.model.check_map(address, size, handle, granule)?;
        self.model.insert_mapping(address, size, handle);
        Ok(())
    }

    /// Sets access; returns the number and bytes of the mappings that had no access before
    /// (the fresh mappings, what the call is charged for).
    pub(crate) fn set_access(
        &mut self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> Result<(u64, u64), BackendError> {
        for d in access {
            self.device(Operation::SetAccess, d.device)?;
        }
        // Access from another device needs a peer link to the memory's device (the driver
        // refuses the whole call otherwise).
        let peers = &self.peers;
        let linked = |owner: kvvm_hal::DeviceId, d: kvvm_hal::DeviceId| peers.linked(owner.0, d.0);
        self.model.check_set_access(address, size, access, linked)?;
        Ok(self.model.set_access(address, size, access))
    }

    /// Unmaps; returns the number of mappings removed and their bytes.
    pub(crate) fn unmap(
        &mut self,
        address: DeviceAddress,
        size: u64,
    ) -> Result<(u64, u64), BackendError> {
        let op = Operation::Unmap;
        let inside = self.model.check_unmap(address, size)?;
        if inside.is_empty() && self.quirks.report_double_unmap {
            return Err(invalid(op, "nothing mapped (quirk: double unmap reported)"));
        }
        if inside.len() > 1 && self.quirks.multi_unmap_breaks_free {
            if let Some((start, _)) = self.model.range_containing(address.0) {
                self.broken_by_multi_unmap.insert(start);
            }
        }
        Ok(self.model.unmap(address, size))
    }
}
