//! [`Forward`]: the one forwarding base of every backend that wraps another.
//!
//! A decorator implements [`Forward`]: it names the backend underneath ([`Forward::inner`])
//! and writes only the methods it changes; every other call goes to the backend underneath,
//! after the [`Forward::before`] hook (a fault injector fails calls there and writes nothing
//! else). The blanket implementation makes every `Forward` a [`VirtualMemoryBackend`], as
//! wgpu-hal's dynamic dispatch is written once over its traits.
//!
//! Import `Forward` where a decorator implements it, not where one is used: with both traits
//! in scope, a call such as `decorator.map(..)` names two methods.

use std::os::fd::{BorrowedFd, OwnedFd};

use crate::{
    AccessDescriptor, AllocationProperties, BackendResult, Capabilities, DeviceAddress, DeviceId,
    DeviceInfo, EventHandle, Granularity, HostBuffer, HostCopy, KernelProbe, MemoryInfo, Operation,
    PhysicalHandle, RowCopy, StreamHandle, VirtualMemoryBackend,
};

/// A backend that wraps another: each method defaults to [`before`](Forward::before) with its
/// operation, then the same call on [`inner`](Forward::inner). A method written by the
/// decorator replaces the default, hook included. `name`, `capabilities` and `kernel_probe`
/// are not driver calls and run no hook.
pub trait Forward: Send + Sync {
    /// The backend underneath.
    fn inner(&self) -> &dyn VirtualMemoryBackend;

    /// Runs before each forwarded driver call of `op`; an error fails the call without
    /// reaching the backend underneath. The default does nothing.
    fn before(&self, op: Operation) -> BackendResult<()> {
        let _ = op;
        Ok(())
    }

    /// [`VirtualMemoryBackend::name`].
    fn name(&self) -> &str {
        self.inner().name()
    }

    /// [`VirtualMemoryBackend::capabilities`].
    fn capabilities(&self) -> Capabilities {
        self.inner().capabilities()
    }

    /// [`VirtualMemoryBackend::devices`].
    fn devices(&self) -> BackendResult<Vec<DeviceInfo>> {
        self.before(Operation::Devices)?;
        self.inner().devices()
    }

    /// [`VirtualMemoryBackend::memory_info`].
    fn memory_info(&self, device: DeviceId) -> BackendResult<MemoryInfo> {
        self.before(Operation::MemoryInfo)?;
        self.inner().memory_info(device)
    }

    /// [`VirtualMemoryBackend::granularity`].
    fn granularity(&self, properties: &AllocationProperties) -> BackendResult<Granularity> {
        self.before(Operation::Granularity)?;
        self.inner().granularity(properties)
    }

    /// [`VirtualMemoryBackend::reserve`].
    fn reserve(
        &self,
        size: u64,
        alignment: u64,
        fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress> {
        self.before(Operation::Reserve)?;
        self.inner().reserve(size, alignment, fixed_address)
    }

    /// [`VirtualMemoryBackend::free`].
    fn free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        self.before(Operation::Free)?;
        self.inner().free(address, size)
    }

    /// [`VirtualMemoryBackend::create`].
    fn create(
        &self,
        size: u64,
        properties: &AllocationProperties,
    ) -> BackendResult<PhysicalHandle> {
        self.before(Operation::Create)?;
        self.inner().create(size, properties)
    }

    /// [`VirtualMemoryBackend::release`].
    fn release(&self, handle: PhysicalHandle) -> BackendResult<()> {
        self.before(Operation::Release)?;
        self.inner().release(handle)
    }

    /// [`VirtualMemoryBackend::map`].
    fn map(&self, address: DeviceAddress, size: u64, handle: PhysicalHandle) -> BackendResult<()> {
        self.before(Operation::Map)?;
        self.inner().map(address, size, handle)
    }

    /// [`VirtualMemoryBackend::set_access`].
    fn set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> BackendResult<()> {
        self.before(Operation::SetAccess)?;
        self.inner().set_access(address, size, access)
    }

