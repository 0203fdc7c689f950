//! File descriptors over a Unix stream socket (`SCM_RIGHTS`): [`send_with_fds`] attaches
//! descriptors to the first byte of a write; [`FdReader`] reads with `recvmsg` so descriptors
//! that arrive are kept (a plain `read` would close them) until the frame that carries them
//! is parsed. A reader keeps at most [`MAX_FDS`] descriptors not taken (more is an error: a
//! peer cannot fill the process's descriptor table with a frame it never finishes), and may
//! be given a deadline for its reads.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

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

/// A message header over the one buffer of `iov` and the first `control_len` bytes of
/// `control` (at most its size). Its pointers are valid while `iov` and `control` are.
fn header(iov: &mut libc::iovec, control: &mut Cmsg, control_len: usize) -> libc::msghdr {
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { MaybeUninit::zeroed().assume_init() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = control_len.min(CMSG_BYTES) as _;
    msg
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
    let msg = header(&mut iov, &mut control, space);
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
    deadline: Option<Instant>,
}

impl std::fmt::Debug for FdReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdReader")
            .field("fds", &self.fds.len())
            .field("deadline", &self.deadline)
            .finish()
    }
}

/// Waits until `fd` has something to read (data, a descriptor or the end), or `deadline`
/// passes (`TimedOut`).
fn wait_readable(fd: RawFd, deadline: Instant) -> io::Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        // Rounded up: a wait of 0 ms would spin until the deadline.
        let ms = libc::c_int::try_from(left.as_millis().saturating_add(1)).unwrap_or(i32::MAX);
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid pollfd for the call; the descriptor is open.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        match rc {
            0 => {}
            r if r > 0 => return Ok(()),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// Whether `fd` has something to read within `wait` (`false`: nothing came).
pub(crate) fn readable_within(fd: RawFd, wait: std::time::Duration) -> io::Result<bool> {
    match wait_readable(fd, Instant::now() + wait) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::TimedOut => Ok(false),
        Err(e) => Err(e),
    }
}

impl FdReader {
    /// Reads `stream`.
    pub fn new(stream: UnixStream) -> Self {
        FdReader {
            stream,
            fds: VecDeque::new(),
            deadline: None,
        }
    }

    /// From now on, a read that has nothing by `deadline` fails with `TimedOut` (`None`: reads
    /// wait as long as it takes).
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }

    /// The stream read.
    pub fn stream(&self) -> &UnixStream {
        &self.stream
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
        if let Some(deadline) = self.deadline {
            wait_readable(self.stream.as_raw_fd(), deadline)?;
        }
        let mut control = Cmsg([0u8; CMSG_BYTES]);
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut msg = header(&mut iov, &mut control, CMSG_BYTES);
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
        if msg.msg_flags & libc::MSG_CTRUNC != 0 || self.fds.len() > MAX_FDS {
            self.fds.clear();
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "too many descriptors",
            ));
        }
        Ok(n)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::fd::AsFd;
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_write_carries_1_to_64_descriptors_and_a_reader_keeps_at_most_64_not_taken() {
        let (a, b) = UnixStream::pair().unwrap();
        let null = std::fs::File::open("/dev/null").unwrap();
        let many: Vec<OwnedFd> = (0..65)
            .map(|_| null.as_fd().try_clone_to_owned().unwrap())
            .collect();
        let fds: Vec<BorrowedFd<'_>> = many.iter().map(AsFd::as_fd).collect();
        assert!(send_with_fds(&a, b"x", &[]).is_err(), "none");
        assert!(send_with_fds(&a, b"x", &fds).is_err(), "65");
        assert!(
            send_with_fds(&a, b"", &fds[..1]).is_err(),
            "no byte to carry them"
        );
        // Two writes of 40 before the frame they ride on is read: 80 kept is too many.
        send_with_fds(&a, b"a", &fds[..40]).unwrap();
        send_with_fds(&a, b"b", &fds[..40]).unwrap();
        let mut r = FdReader::new(b);
        let mut buf = [0u8; 1];
        assert_eq!(r.read(&mut buf).unwrap(), 1);
        assert_eq!(r.take_fds(40).map(|f| f.len()), Some(40));
        send_with_fds(&a, b"c", &fds[..40]).unwrap();
        assert_eq!(r.read(&mut buf).unwrap(), 1, "40 kept: fine");
        assert_eq!(
            r.read(&mut buf).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        assert_eq!(r.drop_fds(), 0, "the descriptors are closed");
        assert_eq!(format!("{r:?}"), "FdReader { fds: 0, deadline: None }");
    }

    extern "C" fn nothing(_: libc::c_int) {}

    #[test]
    fn a_signal_does_not_cut_a_wait_short() {
        // SAFETY: sigaction is plain data; all-zero is an empty action.
        let mut sa: libc::sigaction = unsafe { MaybeUninit::zeroed().assume_init() };
        sa.sa_sigaction = nothing as extern "C" fn(libc::c_int) as usize;
        // SAFETY: a handler that does nothing, for a signal nothing else in these tests uses.
        let installed = unsafe { libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut()) };
        assert_eq!(installed, 0);
        let (_a, b) = UnixStream::pair().unwrap();
        let fd = b.as_raw_fd();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            // SAFETY: pthread_self cannot fail.
            tx.send(unsafe { libc::pthread_self() }).unwrap();
            wait_readable(fd, Instant::now() + Duration::from_millis(300)).map_err(|e| e.kind())
        });
        let thread = rx.recv().unwrap();
        while !waiter.is_finished() {
            // SAFETY: the thread is not joined yet, so its id is valid; the signal is handled.
            unsafe { libc::pthread_kill(thread, libc::SIGUSR2) };
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(waiter.join().unwrap(), Err(io::ErrorKind::TimedOut));
    }

    #[test]
    fn a_read_waits_until_its_deadline_and_no_longer() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut r = FdReader::new(b);
        r.set_deadline(Some(Instant::now() + Duration::from_millis(50)));
        let mut buf = [0u8; 1];
        assert_eq!(
            r.read(&mut buf).unwrap_err().kind(),
            io::ErrorKind::TimedOut
        );
        let fd = r.stream().as_raw_fd();
        assert!(!readable_within(fd, Duration::from_millis(10)).unwrap());
        (&a).write_all(b"x").unwrap();
        assert!(readable_within(fd, Duration::from_secs(20)).unwrap());
        r.set_deadline(Some(Instant::now() + Duration::from_secs(20)));
        assert_eq!(r.read(&mut buf).unwrap(), 1);
    }
}
