//! # kvvm-hal: the backend-neutral virtual-memory interface
//!
//! This crate defines [`VirtualMemoryBackend`], the one trait every vendor plugin of kvvm
//! implements (the simulated driver, the CUDA driver, the HIP runtime, the host's own virtual
//! memory), together with the
//! neutral types it speaks ([`DeviceAddress`], [`PhysicalHandle`], [`DeviceId`], [`Access`]) and
//! its error type [`BackendError`].
//!
//! ## The contract
//!
//! A backend **translates; it does not decide.** Each trait method corresponds to one driver
//! call (or a short fixed sequence that the driver needs for one logical step, such as making
//! a context current), and reports exactly what the driver reported:
//!
//! * **Validation lives above the trait.** The manager (`kvvm-vmm`) checks sizes against the
//!   granularity, keeps maps inside their reservations, never maps over a live mapping, never
//!   releases a handle twice, and does all size arithmetic with overflow checks. A backend
//!   passes arguments through and maps the driver's return code onto an [`ErrorKind`]. Where
//!   a real driver is *silent* about a misuse (a map that runs past the end of its reservation
//!   succeeds on CUDA), the simulated backend refuses with [`ErrorKind::InvalidValue`] so that
//!   such bugs surface in tests; real backends do not add checks of their own, except where
//!   the OS underneath would silently do something else (the host backend, over `mmap`, keeps
//!   the driver's bookkeeping and refuses as the driver does).
//! * **A backend never panics.** A missing library, a missing symbol, a missing device or an
//!   unknown return code is a [`BackendError`], never a panic or undefined behaviour.
//! * **Err does not always mean nothing happened.** A single driver call is all-or-nothing as
//!   far as the drivers document, but the layers above compose several calls; they roll back or
//!   record what is left (see the `kvvm-vmm` crate).
//! * **Backends are `Send + Sync`.** Any method may be called from any thread; a backend makes
//!   whatever per-thread driver state it needs (for CUDA, the device's primary context) current
//!   on the calling thread itself.
//! * **The trait is object-safe**: no associated types, no generic methods, so it is used as
//!   `&dyn VirtualMemoryBackend` / `Arc<dyn VirtualMemoryBackend>`.
//!
//! ## Semantics every backend shares
//!
//! These are the driver behaviours measured on an NVIDIA H200 (see `docs/driver-semantics.md`)
//! and checked by the conformance suite (`kvvm-conformance`) on every backend:
//!
//! | misuse | [`ErrorKind`] |
//! |---|---|
//! | unmap of part of one mapping | `InvalidValue` (a mapping is unmapped whole) |
//! | map of part of a handle (a size other than the handle's, e.g. granule/2) | `NotSupported` |
//! | map of a whole handle over an already-mapped address | `InvalidValue` |
//! | map of a whole handle at an address not aligned to the granule | `InvalidValue` |
//! | map of a whole handle at an address that is not reserved | `InvalidValue` |
//! | create or reserve of a size that is not a granule multiple | `InvalidValue` |
//! | second release of a handle, second free of a range | `InvalidValue` |
//! | free of a range that still holds a mapping | `InvalidValue` |
//! | a copy through a mapping that has no access yet, or a write through a `Read` mapping | `InvalidValue` |
//! | physical memory exhausted; a reservation larger than the address space | `OutOfMemory` |
//!
//! and two that are *not* errors: releasing a handle that is still mapped succeeds and defers
//! the free until its last mapping is unmapped; unmapping a range with no mapping succeeds.
//!
//! ## Errors
//!
//! Every failure is a [`BackendError`] that carries the [`Operation`], the vendor's numeric
//! code and its name, and an [`ErrorKind`] a caller can act on:
//!
//! * [`ErrorKind::OutOfMemory`]: physical memory (or address space) is exhausted. Retry later
//!   or shed load; the device is still usable.
//! * [`ErrorKind::InvalidValue`]: the arguments were wrong for the driver's current state. This
//!   is a bug in the caller (or an injected fault in tests).
//! * [`ErrorKind::NotSupported`]: the driver cannot do this (a map of part of a handle, an
//!   export type the device lacks). A map over a live mapping or at an unaligned address is
//!   `InvalidValue`, as the table above says.
//! * [`ErrorKind::Unavailable`]: the backend cannot be used at all here: library, symbol or
//!   device missing, or the runtime too old. The message says which. Choose another backend.
//! * [`ErrorKind::DeviceLost`]: the context is unusable (a kernel fault, a lost device). Memory
//!   on that device cannot be proven idle; the manager quarantines it.
//! * [`ErrorKind::Other`]: any other driver code, reported with its number and name.

