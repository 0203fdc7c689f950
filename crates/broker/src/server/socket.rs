//! The broker's socket file: what may be at its path before (nothing, or a stale socket no
//! broker answers on), and a bind that gives the socket its final mode before it can be
//! connected to.
//!
//! `bind(2)` makes the socket file with the process's umask; a `chmod` afterwards leaves a
//! moment in which the looser mode lets anyone connect. So the socket is bound in a private
//! directory beside its path (mode 0700: nobody else can reach it there), given its mode, and
//! renamed over its path (atomically: at its path it has its final mode from the start).

use std::ffi::{CString, OsString};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::error::BrokerError;

fn refused(path: &Path, kind: io::ErrorKind, why: String) -> BrokerError {
    BrokerError::path("the socket", path, io::Error::new(kind, why))
}

/// What a file type is, in words.
fn what(t: std::fs::FileType) -> &'static str {
    if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a pipe"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "not a socket"
    }
}

/// The folder `path` lies in.
fn folder(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Checks what is at `path` before a broker binds it: nothing, or a stale socket (one no
/// broker answers on), which the bind replaces. A live socket, anything that is not a
/// socket, and a path in a folder that does not exist are refused, each named.
pub(super) fn check_path(path: &Path) -> Result<(), BrokerError> {
    let dir = folder(path);
    if !dir.is_dir() {
        let why = format!("its folder {} does not exist", dir.display());
        return Err(refused(path, io::ErrorKind::NotFound, why));
    }
    match std::fs::symlink_metadata(path) {
        // Nothing there (or what is there cannot be looked at: the bind says why).
        Err(_) => Ok(()),
        Ok(m) if !m.file_type().is_socket() => {
            let why = format!(
                "{} is there, not a stale socket: it is left alone",
                what(m.file_type())
            );
            Err(refused(path, io::ErrorKind::AlreadyExists, why))
        }
        Ok(_) if UnixStream::connect(path).is_ok() => {
            let why = "a broker already listens on it".to_owned();
            Err(refused(path, io::ErrorKind::AddrInUse, why))
        }
        Ok(_) => Ok(()),
    }
}

/// A new private directory (mode 0700) in `dir`.
fn private_dir(dir: &Path) -> io::Result<PathBuf> {
    let mut template = dir.as_os_str().as_bytes().to_vec();
    template.extend_from_slice(b"/.kvvmXXXXXX");
    let template = CString::new(template).map_err(io::Error::other)?;
    let mut buf = template.into_bytes_with_nul();
    // SAFETY: `buf` is a writable NUL-terminated template ending in six X; mkdtemp replaces
    // them in place and returns `buf`'s pointer or null.
    let made = unsafe { libc::mkdtemp(buf.as_mut_ptr().cast()) };
    if made.is_null() {
        return Err(io::Error::last_os_error());
    }
    buf.pop(); // the NUL
    let made = PathBuf::from(OsString::from_vec(buf));
    // mkdtemp asks for 0700, which the umask may have narrowed further.
    std::fs::set_permissions(&made, std::fs::Permissions::from_mode(0o700))?;
    Ok(made)
}

/// Binds a socket at `path` with `mode`: made in a private directory beside it, given its
/// mode there, then renamed over `path` (replacing a stale socket checked by
/// [`check_path`]).
pub(super) fn bind(path: &Path, mode: u32) -> Result<UnixListener, BrokerError> {
    let fail = |e: io::Error| BrokerError::path("the socket", path, e);
    let dir = private_dir(folder(path)).map_err(fail)?;
    let tmp = dir.join("s");
    let bound = UnixListener::bind(&tmp).and_then(|listener| {
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&tmp, path)?;
        Ok(listener)
    });
    let _ = std::fs::remove_file(&tmp);
    let _ = std::fs::remove_dir(&dir);
    bound.map_err(fail)
}
