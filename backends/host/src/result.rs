//! Thin checked wrappers over the system calls, through `rustix` (no hand-written FFI): one
//! function per call, an `errno` out as [`Errno`], and one `tracing` span per call (`op`,
//! `device`, `bytes`, and its `result`).
//!
//! A wrapper is safe when the call cannot touch memory that Rust code may be using: a new
//! anonymous range the kernel places itself (never `MAP_FIXED`), descriptors, sizes. The
//! wrappers that replace or change existing pages at a given address (`MAP_FIXED` maps,
//! `mprotect`, `munmap`) are `unsafe`: the caller proves from its bookkeeping that the range
//! belongs to this backend.

use std::ffi::{c_void, CStr};
use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};

use crate::conv::{expose, to_u64};
use crate::error::Errno;

/// The result of one system call.
pub(crate) type SysResult<T> = Result<T, Errno>;

/// Runs one system call inside its span and logs the outcome.
fn traced<T>(
    op: &'static str,
    bytes: u64,
    call: impl FnOnce() -> rustix::io::Result<T>,
) -> SysResult<T> {
    let span = tracing::debug_span!("kvvm_host", op, device = 0u32, bytes);
    let _entered = span.enter();
    match call() {
        Ok(v) => {
            tracing::debug!(result = "ok");
            Ok(v)
        }
        Err(e) => {
            let e = Errno(e.raw_os_error());
            tracing::debug!(result = e.name().unwrap_or("unknown errno"), errno = e.0);
            Err(e)
        }
    }
}

/// The flags of a reservation: private, anonymous, no swap reserved.
fn reservation_flags() -> MapFlags {
    MapFlags::PRIVATE | MapFlags::NORESERVE
}

/// `mmap(hint, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE [| MAP_FIXED_NOREPLACE])`:
/// a new inaccessible range that uses no memory. With a hint, `MAP_FIXED_NOREPLACE` makes the
/// kernel refuse (`EEXIST`) rather than move when the range is taken; kernels older than 4.17
/// treat the flag as a plain hint, so the caller compares the result with the hint.
pub(crate) fn reserve(hint: Option<u64>, len: usize) -> SysResult<u64> {
    traced("mmap(PROT_NONE, anonymous)", to_u64(len), || {
        let (ptr, flags) = match hint {
            Some(a) => (
                std::ptr::with_exposed_provenance_mut::<c_void>(usize::try_from(a).unwrap_or(0)),
                reservation_flags() | MapFlags::FIXED_NOREPLACE,
            ),
            None => (std::ptr::null_mut(), reservation_flags()),
        };
        // SAFETY: without MAP_FIXED the kernel never replaces an existing mapping: it picks a
        // free range (the hint, when free and MAP_FIXED_NOREPLACE is honoured, or anywhere
        // else) and returns a new mapping that no Rust reference can point into yet.
        let p = unsafe { rustix::mm::mmap_anonymous(ptr, len, ProtFlags::empty(), flags) }?;
        Ok(expose(p))
    })
}

/// `munmap(address, len)`.
///
/// # Safety
/// `[address, address + len)` must be a range this backend reserved (or the unused head or
/// tail of one it is trimming), with no Rust reference into it.
pub(crate) unsafe fn unmap(address: *mut c_void, len: usize) -> SysResult<()> {
    traced("munmap", to_u64(len), || {
        // SAFETY: the caller guarantees the range is this backend's and unreferenced.
        unsafe { rustix::mm::munmap(address, len) }
    })
}

/// `mmap(address, len, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, 0)`: maps the memfd's pages at
/// `address`, replacing the reservation's placeholder pages there.
///
/// # Safety
/// `[address, address + len)` must lie inside a reservation of this backend and hold no live
/// mapping (only the placeholder pages of the reservation), so that nothing is replaced that
/// anyone else uses.
pub(crate) unsafe fn map_fixed(address: *mut c_void, len: usize, fd: impl AsFd) -> SysResult<()> {
    traced("mmap(MAP_SHARED | MAP_FIXED, memfd)", to_u64(len), || {
        let flags = MapFlags::SHARED | MapFlags::FIXED;
        // SAFETY: the caller guarantees the range is an unmapped part of our reservation.
        unsafe { rustix::mm::mmap(address, len, ProtFlags::empty(), flags, fd, 0) }.map(|_| ())
    })
}

/// `mmap(address, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED)`:
/// puts inaccessible placeholder pages back over a mapping, which unmaps it while the range
/// stays reserved.
///
/// # Safety
/// `[address, address + len)` must be exactly live mappings of this backend (being unmapped)
/// with no Rust reference into them.
pub(crate) unsafe fn map_placeholder(address: *mut c_void, len: usize) -> SysResult<()> {
    traced("mmap(PROT_NONE, anonymous, MAP_FIXED)", to_u64(len), || {
        let flags = reservation_flags() | MapFlags::FIXED;
        // SAFETY: the caller guarantees the range is our own mappings, now being dropped.
        unsafe { rustix::mm::mmap_anonymous(address, len, ProtFlags::empty(), flags) }.map(|_| ())
    })
}

