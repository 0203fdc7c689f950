//! A tracker of what a case created, undone on drop, so a failing case leaves nothing behind.

use kvvm_hal::{
    AccessDescriptor, AllocationProperties, BackendError, DeviceAddress, DeviceId, PhysicalHandle,
    VirtualMemoryBackend,
};

/// Resources a case created and has not yet given back.
pub(crate) struct Scratch<'a> {
    pub(crate) backend: &'a dyn VirtualMemoryBackend,
    pub(crate) device: DeviceId,
    /// Other devices given access to the mappings, synchronized too before they are unmapped.
    peers: Vec<DeviceId>,
    reservations: Vec<(DeviceAddress, u64)>,
    handles: Vec<PhysicalHandle>,
    mappings: Vec<(DeviceAddress, u64)>,
}

impl<'a> Scratch<'a> {
    pub(crate) fn new(backend: &'a dyn VirtualMemoryBackend, device: DeviceId) -> Self {
        Scratch {
            backend,
            device,
            peers: Vec::new(),
            reservations: Vec::new(),
            handles: Vec::new(),
            mappings: Vec::new(),
        }
    }

    /// Records that `peer` was given access to (and may run kernels on) these mappings: the
    /// teardown synchronizes it as well as the device under test.
    pub(crate) fn shared_with(&mut self, peer: DeviceId) {
        if peer != self.device && !self.peers.contains(&peer) {
            self.peers.push(peer);
        }
    }

    pub(crate) fn props(&self) -> AllocationProperties {
        AllocationProperties::device(self.device)
    }

    pub(crate) fn reserve(&mut self, size: u64) -> Result<DeviceAddress, BackendError> {
        let va = self.backend.reserve(size, 0, None)?;
        self.reservations.push((va, size));
        Ok(va)
    }

    pub(crate) fn create(&mut self, size: u64) -> Result<PhysicalHandle, BackendError> {
        let props = self.props();
        self.create_with(size, &props)
    }

    pub(crate) fn create_with(
        &mut self,
        size: u64,
        props: &AllocationProperties,
    ) -> Result<PhysicalHandle, BackendError> {
        let h = self.backend.create(size, props)?;
        self.handles.push(h);
        Ok(h)
    }

    pub(crate) fn track_handle(&mut self, h: PhysicalHandle) {
        self.handles.push(h);
    }

    pub(crate) fn map(
        &mut self,
        va: DeviceAddress,
        size: u64,
        h: PhysicalHandle,
    ) -> Result<(), BackendError> {
        self.backend.map(va, size, h)?;
        self.mappings.push((va, size));
        Ok(())
    }

    pub(crate) fn rw(&self, va: DeviceAddress, size: u64) -> Result<(), BackendError> {
        self.backend
            .set_access(va, size, &[AccessDescriptor::read_write(self.device)])
    }

    pub(crate) fn ro(&self, va: DeviceAddress, size: u64) -> Result<(), BackendError> {
        self.backend
            .set_access(va, size, &[AccessDescriptor::read_only(self.device)])
    }

    /// Creates one handle of `size`, maps it at `va` and gives this device read-write access.
    pub(crate) fn commit(
        &mut self,
        va: DeviceAddress,
        size: u64,
    ) -> Result<PhysicalHandle, BackendError> {
        let h = self.create(size)?;
        self.map(va, size, h)?;
        self.rw(va, size)?;
        Ok(h)
    }

    pub(crate) fn unmap(&mut self, va: DeviceAddress, size: u64) -> Result<(), BackendError> {
        self.backend.unmap(va, size)?;
        let end = va.0.saturating_add(size);
        self.mappings
            .retain(|(a, s)| !(a.0 >= va.0 && a.0.saturating_add(*s) <= end));
        Ok(())
    }

    pub(crate) fn release(&mut self, h: PhysicalHandle) -> Result<(), BackendError> {
        self.backend.release(h)?;
        self.handles.retain(|x| *x != h);
        Ok(())
    }

    pub(crate) fn free(&mut self, va: DeviceAddress, size: u64) -> Result<(), BackendError> {
        self.backend.free(va, size)?;
        self.reservations.retain(|(a, _)| *a != va);
        Ok(())
    }

    /// Gives everything back in reverse order; reports the first failure. The device (and
    /// every peer given access) is synchronized before anything is unmapped: a copy from
    /// pageable host memory may still be landing when the call that queued it returned (the
    /// driver has only staged the bytes), and unmapping under it faults the context for the
    /// cases that follow.
    pub(crate) fn finish(&mut self) -> Result<(), BackendError> {
        let mut first = None;
        if !self.mappings.is_empty() {
            for d in std::iter::once(self.device).chain(self.peers.iter().copied()) {
                if let Err(e) = self.backend.synchronize(d) {
                    first.get_or_insert(e);
                }
            }
        }
        for (va, size) in std::mem::take(&mut self.mappings).into_iter().rev() {
            if let Err(e) = self.backend.unmap(va, size) {
                first.get_or_insert(e);
            }
        }
        for h in std::mem::take(&mut self.handles).into_iter().rev() {
            if let Err(e) = self.backend.release(h) {
                first.get_or_insert(e);
            }
        }
        for (va, size) in std::mem::take(&mut self.reservations).into_iter().rev() {
            if let Err(e) = self.backend.free(va, size) {
                first.get_or_insert(e);
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        // Best effort: a case that returned early still gives its resources back.
        let _ = self.finish();
    }
}
