//! # kvvm-hip: the HIP (ROCm) backend of kvvm
//!
//! [`HipBackend`] implements [`VirtualMemoryBackend`] over the HIP runtime's virtual-memory API
//! (`hipMemAddressReserve`, `hipMemCreate`, `hipMemMap`, `hipMemSetAccess`, ...). It follows
//! the contract of `kvvm-hal`: it translates, it does not decide, and it never panics.
//!
//! ## Loading
//!
//! The runtime is loaded at run time with `libloading`; nothing links `libamdhip64` at build
//! time, so the crate builds and its tests run on machines without ROCm.
//!
//! 1. If `KVVM_HIP_LIBRARY` is set (and not empty), that path is loaded and nothing else is
//!    tried. Otherwise `libamdhip64.so`, `libamdhip64.so.7`, `.so.6`, `.so.5` are tried in
//!    order.
//! 2. Every entry point is resolved up front into [`sys::HipApi`]. A missing library or a
//!    missing required symbol is an [`ErrorKind::Unavailable`] error of [`Operation::Load`]
//!    whose message names what is missing.
//! 3. `hipRuntimeGetVersion` picks the `hipMemAllocationProp` layout ([`version::layout_for`]);
//!    a runtime outside the verified range is refused with `Unavailable`, naming the version.
//! 4. `hipInit(0)` and `hipGetDeviceCount`; no AMD GPU gives `Unavailable` with a message like
//!    `no HIP device (hipErrorNoDevice, HIP runtime 5.2.21153)`, within milliseconds.
//!
//! The runtime is never unloaded (not even after a failed open): the HIP runtime starts
//! threads and registers exit handlers, and `dlclose` under them crashes. The cost is one
//! loaded library per process.
//!
//! ## ABI handling
//!
//! * **Return codes are raw `i32`**, never a Rust enum: a newer runtime may return a code this
//!   crate does not know, which would be undefined behaviour in an enum. [`codes`] names and
//!   classifies them with our own table (falling back to `hipGetErrorName`, then
//!   `"hipError(<n>)"`).
//! * **`hipMemAllocationProp` changed layout** between ROCm 5.2 (`compressionType` first) and
//!   ROCm >= 5.4 (CUDA's layout), keeping the same 32-byte size, so a wrong guess is silent
//!   memory corruption of the request, not a crash. Both layouts are hand-written in [`sys`]
//!   with `offset_of!` assertions that fail the build on drift, and the runtime's own version
//!   chooses between them. The `hip-sys-check` feature compares the >= 5.4 layout with
//!   hip-sys 0.1.2's bindgen output (see README.md).
//! * Enum values (pinned = 1, location device = 1, access 0/1/3, handle type none/POSIX-FD =
//!   0/1, granularity minimum/recommended = 0/1) are the same in every release and are passed
//!   as 32-bit integers.
//! * Addresses are `void*` and a physical handle is an opaque pointer; both travel through the
//!   neutral `u64` types unchanged. This crate requires a 64-bit target.
//!
//! ## Threads and devices
//!
//! HIP keeps a current device per thread. Calls tied to a device (`create`, `granularity`,
//! `memory_info`, `synchronize`) call `hipSetDevice` on the calling thread first. Calls on
//! addresses or handles (`reserve`, `map`, `set_access`, `unmap`, copies, `release`) act on
//! process-wide virtual addresses and use whatever device the thread has (device 0 by
//! default). `import_posix_fd` imports onto the thread's current device, as HIP does.
//!
//! ## Known ROCm bugs this backend reports through [`Capabilities`]
//!
//! * `unmap_spans_mappings = false`: one `hipMemUnmap` over several mappings later makes
//!   `hipMemAddressFree` fail (ROCR-Runtime issue #285; llama.cpp unmaps mapping by mapping
//!   for that reason). The manager then unmaps one mapping per call.
//! * `set_access_retries = 3`: `hipMemSetAccess` on a newly mapped tail fails intermittently
//!   on gfx942 with ROCm 7.2 when several reservations exist, and succeeds when retried
//!   (`driver-facts.md`, "Known ROCm VMM bugs"; llama.cpp ships HIP VMM off by default).
//! * `kernels = false`: this backend launches no probe kernels.
//! * `checks_reservation_bounds = false`: like CUDA, HIP does not check that a map stays
//!   inside its reservation; the manager does.
//! * Granularity queries returned the minimum regardless of the flag before a 2025 ROCm fix;
//!   the backend reports what the runtime says and the manager only relies on `minimum`.
//!
//! ## Device attributes
//!
//! `DeviceInfo::vmm_supported` comes from a `hipMemGetAllocationGranularity` probe on that
//! device, not from `hipDeviceGetAttribute`: ROCm 5.2 has no
//! `hipDeviceAttributeVirtualMemoryManagementSupported`, and later headers number that enum
//! alphabetically (values move between releases), so using it would mean guessing a number.

