//! Thin result-style wrappers over the [`Driver`] table: out-parameters become return values
//! (`MaybeUninit`), a `CUresult` becomes `Result<_, CuCode>`.
//!
//! A wrapper is a safe function when every host pointer it hands the driver comes from a Rust
//! reference or a local, and the device-side arguments (addresses, handles, ordinals) are
//! plain integers that the driver validates itself. Wrappers that take a driver object the
//! driver cannot validate (a context, module or function pointer) are `unsafe`.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::mem::MaybeUninit;
use std::ptr;

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdevice_attribute, CUdeviceptr, CUfunction, CUmemAccessDesc,
    CUmemAllocationGranularity_flags, CUmemAllocationHandleType, CUmemAllocationProp,
    CUmemGenericAllocationHandle, CUmodule, CUstream,
};

use super::{Driver, RawResult};
use crate::error::CuCode;

/// The result of one driver call.
pub(crate) type CuResult<T> = Result<T, CuCode>;

fn check(code: RawResult) -> CuResult<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(CuCode(code))
    }
}

impl Driver {
    /// `cuInit(0)`.
    pub(crate) fn init(&self) -> CuResult<()> {
        // SAFETY: plain integer argument.
        check(unsafe { (self.init)(0) })
    }

    /// `cuDriverGetVersion`: the version as `1000 * major + 10 * minor`.
    pub(crate) fn driver_version(&self) -> CuResult<c_int> {
        let mut v = MaybeUninit::<c_int>::uninit();
        // SAFETY: `v` is a valid out-pointer; it is read only after success.
        unsafe {
            check((self.driver_get_version)(v.as_mut_ptr()))?;
            Ok(v.assume_init())
        }
    }

    /// `cuGetErrorName`: the driver's own name for `code`, if it knows it.
    pub(crate) fn error_name(&self, code: CuCode) -> Option<String> {
        let mut p = MaybeUninit::<*const c_char>::uninit();
        // SAFETY: `p` is a valid out-pointer. On success the driver stores a pointer to a
        // static NUL-terminated string (or NULL), which is copied before returning.
        unsafe {
            check((self.get_error_name)(code.0, p.as_mut_ptr())).ok()?;
            let p = p.assume_init();
            if p.is_null() {
                return None;
            }
            Some(CStr::from_ptr(p).to_string_lossy().into_owned())
        }
    }

    /// `cuDeviceGetCount`.
    pub(crate) fn device_count(&self) -> CuResult<c_int> {
        let mut n = MaybeUninit::<c_int>::uninit();
        // SAFETY: valid out-pointer, read only after success.
        unsafe {
            check((self.device_get_count)(n.as_mut_ptr()))?;
            Ok(n.assume_init())
        }
    }

    /// `cuDeviceGet`.
    pub(crate) fn device(&self, ordinal: c_int) -> CuResult<CUdevice> {
        let mut d = MaybeUninit::<CUdevice>::uninit();
        // SAFETY: valid out-pointer, read only after success.
        unsafe {
            check((self.device_get)(d.as_mut_ptr(), ordinal))?;
            Ok(d.assume_init())
        }
    }

    /// `cuDeviceGetName`.
    pub(crate) fn device_name(&self, dev: CUdevice) -> CuResult<String> {
        let mut buf = [0 as c_char; 256];
        let len = c_int::try_from(buf.len() - 1).unwrap_or(255);
        // SAFETY: the driver writes at most `len` bytes (NUL included) into `buf`, which is
        // one byte longer, so `buf` stays NUL-terminated even if the driver fills it.
        unsafe { check((self.device_get_name)(buf.as_mut_ptr(), len, dev))? };
        // SAFETY: `buf` is NUL-terminated (see above) and lives for this borrow.
        let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Ok(name.to_string_lossy().into_owned())
    }

    /// `cuDeviceTotalMem_v2`.
    pub(crate) fn device_total_mem(&self, dev: CUdevice) -> CuResult<usize> {
        let mut n = MaybeUninit::<usize>::uninit();
        // SAFETY: valid out-pointer, read only after success.
        unsafe {
            check((self.device_total_mem)(n.as_mut_ptr(), dev))?;
            Ok(n.assume_init())
        }
    }

    /// `cuDeviceGetAttribute`.
    pub(crate) fn device_attribute(
        &self,
        attribute: CUdevice_attribute,
        dev: CUdevice,
    ) -> CuResult<c_int> {
        let mut v = MaybeUninit::<c_int>::uninit();
        // SAFETY: valid out-pointer, read only after success; `attribute` is a valid variant.
        unsafe {
            check((self.device_get_attribute)(v.as_mut_ptr(), attribute, dev))?;
            Ok(v.assume_init())
        }
    }

