//! [`Recording`]: a backend that keeps its own books of what was created through it.

use std::collections::BTreeMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

use super::lock;

use crate::{
    AccessDescriptor, AllocationProperties, BackendResult, Capabilities, DeviceAddress, DeviceId,
    DeviceInfo, Granularity, KernelProbe, MemoryInfo, PhysicalHandle, RowCopy, StreamHandle,
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
            && self.anomalies.is_empty()
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
        let end = address.0.saturating_add(size);
        self.mappings
            .iter()
            .filter(|m| m.address.0 >= address.0 && m.address.0.saturating_add(m.size) <= end)
            .map(|m| m.size)
            .fold(0u64, u64::saturating_add)
    }
}

#[derive(Default)]
struct Books {
    ranges: BTreeMap<u64, u64>,
    handles: BTreeMap<u64, RecordedHandle>,
    mappings: BTreeMap<u64, RecordedMapping>,
    anomalies: Vec<String>,
}

impl Books {
    fn in_range(&self, address: u64, size: u64) -> bool {
        let end = address.saturating_add(size);
        self.ranges
            .range(..=address)
            .next_back()
            .is_some_and(|(&a, &s)| end <= a.saturating_add(s))
    }

    /// Mappings overlapping `[address, address + size)`.
    fn overlapping(&self, address: u64, size: u64) -> Vec<RecordedMapping> {
        let end = address.saturating_add(size);
        let mut out: Vec<RecordedMapping> = self
            .mappings
            .range(..end)
            .rev()
            .take_while(|(_, m)| m.address.0.saturating_add(m.size) > address)
            .map(|(_, m)| *m)
            .collect();
        out.reverse();
        out
    }

    fn drop_handle_if_dead(&mut self, handle: u64) {
        if self
            .handles
            .get(&handle)
            .is_some_and(|h| h.released && h.mappings == 0)
        {
            self.handles.remove(&handle);
        }
    }
}

/// A backend that books every range, handle and mapping created and destroyed through the
/// one it wraps (see the module docs of `decorate`). Only successful calls change the books;
/// a call that breaks the drivers' rules is noted as an anomaly whatever its result.
pub struct Recording {
    inner: Arc<dyn VirtualMemoryBackend>,
    books: Mutex<Books>,
}

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recording")
            .field("inner", &self.inner.name())
            .field("record", &self.record())
            .finish()
    }
}

impl Recording {
    /// Wraps `inner` with empty books.
    pub fn new(inner: Arc<dyn VirtualMemoryBackend>) -> Self {
        Recording {
            inner,
            books: Mutex::new(Books::default()),
        }
    }

    /// The backend underneath.
    pub fn inner(&self) -> &Arc<dyn VirtualMemoryBackend> {
        &self.inner
    }

    /// A copy of the books.
    pub fn record(&self) -> Record {
        let b = lock(&self.books);
        Record {
            ranges: b
                .ranges
                .iter()
                .map(|(&a, &s)| (DeviceAddress(a), s))
                .collect(),
            handles: b.handles.values().copied().collect(),
            mappings: b.mappings.values().copied().collect(),
            anomalies: b.anomalies.clone(),
        }
    }

    /// Takes the anomalies noted so far out of the books.
    pub fn take_anomalies(&self) -> Vec<String> {
        std::mem::take(&mut lock(&self.books).anomalies)
    }

    fn note(books: &mut Books, what: String) {
        tracing::warn!(anomaly = %what, "recording backend: a call broke the drivers' rules");
        books.anomalies.push(what);
    }
}

impl VirtualMemoryBackend for Recording {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn devices(&self) -> BackendResult<Vec<DeviceInfo>> {
        self.inner.devices()
    }

    fn memory_info(&self, device: DeviceId) -> BackendResult<MemoryInfo> {
        self.inner.memory_info(device)
    }

    fn granularity(&self, properties: &AllocationProperties) -> BackendResult<Granularity> {
        self.inner.granularity(properties)
    }

    fn reserve(
        &self,
        size: u64,
        alignment: u64,
        fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress> {
        let address = self.inner.reserve(size, alignment, fixed_address)?;
        let mut b = lock(&self.books);
        if b.in_range(address.0, 1) {
            Recording::note(
                &mut b,
                format!("reserve returned {address}, inside a live range"),
            );
        }
        b.ranges.insert(address.0, size);
        Ok(address)
    }

    fn free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        {
            let mut b = lock(&self.books);
            match b.ranges.get(&address.0) {
                None => Recording::note(&mut b, format!("free of {address}: no such range")),
                Some(&s) if s != size => Recording::note(
                    &mut b,
                    format!("free of {address}: {size} bytes, the range has {s}"),
                ),
                Some(_) => {
                    if !b.overlapping(address.0, size).is_empty() {
                        Recording::note(&mut b, format!("free of {address} under a live mapping"));
                    }
                }
            }
        }
        self.inner.free(address, size)?;
        lock(&self.books).ranges.remove(&address.0);
        Ok(())
    }

