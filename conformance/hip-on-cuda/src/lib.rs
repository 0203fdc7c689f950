//! # libhip_on_cuda.so: the HIP runtime ABI, forwarded to the CUDA driver
//!
//! Test tooling, not part of the library. This cdylib exports (`#[no_mangle] extern "C"`) the
//! HIP entry points that `kvvm-hip` resolves, with the ROCm 6 ABI (the >= 5.4
//! `hipMemAllocationProp` layout), and reports `hipRuntimeGetVersion` as ROCm 6.2.41134. Each
//! call is forwarded to `libcuda.so.1`, loaded with libloading at first use:
//!
//! | HIP | CUDA driver |
//! |---|---|
//! | `hipInit` | `cuInit` |
//! | `hipGetDeviceCount` | `cuDeviceGetCount` (0 devices: `hipErrorNoDevice`) |
//! | `hipSetDevice` | `cuDevicePrimaryCtxRetain` + `cuCtxSetCurrent` on the calling thread |
//! | `hipDeviceSynchronize` | `cuCtxSynchronize` |
//! | `hipMemAddressReserve` / `Free` | `cuMemAddressReserve` / `cuMemAddressFree` |
//! | `hipMemCreate` | `cuMemCreate`, the HIP prop translated into `CUmemAllocationProp` |
//! | `hipMemRelease`, `hipMemMap`, `hipMemSetAccess`, `hipMemUnmap` | the `cuMem*` of the same name |
//! | `hipMemGetAllocationGranularity` | `cuMemGetAllocationGranularity` |
//! | `hipMemcpyHtoD` / `DtoH` | `cuMemcpyHtoD_v2` / `cuMemcpyDtoH_v2` |
//! | `hipMemGetInfo` | `cuMemGetInfo_v2` |
//! | `hipDeviceGetName`, `hipDeviceTotalMem` | `cuDeviceGetName`, `cuDeviceTotalMem_v2` |
//! | `hipMemExportToShareableHandle` / `Import...` | `cuMemExportToShareableHandle` / `Import...` |
//! | `hipDriverGetVersion` | `cuDriverGetVersion` |
//!
//! Every memory call first makes the calling thread's device's primary context current (HIP
//! has a current device per thread, device 0 by default; CUDA needs a current context).
//! CUDA result codes are translated into HIP codes ([`cuda::to_hip`]).
//!
//! When `libcuda.so.1` (or one of its symbols) is missing, `hipInit` returns
//! `hipErrorInsufficientDriver` and `hipGetDeviceCount` returns `hipErrorNoDevice` with a
//! count of 0, so `kvvm-hip` reports a clean `Unavailable`.
//!
//! No panic crosses the FFI boundary: the code has no panicking paths, and every entry point
//! that does work runs under `catch_unwind` anyway (a caught panic returns `hipErrorUnknown`).
//!
//! What this proves: the HIP backend's calls, struct layout and error handling against the
//! HIP ABI and real VMM semantics (NVIDIA's). It does not prove anything about AMD hardware
//! or ROCm's own behaviour (see README.md).

pub mod cuda;

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use kvvm_hip::driver::{HipMemAccessDesc, HipMemAllocationPropV54};
use kvvm_hip::error::HipErrorCode;
use kvvm_hip::error::{
    HIP_ERROR_INSUFFICIENT_DRIVER, HIP_ERROR_INVALID_VALUE, HIP_ERROR_NO_DEVICE, HIP_ERROR_UNKNOWN,
};

use crate::cuda::{
    cuda, to_hip, CuMemAccessDesc, CuMemAllocFlags, CuMemAllocationProp, CuMemLocation,
};

/// The runtime version the shim reports: ROCm 6.2.41134 in HIP's encoding.
pub const RUNTIME_VERSION: c_int = 60_241_134;

/// Runs `f`, turning a panic into `hipErrorUnknown` so that none crosses the FFI boundary.
fn guard(f: impl FnOnce() -> HipErrorCode) -> HipErrorCode {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(HIP_ERROR_UNKNOWN)
}

