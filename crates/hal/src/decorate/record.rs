//! [`Recording`]: a backend that keeps its own books of what was created through it.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex};

use super::{lock, Forward};

use crate::model::{bytes_within, DriverModel};
use crate::{
    AccessDescriptor, AllocationProperties, BackendError, BackendResult, DeviceAddress, DeviceId,
    EventHandle, HostBuffer, HostCopy, Operation, PhysicalHandle, StreamHandle,
    VirtualMemoryBackend,
};

/// A live physical handle in a [`Record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordedHandle {
    /// The handle.
    pub handle: PhysicalHandle,
    /// The device it was created (or imported) on.
    pub device: DeviceId,
    /// Its size in bytes (0 for an imported handle, whose size the import does not say).
    pub size: u64,
    /// Whether it was released (it lives on while mapped).
    pub released: bool,
    /// How many live mappings map it.
    pub mappings: u64,
}

/// A live mapping in a [`Record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordedMapping {
    /// Where it is mapped.
    pub address: DeviceAddress,
    /// Its size.
    pub size: u64,
    /// The handle mapped there.
    pub handle: PhysicalHandle,
}

/// What a [`Recording`] backend knows is alive, and every call it saw that a driver would
/// refuse, that would leak, or that would free twice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    /// Reserved ranges `(address, size)`, by address.
    pub ranges: Vec<(DeviceAddress, u64)>,
    /// Live handles (created or imported, not yet both released and unmapped), by handle.
    pub handles: Vec<RecordedHandle>,
    /// Live mappings, by address.
    pub mappings: Vec<RecordedMapping>,
    /// Live page-locked host buffers `(buffer, bytes)`, by buffer.
    pub host_buffers: Vec<(HostBuffer, u64)>,
    /// Live events, by handle.
    pub events: Vec<EventHandle>,
    /// Calls that broke the drivers' rules: a second release or free, a map over a mapping
    /// or outside any range, an unmap of part of a mapping, a free under a mapping, ...
    pub anomalies: Vec<String>,
}

impl Record {
    /// Whether nothing is alive and nothing went wrong.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
            && self.handles.is_empty()
            && self.mappings.is_empty()
            && self.host_buffers.is_empty()
            && self.events.is_empty()
            && self.anomalies.is_empty()
    }

    /// Bytes of the live page-locked host buffers.
    pub fn host_bytes(&self) -> u64 {
        self.host_buffers
            .iter()
            .map(|(_, b)| *b)
            .fold(0u64, u64::saturating_add)
    }

    /// Bytes of the live handles.
    pub fn live_bytes(&self) -> u64 {
        self.handles
            .iter()
            .map(|h| h.size)
            .fold(0u64, u64::saturating_add)
    }

    /// Bytes of the live handles of `device`.
    pub fn live_bytes_on(&self, device: DeviceId) -> u64 {
        self.handles
            .iter()
            .filter(|h| h.device == device)
            .map(|h| h.size)
            .fold(0u64, u64::saturating_add)
    }

    /// Bytes mapped inside `[address, address + size)`.
    pub fn mapped_bytes_in(&self, address: DeviceAddress, size: u64) -> u64 {
        let spans = self.mappings.iter().map(|m| (m.address.0, m.size));
        bytes_within(spans, address.0, size)
    }
}

/// The recorder's books: the driver's state as the calls that succeeded left it, each
/// allocation kept with the handle it was made as, and the anomalies noted.
#[derive(Debug)]
struct Books {
    model: DriverModel<PhysicalHandle>,
    /// Live host buffers and their sizes.
    host: BTreeMap<u64, u64>,
    /// Live events.
    events: BTreeSet<u64>,
    anomalies: Vec<String>,
}

impl Books {
    fn note(&mut self, what: String) {
        tracing::warn!(anomaly = %what, "recording backend: a call broke the drivers' rules");
        self.anomalies.push(what);
    }

    /// Notes `what` with the reason a driver would refuse, if it would.
    fn note_refusal<T>(&mut self, what: impl std::fmt::Display, checked: BackendResult<T>) {
        if let Err(e) = checked {
            let why = e.detail.unwrap_or_else(|| e.kind.to_string());
            self.note(format!("{what}: {why}"));
        }
    }

    /// Whether an allocation made as `handle` is alive (released, and still mapped).
    fn released_but_mapped(&self, handle: PhysicalHandle) -> bool {
        self.model.find_allocation(|a| a.extra == handle).is_some()
    }

