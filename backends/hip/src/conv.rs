//! Conversions between the neutral types and HIP's: device ids to ordinals, sizes to `usize`
//! and back, addresses and handles to pointers, access flags, allocation properties. Every
//! conversion is checked: a value that does not fit is an error the backend raises (no vendor
//! code), never a truncation.

use std::ffi::{c_int, c_void};

use kvvm_hal::{
    Access, BackendError, BackendResult, DeviceAddress, DeviceId, Operation, PhysicalHandle,
    ShareableHandleType,
};

use crate::driver::{
    HipMemAllocationProp, HipMemAllocationPropV52, HipMemAllocationPropV54,
    HIP_MEM_ACCESS_FLAGS_PROT_NONE, HIP_MEM_ACCESS_FLAGS_PROT_READ,
    HIP_MEM_ACCESS_FLAGS_PROT_READ_WRITE, HIP_MEM_HANDLE_TYPE_NONE, HIP_MEM_HANDLE_TYPE_POSIX_FD,
};
use crate::version::PropLayout;

/// The HIP ordinal of `device` ([`DeviceId::ordinal`]).
pub(crate) fn ordinal(op: Operation, device: DeviceId) -> BackendResult<c_int> {
    device.ordinal(op, "HIP device ordinal")
}

/// `value` as the `size_t` of a driver call ([`BackendError::usize_arg`]).
pub(crate) fn to_usize(op: Operation, what: &str, value: u64) -> BackendResult<usize> {
    BackendError::usize_arg(op, what, value)
}

/// A `size_t` the driver returned, as bytes ([`kvvm_num::to_u64`]).
pub(crate) fn to_u64(value: usize) -> u64 {
    kvvm_num::to_u64(value)
}

/// A device address as the `void*` HIP takes.
pub(crate) fn to_ptr(address: DeviceAddress) -> *mut c_void {
    std::ptr::with_exposed_provenance_mut(address.0 as usize)
}

/// A `void*` HIP returned as a device address.
pub(crate) fn from_ptr(ptr: *mut c_void) -> DeviceAddress {
    DeviceAddress(ptr.expose_provenance() as u64)
}

/// A physical handle as the opaque pointer HIP takes.
pub(crate) fn handle_ptr(handle: PhysicalHandle) -> *mut c_void {
    std::ptr::with_exposed_provenance_mut(handle.0 as usize)
}

/// An opaque handle pointer HIP returned as a physical handle.
pub(crate) fn handle_of(ptr: *mut c_void) -> PhysicalHandle {
    PhysicalHandle(ptr.expose_provenance() as u64)
}

/// The `hipMemAccessFlags` of a neutral [`Access`].
pub(crate) fn access_flags(access: Access) -> u32 {
    match access {
        Access::None => HIP_MEM_ACCESS_FLAGS_PROT_NONE,
        Access::Read => HIP_MEM_ACCESS_FLAGS_PROT_READ,
        Access::ReadWrite => HIP_MEM_ACCESS_FLAGS_PROT_READ_WRITE,
    }
}

/// The `hipMemAllocationHandleType` of a neutral handle type.
pub(crate) fn handle_type(t: ShareableHandleType) -> u32 {
    match t {
        ShareableHandleType::None => HIP_MEM_HANDLE_TYPE_NONE,
        ShareableHandleType::PosixFd => HIP_MEM_HANDLE_TYPE_POSIX_FD,
    }
}

/// The `hipMemAllocationProp` of pinned memory on device `id`, in the runtime's `layout`.
pub(crate) fn allocation_prop(
    layout: PropLayout,
    id: c_int,
    handle: ShareableHandleType,
) -> HipMemAllocationProp {
    let handle = handle_type(handle);
    match layout {
        PropLayout::Rocm52 => {
            HipMemAllocationProp::V52(HipMemAllocationPropV52::pinned_device(id, handle))
        }
        PropLayout::Rocm54 => {
            HipMemAllocationProp::V54(HipMemAllocationPropV54::pinned_device(id, handle))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvvm_hal::ErrorKind;

    #[test]
    fn addresses_and_handles_round_trip_through_pointers() {
        let a = DeviceAddress(0x7f00_0020_0000);
        assert_eq!(from_ptr(to_ptr(a)), a);
        let h = PhysicalHandle(0x5555_0000_1234);
        assert_eq!(handle_ptr(h).expose_provenance() as u64, h.0);
    }

    #[test]
    fn out_of_range_values_are_invalid() {
        let too_large = ordinal(Operation::Map, DeviceId(u32::MAX));
        assert!(too_large.is_err_and(|e| e.kind == ErrorKind::InvalidValue
            && e.to_string().contains("does not fit a HIP device ordinal")));
        assert_eq!(ordinal(Operation::Map, DeviceId(2)).ok(), Some(2));
        assert_eq!(to_usize(Operation::Map, "size", 4096).ok(), Some(4096));
    }
}
