//! Bookkeeping of physical memory: create, release, export.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use kvvm_hal::{BackendResult, ErrorKind, Operation, PhysicalHandle};

use crate::error::{invalid, refused};
use crate::state::{Allocation, AllocationKey, Handle, State};

impl State {
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

    pub(crate) fn maybe_free_allocation(&mut self, key: AllocationKey) {
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

    pub(crate) fn handle(&self, op: Operation, handle: PhysicalHandle) -> BackendResult<&Handle> {
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
}