#![cfg_attr(not(target_pointer_width = "64"), allow(unused))]

#[cfg(not(target_pointer_width = "64"))]
compile_error!("kvvm-hip requires a 64-bit target (device addresses and handles are pointers)");

pub mod codes;
pub mod sys;
pub mod version;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use kvvm_hal::{
    Access, AccessDescriptor, AllocationProperties, BackendError, BackendResult, Capabilities,
    DeviceAddress, DeviceId, DeviceInfo, ErrorKind, Granularity, MemoryInfo, Operation,
    PhysicalHandle, ShareableHandleType, VirtualMemoryBackend,
};
use libloading::Library;

use crate::codes::{HIP_ERROR_NO_DEVICE, HIP_ERROR_UNKNOWN};
use crate::sys::{
    HipApi, HipErrorCode, HipMemAccessDesc, HipMemAllocationProp, HipMemAllocationPropV52,
    HipMemAllocationPropV54, HipMemLocation, HIP_MEM_ACCESS_FLAGS_PROT_NONE,
    HIP_MEM_ACCESS_FLAGS_PROT_READ, HIP_MEM_ACCESS_FLAGS_PROT_READ_WRITE,
    HIP_MEM_ALLOCATION_GRANULARITY_MINIMUM, HIP_MEM_ALLOCATION_GRANULARITY_RECOMMENDED,
    HIP_MEM_HANDLE_TYPE_NONE, HIP_MEM_HANDLE_TYPE_POSIX_FD, HIP_MEM_LOCATION_TYPE_DEVICE,
    HIP_SUCCESS,
};
pub use crate::version::{PropLayout, RuntimeVersion};

/// The environment variable naming the HIP runtime library to load instead of the defaults.
pub const LIBRARY_ENV: &str = "KVVM_HIP_LIBRARY";

/// The library names tried, in order, when [`LIBRARY_ENV`] is not set.
pub const LIBRARY_NAMES: [&str; 4] = [
    "libamdhip64.so",
    "libamdhip64.so.7",
    "libamdhip64.so.6",
    "libamdhip64.so.5",
];

/// Extra `hipMemSetAccess` attempts the manager makes on a transient failure (gfx942 / ROCm
/// 7.2, see the crate documentation).
pub const SET_ACCESS_RETRIES: u32 = 3;

/// A loaded HIP runtime whose symbols are resolved and whose version is read, before
/// `hipInit`. [`HipRuntime::open`] turns it into a [`HipBackend`].
///
/// Reading the version needs no device, which is what lets CI check a real runtime on a
/// machine without an AMD GPU.
#[derive(Debug)]
pub struct HipRuntime {
    /// Never dropped: unloading the HIP runtime under its own threads crashes.
    _library: ManuallyDrop<Library>,
    api: HipApi,
    path: String,
    version: RuntimeVersion,
}

