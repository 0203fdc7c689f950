//! The host tier's calls on CUDA: page-locked host memory (`cuMemHostAlloc`, portable to every
//! context), copies between it and device memory queued on a stream (`cuMemcpyDtoHAsync`,
//! `cuMemcpyHtoDAsync`), the backend's own copy stream per device (`CU_STREAM_NON_BLOCKING`,
//! made at the first need, destroyed with the backend), and events without timing.
//!
//! The driver cannot tell a host pointer from any other, and an asynchronous copy writes host
//! memory after the call returns: so the backend keeps the books of the buffers it allocated
//! and of the events it made (`TierBooks`), refuses with `InvalidValue` a copy whose host
//! range is not inside a live buffer and any unknown buffer or event, before calling the
//! driver. Freeing a buffer while a copy still uses it is the caller's error to avoid (its
//! event waited for first), as for device memory.

use kvvm_hal::sync::Unpoison;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use cudarc::driver::sys::{CUevent, CUstream};
use kvvm_hal::{
    BackendError, BackendResult, DeviceId, ErrorKind, EventHandle, HostBuffer, HostCopy, Operation,
    StreamHandle,
};

use super::{CudaBackend, Device};
use crate::conv::to_usize;
use crate::driver::streams::{EVENT_DISABLE_TIMING, HOST_ALLOC_PORTABLE, STREAM_NON_BLOCKING};

/// A stream the backend made (its copy stream of one device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OwnStream(pub(crate) CUstream);

// SAFETY: a CUDA stream is a driver object usable from any thread of the process with its
// context current (the driver API is thread-safe); the pointer is only an identifier handed
// back to the driver.
unsafe impl Send for OwnStream {}
// SAFETY: see `Send`; no interior state of its own.
unsafe impl Sync for OwnStream {}

/// The buffers and events this backend made and has not freed or destroyed.
#[derive(Debug, Default)]
pub(crate) struct TierBooks {
    /// Live buffers: base address and length.
    buffers: BTreeMap<u64, usize>,
    /// Live events.
    events: BTreeSet<u64>,
}

fn invalid(op: Operation, detail: String) -> BackendError {
    BackendError::raised(op, ErrorKind::InvalidValue, detail)
}

