//! Thin wrappers of a host tier's driver calls: page-locked host memory, copies between it and
//! device memory queued on a stream, streams and events. A wrapper is `unsafe` when the
//! driver cannot validate what it is given: a host pointer it will write or read later (the
//! copy is asynchronous), or a stream or event it would dereference.

use std::ffi::{c_uint, c_void};
use std::mem::MaybeUninit;

use cudarc::driver::sys::{CUdeviceptr, CUevent, CUstream};

use super::Driver;
use crate::driver::CuResult;
use crate::error::CuCode;

/// `CU_MEMHOSTALLOC_PORTABLE`: the memory is page-locked for every context.
pub(crate) const HOST_ALLOC_PORTABLE: c_uint = 1;
/// `CU_STREAM_NON_BLOCKING`: the stream does not wait for the legacy default stream.
pub(crate) const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_DISABLE_TIMING`: an event that records no time (the cheapest kind).
pub(crate) const EVENT_DISABLE_TIMING: c_uint = 2;

fn check(code: u32) -> CuResult<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(CuCode(code))
    }
}

impl Driver {
    /// `cuMemHostAlloc(size, flags)`: page-locked host memory.
    pub(crate) fn mem_host_alloc(&self, size: usize, flags: c_uint) -> CuResult<*mut c_void> {
        let mut p = MaybeUninit::<*mut c_void>::uninit();
        // SAFETY: valid out-pointer, read only after success; integers the driver validates.
        unsafe {
            check((self.mem_host_alloc)(p.as_mut_ptr(), size, flags))?;
            Ok(p.assume_init())
        }
    }

    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// `p` must come from [`mem_host_alloc`](Self::mem_host_alloc), not be freed yet, and no
    /// copy may still use it.
    pub(crate) unsafe fn mem_free_host(&self, p: *mut c_void) -> CuResult<()> {
        // SAFETY: the caller's guarantees.
        check(unsafe { (self.mem_free_host)(p) })
    }

    /// `cuMemcpyDtoHAsync_v2`: queues a copy of `n` bytes from `src` into host memory at `dst`.
    ///
    /// # Safety
    /// `dst` must be page-locked memory writable for `n` bytes, and stay allocated and
    /// untouched by the host until the copy is done; `stream` null or a live stream of the
    /// current context.
    pub(crate) unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut c_void,
        src: CUdeviceptr,
        n: usize,
        stream: CUstream,
    ) -> CuResult<()> {
        // SAFETY: the caller's guarantees; the device address is an integer the driver
        // validates.
        check(unsafe { (self.memcpy_dtoh_async)(dst, src, n, stream) })
    }

    /// `cuMemcpyHtoDAsync_v2`: queues a copy of `n` bytes from host memory at `src` to `dst`.
    ///
    /// # Safety
    /// `src` must be page-locked memory readable for `n` bytes, and stay allocated and
    /// unwritten by the host until the copy is done; `stream` as for
    /// [`memcpy_dtoh_async`](Self::memcpy_dtoh_async).
    pub(crate) unsafe fn memcpy_htod_async(
        &self,
        dst: CUdeviceptr,
        src: *const c_void,
        n: usize,
        stream: CUstream,
    ) -> CuResult<()> {
        // SAFETY: the caller's guarantees.
        check(unsafe { (self.memcpy_htod_async)(dst, src, n, stream) })
    }

    /// `cuStreamCreate` in the current context.
    pub(crate) fn stream_create(&self, flags: c_uint) -> CuResult<CUstream> {
        let mut s = MaybeUninit::<CUstream>::uninit();
        // SAFETY: valid out-pointer, read only after success.
        unsafe {
            check((self.stream_create)(s.as_mut_ptr(), flags))?;
            Ok(s.assume_init())
        }
    }

    /// `cuStreamDestroy_v2`.
    ///
    /// # Safety
    /// `stream` must be a live stream made by [`stream_create`](Self::stream_create), not
    /// used afterwards.
    pub(crate) unsafe fn stream_destroy(&self, stream: CUstream) -> CuResult<()> {
        // SAFETY: the caller's guarantees.
        check(unsafe { (self.stream_destroy)(stream) })
    }

    /// `cuStreamWaitEvent(stream, event, 0)`.
    ///
    /// # Safety
    /// `stream` null or a live stream, `event` a live event, both of the current context.
    pub(crate) unsafe fn stream_wait_event(
        &self,
        stream: CUstream,
        event: CUevent,
    ) -> CuResult<()> {
        // SAFETY: the caller's guarantees.
        check(unsafe { (self.stream_wait_event)(stream, event, 0) })
    }

    /// `cuEventCreate` in the current context.
    pub(crate) fn event_create(&self, flags: c_uint) -> CuResult<CUevent> {
        let mut e = MaybeUninit::<CUevent>::uninit();
        // SAFETY: valid out-pointer, read only after success.
        unsafe {
            check((self.event_create)(e.as_mut_ptr(), flags))?;
            Ok(e.assume_init())
        }
    }

    /// `cuEventRecord`.
    ///
    /// # Safety
    /// `event` a live event and `stream` null or a live stream of the current context.
    pub(crate) unsafe fn event_record(&self, event: CUevent, stream: CUstream) -> CuResult<()> {
        // SAFETY: the caller's guarantees.
        check(unsafe { (self.event_record)(event, stream) })
    }

    /// `cuEventQuery`: `Ok(true)` when complete, `Ok(false)` on `CUDA_ERROR_NOT_READY`.
    ///
    /// # Safety
    /// `event` must be a live event.
    pub(crate) unsafe fn event_query(&self, event: CUevent) -> CuResult<bool> {
        // SAFETY: the caller's guarantees.
        match check(unsafe { (self.event_query)(event) }) {
            Ok(()) => Ok(true),
            Err(code) if code == CuCode::NOT_READY => Ok(false),
            Err(code) => Err(code),
        }
    }

    /// `cuEventSynchronize`.
    ///
    /// # Safety
    /// `event` must be a live event.
    pub(crate) unsafe fn event_synchronize(&self, event: CUevent) -> CuResult<()> {
        // SAFETY: the caller's guarantees.
        check(unsafe { (self.event_synchronize)(event) })
    }

    /// `cuEventDestroy_v2`.
    ///
    /// # Safety
    /// `event` must be a live event, not used afterwards.
    pub(crate) unsafe fn event_destroy(&self, event: CUevent) -> CuResult<()> {
        // SAFETY: the caller's guarantees.
        check(unsafe { (self.event_destroy)(event) })
    }
}