impl HipRuntime {
    /// Loads the runtime named by `KVVM_HIP_LIBRARY`, or else the first of [`LIBRARY_NAMES`]
    /// that loads.
    pub fn load() -> BackendResult<HipRuntime> {
        match std::env::var_os(LIBRARY_ENV) {
            Some(path) if !path.is_empty() => Self::load_from(&path.to_string_lossy()),
            _ => Self::load_system(),
        }
    }

    /// Loads the first of [`LIBRARY_NAMES`] that loads, ignoring `KVVM_HIP_LIBRARY`.
    ///
    /// When none loads, the error's message starts with `no HIP runtime (libamdhip64 not
    /// found` and lists each name with the loader's reason.
    pub fn load_system() -> BackendResult<HipRuntime> {
        let mut tried = Vec::new();
        for name in LIBRARY_NAMES {
            // SAFETY: loading runs the library's initialisers; these names are the HIP
            // runtime's own sonames, whose initialisers are safe to run in any process.
            match unsafe { Library::new(name) } {
                Ok(lib) => return Self::from_library(lib, name.to_owned()),
                Err(e) => tried.push(format!("{name}: {}", describe(&e))),
            }
        }
        Err(BackendError::unavailable(
            Operation::Load,
            format!(
                "no HIP runtime (libamdhip64 not found; tried {})",
                tried.join("; ")
            ),
        ))
    }

    /// Loads the HIP runtime (or a library with the HIP ABI, such as the HIP-on-CUDA shim)
    /// at `path`. Nothing else is tried.
    pub fn load_from(path: &str) -> BackendResult<HipRuntime> {
        // SAFETY: loading runs the library's initialisers; the caller (or KVVM_HIP_LIBRARY)
        // chose this library explicitly as a HIP runtime.
        match unsafe { Library::new(path) } {
            Ok(lib) => Self::from_library(lib, path.to_owned()),
            Err(e) => Err(BackendError::unavailable(
                Operation::Load,
                format!("cannot load the HIP runtime {path}: {}", describe(&e)),
            )),
        }
    }

    fn from_library(lib: Library, path: String) -> BackendResult<HipRuntime> {
        let library = ManuallyDrop::new(lib);
        let api = HipApi::load(&library, &path)?;
        let mut raw: c_int = 0;
        // SAFETY: `raw` is a valid out-parameter for the duration of the call.
        let rc = unsafe { (api.runtime_get_version)(&mut raw) };
        if rc != HIP_SUCCESS {
            return Err(unavailable_code(&api, rc).with_detail(format!(
                "hipRuntimeGetVersion failed ({}, code {rc}) in {path}",
                error_name(&api, rc)
            )));
        }
        Ok(HipRuntime {
            _library: library,
            api,
            path,
            version: RuntimeVersion(raw),
        })
    }

    /// The runtime's version (`hipRuntimeGetVersion`).
    pub fn version(&self) -> RuntimeVersion {
        self.version
    }

    /// The library that was loaded (a soname or the path given).
    pub fn library(&self) -> &str {
        &self.path
    }

    /// The resolved entry points.
    pub fn api(&self) -> &HipApi {
        &self.api
    }

    /// The `hipMemAllocationProp` layout of this runtime, or `Unavailable` naming the version
    /// when it is outside the verified range.
    pub fn layout(&self) -> BackendResult<PropLayout> {
        version::layout_for(self.version).map_err(|reason| {
            BackendError::unavailable(Operation::Load, format!("{reason} ({})", self.path))
        })
    }

