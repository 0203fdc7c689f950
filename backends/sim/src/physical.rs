//! Physical memory: create and release handles, export and import them as POSIX descriptors.

use std::fs::File;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;

use kvvm_hal::{
    AllocationProperties, BackendError, DeviceId, ErrorKind, Operation, PhysicalHandle,
    ShareableHandleType,
};

use crate::sim_error;
use crate::state::{invalid, not_supported, Allocation, State};

impl State {
    pub(crate) fn create(
        &mut self,
        size: u64,
        props: &AllocationProperties,
    ) -> Result<PhysicalHandle, BackendError> {
        let op = Operation::Create;
        let d = self.device(op, props.device)?;
        let g = d.granularity.minimum.max(1);
        if size == 0 || !size.is_multiple_of(g) {
            return Err(invalid(op, format!("size {size} is not a multiple of {g}")));
        }
        if props.handle_type == ShareableHandleType::PosixFd && !d.posix_fd {
            return Err(not_supported(op, "POSIX fd handles not supported"));
        }
        let capacity = d.capacity;
        let idx = props.device.0 as usize;
        let used = self.used.get(idx).copied().unwrap_or(0);
        if used.checked_add(size).is_none_or(|u| u > capacity) {
            return Err(sim_error(
                op,
                ErrorKind::OutOfMemory,
                format!(
                    "{size} bytes requested, {} free",
                    capacity.saturating_sub(used)
                ),
            ));
        }
        if let Some(u) = self.used.get_mut(idx) {
            *u = used + size;
        }
        let id = self.next_allocation;
        self.next_allocation += 1;
        self.allocations.insert(
            id,
            Allocation {
                device: props.device,
                size,
                handle_type: props.handle_type,
                handles: 1,
                mappings: 0,
                data: crate::store::ChunkStore::default(),
                exports: Vec::new(),
            },
        );
        Ok(self.new_handle(id))
    }

    pub(crate) fn new_handle(&mut self, allocation: u64) -> PhysicalHandle {
        let h = self.next_handle;
        self.next_handle += 0x10;
        self.handles.insert(h, allocation);
        PhysicalHandle(h)
    }

    /// Releases a handle; returns the size of its allocation (what the release is charged for).
    pub(crate) fn release(&mut self, handle: PhysicalHandle) -> Result<u64, BackendError> {
        let op = Operation::Release;
        let id = self
            .handles
            .remove(&handle.0)
            .ok_or_else(|| invalid(op, format!("{handle} is not live")))?;
        let size = self.allocations.get(&id).map_or(0, |a| a.size);
        if let Some(a) = self.allocations.get_mut(&id) {
            a.handles = a.handles.saturating_sub(1);
            if self.quirks.release_frees_mapped && a.handles == 0 {
                // Deliberately wrong: drop the data and the capacity at once.
                a.data.clear();
                let (dev, size) = (a.device.0 as usize, a.size);
                a.size = 0;
                if let Some(u) = self.used.get_mut(dev) {
                    *u = u.saturating_sub(size);
                }
            }
        }
        self.maybe_free_allocation(id);
        Ok(size)
    }

    pub(crate) fn maybe_free_allocation(&mut self, id: u64) {
        let dead = self
            .allocations
            .get(&id)
            .is_some_and(|a| a.handles == 0 && a.mappings == 0);
        if dead {
            if let Some(a) = self.allocations.remove(&id) {
                if let Some(u) = self.used.get_mut(a.device.0 as usize) {
                    *u = u.saturating_sub(a.size);
                }
            }
        }
    }

    /// The allocation a live handle refers to, or `InvalidValue`.
    pub(crate) fn allocation_of(
        &self,
        op: Operation,
        handle: PhysicalHandle,
    ) -> Result<u64, BackendError> {
        self.handles
            .get(&handle.0)
            .copied()
            .ok_or_else(|| invalid(op, format!("{handle} is not live")))
    }

    pub(crate) fn export(&mut self, handle: PhysicalHandle) -> Result<OwnedFd, BackendError> {
        let op = Operation::Export;
        let id = self.allocation_of(op, handle)?;
        let a = self
            .allocations
            .get_mut(&id)
            .ok_or_else(|| invalid(op, "handle without allocation"))?;
        if a.handle_type != ShareableHandleType::PosixFd {
            return Err(invalid(
                op,
                "handle was not created exportable as a POSIX fd",
            ));
        }
        let io = |e: std::io::Error| sim_error(op, ErrorKind::Other, e.to_string());
        let (exported, _peer) = UnixStream::pair().map_err(io)?;
        let fd: OwnedFd = exported.into();
        let keep = fd.try_clone().map_err(io)?;
        let ino = File::from(keep.try_clone().map_err(io)?)
            .metadata()
            .map_err(io)?
            .ino();
        a.exports.push((ino, keep));
        Ok(fd)
    }

    /// Imports on `device`: the memory must be that device's (a handle is imported where it
    /// was created, as the drivers require).
    pub(crate) fn import(
        &mut self,
        device: DeviceId,
        fd: BorrowedFd<'_>,
    ) -> Result<PhysicalHandle, BackendError> {
        let op = Operation::Import;
        let io = |e: std::io::Error| invalid(op, e.to_string());
        let ino = File::from(fd.try_clone_to_owned().map_err(io)?)
            .metadata()
            .map_err(io)?
            .ino();
        let id = self
            .allocations
            .iter()
            .find(|(_, a)| a.exports.iter().any(|(i, _)| *i == ino))
            .map(|(id, _)| *id)
            .ok_or_else(|| invalid(op, "descriptor was not exported by this driver"))?;
        let owner = self.allocations.get(&id).map(|a| a.device);
        if owner.is_some_and(|o| o != device) {
            return Err(invalid(
                op,
                format!("the memory is on {}, not {device}", owner.unwrap_or(device)),
            ));
        }
        if let Some(a) = self.allocations.get_mut(&id) {
            a.handles += 1;
        }
        Ok(self.new_handle(id))
    }
}
