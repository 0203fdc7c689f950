//! # kvvm-hip: the HIP (ROCm) backend of kvvm
//!
//! [`HipBackend`] implements [`VirtualMemoryBackend`](kvvm_hal::VirtualMemoryBackend) over the HIP runtime's virtual-memory API
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
//! 2. Every entry point is resolved up front into [`driver::HipApi`]. A missing library or a
//!    missing required symbol is an
//!    [`ErrorKind::Unavailable`](kvvm_hal::ErrorKind::Unavailable) error of
//!    [`Operation::Load`](kvvm_hal::Operation::Load) whose message names what is missing.
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
//!   crate does not know, which would be undefined behaviour in an enum. [`error`] names and
//!   classifies them with our own table (falling back to `hipGetErrorName`, then
//!   `"hipError(<n>)"`).
//! * **`hipMemAllocationProp` changed layout** between ROCm 5.2 (`compressionType` first) and
//!   ROCm >= 5.4 (CUDA's layout), keeping the same 32-byte size, so a wrong guess is silent
//!   memory corruption of the request, not a crash. Both layouts are hand-written in [`driver`]
//!   with `offset_of!` assertions that fail the build on drift, and the runtime's own version
//!   chooses between them. The `hip-sys-check` feature compares the >= 5.4 layout with
//!   hip-sys 0.1.2's bindgen output (see README.md).
//! * Enum values (pinned = 1, location device = 1, access 0/1/3, handle type none/POSIX-FD =
//!   0/1, granularity minimum/recommended = 0/1) are the same in every release and are passed
//!   as 32-bit integers.
//! * Addresses are `void*` and a physical handle is an opaque pointer; both travel through the
//!   neutral `u64` types unchanged. This crate requires a 64-bit target.
//!
//! ## Files
//!
//! The same file set as the CUDA backend: `driver/` (the loaded symbol table and the raw ABI,
//! and in `driver/result.rs` one thin checked wrapper per entry point; every `unsafe` call
//! into the runtime is there), `error` (one `(code, name, kind)` table), `conv` (checked
//! conversions), `backend/` (the trait in `mod.rs`, one tracing span per driver call; plus
//! `devices.rs`: names, memory, peer access; and `runtime.rs`: [`HipRuntime`], loading and
//! initialising); and `version`.
//!
//! ## Threads and devices
//!
//! HIP keeps a current device per thread. Calls tied to a device (`create`, `granularity`,
//! `memory_info`, `synchronize`) call `hipSetDevice` on the calling thread first. Calls on
//! addresses or handles (`reserve`, `map`, `set_access`, `unmap`, copies, `release`) act on
//! process-wide virtual addresses and use whatever device the thread has (device 0 by
//! default). `import_posix_fd` imports onto the device it is given (made current first).
//! `can_access_peer` asks `hipDeviceCanAccessPeer` (optional: a runtime without it reports no
//! peers).
//!
//! ## Known ROCm bugs this backend reports through [`Capabilities`](kvvm_hal::Capabilities)
//!
//! * `unmap_spans_mappings = false`: one `hipMemUnmap` over several mappings later makes
//!   `hipMemAddressFree` fail (ROCR-Runtime issue #285; llama.cpp unmaps mapping by mapping
//!   for that reason). The manager then unmaps one mapping per call.
//! * `set_access_retries = 3`: `hipMemSetAccess` on a newly mapped tail fails intermittently
//!   on gfx942 with ROCm 7.2 when several reservations exist, and succeeds when retried
//!   (`docs/driver-semantics.md`; llama.cpp ships HIP VMM off by default).
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

mod backend;
mod conv;
pub mod driver;
pub mod error;
pub mod version;

pub use crate::backend::{HipBackend, HipRuntime};
pub use crate::driver::result::error_name;
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
