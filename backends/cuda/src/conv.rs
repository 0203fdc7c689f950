//! Conversions between the neutral types and the CUDA driver's: sizes to `usize`, device ids
//! to ordinals, allocation properties, access flags, the driver version. Every conversion is
//! checked: a value that does not fit is an error the backend raises, never a truncation.

use std::ffi::c_int;
use std::ptr;

use cudarc::driver::sys::{
    CUmemAccess_flags, CUmemAllocationHandleType, CUmemAllocationProp,
    CUmemAllocationProp_st__bindgen_ty_1, CUmemAllocationType, CUmemLocation, CUmemLocationType,
};
use kvvm_hal::{Access, BackendError, BackendResult, DeviceId, Operation, ShareableHandleType};

/// Formats `cuDriverGetVersion`'s value (`1000 * major + 10 * minor`) as
/// `"CUDA 13.0 (driver 13000)"`.
pub fn format_driver_version(version: i32) -> String {
    format!(
        "CUDA {}.{} (driver {version})",
        version / 1000,
        (version % 1000) / 10
    )
}

/// `value` as the `size_t` of a driver call ([`BackendError::usize_arg`]).
pub(crate) fn to_usize(op: Operation, what: &str, value: u64) -> BackendResult<usize> {
    BackendError::usize_arg(op, what, value)
}

/// A `size_t` the driver returned, as bytes ([`kvvm_num::to_u64`]).
pub(crate) fn to_u64(value: usize) -> u64 {
    kvvm_num::to_u64(value)
}

/// The CUDA ordinal of `device` ([`DeviceId::ordinal`]).
pub(crate) fn ordinal(op: Operation, device: DeviceId) -> BackendResult<c_int> {
    device.ordinal(op, "CUDA ordinal")
}

/// The `CUmemAllocationProp` of pinned device memory on `ordinal`.
pub(crate) fn allocation_prop(
    ordinal: c_int,
    handle_type: ShareableHandleType,
) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: match handle_type {
            ShareableHandleType::None => CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            ShareableHandleType::PosixFd => {
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            }
        },
        location: CUmemLocation {
            type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The `CUmemAccess_flags` of a neutral [`Access`].
pub(crate) fn access_flags(access: Access) -> CUmemAccess_flags {
    match access {
        Access::None => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
        Access::Read => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
        Access::ReadWrite => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUmemAccessDesc;
    use kvvm_hal::ErrorKind;

    #[test]
    fn driver_version_string() {
        assert_eq!(format_driver_version(13000), "CUDA 13.0 (driver 13000)");
        assert_eq!(format_driver_version(12080), "CUDA 12.8 (driver 12080)");
        assert_eq!(format_driver_version(11040), "CUDA 11.4 (driver 11040)");
    }

    #[test]
    fn access_flags_match_cuda() {
        assert_eq!(access_flags(Access::None) as u32, 0);
        assert_eq!(access_flags(Access::Read) as u32, 1);
        assert_eq!(access_flags(Access::ReadWrite) as u32, 3);
    }

    #[test]
    fn allocation_prop_is_pinned_device_memory() {
        let p = allocation_prop(3, ShareableHandleType::None);
        assert_eq!(p.type_ as u32, 1);
        assert_eq!(p.location.type_ as u32, 1);
        assert_eq!(p.location.id, 3);
        assert_eq!(p.requestedHandleTypes.0, 0);
        assert!(p.win32HandleMetaData.is_null());
        let p = allocation_prop(0, ShareableHandleType::PosixFd);
        assert_eq!(p.requestedHandleTypes.0, 1);
    }

    #[test]
    fn struct_layouts_match_cuda_h() {
        // cuda.h (12.x / 13.0): CUmemAllocationProp is 32 bytes, CUmemAccessDesc 12.
        assert_eq!(std::mem::size_of::<CUmemAllocationProp>(), 32);
        assert_eq!(std::mem::size_of::<CUmemAccessDesc>(), 12);
        assert_eq!(std::mem::size_of::<CUmemLocation>(), 8);
    }

    #[test]
    fn out_of_range_values_are_invalid() {
        let too_large = ordinal(Operation::Map, DeviceId(u32::MAX));
        assert!(too_large.is_err_and(|e| e.kind == ErrorKind::InvalidValue
            && e.to_string().contains("does not fit a CUDA ordinal")));
        assert_eq!(ordinal(Operation::Map, DeviceId(2)).ok(), Some(2));
        assert_eq!(to_usize(Operation::Map, "size", 4096).ok(), Some(4096));
    }
}