    /// Initialises the runtime (`hipInit(0)`, `hipGetDeviceCount`) and returns the backend.
    ///
    /// Fails with `Unavailable` when the version is outside the verified range, when the
    /// runtime cannot initialise, or when there is no device (`no HIP device
    /// (hipErrorNoDevice, HIP runtime X.Y.Z)`).
    pub fn open(self) -> BackendResult<HipBackend> {
        let layout = self.layout()?;
        let api = self.api;
        let version = self.version;
        // SAFETY: hipInit takes flags by value; 0 is the only documented value.
        let init_rc = unsafe { (api.init)(0) };
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-parameter for the duration of the call.
        let count_rc = unsafe { (api.get_device_count)(&mut count) };
        tracing::debug!(
            library = %self.path, %version, init_rc, count_rc, count, "HIP runtime initialised"
        );
        let init_note = if init_rc == HIP_SUCCESS {
            String::new()
        } else {
            format!("; hipInit(0) returned {}", error_name(&api, init_rc))
        };
        if count_rc == HIP_ERROR_NO_DEVICE || (count_rc == HIP_SUCCESS && count <= 0) {
            return Err(BackendError::new(
                Operation::Load,
                ErrorKind::Unavailable,
                i64::from(HIP_ERROR_NO_DEVICE),
                "hipErrorNoDevice",
            )
            .with_detail(format!(
                "no HIP device (hipErrorNoDevice, HIP runtime {version}){init_note}; library {}",
                self.path
            )));
        }
        if count_rc != HIP_SUCCESS {
            return Err(unavailable_code(&api, count_rc).with_detail(format!(
                "hipGetDeviceCount failed ({}, HIP runtime {version}){init_note}; library {}",
                error_name(&api, count_rc),
                self.path
            )));
        }
        if init_rc != HIP_SUCCESS {
            return Err(unavailable_code(&api, init_rc).with_detail(format!(
                "hipInit(0) failed ({}, HIP runtime {version}); library {}",
                error_name(&api, init_rc),
                self.path
            )));
        }
        let device_count = u32::try_from(count).unwrap_or(0);
        let mut backend = HipBackend {
            runtime: self,
            layout,
            device_count,
            posix_fd: false,
        };
        backend.posix_fd = backend.api().mem_export_to_shareable_handle.is_some()
            && backend.api().mem_import_from_shareable_handle.is_some()
            && backend.probe_granularity(DeviceId(0), ShareableHandleType::PosixFd)?;
        Ok(backend)
    }
}

/// The HIP backend: a loaded, initialised HIP runtime with at least one device.
///
/// Open it with [`HipBackend::open`] (or [`HipRuntime`] for finer steps). It is `Send + Sync`;
/// every method may be called from any thread.
#[derive(Debug)]
pub struct HipBackend {
    runtime: HipRuntime,
    layout: PropLayout,
    device_count: u32,
    posix_fd: bool,
}

impl HipBackend {
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

    fn api(&self) -> &HipApi {
        &self.runtime.api
    }

    /// Ok when `rc` is `hipSuccess`; else the typed error, with `call` as detail.
    fn check(
        &self,
        op: Operation,
        rc: HipErrorCode,
        call: impl FnOnce() -> String,
    ) -> BackendResult<()> {
        tracing::trace!(op = op.as_str(), rc, "hip call");
        if rc == HIP_SUCCESS {
            Ok(())
        } else {
            let e = driver_error(self.api(), op, rc).with_detail(call());
            tracing::debug!(error = %e, "hip call failed");
            Err(e)
        }
    }

    fn set_device(&self, op: Operation, device: DeviceId) -> BackendResult<()> {
        let ordinal = ordinal(op, device)?;
        // SAFETY: hipSetDevice takes the ordinal by value.
        let rc = unsafe { (self.api().set_device)(ordinal) };
        self.check(op, rc, || format!("hipSetDevice({ordinal})"))
    }

    fn prop(
        &self,
        op: Operation,
        device: DeviceId,
        handle_type: ShareableHandleType,
    ) -> BackendResult<HipMemAllocationProp> {
        let id = ordinal(op, device)?;
        let handle = match handle_type {
            ShareableHandleType::None => HIP_MEM_HANDLE_TYPE_NONE,
            ShareableHandleType::PosixFd => HIP_MEM_HANDLE_TYPE_POSIX_FD,
        };
        Ok(match self.layout {
            PropLayout::Rocm52 => {
                HipMemAllocationProp::V52(HipMemAllocationPropV52::pinned_device(id, handle))
            }
            PropLayout::Rocm54 => {
                HipMemAllocationProp::V54(HipMemAllocationPropV54::pinned_device(id, handle))
            }
        })
    }