    fn record(&self) -> Record {
        let m = &self.model;
        let handle_of = |id| m.allocation(id).map_or(PhysicalHandle(0), |a| a.extra);
        let mut handles: Vec<RecordedHandle> = m
            .allocations()
            .map(|(_, a)| RecordedHandle {
                handle: a.extra,
                device: a.device,
                size: a.size,
                released: a.handles == 0,
                mappings: a.mappings,
            })
            .collect();
        handles.sort_by_key(|h| h.handle);
        Record {
            ranges: m.ranges().map(|(a, s)| (DeviceAddress(a), s)).collect(),
            handles,
            mappings: m
                .mappings()
                .map(|(a, map)| RecordedMapping {
                    address: DeviceAddress(a),
                    size: map.size,
                    handle: handle_of(map.allocation),
                })
                .collect(),
            host_buffers: self
                .host
                .iter()
                .map(|(b, n)| (HostBuffer(*b), *n))
                .collect(),
            events: self.events.iter().map(|e| EventHandle(*e)).collect(),
            anomalies: self.anomalies.clone(),
        }
    }

    /// Notes a host copy (`what`) whose host range is not inside a live buffer, or whose
    /// device range is not mapped whole.
    fn check_host_copy(&mut self, what: &str, copy: &HostCopy) {
        match self.host.get(&copy.host.0) {
            None => self.note(format!("{what} with {}: not live", copy.host)),
            Some(&size) if copy.offset.checked_add(copy.bytes).is_none_or(|e| e > size) => {
                self.note(format!(
                    "{what} of {} bytes at {} of {} ({size} bytes)",
                    copy.bytes, copy.offset, copy.host
                ));
            }
            Some(_) => {}
        }
        let spans = self.model.mappings().map(|(a, m)| (a, m.size));
        if bytes_within(spans, copy.device.0, copy.bytes) != copy.bytes {
            self.note(format!(
                "{what} over unmapped bytes: {} bytes at {}",
                copy.bytes, copy.device
            ));
        }
    }
}

/// A backend that books every range, handle and mapping created and destroyed through the
/// one it wraps (see the module docs of `decorate`). Only successful calls change the books;
/// a call that breaks the drivers' rules is noted as an anomaly whatever its result.
#[derive(Debug)]
pub struct Recording {
    inner: Arc<dyn VirtualMemoryBackend>,
    books: Mutex<Books>,
}

impl Recording {
    /// Wraps `inner` with empty books.
    pub fn new(inner: Arc<dyn VirtualMemoryBackend>) -> Self {
        let books = Books {
            model: DriverModel::new(0, BackendError::raised),
            host: BTreeMap::new(),
            events: BTreeSet::new(),
            anomalies: Vec::new(),
        };
        Recording {
            inner,
            books: Mutex::new(books),
        }
    }

    /// The backend underneath.
    pub fn inner(&self) -> &Arc<dyn VirtualMemoryBackend> {
        &self.inner
    }

    /// A copy of the books.
    pub fn record(&self) -> Record {
        lock(&self.books).record()
    }

    /// Takes the anomalies noted so far out of the books.
    pub fn take_anomalies(&self) -> Vec<String> {
        std::mem::take(&mut lock(&self.books).anomalies)
    }

    /// Books a handle the backend underneath made (created or imported, `how`).
    fn adopt(&self, how: &str, handle: PhysicalHandle, device: DeviceId, size: u64) {
        let mut b = lock(&self.books);
        if !b.model.adopt_handle(handle, device, size, handle, ()) {
            b.note(format!("{how} returned {handle}, already live"));
        }
    }
}

/// Each call that changes the driver's state is checked against the books (a refusal the
/// driver would make is noted), forwarded, and booked if it succeeded; the rest forward.
impl Forward for Recording {
    fn inner(&self) -> &dyn VirtualMemoryBackend {
        &*self.inner
    }

    fn reserve(
        &self,
        size: u64,
        alignment: u64,
        fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress> {
        let address = self.inner.reserve(size, alignment, fixed_address)?;
        let mut b = lock(&self.books);
        if b.model.range_containing(address.0).is_some() {
            b.note(format!("reserve returned {address}, inside a live range"));
        }
        b.model.insert_range(address.0, size);
        Ok(address)
    }

    /// The books stay locked across the driver's call, as in `release` and `unmap`.
    fn free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        let mut b = lock(&self.books);
        let checked = b.model.check_free(address, size);
        b.note_refusal(format_args!("free of {address}"), checked);
        self.inner.free(address, size)?;
        b.model.remove_range(address.0);
        Ok(())
    }

    fn create(
        &self,
        size: u64,
        properties: &AllocationProperties,
    ) -> BackendResult<PhysicalHandle> {
        let handle = self.inner.create(size, properties)?;
        self.adopt("create", handle, properties.device, size);
        Ok(handle)
    }

