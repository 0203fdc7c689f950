//! Physical memory: allocations, the handles that refer to them, and release with the
//! driver's deferred free.

use crate::{BackendError, DeviceId, ErrorKind, Operation, PhysicalHandle};

use super::{Allocation, AllocationId, DriverModel, Handle};

/// What a release gave back.
#[derive(Debug)]
pub struct Released<H> {
    /// What the model's user kept with the handle (the host's memfd, to close).
    pub extra: H,
    /// The allocation it referred to (alive still if mapped).
    pub allocation: AllocationId,
    /// The allocation's size (what a release is charged for).
    pub size: u64,
}

impl<A, H> DriverModel<A, H> {
    /// `OutOfMemory` unless `size` more bytes fit in `capacity` on `device`.
    pub fn check_capacity(
        &self,
        op: Operation,
        device: DeviceId,
        size: u64,
        capacity: u64,
    ) -> Result<(), BackendError> {
        let used = self.used_on(device);
        if used.checked_add(size).is_none_or(|u| u > capacity) {
            return Err(self.refuse(
                op,
                ErrorKind::OutOfMemory,
                format!(
                    "{size} bytes requested, {} of the capacity of {capacity} free",
                    capacity.saturating_sub(used)
                ),
            ));
        }
        Ok(())
    }

    /// Records a new allocation of `size` bytes on `device`, with no handle yet.
    pub fn new_allocation(&mut self, device: DeviceId, size: u64, extra: A) -> AllocationId {
        let id = self.next_allocation;
        self.next_allocation = self.next_allocation.saturating_add(1);
        self.allocations.insert(
            id,
            Allocation {
                device,
                size,
                handles: 0,
                mappings: 0,
                extra,
            },
        );
        self.add_used(device, size);
        id
    }

    /// Records a new handle of `allocation`, with an id of the model's (never reused).
    pub fn new_handle(&mut self, allocation: AllocationId, extra: H) -> PhysicalHandle {
        let id = self.next_handle;
        self.next_handle = self.next_handle.saturating_add(0x10);
        self.attach(id, allocation, extra);
        PhysicalHandle(id)
    }

    /// Records `handle`, which a driver underneath returned for a new allocation of `size`
    /// bytes on `device`; false (and nothing recorded) if that handle is live already.
    pub fn adopt_handle(
        &mut self,
        handle: PhysicalHandle,
        device: DeviceId,
        size: u64,
        allocation: A,
        extra: H,
    ) -> bool {
        if self.handles.contains_key(&handle.0) {
            return false;
        }
        let id = self.new_allocation(device, size, allocation);
        self.attach(handle.0, id, extra);
        true
    }

    fn attach(&mut self, handle: u64, allocation: AllocationId, extra: H) {
        if let Some(a) = self.allocations.get_mut(&allocation) {
            a.handles = a.handles.saturating_add(1);
        }
        self.handles.insert(handle, Handle { allocation, extra });
    }

    /// Releases a live handle (`InvalidValue` otherwise: a second release); its allocation
    /// is freed now, or at its last unmap if it is mapped.
    pub fn release(&mut self, handle: PhysicalHandle) -> Result<Released<H>, BackendError> {
        let op = Operation::Release;
        let h = self
            .handles
            .remove(&handle.0)
            .ok_or_else(|| self.invalid(op, format!("{handle} is not live")))?;
        let mut size = 0;
        if let Some(a) = self.allocations.get_mut(&h.allocation) {
            a.handles = a.handles.saturating_sub(1);
            size = a.size;
        }
        self.free_if_dead(h.allocation);
        Ok(Released {
            extra: h.extra,
            allocation: h.allocation,
            size,
        })
    }

    /// Frees `allocation` if no handle and no mapping refer to it any more.
    pub fn free_if_dead(&mut self, allocation: AllocationId) {
        let dead = self
            .allocations
            .get(&allocation)
            .is_some_and(|a| a.handles == 0 && a.mappings == 0);
        if dead {
            if let Some(a) = self.allocations.remove(&allocation) {
                self.sub_used(a.device, a.size);
            }
        }
    }

    /// Gives the bytes of a still-mapped allocation back now (its size becomes 0): what a
    /// driver that frees at release instead of the last unmap does (the simulator's
    /// deliberately wrong quirk).
    pub fn free_bytes_now(&mut self, allocation: AllocationId) {
        let Some(a) = self.allocations.get_mut(&allocation) else {
            return;
        };
        let (device, size) = (a.device, a.size);
        a.size = 0;
        self.sub_used(device, size);
    }

    /// The live handle `handle`, or `InvalidValue`.
    pub fn handle(
        &self,
        op: Operation,
        handle: PhysicalHandle,
    ) -> Result<&Handle<H>, BackendError> {
        self.handles
            .get(&handle.0)
            .ok_or_else(|| self.invalid(op, format!("{handle} is not live")))
    }

    /// The allocation a live handle refers to, or `InvalidValue`.
    pub fn allocation_of(
        &self,
        op: Operation,
        handle: PhysicalHandle,
    ) -> Result<AllocationId, BackendError> {
        self.handle(op, handle).map(|h| h.allocation)
    }

    /// A live allocation.
    pub fn allocation(&self, id: AllocationId) -> Option<&Allocation<A>> {
        self.allocations.get(&id)
    }

    /// A live allocation, to change what its user keeps with it.
    pub fn allocation_mut(&mut self, id: AllocationId) -> Option<&mut Allocation<A>> {
        self.allocations.get_mut(&id)
    }

    /// The first live allocation that `found` accepts (an import looking for the memory a
    /// descriptor refers to).
    pub fn find_allocation(&self, found: impl Fn(&Allocation<A>) -> bool) -> Option<AllocationId> {
        self.allocations
            .iter()
            .find(|(_, a)| found(a))
            .map(|(id, _)| *id)
    }
}
