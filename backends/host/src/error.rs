//! `errno` values: their names and the [`ErrorKind`] each one maps onto, in one table.
//!
//! Every error of this backend carries an `errno`: the one the kernel returned, or, when the
//! backend itself refuses a call that the kernel would let through (a map over a live
//! mapping, a second release, ...), the `errno` whose kind is the driver's answer
//! (`refused`): `EINVAL` for `InvalidValue`, `EOPNOTSUPP` for `NotSupported`, `ENOMEM` for
//! `OutOfMemory`. The classification follows the contract of `kvvm-hal`:
//!
//! | errno | kind |
//! |---|---|
//! | `ENOMEM`, `ENOSPC` (no memory, tmpfs full), `EMFILE`, `ENFILE` (no descriptor left for a handle) | `OutOfMemory` |
//! | `EINVAL`, `EBADF`, `EEXIST`, `EFAULT`, `EOVERFLOW`, `ENXIO`, `EFBIG`, `ESPIPE` | `InvalidValue` |
//! | `EOPNOTSUPP`, `EPERM`, `EACCES`, `ENODEV`, `ETXTBSY`, `EBUSY` | `NotSupported` |
//! | `ENOSYS` (the kernel lacks the call: `memfd_create` needs Linux 3.17) | `Unavailable` |
//! | everything else (`EINTR`, `EAGAIN`, `EIO`, ...), including values this table does not know | `Other` |
//!
//! Nothing maps onto `DeviceLost`: the CPU has no sticky context error. A faulting access
//! through a mapping is a `SIGSEGV` that ends the process (see the crate docs).

// The refusal helpers are used by the Linux implementation only.
#![cfg_attr(not(target_os = "linux"), allow(dead_code))]

use kvvm_hal::{BackendError, ErrorCodes, ErrorKind, Operation};

/// A raw `errno` value, as the kernel returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Errno(pub i32);

impl Errno {
    /// `EPERM`.
    pub const PERM: Errno = Errno(1);
    /// `EINTR`.
    pub const INTR: Errno = Errno(4);
    /// `EBADF`.
    pub const BADF: Errno = Errno(9);
    /// `EAGAIN`.
    pub const AGAIN: Errno = Errno(11);
    /// `ENOMEM`.
    pub const NOMEM: Errno = Errno(12);
    /// `EEXIST`.
    pub const EXIST: Errno = Errno(17);
    /// `EINVAL`.
    pub const INVAL: Errno = Errno(22);
    /// `EMFILE`.
    pub const MFILE: Errno = Errno(24);
    /// `ENOSYS`.
    pub const NOSYS: Errno = Errno(38);
    /// `EOPNOTSUPP`.
    pub const OPNOTSUPP: Errno = Errno(95);

    /// The value's symbolic name (`"ENOMEM"`), if this table knows it.
    pub fn name(self) -> Option<&'static str> {
        errno_name(self.0)
    }

    /// The neutral classification of the value.
    pub fn kind(self) -> ErrorKind {
        classify(self.0)
    }

    /// A [`BackendError`] for `op` carrying the value, its name and its kind.
    pub fn to_error(self, op: Operation) -> BackendError {
        CODES.error(op, self.0, "errno")
    }
}

/// `(errno, name, kind)` of every value this backend knows (the generic Linux numbering of
/// x86_64 and aarch64; a unit test checks it against rustix on the build target): one table,
/// read by [`errno_name`] and [`classify`].
const CODES: ErrorCodes<i32> = ErrorCodes::new(&[
    (1, "EPERM", ErrorKind::NotSupported),
    (2, "ENOENT", ErrorKind::Other),
    (4, "EINTR", ErrorKind::Other),
    (5, "EIO", ErrorKind::Other),
    (6, "ENXIO", ErrorKind::InvalidValue),
    (9, "EBADF", ErrorKind::InvalidValue),
    (11, "EAGAIN", ErrorKind::Other),
    (12, "ENOMEM", ErrorKind::OutOfMemory),
    (13, "EACCES", ErrorKind::NotSupported),
    (14, "EFAULT", ErrorKind::InvalidValue),
    (16, "EBUSY", ErrorKind::NotSupported),
    (17, "EEXIST", ErrorKind::InvalidValue),
    (19, "ENODEV", ErrorKind::NotSupported),
    (22, "EINVAL", ErrorKind::InvalidValue),
    (23, "ENFILE", ErrorKind::OutOfMemory),
    (24, "EMFILE", ErrorKind::OutOfMemory),
    (26, "ETXTBSY", ErrorKind::NotSupported),
    (27, "EFBIG", ErrorKind::InvalidValue),
    (28, "ENOSPC", ErrorKind::OutOfMemory),
    (29, "ESPIPE", ErrorKind::InvalidValue),
    (38, "ENOSYS", ErrorKind::Unavailable),
    (75, "EOVERFLOW", ErrorKind::InvalidValue),
    (95, "EOPNOTSUPP", ErrorKind::NotSupported),
]);

/// The symbolic name of an `errno` value, or `None` if this table does not know it.
pub fn errno_name(errno: i32) -> Option<&'static str> {
    CODES.name(errno)
}

/// The [`ErrorKind`] an `errno` value maps onto (see the module documentation); `Other` for a
/// value this table does not know.
pub fn classify(errno: i32) -> ErrorKind {
    CODES.kind(errno)
}

