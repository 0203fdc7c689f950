//! The host backend on operating systems other than Linux: it cannot be opened.
//!
//! [`HostBackend`] exists so that code naming it builds everywhere; [`HostBackend::open`]
//! returns `Unavailable`, so no value of it can exist and its methods are unreachable.

use std::convert::Infallible;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use kvvm_hal::{
    AccessDescriptor, AllocationProperties, BackendError, BackendResult, Capabilities,
    DeviceAddress, DeviceId, DeviceInfo, Granularity, MemoryInfo, Operation, PhysicalHandle,
    VirtualMemoryBackend,
};

use crate::{HostConfig, HostLedger};

const REASON: &str =
    "the host backend needs Linux (memfd_create, MAP_FIXED_NOREPLACE, F_ADD_SEALS)";

/// The host backend (unavailable on this operating system).
#[derive(Debug)]
pub struct HostBackend {
    never: Infallible,
}

impl HostBackend {
    /// Always `Unavailable` here.
    pub fn open() -> Result<HostBackend, BackendError> {
        Err(BackendError::unavailable(Operation::Load, REASON))
    }

    /// Always `Unavailable` here.
    pub fn with_config(_config: HostConfig) -> Result<HostBackend, BackendError> {
        Self::open()
    }

    /// Unreachable: no value exists.
    pub fn ledger(&self) -> HostLedger {
        match self.never {}
    }

    /// Unreachable: no value exists.
    pub fn touch_pages(&self, _address: DeviceAddress, _len: u64) -> BackendResult<()> {
        match self.never {}
    }
}

/// Always `Unavailable` here.
pub fn mmap_first_touch(_len: u64) -> BackendResult<Duration> {
    Err(BackendError::unavailable(Operation::Load, REASON))
}

impl VirtualMemoryBackend for HostBackend {
    fn name(&self) -> &str {
        match self.never {}
    }
    fn capabilities(&self) -> Capabilities {
        match self.never {}
    }
    fn devices(&self) -> BackendResult<Vec<DeviceInfo>> {
        match self.never {}
    }
    fn memory_info(&self, _device: DeviceId) -> BackendResult<MemoryInfo> {
        match self.never {}
    }
    fn granularity(&self, _properties: &AllocationProperties) -> BackendResult<Granularity> {
        match self.never {}
    }
    fn reserve(
        &self,
        _size: u64,
        _alignment: u64,
        _fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress> {
        match self.never {}
    }
    fn free(&self, _address: DeviceAddress, _size: u64) -> BackendResult<()> {
        match self.never {}
    }
    fn create(
        &self,
        _size: u64,
        _properties: &AllocationProperties,
    ) -> BackendResult<PhysicalHandle> {
        match self.never {}
    }
    fn release(&self, _handle: PhysicalHandle) -> BackendResult<()> {
        match self.never {}
    }
    fn map(
        &self,
        _address: DeviceAddress,
        _size: u64,
        _handle: PhysicalHandle,
    ) -> BackendResult<()> {
        match self.never {}
    }
    fn set_access(
        &self,
        _address: DeviceAddress,
        _size: u64,
        _access: &[AccessDescriptor],
    ) -> BackendResult<()> {
        match self.never {}
    }
    fn unmap(&self, _address: DeviceAddress, _size: u64) -> BackendResult<()> {
        match self.never {}
    }
    fn synchronize(&self, _device: DeviceId) -> BackendResult<()> {
        match self.never {}
    }
    fn copy_to_device(&self, _dst: DeviceAddress, _src: &[u8]) -> BackendResult<()> {
        match self.never {}
    }
    fn copy_from_device(&self, _dst: &mut [u8], _src: DeviceAddress) -> BackendResult<()> {
        match self.never {}
    }
    fn export_posix_fd(&self, _handle: PhysicalHandle) -> BackendResult<OwnedFd> {
        match self.never {}
    }
    fn import_posix_fd(
        &self,
        _device: DeviceId,
        _fd: BorrowedFd<'_>,
    ) -> BackendResult<PhysicalHandle> {
        match self.never {}
    }
}
