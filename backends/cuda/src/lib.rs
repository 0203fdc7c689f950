//! # kvvm-cuda: the CUDA driver backend of kvvm
//!
//! [`CudaBackend`] implements [`kvvm_hal::VirtualMemoryBackend`] over the CUDA driver's
//! virtual-memory management API (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`,
//! `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`, `cuMemAddressFree`, POSIX-FD export and
//! import) and [`kvvm_hal::KernelProbe`] with two hand-written PTX kernels.
//!
//! ## Loading
//!
//! `libcuda` is loaded at run time through cudarc's dynamic loader; the crate builds and its
//! tests run on machines without CUDA. [`CudaBackend::open`] checks that the library exists
//! and resolves **every** symbol the backend uses before calling any of them, so a missing
//! library, a missing symbol, a stub library, a driver mismatch or the absence of a device is
//! an [`ErrorKind::Unavailable`](kvvm_hal::ErrorKind::Unavailable) error whose detail says
//! what is missing, never a panic.
//!
//! ## Layers
//!
//! * `driver/`: the table of entry points (cudarc's `sys` types, raw `u32` return codes, so a
//!   code newer than the bindings cannot be undefined behaviour), and in `driver/result.rs`
//!   thin wrappers, `MaybeUninit` out-parameters in, `Result<_, CuCode>` out;
//! * [`error`]: names and classification of `CUresult` codes;
//! * `conv`: checked conversions between the neutral types and the driver's;
//! * `backend/`: [`CudaBackend`] itself: [`VirtualMemoryBackend`](kvvm_hal::VirtualMemoryBackend)
//!   in `mod.rs`; opening and closing in `open.rs`; in `kernel.rs` (with the PTX of `probe`)
//!   [`KernelProbe`](kvvm_hal::KernelProbe); row copies in `rows.rs` (with the PTX of
//!   `rows_kernel`); in `linear.rs` plain device memory for the realloc-and-copy baseline.
//!
//! ## Contexts and threads
//!
//! `open` retains each device's primary context once and `Drop` releases it. Every method
//! makes the right context current on the calling thread (a `cuCtxGetCurrent` comparison, and
//! `cuCtxSetCurrent` only when it differs), so the backend works from any thread.
//!
//! ## Capabilities
//!
//! `unmap_spans_mappings`: true; `kernels`: true; `set_access_retries`: 0;
//! `checks_reservation_bounds`: false (the driver does not; the manager checks);
//! `posix_fd_handles`: true only when every device reports
//! `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.

mod backend;
mod conv;
mod driver;
pub mod error;
mod probe;
mod rows_kernel;

pub use backend::CudaBackend;
pub use conv::format_driver_version;
pub use error::CuCode;
pub use probe::{LOAD_KERNEL, PROBE_PTX, STORE_KERNEL};

/// The `libcuda` symbols the backend resolves when it opens (all of them are required).
pub fn required_symbols() -> &'static [&'static std::ffi::CStr] {
    driver::Driver::SYMBOLS
}
