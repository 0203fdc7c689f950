//! [`check_exported`]: whether a descriptor a client publishes is memory a driver exported,
//! of the size it claims, before the broker keeps it.
//!
//! What the backends export as a POSIX descriptor, and what is accepted of each:
//!
//! | backend | what `export_posix_fd` gives | accepted when |
//! |---|---|---|
//! | host | a `memfd` whose size is sealed | a regular file whose size is sealed against growing and shrinking (only files in memory can have seals: tmpfs, hugetlbfs, memfds) and is the size claimed |
//! | CUDA | a descriptor of the NVIDIA control device (`/dev/nvidiactl`, a character device of major 195) the driver exported the allocation onto | it is a character device of major 195 (its size cannot be read: the claim is trusted, and billed) |
//! | HIP, others | a dma-buf (an anonymous inode of the dma-buf file system) | its size is the size claimed |
//!
//! Everything else is refused: sockets (the client's own broker connection among them, which
//! would keep the client alive in the broker after it died), pipes, directories, files
//! without sealed sizes (on disk, or in memory but growable), other devices, other
//! anonymous inodes.

use std::fmt;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd};

/// The NVIDIA driver's character devices' major number.
const NVIDIA_MAJOR: u32 = 195;

/// `DMA_BUF_MAGIC` of `linux/magic.h` (the libc crate does not carry it).
const DMA_BUF_MAGIC: u64 = 0x444d_4142;

/// What kind of exported memory a descriptor was found to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportKind {
    /// A sealed memfd (the host backend).
    Memfd,
    /// A descriptor of the NVIDIA control device (the CUDA driver's export).
    NvidiaControl,
    /// A dma-buf.
    DmaBuf,
}

impl fmt::Display for ExportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ExportKind::Memfd => "a sealed memfd",
            ExportKind::NvidiaControl => "an NVIDIA driver export",
            ExportKind::DmaBuf => "a dma-buf",
        })
    }
}

/// What `fstat` says of a descriptor.
#[derive(Debug, Clone, Copy)]
struct Stat {
    kind: u32,
    size: u64,
    rdev_major: u32,
    rdev_minor: u32,
}

