//! Physical memory: create and release handles, export and import them as POSIX descriptors.

use std::fs::File;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;

use kvvm_hal::{
    AllocationProperties, BackendError, DeviceId, ErrorKind, Operation, PhysicalHandle,
    ShareableHandleType,
};

use super::{invalid, SimAllocation, State};
use crate::error::sim_error;

impl State {
    pub(crate) fn create(
        &mut self,
        size: u64,
        props: &AllocationProperties,
    ) -> Result<PhysicalHandle, BackendError> {
        let op = Operation::Create;
        let d = self.device(op, props.device)?;
        let (granule, capacity, posix_fd) = (d.granularity.minimum.max(1), d.capacity, d.posix_fd);
        self.model.check_size(op, size, granule)?;
        if props.handle_type == ShareableHandleType::PosixFd && !posix_fd {
            return Err(sim_error(
                op,
                ErrorKind::NotSupported,
                "POSIX fd handles not supported",
            ));
        }
        self.model
            .check_capacity(op, props.device, size, capacity)?;
        let extra = SimAllocation {
            handle_type: props.handle_type,
            data: crate::store::ChunkStore::default(),
            exports: Vec::new(),
        };
        let id = self.model.new_allocation(props.device, size, extra);
        Ok(self.model.new_handle(id, ()))
    }

    /// Releases a handle; returns the size of its allocation (what the release is charged for).
    pub(crate) fn release(&mut self, handle: PhysicalHandle) -> Result<u64, BackendError> {
        let released = self.model.release(handle)?;
        if self.quirks.release_frees_mapped {
            // Deliberately wrong: drop the data and the capacity at once, mapped or not.
            let id = released.allocation;
            if let Some(a) = self.model.allocation_mut(id).filter(|a| a.handles == 0) {
                a.extra.data.clear();
                self.model.free_bytes_now(id);
            }
        }
        Ok(released.size)
    }

    pub(crate) fn export(&mut self, handle: PhysicalHandle) -> Result<OwnedFd, BackendError> {
        let op = Operation::Export;
        let id = self.model.allocation_of(op, handle)?;
        let a = self
            .model
            .allocation_mut(id)
            .map(|a| &mut a.extra)
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
            .model
            .find_allocation(|a| a.extra.exports.iter().any(|(i, _)| *i == ino))
            .ok_or_else(|| invalid(op, "descriptor was not exported by this driver"))?;
        let owner = self.model.allocation(id).map(|a| a.device);
        if let Some(owner) = owner.filter(|o| *o != device) {
            return Err(invalid(
                op,
                format!("the memory is on {owner}, not {device}"),
            ));
        }
        Ok(self.model.new_handle(id, ()))
    }
}
