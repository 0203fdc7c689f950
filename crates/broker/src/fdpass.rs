//! File descriptors over a Unix stream socket (`SCM_RIGHTS`): [`send_with_fds`] attaches
//! descriptors to the first byte of a write; [`FdReader`] reads with `recvmsg` so descriptors
//! that arrive are kept (a plain `read` would close them) until the frame that carries them
//! is parsed.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// The most descriptors one frame may carry.
pub const MAX_FDS: usize = 64;

/// Bytes of control buffer for [`MAX_FDS`] descriptors (`CMSG_SPACE`), rounded up.
const CMSG_BYTES: usize = 64 * 4 + 64;

/// A control buffer aligned for `cmsghdr`.
#[repr(C, align(8))]
struct Cmsg([u8; CMSG_BYTES]);

fn cmsg_space(n: usize) -> io::Result<usize> {
    let bytes = u32::try_from(n * std::mem::size_of::<RawFd>()).map_err(io::Error::other)?;
    // SAFETY: CMSG_SPACE is pure arithmetic on its argument.
    let space = unsafe { libc::CMSG_SPACE(bytes) };
    usize::try_from(space).map_err(io::Error::other)
}

/// Writes all of `bytes` to `stream`, with `fds` attached to the first byte.
pub fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.is_empty() || fds.len() > MAX_FDS || bytes.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "1 to 64 descriptors",
        ));
    }
    let space = cmsg_space(fds.len())?;
    if space > CMSG_BYTES {
        return Err(io::Error::other("control buffer too small"));
    }
    let mut control = Cmsg([0u8; CMSG_BYTES]);
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { MaybeUninit::zeroed().assume_init() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let data_len = u32::try_from(std::mem::size_of_val(fds)).map_err(io::Error::other)?;
    // SAFETY: msg_control points at `control`, at least CMSG_SPACE(data_len) bytes, aligned
    // for cmsghdr; CMSG_FIRSTHDR returns a pointer inside it (non-null: controllen > 0).
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(data_len) as _;
        let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
        for (i, fd) in fds.iter().enumerate() {
            data.add(i).write_unaligned(fd.as_raw_fd());
        }
    }
    // SAFETY: `msg` describes `bytes` (read only by the kernel) and the control buffer built
    // above, both alive for the call; the descriptors are borrowed and stay open.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    let sent = usize::try_from(sent).map_err(|_| io::Error::last_os_error())?;
    let mut rest = stream;
    rest.write_all(&bytes[sent..])
}

/// Reads a stream with `recvmsg`, keeping the descriptors that arrive.
pub struct FdReader {
    stream: UnixStream,
    fds: VecDeque<OwnedFd>,
}

impl FdReader {
    /// Reads `stream`.
    pub fn new(stream: UnixStream) -> Self {
        FdReader {
            stream,
            fds: VecDeque::new(),
        }
    }

    /// Takes the `n` oldest descriptors received, or none if fewer arrived.
    pub fn take_fds(&mut self, n: usize) -> Option<Vec<OwnedFd>> {
        (self.fds.len() >= n).then(|| self.fds.drain(..n).collect())
    }

    /// Closes every descriptor received and not taken.
    pub fn drop_fds(&mut self) -> usize {
        let n = self.fds.len();
        self.fds.clear();
        n
    }
}

impl Read for FdReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut control = Cmsg([0u8; CMSG_BYTES]);
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let mut msg: libc::msghdr = unsafe { MaybeUninit::zeroed().assume_init() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.0.as_mut_ptr().cast();
        msg.msg_controllen = CMSG_BYTES as _;
        // SAFETY: `msg` points at `buf` and `control`, both writable and alive for the call.
        let n = unsafe { libc::recvmsg(self.stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
        // SAFETY: the kernel filled `control` up to msg_controllen; CMSG_FIRSTHDR/NXTHDR walk
        // only inside it, and each SCM_RIGHTS payload holds (cmsg_len - CMSG_LEN(0)) / 4
        // descriptors that are now ours to own.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let len =
                        ((*cmsg).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                    let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                    for i in 0..len / std::mem::size_of::<RawFd>() {
                        let fd = data.add(i).read_unaligned();
                        self.fds.push_back(OwnedFd::from_raw_fd(fd));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "too many descriptors",
            ));
        }
        Ok(n)
    }
}
