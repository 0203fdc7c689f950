//! The loaded symbol table and the raw HIP ABI it speaks: hand-written `#[repr(C)]` structs,
//! enum values and function-pointer types, plus [`HipApi`], every symbol resolved up front.
//! Calling them is the job of `driver/result.rs`, the thin wrappers of [`HipApi`].
//!
//! [`HipApi`] is a `Copy` table of function pointers. The invariants it keeps: a `HipApi`
//! exists only once every required symbol resolved from the loaded library
//! ([`HipApi::load`]; the optional ones are `Option`s, `None` when the runtime lacks them),
//! so calling an entry point never resolves anything; a return code is always the raw `i32`
//! ([`HipErrorCode`]), never a Rust enum. Its methods live in two files: this one (the table
//! and loading it) and `result.rs` (one checked wrapper per entry point; every call into the
//! runtime is there).
//!
//! Nothing here is generated from headers at build time. Each struct layout is written from a
//! named ROCm header and pinned by `offset_of!`/`size_of` assertions that fail the *build* if
//! the Rust definition drifts (see the `const _: () = ...` blocks and the tests).
//!
//! * Return codes are raw `i32` ([`HipErrorCode`]), never a Rust enum: a newer runtime may
//!   return a code this crate does not know, and an out-of-range enum value is undefined
//!   behaviour. `error.rs` classifies them.
//! * C enums are passed as `u32`/`i32` of the same size (every HIP enum used here fits in a
//!   C `int`).
//! * Handles (`hipMemGenericAllocationHandle_t`) and device addresses are pointers.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::mem::{offset_of, size_of};

use kvvm_hal::{BackendError, Operation};
use libloading::Library;

pub use crate::error::{HipErrorCode, HIP_SUCCESS};

pub(crate) mod result;

/// `hipMemAllocationTypePinned`.
pub const HIP_MEM_ALLOCATION_TYPE_PINNED: u32 = 1;
/// `hipMemLocationTypeDevice`.
pub const HIP_MEM_LOCATION_TYPE_DEVICE: u32 = 1;
/// `hipMemHandleTypeNone`.
pub const HIP_MEM_HANDLE_TYPE_NONE: u32 = 0;
/// `hipMemHandleTypePosixFileDescriptor`.
pub const HIP_MEM_HANDLE_TYPE_POSIX_FD: u32 = 1;
/// `hipMemAccessFlagsProtNone`.
pub const HIP_MEM_ACCESS_FLAGS_PROT_NONE: u32 = 0;
/// `hipMemAccessFlagsProtRead`.
pub const HIP_MEM_ACCESS_FLAGS_PROT_READ: u32 = 1;
/// `hipMemAccessFlagsProtReadWrite`.
pub const HIP_MEM_ACCESS_FLAGS_PROT_READ_WRITE: u32 = 3;
/// `hipMemAllocationGranularityMinimum`.
pub const HIP_MEM_ALLOCATION_GRANULARITY_MINIMUM: u32 = 0;
/// `hipMemAllocationGranularityRecommended`.
pub const HIP_MEM_ALLOCATION_GRANULARITY_RECOMMENDED: u32 = 1;

/// `hipMemLocation` (identical in every ROCm release that has the VMM API).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HipMemLocation {
    /// `hipMemLocationType type` ([`HIP_MEM_LOCATION_TYPE_DEVICE`]).
    pub type_: u32,
    /// `int id`: the device ordinal.
    pub id: i32,
}

/// `hipMemAccessDesc` (identical in every ROCm release that has the VMM API).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HipMemAccessDesc {
    /// The device whose access is set.
    pub location: HipMemLocation,
    /// `hipMemAccessFlags`: 0 none, 1 read, 3 read-write.
    pub flags: u32,
}