    fn create(
        &self,
        size: u64,
        properties: &AllocationProperties,
    ) -> BackendResult<PhysicalHandle> {
        let handle = self.inner.create(size, properties)?;
        let mut b = lock(&self.books);
        let fresh = RecordedHandle {
            handle,
            device: properties.device,
            size,
            released: false,
            mappings: 0,
        };
        if b.handles.insert(handle.0, fresh).is_some() {
            Recording::note(&mut b, format!("create returned {handle}, already live"));
        }
        Ok(handle)
    }

    fn release(&self, handle: PhysicalHandle) -> BackendResult<()> {
        {
            let mut b = lock(&self.books);
            match b.handles.get(&handle.0) {
                None => Recording::note(&mut b, format!("release of {handle}: not live")),
                Some(h) if h.released => {
                    Recording::note(&mut b, format!("second release of {handle}"))
                }
                Some(_) => {}
            }
        }
        self.inner.release(handle)?;
        let mut b = lock(&self.books);
        if let Some(h) = b.handles.get_mut(&handle.0) {
            h.released = true;
        }
        b.drop_handle_if_dead(handle.0);
        Ok(())
    }

    fn map(&self, address: DeviceAddress, size: u64, handle: PhysicalHandle) -> BackendResult<()> {
        {
            let mut b = lock(&self.books);
            if !b.in_range(address.0, size) {
                Recording::note(
                    &mut b,
                    format!("map at {address}: not inside a reserved range"),
                );
            }
            if !b.overlapping(address.0, size).is_empty() {
                Recording::note(&mut b, format!("map at {address}: over a live mapping"));
            }
            match b.handles.get(&handle.0) {
                None => Recording::note(&mut b, format!("map of {handle}: not live")),
                Some(h) if h.released => {
                    Recording::note(&mut b, format!("map of {handle}: already released"))
                }
                Some(_) => {}
            }
        }
        self.inner.map(address, size, handle)?;
        let mut b = lock(&self.books);
        b.mappings.insert(
            address.0,
            RecordedMapping {
                address,
                size,
                handle,
            },
        );
        if let Some(h) = b.handles.get_mut(&handle.0) {
            h.mappings = h.mappings.saturating_add(1);
        }
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
            let covered: u64 = b
                .overlapping(address.0, size)
                .iter()
                .map(|m| m.size)
                .fold(0u64, u64::saturating_add);
            if covered != size {
                Recording::note(
                    &mut b,
                    format!("set access over {size} bytes at {address}: {covered} mapped"),
                );
            }
        }
        self.inner.set_access(address, size, access)
    }

    fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        let end = address.0.saturating_add(size);
        let victims = {
            let mut b = lock(&self.books);
            let victims = b.overlapping(address.0, size);
            if victims
                .iter()
                .any(|m| m.address.0 < address.0 || m.address.0.saturating_add(m.size) > end)
            {
                Recording::note(&mut b, format!("unmap at {address}: part of a mapping"));
            }
            victims
        };
        self.inner.unmap(address, size)?;
        let mut b = lock(&self.books);
        for m in victims {
            b.mappings.remove(&m.address.0);
            if let Some(h) = b.handles.get_mut(&m.handle.0) {
                h.mappings = h.mappings.saturating_sub(1);
            }
            b.drop_handle_if_dead(m.handle.0);
        }
        Ok(())
    }

    fn synchronize(&self, device: DeviceId) -> BackendResult<()> {
        self.inner.synchronize(device)
    }

    fn copy_to_device(&self, dst: DeviceAddress, src: &[u8]) -> BackendResult<()> {
        self.inner.copy_to_device(dst, src)
    }

    fn copy_from_device(&self, dst: &mut [u8], src: DeviceAddress) -> BackendResult<()> {
        self.inner.copy_from_device(dst, src)
    }

    fn copy_rows_async(&self, copy: &RowCopy, stream: StreamHandle) -> BackendResult<()> {
        self.inner.copy_rows_async(copy, stream)
    }

    fn export_posix_fd(&self, handle: PhysicalHandle) -> BackendResult<OwnedFd> {
        self.inner.export_posix_fd(handle)
    }

    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> BackendResult<bool> {
        self.inner.can_access_peer(device, peer)
    }

    fn import_posix_fd(
        &self,
        device: DeviceId,
        fd: BorrowedFd<'_>,
    ) -> BackendResult<PhysicalHandle> {
        let handle = self.inner.import_posix_fd(device, fd)?;
        let mut b = lock(&self.books);
        let fresh = RecordedHandle {
            handle,
            device,
            size: 0,
            released: false,
            mappings: 0,
        };
        if b.handles.insert(handle.0, fresh).is_some() {
            Recording::note(&mut b, format!("import returned {handle}, already live"));
        }
        Ok(handle)
    }

    fn kernel_probe(&self) -> Option<&dyn KernelProbe> {
        self.inner.kernel_probe()
    }
}