    fn granularity_of(&self, prop: &HipMemAllocationProp, flag: u32) -> BackendResult<u64> {
        let mut g: usize = 0;
        let p = prop.as_ptr();
        // SAFETY: `g` is a valid out-parameter; `p` points to a live hipMemAllocationProp in
        // the layout of the loaded runtime.
        let rc = unsafe { (self.api().mem_get_allocation_granularity)(&mut g, p, flag) };
        self.check(Operation::Granularity, rc, || {
            format!("hipMemGetAllocationGranularity({prop:?}, option {flag})")
        })?;
        Ok(g as u64)
    }

    /// Whether a granularity query for `handle_type` on `device` succeeds: the runtime
    /// supports VMM allocations of that kind there. Refusals (`NotSupported`,
    /// `InvalidValue`) are `false`; other failures are errors.
    fn probe_granularity(
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

    fn driver_version(&self) -> String {
        let mut s = format!("HIP runtime {}", self.runtime.version);
        if let Some(f) = self.api().driver_get_version {
            let mut v: c_int = 0;
            // SAFETY: `v` is a valid out-parameter for the duration of the call.
            if unsafe { f(&mut v) } == HIP_SUCCESS && v > 0 {
                s.push_str(&format!(", driver {v}"));
            }
        }
        s
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
        }
    }

    fn devices(&self) -> BackendResult<Vec<DeviceInfo>> {
        let driver_version = self.driver_version();
        let mut out = Vec::new();
        for index in 0..self.device_count {
            let id = DeviceId(index);
            let ordinal = ordinal(Operation::Devices, id)?;
            let mut buf = [0u8; 256];
            let len = buf.len() as c_int;
            // SAFETY: `buf` is writable for `len` bytes; the runtime NUL-terminates within it.
            let rc = unsafe {
                (self.api().device_get_name)(buf.as_mut_ptr().cast::<c_char>(), len, ordinal)
            };
            self.check(Operation::Devices, rc, || {
                format!("hipDeviceGetName(device {ordinal})")
            })?;
            if let Some(last) = buf.last_mut() {
                *last = 0;
            }
            let name = CStr::from_bytes_until_nul(&buf)
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default();
            let mut total: usize = 0;
            // SAFETY: `total` is a valid out-parameter for the duration of the call.
            let rc = unsafe { (self.api().device_total_mem)(&mut total, ordinal) };
            self.check(Operation::Devices, rc, || {
                format!("hipDeviceTotalMem(device {ordinal})")
            })?;
            let vmm_supported = self.probe_granularity(id, ShareableHandleType::None)?;
            let posix_fd_supported =
                self.posix_fd && self.probe_granularity(id, ShareableHandleType::PosixFd)?;
            out.push(DeviceInfo {
                id,
                name,
                total_memory: total as u64,
                vmm_supported,
                posix_fd_supported,
                driver_version: driver_version.clone(),
            });
        }
        Ok(out)
    }

