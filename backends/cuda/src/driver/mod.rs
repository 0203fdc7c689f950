//! The driver's entry points, resolved once, up front, from cudarc's loaded `libcuda`.
//!
//! cudarc's `sys` functions resolve each symbol lazily on first call and panic when it is
//! missing; its `CUresult` is a Rust `enum`, so a code newer than the bindings would be
//! undefined behaviour. This module therefore uses cudarc's loader
//! ([`cudarc::driver::sys::is_culib_present`], [`cudarc::driver::sys::culib`]) and its
//! `#[repr(C)]` types, but resolves every symbol the backend needs itself, when the backend
//! opens, into a table of function pointers whose return type is the raw `u32` code. A missing
//! library or symbol is an [`ErrorKind::Unavailable`](kvvm_hal::ErrorKind::Unavailable) error
//! listing what is missing; nothing is resolved (or can panic) later.
//!
//! [`Driver`] is that table: a `Copy` struct of function pointers, one per symbol of
//! [`Driver::SYMBOLS`]. The invariants it keeps: a `Driver` exists only once every one of its
//! symbols resolved from the CUDA driver library ([`load`], `Driver::resolve`), so calling an
//! entry point never resolves anything and never panics; every entry point returns the raw
//! `u32` code ([`RawResult`]), never cudarc's `CUresult` enum. Its methods live in two files:
//!
//! * `mod.rs` (this file): the table, its symbol list and loading it;
//! * `result.rs`: the thin wrappers, `MaybeUninit` out-parameters in, `Result<_, CuCode>`
//!   ([`CuResult`]) out;
//! * `streams.rs`: the wrappers of a host tier's calls (pinned host memory, copies on a
//!   stream, streams and events).

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdevice_attribute, CUdeviceptr, CUevent, CUfunction, CUmemAccessDesc,
    CUmemAllocationGranularity_flags, CUmemAllocationHandleType, CUmemAllocationProp,
    CUmemGenericAllocationHandle, CUmodule, CUstream,
};
use kvvm_hal::{BackendError, Operation};

mod result;
pub(crate) mod streams;

pub(crate) use result::CuResult;

/// The raw `CUresult` every entry point returns (see [`crate::error::CuCode`]).
pub(crate) type RawResult = c_uint;

macro_rules! driver_table {
    ($( $field:ident = $sym:literal : fn($($arg:ty),* $(,)?); )*) => {
        /// Function pointers into `libcuda`, all resolved when the backend opened.
        #[derive(Clone, Copy)]
        #[allow(non_snake_case)]
        pub(crate) struct Driver {
            $( pub(crate) $field: unsafe extern "C" fn($($arg),*) -> RawResult, )*
        }

        impl Driver {
            /// The exported names of every symbol the backend resolves.
            pub(crate) const SYMBOLS: &'static [&'static CStr] = &[$($sym),*];

            /// Resolves every symbol from cudarc's `libcuda` handle.
            ///
            /// # Safety
            /// `cudarc::driver::sys::is_culib_present()` must have returned true (so that
            /// `culib()` finds the library and does not panic), and the library must be the
            /// CUDA driver, whose symbols have the C signatures declared in this table.
            #[allow(non_snake_case)]
            pub(crate) unsafe fn resolve() -> Result<Driver, BackendError> {
                // SAFETY: the caller checked that the library is present, so `culib()` loads
                // it (once, for the life of the process) instead of panicking.
                let lib = unsafe { cudarc::driver::sys::culib() };
                let mut missing: Vec<String> = Vec::new();
                $(
                    // SAFETY: the symbol is looked up by name only; the declared type is the
                    // C signature of that driver entry point (see cuda.h / cudarc's sys).
                    let $field = match unsafe {
                        lib.get::<unsafe extern "C" fn($($arg),*) -> RawResult>($sym)
                    } {
                        Ok(symbol) => Some(*symbol),
                        Err(_) => {
                            missing.push($sym.to_string_lossy().into_owned());
                            None
                        }
                    };
                )*
                if let ($(Some($field),)*) = ($($field,)*) {
                    Ok(Driver { $($field),* })
                } else {
                    Err(BackendError::unavailable(
                        Operation::Load,
                        format!(
                            "the CUDA driver library lacks symbol(s): {} (driver too old?)",
                            missing.join(", ")
                        ),
                    ))
                }
            }
        }
    };
}

