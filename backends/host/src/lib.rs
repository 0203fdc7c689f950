//! # kvvm-host: the host's own virtual memory as a kvvm backend
//!
//! [`HostBackend`] implements [`kvvm_hal::VirtualMemoryBackend`] over the operating system's
//! virtual memory, which offers exactly the driver's model on the CPU: an address range is
//! reserved without memory, physical memory is a file descriptor whose pages can be mapped at
//! any reserved address, as many times as wanted, each mapping with its own protection
//! enforced by the MMU. Everything above the trait (the manager, the governor, shared
//! prefixes, backpressure) runs on it unchanged, and its memory is addressable: a
//! [`DeviceAddress`](kvvm_hal::DeviceAddress) of this backend is a pointer of the process.
//!
//! | trait call | host implementation |
//! |---|---|
//! | `reserve` | `mmap` of `PROT_NONE`, `MAP_PRIVATE \| MAP_ANONYMOUS \| MAP_NORESERVE` (no memory used; over-reserved and trimmed to honour the alignment; a fixed address is tried with `MAP_FIXED_NOREPLACE`) |
//! | `create` | `memfd_create` + `ftruncate` + seals on the size (the handle *is* the memfd; its pages are the physical memory, allocated on first touch, or at once with [`HostConfig::populate`]) |
//! | `map` | `mmap(MAP_FIXED \| MAP_SHARED)` of the memfd over the reservation's placeholder pages, `PROT_NONE` until access is set |
//! | `set_access` | `mprotect`: `Read` -> `PROT_READ`, `ReadWrite` -> `PROT_READ \| PROT_WRITE` |
//! | `unmap` | `mmap(MAP_FIXED)` of `PROT_NONE` anonymous memory over each run of mappings (the range stays reserved) |
//! | `release` | `close` of the memfd; its memory lives on while mapped (CUDA's deferred free) |
//! | `free` | `munmap` of the reservation |
//! | `export_posix_fd` / `import_posix_fd` | a `dup` of the memfd / the received descriptor (checked to be a size-sealed memfd): real cross-process sharing |
//! | `copy_to_device` / `copy_from_device` | `memcpy`, after checking that every byte is mapped with the access needed |
//! | `granularity` | minimum: the page size; recommended: 2 MiB ([`HostConfig::recommended_granularity`]) |
//! | `memory_info` | total: the configured capacity (default: physical RAM); used: bytes of live memfds, each counted once |
//! | `synchronize` | nothing to wait for |
//! | [`KernelProbe`](kvvm_hal::KernelProbe) | CPU loads and stores through the mapping, checked by the MMU |
//!
//! ## Semantics: what the driver refuses, the host refuses
//!
//! The kernel lets many misuses through: a `MAP_FIXED` map over a live mapping silently
//! replaces it, one outside a reservation clobbers whatever the process has there, a copy
//! through a read-only mapping is a `SIGSEGV`. So unlike the CUDA backend, which passes
//! arguments to a driver that checks them, this backend keeps the bookkeeping the driver
//! keeps (reservations, handles, allocations, mappings and their access: `state.rs`) and
//! refuses exactly what the CUDA driver refuses, with the same [`ErrorKind`](kvvm_hal::ErrorKind)
//! in the same order (`docs/driver-semantics.md`, and the `kvvm-hal` crate docs):
//!
//! * a map of part of a handle is `NotSupported`, checked before the address; with the whole
//!   handle, an unaligned address, one not reserved, one already mapped, or a map that runs
//!   past the end of its reservation is `InvalidValue` (CUDA does not check the last one; the
//!   host must, since `MAP_FIXED` would replace memory beyond the reservation:
//!   `checks_reservation_bounds` is true);
//! * sizes that are not page multiples, a second release, a second free, a free while a
//!   mapping is live, an unmap of part of a mapping, a copy through a mapping without the
//!   access it needs (none yet, or `Read` for a write) are `InvalidValue`, never a `SIGSEGV`;
//! * creating past the capacity is `OutOfMemory`, so the governor's backpressure can be
//!   exercised at any size;
//! * releasing a mapped handle succeeds and its memory lives until the last unmap; an unmap
//!   of a range with no mapping succeeds.
//!
//! Every error carries the operation, an `errno` and its name ([`error`]): the kernel's, or for
//! a refusal of the bookkeeping, the `errno` of the driver's answer (`EINVAL`, `EOPNOTSUPP`,
//! `ENOMEM`) with a detail saying what was refused.
//!
//! ## Read-only aliases are enforced by the MMU
//!
//! A `Read` mapping is `PROT_READ`. The backend's own copies check the access first and refuse
//! with `InvalidValue`; any other store through the mapping (the store probe, or code writing
//! through the pointer) is stopped by the MMU: the process receives `SIGSEGV` and, as Rust
//! programs do, dies of it. The conformance suite shows it with a child process that stores
//! through a `Read` alias and must die of `SIGSEGV`, after its loads through the alias saw the
//! owner's bytes. Run faulting probes in a child process.
//!
//! ## Memory, descriptors and threads
//!
//! * Pages of a memfd are allocated on first touch, like anonymous memory, and freed by the
//!   kernel when the last descriptor and mapping of it (in any process) are gone. With
//!   [`HostConfig::populate`] `create` allocates them at once (`fallocate`), so that running
//!   out of memory is an error of `create` rather than a `SIGBUS` at first touch.
//! * Each live handle holds one descriptor (`RLIMIT_NOFILE` bounds the handles alive at once;
//!   running out is `OutOfMemory`, `EMFILE`).
//! * The backend is `Send + Sync`: the bookkeeping sits behind a read-write lock; copies and
//!   probes hold it shared for their duration, so no unmap, protection change or free can
//!   overlap them.
//! * The bytes behind a mapping are not Rust objects: they are shared with every other mapping
//!   of the memfd, in this process or another. Code that turns an address into a reference
//!   (unsafe) must not let it overlap a copy, an unmap or a protection change.
//!
//! ## Platforms
//!
//! Linux only (memfd, `MAP_FIXED_NOREPLACE`, `F_ADD_SEALS`). Elsewhere the crate builds and
//! [`HostBackend::open`] returns `Unavailable`.
//!
//! ```
//! use kvvm_hal::{AccessDescriptor, AllocationProperties, DeviceId, VirtualMemoryBackend};
//! use kvvm_host::HostBackend;
//!
//! # fn main() -> Result<(), kvvm_hal::BackendError> {
//! # if cfg!(not(target_os = "linux")) { return Ok(()); }
//! let host = HostBackend::open()?;
//! let g = host.granularity(&AllocationProperties::device(DeviceId(0)))?.recommended;
//! let va = host.reserve(4 * g, 0, None)?;
//! let h = host.create(g, &AllocationProperties::device(DeviceId(0)))?;
//! host.map(va, g, h)?;
//! host.set_access(va, g, &[AccessDescriptor::read_write(DeviceId(0))])?;
//! host.copy_to_device(va, b"kv")?;
//! let mut back = [0u8; 2];
//! host.copy_from_device(&mut back, va)?;
//! assert_eq!(&back, b"kv");
//! host.unmap(va, g)?;
//! host.release(h)?;
//! host.free(va, 4 * g)?;
//! assert!(host.ledger().is_empty());
//! # Ok(())
//! # }
//! ```