    /// [`VirtualMemoryBackend::unmap`].
    fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        self.before(Operation::Unmap)?;
        self.inner().unmap(address, size)
    }

    /// [`VirtualMemoryBackend::synchronize`].
    fn synchronize(&self, device: DeviceId) -> BackendResult<()> {
        self.before(Operation::Synchronize)?;
        self.inner().synchronize(device)
    }

    /// [`VirtualMemoryBackend::copy_to_device`].
    fn copy_to_device(&self, dst: DeviceAddress, src: &[u8]) -> BackendResult<()> {
        self.before(Operation::CopyToDevice)?;
        self.inner().copy_to_device(dst, src)
    }

    /// [`VirtualMemoryBackend::copy_from_device`].
    fn copy_from_device(&self, dst: &mut [u8], src: DeviceAddress) -> BackendResult<()> {
        self.before(Operation::CopyFromDevice)?;
        self.inner().copy_from_device(dst, src)
    }

    /// [`VirtualMemoryBackend::copy_rows_async`].
    fn copy_rows_async(&self, copy: &RowCopy, stream: StreamHandle) -> BackendResult<()> {
        self.before(Operation::CopyRows)?;
        self.inner().copy_rows_async(copy, stream)
    }

    /// [`VirtualMemoryBackend::host_alloc`].
    fn host_alloc(&self, device: DeviceId, bytes: u64) -> BackendResult<HostBuffer> {
        self.before(Operation::HostAlloc)?;
        self.inner().host_alloc(device, bytes)
    }

    /// [`VirtualMemoryBackend::host_free`].
    fn host_free(&self, buffer: HostBuffer) -> BackendResult<()> {
        self.before(Operation::HostFree)?;
        self.inner().host_free(buffer)
    }

    /// [`VirtualMemoryBackend::copy_to_host_async`].
    fn copy_to_host_async(&self, copy: &HostCopy, stream: StreamHandle) -> BackendResult<()> {
        self.before(Operation::CopyToHost)?;
        self.inner().copy_to_host_async(copy, stream)
    }

    /// [`VirtualMemoryBackend::copy_from_host_async`].
    fn copy_from_host_async(&self, copy: &HostCopy, stream: StreamHandle) -> BackendResult<()> {
        self.before(Operation::CopyFromHost)?;
        self.inner().copy_from_host_async(copy, stream)
    }

    /// [`VirtualMemoryBackend::copy_stream`].
    fn copy_stream(&self, device: DeviceId) -> BackendResult<StreamHandle> {
        self.before(Operation::Stream)?;
        self.inner().copy_stream(device)
    }

    /// [`VirtualMemoryBackend::event_record`].
    fn event_record(&self, device: DeviceId, stream: StreamHandle) -> BackendResult<EventHandle> {
        self.before(Operation::Event)?;
        self.inner().event_record(device, stream)
    }

    /// [`VirtualMemoryBackend::event_query`].
    fn event_query(&self, event: EventHandle) -> BackendResult<bool> {
        self.before(Operation::Event)?;
        self.inner().event_query(event)
    }

    /// [`VirtualMemoryBackend::event_wait`].
    fn event_wait(&self, event: EventHandle) -> BackendResult<()> {
        self.before(Operation::Event)?;
        self.inner().event_wait(event)
    }

    /// [`VirtualMemoryBackend::stream_wait_event`].
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> BackendResult<()> {
        self.before(Operation::Event)?;
        self.inner().stream_wait_event(stream, event)
    }

    /// [`VirtualMemoryBackend::event_destroy`] (not a counted step: destroying an event is what
    /// cleaning up after any failure does, and a driver destroys a valid event).
    fn event_destroy(&self, event: EventHandle) -> BackendResult<()> {
        self.inner().event_destroy(event)
    }

    /// [`VirtualMemoryBackend::export_posix_fd`].
    fn export_posix_fd(&self, handle: PhysicalHandle) -> BackendResult<OwnedFd> {
        self.before(Operation::Export)?;
        self.inner().export_posix_fd(handle)
    }

    /// [`VirtualMemoryBackend::import_posix_fd`].
    fn import_posix_fd(
        &self,
        device: DeviceId,
        fd: BorrowedFd<'_>,
    ) -> BackendResult<PhysicalHandle> {
        self.before(Operation::Import)?;
        self.inner().import_posix_fd(device, fd)
    }

    /// [`VirtualMemoryBackend::can_access_peer`] (a device query: its hook is `Devices`).
    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> BackendResult<bool> {
        self.before(Operation::Devices)?;
        self.inner().can_access_peer(device, peer)
    }

    /// [`VirtualMemoryBackend::kernel_probe`].
    fn kernel_probe(&self) -> Option<&dyn KernelProbe> {
        self.inner().kernel_probe()
    }
}