    fn memory_info(&self, device: DeviceId) -> BackendResult<MemoryInfo> {
        self.set_device(Operation::MemoryInfo, device)?;
        let (mut free, mut total): (usize, usize) = (0, 0);
        // SAFETY: both out-parameters are valid for the duration of the call.
        let rc = unsafe { (self.api().mem_get_info)(&mut free, &mut total) };
        self.check(Operation::MemoryInfo, rc, || {
            format!("hipMemGetInfo({device})")
        })?;
        Ok(MemoryInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn granularity(&self, properties: &AllocationProperties) -> BackendResult<Granularity> {
        self.set_device(Operation::Granularity, properties.device)?;
        let prop = self.prop(
            Operation::Granularity,
            properties.device,
            properties.handle_type,
        )?;
        Ok(Granularity {
            minimum: self.granularity_of(&prop, HIP_MEM_ALLOCATION_GRANULARITY_MINIMUM)?,
            recommended: self.granularity_of(&prop, HIP_MEM_ALLOCATION_GRANULARITY_RECOMMENDED)?,
        })
    }

    fn reserve(
        &self,
        size: u64,
        alignment: u64,
        fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        let hint = fixed_address.map_or(std::ptr::null_mut(), to_ptr);
        // SAFETY: `ptr` is a valid out-parameter; the hint is only an address value.
        let rc = unsafe {
            (self.api().mem_address_reserve)(&mut ptr, size as usize, alignment as usize, hint, 0)
        };
        self.check(Operation::Reserve, rc, || {
            format!(
                "hipMemAddressReserve(size {size}, alignment {alignment}, hint {fixed_address:?})"
            )
        })?;
        Ok(from_ptr(ptr))
    }

    fn free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        // SAFETY: the runtime validates the range; no Rust memory is involved.
        let rc = unsafe { (self.api().mem_address_free)(to_ptr(address), size as usize) };
        self.check(Operation::Free, rc, || {
            format!("hipMemAddressFree({address}, {size})")
        })
    }

    fn create(
        &self,
        size: u64,
        properties: &AllocationProperties,
    ) -> BackendResult<PhysicalHandle> {
        self.set_device(Operation::Create, properties.device)?;
        let prop = self.prop(Operation::Create, properties.device, properties.handle_type)?;
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: `handle` is a valid out-parameter; `prop` is a live hipMemAllocationProp in
        // the layout of the loaded runtime.
        let rc = unsafe { (self.api().mem_create)(&mut handle, size as usize, prop.as_ptr(), 0) };
        self.check(Operation::Create, rc, || {
            format!("hipMemCreate(size {size}, {prop:?})")
        })?;
        Ok(PhysicalHandle(handle.expose_provenance() as u64))
    }

    fn release(&self, handle: PhysicalHandle) -> BackendResult<()> {
        // SAFETY: the handle is an opaque runtime value; the runtime validates it.
        let rc = unsafe { (self.api().mem_release)(handle_ptr(handle)) };
        self.check(Operation::Release, rc, || {
            format!("hipMemRelease({handle})")
        })
    }

    fn map(&self, address: DeviceAddress, size: u64, handle: PhysicalHandle) -> BackendResult<()> {
        // SAFETY: address and handle are opaque runtime values; the runtime validates them.
        let rc = unsafe {
            (self.api().mem_map)(to_ptr(address), size as usize, 0, handle_ptr(handle), 0)
        };
        self.check(Operation::Map, rc, || {
            format!("hipMemMap({address}, size {size}, offset 0, {handle})")
        })
    }

    fn set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> BackendResult<()> {
        let descs = access
            .iter()
            .map(|d| {
                Ok(HipMemAccessDesc {
                    location: HipMemLocation {
                        type_: HIP_MEM_LOCATION_TYPE_DEVICE,
                        id: ordinal(Operation::SetAccess, d.device)?,
                    },
                    flags: match d.access {
                        Access::None => HIP_MEM_ACCESS_FLAGS_PROT_NONE,
                        Access::Read => HIP_MEM_ACCESS_FLAGS_PROT_READ,
                        Access::ReadWrite => HIP_MEM_ACCESS_FLAGS_PROT_READ_WRITE,
                    },
                })
            })
            .collect::<BackendResult<Vec<_>>>()?;
        // SAFETY: `descs` holds `descs.len()` initialised hipMemAccessDesc for the call.
        let rc = unsafe {
            (self.api().mem_set_access)(to_ptr(address), size as usize, descs.as_ptr(), descs.len())
        };
        self.check(Operation::SetAccess, rc, || {
            format!("hipMemSetAccess({address}, size {size}, {access:?})")
        })
    }

    fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
        // SAFETY: the runtime validates the range; no Rust memory is involved.
        let rc = unsafe { (self.api().mem_unmap)(to_ptr(address), size as usize) };
        self.check(Operation::Unmap, rc, || {
            format!("hipMemUnmap({address}, {size})")
        })
    }

