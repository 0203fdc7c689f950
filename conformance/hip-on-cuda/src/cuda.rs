//! The CUDA driver side: hand-written ABI types, `libcuda.so.1` loaded once, the primary
//! context made current per thread, and CUDA result codes translated into HIP codes.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::mem::{offset_of, size_of, ManuallyDrop};
use std::sync::{Mutex, OnceLock};

use kvvm_hip::error::HipErrorCode;
use kvvm_hip::error::{
    HIP_ERROR_INSUFFICIENT_DRIVER, HIP_ERROR_INVALID_DEVICE, HIP_ERROR_INVALID_VALUE,
    HIP_ERROR_LAUNCH_FAILURE, HIP_ERROR_UNKNOWN,
};
use libloading::Library;

/// `CUresult`, kept raw.
pub type CuResult = i32;
/// `CUdeviceptr`.
pub type CuDevicePtr = u64;
/// `CUmemGenericAllocationHandle`.
pub type CuHandle = u64;

/// `CUmemLocation` (`type` u32 @0, `id` i32 @4; a union around `id` from CUDA 13, same ABI).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CuMemLocation {
    /// `CUmemLocationType` (1 = device).
    pub type_: u32,
    /// The device ordinal.
    pub id: i32,
}

/// The `allocFlags` member of [`CuMemAllocationProp`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CuMemAllocFlags {
    /// `unsigned char compressionType`.
    pub compression_type: u8,
    /// `unsigned char gpuDirectRDMACapable`.
    pub gpu_direct_rdma_capable: u8,
    /// `unsigned short usage`.
    pub usage: u16,
    /// `unsigned char reserved[4]`.
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp`: type u32 @0, requestedHandleTypes u32 @4, location @8,
/// win32HandleMetaData @16, allocFlags @24, size 32.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CuMemAllocationProp {
    /// `CUmemAllocationType` (1 = pinned).
    pub type_: u32,
    /// `CUmemAllocationHandleType` (0 none, 1 POSIX fd).
    pub requested_handle_types: u32,
    /// Where the memory lives.
    pub location: CuMemLocation,
    /// `void* win32HandleMetaData`.
    pub win32_handle_meta_data: *mut c_void,
    /// `allocFlags`.
    pub alloc_flags: CuMemAllocFlags,
}

/// `CUmemAccessDesc`: location @0, flags @8, size 12.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CuMemAccessDesc {
    /// The device whose access is set.
    pub location: CuMemLocation,
    /// `CUmemAccess_flags`: 0 none, 1 read, 3 read-write.
    pub flags: u32,
}

const _: () = {
    assert!(size_of::<CuMemLocation>() == 8);
    assert!(size_of::<CuMemAllocationProp>() == 32);
    assert!(offset_of!(CuMemAllocationProp, type_) == 0);
    assert!(offset_of!(CuMemAllocationProp, requested_handle_types) == 4);
    assert!(offset_of!(CuMemAllocationProp, location) == 8);
    assert!(offset_of!(CuMemAllocationProp, win32_handle_meta_data) == 16);
    assert!(offset_of!(CuMemAllocationProp, alloc_flags) == 24);
    assert!(offset_of!(CuMemAllocationProp, alloc_flags.usage) == 26);
    assert!(offset_of!(CuMemAllocationProp, alloc_flags.reserved) == 28);
    assert!(size_of::<CuMemAccessDesc>() == 12);
    assert!(offset_of!(CuMemAccessDesc, flags) == 8);
};

/// The CUDA driver entry points the shim forwards to.
pub struct Cuda {
    _library: ManuallyDrop<Library>,
    /// What `cuInit(0)` returned, translated.
    pub init_rc: HipErrorCode,
    /// `cuDeviceGetCount`.
    pub device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    /// `cuDeviceGet`.
    pub device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    /// `cuDriverGetVersion`.
    pub driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    /// `cuDevicePrimaryCtxRetain`.
    pub primary_ctx_retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult,
    /// `cuCtxSetCurrent`.
    pub ctx_set_current: unsafe extern "C" fn(*mut c_void) -> CuResult,
    /// `cuCtxSynchronize`.
    pub ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    /// `cuMemAddressReserve`.
    pub mem_address_reserve:
        unsafe extern "C" fn(*mut CuDevicePtr, usize, usize, CuDevicePtr, c_ulonglong) -> CuResult,
    /// `cuMemAddressFree`.
    pub mem_address_free: unsafe extern "C" fn(CuDevicePtr, usize) -> CuResult,
    /// `cuMemCreate`.
    pub mem_create: unsafe extern "C" fn(
        *mut CuHandle,
        usize,
        *const CuMemAllocationProp,
        c_ulonglong,
    ) -> CuResult,
    /// `cuMemRelease`.
    pub mem_release: unsafe extern "C" fn(CuHandle) -> CuResult,
    /// `cuMemMap`.
    pub mem_map: unsafe extern "C" fn(CuDevicePtr, usize, usize, CuHandle, c_ulonglong) -> CuResult,
    /// `cuMemSetAccess`.
    pub mem_set_access:
        unsafe extern "C" fn(CuDevicePtr, usize, *const CuMemAccessDesc, usize) -> CuResult,
    /// `cuMemUnmap`.
    pub mem_unmap: unsafe extern "C" fn(CuDevicePtr, usize) -> CuResult,
    /// `cuMemGetAllocationGranularity`.
    pub mem_get_allocation_granularity:
        unsafe extern "C" fn(*mut usize, *const CuMemAllocationProp, c_uint) -> CuResult,
    /// `cuMemcpyHtoD_v2`.
    pub memcpy_htod: unsafe extern "C" fn(CuDevicePtr, *const c_void, usize) -> CuResult,
    /// `cuMemcpyDtoH_v2`.
    pub memcpy_dtoh: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult,
    /// `cuMemGetInfo_v2`.
    pub mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult,
    /// `cuDeviceGetName`.
    pub device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> CuResult,
    /// `cuDeviceTotalMem_v2`.
    pub device_total_mem: unsafe extern "C" fn(*mut usize, c_int) -> CuResult,
    /// `cuMemExportToShareableHandle`.
    pub mem_export: unsafe extern "C" fn(*mut c_void, CuHandle, c_uint, c_ulonglong) -> CuResult,
    /// `cuMemImportFromShareableHandle`.
    pub mem_import: unsafe extern "C" fn(*mut CuHandle, *mut c_void, c_uint) -> CuResult,
    /// `cuDeviceCanAccessPeer`.
    pub device_can_access_peer: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CuResult,
    /// Primary contexts retained so far: (ordinal, CUcontext address).
    contexts: Mutex<Vec<(c_int, usize)>>,
}

static CUDA: OnceLock<Result<Cuda, HipErrorCode>> = OnceLock::new();

thread_local! {
    /// The HIP device of the calling thread (`hipSetDevice`); 0 until set, as in HIP.
    static DEVICE: Cell<c_int> = const { Cell::new(0) };
    /// The device whose primary context is current on this thread, if the shim made one so.
    static BOUND: Cell<Option<c_int>> = const { Cell::new(None) };
}

/// The loaded driver (`cuInit(0)` already called), or the HIP code to return: when
/// `libcuda.so.1` or one of its symbols is missing, `hipErrorInsufficientDriver`.
pub fn cuda() -> Result<&'static Cuda, HipErrorCode> {
    match CUDA.get_or_init(load) {
        Ok(c) => Ok(c),
        Err(rc) => Err(*rc),
    }
}

/// Resolves `name` in `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the symbol's real type.
unsafe fn symbol<T: Copy>(lib: &Library, name: &str) -> Option<T> {
    // SAFETY: the caller guarantees the type; the library is never unloaded.
    unsafe { lib.get::<T>(name).ok().map(|s| *s) }
}