    /// The books stay locked across the driver's call: once the driver has released a handle
    /// it may hand the same value to a create on another thread at once, and that create must
    /// not find the value still live in the books (it waits for them instead).
    fn release(&self, handle: PhysicalHandle) -> BackendResult<()> {
        let mut b = lock(&self.books);
        if b.model.handle(Operation::Release, handle).is_err() {
            let what = if b.released_but_mapped(handle) {
                format!("second release of {handle}")
            } else {
                format!("release of {handle}: not live")
            };
            b.note(what);
        }
        self.inner.release(handle)?;
        // A handle the books do not know was noted above.
        let _ = b.model.release(handle);
        Ok(())
    }

    fn map(&self, address: DeviceAddress, size: u64, handle: PhysicalHandle) -> BackendResult<()> {
        {
            let mut b = lock(&self.books);
            let op = Operation::Map;
            let target = b.model.check_map_target(op, address, size);
            b.note_refusal(format_args!("map at {address}"), target);
            if b.model.handle(op, handle).is_err() {
                let why = if b.released_but_mapped(handle) {
                    "already released"
                } else {
                    "not live"
                };
                b.note(format!("map of {handle}: {why}"));
            }
        }
        self.inner.map(address, size, handle)?;
        lock(&self.books)
            .model
            .insert_mapping(address, size, handle);
        Ok(())
    }

    fn set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> BackendResult<()> {
        {
            let mut b = lock(&self.books);
            let end = address.0.saturating_add(size);
            let whole = b.model.whole_mappings(Operation::SetAccess, address.0, end);
            b.note_refusal(
                format_args!("set access over {size} bytes at {address}"),
                whole,
            );
        }
        self.inner.set_access(address, size, access)?;
        lock(&self.books).model.set_access(address, size, access);
        Ok(())
    }

    /// The books stay locked across the driver's call, as in `release`: a map of the same
    /// range on another thread right after the driver's unmap finds it unmapped in the books.
    fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        let mut b = lock(&self.books);
        let whole = b.model.check_unmap(address, size);
        b.note_refusal(format_args!("unmap at {address}"), whole);
        self.inner.unmap(address, size)?;
        b.model.unmap(address, size);
        Ok(())
    }

    fn import_posix_fd(
        &self,
        device: DeviceId,
        fd: BorrowedFd<'_>,
    ) -> BackendResult<PhysicalHandle> {
        let handle = self.inner.import_posix_fd(device, fd)?;
        // The import does not say the size: booked as 0 bytes.
        self.adopt("import", handle, device, 0);
        Ok(handle)
    }

    fn host_alloc(&self, device: DeviceId, bytes: u64) -> BackendResult<HostBuffer> {
        let buffer = self.inner.host_alloc(device, bytes)?;
        let mut b = lock(&self.books);
        if b.host.insert(buffer.0, bytes).is_some() {
            b.note(format!("host_alloc returned {buffer}, already live"));
        }
        Ok(buffer)
    }

    /// The books stay locked across the driver's call (as in `release`).
    fn host_free(&self, buffer: HostBuffer) -> BackendResult<()> {
        let mut b = lock(&self.books);
        if !b.host.contains_key(&buffer.0) {
            b.note(format!("host_free of {buffer}: not live"));
        }
        self.inner.host_free(buffer)?;
        b.host.remove(&buffer.0);
        Ok(())
    }

    fn copy_to_host_async(&self, copy: &HostCopy, stream: StreamHandle) -> BackendResult<()> {
        lock(&self.books).check_host_copy("copy to host", copy);
        self.inner.copy_to_host_async(copy, stream)
    }

    fn copy_from_host_async(&self, copy: &HostCopy, stream: StreamHandle) -> BackendResult<()> {
        lock(&self.books).check_host_copy("copy from host", copy);
        self.inner.copy_from_host_async(copy, stream)
    }

    fn event_record(&self, device: DeviceId, stream: StreamHandle) -> BackendResult<EventHandle> {
        let event = self.inner.event_record(device, stream)?;
        let mut b = lock(&self.books);
        if !b.events.insert(event.0) {
            b.note(format!(
                "event_record returned event {:#x}, already live",
                event.0
            ));
        }
        Ok(event)
    }

    fn event_destroy(&self, event: EventHandle) -> BackendResult<()> {
        let mut b = lock(&self.books);
        if !b.events.contains(&event.0) {
            b.note(format!("event_destroy of event {:#x}: not live", event.0));
        }
        self.inner.event_destroy(event)?;
        b.events.remove(&event.0);
        Ok(())
    }
}
