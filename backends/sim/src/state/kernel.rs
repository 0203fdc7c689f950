//! The probe "kernels" of [`KernelProbe`](kvvm_hal::KernelProbe) on the simulated device: a
//! load or a store of every byte of a range, checked against the access the *launching* device
//! has to each mapping (a copy is checked against the holding device's instead). A forbidden
//! or unmapped access is the fault a GPU reports (`DeviceLost`, the simulated
//! `ILLEGAL_ADDRESS`) and nothing is written; unlike a GPU's, the simulated device stays
//! usable afterwards, so the conformance suite provokes such faults in its own process
//! ([`KernelProbe::faults_are_recoverable`](kvvm_hal::KernelProbe::faults_are_recoverable)).
//! The trait implementation, one call of [`State::kernel`], is in `lib.rs`.

use kvvm_hal::{BackendError, DeviceAddress, DeviceId, ErrorKind, KernelProbeOp, Operation};

use super::State;
use crate::error::sim_error;

impl State {
    /// What the probe kernel does on `device`: the wrapping sum of the bytes for a load, 0
    /// after a store of `value` into every byte.
    pub(crate) fn kernel(
        &mut self,
        device: DeviceId,
        op: KernelProbeOp,
        address: DeviceAddress,
        len: u64,
        value: u8,
    ) -> Result<u64, BackendError> {
        let kop = Operation::Kernel;
        let store = op == KernelProbeOp::Store;
        // Every byte is checked before any is touched: a faulting store writes nothing.
        let pieces = self
            .pieces_for(kop, address.0, len, store, Some(device))
            .map_err(|e| {
                let why = e.detail.unwrap_or_default();
                sim_error(
                    kop,
                    ErrorKind::DeviceLost,
                    format!("kernel on {device} faulted: {why}"),
                )
            })?;
        let n = usize::try_from(len)
            .map_err(|_| sim_error(kop, ErrorKind::InvalidValue, "probe length past usize"))?;
        if store {
            self.write_pieces(&pieces, &vec![value; n]);
            return Ok(0);
        }
        let mut bytes = vec![0u8; n];
        self.read_pieces(&pieces, &mut bytes);
        let sum = bytes
            .iter()
            .fold(0u64, |acc, &b| acc.wrapping_add(u64::from(b)));
        Ok(sum)
    }
}
