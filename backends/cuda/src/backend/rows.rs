//! Row copies ([`VirtualMemoryBackend::copy_rows_async`]) as one launch of a tiny kernel on the
//! caller's stream.
//!
//! `cuMemcpy2DAsync` is not usable for what row copies are for: the driver validates the whole
//! `pitch x rows` span of a 2-D copy as one mapped range, and a batch of KV caches has its rows
//! one slot apart with unmapped address space (the slots' uncommitted tails) in between
//! (`CUDA_ERROR_INVALID_VALUE`, measured on an H200, driver 580.159.04). The kernel touches the
//! rows only. `kvvm_copy_rows(dst, dst_pitch, src, src_pitch, words, rows)` copies `words`
//! 32-bit words per row, a block per row (grid-stride over rows), the block's threads over the
//! words; hand-written PTX (ISA 7.0, sm_70), JIT-compiled by the driver, loaded once per device.
//!
//! [`VirtualMemoryBackend::copy_rows_async`]: kvvm_hal::VirtualMemoryBackend::copy_rows_async

use kvvm_hal::sync::Unpoison;
use std::ffi::{c_uint, c_void};

use cudarc::driver::sys::CUstream;
use kvvm_hal::{BackendError, BackendResult, ErrorKind, Operation, RowCopy, StreamHandle};

use super::CudaBackend;
use crate::rows_kernel::{block_for, RowsModule, MAX_BLOCKS};

fn invalid(detail: String) -> BackendError {
    BackendError::raised(Operation::CopyRows, ErrorKind::InvalidValue, detail)
}

impl CudaBackend {
    /// [`VirtualMemoryBackend::copy_rows_async`](kvvm_hal::VirtualMemoryBackend::copy_rows_async):
    /// one launch of `kvvm_copy_rows` on `stream`, in the context of the device that owns
    /// `copy.dst`. Addresses, pitches and the width must be multiples of 4 bytes (the kernel
    /// moves 32-bit words): `InvalidValue` otherwise, as for an ill-formed copy.
    pub(crate) fn launch_copy_rows(
        &self,
        copy: &RowCopy,
        stream: StreamHandle,
    ) -> BackendResult<()> {
        let op = Operation::CopyRows;
        copy.check()?;
        if copy.rows == 0 || copy.width == 0 {
            return Ok(());
        }
        let unaligned = [
            copy.dst.0,
            copy.src.0,
            copy.dst_pitch,
            copy.src_pitch,
            copy.width,
        ]
        .iter()
        .any(|v| v % 4 != 0);
        if unaligned {
            return Err(invalid(format!(
                "row copy {copy:?}: addresses, pitches and width must be multiples of 4 bytes"
            )));
        }
        let device = self.owner_device(op, copy.dst)?;
        self.make_current(op, device)?;
        let module = {
            let mut slot = device.rows.lock().unpoisoned();
            match *slot {
                Some(m) => m,
                None => {
                    let m = self.check(op, RowsModule::load(&self.driver))?;
                    *slot = Some(m);
                    m
                }
            }
        };
        let mut dst = copy.dst.0;
        let mut dst_pitch = copy.dst_pitch;
        let mut src = copy.src.0;
        let mut src_pitch = copy.src_pitch;
        let mut words = copy.width / 4;
        let mut rows = copy.rows;
        let grid = c_uint::try_from(rows.min(MAX_BLOCKS)).unwrap_or(1);
        let mut params = [
            (&mut dst as *mut u64).cast::<c_void>(),
            (&mut dst_pitch as *mut u64).cast::<c_void>(),
            (&mut src as *mut u64).cast::<c_void>(),
            (&mut src_pitch as *mut u64).cast::<c_void>(),
            (&mut words as *mut u64).cast::<c_void>(),
            (&mut rows as *mut u64).cast::<c_void>(),
        ];
        let stream = stream.0 as usize as CUstream;
        // SAFETY: `module.copy` belongs to the module loaded in the device's context, now
        // current; `params` points to six u64 values, the kernel's six .u64 parameters; the
        // stream is the caller's live stream of this context or 0 (`StreamHandle`'s contract).
        // The kernel dereferences device addresses only: a bad one is a device fault the
        // driver reports, never a host access.
        let r = unsafe {
            self.driver
                .launch_on(module.copy, grid, block_for(words), stream, &mut params)
        };
        self.check(op, r)
    }
}