#[cfg(target_os = "linux")]
fn stat(fd: BorrowedFd<'_>) -> Result<Stat, String> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: the descriptor is open for the borrow; `st` has room for a stat.
    if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(format!("fstat: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: fstat succeeded, so it wrote the whole struct.
    let st = unsafe { st.assume_init() };
    Ok(Stat {
        kind: st.st_mode & libc::S_IFMT,
        size: u64::try_from(st.st_size).unwrap_or(0),
        rdev_major: libc::major(st.st_rdev),
        rdev_minor: libc::minor(st.st_rdev),
    })
}

/// Whether `fd` is of the dma-buf file system (`fstatfs`).
#[cfg(target_os = "linux")]
fn is_dma_buf(fd: BorrowedFd<'_>) -> bool {
    let mut fs = MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: the descriptor is open for the borrow; `fs` has room for a statfs.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), fs.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: fstatfs succeeded, so it wrote the whole struct.
    let fs = unsafe { fs.assume_init() };
    // The type's width differs between targets; the magic numbers fit 32 bits.
    #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
    let magic = fs.f_type as u64;
    magic == DMA_BUF_MAGIC
}

/// Whether `fd`'s size is sealed against growing and shrinking (what the host backend does
/// to every memfd it makes; only files in memory, memfds among them, can have seals).
#[cfg(target_os = "linux")]
fn size_sealed(fd: BorrowedFd<'_>) -> bool {
    // SAFETY: F_GET_SEALS reads the descriptor's seals and touches no memory of ours.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    let wanted = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    seals >= 0 && seals & wanted == wanted
}

/// What a descriptor that is not exported memory is, in words.
fn what(st: &Stat) -> String {
    match st.kind {
        libc::S_IFSOCK => "a socket".into(),
        libc::S_IFIFO => "a pipe".into(),
        libc::S_IFDIR => "a directory".into(),
        libc::S_IFREG => "a file without a sealed size (not a memfd the host backend made)".into(),
        libc::S_IFCHR => format!(
            "a character device {}:{} (not the NVIDIA driver's)",
            st.rdev_major, st.rdev_minor
        ),
        0 => "an anonymous inode that is no dma-buf".into(),
        other => format!("a file of mode {other:o}"),
    }
}

/// Checks that `fd` is a driver's exported memory of `size` bytes, and says which kind.
///
/// # Errors
/// Words for the client: what the descriptor is instead, or the size it has.
#[cfg(target_os = "linux")]
pub fn check_exported(fd: BorrowedFd<'_>, size: u64) -> Result<ExportKind, String> {
    let st = stat(fd)?;
    let kind = match st.kind {
        libc::S_IFREG if size_sealed(fd) => ExportKind::Memfd,
        libc::S_IFCHR if st.rdev_major == NVIDIA_MAJOR => return Ok(ExportKind::NvidiaControl),
        0 if is_dma_buf(fd) => ExportKind::DmaBuf,
        _ => return Err(format!("{}, not exported device memory", what(&st))),
    };
    if st.size != size {
        return Err(format!(
            "{kind} of {} bytes, not the {size} claimed",
            st.size
        ));
    }
    Ok(kind)
}

/// Off Linux no descriptor is accepted.
#[cfg(not(target_os = "linux"))]
pub fn check_exported(_fd: BorrowedFd<'_>, _size: u64) -> Result<ExportKind, String> {
    Err("descriptors are checked on Linux only".into())
}

#[cfg(all(test, target_os = "linux"))]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    use std::os::unix::net::UnixStream;

    use super::*;

    /// A memfd of `size` bytes, its size sealed when `seal`.
    fn memfd(size: u64, seal: bool) -> OwnedFd {
        // SAFETY: the name is a valid C string; the flags are memfd_create's.
        let raw = unsafe { libc::memfd_create(c"kvvm-test".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(raw >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: memfd_create returned a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: the descriptor is open; ftruncate and fcntl touch no memory of ours.
        unsafe {
            assert_eq!(libc::ftruncate(raw, i64::try_from(size).unwrap()), 0);
            if seal {
                let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
                assert_eq!(libc::fcntl(raw, libc::F_ADD_SEALS, seals), 0);
            }
        }
        fd
    }

    #[test]
    fn a_sealed_memfd_of_the_size_claimed_is_accepted_and_nothing_else() {
        let ok = memfd(8192, true);
        assert_eq!(check_exported(ok.as_fd(), 8192), Ok(ExportKind::Memfd));
        let e = check_exported(ok.as_fd(), 1).unwrap_err();
        assert!(e.contains("8192 bytes, not the 1 claimed"), "{e}");
        let unsealed = memfd(8192, false);
        let e = check_exported(unsealed.as_fd(), 8192).unwrap_err();
        assert!(e.starts_with("a file without a sealed size"), "{e}");
        let (a, _b) = UnixStream::pair().unwrap();
        let e = check_exported(a.as_fd(), 1).unwrap_err();
        assert!(e.starts_with("a socket"), "{e}");
        let mut p = [0; 2];
        // SAFETY: `p` has room for the two descriptors pipe writes.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        // SAFETY: pipe returned two new descriptors we own.
        let (r, _w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
        assert!(check_exported(r.as_fd(), 1)
            .unwrap_err()
            .starts_with("a pipe"));
        let dir = std::fs::File::open(std::env::temp_dir()).unwrap();
        let e = check_exported(dir.as_fd(), 1).unwrap_err();
        assert!(e.starts_with("a directory"), "{e}");
        let null = std::fs::File::open("/dev/null").unwrap();
        let e = check_exported(null.as_fd(), 1).unwrap_err();
        assert!(e.contains("character device 1:3"), "{e}");
        let exe = std::fs::File::open(std::env::current_exe().unwrap()).unwrap();
        let size = exe.metadata().unwrap().len();
        let e = check_exported(exe.as_fd(), size).unwrap_err();
        assert!(e.starts_with("a file without a sealed size"), "{e}");
        // An anonymous inode of another kind (an eventfd: of size 0, as claimed here).
        // SAFETY: eventfd makes a new descriptor we own.
        let event = unsafe { OwnedFd::from_raw_fd(libc::eventfd(0, libc::EFD_CLOEXEC)) };
        let e = check_exported(event.as_fd(), 0).unwrap_err();
        assert!(
            e.starts_with("an anonymous inode that is no dma-buf"),
            "{e}"
        );
        // A symbolic link itself (opened with O_PATH).
        let link = std::env::temp_dir().join(format!("kvvm-link-{}", std::process::id()));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("/nonexistent", &link).unwrap();
        let path = std::ffi::CString::new(link.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid C string; O_PATH | O_NOFOLLOW opens the link itself.
        let raw = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        assert!(raw >= 0);
        // SAFETY: open returned a new descriptor we own.
        let l = unsafe { OwnedFd::from_raw_fd(raw) };
        let e = check_exported(l.as_fd(), 0).unwrap_err();
        assert!(e.starts_with("a file of mode 120000"), "{e}");
        std::fs::remove_file(&link).unwrap();
    }
}