/// Runs `f` on the loaded and initialised driver (no context needed), else returns the code
/// of the failed load or `cuInit`.
fn with_driver(f: impl FnOnce(&'static cuda::Cuda) -> HipErrorCode) -> HipErrorCode {
    guard(|| match cuda() {
        Ok(c) if c.init_rc != 0 => c.init_rc,
        Ok(c) => f(c),
        Err(rc) => rc,
    })
}

/// Runs `f` with the driver loaded and the thread's context current.
fn with_context(f: impl FnOnce(&'static cuda::Cuda) -> HipErrorCode) -> HipErrorCode {
    guard(|| match cuda() {
        Ok(c) => match c.ensure_context() {
            0 => f(c),
            rc => rc,
        },
        Err(rc) => rc,
    })
}

fn dptr(p: *mut c_void) -> u64 {
    p.expose_provenance() as u64
}

fn to_ptr(v: u64) -> *mut c_void {
    std::ptr::with_exposed_provenance_mut(v as usize)
}

/// Translates a ROCm >= 5.4 `hipMemAllocationProp` into CUDA's `CUmemAllocationProp`.
///
/// # Safety
/// `prop` must be null or point to a readable `hipMemAllocationProp` (ROCm 6 layout).
unsafe fn translate_prop(prop: *const c_void) -> Option<CuMemAllocationProp> {
    if prop.is_null() {
        return None;
    }
    // SAFETY: non-null and, by the caller's contract, a readable HIP prop; read unaligned so
    // that a misaligned caller pointer is not undefined behaviour.
    let p = unsafe { std::ptr::read_unaligned(prop.cast::<HipMemAllocationPropV54>()) };
    Some(CuMemAllocationProp {
        type_: p.type_,
        requested_handle_types: p.requested_handle_type,
        location: CuMemLocation {
            type_: p.location.type_,
            id: p.location.id,
        },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: CuMemAllocFlags {
            compression_type: p.alloc_flags.compression_type,
            gpu_direct_rdma_capable: p.alloc_flags.gpu_direct_rdma_capable,
            usage: p.alloc_flags.usage,
            reserved: [0; 4],
        },
    })
}

/// `hipError_t hipInit(unsigned int flags)`: loads libcuda and returns what `cuInit(0)` did.
#[no_mangle]
pub extern "C" fn hipInit(_flags: c_uint) -> HipErrorCode {
    guard(|| match cuda() {
        Ok(c) => c.init_rc,
        Err(rc) => rc,
    })
}

/// `hipError_t hipGetDeviceCount(int* count)`.
///
/// # Safety
/// `count` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn hipGetDeviceCount(count: *mut c_int) -> HipErrorCode {
    guard(|| {
        if count.is_null() {
            return HIP_ERROR_INVALID_VALUE;
        }
        let (n, rc) = match cuda() {
            Err(_) => (0, HIP_ERROR_NO_DEVICE),
            Ok(c) if c.init_rc != 0 => (0, HIP_ERROR_NO_DEVICE),
            Ok(c) => match c.device_count() {
                Ok(0) => (0, HIP_ERROR_NO_DEVICE),
                Ok(n) => (n, 0),
                Err(rc) => (0, rc),
            },
        };
        // SAFETY: non-null and writable by the caller's contract.
        unsafe { count.write(n) };
        rc
    })
}

/// `hipError_t hipRuntimeGetVersion(int* runtimeVersion)`: always ROCm 6.2.41134.
///
/// # Safety
/// `version` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn hipRuntimeGetVersion(version: *mut c_int) -> HipErrorCode {
    guard(|| {
        if version.is_null() {
            return HIP_ERROR_INVALID_VALUE;
        }
        // SAFETY: non-null and writable by the caller's contract.
        unsafe { version.write(RUNTIME_VERSION) };
        0
    })
}

