//! The probe "kernels" of [`KernelProbe`] on the CPU: plain loads and stores through the
//! mapping, so that the MMU, not the backend, decides whether they may happen.
//!
//! The backend checks only that every byte of the range is mapped by it (so that a probe
//! never touches memory that is not a mapping of this backend); the protection is left to the
//! hardware. A load through a `Read` alias reads the owner's bytes; a store through it is
//! stopped by the MMU and the process dies of `SIGSEGV` (the host's equivalent of CUDA's
//! sticky `ILLEGAL_ADDRESS`), which is why the conformance suite runs the store in a child
//! process.

use kvvm_hal::{BackendResult, DeviceAddress, DeviceId, KernelProbe, KernelProbeOp, Operation};

use super::HostBackend;
use crate::conv::{pointer, to_usize};
use crate::state::State;

impl KernelProbe for HostBackend {
    fn run(
        &self,
        device: DeviceId,
        op: KernelProbeOp,
        address: DeviceAddress,
        len: u64,
        value: u8,
    ) -> BackendResult<u64> {
        let kop = Operation::Kernel;
        let span = tracing::debug_span!("kvvm_host", op = "probe", ?op, %address, bytes = len);
        let _entered = span.enter();
        State::check_device(kop, device)?;
        let s = self.read();
        s.check_range(kop, address.0, len, None)?;
        let n = to_usize(kop, "length", len)?;
        let base = pointer(kop, address.0)?.cast::<u8>();
        let mut sum = 0u64;
        for i in 0..n {
            // SAFETY: `[address, address + len)` is covered by live mappings of this backend
            // (checked above) and stays so while the read lock is held, so `base + i` is an
            // address of a mapping of this process. The access is *not* checked: a load or
            // store the protection forbids is stopped by the MMU (SIGSEGV), which is what the
            // probe exists to show; it never reaches memory outside the mapping.
            unsafe {
                let p = base.add(i);
                match op {
                    KernelProbeOp::Load => sum = sum.wrapping_add(u64::from(p.read_volatile())),
                    KernelProbeOp::Store => p.write_volatile(value),
                }
            }
        }
        tracing::debug!(result = "ok", sum);
        Ok(match op {
            KernelProbeOp::Load => sum,
            KernelProbeOp::Store => 0,
        })
    }
}