/// Every [`Forward`] is a backend: each trait method is the decorator's (a dispatch table, in
/// the trait's order).
impl<T: Forward> VirtualMemoryBackend for T {
    fn name(&self) -> &str {
        Forward::name(self)
    }
    fn capabilities(&self) -> Capabilities {
        Forward::capabilities(self)
    }
    fn devices(&self) -> BackendResult<Vec<DeviceInfo>> {
        Forward::devices(self)
    }
    fn memory_info(&self, d: DeviceId) -> BackendResult<MemoryInfo> {
        Forward::memory_info(self, d)
    }
    fn granularity(&self, p: &AllocationProperties) -> BackendResult<Granularity> {
        Forward::granularity(self, p)
    }
    fn reserve(&self, s: u64, a: u64, f: Option<DeviceAddress>) -> BackendResult<DeviceAddress> {
        Forward::reserve(self, s, a, f)
    }
    fn free(&self, a: DeviceAddress, s: u64) -> BackendResult<()> {
        Forward::free(self, a, s)
    }
    fn create(&self, s: u64, p: &AllocationProperties) -> BackendResult<PhysicalHandle> {
        Forward::create(self, s, p)
    }
    fn release(&self, h: PhysicalHandle) -> BackendResult<()> {
        Forward::release(self, h)
    }
    fn map(&self, a: DeviceAddress, s: u64, h: PhysicalHandle) -> BackendResult<()> {
        Forward::map(self, a, s, h)
    }
    fn set_access(&self, a: DeviceAddress, s: u64, d: &[AccessDescriptor]) -> BackendResult<()> {
        Forward::set_access(self, a, s, d)
    }
    fn unmap(&self, a: DeviceAddress, s: u64) -> BackendResult<()> {
        Forward::unmap(self, a, s)
    }
    fn synchronize(&self, d: DeviceId) -> BackendResult<()> {
        Forward::synchronize(self, d)
    }
    fn copy_to_device(&self, dst: DeviceAddress, src: &[u8]) -> BackendResult<()> {
        Forward::copy_to_device(self, dst, src)
    }
    fn copy_from_device(&self, dst: &mut [u8], src: DeviceAddress) -> BackendResult<()> {
        Forward::copy_from_device(self, dst, src)
    }
    fn copy_rows_async(&self, c: &RowCopy, s: StreamHandle) -> BackendResult<()> {
        Forward::copy_rows_async(self, c, s)
    }
    fn host_alloc(&self, d: DeviceId, bytes: u64) -> BackendResult<HostBuffer> {
        Forward::host_alloc(self, d, bytes)
    }
    fn host_free(&self, b: HostBuffer) -> BackendResult<()> {
        Forward::host_free(self, b)
    }
    fn copy_to_host_async(&self, c: &HostCopy, s: StreamHandle) -> BackendResult<()> {
        Forward::copy_to_host_async(self, c, s)
    }
    fn copy_from_host_async(&self, c: &HostCopy, s: StreamHandle) -> BackendResult<()> {
        Forward::copy_from_host_async(self, c, s)
    }
    fn copy_stream(&self, d: DeviceId) -> BackendResult<StreamHandle> {
        Forward::copy_stream(self, d)
    }
    fn event_record(&self, d: DeviceId, s: StreamHandle) -> BackendResult<EventHandle> {
        Forward::event_record(self, d, s)
    }
    fn event_query(&self, e: EventHandle) -> BackendResult<bool> {
        Forward::event_query(self, e)
    }
    fn event_wait(&self, e: EventHandle) -> BackendResult<()> {
        Forward::event_wait(self, e)
    }
    fn stream_wait_event(&self, s: StreamHandle, e: EventHandle) -> BackendResult<()> {
        Forward::stream_wait_event(self, s, e)
    }
    fn event_destroy(&self, e: EventHandle) -> BackendResult<()> {
        Forward::event_destroy(self, e)
    }
    fn export_posix_fd(&self, h: PhysicalHandle) -> BackendResult<OwnedFd> {
        Forward::export_posix_fd(self, h)
    }
    fn import_posix_fd(&self, d: DeviceId, fd: BorrowedFd<'_>) -> BackendResult<PhysicalHandle> {
        Forward::import_posix_fd(self, d, fd)
    }
    fn can_access_peer(&self, d: DeviceId, peer: DeviceId) -> BackendResult<bool> {
        Forward::can_access_peer(self, d, peer)
    }
    fn kernel_probe(&self) -> Option<&dyn KernelProbe> {
        Forward::kernel_probe(self)
    }
}