impl CudaBackend {
    fn tier_books(&self) -> MutexGuard<'_, TierBooks> {
        // Each update of the books is one step under the lock: recover from a poison.
        self.tier.lock().unpoisoned()
    }

    pub(crate) fn tier_host_alloc(
        &self,
        device: DeviceId,
        bytes: u64,
    ) -> BackendResult<HostBuffer> {
        let op = Operation::HostAlloc;
        self.make_device_current(op, device)?;
        let len = to_usize(op, "size", bytes)?;
        let p = self.check(op, self.driver.mem_host_alloc(len, HOST_ALLOC_PORTABLE))?;
        let base = p as usize as u64;
        self.tier_books().buffers.insert(base, len);
        Ok(HostBuffer(base))
    }

    pub(crate) fn tier_host_free(&self, buffer: HostBuffer) -> BackendResult<()> {
        let op = Operation::HostFree;
        let mut books = self.tier_books();
        if !books.buffers.contains_key(&buffer.0) {
            return Err(invalid(op, format!("{buffer} is not a live host buffer")));
        }
        self.any_context(op)?;
        let p = buffer.0 as usize as *mut c_void;
        // SAFETY: `p` is a live buffer of `mem_host_alloc` (the books say so; they are locked
        // until it leaves them), and the caller waited for every copy that used it.
        self.check(op, unsafe { self.driver.mem_free_host(p) })?;
        books.buffers.remove(&buffer.0);
        Ok(())
    }

    /// The host address of `copy`'s first byte, once its range is inside a live buffer.
    fn host_range(&self, op: Operation, copy: &HostCopy) -> BackendResult<usize> {
        copy.check(op)?;
        let books = self.tier_books();
        let Some(&len) = books.buffers.get(&copy.host.0) else {
            return Err(invalid(
                op,
                format!("{} is not a live host buffer", copy.host),
            ));
        };
        let end = to_usize(op, "end", copy.host_end())?;
        if end > len {
            return Err(invalid(
                op,
                format!(
                    "{} bytes at {} are past the end of {} ({len} bytes)",
                    copy.bytes, copy.offset, copy.host
                ),
            ));
        }
        let base = to_usize(op, "buffer", copy.host.0)?;
        let offset = to_usize(op, "offset", copy.offset)?;
        Ok(base.saturating_add(offset))
    }

    pub(crate) fn tier_copy(
        &self,
        copy: &HostCopy,
        stream: StreamHandle,
        to_host: bool,
    ) -> BackendResult<()> {
        let op = if to_host {
            Operation::CopyToHost
        } else {
            Operation::CopyFromHost
        };
        let host = self.host_range(op, copy)?;
        let n = to_usize(op, "size", copy.bytes)?;
        if n == 0 {
            return Ok(());
        }
        self.make_current(op, self.owner_device(op, copy.device)?)?;
        let stream = stream.0 as usize as CUstream;
        let p = host as *mut c_void;
        let r = if to_host {
            // SAFETY: `p` lies in a live page-locked buffer with `n` bytes after it (checked
            // above); the caller keeps the buffer until the copy's event is waited for; the
            // stream is 0 or a live stream of this context (`StreamHandle`'s contract).
            unsafe { self.driver.memcpy_dtoh_async(p, copy.device.0, n, stream) }
        } else {
            // SAFETY: as just above, the buffer read instead of written.
            unsafe { self.driver.memcpy_htod_async(copy.device.0, p, n, stream) }
        };
        self.check(op, r)
    }

    pub(crate) fn tier_copy_stream(&self, device: DeviceId) -> BackendResult<StreamHandle> {
        let op = Operation::Stream;
        let dev = self.device(op, device)?;
        let mut slot = dev.copy_stream.lock().unpoisoned();
        if let Some(s) = *slot {
            return Ok(StreamHandle(s.0 as usize as u64));
        }
        self.make_current(op, dev)?;
        let s = self.check(op, self.driver.stream_create(STREAM_NON_BLOCKING))?;
        *slot = Some(OwnStream(s));
        Ok(StreamHandle(s as usize as u64))
    }

    pub(crate) fn tier_event_record(
        &self,
        device: DeviceId,
        stream: StreamHandle,
    ) -> BackendResult<EventHandle> {
        let op = Operation::Event;
        self.make_device_current(op, device)?;
        let event = self.check(op, self.driver.event_create(EVENT_DISABLE_TIMING))?;
        let s = stream.0 as usize as CUstream;
        // SAFETY: `event` was just made in this context; the stream is 0 or a live stream of
        // it (`StreamHandle`'s contract).
        if let Err(code) = unsafe { self.driver.event_record(event, s) } {
            // SAFETY: the event was made just above and is not used again.
            let _ = unsafe { self.driver.event_destroy(event) };
            return Err(self.error(op, code));
        }
        let id = event as usize as u64;
        self.tier_books().events.insert(id);
        Ok(EventHandle(id))
    }

    /// The live event `event`, or `InvalidValue` (the driver cannot tell a destroyed one).
    fn live_event(&self, op: Operation, event: EventHandle) -> BackendResult<CUevent> {
        if self.tier_books().events.contains(&event.0) {
            Ok(event.0 as usize as CUevent)
        } else {
            Err(invalid(op, format!("event {:#x} is not live", event.0)))
        }
    }

    pub(crate) fn tier_event_query(&self, event: EventHandle) -> BackendResult<bool> {
        let op = Operation::Event;
        let e = self.live_event(op, event)?;
        self.any_context(op)?;
        // SAFETY: a live event of this backend (its books say so).
        self.check(op, unsafe { self.driver.event_query(e) })
    }

    pub(crate) fn tier_event_wait(&self, event: EventHandle) -> BackendResult<()> {
        let op = Operation::Event;
        let e = self.live_event(op, event)?;
        self.any_context(op)?;
        // SAFETY: a live event of this backend.
        self.check(op, unsafe { self.driver.event_synchronize(e) })
    }

    pub(crate) fn tier_stream_wait_event(
        &self,
        stream: StreamHandle,
        event: EventHandle,
    ) -> BackendResult<()> {
        let op = Operation::Event;
        let e = self.live_event(op, event)?;
        self.any_context(op)?;
        let s = stream.0 as usize as CUstream;
        // SAFETY: a live event of this backend; the stream is 0 or a live stream.
        self.check(op, unsafe { self.driver.stream_wait_event(s, e) })
    }

    pub(crate) fn tier_event_destroy(&self, event: EventHandle) -> BackendResult<()> {
        let op = Operation::Event;
        let mut books = self.tier_books();
        if !books.events.contains(&event.0) {
            return Err(invalid(op, format!("event {:#x} is not live", event.0)));
        }
        self.any_context(op)?;
        // SAFETY: a live event of this backend; it leaves the books (locked until then) and
        // is not used again.
        self.check(op, unsafe {
            self.driver.event_destroy(event.0 as usize as CUevent)
        })?;
        books.events.remove(&event.0);
        Ok(())
    }

    /// At teardown, with `device`'s context current: destroys its copy stream.
    pub(crate) fn drop_copy_stream(&self, device: &Device) {
        let stream = device.copy_stream.lock().unpoisoned().take();
        if let Some(s) = stream {
            // SAFETY: the stream was made in this context (current) and nothing uses it any
            // more: the backend is being dropped.
            if let Err(code) = unsafe { self.driver.stream_destroy(s.0) } {
                tracing::debug!(code = code.0, "cuStreamDestroy failed");
            }
        }
    }

    /// At teardown, with a context current: destroys the events and frees the buffers still
    /// live (as destroying a context would), so that nothing outlives the backend.
    pub(crate) fn drop_tier(&self) {
        let books = std::mem::take(&mut *self.tier_books());
        for e in books.events {
            // SAFETY: a live event of this backend, not used again.
            let _ = unsafe { self.driver.event_destroy(e as usize as CUevent) };
        }
        for (base, _) in books.buffers {
            // SAFETY: a live buffer of this backend; the backend is going away.
            let _ = unsafe { self.driver.mem_free_host(base as usize as *mut c_void) };
        }
    }
}

/// Empty books (what a new backend holds behind its mutex).
pub(crate) fn new_books() -> Mutex<TierBooks> {
    Mutex::new(TierBooks::default())
}
