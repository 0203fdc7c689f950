//! [`HipBackend`]: the [`VirtualMemoryBackend`] implementation over the HIP runtime, and
//! [`HipRuntime`], the loaded runtime it is opened from and keeps. Each method is one driver
//! call (or the `hipSetDevice` it needs first) inside one tracing span; the calls themselves
//! are `driver/result.rs`, the conversions `conv.rs`.
//!
//! The invariants they keep:
//!
//! * a [`HipRuntime`] exists only once its library is loaded, every required symbol is
//!   resolved and its version is read; the library is never unloaded, so the entry points of
//!   its [`HipApi`] stay valid for the life of the process;
//! * a [`HipBackend`] exists only over a runtime that `hipInit` initialised, whose version has
//!   a verified `hipMemAllocationProp` layout, and with at least one device; it owns that
//!   runtime and builds every allocation property in that layout;
//! * every call tied to a device makes that device current on the calling thread first
//!   (`hipSetDevice`), so the backend may be used from any thread;
//! * it translates and does not validate: a runtime code becomes a [`BackendError`] through
//!   `check`, named by our table or else by the runtime.
//!
//! Their methods live in the files of this folder:
//!
//! * `mod.rs` (this file): [`HipBackend`], its helpers and [`VirtualMemoryBackend`];
//! * `devices.rs`: what the backend reports about its devices (names, memory, peer access);
//! * `runtime.rs`: [`HipRuntime`]: loading the library, reading its version, and
//!   [`HipRuntime::open`], which initialises it into a [`HipBackend`].

use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use kvvm_hal::{
    traced, AccessDescriptor, AllocationProperties, BackendError, BackendResult, Capabilities,
    DeviceAddress, DeviceId, DeviceInfo, ErrorKind, Granularity, MemoryInfo, Operation,
    PhysicalHandle, ShareableHandleType, VirtualMemoryBackend,
};

use crate::conv::{
    access_flags, allocation_prop, from_ptr, handle_of, handle_ptr, ordinal, to_ptr, to_u64,
    to_usize,
};
use crate::driver::result::{error_name, HipResult};
use crate::driver::{
    HipApi, HipMemAccessDesc, HipMemAllocationProp, HipMemLocation,
    HIP_MEM_ALLOCATION_GRANULARITY_MINIMUM, HIP_MEM_ALLOCATION_GRANULARITY_RECOMMENDED,
    HIP_MEM_HANDLE_TYPE_POSIX_FD, HIP_MEM_LOCATION_TYPE_DEVICE,
};
use crate::error::call_error;
use crate::version::{PropLayout, RuntimeVersion};
use crate::SET_ACCESS_RETRIES;

mod devices;
mod runtime;

pub use runtime::HipRuntime;

/// The HIP backend: a loaded, initialised HIP runtime with at least one device.
///
/// Open it with [`HipBackend::open`] (or [`HipRuntime`] for finer steps). It is `Send + Sync`;
/// every method may be called from any thread.
#[derive(Debug)]
pub struct HipBackend {
    pub(crate) runtime: HipRuntime,
    layout: PropLayout,
    pub(crate) device_count: u32,
    pub(crate) posix_fd: bool,
}

impl HipBackend {
    /// The backend over an initialised `runtime` with `device_count` devices; checks whether
    /// POSIX-fd handles work on device 0.
    pub(crate) fn new(
        runtime: HipRuntime,
        layout: PropLayout,
        device_count: u32,
    ) -> BackendResult<HipBackend> {
        let mut backend = HipBackend {
            runtime,
            layout,
            device_count,
            posix_fd: false,
        };
        backend.posix_fd = backend.api().mem_export_to_shareable_handle.is_some()
            && backend.api().mem_import_from_shareable_handle.is_some()
            && backend.probe_granularity(DeviceId(0), ShareableHandleType::PosixFd)?;
        Ok(backend)
    }

    /// Loads the HIP runtime (`KVVM_HIP_LIBRARY` or the default names), checks its version,
    /// initialises it and checks that a device exists.
    pub fn open() -> BackendResult<HipBackend> {
        HipRuntime::load()?.open()
    }