/// `hipMemAllocationProp` as declared by the ROCm **5.2** header (`hip_runtime_api.h` of
/// Debian's `libamdhip64-dev` 5.2.3, HIP_VERSION 50221153):
///
/// ```c
/// typedef struct hipMemAllocationProp {
///     unsigned char compressionType;                  // @0
///     hipMemLocation location;                        // @4
///     hipMemAllocationHandleType requestedHandleType; // @12
///     hipMemAllocationType type;                      // @16
///     unsigned short usage;                           // @20
///     void* win32HandleMetaData;                      // @24
/// } hipMemAllocationProp;                             // size 32
/// ```
///
/// The offsets were checked with `offsetof` against that header (see README.md).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HipMemAllocationPropV52 {
    /// `unsigned char compressionType`.
    pub compression_type: u8,
    /// `hipMemLocation location`.
    pub location: HipMemLocation,
    /// `hipMemAllocationHandleType requestedHandleType`.
    pub requested_handle_type: u32,
    /// `hipMemAllocationType type`.
    pub type_: u32,
    /// `unsigned short usage`.
    pub usage: u16,
    /// `void* win32HandleMetaData`.
    pub win32_handle_meta_data: *mut c_void,
}

/// The `allocFlags` member of the ROCm >= 5.4 [`HipMemAllocationPropV54`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HipMemAllocFlags {
    /// `unsigned char compressionType`.
    pub compression_type: u8,
    /// `unsigned char gpuDirectRDMACapable`.
    pub gpu_direct_rdma_capable: u8,
    /// `unsigned short usage`.
    pub usage: u16,
}

/// `hipMemAllocationProp` as declared by ROCm **>= 5.4** (5.x, 6.x, 7.x headers, and hip-sys
/// 0.1.2's bindings); it is CUDA's `CUmemAllocationProp` layout:
///
/// ```c
/// typedef struct hipMemAllocationProp {
///     hipMemAllocationType type;                       // @0
///     hipMemAllocationHandleType requestedHandleType;  // @4 (requestedHandleTypes in 7.x)
///     hipMemLocation location;                         // @8
///     void* win32HandleMetaData;                       // @16
///     struct {
///         unsigned char compressionType;               // @24
///         unsigned char gpuDirectRDMACapable;          // @25
///         unsigned short usage;                        // @26
///     } allocFlags;
/// } hipMemAllocationProp;                              // size 32
/// ```
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HipMemAllocationPropV54 {
    /// `hipMemAllocationType type`.
    pub type_: u32,
    /// `hipMemAllocationHandleType requestedHandleType`.
    pub requested_handle_type: u32,
    /// `hipMemLocation location`.
    pub location: HipMemLocation,
    /// `void* win32HandleMetaData`.
    pub win32_handle_meta_data: *mut c_void,
    /// `allocFlags`.
    pub alloc_flags: HipMemAllocFlags,
}

// Layout pins: a drift in either definition fails the build.
const _: () = {
    assert!(size_of::<HipMemLocation>() == 8);
    assert!(offset_of!(HipMemLocation, type_) == 0);
    assert!(offset_of!(HipMemLocation, id) == 4);
    assert!(size_of::<HipMemAccessDesc>() == 12);
    assert!(offset_of!(HipMemAccessDesc, location) == 0);
    assert!(offset_of!(HipMemAccessDesc, flags) == 8);

    assert!(size_of::<HipMemAllocationPropV52>() == 32);
    assert!(offset_of!(HipMemAllocationPropV52, compression_type) == 0);
    assert!(offset_of!(HipMemAllocationPropV52, location) == 4);
    assert!(offset_of!(HipMemAllocationPropV52, location.type_) == 4);
    assert!(offset_of!(HipMemAllocationPropV52, location.id) == 8);
    assert!(offset_of!(HipMemAllocationPropV52, requested_handle_type) == 12);
    assert!(offset_of!(HipMemAllocationPropV52, type_) == 16);
    assert!(offset_of!(HipMemAllocationPropV52, usage) == 20);
    assert!(offset_of!(HipMemAllocationPropV52, win32_handle_meta_data) == 24);

    assert!(size_of::<HipMemAllocationPropV54>() == 32);
    assert!(offset_of!(HipMemAllocationPropV54, type_) == 0);
    assert!(offset_of!(HipMemAllocationPropV54, requested_handle_type) == 4);
    assert!(offset_of!(HipMemAllocationPropV54, location) == 8);
    assert!(offset_of!(HipMemAllocationPropV54, location.type_) == 8);
    assert!(offset_of!(HipMemAllocationPropV54, location.id) == 12);
    assert!(offset_of!(HipMemAllocationPropV54, win32_handle_meta_data) == 16);
    assert!(offset_of!(HipMemAllocationPropV54, alloc_flags) == 24);
    assert!(offset_of!(HipMemAllocationPropV54, alloc_flags.compression_type) == 24);
    assert!(offset_of!(HipMemAllocationPropV54, alloc_flags.gpu_direct_rdma_capable) == 25);
    assert!(offset_of!(HipMemAllocationPropV54, alloc_flags.usage) == 26);
};

