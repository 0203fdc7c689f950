//! The host tier's calls: page-locked host memory, copies between it and device memory on the
//! backend's copy stream, and the events that say they are done. A round trip device -> host
//! -> device is byte-exact; a host range outside its buffer, an unknown buffer or event, a
//! second free or destroy are `InvalidValue`; an event orders a stream after a copy. Skipped
//! on a backend without host copies (`Capabilities::host_copies`).

use kvvm_hal::{
    DeviceAddress, ErrorKind, EventHandle, HostBuffer, HostCopy, StreamHandle, VirtualMemoryBackend,
};

use crate::case::{at, ensure, expect_kind, pattern, read_back, Outcome, Verdict};
use crate::ctx::Ctx;

/// Buffers and events a case made, given back on drop (after the device is synchronized, so
/// that no copy still uses a buffer), so that a failing case leaves nothing behind.
struct Pinned<'a> {
    ctx: &'a Ctx<'a>,
    buffers: Vec<HostBuffer>,
    events: Vec<EventHandle>,
}

impl<'a> Pinned<'a> {
    fn new(ctx: &'a Ctx<'a>) -> Result<Self, Verdict> {
        if !ctx.backend.capabilities().host_copies {
            return Err(Verdict::Skip(format!(
                "backend {} has no page-locked host memory",
                ctx.backend.name()
            )));
        }
        Ok(Pinned {
            ctx,
            buffers: Vec::new(),
            events: Vec::new(),
        })
    }

    fn alloc(&mut self, bytes: u64) -> Result<HostBuffer, Verdict> {
        let b = self.ctx.backend.host_alloc(self.ctx.device, bytes)?;
        self.buffers.push(b);
        Ok(b)
    }

    /// An event after the work queued on `stream`, waited for.
    fn wait(&mut self, stream: StreamHandle) -> Outcome {
        let backend: &dyn VirtualMemoryBackend = self.ctx.backend;
        let e = backend.event_record(self.ctx.device, stream)?;
        self.events.push(e);
        backend.event_wait(e)?;
        ensure(backend.event_query(e)?, "a waited event is not complete")
    }
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        let b = self.ctx.backend;
        let _ = b.synchronize(self.ctx.device);
        for e in self.events.drain(..) {
            let _ = b.event_destroy(e);
        }
        for h in self.buffers.drain(..) {
            let _ = b.host_free(h);
        }
    }
}

pub(crate) fn host_copy_round_trip(ctx: &Ctx<'_>) -> Outcome {
    let mut p = Pinned::new(ctx)?;
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(2 * g)?;
    s.commit(va, 2 * g)?;
    let data = pattern(g as usize, 23);
    ctx.backend.copy_to_device(va, &data)?;
    ctx.backend
        .copy_to_device(at(va, g)?, &vec![0u8; g as usize])?;
    let buf = p.alloc(g + 512)?;
    let stream = ctx.backend.copy_stream(ctx.device)?;
    ensure(
        ctx.backend.copy_stream(ctx.device)? == stream,
        "the copy stream changed between two calls",
    )?;
    let out = HostCopy {
        device: va,
        host: buf,
        offset: 512,
        bytes: g,
    };
    ctx.backend.copy_to_host_async(&out, stream)?;
    let back = HostCopy {
        device: at(va, g)?,
        ..out
    };
    ctx.backend.copy_from_host_async(&back, stream)?;
    p.wait(stream)?;
    let got = read_back(ctx, at(va, g)?, g as usize)?;
    ensure(
        got == data,
        "the bytes differ after device -> host -> device",
    )
}

pub(crate) fn host_copy_outside_buffer_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let mut p = Pinned::new(ctx)?;
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(g)?;
    s.commit(va, g)?;
    let before = pattern(256, 5);
    ctx.backend.copy_to_device(va, &before)?;
    let buf = p.alloc(256)?;
    let stream = ctx.backend.copy_stream(ctx.device)?;
    let past = HostCopy {
        device: va,
        host: buf,
        offset: 128,
        bytes: 256,
    };
    expect_kind(
        ctx.backend.copy_to_host_async(&past, stream),
        ErrorKind::InvalidValue,
        "a copy into bytes past the buffer's end",
    )?;
    expect_kind(
        ctx.backend.copy_from_host_async(&past, stream),
        ErrorKind::InvalidValue,
        "a copy from bytes past the buffer's end",
    )?;
    let unknown = HostCopy {
        host: HostBuffer(buf.0 ^ 0x5a5a_0000),
        offset: 0,
        ..past
    };
    expect_kind(
        ctx.backend.copy_from_host_async(&unknown, stream),
        ErrorKind::InvalidValue,
        "a copy from a buffer that does not exist",
    )?;
    p.wait(stream)?;
    let got = read_back(ctx, va, 256)?;
    ensure(got == before, "a refused copy wrote device memory")
}

pub(crate) fn host_free_and_event_destroy_twice_are_invalid(ctx: &Ctx<'_>) -> Outcome {
    let _p = Pinned::new(ctx)?;
    let b = ctx.backend;
    let buf = b.host_alloc(ctx.device, 4096)?;
    b.host_free(buf)?;
    expect_kind(
        b.host_free(buf),
        ErrorKind::InvalidValue,
        "a second host free",
    )?;
    let e = b.event_record(ctx.device, StreamHandle(0))?;
    b.event_wait(e)?;
    b.event_destroy(e)?;
    expect_kind(
        b.event_destroy(e),
        ErrorKind::InvalidValue,
        "a second destroy",
    )?;
    expect_kind(
        b.event_query(e),
        ErrorKind::InvalidValue,
        "a query of a destroyed event",
    )
}

pub(crate) fn stream_waits_for_a_copy_event(ctx: &Ctx<'_>) -> Outcome {
    let mut p = Pinned::new(ctx)?;
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(2 * g)?;
    s.commit(va, 2 * g)?;
    let data = pattern(4096, 41);
    ctx.backend.copy_to_device(va, &data)?;
    let buf = p.alloc(4096)?;
    let stream = ctx.backend.copy_stream(ctx.device)?;
    let out = HostCopy {
        device: va,
        host: buf,
        offset: 0,
        bytes: 4096,
    };
    ctx.backend.copy_to_host_async(&out, stream)?;
    // The default stream waits, on the device, for the copy; then a copy on it reads the
    // buffer: it sees the bytes the first one wrote.
    let e = ctx.backend.event_record(ctx.device, stream)?;
    p.events.push(e);
    ctx.backend.stream_wait_event(StreamHandle(0), e)?;
    let back = HostCopy {
        device: at(va, g)?,
        ..out
    };
    ctx.backend.copy_from_host_async(&back, StreamHandle(0))?;
    p.wait(StreamHandle(0))?;
    let got = read_back(ctx, DeviceAddress(va.0 + g), 4096)?;
    ensure(
        got == data,
        "the copy ordered after the event read other bytes",
    )
}
