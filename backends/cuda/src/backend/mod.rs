//! [`CudaBackend`]: the CUDA driver backend, the [`VirtualMemoryBackend`] implementation over
//! the CUDA driver API (and [`KernelProbe`], row copies and plain device memory besides).
//!
//! The invariants it keeps:
//!
//! * every `Device` it holds has its primary context retained exactly once, by
//!   [`CudaBackend::open`], and released exactly once, by `Drop` (after unloading the kernel
//!   modules loaded in it), so a context a method hands the driver is always live;
//! * every method makes one of its own contexts current on the calling thread before calling
//!   the driver (`make_current`, `owner_context`, `any_context`), so it may be called from
//!   any thread;
//! * the kernel modules (probe, row copy) are loaded lazily, at most once per device, in that
//!   device's context, under that module's mutex in the `Device`;
//! * it translates and does not validate: a driver code becomes a [`BackendError`] through
//!   `check`, named by our table or else by the driver.
//!
//! Its methods live in the files of this folder:
//!
//! * `mod.rs` (this file): the type, its context helpers and [`VirtualMemoryBackend`];
//! * `open.rs`: [`CudaBackend::open`] and `Drop`;
//! * `kernel.rs`: [`KernelProbe`], one launch of a probe kernel;
//! * `rows.rs`: row copies ([`VirtualMemoryBackend::copy_rows_async`]) as one kernel launch;
//! * `linear.rs`: plain device memory outside the VMM API, for the realloc-and-copy baseline;
//! * `tier.rs`: the host tier's calls (page-locked host memory, copies to and from it on a
//!   stream, the copy stream, events), with the books of the buffers and events it made.

use std::ffi::c_int;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUmemAccessDesc, CUmemAllocationGranularity_flags, CUmemLocation,
    CUmemLocationType,
};
use kvvm_hal::{
    traced, AccessDescriptor, AllocationProperties, BackendError, BackendResult, Capabilities,
    DeviceAddress, DeviceId, DeviceInfo, ErrorKind, EventHandle, Granularity, HostBuffer, HostCopy,
    KernelProbe, MemoryInfo, Operation, PhysicalHandle, RowCopy, StreamHandle,
    VirtualMemoryBackend,
};

use crate::conv::{access_flags, allocation_prop, ordinal, to_u64, to_usize};
use crate::driver::{CuResult, Driver};
use crate::error::CuCode;
use crate::probe::ProbeModule;
use crate::rows_kernel::RowsModule;

mod kernel;
mod linear;
mod open;
mod rows;
mod tier;

/// A retained primary context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Context(pub(crate) CUcontext);

// SAFETY: a CUDA context is a driver object that may be made current on, and used from, any
// thread of the process (the driver API is thread-safe); the pointer is only an identifier
// handed back to the driver.
unsafe impl Send for Context {}
// SAFETY: see `Send`; `Context` has no interior state of its own.
unsafe impl Sync for Context {}

/// One device the backend opened.
pub(crate) struct Device {
    /// The driver's device handle.
    pub(crate) cu: CUdevice,
    /// The ordinal, as the driver's `int`.
    pub(crate) ordinal: c_int,
    /// The device's primary context, retained once by [`CudaBackend::open`].
    pub(crate) ctx: Context,
    /// What `devices()` reports.
    pub(crate) info: DeviceInfo,
    /// The probe kernels, loaded on first use.
    pub(crate) probe: Mutex<Option<ProbeModule>>,
    /// The row-copy kernel, loaded on first use.
    pub(crate) rows: Mutex<Option<RowsModule>>,
    /// The backend's copy stream of this device, made on first use.
    pub(crate) copy_stream: Mutex<Option<tier::OwnStream>>,
}

