//! Thin wrappers over [`HipApi`]: one per entry point, out-parameters in, `Result` out, every
//! `unsafe` call here with its reason. `Err` carries the raw code; `backend/` names and
//! classifies it (`error.rs`).

use std::ffi::{c_char, c_int, c_void, CStr};

use super::{HipApi, HipMemAccessDesc, HipMemAllocationProp};
use crate::error::{self, HipErrorCode, HIP_ERROR_UNKNOWN, HIP_SUCCESS};

/// The result of one HIP call.
pub(crate) type HipResult<T> = Result<T, HipErrorCode>;

fn check(rc: HipErrorCode) -> HipResult<()> {
    if rc == HIP_SUCCESS {
        Ok(())
    } else {
        Err(rc)
    }
}

/// The name of `rc`: our table, else `hipGetErrorName`, else `hipError(<n>)`.
pub fn error_name(api: &HipApi, rc: HipErrorCode) -> String {
    if let Some(name) = error::code_name(rc) {
        return name.to_owned();
    }
    if let Some(f) = api.get_error_name {
        // SAFETY: hipGetErrorName returns a pointer to a static NUL-terminated string (or
        // null); it is checked for null before it is read.
        let p = unsafe { f(rc) };
        if !p.is_null() {
            // SAFETY: non-null, NUL-terminated, static (see above).
            let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
            // Runtimes name every code they do not know "hipErrorUnknown": say the number.
            if !s.is_empty() && (s != "hipErrorUnknown" || rc == HIP_ERROR_UNKNOWN) {
                return s;
            }
        }
    }
    error::unnamed(rc)
}

impl HipApi {
    /// `hipInit(flags)`.
    pub(crate) fn call_init(&self, flags: u32) -> HipResult<()> {
        // SAFETY: hipInit takes flags by value.
        check(unsafe { (self.init)(flags) })
    }

    /// `hipGetDeviceCount`: the count, and the call's own code (`open` reads both).
    pub(crate) fn call_get_device_count(&self) -> (HipErrorCode, c_int) {
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-parameter for the duration of the call.
        let rc = unsafe { (self.get_device_count)(&mut count) };
        (rc, count)
    }

    /// `hipRuntimeGetVersion`.
    pub(crate) fn call_runtime_get_version(&self) -> HipResult<c_int> {
        let mut raw: c_int = 0;
        // SAFETY: `raw` is a valid out-parameter for the duration of the call.
        check(unsafe { (self.runtime_get_version)(&mut raw) })?;
        Ok(raw)
    }

    /// `hipDriverGetVersion`, when exported.
    pub(crate) fn call_driver_get_version(&self) -> Option<HipResult<c_int>> {
        let f = self.driver_get_version?;
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-parameter for the duration of the call.
        Some(check(unsafe { f(&mut v) }).map(|()| v))
    }

    /// `hipSetDevice(ordinal)`.
    pub(crate) fn call_set_device(&self, ordinal: c_int) -> HipResult<()> {
        // SAFETY: hipSetDevice takes the ordinal by value.
        check(unsafe { (self.set_device)(ordinal) })
    }

    /// `hipDeviceSynchronize()` on the thread's current device.
    pub(crate) fn call_device_synchronize(&self) -> HipResult<()> {
        // SAFETY: no arguments.
        check(unsafe { (self.device_synchronize)() })
    }

    /// `hipDeviceGetName` of `ordinal`, read from a 256-byte buffer.
    pub(crate) fn call_device_get_name(&self, ordinal: c_int) -> HipResult<String> {
        let mut buf = [0u8; 256];
        let len = c_int::try_from(buf.len()).unwrap_or(c_int::MAX);
        // SAFETY: `buf` is writable for `len` bytes; the runtime NUL-terminates within it.
        check(unsafe { (self.device_get_name)(buf.as_mut_ptr().cast::<c_char>(), len, ordinal) })?;
        if let Some(last) = buf.last_mut() {
            *last = 0;
        }
        Ok(CStr::from_bytes_until_nul(&buf)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default())
    }

    /// `hipDeviceCanAccessPeer`: whether `device` can access the memory of `peer`; `None`
    /// when the runtime does not export it.
    pub(crate) fn call_device_can_access_peer(
        &self,
        device: c_int,
        peer: c_int,
    ) -> Option<HipResult<bool>> {
        let f = self.device_can_access_peer?;
        let mut can: c_int = 0;
        // SAFETY: `can` is a valid out-parameter for the duration of the call.
        let rc = unsafe { f(&mut can, device, peer) };
        Some(check(rc).map(|()| can != 0))
    }

    /// `hipDeviceTotalMem` of `ordinal`.
    pub(crate) fn call_device_total_mem(&self, ordinal: c_int) -> HipResult<usize> {
        let mut total: usize = 0;
        // SAFETY: `total` is a valid out-parameter for the duration of the call.
        check(unsafe { (self.device_total_mem)(&mut total, ordinal) })?;
        Ok(total)
    }

    /// `hipMemGetInfo` on the thread's current device: `(free, total)`.
    pub(crate) fn call_mem_get_info(&self) -> HipResult<(usize, usize)> {
        let (mut free, mut total): (usize, usize) = (0, 0);
        // SAFETY: both out-parameters are valid for the duration of the call.
        check(unsafe { (self.mem_get_info)(&mut free, &mut total) })?;
        Ok((free, total))
    }