fn load() -> Result<Cuda, HipErrorCode> {
    // SAFETY: loading libcuda runs its initialisers, which are safe in any process.
    let lib = match unsafe { Library::new("libcuda.so.1") } {
        Ok(lib) => ManuallyDrop::new(lib),
        Err(_) => return Err(HIP_ERROR_INSUFFICIENT_DRIVER),
    };
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the field's type is the CUDA prototype of `$name` (cuda.h).
            match unsafe { symbol(&lib, $name) } {
                Some(f) => f,
                None => return Err(HIP_ERROR_INSUFFICIENT_DRIVER),
            }
        };
    }
    let init: unsafe extern "C" fn(c_uint) -> CuResult = sym!("cuInit");
    let mut cuda = Cuda {
        init_rc: 0,
        device_get_count: sym!("cuDeviceGetCount"),
        device_get: sym!("cuDeviceGet"),
        driver_get_version: sym!("cuDriverGetVersion"),
        primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
        ctx_set_current: sym!("cuCtxSetCurrent"),
        ctx_synchronize: sym!("cuCtxSynchronize"),
        mem_address_reserve: sym!("cuMemAddressReserve"),
        mem_address_free: sym!("cuMemAddressFree"),
        mem_create: sym!("cuMemCreate"),
        mem_release: sym!("cuMemRelease"),
        mem_map: sym!("cuMemMap"),
        mem_set_access: sym!("cuMemSetAccess"),
        mem_unmap: sym!("cuMemUnmap"),
        mem_get_allocation_granularity: sym!("cuMemGetAllocationGranularity"),
        memcpy_htod: sym!("cuMemcpyHtoD_v2"),
        memcpy_dtoh: sym!("cuMemcpyDtoH_v2"),
        mem_get_info: sym!("cuMemGetInfo_v2"),
        device_get_name: sym!("cuDeviceGetName"),
        device_total_mem: sym!("cuDeviceTotalMem_v2"),
        mem_export: sym!("cuMemExportToShareableHandle"),
        mem_import: sym!("cuMemImportFromShareableHandle"),
        device_can_access_peer: sym!("cuDeviceCanAccessPeer"),
        contexts: Mutex::new(Vec::new()),
        _library: lib,
    };
    // SAFETY: cuInit takes its flags by value.
    cuda.init_rc = to_hip(unsafe { init(0) });
    Ok(cuda)
}

