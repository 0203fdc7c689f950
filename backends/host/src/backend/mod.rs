//! [`HostBackend`]: the host backend, the operating system's virtual memory behind the
//! driver's interface ([`VirtualMemoryBackend`](kvvm_hal::VirtualMemoryBackend) and
//! [`KernelProbe`](kvvm_hal::KernelProbe)); see the crate documentation for the mapping of
//! each call and its semantics.
//!
//! The invariants it keeps (on Linux):
//!
//! * one device, `DeviceId(0)`: the host's memory;
//! * its bookkeeping (`state.rs`: reservations, handles and their memfds, allocations,
//!   mappings and their access) sits behind one read-write lock, and every `MAP_FIXED` map,
//!   `mprotect` and `munmap` it makes is over a range its bookkeeping proves its own, so that
//!   it refuses what the CUDA driver refuses and never touches memory of the process that it
//!   did not map;
//! * copies and probes hold the lock shared for their duration, so no unmap, protection change
//!   or free overlaps them; every call that changes mappings or handles holds it exclusively;
//! * dropping it unmaps every range it still reserves and closes every memfd it still holds.
//!
//! On other operating systems it cannot be opened: [`HostBackend::open`] is `Unavailable`,
//! so no value of it exists.
//!
//! Its impl blocks live in the files of this folder:
//!
//! * `linux.rs`: the type on Linux, opening it, `Drop`, and
//!   [`VirtualMemoryBackend`](kvvm_hal::VirtualMemoryBackend) over `mmap` and memfds;
//! * `probe.rs`: [`KernelProbe`](kvvm_hal::KernelProbe), CPU loads and stores through the
//!   mapping, checked by the MMU;
//! * `tier.rs`: the host tier's calls (page-locked buffers as heap memory, copies as
//!   `memcpy` made at once, events complete when recorded);
//! * `unsupported.rs`: the type on other operating systems (also built by the tests).

#[cfg(target_os = "linux")]
mod first_touch;
#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
mod probe;
#[cfg(target_os = "linux")]
mod tier;
#[cfg(any(not(target_os = "linux"), test))]
#[cfg_attr(test, allow(dead_code))]
pub(crate) mod unsupported;

#[cfg(target_os = "linux")]
pub use first_touch::mmap_first_touch;
#[cfg(target_os = "linux")]
pub use linux::HostBackend;
#[cfg(not(target_os = "linux"))]
pub use unsupported::{mmap_first_touch, HostBackend};