/// The `errno` this backend reports when it refuses a call itself with `kind`.
pub(crate) fn errno_for(kind: ErrorKind) -> Errno {
    match kind {
        ErrorKind::OutOfMemory => Errno::NOMEM,
        ErrorKind::InvalidValue => Errno::INVAL,
        ErrorKind::NotSupported => Errno::OPNOTSUPP,
        ErrorKind::Unavailable => Errno::NOSYS,
        ErrorKind::DeviceLost | ErrorKind::Other => Errno::AGAIN,
    }
}

/// A refusal by the backend's own bookkeeping: the driver's answer where the kernel would
/// have let the call through (or done something else).
pub(crate) fn refused(op: Operation, kind: ErrorKind, detail: impl Into<String>) -> BackendError {
    let mut e = errno_for(kind).to_error(op).with_detail(detail);
    e.kind = kind;
    e
}

/// `InvalidValue` (`EINVAL`) with a detail.
pub(crate) fn invalid(op: Operation, detail: impl Into<String>) -> BackendError {
    refused(op, ErrorKind::InvalidValue, detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_map_onto_kinds() {
        let cases: &[(i32, &str, ErrorKind)] = &[
            (12, "ENOMEM", ErrorKind::OutOfMemory),
            (28, "ENOSPC", ErrorKind::OutOfMemory),
            (24, "EMFILE", ErrorKind::OutOfMemory),
            (23, "ENFILE", ErrorKind::OutOfMemory),
            (22, "EINVAL", ErrorKind::InvalidValue),
            (9, "EBADF", ErrorKind::InvalidValue),
            (17, "EEXIST", ErrorKind::InvalidValue),
            (14, "EFAULT", ErrorKind::InvalidValue),
            (95, "EOPNOTSUPP", ErrorKind::NotSupported),
            (1, "EPERM", ErrorKind::NotSupported),
            (13, "EACCES", ErrorKind::NotSupported),
            (38, "ENOSYS", ErrorKind::Unavailable),
            (4, "EINTR", ErrorKind::Other),
            (11, "EAGAIN", ErrorKind::Other),
            (5, "EIO", ErrorKind::Other),
        ];
        for &(errno, name, kind) in cases {
            assert_eq!(errno_name(errno), Some(name), "name of {errno}");
            assert_eq!(classify(errno), kind, "kind of {name}");
        }
    }

    #[test]
    fn unknown_values_are_other_and_still_named() {
        assert_eq!(errno_name(4242), None);
        assert_eq!(classify(4242), ErrorKind::Other);
        let e = Errno(4242).to_error(Operation::Map);
        assert_eq!((e.kind, e.code), (ErrorKind::Other, 4242));
        assert_eq!(e.code_name, "errno 4242");
    }

    #[test]
    fn refusals_carry_the_errno_of_their_kind() {
        for kind in [
            ErrorKind::OutOfMemory,
            ErrorKind::InvalidValue,
            ErrorKind::NotSupported,
            ErrorKind::Unavailable,
        ] {
            let e = refused(Operation::Map, kind, "why");
            assert_eq!(e.kind, kind);
            assert_eq!(classify(i32::try_from(e.code).unwrap_or(0)), kind);
            assert_eq!(e.detail.as_deref(), Some("why"));
        }
        let e = invalid(Operation::Release, "handle 0x1 is not live");
        assert_eq!(
            e.to_string(),
            "release failed: invalid value (EINVAL, code 22): handle 0x1 is not live"
        );
        assert_eq!(
            refused(Operation::Map, ErrorKind::NotSupported, "x").kind,
            ErrorKind::NotSupported
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn table_agrees_with_rustix() {
        use rustix::io::Errno as R;
        let pairs = [
            (R::PERM, "EPERM"),
            (R::NOENT, "ENOENT"),
            (R::INTR, "EINTR"),
            (R::IO, "EIO"),
            (R::NXIO, "ENXIO"),
            (R::BADF, "EBADF"),
            (R::AGAIN, "EAGAIN"),
            (R::NOMEM, "ENOMEM"),
            (R::ACCESS, "EACCES"),
            (R::FAULT, "EFAULT"),
            (R::BUSY, "EBUSY"),
            (R::EXIST, "EEXIST"),
            (R::NODEV, "ENODEV"),
            (R::INVAL, "EINVAL"),
            (R::NFILE, "ENFILE"),
            (R::MFILE, "EMFILE"),
            (R::TXTBSY, "ETXTBSY"),
            (R::FBIG, "EFBIG"),
            (R::NOSPC, "ENOSPC"),
            (R::SPIPE, "ESPIPE"),
            (R::NOSYS, "ENOSYS"),
            (R::OVERFLOW, "EOVERFLOW"),
            (R::OPNOTSUPP, "EOPNOTSUPP"),
        ];
        for (errno, name) in pairs {
            assert_eq!(errno_name(errno.raw_os_error()), Some(name));
        }
        for (ours, theirs) in [
            (Errno::PERM, R::PERM),
            (Errno::INTR, R::INTR),
            (Errno::BADF, R::BADF),
            (Errno::AGAIN, R::AGAIN),
            (Errno::NOMEM, R::NOMEM),
            (Errno::EXIST, R::EXIST),
            (Errno::INVAL, R::INVAL),
            (Errno::MFILE, R::MFILE),
            (Errno::NOSYS, R::NOSYS),
            (Errno::OPNOTSUPP, R::OPNOTSUPP),
        ] {
            assert_eq!(ours.0, theirs.raw_os_error());
        }
    }
}
