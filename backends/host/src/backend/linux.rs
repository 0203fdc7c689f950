//! [`HostBackend`]: the [`VirtualMemoryBackend`] implementation over `mmap` and memfds.

use kvvm_hal::sync::Unpoison;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use kvvm_hal::{
    traced, AccessDescriptor, AllocationProperties, BackendError, BackendResult, Capabilities,
    DeviceAddress, DeviceId, DeviceInfo, ErrorKind, EventHandle, Granularity, HostBuffer, HostCopy,
    KernelProbe, MemoryInfo, Operation, PhysicalHandle, RowCopy, ShareableHandleType, StreamHandle,
    VirtualMemoryBackend,
};

use crate::conv::{align_up, is_multiple, pointer, protection, to_u64, to_usize};
use crate::error::invalid;
use crate::result;
use crate::state::{HostHandle, State};
use crate::{HostConfig, HostLedger};

/// The name memfds carry (`/proc/<pid>/maps` shows `/memfd:kvvm-host (deleted)`).
const MEMFD_NAME: &std::ffi::CStr = c"kvvm-host";

/// The host backend: the operating system's virtual memory behind the driver's interface
/// (see the crate documentation for the mapping of each call and its semantics).
///
/// One device, [`DeviceId`]`(0)`: the host's memory. Cheap to share behind an `Arc`; every
/// method takes `&self` and may be called from any thread. Dropping the backend unmaps every
/// range it still reserves and closes every memfd it still holds (as destroying a driver
/// context frees its memory); memory shared with another process lives on there.
pub struct HostBackend {
    state: RwLock<State>,
    /// Page-locked buffers and events of the host tier (`tier.rs`).
    pub(crate) tier: std::sync::Mutex<super::tier::Tier>,
    recommended: u64,
    populate: bool,
    info: DeviceInfo,
}

impl std::fmt::Debug for HostBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBackend")
            .field("device", &self.info)
            .field("recommended", &self.recommended)
            .field("populate", &self.populate)
            .field("ledger", &self.ledger())
            .finish()
    }
}

impl HostBackend {
    /// Opens the host backend with the default configuration (capacity: physical memory, or
    /// [`CAPACITY_ENV`](crate::CAPACITY_ENV) when set).
    ///
    /// Fails with [`ErrorKind::Unavailable`] when the kernel cannot create a memfd (Linux
    /// before 3.17, a seccomp filter, ...) or when the environment variable is not a size.
    pub fn open() -> Result<HostBackend, BackendError> {
        let config = HostConfig::from_env()
            .map_err(|reason| BackendError::unavailable(Operation::Load, reason))?;
        Self::with_config(config)
    }

    /// Opens the host backend with `config`.
    ///
    /// Fails with [`ErrorKind::Unavailable`] when memfds cannot be created here.
    pub fn with_config(config: HostConfig) -> Result<HostBackend, BackendError> {
        let _span = tracing::debug_span!("kvvm_host", op = "open").entered();
        let page = result::page_size();
        // A probe memfd: proves the calls exist (and are allowed) before anything relies on
        // them.
        let probe = result::memfd_create(MEMFD_NAME)
            .and_then(|fd| result::seal_size(&fd).map(|()| fd))
            .map_err(|e| {
                let cause = e.to_error(Operation::Load);
                BackendError {
                    kind: ErrorKind::Unavailable,
                    detail: Some(format!(
                        "memfd_create with sealing failed ({}): the host backend needs Linux 3.17 or newer",
                        cause.kind
                    )),
                    ..cause
                }
            })?;
        drop(probe);
        let capacity = config.capacity.unwrap_or_else(result::total_ram);
        if capacity == 0 {
            return Err(BackendError::unavailable(
                Operation::Load,
                "the capacity is 0 bytes",
            ));
        }
        let recommended = if is_multiple(config.recommended_granularity, page) {
            config.recommended_granularity
        } else {
            page
        };
        let (release, machine) = result::kernel();
        let info = DeviceInfo {
            id: DeviceId(0),
            name: format!("host memory ({machine}, memfd)"),
            total_memory: capacity,
            vmm_supported: true,
            posix_fd_supported: true,
            driver_version: format!("Linux {release}"),
        };
        tracing::debug!(page, capacity, recommended, %release, "opened");
        Ok(HostBackend {
            state: RwLock::new(State::new(page, capacity)),
            tier: super::tier::new_tier(),
            recommended,
            populate: config.populate,
            info,
        })
    }