/// The CUDA driver backend: the driver's virtual-memory management API (`cuMemCreate`,
/// `cuMemMap`, ...) through `libcuda`, loaded at run time.
///
/// [`CudaBackend::open`] initialises the driver and retains each device's primary context
/// once; dropping the backend releases them. Every method makes the right context current on
/// the calling thread first (a cheap `cuCtxGetCurrent` comparison, then `cuCtxSetCurrent` only
/// when needed), so the backend can be used from any thread, e.g. a thread pool. Methods that
/// are not tied to one device (reserve, map, set access, copies, ...) accept any of this
/// backend's contexts as current and otherwise make device 0's current: the address space is
/// unified across the process's devices.
///
/// The backend translates and does not validate: arguments go to the driver as given and its
/// return code is mapped onto an [`ErrorKind`] (see [`crate::error`]).
pub struct CudaBackend {
    pub(crate) driver: Driver,
    pub(crate) devices: Vec<Device>,
    pub(crate) posix_fd: bool,
    /// The page-locked buffers and events it made (`tier.rs`).
    pub(crate) tier: Mutex<tier::TierBooks>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field(
                "devices",
                &self.devices.iter().map(|d| &d.info).collect::<Vec<_>>(),
            )
            .field("posix_fd", &self.posix_fd)
            .finish()
    }
}

impl CudaBackend {
    /// The number of devices the backend opened.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// A [`BackendError`] for `code` from `op`, named by our table or else by the driver.
    pub(crate) fn error(&self, op: Operation, code: CuCode) -> BackendError {
        error_with_name(&self.driver, op, code)
    }

    /// Maps a driver result onto a backend result for `op`.
    pub(crate) fn check<T>(&self, op: Operation, result: CuResult<T>) -> BackendResult<T> {
        result.map_err(|code| self.error(op, code))
    }

    /// The opened device `id`, or `InvalidValue` (`CUDA_ERROR_INVALID_DEVICE`).
    pub(crate) fn device(&self, op: Operation, id: DeviceId) -> BackendResult<&Device> {
        usize::try_from(id.0)
            .ok()
            .and_then(|i| self.devices.get(i))
            .ok_or_else(|| {
                CuCode::INVALID_DEVICE
                    .to_error(op)
                    .with_detail(format!("no {id} ({} devices)", self.devices.len()))
            })
    }

    /// Makes `device`'s primary context current on this thread (if it is not already).
    pub(crate) fn make_current(&self, op: Operation, device: &Device) -> BackendResult<()> {
        let current = self.check(op, self.driver.ctx_current())?;
        if current == device.ctx.0 {
            return Ok(());
        }
        // SAFETY: `device.ctx` is a primary context retained by `open` and released only in
        // `Drop`, so it is live.
        self.check(op, unsafe { self.driver.ctx_set_current(device.ctx.0) })
    }

    /// Makes current the primary context of the device whose memory `address` maps (a copy
    /// runs on that device's engines; with several devices another one's context may have no
    /// access). Falls back to [`any_context`](Self::any_context) when the driver cannot say.
    fn owner_context(&self, op: Operation, address: DeviceAddress) -> BackendResult<()> {
        if self.devices.len() > 1 {
            if let Ok(ordinal) = self.driver.pointer_device_ordinal(address.0) {
                if let Some(dev) = self.devices.iter().find(|d| d.ordinal == ordinal) {
                    return self.make_current(op, dev);
                }
            }
        }
        self.any_context(op)
    }

    /// Makes the context of device `id` current on this thread (an unknown device refused).
    pub(crate) fn make_device_current(&self, op: Operation, id: DeviceId) -> BackendResult<()> {
        self.make_current(op, self.device(op, id)?)
    }

    /// The device whose memory `address` maps when the driver can say (with several devices),
    /// else the device whose context is current, else device 0.
    pub(crate) fn owner_device(
        &self,
        op: Operation,
        address: DeviceAddress,
    ) -> BackendResult<&Device> {
        if self.devices.len() > 1 {
            if let Ok(ordinal) = self.driver.pointer_device_ordinal(address.0) {
                if let Some(dev) = self.devices.iter().find(|d| d.ordinal == ordinal) {
                    return Ok(dev);
                }
            }
        }
        let current = self.check(op, self.driver.ctx_current())?;
        match self.devices.iter().find(|d| d.ctx.0 == current) {
            Some(dev) => Ok(dev),
            None => self.device(op, DeviceId(0)),
        }
    }

