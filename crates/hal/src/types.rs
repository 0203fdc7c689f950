//! Neutral types shared by every backend.

use std::fmt;

use crate::{BackendError, ErrorKind, Operation};

/// A device virtual address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DeviceAddress(pub u64);

impl DeviceAddress {
    /// The raw address.
    pub fn get(self) -> u64 {
        self.0
    }

    /// The address `bytes` further on, or `None` on overflow.
    pub fn checked_add(self, bytes: u64) -> Option<DeviceAddress> {
        self.0.checked_add(bytes).map(DeviceAddress)
    }

    /// The address `bytes` further on, saturating at the top of the address space: for an
    /// offset already known to lie inside a range whose end was checked (a wrap is impossible
    /// there, and a driver refuses a saturated address anyway).
    pub fn offset(self, bytes: u64) -> DeviceAddress {
        DeviceAddress(self.0.saturating_add(bytes))
    }
}

impl fmt::Display for DeviceAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// An opaque physical-allocation handle (a `CUmemGenericAllocationHandle`, a
/// `hipMemGenericAllocationHandle_t` pointer, or a simulator id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PhysicalHandle(pub u64);

impl fmt::Display for PhysicalHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "handle {:#x}", self.0)
    }
}

/// A device ordinal, as the driver numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DeviceId(pub u32);

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {}", self.0)
    }
}

impl DeviceId {
    /// The host's page-locked memory, as a budget names it: the governor and the node's
    /// broker keep its books like any device's (a budget, floors and ceilings), so that KV
    /// moved to the host is billed there. Never a backend's device ordinal (`u32::MAX` fits
    /// no driver's `int` ordinal, so a driver call given it is refused).
    pub const HOST: DeviceId = DeviceId(u32::MAX);

    /// Whether this is [`DeviceId::HOST`].
    pub fn is_host(self) -> bool {
        self == DeviceId::HOST
    }

    /// The `int` ordinal a driver call of `op` takes, or the `InvalidValue` a backend raises
    /// itself when it does not fit; `ordinal` names the vendor's ordinal in the message
    /// (`"CUDA ordinal"`).
    pub fn ordinal(self, op: Operation, ordinal: &str) -> Result<std::ffi::c_int, BackendError> {
        std::ffi::c_int::try_from(self.0).map_err(|_| {
            BackendError::raised(
                op,
                ErrorKind::InvalidValue,
                format!("{self} does not fit a {ordinal}"),
            )
        })
    }
}

/// Access of one device to a mapped range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// No access.
    None,
    /// Loads only; stores and host writes fail.
    Read,
    /// Loads and stores.
    ReadWrite,
}

impl Access {
    /// Whether reads are allowed.
    pub fn can_read(self) -> bool {
        !matches!(self, Access::None)
    }

    /// Whether writes are allowed.
    pub fn can_write(self) -> bool {
        matches!(self, Access::ReadWrite)
    }
}

/// One entry of a [`VirtualMemoryBackend::set_access`](crate::VirtualMemoryBackend::set_access)
/// list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AccessDescriptor {
    /// The device whose access is set.
    pub device: DeviceId,
    /// The access it gets.
    pub access: Access,
}

impl AccessDescriptor {
    /// Read-write access for `device`.
    pub fn read_write(device: DeviceId) -> Self {
        AccessDescriptor {
            device,
            access: Access::ReadWrite,
        }
    }

    /// Read-only access for `device`.
    pub fn read_only(device: DeviceId) -> Self {
        AccessDescriptor {
            device,
            access: Access::Read,
        }
    }
}

/// Which shareable (inter-process) handle type a physical allocation may be exported as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ShareableHandleType {
    /// Not exportable.
    #[default]
    None,
    /// Exportable as a POSIX file descriptor.
    PosixFd,
}

/// Properties of a physical allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AllocationProperties {
    /// The device whose memory backs the allocation.
    pub device: DeviceId,
    /// The shareable handle type requested at creation.
    pub handle_type: ShareableHandleType,
}

impl AllocationProperties {
    /// Pinned device memory on `device`, not exportable.
    pub fn device(device: DeviceId) -> Self {
        AllocationProperties {
            device,
            handle_type: ShareableHandleType::None,
        }
    }
}

/// Allocation granularity, as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Granularity {
    /// Every size and address must be a multiple of this.
    pub minimum: u64,
    /// The granularity the driver recommends for performance.
    pub recommended: u64,
}

/// One device as a backend sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device ordinal.
    pub id: DeviceId,
    /// The device's name (`"NVIDIA H200"`).
    pub name: String,
    /// Total physical memory in bytes.
    pub total_memory: u64,
    /// Whether the driver supports the virtual-memory management API on this device.
    pub vmm_supported: bool,
    /// Whether allocations can be exported as POSIX file descriptors.
    pub posix_fd_supported: bool,
    /// The driver or runtime version, as the vendor reports it (for example `"CUDA 13.0"`).
    pub driver_version: String,
}

/// Free and total physical memory of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryInfo {
    /// Free bytes.
    pub free: u64,
    /// Total bytes.
    pub total: u64,
}