/// `mprotect(address, len, flags)`.
///
/// # Safety
/// `[address, address + len)` must be covered by live mappings of this backend. (Taking
/// access away while a Rust reference reads the range would fault that reader: the
/// backend's own copies hold its lock, so they never overlap a protection change.)
pub(crate) unsafe fn protect(
    address: *mut c_void,
    len: usize,
    flags: MprotectFlags,
) -> SysResult<()> {
    traced("mprotect", to_u64(len), || {
        // SAFETY: the caller guarantees the range is our own live mappings.
        unsafe { rustix::mm::mprotect(address, len, flags) }
    })
}

/// `memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING)`: a new, empty physical allocation.
pub(crate) fn memfd_create(name: &CStr) -> SysResult<OwnedFd> {
    traced("memfd_create", 0, || {
        rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
    })
}

/// `ftruncate(fd, size)`: gives the memfd its size (its pages are allocated on first touch).
pub(crate) fn ftruncate(fd: impl AsFd, size: u64) -> SysResult<()> {
    traced("ftruncate", size, || rustix::fs::ftruncate(fd, size))
}

/// `fallocate(fd, 0, 0, size)`: allocates every page now, so that running out of memory is
/// an error of `create` rather than a `SIGBUS` at first touch.
pub(crate) fn fallocate(fd: impl AsFd, size: u64) -> SysResult<()> {
    traced("fallocate", size, || {
        rustix::fs::fallocate(fd, rustix::fs::FallocateFlags::empty(), 0, size)
    })
}

/// `fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)`: fixes the size for
/// good, so that no process holding the descriptor can truncate the pages under a mapping
/// (which would turn an access into a `SIGBUS`).
pub(crate) fn seal_size(fd: impl AsFd) -> SysResult<()> {
    traced("fcntl(F_ADD_SEALS)", 0, || {
        rustix::fs::fcntl_add_seals(fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
    })
}

/// `fcntl(fd, F_GET_SEALS)`.
pub(crate) fn seals(fd: impl AsFd) -> SysResult<SealFlags> {
    traced("fcntl(F_GET_SEALS)", 0, || rustix::fs::fcntl_get_seals(fd))
}

/// What `fstat` says about a descriptor: the file's identity and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileIdentity {
    /// `st_dev`.
    pub(crate) dev: u64,
    /// `st_ino`.
    pub(crate) ino: u64,
    /// `st_size` in bytes.
    pub(crate) size: u64,
    /// Whether it is a regular file (a memfd is).
    pub(crate) regular: bool,
}

/// `fstat(fd)`.
pub(crate) fn fstat(fd: impl AsFd) -> SysResult<FileIdentity> {
    traced("fstat", 0, || {
        let st = rustix::fs::fstat(fd)?;
        let file_type = rustix::fs::FileType::from_raw_mode(st.st_mode);
        Ok(FileIdentity {
            dev: st.st_dev,
            ino: st.st_ino,
            size: u64::try_from(st.st_size).unwrap_or(0),
            regular: file_type == rustix::fs::FileType::RegularFile,
        })
    })
}

/// `fcntl(fd, F_DUPFD_CLOEXEC, 0)`: a new descriptor of the same open file.
pub(crate) fn dup(fd: impl AsFd) -> SysResult<OwnedFd> {
    traced("fcntl(F_DUPFD_CLOEXEC)", 0, || {
        rustix::io::fcntl_dupfd_cloexec(fd, 0)
    })
}

/// `mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS)`: plain anonymous
/// memory (the benchmark's baseline).
pub(crate) fn anonymous_read_write(len: usize) -> SysResult<u64> {
    traced(
        "mmap(PROT_READ | PROT_WRITE, anonymous)",
        to_u64(len),
        || {
            // SAFETY: a null address without MAP_FIXED: the kernel picks a free range and returns
            // a new mapping that nothing points into yet.
            let p = unsafe {
                rustix::mm::mmap_anonymous(
                    std::ptr::null_mut(),
                    len,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::PRIVATE,
                )
            }?;
            Ok(expose(p))
        },
    )
}

/// The page size (the minimum granularity).
pub(crate) fn page_size() -> u64 {
    to_u64(rustix::param::page_size())
}

/// Physical memory of the machine in bytes (`sysinfo`'s `totalram * mem_unit`).
pub(crate) fn total_ram() -> u64 {
    let info = rustix::system::sysinfo();
    let unit = u64::from(info.mem_unit).max(1);
    // `totalram` is a C `unsigned long`: 32 bits on 32-bit targets.
    #[allow(clippy::useless_conversion)]
    let total = u64::try_from(info.totalram);
    total.unwrap_or(u64::MAX).saturating_mul(unit)
}

/// `uname`: the kernel release and the machine (`"6.1.0"`, `"x86_64"`).
pub(crate) fn kernel() -> (String, String) {
    let u = rustix::system::uname();
    (
        u.release().to_string_lossy().into_owned(),
        u.machine().to_string_lossy().into_owned(),
    )
}
