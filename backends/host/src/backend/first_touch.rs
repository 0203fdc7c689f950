//! The benchmark baseline beside the host backend: plain anonymous memory, first touched.

use std::time::{Duration, Instant};

use kvvm_hal::{BackendResult, Operation};

use crate::conv::{pointer, to_usize};
use crate::result;

/// The benchmark baseline: `mmap` of `len` bytes of plain anonymous read-write memory and a
/// first touch of every page (one byte written a page), timed; then `munmap` (not timed).
pub fn mmap_first_touch(len: u64) -> BackendResult<Duration> {
    let op = Operation::CopyToDevice;
    let n = to_usize(op, "length", len)?;
    let page = to_usize(op, "page size", result::page_size())?;
    let start = Instant::now();
    let address = result::anonymous_read_write(n).map_err(|e| e.to_error(op))?;
    let base = pointer(op, address)?.cast::<u8>();
    for offset in (0..n).step_by(page.max(1)) {
        // SAFETY: `[base, base + n)` is the read-write mapping just made, private to this
        // function.
        unsafe { base.add(offset).write_volatile(1) };
    }
    let elapsed = start.elapsed();
    // SAFETY: the mapping made above, no longer used.
    unsafe { result::unmap(base.cast(), n) }.map_err(|e| e.to_error(Operation::Free))?;
    Ok(elapsed)
}
