//! Plain device memory outside the VMM API (`cuMemAlloc`, `cuMemcpyDtoD`, `cuMemFree`): what
//! growing a buffer without virtual memory uses, for the realloc-and-copy baseline.

use kvvm_hal::{traced, BackendResult, DeviceAddress, DeviceId, Operation};

use super::CudaBackend;
use crate::conv::to_usize;

impl CudaBackend {
    /// Allocates `bytes` of plain device memory on `device` (`cuMemAlloc`), outside the VMM
    /// API: what growing a buffer without virtual memory uses (the realloc-and-copy baseline
    /// of the benchmarks). The caller frees it with [`mem_free`](Self::mem_free).
    pub fn mem_alloc(&self, device: DeviceId, bytes: u64) -> BackendResult<DeviceAddress> {
        let op = Operation::CopyToDevice;
        traced(
            tracing::debug_span!("kvvm_cuda", op = "cuMemAlloc", %device, bytes),
            || {
                self.make_device_current(op, device)?;
                let len = to_usize(op, "size", bytes)?;
                self.check(op, self.driver.mem_alloc(len))
                    .map(DeviceAddress)
            },
        )
    }

    /// Frees memory from [`mem_alloc`](Self::mem_alloc) (`cuMemFree`).
    pub fn mem_free(&self, device: DeviceId, ptr: DeviceAddress) -> BackendResult<()> {
        let op = Operation::CopyToDevice;
        traced(
            tracing::debug_span!("kvvm_cuda", op = "cuMemFree", %device, %ptr),
            || {
                self.make_device_current(op, device)?;
                self.check(op, self.driver.mem_free(ptr.0))
            },
        )
    }

    /// Copies `bytes` device to device (`cuMemcpyDtoD`) on `device`; the copy is complete
    /// once the device is synchronized.
    pub fn copy_device_to_device(
        &self,
        device: DeviceId,
        dst: DeviceAddress,
        src: DeviceAddress,
        bytes: u64,
    ) -> BackendResult<()> {
        let op = Operation::CopyToDevice;
        traced(
            tracing::debug_span!("kvvm_cuda", op = "cuMemcpyDtoD", %device, bytes),
            || {
                self.make_device_current(op, device)?;
                let len = to_usize(op, "size", bytes)?;
                self.check(op, self.driver.memcpy_dtod(dst.0, src.0, len))
            },
        )
    }
}
