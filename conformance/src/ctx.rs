//! [`Ctx`]: what a case sees.

use kvvm_hal::{AllocationProperties, BackendError, DeviceId, KernelProbe, VirtualMemoryBackend};

use crate::child::{ChildRunner, ChildVerdict};
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

    /// Runs `body`, a case that provokes a kernel fault, where a fault cannot harm the rest of
    /// the run: in this process when the backend's faults are recoverable
    /// ([`KernelProbe::faults_are_recoverable`]), else as child case `child_case` in a child
    /// process (skipped without a child runner). Returns the body's verdict.
    pub(crate) fn run_faulting(
        &self,
        child_case: &str,
        body: fn(&Ctx<'_>) -> ChildVerdict,
    ) -> Result<ChildVerdict, Verdict> {
        let probe = self.require_kernels()?;
        if probe.faults_are_recoverable() {
            return Ok(body(self));
        }
        let runner = self.child.ok_or_else(|| {
            Verdict::Skip("no child-process runner (run it through `kvvm conformance`)".into())
        })?;
        runner
            .run(self.backend.name(), child_case, self.device)
            .map_err(|m| Verdict::Fail(format!("child process: {m}")))
    }
}

/// The outcome of a case whose body had to fault: `no_fault` is the failure message when the
/// operation completed instead.
pub(crate) fn expect_fault(verdict: ChildVerdict, no_fault: &str) -> Outcome {
    match verdict {
        ChildVerdict::Fault(_) => Ok(()),
        ChildVerdict::NoFault => Err(Verdict::Fail(no_fault.to_owned())),
        ChildVerdict::Error(m) => Err(Verdict::Fail(format!(
            "the faulting case could not run: {m}"
        ))),
    }
}
