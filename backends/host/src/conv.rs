//! Conversions between the trait's neutral values and the kernel's: [`Access`] to protection
//! flags, checked `u64` <-> `usize`, and addresses to pointers.
//!
//! A device address of this backend *is* a virtual address of the process. Addresses are kept
//! as integers in the bookkeeping and turned back into pointers with
//! [`std::ptr::with_exposed_provenance_mut`]: every address the backend hands out comes from a
//! pointer that `mmap` returned and whose provenance was exposed
//! ([`expose`]) when it was recorded.

use std::ffi::c_void;

use kvvm_hal::{Access, BackendResult, Operation};
use rustix::mm::MprotectFlags;

use crate::error::invalid;

/// The `mprotect` flags of an [`Access`]: `None` -> `PROT_NONE`, `Read` -> `PROT_READ`,
/// `ReadWrite` -> `PROT_READ | PROT_WRITE`. Enforced by the MMU for every access through the
/// mapping, the backend's own copies included (which check first, so they never fault).
pub(crate) fn protection(access: Access) -> MprotectFlags {
    match access {
        Access::None => MprotectFlags::empty(),
        Access::Read => MprotectFlags::READ,
        Access::ReadWrite => MprotectFlags::READ | MprotectFlags::WRITE,
    }
}

/// `value` as a `usize`, or `InvalidValue` naming `what`.
pub(crate) fn to_usize(op: Operation, what: &str, value: u64) -> BackendResult<usize> {
    usize::try_from(value).map_err(|_| invalid(op, format!("{what} {value} does not fit in usize")))
}

/// `value` as a `u64` (exact on every 32- and 64-bit target; saturates otherwise).
pub(crate) fn to_u64(value: usize) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

/// Whether `value` is a multiple of `granule` (a granule of 0 divides nothing).
pub(crate) fn is_multiple(value: u64, granule: u64) -> bool {
    granule != 0 && value.is_multiple_of(granule)
}

/// `value` rounded up to a multiple of the power of two `align`, or `None` on overflow.
pub(crate) fn align_up(value: u64, align: u64) -> Option<u64> {
    let mask = align.checked_sub(1)?;
    value.checked_add(mask).map(|v| v & !mask)
}

/// Exposes the provenance of a pointer `mmap` returned and gives its address.
pub(crate) fn expose(ptr: *mut c_void) -> u64 {
    to_u64(ptr.expose_provenance())
}

/// The pointer of an address recorded by [`expose`] (or derived from one by offset
/// arithmetic inside the same mapping). `InvalidValue` if it does not fit a pointer.
pub(crate) fn pointer(op: Operation, address: u64) -> BackendResult<*mut c_void> {
    let a = to_usize(op, "address", address)?;
    Ok(std::ptr::with_exposed_provenance_mut(a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_maps_onto_protection() {
        assert_eq!(protection(Access::None), MprotectFlags::empty());
        assert_eq!(protection(Access::Read), MprotectFlags::READ);
        assert_eq!(
            protection(Access::ReadWrite),
            MprotectFlags::READ | MprotectFlags::WRITE
        );
    }

    #[test]
    fn conversions_are_checked() {
        assert_eq!(to_usize(Operation::Map, "size", 4096).ok(), Some(4096));
        assert_eq!(to_u64(7), 7);
        assert_eq!(align_up(5, 4), Some(8));
        assert_eq!(align_up(8, 4), Some(8));
        assert_eq!(align_up(u64::MAX, 4), None);
        assert!(is_multiple(8192, 4096) && !is_multiple(4097, 4096));
        assert!(!is_multiple(4096, 0));
    }

    #[test]
    fn addresses_roundtrip_through_pointers() {
        let mut x = 5u8;
        let p: *mut c_void = (&raw mut x).cast();
        let a = expose(p);
        assert_eq!(pointer(Operation::Map, a).ok(), Some(p));
    }
}