    /// Like [`open`](Self::open), with the runtime at `path` (for instance the HIP-on-CUDA
    /// shim `libhip_on_cuda.so`).
    pub fn open_library(path: &str) -> BackendResult<HipBackend> {
        HipRuntime::load_from(path)?.open()
    }

    /// The runtime's version.
    pub fn runtime_version(&self) -> RuntimeVersion {
        self.runtime.version
    }

    /// The `hipMemAllocationProp` layout in use.
    pub fn prop_layout(&self) -> PropLayout {
        self.layout
    }

    /// The library that was loaded.
    pub fn library(&self) -> &str {
        &self.runtime.path
    }

    /// How many devices `hipGetDeviceCount` reported.
    pub fn device_count(&self) -> u32 {
        self.device_count
    }

    pub(crate) fn api(&self) -> &HipApi {
        &self.runtime.api
    }

    /// The value of a successful call; else the typed error, with `call` as detail.
    pub(crate) fn check<T>(
        &self,
        op: Operation,
        result: HipResult<T>,
        call: impl FnOnce() -> String,
    ) -> BackendResult<T> {
        result.map_err(|rc| {
            let e = call_error(op, rc, error_name(self.api(), rc)).with_detail(call());
            tracing::debug!(error = %e, "hip call failed");
            e
        })
    }

    fn set_device(&self, op: Operation, device: DeviceId) -> BackendResult<()> {
        let ordinal = ordinal(op, device)?;
        self.check(op, self.api().call_set_device(ordinal), || {
            format!("hipSetDevice({ordinal})")
        })
    }

    fn prop(
        &self,
        op: Operation,
        device: DeviceId,
        handle_type: ShareableHandleType,
    ) -> BackendResult<HipMemAllocationProp> {
        Ok(allocation_prop(
            self.layout,
            ordinal(op, device)?,
            handle_type,
        ))
    }

    fn granularity_of(&self, prop: &HipMemAllocationProp, flag: u32) -> BackendResult<u64> {
        let g = self.check(
            Operation::Granularity,
            self.api().call_mem_get_allocation_granularity(prop, flag),
            || format!("hipMemGetAllocationGranularity({prop:?}, option {flag})"),
        )?;
        Ok(to_u64(g))
    }

    /// Whether a granularity query for `handle_type` on `device` succeeds: the runtime
    /// supports VMM allocations of that kind there. Refusals (`NotSupported`,
    /// `InvalidValue`) are `false`; other failures are errors.
    pub(crate) fn probe_granularity(
        &self,
        device: DeviceId,
        handle_type: ShareableHandleType,
    ) -> BackendResult<bool> {
        let result = self
            .set_device(Operation::Devices, device)
            .and_then(|()| self.prop(Operation::Devices, device, handle_type))
            .and_then(|p| self.granularity_of(&p, HIP_MEM_ALLOCATION_GRANULARITY_MINIMUM));
        match result {
            Ok(g) => Ok(g > 0),
            Err(e) if matches!(e.kind, ErrorKind::NotSupported | ErrorKind::InvalidValue) => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    fn not_supported(&self, op: Operation) -> BackendError {
        BackendError::raised(
            op,
            ErrorKind::NotSupported,
            format!(
                "POSIX-fd handles are not supported by the HIP runtime {} ({})",
                self.runtime.version, self.runtime.path
            ),
        )
    }
}

impl VirtualMemoryBackend for HipBackend {
    fn name(&self) -> &str {
        "hip"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // ROCR-Runtime #285: a multi-mapping unmap makes the later address free fail.
            unmap_spans_mappings: false,
            posix_fd_handles: self.posix_fd,
            kernels: false,
            // gfx942 / ROCm 7.2: hipMemSetAccess on a new tail fails intermittently.
            set_access_retries: SET_ACCESS_RETRIES,
            checks_reservation_bounds: false,
            // hipHostMalloc and hipMemcpyAsync are not wired yet: the host tier is off here.
            host_copies: false,
        }
    }

    fn devices(&self) -> BackendResult<Vec<DeviceInfo>> {
        traced(
            tracing::debug_span!(
                "kvvm_hip",
                op = "hipDeviceGetName",
                devices = self.device_count
            ),
            || {
                let driver_version = self.driver_version();
                (0..self.device_count)
                    .map(|index| self.device_info(index, &driver_version))
                    .collect()
            },
        )
    }

    fn memory_info(&self, device: DeviceId) -> BackendResult<MemoryInfo> {
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemGetInfo", %device),
            || {
                self.set_device(Operation::MemoryInfo, device)?;
                let (free, total) = self.check(
                    Operation::MemoryInfo,
                    self.api().call_mem_get_info(),
                    || format!("hipMemGetInfo({device})"),
                )?;
                Ok(MemoryInfo {
                    free: to_u64(free),
                    total: to_u64(total),
                })
            },
        )
    }