/// `hipError_t hipDriverGetVersion(int* driverVersion)`: the CUDA driver's version.
///
/// # Safety
/// `version` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn hipDriverGetVersion(version: *mut c_int) -> HipErrorCode {
    guard(|| {
        if version.is_null() {
            return HIP_ERROR_INVALID_VALUE;
        }
        match cuda() {
            // SAFETY: non-null and writable by the caller's contract.
            Ok(c) => to_hip(unsafe { (c.driver_get_version)(version) }),
            Err(rc) => rc,
        }
    })
}

/// `const char* hipGetErrorName(hipError_t)`: a static string for every code the shim returns.
#[no_mangle]
pub extern "C" fn hipGetErrorName(code: HipErrorCode) -> *const c_char {
    let name: &'static CStr = match code {
        0 => c"hipSuccess",
        1 => c"hipErrorInvalidValue",
        2 => c"hipErrorOutOfMemory",
        3 => c"hipErrorNotInitialized",
        4 => c"hipErrorDeinitialized",
        35 => c"hipErrorInsufficientDriver",
        100 => c"hipErrorNoDevice",
        101 => c"hipErrorInvalidDevice",
        201 => c"hipErrorInvalidContext",
        400 => c"hipErrorInvalidHandle",
        700 => c"hipErrorIllegalAddress",
        719 => c"hipErrorLaunchFailure",
        801 => c"hipErrorNotSupported",
        _ => c"hipErrorUnknown",
    };
    name.as_ptr()
}

/// `hipError_t hipSetDevice(int deviceId)`: the device's primary context becomes current.
#[no_mangle]
pub extern "C" fn hipSetDevice(device: c_int) -> HipErrorCode {
    with_driver(|c| c.set_device(device))
}

/// `hipError_t hipDeviceSynchronize(void)`.
#[no_mangle]
pub extern "C" fn hipDeviceSynchronize() -> HipErrorCode {
    // SAFETY: no arguments; a context is current.
    with_context(|c| to_hip(unsafe { (c.ctx_synchronize)() }))
}

/// `hipError_t hipMemAddressReserve(void** ptr, size_t size, size_t alignment, void* addr,
/// unsigned long long flags)`.
///
/// # Safety
/// `ptr` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn hipMemAddressReserve(
    ptr: *mut *mut c_void,
    size: usize,
    alignment: usize,
    addr: *mut c_void,
    flags: c_ulonglong,
) -> HipErrorCode {
    with_context(|c| {
        if ptr.is_null() {
            return HIP_ERROR_INVALID_VALUE;
        }
        let mut out: u64 = 0;
        // SAFETY: `out` is a valid out-parameter; the hint is an address value.
        let rc = to_hip(unsafe {
            (c.mem_address_reserve)(&mut out, size, alignment, dptr(addr), flags)
        });
        if rc == 0 {
            // SAFETY: non-null and writable by the caller's contract.
            unsafe { ptr.write(to_ptr(out)) };
        }
        rc
    })
}

/// `hipError_t hipMemAddressFree(void* devPtr, size_t size)`.
#[no_mangle]
pub extern "C" fn hipMemAddressFree(dev_ptr: *mut c_void, size: usize) -> HipErrorCode {
    // SAFETY: address values only; the driver validates them.
    with_context(|c| to_hip(unsafe { (c.mem_address_free)(dptr(dev_ptr), size) }))
}

/// `hipError_t hipMemCreate(hipMemGenericAllocationHandle_t* handle, size_t size,
/// const hipMemAllocationProp* prop, unsigned long long flags)`.
///
/// # Safety
/// `handle` must be null or writable; `prop` null or a readable ROCm 6 prop.
#[no_mangle]
pub unsafe extern "C" fn hipMemCreate(
    handle: *mut *mut c_void,
    size: usize,
    prop: *const c_void,
    flags: c_ulonglong,
) -> HipErrorCode {
    with_context(|c| {
        // SAFETY: by the caller's contract.
        let Some(cu) = (unsafe { translate_prop(prop) }) else {
            return HIP_ERROR_INVALID_VALUE;
        };
        if handle.is_null() {
            return HIP_ERROR_INVALID_VALUE;
        }
        let mut h: u64 = 0;
        // SAFETY: `h` is a valid out-parameter; `cu` lives for the call.
        let rc = to_hip(unsafe { (c.mem_create)(&mut h, size, &cu, flags) });
        if rc == 0 {
            // SAFETY: non-null and writable by the caller's contract.
            unsafe { handle.write(to_ptr(h)) };
        }
        rc
    })
}