mod backend;
#[cfg(target_os = "linux")]
mod conv;
pub mod error;
#[cfg(target_os = "linux")]
mod result;
#[cfg(target_os = "linux")]
mod state;

pub use backend::{mmap_first_touch, HostBackend};

/// Environment variable read by [`HostBackend::open`]: the capacity in bytes, optionally with
/// a binary suffix (`K`, `M`, `G`, `T`, e.g. `8G`).
pub const CAPACITY_ENV: &str = "KVVM_HOST_CAPACITY";

/// The recommended granularity by default: 2 MiB (a huge page on x86_64 and aarch64).
pub const DEFAULT_RECOMMENDED_GRANULARITY: u64 = 2 << 20;

/// How a [`HostBackend`] is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HostConfig {
    /// Physical bytes the backend may hold at once (`memory_info`'s total); a create past it is
    /// `OutOfMemory`. `None`: the machine's physical memory.
    pub capacity: Option<u64>,
    /// The recommended granularity (a multiple of the page size; otherwise the page size is
    /// recommended).
    pub recommended_granularity: u64,
    /// Allocate every page of a handle when it is created (`fallocate`) instead of on first
    /// touch.
    pub populate: bool,
}

impl Default for HostConfig {
    /// The machine's memory as capacity, 2 MiB recommended, pages allocated on first touch.
    fn default() -> Self {
        HostConfig {
            capacity: None,
            recommended_granularity: DEFAULT_RECOMMENDED_GRANULARITY,
            populate: false,
        }
    }
}

