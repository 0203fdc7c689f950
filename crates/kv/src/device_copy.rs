//! Copies from device memory to device memory for the KV layer: a shared prefix's tail
//! captured from its owner, and the bytes a sharer receives instead of mapping them. Each is a
//! [`RowCopy`] (one row per fragment of a plan, the fragments a slice stride apart) queued on
//! the default stream and waited for, or, on a backend that cannot copy rows, staged through
//! host memory one row at a time.

use kvvm_hal::{DeviceAddress, ErrorKind, RowCopy, StreamHandle};
use kvvm_num::{add, mul, to_usize};
use kvvm_vmm::VirtualMemory;

use crate::error::KvCacheError;

/// Largest host staging buffer of a row copied through host memory.
const STAGE_BYTES: u64 = 64 << 20;

/// Runs `copies` on `vm`'s device and waits until they are done: on return every destination
/// byte holds its source byte. The caller has checked that every destination is mapped
/// writable and every source readable, and that nothing else writes either while the copy
/// runs.
pub(crate) fn copy_rows(vm: &VirtualMemory, copies: &[RowCopy]) -> Result<u64, KvCacheError> {
    let backend = vm.backend();
    let mut bytes = 0u64;
    let mut queued = false;
    for copy in copies.iter().filter(|c| c.rows > 0 && c.width > 0) {
        match backend.copy_rows_async(copy, StreamHandle::default()) {
            Ok(()) => queued = true,
            Err(e) if e.kind == ErrorKind::NotSupported => staged(vm, copy)?,
            Err(e) => return Err(e.into()),
        }
        bytes = add(
            bytes,
            mul(copy.rows, copy.width, "copied bytes")?,
            "copied bytes",
        )?;
    }
    if queued {
        backend.synchronize(vm.device())?;
    }
    Ok(bytes)
}

/// One row copy through host memory, in pieces of at most [`STAGE_BYTES`].
fn staged(vm: &VirtualMemory, copy: &RowCopy) -> Result<(), KvCacheError> {
    copy.check()?;
    let backend = vm.backend();
    let mut buf = Vec::new();
    for row in 0..copy.rows {
        let src = add(copy.src.0, mul(row, copy.src_pitch, "row")?, "row")?;
        let dst = add(copy.dst.0, mul(row, copy.dst_pitch, "row")?, "row")?;
        let mut done = 0u64;
        while done < copy.width {
            let n = STAGE_BYTES.min(copy.width - done);
            buf.resize(to_usize(n, "staged bytes")?, 0);
            backend.copy_from_device(&mut buf, DeviceAddress(add(src, done, "row")?))?;
            backend.copy_to_device(DeviceAddress(add(dst, done, "row")?), &buf)?;
            done += n;
        }
    }
    Ok(())
}