    /// `cuDevicePrimaryCtxRetain`.
    pub(crate) fn primary_ctx_retain(&self, dev: CUdevice) -> CuResult<CUcontext> {
        let mut c = MaybeUninit::<CUcontext>::uninit();
        // SAFETY: valid out-pointer, read only after success.
        unsafe {
            check((self.primary_ctx_retain)(c.as_mut_ptr(), dev))?;
            Ok(c.assume_init())
        }
    }

    /// `cuDevicePrimaryCtxRelease_v2`.
    ///
    /// # Safety
    /// Must balance exactly one successful [`primary_ctx_retain`](Self::primary_ctx_retain)
    /// of `dev`, after every use of that context by this backend.
    pub(crate) unsafe fn primary_ctx_release(&self, dev: CUdevice) -> CuResult<()> {
        // SAFETY: the caller balances one retain.
        check(unsafe { (self.primary_ctx_release)(dev) })
    }

    /// `cuCtxGetCurrent` (NULL when no context is current on this thread).
    pub(crate) fn ctx_current(&self) -> CuResult<CUcontext> {
        let mut c = MaybeUninit::<CUcontext>::uninit();
        // SAFETY: valid out-pointer, read only after success.
        unsafe {
            check((self.ctx_get_current)(c.as_mut_ptr()))?;
            Ok(c.assume_init())
        }
    }

    /// `cuCtxSetCurrent`.
    ///
    /// # Safety
    /// `ctx` must be a live context (a retained primary context of this backend).
    pub(crate) unsafe fn ctx_set_current(&self, ctx: CUcontext) -> CuResult<()> {
        // SAFETY: the caller guarantees that `ctx` is live.
        check(unsafe { (self.ctx_set_current)(ctx) })
    }

    /// `cuCtxSynchronize` on the current context.
    pub(crate) fn ctx_synchronize(&self) -> CuResult<()> {
        // SAFETY: no arguments; fails with a code when no context is current.
        check(unsafe { (self.ctx_synchronize)() })
    }