/// `hipError_t hipMemRelease(hipMemGenericAllocationHandle_t handle)`.
#[no_mangle]
pub extern "C" fn hipMemRelease(handle: *mut c_void) -> HipErrorCode {
    // SAFETY: an opaque handle value; the driver validates it.
    with_context(|c| to_hip(unsafe { (c.mem_release)(dptr(handle)) }))
}

/// `hipError_t hipMemMap(void* ptr, size_t size, size_t offset,
/// hipMemGenericAllocationHandle_t handle, unsigned long long flags)`.
#[no_mangle]
pub extern "C" fn hipMemMap(
    ptr: *mut c_void,
    size: usize,
    offset: usize,
    handle: *mut c_void,
    flags: c_ulonglong,
) -> HipErrorCode {
    // SAFETY: address and handle values; the driver validates them.
    with_context(|c| to_hip(unsafe { (c.mem_map)(dptr(ptr), size, offset, dptr(handle), flags) }))
}

/// `hipError_t hipMemSetAccess(void* ptr, size_t size, const hipMemAccessDesc* desc,
/// size_t count)`.
///
/// # Safety
/// `desc` must point to `count` readable descriptors (or be null with `count` 0).
#[no_mangle]
pub unsafe extern "C" fn hipMemSetAccess(
    ptr: *mut c_void,
    size: usize,
    desc: *const HipMemAccessDesc,
    count: usize,
) -> HipErrorCode {
    with_context(|c| {
        let descs: &[HipMemAccessDesc] = if count == 0 {
            &[]
        } else if desc.is_null() {
            return HIP_ERROR_INVALID_VALUE;
        } else {
            // SAFETY: `count` readable descriptors by the caller's contract.
            unsafe { std::slice::from_raw_parts(desc, count) }
        };
        let cu: Vec<CuMemAccessDesc> = descs
            .iter()
            .map(|d| CuMemAccessDesc {
                location: CuMemLocation {
                    type_: d.location.type_,
                    id: d.location.id,
                },
                flags: d.flags,
            })
            .collect();
        // SAFETY: `cu` holds `cu.len()` descriptors for the call.
        to_hip(unsafe { (c.mem_set_access)(dptr(ptr), size, cu.as_ptr(), cu.len()) })
    })
}

/// `hipError_t hipMemUnmap(void* ptr, size_t size)`.
#[no_mangle]
pub extern "C" fn hipMemUnmap(ptr: *mut c_void, size: usize) -> HipErrorCode {
    // SAFETY: address values; the driver validates them.
    with_context(|c| to_hip(unsafe { (c.mem_unmap)(dptr(ptr), size) }))
}

/// `hipError_t hipMemGetAllocationGranularity(size_t* granularity,
/// const hipMemAllocationProp* prop, hipMemAllocationGranularity_flags option)`.
///
/// # Safety
/// `granularity` must be null or writable; `prop` null or a readable ROCm 6 prop.
#[no_mangle]
pub unsafe extern "C" fn hipMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const c_void,
    option: c_uint,
) -> HipErrorCode {
    with_context(|c| {
        // SAFETY: by the caller's contract.
        let Some(cu) = (unsafe { translate_prop(prop) }) else {
            return HIP_ERROR_INVALID_VALUE;
        };
        if granularity.is_null() {
            return HIP_ERROR_INVALID_VALUE;
        }
        // SAFETY: `granularity` is writable by the caller's contract; `cu` lives for the call.
        to_hip(unsafe { (c.mem_get_allocation_granularity)(granularity, &cu, option) })
    })
}