    fn granularity(&self, properties: &AllocationProperties) -> BackendResult<Granularity> {
        let device = properties.device;
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemGetAllocationGranularity", %device),
            || {
                self.set_device(Operation::Granularity, device)?;
                let prop = self.prop(Operation::Granularity, device, properties.handle_type)?;
                Ok(Granularity {
                    minimum: self.granularity_of(&prop, HIP_MEM_ALLOCATION_GRANULARITY_MINIMUM)?,
                    recommended: self
                        .granularity_of(&prop, HIP_MEM_ALLOCATION_GRANULARITY_RECOMMENDED)?,
                })
            },
        )
    }

    fn reserve(
        &self,
        size: u64,
        alignment: u64,
        fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress> {
        let op = Operation::Reserve;
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemAddressReserve", size, alignment),
            || {
                let hint = fixed_address.map_or(std::ptr::null_mut(), to_ptr);
                let ptr = self.check(
                    op,
                    self.api().call_mem_address_reserve(
                        to_usize(op, "size", size)?,
                        to_usize(op, "alignment", alignment)?,
                        hint,
                    ),
                    || {
                        format!(
                            "hipMemAddressReserve(size {size}, alignment {alignment}, hint {fixed_address:?})"
                        )
                    },
                )?;
                Ok(from_ptr(ptr))
            },
        )
    }

    fn free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        let op = Operation::Free;
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemAddressFree", %address, size),
            || {
                let len = to_usize(op, "size", size)?;
                self.check(
                    op,
                    self.api().call_mem_address_free(to_ptr(address), len),
                    || format!("hipMemAddressFree({address}, {size})"),
                )
            },
        )
    }

    fn create(
        &self,
        size: u64,
        properties: &AllocationProperties,
    ) -> BackendResult<PhysicalHandle> {
        let op = Operation::Create;
        let device = properties.device;
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemCreate", %device, size),
            || {
                self.set_device(op, device)?;
                let prop = self.prop(op, device, properties.handle_type)?;
                let len = to_usize(op, "size", size)?;
                let handle = self.check(op, self.api().call_mem_create(len, &prop), || {
                    format!("hipMemCreate(size {size}, {prop:?})")
                })?;
                Ok(handle_of(handle))
            },
        )
    }

    fn release(&self, handle: PhysicalHandle) -> BackendResult<()> {
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemRelease", %handle),
            || {
                self.check(
                    Operation::Release,
                    self.api().call_mem_release(handle_ptr(handle)),
                    || format!("hipMemRelease({handle})"),
                )
            },
        )
    }

    fn map(&self, address: DeviceAddress, size: u64, handle: PhysicalHandle) -> BackendResult<()> {
        let op = Operation::Map;
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemMap", %address, size, %handle),
            || {
                let len = to_usize(op, "size", size)?;
                self.check(
                    op,
                    self.api()
                        .call_mem_map(to_ptr(address), len, handle_ptr(handle)),
                    || format!("hipMemMap({address}, size {size}, offset 0, {handle})"),
                )
            },
        )
    }

    fn set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> BackendResult<()> {
        let op = Operation::SetAccess;
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemSetAccess", %address, size),
            || {
                let descs = access
                    .iter()
                    .map(|d| {
                        Ok(HipMemAccessDesc {
                            location: HipMemLocation {
                                type_: HIP_MEM_LOCATION_TYPE_DEVICE,
                                id: ordinal(op, d.device)?,
                            },
                            flags: access_flags(d.access),
                        })
                    })
                    .collect::<BackendResult<Vec<_>>>()?;
                let len = to_usize(op, "size", size)?;
                self.check(
                    op,
                    self.api().call_mem_set_access(to_ptr(address), len, &descs),
                    || format!("hipMemSetAccess({address}, size {size}, {access:?})"),
                )
            },
        )
    }

    fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        let op = Operation::Unmap;
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemUnmap", %address, size),
            || {
                let len = to_usize(op, "size", size)?;
                self.check(op, self.api().call_mem_unmap(to_ptr(address), len), || {
                    format!("hipMemUnmap({address}, {size})")
                })
            },
        )
    }

    fn synchronize(&self, device: DeviceId) -> BackendResult<()> {
        let op = Operation::Synchronize;
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipDeviceSynchronize", %device),
            || {
                self.set_device(op, device)?;
                self.check(op, self.api().call_device_synchronize(), || {
                    format!("hipDeviceSynchronize({device})")
                })
            },
        )
    }

    fn copy_to_device(&self, dst: DeviceAddress, src: &[u8]) -> BackendResult<()> {
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemcpyHtoD", %dst, bytes = src.len()),
            || {
                self.check(
                    Operation::CopyToDevice,
                    self.api().call_memcpy_htod(to_ptr(dst), src),
                    || format!("hipMemcpyHtoD({dst}, {} bytes)", src.len()),
                )
            },
        )
    }

    fn copy_from_device(&self, dst: &mut [u8], src: DeviceAddress) -> BackendResult<()> {
        let len = dst.len();
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemcpyDtoH", %src, bytes = len),
            || {
                self.check(
                    Operation::CopyFromDevice,
                    self.api().call_memcpy_dtoh(dst, to_ptr(src)),
                    || format!("hipMemcpyDtoH({src}, {len} bytes)"),
                )
            },
        )
    }

    fn export_posix_fd(&self, handle: PhysicalHandle) -> BackendResult<OwnedFd> {
        let op = Operation::Export;
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemExportToShareableHandle", %handle),
            || {
                if !self.posix_fd {
                    return Err(self.not_supported(op));
                }
                let Some(result) = self
                    .api()
                    .call_export_posix_fd(handle_ptr(handle), HIP_MEM_HANDLE_TYPE_POSIX_FD)
                else {
                    return Err(self.not_supported(op));
                };
                let fd = self.check(op, result, || {
                    format!("hipMemExportToShareableHandle({handle}, POSIX fd)")
                })?;
                if fd < 0 {
                    return Err(BackendError::raised(
                        op,
                        ErrorKind::Other,
                        format!(
                            "hipMemExportToShareableHandle({handle}) succeeded but returned fd {fd}"
                        ),
                    ));
                }
                // SAFETY: the runtime just created `fd` for us and hands its ownership to the
                // caller.
                Ok(unsafe { OwnedFd::from_raw_fd(fd) })
            },
        )
    }

    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> BackendResult<bool> {
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipDeviceCanAccessPeer", %device, %peer),
            || self.peer_access(device, peer),
        )
    }

    fn import_posix_fd(
        &self,
        device: DeviceId,
        fd: BorrowedFd<'_>,
    ) -> BackendResult<PhysicalHandle> {
        let op = Operation::Import;
        let raw = fd.as_raw_fd();
        traced(
            tracing::debug_span!("kvvm_hip", op = "hipMemImportFromShareableHandle", fd = raw, %device),
            || {
                if !self.posix_fd {
                    return Err(self.not_supported(op));
                }
                self.set_device(op, device)?;
                // As with CUDA, a POSIX fd is passed *by value* in the pointer argument
                // (`(void*)(uintptr_t)fd`); the runtime does not take ownership of it.
                let value = usize::try_from(raw).map_err(|_| {
                    BackendError::raised(op, ErrorKind::InvalidValue, format!("fd {raw}"))
                })?;
                let os_handle = std::ptr::without_provenance_mut::<c_void>(value);
                let Some(result) = self
                    .api()
                    .call_import_posix_fd(os_handle, HIP_MEM_HANDLE_TYPE_POSIX_FD)
                else {
                    return Err(self.not_supported(op));
                };
                let handle = self.check(op, result, || {
                    format!("hipMemImportFromShareableHandle(fd {raw}, POSIX fd)")
                })?;
                Ok(handle_of(handle))
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<HipBackend>();
        assert_send_sync::<HipRuntime>();
    }
}