    /// `cuDeviceCanAccessPeer`: whether `device` can access memory of `peer`.
    pub(crate) fn can_access_peer(&self, device: CUdevice, peer: CUdevice) -> CuResult<bool> {
        let mut v = MaybeUninit::<c_int>::uninit();
        // SAFETY: valid out-pointer, read only after success; the devices come from
        // `cuDeviceGet`.
        unsafe {
            check((self.device_can_access_peer)(v.as_mut_ptr(), device, peer))?;
            Ok(v.assume_init() != 0)
        }
    }

    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)`: the ordinal of the device
    /// whose memory `ptr` is mapped to.
    pub(crate) fn pointer_device_ordinal(&self, ptr: CUdeviceptr) -> CuResult<c_int> {
        const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
        let mut v = MaybeUninit::<c_int>::uninit();
        // SAFETY: the attribute's value is one `int` (cuda.h); valid out-pointer, read only
        // after success.
        unsafe {
            check((self.pointer_get_attribute)(
                v.as_mut_ptr().cast::<c_void>(),
                CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr,
            ))?;
            Ok(v.assume_init())
        }
    }

    /// `cuMemGetInfo_v2` of the current context's device: `(free, total)`.
    pub(crate) fn mem_info(&self) -> CuResult<(usize, usize)> {
        let mut free = MaybeUninit::<usize>::uninit();
        let mut total = MaybeUninit::<usize>::uninit();
        // SAFETY: valid out-pointers, read only after success.
        unsafe {
            check((self.mem_get_info)(free.as_mut_ptr(), total.as_mut_ptr()))?;
            Ok((free.assume_init(), total.assume_init()))
        }
    }

    /// `cuMemGetAllocationGranularity`.
    pub(crate) fn granularity(
        &self,
        prop: &CUmemAllocationProp,
        option: CUmemAllocationGranularity_flags,
    ) -> CuResult<usize> {
        let mut g = MaybeUninit::<usize>::uninit();
        // SAFETY: `prop` is a valid, initialised struct for the call; valid out-pointer.
        unsafe {
            check((self.mem_get_allocation_granularity)(
                g.as_mut_ptr(),
                prop,
                option,
            ))?;
            Ok(g.assume_init())
        }
    }

    /// `cuMemAddressReserve(size, alignment, hint, flags = 0)`.
    pub(crate) fn address_reserve(
        &self,
        size: usize,
        alignment: usize,
        hint: CUdeviceptr,
    ) -> CuResult<CUdeviceptr> {
        let mut p = MaybeUninit::<CUdeviceptr>::uninit();
        // SAFETY: valid out-pointer, read only after success; the rest are integers.
        unsafe {
            check((self.mem_address_reserve)(
                p.as_mut_ptr(),
                size,
                alignment,
                hint,
                0,
            ))?;
            Ok(p.assume_init())
        }
    }

    /// `cuMemAddressFree`.
    pub(crate) fn address_free(&self, ptr: CUdeviceptr, size: usize) -> CuResult<()> {
        // SAFETY: device address and size are integers the driver validates.
        check(unsafe { (self.mem_address_free)(ptr, size) })
    }

    /// `cuMemCreate(size, prop, flags = 0)`.
    pub(crate) fn mem_create(
        &self,
        size: usize,
        prop: &CUmemAllocationProp,
    ) -> CuResult<CUmemGenericAllocationHandle> {
        let mut h = MaybeUninit::<CUmemGenericAllocationHandle>::uninit();
        // SAFETY: valid out-pointer, read only after success; `prop` is initialised.
        unsafe {
            check((self.mem_create)(h.as_mut_ptr(), size, prop, 0))?;
            Ok(h.assume_init())
        }
    }

    /// `cuMemRelease`.
    pub(crate) fn mem_release(&self, handle: CUmemGenericAllocationHandle) -> CuResult<()> {
        // SAFETY: the handle is an integer the driver validates.
        check(unsafe { (self.mem_release)(handle) })
    }

    /// `cuMemMap(ptr, size, offset = 0, handle, flags = 0)`.
    pub(crate) fn mem_map(
        &self,
        ptr: CUdeviceptr,
        size: usize,
        handle: CUmemGenericAllocationHandle,
    ) -> CuResult<()> {
        // SAFETY: integers the driver validates.
        check(unsafe { (self.mem_map)(ptr, size, 0, handle, 0) })
    }

    /// `cuMemSetAccess` with a descriptor array.
    pub(crate) fn mem_set_access(
        &self,
        ptr: CUdeviceptr,
        size: usize,
        desc: &[CUmemAccessDesc],
    ) -> CuResult<()> {
        // SAFETY: `desc` points to `desc.len()` initialised descriptors for the call.
        check(unsafe { (self.mem_set_access)(ptr, size, desc.as_ptr(), desc.len()) })
    }

    /// `cuMemUnmap`.
    pub(crate) fn mem_unmap(&self, ptr: CUdeviceptr, size: usize) -> CuResult<()> {
        // SAFETY: integers the driver validates.
        check(unsafe { (self.mem_unmap)(ptr, size) })
    }

    /// `cuMemcpyHtoD_v2` (synchronous).
    pub(crate) fn memcpy_htod(&self, dst: CUdeviceptr, src: &[u8]) -> CuResult<()> {
        // SAFETY: `src` is readable for `src.len()` bytes during the (synchronous) copy.
        check(unsafe { (self.memcpy_htod)(dst, src.as_ptr().cast::<c_void>(), src.len()) })
    }

    /// `cuMemcpyDtoH_v2` (synchronous).
    pub(crate) fn memcpy_dtoh(&self, dst: &mut [u8], src: CUdeviceptr) -> CuResult<()> {
        // SAFETY: `dst` is writable for `dst.len()` bytes during the (synchronous) copy, and
        // any byte pattern is a valid `u8`.
        check(unsafe { (self.memcpy_dtoh)(dst.as_mut_ptr().cast::<c_void>(), src, dst.len()) })
    }

    /// `cuMemExportToShareableHandle` as a POSIX file descriptor (returned raw: the caller
    /// takes ownership).
    pub(crate) fn export_posix_fd(&self, handle: CUmemGenericAllocationHandle) -> CuResult<c_int> {
        let mut fd = MaybeUninit::<c_int>::uninit();
        // SAFETY: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the driver writes one `int`
        // through the pointer; it is read only after success.
        unsafe {
            check((self.mem_export_to_shareable_handle)(
                fd.as_mut_ptr().cast::<c_void>(),
                handle,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            ))?;
            Ok(fd.assume_init())
        }
    }

    /// `cuMemImportFromShareableHandle` of a POSIX file descriptor. The driver does not take
    /// ownership of `fd`.
    pub(crate) fn import_posix_fd(&self, fd: c_int) -> CuResult<CUmemGenericAllocationHandle> {
        let mut h = MaybeUninit::<CUmemGenericAllocationHandle>::uninit();
        // The POSIX-FD handle is passed by value, cast to a pointer, as cuda.h documents
        // (`(void *)(uintptr_t) fd`). A negative fd is rejected by the driver.
        let os_handle = fd as isize as *mut c_void;
        // SAFETY: valid out-pointer, read only after success; `os_handle` is not dereferenced
        // for this handle type.
        unsafe {
            check((self.mem_import_from_shareable_handle)(
                h.as_mut_ptr(),
                os_handle,
                CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            ))?;
            Ok(h.assume_init())
        }
    }

    /// `cuMemAlloc_v2` in the current context.
    pub(crate) fn mem_alloc(&self, size: usize) -> CuResult<CUdeviceptr> {
        let mut p = MaybeUninit::<CUdeviceptr>::uninit();
        // SAFETY: valid out-pointer, read only after success.
        unsafe {
            check((self.mem_alloc)(p.as_mut_ptr(), size))?;
            Ok(p.assume_init())
        }
    }

    /// `cuMemcpyDtoD_v2` of `bytes` bytes (synchronous with respect to the host for
    /// device-to-device copies only once the context is synchronized).
    pub(crate) fn memcpy_dtod(
        &self,
        dst: CUdeviceptr,
        src: CUdeviceptr,
        bytes: usize,
    ) -> CuResult<()> {
        // SAFETY: integer device addresses the driver validates; no host memory is touched.
        check(unsafe { (self.memcpy_dtod)(dst, src, bytes) })
    }

    /// `cuMemFree_v2`.
    pub(crate) fn mem_free(&self, ptr: CUdeviceptr) -> CuResult<()> {
        // SAFETY: an integer address the driver validates.
        check(unsafe { (self.mem_free)(ptr) })
    }

    /// `cuModuleLoadData` of a NUL-terminated PTX image, in the current context.
    pub(crate) fn module_load_data(&self, image: &CStr) -> CuResult<CUmodule> {
        let mut m = MaybeUninit::<CUmodule>::uninit();
        // SAFETY: `image` is a NUL-terminated PTX text that lives across the call (the
        // driver copies it); valid out-pointer, read only after success.
        unsafe {
            check((self.module_load_data)(
                m.as_mut_ptr(),
                image.as_ptr().cast::<c_void>(),
            ))?;
            Ok(m.assume_init())
        }
    }

    /// `cuModuleUnload`.
    ///
    /// # Safety
    /// `module` must be a loaded module, not used again afterwards.
    pub(crate) unsafe fn module_unload(&self, module: CUmodule) -> CuResult<()> {
        // SAFETY: the caller guarantees that `module` is loaded and no longer used.
        check(unsafe { (self.module_unload)(module) })
    }

    /// `cuModuleGetFunction`.
    ///
    /// # Safety
    /// `module` must be a loaded module.
    pub(crate) unsafe fn module_function(
        &self,
        module: CUmodule,
        name: &CStr,
    ) -> CuResult<CUfunction> {
        let mut f = MaybeUninit::<CUfunction>::uninit();
        // SAFETY: `module` is loaded (caller); `name` is NUL-terminated; valid out-pointer.
        unsafe {
            check((self.module_get_function)(
                f.as_mut_ptr(),
                module,
                name.as_ptr(),
            ))?;
            Ok(f.assume_init())
        }
    }

    /// Loads the PTX `image` in the current context and resolves the kernels `names`; when
    /// one cannot be resolved the module is unloaded again and the code returned.
    pub(crate) fn module_load_functions<const N: usize>(
        &self,
        image: &CStr,
        names: [&CStr; N],
    ) -> CuResult<(CUmodule, [CUfunction; N])> {
        let module = self.module_load_data(image)?;
        let mut functions = [ptr::null_mut(); N];
        for (f, name) in functions.iter_mut().zip(names) {
            // SAFETY: `module` was just loaded and is not unloaded before this call.
            match unsafe { self.module_function(module, name) } {
                Ok(function) => *f = function,
                Err(code) => {
                    // SAFETY: the module is loaded and nothing refers to it.
                    let _ = unsafe { self.module_unload(module) };
                    return Err(code);
                }
            }
        }
        Ok((module, functions))
    }

    /// `cuLaunchKernel` on the default stream with a 1-D grid and no shared memory.
    ///
    /// # Safety
    /// `function` must come from a loaded module of the current context, and `params` must
    /// point to one value of exactly the kernel's parameter type per kernel parameter.
    pub(crate) unsafe fn launch(
        &self,
        function: CUfunction,
        grid: c_uint,
        block: c_uint,
        params: &mut [*mut c_void],
    ) -> CuResult<()> {
        // SAFETY: the caller's guarantees; the null stream is the default stream.
        unsafe { self.launch_on(function, grid, block, ptr::null_mut(), params) }
    }

    /// `cuLaunchKernel` on `stream` with a 1-D grid and no shared memory.
    ///
    /// # Safety
    /// As [`launch`](Self::launch); `stream` is null or a live stream of the current context.
    pub(crate) unsafe fn launch_on(
        &self,
        function: CUfunction,
        grid: c_uint,
        block: c_uint,
        stream: CUstream,
        params: &mut [*mut c_void],
    ) -> CuResult<()> {
        // SAFETY: the caller guarantees the function, the stream and the parameter list; the
        // driver copies the parameter values during the call.
        check(unsafe {
            (self.launch_kernel)(
                function,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        })
    }
}