//!
//! ## Shared by every backend
//!
//! * [`traced`]: the one tracing span a backend opens per driver call;
//! * [`LatencyModel`]: the modelled cost of each call (by default a fit of the H200 by handle size and mapping), spent or
//!   accounted by the simulator and used by the workload's counting wrapper;
//! * [`CallCounts`]: calls counted per [`Operation`];
//! * [`ErrorCodes`]: a vendor's error codes, one `(code, name, kind)` table a backend reads for
//!   the name and the kind of a code;
//! * [`BackendError::raised`], [`BackendError::usize_arg`] and [`DeviceId::ordinal`]: errors a
//!   backend raises itself, with no vendor code;
//! * [`decorate`]: backends that wrap any backend, [`decorate::FaultInjecting`] (fail the Nth
//!   call of chosen operations) and [`decorate::Recording`] (books of every range, handle and
//!   mapping made through it), so that fault injection and leak checks run on every backend,
//!   both over [`decorate::Forward`], the forwarding base any wrapper backend is written on;
//! * [`model::DriverModel`]: the driver's state (ranges, allocations, handles, mappings and
//!   their access) with the checks of the contract table above, kept once for the simulator,
//!   the host backend, the recorder and the workload's counting wrapper.

#![forbid(unsafe_code)]

mod calls;
mod codes;
mod cost;
pub mod decorate;
mod error;
mod host;
pub mod model;
pub mod sync;
mod trace;
mod types;

pub use calls::CallCounts;
pub use codes::ErrorCodes;
pub use cost::LatencyModel;
pub use error::{BackendError, ErrorKind, Operation};
pub use host::{EventHandle, HostBuffer, HostCopy};
pub use trace::traced;
pub use types::{
    Access, AccessDescriptor, AllocationProperties, Capabilities, DeviceAddress, DeviceId,
    DeviceInfo, Granularity, KernelProbeOp, MemoryInfo, PhysicalHandle, RowCopy,
    ShareableHandleType, StreamHandle,
};

use std::os::fd::{BorrowedFd, OwnedFd};

/// Result type of every backend call.
pub type BackendResult<T> = Result<T, BackendError>;

/// Optional extension for backends that can launch tiny probe kernels on the device.
///
/// The conformance suite uses it to check that a `Read` mapping is enforced by the hardware
/// for kernels, not only for copies: a load through a read-only alias must succeed, a store
/// through it must fault. Backends without kernels (the simulator) return `None` from
/// [`VirtualMemoryBackend::kernel_probe`] and those cases are skipped.
pub trait KernelProbe: Send + Sync {
    /// Launches a kernel on `device` that performs `op` on `len` bytes at `address`, then
    /// synchronizes the device and reports the result.
    ///
    /// For [`KernelProbeOp::Load`], the returned value is the wrapping sum of the bytes read.
    /// For [`KernelProbeOp::Store`], every byte is overwritten with `value` and 0 is returned.
    /// A fault during the kernel is reported as an error of kind [`ErrorKind::DeviceLost`]; the
    /// device's context may be unusable afterwards (run faulting probes in a child process).
    fn run(
        &self,
        device: DeviceId,
        op: KernelProbeOp,
        address: DeviceAddress,
        len: u64,
        value: u8,
    ) -> BackendResult<u64>;