/// `hipError_t hipMemcpyHtoD(hipDeviceptr_t dst, void* src, size_t sizeBytes)`.
///
/// # Safety
/// `src` must be readable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn hipMemcpyHtoD(
    dst: *mut c_void,
    src: *mut c_void,
    size: usize,
) -> HipErrorCode {
    // SAFETY: `src` is readable for `size` bytes by the caller's contract.
    with_context(|c| to_hip(unsafe { (c.memcpy_htod)(dptr(dst), src.cast_const(), size) }))
}

/// `hipError_t hipMemcpyDtoH(void* dst, hipDeviceptr_t src, size_t sizeBytes)`.
///
/// # Safety
/// `dst` must be writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn hipMemcpyDtoH(
    dst: *mut c_void,
    src: *mut c_void,
    size: usize,
) -> HipErrorCode {
    // SAFETY: `dst` is writable for `size` bytes by the caller's contract.
    with_context(|c| to_hip(unsafe { (c.memcpy_dtoh)(dst, dptr(src), size) }))
}

/// `hipError_t hipMemGetInfo(size_t* free, size_t* total)`.
///
/// # Safety
/// `free` and `total` must be writable.
#[no_mangle]
pub unsafe extern "C" fn hipMemGetInfo(free: *mut usize, total: *mut usize) -> HipErrorCode {
    with_context(|c| {
        if free.is_null() || total.is_null() {
            return HIP_ERROR_INVALID_VALUE;
        }
        // SAFETY: both writable by the caller's contract.
        to_hip(unsafe { (c.mem_get_info)(free, total) })
    })
}

/// `hipError_t hipDeviceGetName(char* name, int len, hipDevice_t device)`.
///
/// # Safety
/// `name` must be writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn hipDeviceGetName(
    name: *mut c_char,
    len: c_int,
    device: c_int,
) -> HipErrorCode {
    with_driver(|c| {
        if name.is_null() || len <= 0 {
            return HIP_ERROR_INVALID_VALUE;
        }
        match c.device(device) {
            // SAFETY: `name` is writable for `len` bytes by the caller's contract.
            Ok(dev) => to_hip(unsafe { (c.device_get_name)(name, len, dev) }),
            Err(rc) => rc,
        }
    })
}

/// `hipError_t hipDeviceTotalMem(size_t* bytes, hipDevice_t device)`.
///
/// # Safety
/// `bytes` must be writable.
#[no_mangle]
pub unsafe extern "C" fn hipDeviceTotalMem(bytes: *mut usize, device: c_int) -> HipErrorCode {
    with_driver(|c| {
        if bytes.is_null() {
            return HIP_ERROR_INVALID_VALUE;
        }
        match c.device(device) {
            // SAFETY: `bytes` is writable by the caller's contract.
            Ok(dev) => to_hip(unsafe { (c.device_total_mem)(bytes, dev) }),
            Err(rc) => rc,
        }
    })
}

/// `hipError_t hipDeviceCanAccessPeer(int* canAccessPeer, int deviceId, int peerDeviceId)`:
/// whether `deviceId` can access the memory of `peerDeviceId` (`cuDeviceCanAccessPeer`, whose
/// arguments are in the same order).
///
/// # Safety
/// `can_access` must be writable.
#[no_mangle]
pub unsafe extern "C" fn hipDeviceCanAccessPeer(
    can_access: *mut c_int,
    device: c_int,
    peer: c_int,
) -> HipErrorCode {
    with_driver(|c| {
        if can_access.is_null() {
            return HIP_ERROR_INVALID_VALUE;
        }
        match (c.device(device), c.device(peer)) {
            // SAFETY: `can_access` is writable by the caller's contract.
            (Ok(d), Ok(p)) => to_hip(unsafe { (c.device_can_access_peer)(can_access, d, p) }),
            (Err(rc), _) | (_, Err(rc)) => rc,
        }
    })
}