    /// Makes one of this backend's contexts current on this thread: the current one if it is
    /// ours, else device 0's.
    pub(crate) fn any_context(&self, op: Operation) -> BackendResult<()> {
        let current = self.check(op, self.driver.ctx_current())?;
        if !current.is_null() && self.devices.iter().any(|d| d.ctx.0 == current) {
            return Ok(());
        }
        let first = self.device(op, DeviceId(0))?;
        // SAFETY: a retained primary context of this backend (see `make_current`).
        self.check(op, unsafe { self.driver.ctx_set_current(first.ctx.0) })
    }
}

pub(crate) fn error_with_name(driver: &Driver, op: Operation, code: CuCode) -> BackendError {
    let mut e = code.to_error(op);
    if code.name().is_none() {
        if let Some(name) = driver.error_name(code) {
            e.code_name = name;
        }
    }
    e
}

impl VirtualMemoryBackend for CudaBackend {
    fn name(&self) -> &str {
        "cuda"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            unmap_spans_mappings: true,
            posix_fd_handles: self.posix_fd,
            kernels: true,
            set_access_retries: 0,
            checks_reservation_bounds: false,
            host_copies: true,
        }
    }

    fn devices(&self) -> BackendResult<Vec<DeviceInfo>> {
        Ok(self.devices.iter().map(|d| d.info.clone()).collect())
    }

    fn memory_info(&self, device: DeviceId) -> BackendResult<MemoryInfo> {
        let op = Operation::MemoryInfo;
        traced(
            tracing::debug_span!("kvvm_cuda", op = "cuMemGetInfo", %device),
            || {
                self.make_device_current(op, device)?;
                let (free, total) = self.check(op, self.driver.mem_info())?;
                Ok(MemoryInfo {
                    free: to_u64(free),
                    total: to_u64(total),
                })
            },
        )
    }

    fn granularity(&self, properties: &AllocationProperties) -> BackendResult<Granularity> {
        let op = Operation::Granularity;
        let span = tracing::debug_span!(
            "kvvm_cuda",
            op = "cuMemGetAllocationGranularity",
            device = %properties.device
        );
        traced(span, || {
            let dev = self.device(op, properties.device)?;
            self.make_current(op, dev)?;
            let prop = allocation_prop(dev.ordinal, properties.handle_type);
            let minimum = self.check(
                op,
                self.driver.granularity(
                    &prop,
                    CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                ),
            )?;
            let recommended = self.check(
                op,
                self.driver.granularity(
                    &prop,
                    CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                ),
            )?;
            Ok(Granularity {
                minimum: to_u64(minimum),
                recommended: to_u64(recommended),
            })
        })
    }

    fn reserve(
        &self,
        size: u64,
        alignment: u64,
        fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress> {
        let op = Operation::Reserve;
        let span = tracing::debug_span!("kvvm_cuda", op = "cuMemAddressReserve", size, alignment);
        traced(span, || {
            let size_z = to_usize(op, "size", size)?;
            let alignment = to_usize(op, "alignment", alignment)?;
            self.any_context(op)?;
            let hint = fixed_address.map_or(0, DeviceAddress::get);
            let ptr = self.check(op, self.driver.address_reserve(size_z, alignment, hint))?;
            tracing::debug!(address = ptr, "reserved");
            Ok(DeviceAddress(ptr))
        })
    }

    fn free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        let op = Operation::Free;
        let span = tracing::debug_span!("kvvm_cuda", op = "cuMemAddressFree", %address, size);
        traced(span, || {
            let size = to_usize(op, "size", size)?;
            self.any_context(op)?;
            self.check(op, self.driver.address_free(address.0, size))
        })
    }

    fn create(
        &self,
        size: u64,
        properties: &AllocationProperties,
    ) -> BackendResult<PhysicalHandle> {
        let op = Operation::Create;
        let span = tracing::debug_span!(
            "kvvm_cuda",
            op = "cuMemCreate",
            device = %properties.device,
            size
        );
        traced(span, || {
            let size = to_usize(op, "size", size)?;
            let dev = self.device(op, properties.device)?;
            self.make_current(op, dev)?;
            let prop = allocation_prop(dev.ordinal, properties.handle_type);
            let handle = self.check(op, self.driver.mem_create(size, &prop))?;
            Ok(PhysicalHandle(handle))
        })
    }

    fn release(&self, handle: PhysicalHandle) -> BackendResult<()> {
        let op = Operation::Release;
        let span = tracing::debug_span!("kvvm_cuda", op = "cuMemRelease", %handle);
        traced(span, || {
            self.any_context(op)?;
            self.check(op, self.driver.mem_release(handle.0))
        })
    }

    fn map(&self, address: DeviceAddress, size: u64, handle: PhysicalHandle) -> BackendResult<()> {
        let op = Operation::Map;
        let span = tracing::debug_span!("kvvm_cuda", op = "cuMemMap", %address, size, %handle);
        traced(span, || {
            let size = to_usize(op, "size", size)?;
            self.any_context(op)?;
            self.check(op, self.driver.mem_map(address.0, size, handle.0))
        })
    }

    fn set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> BackendResult<()> {
        let op = Operation::SetAccess;
        let span = tracing::debug_span!(
            "kvvm_cuda",
            op = "cuMemSetAccess",
            %address,
            size,
            descriptors = access.len()
        );
        traced(span, || {
            let size = to_usize(op, "size", size)?;
            let desc = access
                .iter()
                .map(|a| {
                    Ok(CUmemAccessDesc {
                        location: CUmemLocation {
                            type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                            id: ordinal(op, a.device)?,
                        },
                        flags: access_flags(a.access),
                    })
                })
                .collect::<BackendResult<Vec<_>>>()?;
            self.any_context(op)?;
            self.check(op, self.driver.mem_set_access(address.0, size, &desc))
        })
    }

    fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        let op = Operation::Unmap;
        let span = tracing::debug_span!("kvvm_cuda", op = "cuMemUnmap", %address, size);
        traced(span, || {
            let size = to_usize(op, "size", size)?;
            self.any_context(op)?;
            self.check(op, self.driver.mem_unmap(address.0, size))
        })
    }

    fn synchronize(&self, device: DeviceId) -> BackendResult<()> {
        let op = Operation::Synchronize;
        traced(
            tracing::debug_span!("kvvm_cuda", op = "cuCtxSynchronize", %device),
            || {
                self.make_device_current(op, device)?;
                self.check(op, self.driver.ctx_synchronize())
            },
        )
    }

    fn copy_to_device(&self, dst: DeviceAddress, src: &[u8]) -> BackendResult<()> {
        let op = Operation::CopyToDevice;
        let span = tracing::debug_span!("kvvm_cuda", op = "cuMemcpyHtoD", %dst, bytes = src.len());
        traced(span, || {
            self.owner_context(op, dst)?;
            self.check(op, self.driver.memcpy_htod(dst.0, src))
        })
    }

    fn copy_from_device(&self, dst: &mut [u8], src: DeviceAddress) -> BackendResult<()> {
        let op = Operation::CopyFromDevice;
        let span = tracing::debug_span!("kvvm_cuda", op = "cuMemcpyDtoH", %src, bytes = dst.len());
        traced(span, || {
            self.owner_context(op, src)?;
            self.check(op, self.driver.memcpy_dtoh(dst, src.0))
        })
    }

    fn copy_rows_async(&self, copy: &RowCopy, stream: StreamHandle) -> BackendResult<()> {
        let span = tracing::debug_span!(
            "kvvm_cuda",
            op = "kvvm_copy_rows",
            dst = %copy.dst,
            src = %copy.src,
            width = copy.width,
            rows = copy.rows
        );
        traced(span, || self.launch_copy_rows(copy, stream))
    }

    fn host_alloc(&self, device: DeviceId, bytes: u64) -> BackendResult<HostBuffer> {
        let span = tracing::debug_span!("kvvm_cuda", op = "cuMemHostAlloc", %device, bytes);
        traced(span, || self.tier_host_alloc(device, bytes))
    }

    fn host_free(&self, buffer: HostBuffer) -> BackendResult<()> {
        let span = tracing::debug_span!("kvvm_cuda", op = "cuMemFreeHost", %buffer);
        traced(span, || self.tier_host_free(buffer))
    }

    fn copy_to_host_async(&self, copy: &HostCopy, stream: StreamHandle) -> BackendResult<()> {
        let span = tracing::debug_span!(
            "kvvm_cuda",
            op = "cuMemcpyDtoHAsync",
            src = %copy.device,
            bytes = copy.bytes
        );
        traced(span, || self.tier_copy(copy, stream, true))
    }

    fn copy_from_host_async(&self, copy: &HostCopy, stream: StreamHandle) -> BackendResult<()> {
        let span = tracing::debug_span!(
            "kvvm_cuda",
            op = "cuMemcpyHtoDAsync",
            dst = %copy.device,
            bytes = copy.bytes
        );
        traced(span, || self.tier_copy(copy, stream, false))
    }

    fn copy_stream(&self, device: DeviceId) -> BackendResult<StreamHandle> {
        let span = tracing::debug_span!("kvvm_cuda", op = "cuStreamCreate", %device);
        traced(span, || self.tier_copy_stream(device))
    }

    fn event_record(&self, device: DeviceId, stream: StreamHandle) -> BackendResult<EventHandle> {
        let span = tracing::debug_span!("kvvm_cuda", op = "cuEventRecord", %device);
        traced(span, || self.tier_event_record(device, stream))
    }

    fn event_query(&self, event: EventHandle) -> BackendResult<bool> {
        self.tier_event_query(event)
    }

    fn event_wait(&self, event: EventHandle) -> BackendResult<()> {
        let span = tracing::debug_span!("kvvm_cuda", op = "cuEventSynchronize");
        traced(span, || self.tier_event_wait(event))
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> BackendResult<()> {
        self.tier_stream_wait_event(stream, event)
    }

    fn event_destroy(&self, event: EventHandle) -> BackendResult<()> {
        self.tier_event_destroy(event)
    }

    fn export_posix_fd(&self, handle: PhysicalHandle) -> BackendResult<OwnedFd> {
        let op = Operation::Export;
        let span = tracing::debug_span!("kvvm_cuda", op = "cuMemExportToShareableHandle", %handle);
        traced(span, || {
            if !self.posix_fd {
                return Err(CuCode::NOT_SUPPORTED
                    .to_error(op)
                    .with_detail("a device lacks POSIX file descriptor handle support"));
            }
            self.any_context(op)?;
            let fd = self.check(op, self.driver.export_posix_fd(handle.0))?;
            if fd < 0 {
                return Err(BackendError::raised(
                    op,
                    ErrorKind::Other,
                    format!("the driver returned fd {fd}"),
                ));
            }
            // SAFETY: on success the driver returns a newly opened file descriptor that the
            // caller owns (cuda.h); nothing else holds or closes it.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        })
    }

    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> BackendResult<bool> {
        let op = Operation::Devices;
        let span = tracing::debug_span!("kvvm_cuda", op = "cuDeviceCanAccessPeer", %device, %peer);
        traced(span, || {
            let (d, p) = (self.device(op, device)?, self.device(op, peer)?);
            if device == peer {
                return Ok(true);
            }
            self.check(op, self.driver.can_access_peer(p.cu, d.cu))
        })
    }

    fn import_posix_fd(
        &self,
        device: DeviceId,
        fd: BorrowedFd<'_>,
    ) -> BackendResult<PhysicalHandle> {
        let op = Operation::Import;
        let raw = fd.as_raw_fd();
        let span = tracing::debug_span!(
            "kvvm_cuda",
            op = "cuMemImportFromShareableHandle",
            fd = raw,
            %device
        );
        traced(span, || {
            self.make_device_current(op, device)?;
            let handle = self.check(op, self.driver.import_posix_fd(raw))?;
            Ok(PhysicalHandle(handle))
        })
    }

    fn kernel_probe(&self) -> Option<&dyn KernelProbe> {
        Some(self)
    }
}