impl HipMemAllocationPropV52 {
    /// Pinned device memory on device `id` with the given requested handle type.
    pub fn pinned_device(id: i32, requested_handle_type: u32) -> Self {
        HipMemAllocationPropV52 {
            compression_type: 0,
            location: HipMemLocation {
                type_: HIP_MEM_LOCATION_TYPE_DEVICE,
                id,
            },
            requested_handle_type,
            type_: HIP_MEM_ALLOCATION_TYPE_PINNED,
            usage: 0,
            win32_handle_meta_data: std::ptr::null_mut(),
        }
    }
}

impl HipMemAllocationPropV54 {
    /// Pinned device memory on device `id` with the given requested handle type.
    pub fn pinned_device(id: i32, requested_handle_type: u32) -> Self {
        HipMemAllocationPropV54 {
            type_: HIP_MEM_ALLOCATION_TYPE_PINNED,
            requested_handle_type,
            location: HipMemLocation {
                type_: HIP_MEM_LOCATION_TYPE_DEVICE,
                id,
            },
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: HipMemAllocFlags::default(),
        }
    }
}

/// A `hipMemAllocationProp` in the layout of the loaded runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HipMemAllocationProp {
    /// The ROCm 5.2 layout.
    V52(HipMemAllocationPropV52),
    /// The ROCm >= 5.4 layout.
    V54(HipMemAllocationPropV54),
}

impl HipMemAllocationProp {
    /// A pointer to pass as `const hipMemAllocationProp*`; valid while `self` lives.
    pub fn as_ptr(&self) -> *const c_void {
        match self {
            HipMemAllocationProp::V52(p) => (p as *const HipMemAllocationPropV52).cast(),
            HipMemAllocationProp::V54(p) => (p as *const HipMemAllocationPropV54).cast(),
        }
    }
}

/// `hipError_t hipInit(unsigned int flags)`.
pub type FnHipInit = unsafe extern "C" fn(c_uint) -> HipErrorCode;
/// `hipError_t hipGetDeviceCount(int* count)`.
pub type FnHipGetDeviceCount = unsafe extern "C" fn(*mut c_int) -> HipErrorCode;
/// `hipError_t hipRuntimeGetVersion(int* runtimeVersion)`.
pub type FnHipRuntimeGetVersion = unsafe extern "C" fn(*mut c_int) -> HipErrorCode;
/// `hipError_t hipDriverGetVersion(int* driverVersion)`.
pub type FnHipDriverGetVersion = unsafe extern "C" fn(*mut c_int) -> HipErrorCode;
/// `const char* hipGetErrorName(hipError_t)`.
pub type FnHipGetErrorName = unsafe extern "C" fn(HipErrorCode) -> *const c_char;
/// `hipError_t hipSetDevice(int deviceId)`.
pub type FnHipSetDevice = unsafe extern "C" fn(c_int) -> HipErrorCode;
/// `hipError_t hipDeviceSynchronize(void)`.
pub type FnHipDeviceSynchronize = unsafe extern "C" fn() -> HipErrorCode;
/// `hipError_t hipMemAddressReserve(void** ptr, size_t size, size_t alignment, void* addr,
/// unsigned long long flags)`.
pub type FnHipMemAddressReserve =
    unsafe extern "C" fn(*mut *mut c_void, usize, usize, *mut c_void, c_ulonglong) -> HipErrorCode;
/// `hipError_t hipMemAddressFree(void* devPtr, size_t size)`.
pub type FnHipMemAddressFree = unsafe extern "C" fn(*mut c_void, usize) -> HipErrorCode;
/// `hipError_t hipMemCreate(hipMemGenericAllocationHandle_t* handle, size_t size,
/// const hipMemAllocationProp* prop, unsigned long long flags)`.
pub type FnHipMemCreate =
    unsafe extern "C" fn(*mut *mut c_void, usize, *const c_void, c_ulonglong) -> HipErrorCode;
