//! [`KernelProbe`] on the simulated device.

use kvvm_hal::{BackendResult, DeviceAddress, DeviceId, KernelProbe, KernelProbeOp, Operation};

use super::call::Covered;
use super::SimBackend;

/// The probe kernels on the simulated device: loads and stores checked against the access of
/// the launching device (`state/kernel.rs`); a fault is `DeviceLost` and leaves the device
/// usable.
impl KernelProbe for SimBackend {
    fn run(
        &self,
        device: DeviceId,
        op: KernelProbeOp,
        address: DeviceAddress,
        len: u64,
        value: u8,
    ) -> BackendResult<u64> {
        self.call(Operation::Kernel, |s| {
            s.device(Operation::Kernel, device)?;
            Ok((s.kernel(device, op, address, len, value)?, Covered::NOTHING))
        })
    }

    fn faults_are_recoverable(&self) -> bool {
        true
    }
}
