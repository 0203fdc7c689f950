//! [`PeerCredentials`]: who is at the other end of a Unix socket, as the kernel saw it when
//! the peer connected (`SO_PEERCRED`): what a tenant's list of allowed users is checked
//! against, and what the broker's log names a client by.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

/// The process, user and group of a socket's peer when it connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCredentials {
    /// The peer's process id (in the broker's pid namespace; 0 when the peer is in another
    /// one the kernel cannot map).
    pub pid: i32,
    /// The peer's effective user id.
    pub uid: u32,
    /// The peer's effective group id.
    pub gid: u32,
}

/// The credentials of `stream`'s peer.
///
/// # Errors
/// What `getsockopt(SO_PEERCRED)` fails with (`Unsupported` off Linux).
pub fn peer_credentials(stream: &UnixStream) -> io::Result<PeerCredentials> {
    read(stream)
}

#[cfg(target_os = "linux")]
fn read(stream: &UnixStream) -> io::Result<PeerCredentials> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::ucred>())
        .map_err(|_| io::Error::other("ucred does not fit a socklen_t"))?;
    // SAFETY: the descriptor is open for the life of `stream`; `cred` and `len` are valid for
    // writes of `len` bytes, which is what getsockopt(SO_PEERCRED) writes at most.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::from_mut(&mut cred).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCredentials {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

#[cfg(not(target_os = "linux"))]
fn read(_stream: &UnixStream) -> io::Result<PeerCredentials> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "peer credentials are read on Linux only",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_pair_s_peer_is_this_process() {
        let (a, _b) = UnixStream::pair().unwrap();
        let cred = peer_credentials(&a).unwrap();
        assert_eq!(cred.pid, i32::try_from(std::process::id()).unwrap());
        // SAFETY: getuid and getgid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        assert_eq!((cred.uid, cred.gid), (uid, gid));
    }
}