/// `hipError_t hipMemExportToShareableHandle(void* shareableHandle,
/// hipMemGenericAllocationHandle_t handle, hipMemAllocationHandleType handleType,
/// unsigned long long flags)`.
///
/// # Safety
/// `shareable` must be writable for the handle type (an `int` for a POSIX fd).
#[no_mangle]
pub unsafe extern "C" fn hipMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: *mut c_void,
    handle_type: c_uint,
    flags: c_ulonglong,
) -> HipErrorCode {
    with_context(|c| {
        if shareable.is_null() {
            return HIP_ERROR_INVALID_VALUE;
        }
        // SAFETY: `shareable` is writable by the caller's contract.
        to_hip(unsafe { (c.mem_export)(shareable, dptr(handle), handle_type, flags) })
    })
}

/// `hipError_t hipMemImportFromShareableHandle(hipMemGenericAllocationHandle_t* handle,
/// void* osHandle, hipMemAllocationHandleType shHandleType)`. A POSIX fd travels by value in
/// `os_handle`, as on both HIP and CUDA.
///
/// # Safety
/// `handle` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn hipMemImportFromShareableHandle(
    handle: *mut *mut c_void,
    os_handle: *mut c_void,
    handle_type: c_uint,
) -> HipErrorCode {
    with_context(|c| {
        if handle.is_null() {
            return HIP_ERROR_INVALID_VALUE;
        }
        let mut h: u64 = 0;
        // SAFETY: `h` is a valid out-parameter; `os_handle` is passed through as a value.
        let rc = to_hip(unsafe { (c.mem_import)(&mut h, os_handle, handle_type) });
        if rc == 0 {
            // SAFETY: non-null and writable by the caller's contract.
            unsafe { handle.write(to_ptr(h)) };
        }
        rc
    })
}

/// Whether `libcuda.so.1` could be loaded by this process (for tests and tools).
pub fn cuda_available() -> bool {
    cuda().is_ok()
}

/// The code `hipInit` returns when the driver is missing (for documentation and tests).
pub const MISSING_DRIVER: HipErrorCode = HIP_ERROR_INSUFFICIENT_DRIVER;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn hip_and_cuda_props_share_the_layout_that_is_translated() {
        assert_eq!(
            size_of::<HipMemAllocationPropV54>(),
            size_of::<CuMemAllocationProp>()
        );
        assert_eq!(
            offset_of!(HipMemAllocationPropV54, location),
            offset_of!(CuMemAllocationProp, location)
        );
        assert_eq!(size_of::<HipMemAccessDesc>(), size_of::<CuMemAccessDesc>());
    }

    #[test]
    fn a_prop_translates_field_by_field() {
        let hip = HipMemAllocationPropV54::pinned_device(2, 1);
        // SAFETY: `hip` is a live ROCm 6 prop.
        let cu = unsafe { translate_prop((&hip as *const HipMemAllocationPropV54).cast()) };
        let cu = cu.expect("non-null");
        assert_eq!((cu.type_, cu.requested_handle_types), (1, 1));
        assert_eq!((cu.location.type_, cu.location.id), (1, 2));
        // SAFETY: null is allowed.
        assert!(unsafe { translate_prop(std::ptr::null()) }.is_none());
    }

    #[test]
    fn the_version_is_rocm_6() {
        let mut v = 0;
        // SAFETY: `v` is writable.
        assert_eq!(unsafe { hipRuntimeGetVersion(&mut v) }, 0);
        assert_eq!(v / 10_000_000, 6);
        // SAFETY: null is rejected, not written.
        assert_eq!(unsafe { hipRuntimeGetVersion(std::ptr::null_mut()) }, 1);
    }

    #[test]
    fn error_names_are_static_c_strings() {
        // SAFETY: hipGetErrorName returns a static NUL-terminated string.
        let name = unsafe { CStr::from_ptr(hipGetErrorName(100)) };
        assert_eq!(name.to_str(), Ok("hipErrorNoDevice"));
        // SAFETY: as above.
        let unknown = unsafe { CStr::from_ptr(hipGetErrorName(4242)) };
        assert_eq!(unknown.to_str(), Ok("hipErrorUnknown"));
    }
}