/// What a backend and its driver can do. The layers above adapt to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// One `unmap` may cover several adjacent mappings. False on HIP (ROCR-Runtime #285: a
    /// multi-mapping unmap later makes the address free fail), so the manager unmaps one
    /// mapping at a time there.
    pub unmap_spans_mappings: bool,
    /// Handles can be exported and imported as POSIX file descriptors.
    pub posix_fd_handles: bool,
    /// The backend can launch probe kernels ([`VirtualMemoryBackend::kernel_probe`](crate::VirtualMemoryBackend::kernel_probe)).
    pub kernels: bool,
    /// `set_access` on a newly mapped range may fail transiently and succeed when retried
    /// (seen on gfx942 with ROCm 7.2); the manager retries it this many extra times.
    pub set_access_retries: u32,
    /// The driver checks that a map stays inside its reservation. False on CUDA and HIP: the
    /// manager must check (it always does).
    pub checks_reservation_bounds: bool,
    /// The backend allocates page-locked host memory and copies between it and device memory
    /// on a stream, with events ([`VirtualMemoryBackend::host_alloc`](crate::VirtualMemoryBackend::host_alloc)
    /// and the calls after it): what a host tier needs. False: those calls say `NotSupported`.
    pub host_copies: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            unmap_spans_mappings: true,
            posix_fd_handles: false,
            kernels: false,
            set_access_retries: 0,
            checks_reservation_bounds: false,
            host_copies: false,
        }
    }
}

/// What a probe kernel does (see [`KernelProbe`](crate::KernelProbe)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelProbeOp {
    /// `ld.global` every byte and sum them.
    Load,
    /// `st.global` a value into every byte.
    Store,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinals_that_do_not_fit_are_invalid() {
        let e = DeviceId(u32::MAX).ordinal(Operation::Map, "CUDA ordinal");
        assert_eq!(e.as_ref().map_err(|e| e.kind), Err(ErrorKind::InvalidValue));
        assert!(e.is_err_and(|e| e.to_string().contains("does not fit a CUDA ordinal")));
        assert_eq!(
            DeviceId(2).ordinal(Operation::Map, "CUDA ordinal").ok(),
            Some(2)
        );
        assert_eq!(
            BackendError::usize_arg(Operation::Map, "size", 4096).ok(),
            Some(4096)
        );
    }

    #[test]
    fn access_predicates() {
        assert!(!Access::None.can_read());
        assert!(Access::Read.can_read() && !Access::Read.can_write());
        assert!(Access::ReadWrite.can_read() && Access::ReadWrite.can_write());
    }

    #[test]
    fn address_arithmetic_is_checked() {
        assert_eq!(DeviceAddress(10).checked_add(5), Some(DeviceAddress(15)));
        assert_eq!(DeviceAddress(u64::MAX).checked_add(1), None);
        assert_eq!(DeviceAddress(0x200000).to_string(), "0x200000");
    }
}

/// A queue of device work, as the driver names it (a CUDA `CUstream`, a HIP `hipStream_t`),
/// passed through opaquely: `StreamHandle(0)` is the default stream. kvvm never creates or
/// destroys streams; a caller (PyTorch, for instance) owns them, and a handle given to a
/// backend must be 0 or a live stream of the device's primary context (the driver cannot tell
/// a destroyed stream from a live one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct StreamHandle(pub u64);

/// A strided copy of `rows` rows of `width` bytes: row `i` goes from `src + i * src_pitch` to
/// `dst + i * dst_pitch`. What one decode step writes into a batch of KV caches: one row per
/// sequence, the rows a constant slot stride apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowCopy {
    /// Where row 0 goes.
    pub dst: DeviceAddress,
    /// Bytes between consecutive destination rows (at least `width`).
    pub dst_pitch: u64,
    /// Where row 0 comes from.
    pub src: DeviceAddress,
    /// Bytes between consecutive source rows (at least `width`).
    pub src_pitch: u64,
    /// Bytes per row.
    pub width: u64,
    /// Number of rows.
    pub rows: u64,
}

impl RowCopy {
    /// Refuses, with an `InvalidValue` error of [`Operation::CopyRows`], a copy no backend can
    /// make: rows that overlap their own pitch, or a last row past the top of the address
    /// space. What every backend checks first.
    pub fn check(&self) -> Result<(), BackendError> {
        if fits(self.dst.0, self.dst_pitch, self.width, self.rows)
            && fits(self.src.0, self.src_pitch, self.width, self.rows)
        {
            Ok(())
        } else {
            Err(BackendError::raised(
                Operation::CopyRows,
                ErrorKind::InvalidValue,
                format!("ill-formed row copy {self:?}"),
            ))
        }
    }
}

/// Whether `rows` rows of `width` bytes, `pitch` apart from `base`, neither overlap nor
/// wrap around the address space.
fn fits(base: u64, pitch: u64, width: u64, rows: u64) -> bool {
    if rows > 1 && pitch < width {
        return false;
    }
    if rows == 0 || width == 0 {
        return true;
    }
    pitch
        .checked_mul(rows - 1)
        .and_then(|last| base.checked_add(last))
        .and_then(|row| row.checked_add(width))
        .is_some()
}
