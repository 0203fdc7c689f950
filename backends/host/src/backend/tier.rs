//! The host tier's calls on the host backend: its "device" memory is host memory already, so
//! a page-locked buffer is plain heap memory (zeroed, its pages allocated on first touch) and
//! a copy between it and a mapping is a `memcpy`, made at once under the bookkeeping's read
//! lock (the CPU has no queue); an event is complete when it is recorded. Every copy checks
//! that its device range is mapped with the access it needs and its host range lies inside a
//! live buffer before any byte moves, so no call touches memory that is neither.

use kvvm_hal::sync::Unpoison;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

use kvvm_hal::{
    BackendResult, DeviceId, EventHandle, HostBuffer, HostCopy, Operation, StreamHandle,
};

use super::HostBackend;
use crate::conv::{pointer, to_usize};
use crate::error::invalid;
use crate::state::State;

/// Page-locked buffers and events of a [`HostBackend`].
#[derive(Debug, Default)]
pub(crate) struct Tier {
    buffers: BTreeMap<u64, Box<[u8]>>,
    next_buffer: u64,
    events: BTreeSet<u64>,
    next_event: u64,
}

impl Tier {
    /// The bytes `[offset, offset + bytes)` of `copy`'s buffer, refused unless they lie inside
    /// a live buffer.
    fn range_mut(&mut self, op: Operation, copy: &HostCopy) -> BackendResult<&mut [u8]> {
        copy.check(op)?;
        let Some(buf) = self.buffers.get_mut(&copy.host.0) else {
            return Err(invalid(
                op,
                format!("{} is not a live host buffer", copy.host),
            ));
        };
        let start = to_usize(op, "offset", copy.offset)?;
        let end = to_usize(op, "end", copy.host_end())?;
        let len = buf.len();
        buf.get_mut(start..end).ok_or_else(|| {
            invalid(
                op,
                format!(
                    "{} bytes at {start} are past the end of {} ({len} bytes)",
                    copy.bytes, copy.host
                ),
            )
        })
    }

    /// Live buffers and their bytes.
    pub(crate) fn held(&self) -> (usize, u64, usize) {
        let bytes = self
            .buffers
            .values()
            .map(|b| b.len() as u64)
            .fold(0u64, u64::saturating_add);
        (self.buffers.len(), bytes, self.events.len())
    }
}

impl HostBackend {
    pub(crate) fn lock_tier(&self) -> MutexGuard<'_, Tier> {
        // Each update of the tier's books is one step under the lock: recover from a poison.
        self.tier.lock().unpoisoned()
    }

    pub(crate) fn tier_host_alloc(
        &self,
        device: DeviceId,
        bytes: u64,
    ) -> BackendResult<HostBuffer> {
        let op = Operation::HostAlloc;
        State::check_device(op, device)?;
        if bytes == 0 {
            return Err(invalid(op, "a host buffer of 0 bytes"));
        }
        let len = to_usize(op, "size", bytes)?;
        let buf = vec![0u8; len].into_boxed_slice();
        let mut t = self.lock_tier();
        t.next_buffer = t.next_buffer.saturating_add(1);
        let id = t.next_buffer;
        t.buffers.insert(id, buf);
        Ok(HostBuffer(id))
    }

    pub(crate) fn tier_host_free(&self, buffer: HostBuffer) -> BackendResult<()> {
        match self.lock_tier().buffers.remove(&buffer.0) {
            Some(_) => Ok(()),
            None => Err(invalid(
                Operation::HostFree,
                format!("{buffer} is not a live host buffer"),
            )),
        }
    }

    /// A copy between a mapping and a live buffer (`to_host`: from the mapping into the buffer),
    /// made at once once both ranges are checked.
    pub(crate) fn tier_copy(&self, copy: &HostCopy, to_host: bool) -> BackendResult<()> {
        let op = if to_host {
            Operation::CopyToHost
        } else {
            Operation::CopyFromHost
        };
        copy.check(op)?;
        let s = self.read();
        // Read access to copy from the mapping, write access to copy into it.
        s.check_range(op, copy.device.0, copy.bytes, Some(!to_host))?;
        let mut tier = self.lock_tier();
        let host = tier.range_mut(op, copy)?;
        if host.is_empty() {
            return Ok(());
        }
        let device = pointer(op, copy.device.0)?.cast::<u8>();
        if to_host {
            // SAFETY: every byte of `[device, device + bytes)` is mapped by this backend with
            // read access (checked above) and stays so while the read lock `s` is held, which
            // excludes unmap, set access and free; `host` is an exclusively borrowed slice of a
            // live buffer of `bytes` bytes (heap memory, never one of the backend's mappings),
            // and any byte value is a valid `u8`.
            unsafe { std::ptr::copy(device.cast_const(), host.as_mut_ptr(), host.len()) };
        } else {
            // SAFETY: every byte of `[device, device + bytes)` is mapped by this backend with
            // write access (checked above) and stays so under the read lock `s`; `host` is a
            // slice of a live buffer of `bytes` bytes, held under the tier's lock for the copy.
            unsafe { std::ptr::copy(host.as_ptr(), device, host.len()) };
        }
        Ok(())
    }

    pub(crate) fn tier_event_record(
        &self,
        device: DeviceId,
        _stream: StreamHandle,
    ) -> BackendResult<EventHandle> {
        State::check_device(Operation::Event, device)?;
        let mut t = self.lock_tier();
        t.next_event = t.next_event.saturating_add(1);
        let id = t.next_event;
        t.events.insert(id);
        Ok(EventHandle(id))
    }

    /// Refuses an event that is not live; a live one is complete (every copy was made at once).
    pub(crate) fn tier_check_event(&self, event: EventHandle) -> BackendResult<()> {
        live_event(self.lock_tier().events.contains(&event.0), event)
    }

    pub(crate) fn tier_event_destroy(&self, event: EventHandle) -> BackendResult<()> {
        live_event(self.lock_tier().events.remove(&event.0), event)
    }
}

/// `Ok` when the books found `event` (`live`), else the refusal of an event that is not live.
fn live_event(live: bool, event: EventHandle) -> BackendResult<()> {
    if live {
        Ok(())
    } else {
        Err(invalid(
            Operation::Event,
            format!("event {:#x} is not live", event.0),
        ))
    }
}

/// A new, empty tier (what [`HostBackend`] holds behind its mutex).
pub(crate) fn new_tier() -> Mutex<Tier> {
    Mutex::new(Tier::default())
}