impl Cuda {
    /// The number of CUDA devices, or the HIP code of the failure.
    pub fn device_count(&self) -> Result<c_int, HipErrorCode> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-parameter.
        let rc = to_hip(unsafe { (self.device_get_count)(&mut n) });
        if rc == 0 {
            Ok(n)
        } else {
            Err(rc)
        }
    }

    /// The `CUdevice` of ordinal `ordinal`.
    pub fn device(&self, ordinal: c_int) -> Result<c_int, HipErrorCode> {
        let mut dev: c_int = 0;
        // SAFETY: `dev` is a valid out-parameter.
        let rc = to_hip(unsafe { (self.device_get)(&mut dev, ordinal) });
        if rc == 0 {
            Ok(dev)
        } else if rc == HIP_ERROR_INVALID_VALUE {
            Err(HIP_ERROR_INVALID_DEVICE)
        } else {
            Err(rc)
        }
    }

    fn primary_context(&self, ordinal: c_int) -> Result<*mut c_void, HipErrorCode> {
        let mut contexts = self
            .contexts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, ctx)) = contexts.iter().find(|(o, _)| *o == ordinal) {
            return Ok(std::ptr::with_exposed_provenance_mut(*ctx));
        }
        let dev = self.device(ordinal)?;
        let mut ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-parameter; `dev` came from cuDeviceGet.
        let rc = to_hip(unsafe { (self.primary_ctx_retain)(&mut ctx, dev) });
        if rc != 0 {
            return Err(rc);
        }
        contexts.push((ordinal, ctx.expose_provenance()));
        Ok(ctx)
    }

    /// Makes `ordinal`'s primary context current on the calling thread and records it as the
    /// thread's HIP device.
    pub fn set_device(&self, ordinal: c_int) -> HipErrorCode {
        match self.device_count() {
            Ok(n) if (0..n).contains(&ordinal) => {}
            Ok(_) => return HIP_ERROR_INVALID_DEVICE,
            Err(rc) => return rc,
        }
        DEVICE.with(|d| d.set(ordinal));
        // A no-op when this thread already has that device's context current.
        self.ensure_context()
    }

    /// Makes the thread's HIP device's primary context current, once per thread and device.
    pub fn ensure_context(&self) -> HipErrorCode {
        if self.init_rc != 0 {
            return self.init_rc;
        }
        let ordinal = DEVICE.with(Cell::get);
        if BOUND.with(Cell::get) == Some(ordinal) {
            return 0;
        }
        let ctx = match self.primary_context(ordinal) {
            Ok(ctx) => ctx,
            Err(rc) => return rc,
        };
        // SAFETY: `ctx` is a primary context retained above and never released.
        let rc = to_hip(unsafe { (self.ctx_set_current)(ctx) });
        if rc == 0 {
            BOUND.with(|b| b.set(Some(ordinal)));
        }
        rc
    }
}

/// Translates a `CUresult` into the `hipError_t` the HIP runtime would return.
pub fn to_hip(rc: CuResult) -> HipErrorCode {
    match rc {
        // Same number on both sides.
        0 | 1 | 2 | 3 | 4 | 100 | 101 | 200 | 201 | 202 | 205 | 206 | 207 | 208 | 209 | 210
        | 211 | 212 | 213 | 214 | 215 | 216 | 217 | 218 | 219 | 300 | 301 | 302 | 303 | 304
        | 400 | 401 | 500 | 600 | 700 | 701 | 702 | 704 | 705 | 708 | 709 | 710 | 712 | 713
        | 719 | 720 | 801 | 900 | 901 | 902 | 903 | 904 | 905 | 906 | 907 | 908 | 910 | 999 => rc,
        // CUDA_ERROR_DEVICE_UNAVAILABLE: no usable device.
        46 => 100,
        // CUDA_ERROR_HARDWARE_STACK_ERROR .. CUDA_ERROR_INVALID_PC: sticky kernel faults.
        714..=718 => HIP_ERROR_LAUNCH_FAILURE,
        // CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE.
        803 | 804 => HIP_ERROR_INSUFFICIENT_DRIVER,
        _ => HIP_ERROR_UNKNOWN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_codes_translate_to_hip_codes() {
        for (cu, hip) in [
            (0, 0),
            (1, 1),
            (2, 2),
            (801, 801),
            (100, 100),
            (700, 700),
            (719, 719),
            (716, 719),
            (803, 35),
            (12345, 999),
        ] {
            assert_eq!(to_hip(cu), hip, "CUDA {cu}");
        }
    }
}