/// `hipError_t hipMemRelease(hipMemGenericAllocationHandle_t handle)`.
pub type FnHipMemRelease = unsafe extern "C" fn(*mut c_void) -> HipErrorCode;
/// `hipError_t hipMemMap(void* ptr, size_t size, size_t offset,
/// hipMemGenericAllocationHandle_t handle, unsigned long long flags)`.
pub type FnHipMemMap =
    unsafe extern "C" fn(*mut c_void, usize, usize, *mut c_void, c_ulonglong) -> HipErrorCode;
/// `hipError_t hipMemSetAccess(void* ptr, size_t size, const hipMemAccessDesc* desc,
/// size_t count)`.
pub type FnHipMemSetAccess =
    unsafe extern "C" fn(*mut c_void, usize, *const HipMemAccessDesc, usize) -> HipErrorCode;
/// `hipError_t hipMemUnmap(void* ptr, size_t size)`.
pub type FnHipMemUnmap = unsafe extern "C" fn(*mut c_void, usize) -> HipErrorCode;
/// `hipError_t hipMemGetAllocationGranularity(size_t* granularity,
/// const hipMemAllocationProp* prop, hipMemAllocationGranularity_flags option)`.
pub type FnHipMemGetAllocationGranularity =
    unsafe extern "C" fn(*mut usize, *const c_void, u32) -> HipErrorCode;
/// `hipError_t hipMemcpyHtoD(hipDeviceptr_t dst, void* src, size_t sizeBytes)`.
pub type FnHipMemcpyHtoD = unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> HipErrorCode;
/// `hipError_t hipMemcpyDtoH(void* dst, hipDeviceptr_t src, size_t sizeBytes)`.
pub type FnHipMemcpyDtoH = unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> HipErrorCode;
/// `hipError_t hipMemGetInfo(size_t* free, size_t* total)`.
pub type FnHipMemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> HipErrorCode;
/// `hipError_t hipDeviceGetName(char* name, int len, hipDevice_t device)`.
pub type FnHipDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipErrorCode;
/// `hipError_t hipDeviceTotalMem(size_t* bytes, hipDevice_t device)`.
pub type FnHipDeviceTotalMem = unsafe extern "C" fn(*mut usize, c_int) -> HipErrorCode;
/// `hipError_t hipDeviceCanAccessPeer(int* canAccessPeer, int deviceId, int peerDeviceId)`.
pub type FnHipDeviceCanAccessPeer = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> HipErrorCode;
/// `hipError_t hipMemExportToShareableHandle(void* shareableHandle,
/// hipMemGenericAllocationHandle_t handle, hipMemAllocationHandleType handleType,
/// unsigned long long flags)`.
pub type FnHipMemExportToShareableHandle =
    unsafe extern "C" fn(*mut c_void, *mut c_void, u32, c_ulonglong) -> HipErrorCode;
/// `hipError_t hipMemImportFromShareableHandle(hipMemGenericAllocationHandle_t* handle,
/// void* osHandle, hipMemAllocationHandleType shHandleType)`.
pub type FnHipMemImportFromShareableHandle =
    unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u32) -> HipErrorCode;

