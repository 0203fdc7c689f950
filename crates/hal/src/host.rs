//! The neutral types of a host tier: page-locked host memory a backend allocated
//! ([`HostBuffer`]), a copy between it and device memory ([`HostCopy`]), an event that says
//! when queued work is done ([`EventHandle`]). The device number that budgets give the
//! host's memory, [`DeviceId::HOST`](crate::DeviceId::HOST), is defined with
//! [`DeviceId`](crate::DeviceId).

use crate::{BackendError, DeviceAddress, ErrorKind, Operation};

/// Page-locked ("pinned") host memory a backend allocated with
/// [`VirtualMemoryBackend::host_alloc`](crate::VirtualMemoryBackend::host_alloc): an opaque
/// handle (on CUDA the pointer `cuMemHostAlloc` returned; elsewhere a number of the backend's),
/// reached only through the backend's copies, which refuse any byte outside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostBuffer(pub u64);

impl std::fmt::Display for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "host buffer {:#x}", self.0)
    }
}

/// An event recorded on a stream ([`VirtualMemoryBackend::event_record`](crate::VirtualMemoryBackend::event_record)):
/// it completes once the work queued on that stream before it is done. An opaque handle (a
/// `CUevent` on CUDA), destroyed by its owner with
/// [`event_destroy`](crate::VirtualMemoryBackend::event_destroy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventHandle(pub u64);

/// A copy of `bytes` bytes between device memory at `device` and the page-locked host buffer
/// `host` at byte `offset`: device to host for
/// [`copy_to_host_async`](crate::VirtualMemoryBackend::copy_to_host_async), host to device for
/// [`copy_from_host_async`](crate::VirtualMemoryBackend::copy_from_host_async).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostCopy {
    /// The device side's first byte.
    pub device: DeviceAddress,
    /// The host buffer.
    pub host: HostBuffer,
    /// The host side's first byte, from the buffer's start.
    pub offset: u64,
    /// Bytes copied.
    pub bytes: u64,
}

impl HostCopy {
    /// Refuses, with an `InvalidValue` error of `op`, a copy no backend can make: a device
    /// range or a host range that runs past the top of the address space. What every backend
    /// checks first (the host range against the buffer's size is the backend's own check).
    pub fn check(&self, op: Operation) -> Result<(), BackendError> {
        let fits = self.device.0.checked_add(self.bytes).is_some()
            && self.offset.checked_add(self.bytes).is_some();
        if fits {
            Ok(())
        } else {
            Err(BackendError::raised(
                op,
                ErrorKind::InvalidValue,
                format!("ill-formed host copy {self:?}"),
            ))
        }
    }

    /// The end of the host range (`offset + bytes`), once [`check`](Self::check) passed.
    pub fn host_end(&self) -> u64 {
        self.offset.saturating_add(self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeviceId;

    #[test]
    fn the_host_is_no_driver_ordinal() {
        assert!(DeviceId::HOST.is_host() && !DeviceId(0).is_host());
        assert!(DeviceId::HOST
            .ordinal(Operation::HostAlloc, "CUDA ordinal")
            .is_err());
    }

    #[test]
    fn copies_past_the_address_space_are_refused() {
        let ok = HostCopy {
            device: DeviceAddress(4096),
            host: HostBuffer(1),
            offset: 8,
            bytes: 64,
        };
        assert!(ok.check(Operation::CopyToHost).is_ok());
        assert_eq!(ok.host_end(), 72);
        let wraps = HostCopy {
            device: DeviceAddress(u64::MAX - 8),
            ..ok
        };
        let e = wraps.check(Operation::CopyToHost);
        assert_eq!(e.map_err(|e| e.kind), Err(ErrorKind::InvalidValue));
        let wraps = HostCopy {
            offset: u64::MAX,
            ..ok
        };
        assert!(wraps.check(Operation::CopyFromHost).is_err());
    }
}
