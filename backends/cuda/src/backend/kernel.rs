//! [`KernelProbe`] for [`CudaBackend`]: one launch of a probe kernel, in the device's context.

use kvvm_hal::sync::Unpoison;
use std::ffi::{c_uint, c_void};

use kvvm_hal::{BackendResult, DeviceAddress, DeviceId, KernelProbe, KernelProbeOp, Operation};

use super::CudaBackend;
use crate::probe::{grid_for, ProbeModule, BLOCK};

impl KernelProbe for CudaBackend {
    fn run(
        &self,
        device: DeviceId,
        op: KernelProbeOp,
        address: DeviceAddress,
        len: u64,
        value: u8,
    ) -> BackendResult<u64> {
        let kop = Operation::Kernel;
        let span = tracing::debug_span!(
            "kvvm_cuda",
            op = "cuLaunchKernel",
            %device,
            probe = ?op,
            %address,
            len
        );
        let _entered = span.enter();
        let dev = self.device(kop, device)?;
        self.make_current(kop, dev)?;
        // One probe at a time per device: the `out` buffer is shared. The lock is held until
        // the probe has finished.
        let mut slot = dev.probe.lock().unpoisoned();
        let module = match *slot {
            Some(module) => module,
            None => {
                let module = self.check(kop, ProbeModule::load(&self.driver))?;
                *slot = Some(module);
                module
            }
        };
        let grid = grid_for(len);
        let block = c_uint::try_from(BLOCK).unwrap_or(256);
        let mut ptr: u64 = address.0;
        let mut count: u64 = len;
        let result = match op {
            KernelProbeOp::Load => {
                self.check(kop, self.driver.memcpy_htod(module.out, &[0u8; 8]))?;
                let mut out: u64 = module.out;
                let mut params = [
                    (&mut ptr as *mut u64).cast::<c_void>(),
                    (&mut count as *mut u64).cast::<c_void>(),
                    (&mut out as *mut u64).cast::<c_void>(),
                ];
                // SAFETY: `module.load` belongs to the module loaded in this (current)
                // context, and `params` points to three u64 values, the kernel's three .u64
                // parameters.
                self.check(kop, unsafe {
                    self.driver.launch(module.load, grid, block, &mut params)
                })?;
                self.check(kop, self.driver.ctx_synchronize())?;
                let mut bytes = [0u8; 8];
                self.check(kop, self.driver.memcpy_dtoh(&mut bytes, module.out))?;
                u64::from_le_bytes(bytes)
            }
            KernelProbeOp::Store => {
                let mut v = u32::from(value);
                let mut params = [
                    (&mut ptr as *mut u64).cast::<c_void>(),
                    (&mut count as *mut u64).cast::<c_void>(),
                    (&mut v as *mut u32).cast::<c_void>(),
                ];
                // SAFETY: `module.store` belongs to the module loaded in this (current)
                // context, and `params` points to two u64 values and one u32, the kernel's
                // .u64, .u64, .u32 parameters.
                self.check(kop, unsafe {
                    self.driver.launch(module.store, grid, block, &mut params)
                })?;
                self.check(kop, self.driver.ctx_synchronize())?;
                0
            }
        };
        tracing::debug!(result, "probe done");
        Ok(result)
    }
}