/// Every HIP entry point the backend uses, resolved once when the library is loaded.
///
/// The pointers stay valid for as long as the library stays loaded; the backend never unloads
/// it (see `HipRuntime`).
#[derive(Debug, Clone, Copy)]
pub struct HipApi {
    /// `hipInit`.
    pub init: FnHipInit,
    /// `hipGetDeviceCount`.
    pub get_device_count: FnHipGetDeviceCount,
    /// `hipRuntimeGetVersion`.
    pub runtime_get_version: FnHipRuntimeGetVersion,
    /// `hipSetDevice`.
    pub set_device: FnHipSetDevice,
    /// `hipDeviceSynchronize`.
    pub device_synchronize: FnHipDeviceSynchronize,
    /// `hipMemAddressReserve`.
    pub mem_address_reserve: FnHipMemAddressReserve,
    /// `hipMemAddressFree`.
    pub mem_address_free: FnHipMemAddressFree,
    /// `hipMemCreate`.
    pub mem_create: FnHipMemCreate,
    /// `hipMemRelease`.
    pub mem_release: FnHipMemRelease,
    /// `hipMemMap`.
    pub mem_map: FnHipMemMap,
    /// `hipMemSetAccess`.
    pub mem_set_access: FnHipMemSetAccess,
    /// `hipMemUnmap`.
    pub mem_unmap: FnHipMemUnmap,
    /// `hipMemGetAllocationGranularity`.
    pub mem_get_allocation_granularity: FnHipMemGetAllocationGranularity,
    /// `hipMemcpyHtoD`.
    pub memcpy_htod: FnHipMemcpyHtoD,
    /// `hipMemcpyDtoH`.
    pub memcpy_dtoh: FnHipMemcpyDtoH,
    /// `hipMemGetInfo`.
    pub mem_get_info: FnHipMemGetInfo,
    /// `hipDeviceGetName`.
    pub device_get_name: FnHipDeviceGetName,
    /// `hipDeviceTotalMem`.
    pub device_total_mem: FnHipDeviceTotalMem,
    /// `hipGetErrorName`, when the library exports it (only used for codes our table lacks).
    pub get_error_name: Option<FnHipGetErrorName>,
    /// `hipDriverGetVersion`, when the library exports it.
    pub driver_get_version: Option<FnHipDriverGetVersion>,
    /// `hipMemExportToShareableHandle`, when the library exports it.
    pub mem_export_to_shareable_handle: Option<FnHipMemExportToShareableHandle>,
    /// `hipMemImportFromShareableHandle`, when the library exports it.
    pub mem_import_from_shareable_handle: Option<FnHipMemImportFromShareableHandle>,
    /// `hipDeviceCanAccessPeer`, when the library exports it (without it no peer is reported).
    pub device_can_access_peer: Option<FnHipDeviceCanAccessPeer>,
}

/// Resolves `name` in `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the exact function-pointer type of the symbol `name` in the HIP ABI.
unsafe fn symbol<T: Copy>(lib: &Library, name: &str) -> Option<T> {
    // SAFETY: the caller guarantees that `T` is the symbol's real type; the library outlives
    // every use of the copied pointer because the backend never unloads it.
    unsafe { lib.get::<T>(name).ok().map(|s| *s) }
}

