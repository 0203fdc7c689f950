//! [`Ctx`]: what a case sees.

use kvvm_hal::{AllocationProperties, BackendError, DeviceId, KernelProbe, VirtualMemoryBackend};

use crate::child::ChildRunner;
use crate::scratch::Scratch;
use crate::verdict::{Outcome, Verdict};

/// What a case sees: the backend, the device under test and its minimum granularity.
pub struct Ctx<'a> {
    pub(crate) backend: &'a dyn VirtualMemoryBackend,
    pub(crate) device: DeviceId,
    pub(crate) granule: u64,
    pub(crate) child: Option<&'a ChildRunner>,
}

impl<'a> Ctx<'a> {
    pub(crate) fn new(
        backend: &'a dyn VirtualMemoryBackend,
        device: DeviceId,
        child: Option<&'a ChildRunner>,
    ) -> Result<Self, BackendError> {
        let granule = backend
            .granularity(&AllocationProperties::device(device))?
            .minimum;
        Ok(Ctx {
            backend,
            device,
            granule,
            child,
        })
    }

    pub(crate) fn scratch(&self) -> Scratch<'a> {
        Scratch::new(self.backend, self.device)
    }

    pub(crate) fn require_posix_fd(&self) -> Outcome {
        if self.backend.capabilities().posix_fd_handles {
            Ok(())
        } else {
            Err(Verdict::Skip(format!(
                "backend {} cannot export POSIX fd handles",
                self.backend.name()
            )))
        }
    }

    pub(crate) fn require_kernels(&self) -> Result<&'a dyn KernelProbe, Verdict> {
        match self.backend.kernel_probe() {
            Some(p) if self.backend.capabilities().kernels => Ok(p),
            _ => Err(Verdict::Skip(format!(
                "backend {} cannot launch kernels",
                self.backend.name()
            ))),
        }
    }
}