    /// `hipMemGetAllocationGranularity(prop, flag)`.
    pub(crate) fn call_mem_get_allocation_granularity(
        &self,
        prop: &HipMemAllocationProp,
        flag: u32,
    ) -> HipResult<usize> {
        let mut g: usize = 0;
        // SAFETY: `g` is a valid out-parameter; `prop` is a live hipMemAllocationProp in the
        // layout of the loaded runtime.
        check(unsafe { (self.mem_get_allocation_granularity)(&mut g, prop.as_ptr(), flag) })?;
        Ok(g)
    }

    /// `hipMemAddressReserve(size, alignment, hint, 0)`.
    pub(crate) fn call_mem_address_reserve(
        &self,
        size: usize,
        alignment: usize,
        hint: *mut c_void,
    ) -> HipResult<*mut c_void> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-parameter; the hint is only an address value.
        check(unsafe { (self.mem_address_reserve)(&mut ptr, size, alignment, hint, 0) })?;
        Ok(ptr)
    }

    /// `hipMemAddressFree(ptr, size)`.
    pub(crate) fn call_mem_address_free(&self, ptr: *mut c_void, size: usize) -> HipResult<()> {
        // SAFETY: the runtime validates the range; no Rust memory is involved.
        check(unsafe { (self.mem_address_free)(ptr, size) })
    }

    /// `hipMemCreate(size, prop, 0)`.
    pub(crate) fn call_mem_create(
        &self,
        size: usize,
        prop: &HipMemAllocationProp,
    ) -> HipResult<*mut c_void> {
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: `handle` is a valid out-parameter; `prop` is a live hipMemAllocationProp in
        // the layout of the loaded runtime.
        check(unsafe { (self.mem_create)(&mut handle, size, prop.as_ptr(), 0) })?;
        Ok(handle)
    }

    /// `hipMemRelease(handle)`.
    pub(crate) fn call_mem_release(&self, handle: *mut c_void) -> HipResult<()> {
        // SAFETY: the handle is an opaque runtime value; the runtime validates it.
        check(unsafe { (self.mem_release)(handle) })
    }

    /// `hipMemMap(ptr, size, 0, handle, 0)`.
    pub(crate) fn call_mem_map(
        &self,
        ptr: *mut c_void,
        size: usize,
        handle: *mut c_void,
    ) -> HipResult<()> {
        // SAFETY: address and handle are opaque runtime values; the runtime validates them.
        check(unsafe { (self.mem_map)(ptr, size, 0, handle, 0) })
    }

    /// `hipMemSetAccess(ptr, size, descs)`.
    pub(crate) fn call_mem_set_access(
        &self,
        ptr: *mut c_void,
        size: usize,
        descs: &[HipMemAccessDesc],
    ) -> HipResult<()> {
        // SAFETY: `descs` holds `descs.len()` initialised hipMemAccessDesc for the call.
        check(unsafe { (self.mem_set_access)(ptr, size, descs.as_ptr(), descs.len()) })
    }

    /// `hipMemUnmap(ptr, size)`.
    pub(crate) fn call_mem_unmap(&self, ptr: *mut c_void, size: usize) -> HipResult<()> {
        // SAFETY: the runtime validates the range; no Rust memory is involved.
        check(unsafe { (self.mem_unmap)(ptr, size) })
    }

    /// `hipMemcpyHtoD(dst, src, src.len())`.
    pub(crate) fn call_memcpy_htod(&self, dst: *mut c_void, src: &[u8]) -> HipResult<()> {
        // SAFETY: `src` is readable for `src.len()` bytes for the whole (synchronous) call;
        // HIP declares the source `void*` but only reads it.
        check(unsafe {
            (self.memcpy_htod)(dst, src.as_ptr().cast_mut().cast::<c_void>(), src.len())
        })
    }

    /// `hipMemcpyDtoH(dst, src, dst.len())`.
    pub(crate) fn call_memcpy_dtoh(&self, dst: &mut [u8], src: *mut c_void) -> HipResult<()> {
        let len = dst.len();
        // SAFETY: `dst` is writable for `len` bytes for the whole (synchronous) call.
        check(unsafe { (self.memcpy_dtoh)(dst.as_mut_ptr().cast::<c_void>(), src, len) })
    }

    /// `hipMemExportToShareableHandle(&fd, handle, POSIX fd, 0)`; `None` when not exported.
    pub(crate) fn call_export_posix_fd(
        &self,
        handle: *mut c_void,
        handle_type: u32,
    ) -> Option<HipResult<c_int>> {
        let export = self.mem_export_to_shareable_handle?;
        let mut fd: c_int = -1;
        // SAFETY: for hipMemHandleTypePosixFileDescriptor the runtime writes one `int` through
        // the first argument, which points to `fd`.
        let rc = unsafe {
            export(
                (&mut fd as *mut c_int).cast::<c_void>(),
                handle,
                handle_type,
                0,
            )
        };
        Some(check(rc).map(|()| fd))
    }

    /// `hipMemImportFromShareableHandle(&handle, os_handle, POSIX fd)`; `None` when not
    /// exported.
    pub(crate) fn call_import_posix_fd(
        &self,
        os_handle: *mut c_void,
        handle_type: u32,
    ) -> Option<HipResult<*mut c_void>> {
        let import = self.mem_import_from_shareable_handle?;
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: `handle` is a valid out-parameter; `os_handle` is a value, not dereferenced.
        let rc = unsafe { import(&mut handle, os_handle, handle_type) };
        Some(check(rc).map(|()| handle))
    }
}
