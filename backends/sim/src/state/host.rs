//! The host tier's calls: page-locked host buffers (their bytes in a `ChunkStore`, only where
//! written), copies between them and mapped device memory (checked in full before any byte
//! moves, done at once: the simulated device has no queue), and events (complete when
//! recorded, since every copy is).

use std::collections::{BTreeMap, BTreeSet};

use kvvm_hal::{
    BackendError, DeviceId, EventHandle, HostBuffer, HostCopy, Operation, StreamHandle,
};

use super::{invalid, State};
use crate::store::ChunkStore;

/// The host tier's part of the simulated driver.
#[derive(Debug, Default)]
pub(crate) struct HostState {
    /// Live buffers: their size and written bytes.
    buffers: BTreeMap<u64, (u64, ChunkStore)>,
    next_buffer: u64,
    /// Live events.
    events: BTreeSet<u64>,
    next_event: u64,
}

impl HostState {
    /// Live buffers and their sizes, by buffer.
    pub(crate) fn buffers(&self) -> Vec<(HostBuffer, u64)> {
        self.buffers
            .iter()
            .map(|(b, (n, _))| (HostBuffer(*b), *n))
            .collect()
    }

    /// Live events.
    pub(crate) fn event_count(&self) -> usize {
        self.events.len()
    }

    /// Host bytes the buffers' written data holds.
    pub(crate) fn stored_bytes(&self) -> u64 {
        self.buffers
            .values()
            .map(|(_, d)| d.stored_bytes())
            .fold(0u64, u64::saturating_add)
    }
}

impl State {
    pub(crate) fn host_alloc(
        &mut self,
        device: DeviceId,
        bytes: u64,
    ) -> Result<HostBuffer, BackendError> {
        self.device(Operation::HostAlloc, device)?;
        if bytes == 0 {
            return Err(invalid(Operation::HostAlloc, "a host buffer of 0 bytes"));
        }
        let h = &mut self.host;
        h.next_buffer = h.next_buffer.saturating_add(1);
        let id = h.next_buffer;
        h.buffers.insert(id, (bytes, ChunkStore::default()));
        Ok(HostBuffer(id))
    }

    pub(crate) fn host_free(&mut self, buffer: HostBuffer) -> Result<(), BackendError> {
        match self.host.buffers.remove(&buffer.0) {
            Some(_) => Ok(()),
            None => Err(invalid(
                Operation::HostFree,
                format!("{buffer} is not a live host buffer"),
            )),
        }
    }

    /// The size of `copy`'s buffer once its host range is checked inside it.
    fn check_host_range(&self, op: Operation, copy: &HostCopy) -> Result<(), BackendError> {
        copy.check(op)?;
        match self.host.buffers.get(&copy.host.0) {
            Some((size, _)) if copy.host_end() <= *size => Ok(()),
            Some((size, _)) => Err(invalid(
                op,
                format!(
                    "{} bytes at {} are past the end of {} ({size} bytes)",
                    copy.bytes, copy.offset, copy.host
                ),
            )),
            None => Err(invalid(
                op,
                format!("{} is not a live host buffer", copy.host),
            )),
        }
    }

    /// A copy between a mapping and a live buffer (`to_host`: from the mapping into the
    /// buffer), both ranges checked before any byte moves.
    pub(crate) fn host_copy(&mut self, copy: &HostCopy, to_host: bool) -> Result<(), BackendError> {
        let op = if to_host {
            Operation::CopyToHost
        } else {
            Operation::CopyFromHost
        };
        self.check_host_range(op, copy)?;
        let pieces = self.pieces(op, copy.device.0, copy.bytes, !to_host)?;
        let len =
            kvvm_num::to_usize(copy.bytes, "copy bytes").map_err(|e| invalid(op, e.to_string()))?;
        let mut bytes = vec![0u8; len];
        if to_host {
            self.read_pieces(&pieces, &mut bytes);
            if let Some((_, data)) = self.host.buffers.get_mut(&copy.host.0) {
                data.write(copy.offset, &bytes);
            }
        } else {
            if let Some((_, data)) = self.host.buffers.get(&copy.host.0) {
                data.read(copy.offset, &mut bytes);
            }
            self.write_pieces(&pieces, &bytes);
        }
        Ok(())
    }

    pub(crate) fn event_record(
        &mut self,
        device: DeviceId,
        _stream: StreamHandle,
    ) -> Result<EventHandle, BackendError> {
        self.device(Operation::Event, device)?;
        let h = &mut self.host;
        h.next_event = h.next_event.saturating_add(1);
        let id = h.next_event;
        h.events.insert(id);
        Ok(EventHandle(id))
    }

    /// Refuses an event that is not live; a live one is complete.
    pub(crate) fn check_event(&self, event: EventHandle) -> Result<(), BackendError> {
        if self.host.events.contains(&event.0) {
            Ok(())
        } else {
            Err(invalid(
                Operation::Event,
                format!("event {:#x} is not live", event.0),
            ))
        }
    }

    pub(crate) fn event_destroy(&mut self, event: EventHandle) -> Result<(), BackendError> {
        self.check_event(event)?;
        self.host.events.remove(&event.0);
        Ok(())
    }
}