    fn synchronize(&self, device: DeviceId) -> BackendResult<()> {
        self.set_device(Operation::Synchronize, device)?;
        // SAFETY: no arguments.
        let rc = unsafe { (self.api().device_synchronize)() };
        self.check(Operation::Synchronize, rc, || {
            format!("hipDeviceSynchronize({device})")
        })
    }

    fn copy_to_device(&self, dst: DeviceAddress, src: &[u8]) -> BackendResult<()> {
        // SAFETY: `src` is readable for `src.len()` bytes for the whole (synchronous) call;
        // HIP declares the source `void*` but only reads it.
        let rc = unsafe {
            (self.api().memcpy_htod)(
                to_ptr(dst),
                src.as_ptr().cast_mut().cast::<c_void>(),
                src.len(),
            )
        };
        self.check(Operation::CopyToDevice, rc, || {
            format!("hipMemcpyHtoD({dst}, {} bytes)", src.len())
        })
    }

    fn copy_from_device(&self, dst: &mut [u8], src: DeviceAddress) -> BackendResult<()> {
        let len = dst.len();
        // SAFETY: `dst` is writable for `len` bytes for the whole (synchronous) call.
        let rc = unsafe {
            (self.api().memcpy_dtoh)(dst.as_mut_ptr().cast::<c_void>(), to_ptr(src), len)
        };
        self.check(Operation::CopyFromDevice, rc, || {
            format!("hipMemcpyDtoH({src}, {len} bytes)")
        })
    }

    fn export_posix_fd(&self, handle: PhysicalHandle) -> BackendResult<OwnedFd> {
        let export = match self.api().mem_export_to_shareable_handle {
            Some(f) if self.posix_fd => f,
            _ => return Err(not_supported(Operation::Export, &self.runtime)),
        };
        let mut fd: c_int = -1;
        // SAFETY: for hipMemHandleTypePosixFileDescriptor the runtime writes one `int` through
        // the first argument, which points to `fd`.
        let rc = unsafe {
            export(
                (&mut fd as *mut c_int).cast::<c_void>(),
                handle_ptr(handle),
                HIP_MEM_HANDLE_TYPE_POSIX_FD,
                0,
            )
        };
        self.check(Operation::Export, rc, || {
            format!("hipMemExportToShareableHandle({handle}, POSIX fd)")
        })?;
        if fd < 0 {
            return Err(
                BackendError::new(Operation::Export, ErrorKind::Other, 0, "invalid fd")
                    .with_detail(format!(
                        "hipMemExportToShareableHandle({handle}) succeeded but returned fd {fd}"
                    )),
            );
        }
        // SAFETY: the runtime just created `fd` for us and hands its ownership to the caller.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn import_posix_fd(&self, fd: BorrowedFd<'_>) -> BackendResult<PhysicalHandle> {
        let import = match self.api().mem_import_from_shareable_handle {
            Some(f) if self.posix_fd => f,
            _ => return Err(not_supported(Operation::Import, &self.runtime)),
        };
        let raw = fd.as_raw_fd();
        let mut handle: *mut c_void = std::ptr::null_mut();
        // As with CUDA, a POSIX fd is passed *by value* in the pointer argument
        // (`(void*)(uintptr_t)fd`); the runtime does not take ownership of it.
        let os_handle = std::ptr::without_provenance_mut::<c_void>(raw as usize);
        // SAFETY: `handle` is a valid out-parameter; `os_handle` is a value, not dereferenced.
        let rc = unsafe { import(&mut handle, os_handle, HIP_MEM_HANDLE_TYPE_POSIX_FD) };
        self.check(Operation::Import, rc, || {
            format!("hipMemImportFromShareableHandle(fd {raw}, POSIX fd)")
        })?;
        Ok(PhysicalHandle(handle.expose_provenance() as u64))
    }
}