impl HipApi {
    /// Resolves every symbol the backend needs from `lib` (`path` names it in errors).
    ///
    /// A missing required symbol is an [`ErrorKind::Unavailable`](kvvm_hal::ErrorKind) error
    /// of [`Operation::Load`] that names the symbol and the library.
    pub fn load(lib: &Library, path: &str) -> Result<HipApi, BackendError> {
        let missing = |name: &str| {
            BackendError::unavailable(
                Operation::Load,
                format!(
                    "symbol {name} not found in {path} (the HIP virtual-memory API needs ROCm >= 5.2)"
                ),
            )
        };
        macro_rules! required {
            ($name:literal, $ty:ty) => {
                // SAFETY: `$ty` is the HIP prototype of `$name`, written from the header above.
                match unsafe { symbol::<$ty>(lib, $name) } {
                    Some(f) => f,
                    None => return Err(missing($name)),
                }
            };
        }
        macro_rules! optional {
            ($name:literal, $ty:ty) => {
                // SAFETY: `$ty` is the HIP prototype of `$name`, written from the header above.
                unsafe { symbol::<$ty>(lib, $name) }
            };
        }
        Ok(HipApi {
            init: required!("hipInit", FnHipInit),
            get_device_count: required!("hipGetDeviceCount", FnHipGetDeviceCount),
            runtime_get_version: required!("hipRuntimeGetVersion", FnHipRuntimeGetVersion),
            set_device: required!("hipSetDevice", FnHipSetDevice),
            device_synchronize: required!("hipDeviceSynchronize", FnHipDeviceSynchronize),
            mem_address_reserve: required!("hipMemAddressReserve", FnHipMemAddressReserve),
            mem_address_free: required!("hipMemAddressFree", FnHipMemAddressFree),
            mem_create: required!("hipMemCreate", FnHipMemCreate),
            mem_release: required!("hipMemRelease", FnHipMemRelease),
            mem_map: required!("hipMemMap", FnHipMemMap),
            mem_set_access: required!("hipMemSetAccess", FnHipMemSetAccess),
            mem_unmap: required!("hipMemUnmap", FnHipMemUnmap),
            mem_get_allocation_granularity: required!(
                "hipMemGetAllocationGranularity",
                FnHipMemGetAllocationGranularity
            ),
            memcpy_htod: required!("hipMemcpyHtoD", FnHipMemcpyHtoD),
            memcpy_dtoh: required!("hipMemcpyDtoH", FnHipMemcpyDtoH),
            mem_get_info: required!("hipMemGetInfo", FnHipMemGetInfo),
            device_get_name: required!("hipDeviceGetName", FnHipDeviceGetName),
            device_total_mem: required!("hipDeviceTotalMem", FnHipDeviceTotalMem),
            get_error_name: optional!("hipGetErrorName", FnHipGetErrorName),
            driver_get_version: optional!("hipDriverGetVersion", FnHipDriverGetVersion),
            mem_export_to_shareable_handle: optional!(
                "hipMemExportToShareableHandle",
                FnHipMemExportToShareableHandle
            ),
            mem_import_from_shareable_handle: optional!(
                "hipMemImportFromShareableHandle",
                FnHipMemImportFromShareableHandle
            ),
            device_can_access_peer: optional!("hipDeviceCanAccessPeer", FnHipDeviceCanAccessPeer),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rocm_5_2_layout_offsets() {
        assert_eq!(size_of::<HipMemAllocationPropV52>(), 32);
        assert_eq!(offset_of!(HipMemAllocationPropV52, compression_type), 0);
        assert_eq!(offset_of!(HipMemAllocationPropV52, location), 4);
        assert_eq!(
            offset_of!(HipMemAllocationPropV52, requested_handle_type),
            12
        );
        assert_eq!(offset_of!(HipMemAllocationPropV52, type_), 16);
        assert_eq!(offset_of!(HipMemAllocationPropV52, usage), 20);
        assert_eq!(
            offset_of!(HipMemAllocationPropV52, win32_handle_meta_data),
            24
        );
    }

    #[test]
    fn rocm_5_4_layout_offsets() {
        assert_eq!(size_of::<HipMemAllocationPropV54>(), 32);
        assert_eq!(offset_of!(HipMemAllocationPropV54, type_), 0);
        assert_eq!(
            offset_of!(HipMemAllocationPropV54, requested_handle_type),
            4
        );
        assert_eq!(offset_of!(HipMemAllocationPropV54, location), 8);
        assert_eq!(
            offset_of!(HipMemAllocationPropV54, win32_handle_meta_data),
            16
        );
        assert_eq!(offset_of!(HipMemAllocationPropV54, alloc_flags), 24);
        assert_eq!(offset_of!(HipMemAllocationPropV54, alloc_flags.usage), 26);
    }

    /// The bytes the runtime reads: pinned (1) on device 3, POSIX-FD handle type (1).
    #[test]
    fn props_put_fields_where_each_header_expects_them() {
        /// The `u32` at byte `offset` of a 32-byte prop (never a padding byte here).
        fn word(ptr: *const c_void, offset: usize) -> u32 {
            assert!(offset + 4 <= 32);
            // SAFETY: both prop layouts are 32 bytes; every offset read below is a fully
            // initialised 4-byte field, never padding.
            unsafe { std::ptr::read_unaligned(ptr.cast::<u8>().add(offset).cast::<u32>()) }
        }
        let v52 = HipMemAllocationProp::V52(HipMemAllocationPropV52::pinned_device(3, 1));
        // location.type @4, location.id @8, requestedHandleType @12, type @16.
        let w: Vec<u32> = [4, 8, 12, 16]
            .iter()
            .map(|&o| word(v52.as_ptr(), o))
            .collect();
        assert_eq!(w, [1, 3, 1, 1]);
        let v54 = HipMemAllocationProp::V54(HipMemAllocationPropV54::pinned_device(3, 0));
        // type @0, requestedHandleType @4, location.type @8, location.id @12.
        let w: Vec<u32> = [0, 4, 8, 12]
            .iter()
            .map(|&o| word(v54.as_ptr(), o))
            .collect();
        assert_eq!(w, [1, 0, 1, 3]);
    }
}