impl HostConfig {
    /// Sets the capacity in bytes.
    #[must_use]
    pub fn capacity(mut self, bytes: u64) -> Self {
        self.capacity = Some(bytes);
        self
    }

    /// Sets the recommended granularity.
    #[must_use]
    pub fn recommended_granularity(mut self, bytes: u64) -> Self {
        self.recommended_granularity = bytes;
        self
    }

    /// Allocates pages at create (`true`) or on first touch (`false`, the default).
    #[must_use]
    pub fn populate(mut self, populate: bool) -> Self {
        self.populate = populate;
        self
    }

    /// The default configuration with the capacity of [`CAPACITY_ENV`] when it is set.
    pub fn from_env() -> Result<Self, String> {
        let config = HostConfig::default();
        match std::env::var(CAPACITY_ENV) {
            Ok(v) => parse_size(&v)
                .map(|bytes| config.capacity(bytes))
                .ok_or_else(|| format!("{CAPACITY_ENV}={v:?} is not a size (e.g. 8G)")),
            Err(std::env::VarError::NotPresent) => Ok(config),
            Err(e) => Err(format!("{CAPACITY_ENV}: {e}")),
        }
    }
}

/// Parses a byte count with an optional binary suffix: `"4096"`, `"64M"`, `"8GiB"`, `"1t"`.
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, suffix) = t.split_at(digits);
    let n: u64 = number.parse().ok()?;
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

/// What the backend holds right now (the host's equivalent of the simulator's ledger); see
/// [`HostBackend::ledger`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct HostLedger {
    /// Live reservations.
    pub reservations: usize,
    /// Bytes of address space they reserve.
    pub reserved_bytes: u64,
    /// Live handles (open memfds).
    pub handles: usize,
    /// Physical allocations alive (held by a handle or a mapping), each counted once.
    pub allocations: usize,
    /// Live mappings.
    pub mappings: usize,
    /// Bytes those mappings cover.
    pub mapped_bytes: u64,
    /// Bytes of the live allocations (what `memory_info` counts as used).
    pub used_bytes: u64,
    /// Live host-tier buffers.
    pub host_buffers: usize,
    /// Their bytes.
    pub host_bytes: u64,
    /// Live events.
    pub events: usize,
}

impl HostLedger {
    /// Whether the backend holds nothing at all: no reservation, handle, allocation,
    /// mapping, host buffer or event (what a run that leaks nothing leaves).
    pub fn is_empty(&self) -> bool {
        self.reservations == 0
            && self.handles == 0
            && self.allocations == 0
            && self.mappings == 0
            && self.host_buffers == 0
            && self.events == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64M"), Some(64 << 20));
        assert_eq!(parse_size(" 8GiB "), Some(8 << 30));
        assert_eq!(parse_size("1t"), Some(1 << 40));
        assert_eq!(parse_size("12 kb"), Some(12 << 10));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size("5Q"), None);
        assert_eq!(parse_size("99999999999999999T"), None);
    }

    #[test]
    fn config_builders() {
        let c = HostConfig::default()
            .capacity(1 << 30)
            .populate(true)
            .recommended_granularity(64 << 10);
        assert_eq!(c.capacity, Some(1 << 30));
        assert!(c.populate);
        assert_eq!(c.recommended_granularity, 64 << 10);
        assert_eq!(
            HostConfig::default().recommended_granularity,
            DEFAULT_RECOMMENDED_GRANULARITY
        );
    }

    #[test]
    fn the_stub_of_other_platforms_is_unavailable() {
        use kvvm_hal::ErrorKind;
        match backend::unsupported::HostBackend::open() {
            Ok(_) => panic!("the stub opened"),
            Err(e) => {
                assert_eq!(e.kind, ErrorKind::Unavailable);
                assert!(e.to_string().contains("Linux"), "{e}");
            }
        }
        assert!(backend::unsupported::mmap_first_touch(4096).is_err());
    }
}