driver_table! {
    init = c"cuInit": fn(c_uint);
    driver_get_version = c"cuDriverGetVersion": fn(*mut c_int);
    get_error_name = c"cuGetErrorName": fn(RawResult, *mut *const c_char);
    device_get_count = c"cuDeviceGetCount": fn(*mut c_int);
    device_get = c"cuDeviceGet": fn(*mut CUdevice, c_int);
    device_get_name = c"cuDeviceGetName": fn(*mut c_char, c_int, CUdevice);
    device_total_mem = c"cuDeviceTotalMem_v2": fn(*mut usize, CUdevice);
    device_get_attribute = c"cuDeviceGetAttribute": fn(*mut c_int, CUdevice_attribute, CUdevice);
    primary_ctx_retain = c"cuDevicePrimaryCtxRetain": fn(*mut CUcontext, CUdevice);
    primary_ctx_release = c"cuDevicePrimaryCtxRelease_v2": fn(CUdevice);
    ctx_get_current = c"cuCtxGetCurrent": fn(*mut CUcontext);
    ctx_set_current = c"cuCtxSetCurrent": fn(CUcontext);
    ctx_synchronize = c"cuCtxSynchronize": fn();
    mem_get_info = c"cuMemGetInfo_v2": fn(*mut usize, *mut usize);
    mem_get_allocation_granularity = c"cuMemGetAllocationGranularity":
        fn(*mut usize, *const CUmemAllocationProp, CUmemAllocationGranularity_flags);
    mem_address_reserve = c"cuMemAddressReserve":
        fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, c_ulonglong);
    mem_address_free = c"cuMemAddressFree": fn(CUdeviceptr, usize);
    mem_create = c"cuMemCreate":
        fn(*mut CUmemGenericAllocationHandle, usize, *const CUmemAllocationProp, c_ulonglong);
    mem_release = c"cuMemRelease": fn(CUmemGenericAllocationHandle);
    mem_map = c"cuMemMap":
        fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, c_ulonglong);
    mem_set_access = c"cuMemSetAccess": fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize);
    mem_unmap = c"cuMemUnmap": fn(CUdeviceptr, usize);
    memcpy_htod = c"cuMemcpyHtoD_v2": fn(CUdeviceptr, *const c_void, usize);
    memcpy_dtoh = c"cuMemcpyDtoH_v2": fn(*mut c_void, CUdeviceptr, usize);
    mem_export_to_shareable_handle = c"cuMemExportToShareableHandle":
        fn(*mut c_void, CUmemGenericAllocationHandle, CUmemAllocationHandleType, c_ulonglong);
    mem_import_from_shareable_handle = c"cuMemImportFromShareableHandle":
        fn(*mut CUmemGenericAllocationHandle, *mut c_void, CUmemAllocationHandleType);
    mem_alloc = c"cuMemAlloc_v2": fn(*mut CUdeviceptr, usize);
    mem_free = c"cuMemFree_v2": fn(CUdeviceptr);
    memcpy_dtod = c"cuMemcpyDtoD_v2": fn(CUdeviceptr, CUdeviceptr, usize);
    module_load_data = c"cuModuleLoadData": fn(*mut CUmodule, *const c_void);
    module_unload = c"cuModuleUnload": fn(CUmodule);
    module_get_function = c"cuModuleGetFunction": fn(*mut CUfunction, CUmodule, *const c_char);
    device_can_access_peer = c"cuDeviceCanAccessPeer": fn(*mut c_int, CUdevice, CUdevice);
    pointer_get_attribute = c"cuPointerGetAttribute": fn(*mut c_void, c_int, CUdeviceptr);
    mem_host_alloc = c"cuMemHostAlloc": fn(*mut *mut c_void, usize, c_uint);
    mem_free_host = c"cuMemFreeHost": fn(*mut c_void);
    memcpy_dtoh_async = c"cuMemcpyDtoHAsync_v2": fn(*mut c_void, CUdeviceptr, usize, CUstream);
    memcpy_htod_async = c"cuMemcpyHtoDAsync_v2": fn(CUdeviceptr, *const c_void, usize, CUstream);
    stream_create = c"cuStreamCreate": fn(*mut CUstream, c_uint);
    stream_destroy = c"cuStreamDestroy_v2": fn(CUstream);
    stream_wait_event = c"cuStreamWaitEvent": fn(CUstream, CUevent, c_uint);
    event_create = c"cuEventCreate": fn(*mut CUevent, c_uint);
    event_record = c"cuEventRecord": fn(CUevent, CUstream);
    event_query = c"cuEventQuery": fn(CUevent);
    event_synchronize = c"cuEventSynchronize": fn(CUevent);
    event_destroy = c"cuEventDestroy_v2": fn(CUevent);
    launch_kernel = c"cuLaunchKernel": fn(
        CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CUstream,
        *mut *mut c_void, *mut *mut c_void,
    );
}

/// Loads the CUDA driver library through cudarc and resolves every symbol of [`Driver`].
///
/// Never panics on a missing library or symbol: both are `Unavailable` errors.
pub(crate) fn load() -> Result<Driver, BackendError> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate names and drops them.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    if !present {
        let candidates = cudarc::get_lib_name_candidates("cuda");
        let mut shown: Vec<&str> = candidates
            .iter()
            .filter(|c| c.starts_with("libcuda.so"))
            .map(String::as_str)
            .collect();
        shown.sort_unstable();
        shown.dedup();
        return Err(BackendError::unavailable(
            Operation::Load,
            format!(
                "the CUDA driver library was not found (searched {} names such as {}; \
                 is the NVIDIA driver installed and on LD_LIBRARY_PATH?)",
                candidates.len(),
                shown.join(", ")
            ),
        ));
    }
    // SAFETY: the library is present (checked just above) and it is libcuda, the library
    // whose entry points the table declares.
    unsafe { Driver::resolve() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbol_names_are_unique_and_cuda_prefixed() {
        let mut names: Vec<&CStr> = Driver::SYMBOLS.to_vec();
        assert!(names.iter().all(|n| n.to_bytes().starts_with(b"cu")));
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Driver::SYMBOLS.len());
    }
}