/// A loader error with its cause (`dlopen failed: libfoo.so: cannot open shared object ...`).
fn describe(e: &libloading::Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

fn not_supported(op: Operation, runtime: &HipRuntime) -> BackendError {
    BackendError::new(op, ErrorKind::NotSupported, 0, "not supported").with_detail(format!(
        "POSIX-fd handles are not supported by the HIP runtime {} ({})",
        runtime.version, runtime.path
    ))
}

/// The name of `rc`: our table, else `hipGetErrorName`, else `hipError(<n>)`.
pub fn error_name(api: &HipApi, rc: HipErrorCode) -> String {
    if let Some(name) = codes::code_name(rc) {
        return name.to_owned();
    }
    if let Some(f) = api.get_error_name {
        // SAFETY: hipGetErrorName returns a pointer to a static NUL-terminated string (or
        // null); it is checked for null before it is read.
        let p = unsafe { f(rc) };
        if !p.is_null() {
            // SAFETY: non-null, NUL-terminated, static (see above).
            let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
            // Runtimes name every code they do not know "hipErrorUnknown": say the number.
            if !s.is_empty() && (s != "hipErrorUnknown" || rc == HIP_ERROR_UNKNOWN) {
                return s;
            }
        }
    }
    codes::unnamed(rc)
}

/// The typed error for a failed call.
fn driver_error(api: &HipApi, op: Operation, rc: HipErrorCode) -> BackendError {
    BackendError::new(
        op,
        codes::error_kind(rc),
        i64::from(rc),
        error_name(api, rc),
    )
}

/// An open-time failure: the backend cannot be used, whatever the code.
fn unavailable_code(api: &HipApi, rc: HipErrorCode) -> BackendError {
    BackendError::new(
        Operation::Load,
        ErrorKind::Unavailable,
        i64::from(rc),
        error_name(api, rc),
    )
}

fn ordinal(op: Operation, device: DeviceId) -> BackendResult<c_int> {
    c_int::try_from(device.0).map_err(|_| {
        BackendError::new(op, ErrorKind::InvalidValue, 0, "invalid device")
            .with_detail(format!("{device} does not fit a HIP device ordinal"))
    })
}

fn to_ptr(address: DeviceAddress) -> *mut c_void {
    std::ptr::with_exposed_provenance_mut(address.0 as usize)
}

fn from_ptr(ptr: *mut c_void) -> DeviceAddress {
    DeviceAddress(ptr.expose_provenance() as u64)
}

fn handle_ptr(handle: PhysicalHandle) -> *mut c_void {
    std::ptr::with_exposed_provenance_mut(handle.0 as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_unavailable_and_names_the_path() {
        let e = HipRuntime::load_from("/nonexistent/libamdhip64.so.42").expect_err("no library");
        assert_eq!(e.kind, ErrorKind::Unavailable);
        assert_eq!(e.op, Operation::Load);
        assert!(
            e.to_string().contains("/nonexistent/libamdhip64.so.42"),
            "{e}"
        );
    }

    #[test]
    fn a_library_without_hip_symbols_is_unavailable_and_names_the_symbol() {
        // libc loads everywhere and has no HIP symbol.
        let e = HipRuntime::load_from("libc.so.6").expect_err("not HIP");
        assert_eq!(e.kind, ErrorKind::Unavailable);
        let s = e.to_string();
        assert!(s.contains("hipInit") && s.contains("libc.so.6"), "{s}");
    }

    #[test]
    fn addresses_and_handles_round_trip_through_pointers() {
        let a = DeviceAddress(0x7f00_0020_0000);
        assert_eq!(from_ptr(to_ptr(a)), a);
        let h = PhysicalHandle(0x5555_0000_1234);
        assert_eq!(handle_ptr(h).expose_provenance() as u64, h.0);
    }

    #[test]
    fn backend_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<HipBackend>();
        assert_send_sync::<HipRuntime>();
    }
}