    /// Whether a faulting probe leaves the device and the process usable, so that a fault may
    /// be provoked in this process. False unless a backend says otherwise: on a GPU a kernel
    /// fault is sticky (the context is lost) and on the host the MMU ends the process, so the
    /// conformance suite runs faulting probes in a child process there.
    fn faults_are_recoverable(&self) -> bool {
        false
    }
}

/// The backend-neutral virtual-memory interface of a GPU driver.
///
/// See the crate documentation for the contract: who validates what, and what each error
/// means. All sizes are in bytes; every address, size and alignment given to `reserve`,
/// `create`, `map`, `set_access` and `unmap` must be a multiple of the device's minimum
/// granularity ([`VirtualMemoryBackend::granularity`]).
pub trait VirtualMemoryBackend: Send + Sync {
    /// The backend's short name: `"sim"`, `"cuda"`, `"hip"` or `"host"`.
    fn name(&self) -> &str;

    /// What this backend and its driver can do; the manager adapts to it.
    fn capabilities(&self) -> Capabilities;

    /// Lists the devices this backend can use, in ordinal order.
    fn devices(&self) -> BackendResult<Vec<DeviceInfo>>;

    /// Free and total physical memory of `device` as the driver reports it.
    fn memory_info(&self, device: DeviceId) -> BackendResult<MemoryInfo>;

    /// Minimum and recommended granularity for allocations with `properties`.
    fn granularity(&self, properties: &AllocationProperties) -> BackendResult<Granularity>;