    /// The bookkeeping, shared (copies, probes, queries).
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, State> {
        // A panic while holding the lock cannot happen on the paths that change the state
        // (no code there panics); recover rather than propagate a poison.
        self.state.read().unpoisoned()
    }

    /// The bookkeeping, exclusive (every call that changes mappings or handles).
    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unpoisoned()
    }

    /// What the backend holds right now; [`HostLedger::is_empty`] after a run that leaked
    /// nothing.
    pub fn ledger(&self) -> HostLedger {
        let (host_buffers, host_bytes, events) = self.lock_tier().held();
        HostLedger {
            host_buffers,
            host_bytes,
            events,
            ..self.read().ledger()
        }
    }

    /// Touches every page of the mapped, writable range `[address, address + len)` for
    /// writing (an atomic add of 0 to one byte a page: one write fault a page, as a first
    /// store would take, and the bytes keep their values), so that the kernel allocates the
    /// pages now. For benchmarks: the first touch of committed memory.
    pub fn touch_pages(&self, address: DeviceAddress, len: u64) -> BackendResult<()> {
        let op = Operation::CopyToDevice;
        let s = self.read();
        s.check_range(op, address.0, len, Some(true))?;
        let base = pointer(op, address.0)?.cast::<u8>();
        let page = to_usize(op, "page size", s.granule())?;
        let n = to_usize(op, "length", len)?;
        for offset in (0..n).step_by(page.max(1)) {
            // SAFETY: every byte of the range is mapped by this backend with write access
            // (checked above), and stays so while the read lock is held; a `u8` is always
            // aligned for `AtomicU8`, and the backend accesses the byte only atomically here.
            let byte = unsafe { std::sync::atomic::AtomicU8::from_ptr(base.add(offset)) };
            // `black_box`: an add of a known 0 would be compiled into a load (a read fault,
            // then a second fault at the first write).
            byte.fetch_add(
                std::hint::black_box(0),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        Ok(())
    }

    /// Reserves `size` bytes aligned to `align` (a power of two, at least the page size):
    /// over-reserves by `align - page` and trims the head and the tail.
    fn reserve_aligned(&self, size: u64, align: u64, page: u64) -> BackendResult<u64> {
        let op = Operation::Reserve;
        let len = to_usize(op, "size", size)?;
        if align <= page {
            return result::reserve(None, len).map_err(|e| e.to_error(op));
        }
        let extra = align.saturating_sub(page);
        let over = size
            .checked_add(extra)
            .ok_or_else(|| invalid(op, "size + alignment overflows"))?;
        let over_len = to_usize(op, "size", over)?;
        let raw = result::reserve(None, over_len).map_err(|e| e.to_error(op))?;
        let start = align_up(raw, align).ok_or_else(|| invalid(op, "alignment overflows"))?;
        let head = start.saturating_sub(raw);
        let tail_start = start.saturating_add(size);
        let tail = raw.saturating_add(over).saturating_sub(tail_start);
        for (a, l) in [(raw, head), (tail_start, tail)] {
            if l == 0 {
                continue;
            }
            let ptr = pointer(op, a)?;
            let l = to_usize(op, "size", l)?;
            // SAFETY: the head and tail are parts of the range just reserved above, outside
            // the part kept, and nothing refers to them.
            if let Err(e) = unsafe { result::unmap(ptr, l) } {
                // The range stays reserved whole; trimming is an optimisation only.
                tracing::debug!(errno = e.0, "trimming an over-reservation failed");
            }
        }
        Ok(start)
    }
}

impl Drop for HostBackend {
    fn drop(&mut self) {
        let state = self.state.get_mut().unpoisoned();
        for (address, size) in state.reservation_ranges() {
            let (Ok(ptr), Ok(len)) = (
                pointer(Operation::Free, address),
                to_usize(Operation::Free, "size", size),
            ) else {
                continue;
            };
            // SAFETY: a reservation of this backend, which is going away: nothing of it is
            // used through the backend any more (we hold `&mut self`).
            if let Err(e) = unsafe { result::unmap(ptr, len) } {
                tracing::debug!(errno = e.0, "munmap at teardown failed");
            }
        }
        // Closing the memfds releases the handles.
        drop(state.clear());
    }
}

impl VirtualMemoryBackend for HostBackend {
    fn name(&self) -> &str {
        "host"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            unmap_spans_mappings: true,
            posix_fd_handles: true,
            kernels: true,
            set_access_retries: 0,
            checks_reservation_bounds: true,
            host_copies: true,
        }
    }

    fn devices(&self) -> BackendResult<Vec<DeviceInfo>> {
        Ok(vec![self.info.clone()])
    }

    fn memory_info(&self, device: DeviceId) -> BackendResult<MemoryInfo> {
        State::check_device(Operation::MemoryInfo, device)?;
        let s = self.read();
        Ok(MemoryInfo {
            free: s.capacity().saturating_sub(s.used()),
            total: s.capacity(),
        })
    }

    fn granularity(&self, properties: &AllocationProperties) -> BackendResult<Granularity> {
        State::check_device(Operation::Granularity, properties.device)?;
        Ok(Granularity {
            minimum: self.read().granule(),
            recommended: self.recommended,
        })
    }

    fn reserve(
        &self,
        size: u64,
        alignment: u64,
        fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress> {
        let op = Operation::Reserve;
        let span = tracing::debug_span!("kvvm_host", op = "reserve", size, alignment);
        traced(span, || {
            let mut s = self.write();
            let align = s.check_reserve(size, alignment)?;
            let page = s.granule();
            if let Some(hint) = fixed_address.filter(|a| a.0 != 0 && is_multiple(a.0, align)) {
                let len = to_usize(op, "size", size)?;
                match result::reserve(Some(hint.0), len) {
                    Ok(a) if a == hint.0 => {
                        s.record_reservation(a, size);
                        return Ok(hint);
                    }
                    Ok(a) => {
                        // An old kernel took MAP_FIXED_NOREPLACE as a hint and placed the
                        // range elsewhere: give it back and reserve as without a hint.
                        let ptr = pointer(op, a)?;
                        // SAFETY: the range was just reserved above and nothing refers to it.
                        unsafe { result::unmap(ptr, len) }.map_err(|e| e.to_error(op))?;
                    }
                    // Taken (EEXIST): like the driver, a fixed address is only a hint.
                    Err(_) => {}
                }
            }
            let a = self.reserve_aligned(size, align, page)?;
            s.record_reservation(a, size);
            tracing::debug!(address = a, "reserved");
            Ok(DeviceAddress(a))
        })
    }

    fn free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        let op = Operation::Free;
        let span = tracing::debug_span!("kvvm_host", op = "free", %address, size);
        traced(span, || {
            let mut s = self.write();
            s.check_free(address, size)?;
            let ptr = pointer(op, address.0)?;
            let len = to_usize(op, "size", size)?;
            // SAFETY: exactly a live reservation of this backend with no mapping left in it
            // (checked above, under the write lock), so only its placeholder pages go.
            unsafe { result::unmap(ptr, len) }.map_err(|e| e.to_error(op))?;
            s.remove_reservation(address.0);
            Ok(())
        })
    }

    fn create(
        &self,
        size: u64,
        properties: &AllocationProperties,
    ) -> BackendResult<PhysicalHandle> {
        let op = Operation::Create;
        let span =
            tracing::debug_span!("kvvm_host", op = "create", device = %properties.device, size);
        traced(span, || {
            State::check_device(op, properties.device)?;
            let mut s = self.write();
            s.check_create(size)?;
            let fd = result::memfd_create(MEMFD_NAME).map_err(|e| e.to_error(op))?;
            result::ftruncate(&fd, size).map_err(|e| e.to_error(op))?;
            result::seal_size(&fd).map_err(|e| e.to_error(op))?;
            if self.populate {
                result::fallocate(&fd, size).map_err(|e| e.to_error(op))?;
            }
            let id = result::fstat(&fd).map_err(|e| e.to_error(op))?;
            let exportable = properties.handle_type == ShareableHandleType::PosixFd;
            let handle = s.record_created((id.dev, id.ino), size, HostHandle { fd, exportable });
            tracing::debug!(%handle, "created");
            Ok(handle)
        })
    }

    fn release(&self, handle: PhysicalHandle) -> BackendResult<()> {
        let span = tracing::debug_span!("kvvm_host", op = "release", %handle);
        traced(span, || {
            let fd = self.write().release(handle)?;
            // The memory lives on while a mapping of the memfd does.
            drop(fd);
            Ok(())
        })
    }

    fn map(&self, address: DeviceAddress, size: u64, handle: PhysicalHandle) -> BackendResult<()> {
        let op = Operation::Map;
        let span = tracing::debug_span!("kvvm_host", op = "map", %address, size, %handle);
        traced(span, || {
            let mut s = self.write();
            let fd = s.check_map(address, size, handle)?;
            let ptr = pointer(op, address.0)?;
            let len = to_usize(op, "size", size)?;
            // SAFETY: the range lies inside one live reservation and holds no live mapping
            // (checked above, under the write lock): MAP_FIXED replaces only the
            // reservation's placeholder pages.
            unsafe { result::map_fixed(ptr, len, fd) }.map_err(|e| e.to_error(op))?;
            s.record_map(address, size, handle);
            Ok(())
        })
    }

    fn set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> BackendResult<()> {
        let op = Operation::SetAccess;
        let span = tracing::debug_span!("kvvm_host", op = "set_access", %address, size);
        traced(span, || {
            let mut s = self.write();
            let acc = s.check_set_access(address, size, access)?;
            let ptr = pointer(op, address.0)?;
            let len = to_usize(op, "size", size)?;
            // SAFETY: the range is exactly live mappings of this backend (checked above);
            // copies and probes, the backend's only readers, are excluded by the write lock.
            unsafe { result::protect(ptr, len, protection(acc)) }.map_err(|e| e.to_error(op))?;
            s.record_access(address, size, acc);
            Ok(())
        })
    }

    fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        let op = Operation::Unmap;
        let span = tracing::debug_span!("kvvm_host", op = "unmap", %address, size);
        traced(span, || {
            let mut s = self.write();
            let runs = s.check_unmap(address, size)?;
            let total = runs.len();
            for (i, (start, len)) in runs.into_iter().enumerate() {
                let ptr = pointer(op, start)?;
                let l = to_usize(op, "size", len)?;
                // SAFETY: `[start, start + len)` is a run of whole live mappings of this
                // backend (checked above, under the write lock), inside its reservation:
                // placeholder pages replace exactly them.
                if let Err(e) = unsafe { result::map_placeholder(ptr, l) } {
                    return Err(e.to_error(op).with_detail(format!(
                        "{i} of {total} runs of mappings were unmapped before this one failed"
                    )));
                }
                s.record_unmap(start, len);
            }
            Ok(())
        })
    }

    fn synchronize(&self, device: DeviceId) -> BackendResult<()> {
        // The CPU's stores are complete when the call that made them returns.
        State::check_device(Operation::Synchronize, device)
    }

    fn copy_to_device(&self, dst: DeviceAddress, src: &[u8]) -> BackendResult<()> {
        let op = Operation::CopyToDevice;
        let s = self.read();
        s.check_range(op, dst.0, to_u64(src.len()), Some(true))?;
        if src.is_empty() {
            return Ok(());
        }
        let to = pointer(op, dst.0)?.cast::<u8>();
        // SAFETY: every byte of `[dst, dst + src.len())` is mapped by this backend with write
        // access (checked above) and stays so while the read lock is held, which excludes
        // unmap, set access and free. `src` is a valid slice; `ptr::copy` allows it to
        // overlap the destination (a slice taken from a mapping of the same memfd).
        unsafe { std::ptr::copy(src.as_ptr(), to, src.len()) };
        Ok(())
    }

    fn copy_from_device(&self, dst: &mut [u8], src: DeviceAddress) -> BackendResult<()> {
        let op = Operation::CopyFromDevice;
        let s = self.read();
        s.check_range(op, src.0, to_u64(dst.len()), Some(false))?;
        if dst.is_empty() {
            return Ok(());
        }
        let from = pointer(op, src.0)?.cast::<u8>().cast_const();
        // SAFETY: every byte of `[src, src + dst.len())` is mapped by this backend with read
        // access (checked above) and stays so under the read lock; `dst` is a valid,
        // exclusively borrowed slice, and any byte value is a valid `u8`.
        unsafe { std::ptr::copy(from, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn copy_rows_async(&self, copy: &RowCopy, _stream: StreamHandle) -> BackendResult<()> {
        // The CPU has no queue: the rows are copied now, under the read lock.
        let op = Operation::CopyRows;
        copy.check()?;
        let s = self.read();
        for row in 0..copy.rows {
            // In range: `check` proved the last row's end does not overflow.
            let dst = copy.dst.0 + row * copy.dst_pitch;
            let src = copy.src.0 + row * copy.src_pitch;
            s.check_range(op, dst, copy.width, Some(true))?;
            s.check_range(op, src, copy.width, Some(false))?;
        }
        let width = to_usize(op, "width", copy.width)?;
        if width == 0 {
            return Ok(());
        }
        for row in 0..copy.rows {
            let to = pointer(op, copy.dst.0 + row * copy.dst_pitch)?.cast::<u8>();
            let from = pointer(op, copy.src.0 + row * copy.src_pitch)?
                .cast::<u8>()
                .cast_const();
            // SAFETY: both rows lie in mappings of this backend, the destination with write
            // access and the source with read access (checked above for every row), and stay
            // mapped while the read lock is held (it excludes unmap, set access and free).
            // `ptr::copy` allows the rows to overlap.
            unsafe { std::ptr::copy(from, to, width) };
        }
        Ok(())
    }

    fn host_alloc(&self, device: DeviceId, bytes: u64) -> BackendResult<HostBuffer> {
        let span = tracing::debug_span!("kvvm_host", op = "host_alloc", bytes);
        traced(span, || self.tier_host_alloc(device, bytes))
    }

    fn host_free(&self, buffer: HostBuffer) -> BackendResult<()> {
        let span = tracing::debug_span!("kvvm_host", op = "host_free", %buffer);
        traced(span, || self.tier_host_free(buffer))
    }

    fn copy_to_host_async(&self, copy: &HostCopy, _stream: StreamHandle) -> BackendResult<()> {
        // The CPU has no queue: copied now, under the read lock.
        self.tier_copy(copy, true)
    }

    fn copy_from_host_async(&self, copy: &HostCopy, _stream: StreamHandle) -> BackendResult<()> {
        self.tier_copy(copy, false)
    }

    fn copy_stream(&self, device: DeviceId) -> BackendResult<StreamHandle> {
        State::check_device(Operation::Stream, device)?;
        Ok(StreamHandle(0))
    }

    fn event_record(&self, device: DeviceId, stream: StreamHandle) -> BackendResult<EventHandle> {
        self.tier_event_record(device, stream)
    }

    fn event_query(&self, event: EventHandle) -> BackendResult<bool> {
        self.tier_check_event(event).map(|()| true)
    }

    fn event_wait(&self, event: EventHandle) -> BackendResult<()> {
        self.tier_check_event(event)
    }

    fn stream_wait_event(&self, _stream: StreamHandle, event: EventHandle) -> BackendResult<()> {
        self.tier_check_event(event)
    }

    fn event_destroy(&self, event: EventHandle) -> BackendResult<()> {
        self.tier_event_destroy(event)
    }

    fn export_posix_fd(&self, handle: PhysicalHandle) -> BackendResult<OwnedFd> {
        let op = Operation::Export;
        let span = tracing::debug_span!("kvvm_host", op = "export_posix_fd", %handle);
        traced(span, || {
            let s = self.read();
            let fd = s.check_export(handle)?;
            result::dup(fd).map_err(|e| e.to_error(op))
        })
    }

    fn import_posix_fd(
        &self,
        device: DeviceId,
        fd: BorrowedFd<'_>,
    ) -> BackendResult<PhysicalHandle> {
        let op = Operation::Import;
        let span = tracing::debug_span!("kvvm_host", op = "import_posix_fd", %device);
        traced(span, || {
            if device != DeviceId(0) {
                return Err(BackendError::raised(
                    op,
                    ErrorKind::InvalidValue,
                    format!("no {device}: the host backend has device 0 only"),
                ));
            }
            let own = result::dup(fd).map_err(|e| e.to_error(op))?;
            let id = result::fstat(&own).map_err(|e| e.to_error(op))?;
            let seals = result::seals(&own).map_err(|e| {
                e.to_error(op)
                    .with_detail("the descriptor is not a memfd (F_GET_SEALS failed)")
            })?;
            use rustix::fs::SealFlags;
            if !id.regular || !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
                return Err(invalid(
                    op,
                    "the descriptor is not a memfd whose size is sealed (as export makes them)",
                ));
            }
            let mut s = self.write();
            let key = (id.dev, id.ino);
            let size = s.allocation_size(key).unwrap_or(id.size);
            if size == 0 || !is_multiple(size, s.granule()) {
                return Err(invalid(
                    op,
                    format!(
                        "the memfd's size {size} is not a multiple of {}",
                        s.granule()
                    ),
                ));
            }
            let handle = s.record_handle(own, key, size, true);
            tracing::debug!(%handle, size, "imported");
            Ok(handle)
        })
    }

    fn kernel_probe(&self) -> Option<&dyn KernelProbe> {
        Some(self)
    }
}