    /// Reserves `size` bytes of device virtual address space aligned to `alignment`
    /// (0: the granularity). `fixed_address` is a hint: the driver uses it when that range is
    /// free and may return another address otherwise. No physical memory is used.
    fn reserve(
        &self,
        size: u64,
        alignment: u64,
        fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress>;

    /// Frees a range returned by [`reserve`](Self::reserve); `size` must be the reserved size.
    /// Fails with `InvalidValue` while a mapping inside it is live.
    fn free(&self, address: DeviceAddress, size: u64) -> BackendResult<()>;

    /// Creates a physical allocation of `size` bytes on `properties.device`.
    fn create(&self, size: u64, properties: &AllocationProperties)
        -> BackendResult<PhysicalHandle>;

    /// Releases a physical handle. If the handle is still mapped, this succeeds and the memory
    /// is freed when its last mapping is unmapped.
    fn release(&self, handle: PhysicalHandle) -> BackendResult<()>;

    /// Maps `handle` (offset 0) at `address`, inside a reserved range. `size` must be the
    /// handle's size: drivers map a handle whole (a partial map is `NotSupported`). The
    /// mapping has no access until [`set_access`](Self::set_access) is called.
    fn map(&self, address: DeviceAddress, size: u64, handle: PhysicalHandle) -> BackendResult<()>;

    /// Sets the access of each listed device to the mapped range `[address, address + size)`.
    /// The range may span several adjacent mappings (one call over a whole commit).
    fn set_access(
        &self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> BackendResult<()>;

    /// Unmaps the mappings in `[address, address + size)`. Each mapping must be covered whole;
    /// a range with no mapping is not an error. Whether one call may cover several mappings is
    /// given by [`Capabilities::unmap_spans_mappings`].
    fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()>;

    /// Waits until all work queued on `device` has finished. Teardown calls it before
    /// unmapping; a failure means the memory cannot be proven idle.
    fn synchronize(&self, device: DeviceId) -> BackendResult<()>;

    /// Copies `src` from host memory to the device at `dst` (synchronously).
    fn copy_to_device(&self, dst: DeviceAddress, src: &[u8]) -> BackendResult<()>;

    /// Copies `dst.len()` bytes from the device at `src` into host memory (synchronously).
    fn copy_from_device(&self, dst: &mut [u8], src: DeviceAddress) -> BackendResult<()>;

    /// Queues on `stream` a copy of `copy.rows` rows of `copy.width` bytes from device memory
    /// to device memory (see [`RowCopy`]) and returns without waiting for it; work queued on
    /// the same stream before it is done first, work queued after it sees its bytes. Backends
    /// without streams (the host backend, the simulator) copy at once. The default says
    /// `NotSupported`.
    ///
    /// The destination must be mapped with write access for the whole copy and the source
    /// readable, and both must stay so until the copy is done; the layer above checks the
    /// destination (on a GPU a store into an unmapped or read-only mapping faults on the
    /// device and its context is lost, a fault the driver reports later). A backend whose
    /// "device" memory is host memory (the host backend) checks both ranges against its own
    /// mappings and refuses anything else with `InvalidValue`: no call can touch host memory
    /// that is not a mapping.
    fn copy_rows_async(&self, copy: &RowCopy, stream: StreamHandle) -> BackendResult<()> {
        let _ = (copy, stream);
        Err(BackendError::raised(
            Operation::CopyRows,
            ErrorKind::NotSupported,
            format!("the {} backend cannot copy rows on a stream", self.name()),
        ))
    }

    /// Allocates `bytes` of page-locked ("pinned") host memory that `device`'s copy engines
    /// reach directly (CUDA: `cuMemHostAlloc`, portable to every context): the memory a host
    /// tier keeps KV windows in. It is reached only through
    /// [`copy_to_host_async`](Self::copy_to_host_async) and
    /// [`copy_from_host_async`](Self::copy_from_host_async), which refuse any byte outside it.
    /// Backends without host copies ([`Capabilities::host_copies`]) say `NotSupported`.
    fn host_alloc(&self, device: DeviceId, bytes: u64) -> BackendResult<HostBuffer> {
        let _ = (device, bytes);
        Err(not_supported(self.name(), Operation::HostAlloc))
    }

    /// Frees a buffer of [`host_alloc`](Self::host_alloc). Every copy touching it must be done
    /// (its event waited for); a second free is `InvalidValue`.
    fn host_free(&self, buffer: HostBuffer) -> BackendResult<()> {
        let _ = buffer;
        Err(not_supported(self.name(), Operation::HostFree))
    }

    /// Queues on `stream` a copy of `copy.bytes` from device memory at `copy.device` into the
    /// host buffer at `copy.offset` and returns without waiting (CUDA: `cuMemcpyDtoHAsync`);
    /// work queued on `stream` before it is done first. The device range must be mapped and
    /// readable and stay so until the copy is done; a host range outside the buffer is
    /// `InvalidValue` before anything is queued. Backends without streams copy at once.
    fn copy_to_host_async(&self, copy: &HostCopy, stream: StreamHandle) -> BackendResult<()> {
        let _ = (copy, stream);
        Err(not_supported(self.name(), Operation::CopyToHost))
    }

    /// The mirror of [`copy_to_host_async`](Self::copy_to_host_async): queues a copy from the
    /// host buffer into device memory (mapped writable until the copy is done; CUDA:
    /// `cuMemcpyHtoDAsync`).
    fn copy_from_host_async(&self, copy: &HostCopy, stream: StreamHandle) -> BackendResult<()> {
        let _ = (copy, stream);
        Err(not_supported(self.name(), Operation::CopyFromHost))
    }

    /// The backend's own copy stream of `device`: made at the first call (CUDA: a stream that
    /// does not wait for the legacy default stream, `CU_STREAM_NON_BLOCKING`), the same one
    /// afterwards, destroyed with the backend. Copies queued on it overlap the work of other
    /// streams. Backends without streams give `StreamHandle(0)`.
    fn copy_stream(&self, device: DeviceId) -> BackendResult<StreamHandle> {
        let _ = device;
        Err(not_supported(self.name(), Operation::Stream))
    }

    /// Records a new event on `stream` of `device` (CUDA: `cuEventCreate` without timing, then
    /// `cuEventRecord`): it completes when the work queued on `stream` before it is done.
    /// The caller destroys it with [`event_destroy`](Self::event_destroy). Backends without
    /// streams give an event that is complete at once.
    fn event_record(&self, device: DeviceId, stream: StreamHandle) -> BackendResult<EventHandle> {
        let _ = (device, stream);
        Err(not_supported(self.name(), Operation::Event))
    }

    /// Whether `event` is complete, without waiting (CUDA: `cuEventQuery`). An error is the
    /// failure of the work it follows (a copy that faulted) or an unknown event.
    fn event_query(&self, event: EventHandle) -> BackendResult<bool> {
        let _ = event;
        Err(not_supported(self.name(), Operation::Event))
    }

    /// Waits until `event` is complete (CUDA: `cuEventSynchronize`). An error is the failure
    /// of the work it follows: the bytes it copied cannot be trusted.
    fn event_wait(&self, event: EventHandle) -> BackendResult<()> {
        let _ = event;
        Err(not_supported(self.name(), Operation::Event))
    }

    /// Makes the work queued on `stream` after this call wait, on the device, for `event`
    /// (CUDA: `cuStreamWaitEvent`): a copy that reads what a kernel wrote on another stream.
    /// The host does not wait.
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> BackendResult<()> {
        let _ = (stream, event);
        Err(not_supported(self.name(), Operation::Event))
    }

    /// Destroys an event of [`event_record`](Self::event_record) (a wait queued on it still
    /// holds; CUDA: `cuEventDestroy`). A second destroy is `InvalidValue`.
    fn event_destroy(&self, event: EventHandle) -> BackendResult<()> {
        let _ = event;
        Err(not_supported(self.name(), Operation::Event))
    }

    /// Exports a handle created with `ShareableHandleType::PosixFd` as a file descriptor.
    /// Fails with `NotSupported` when [`Capabilities::posix_fd_handles`] is false.
    fn export_posix_fd(&self, handle: PhysicalHandle) -> BackendResult<OwnedFd>;

    /// Imports, on `device` (the device the memory was created on, whose context the driver
    /// call runs under), a file descriptor made by
    /// [`export_posix_fd`](Self::export_posix_fd) (possibly in another process) as a new handle
    /// to the same physical memory. The new handle is released on its own; the memory lives
    /// until every handle is released and unmapped.
    fn import_posix_fd(
        &self,
        device: DeviceId,
        fd: BorrowedFd<'_>,
    ) -> BackendResult<PhysicalHandle>;

    /// Whether memory on `device` can be given access from `peer` (peer access: a
    /// [`set_access`](Self::set_access) descriptor for `peer` over a mapping of `device`'s
    /// memory). Always true for `peer == device`. The default, for backends with one device
    /// or no peer links, says no for every other device.
    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> BackendResult<bool> {
        Ok(device == peer)
    }

    /// Probe kernels, for backends that can launch them (see [`KernelProbe`]).
    fn kernel_probe(&self) -> Option<&dyn KernelProbe> {
        None
    }
}

/// The `NotSupported` error of a host-tier call on a backend without host copies.
fn not_supported(backend: &str, op: Operation) -> BackendError {
    BackendError::raised(
        op,
        ErrorKind::NotSupported,
        format!("the {backend} backend has no page-locked host memory or host copies"),
    )
}

impl std::fmt::Debug for dyn VirtualMemoryBackend + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtualMemoryBackend")
            .field("name", &self.name())
            .field("capabilities", &self.capabilities())
            .finish()
    }
}

impl dyn VirtualMemoryBackend + '_ {
    /// The name [`VirtualMemoryBackend::devices`] gives `device`, or `None` when the device
    /// is not listed or the devices cannot be enumerated (what a report prints as a header).
    pub fn device_name(&self, device: DeviceId) -> Option<String> {
        self.devices()
            .ok()
            .and_then(|d| d.into_iter().find(|d| d.id == device))
            .map(|d| d.name)
    }
}
