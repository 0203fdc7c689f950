//! # kvvm-conformance: one suite, every backend
//!
//! The suite's cases are written once over `&dyn VirtualMemoryBackend`. They check the driver
//! semantics every backend must share (`kvvm-hal`'s crate docs list them), granularity sanity,
//! data written through one mapping reading back through an alias of the same handle, `Read`
//! aliases refusing writes (and, on backends with kernels, faulting kernel stores), deferred
//! free on release-while-mapped, `OutOfMemory` when the device is full with the device usable
//! afterwards, a 64 TiB reservation with no physical use, and thousands of cycles leaking
//! nothing.
//!
//! A case needing a capability the backend lacks is reported `skip` with the reason, never
//! `pass`. [`run_suite`] runs every case and returns a [`Report`] (a text table or the JSON the
//! CLI prints); [`unavailable_report`] reports every case skipped when the backend cannot be
//! opened.
//!
//! ```
//! use kvvm_conformance::{run_suite, RunOptions};
//! use kvvm_sim::{SimBackend, SimConfig};
//!
//! let sim = SimBackend::new(SimConfig::single(64 << 10, 256 << 20));
//! let report = run_suite(&sim, &RunOptions::default());
//! assert_eq!(report.failed, 0);
//! assert!(report.passed >= 30);
//! ```

mod cases;
mod child;
mod report;
mod scratch;

pub use cases::{all_cases, Case, Outcome, Verdict};
pub use child::{
    report_child_error, requested_child, run_child, ChildRunner, ChildVerdict, CHILD_BACKEND_ENV,
    CHILD_ENV, CHILD_KERNEL_STORE,
};
pub use report::{CaseResult, Report, Status};

use std::time::Instant;

use kvvm_hal::{AllocationProperties, BackendError, DeviceId, KernelProbe, VirtualMemoryBackend};

use scratch::Scratch;

/// What a case sees: the backend, the device under test and its minimum granularity.
pub struct Ctx<'a> {
    backend: &'a dyn VirtualMemoryBackend,
    device: DeviceId,
    granule: u64,
    child: Option<&'a ChildRunner>,
}

impl<'a> Ctx<'a> {
    fn new(
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

    fn scratch(&self) -> Scratch<'a> {
        Scratch::new(self.backend, self.device)
    }

    fn require_posix_fd(&self) -> Outcome {
        if self.backend.capabilities().posix_fd_handles {
            Ok(())
        } else {
            Err(Verdict::Skip(format!(
                "backend {} cannot export POSIX fd handles",
                self.backend.name()
            )))
        }
    }

    fn require_kernels(&self) -> Result<&'a dyn KernelProbe, Verdict> {
        match self.backend.kernel_probe() {
            Some(p) if self.backend.capabilities().kernels => Ok(p),
            _ => Err(Verdict::Skip(format!(
                "backend {} cannot launch kernels",
                self.backend.name()
            ))),
        }
    }
}

/// Options of a run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// The device to test (default device 0).
    pub device: DeviceId,
    /// Run only the cases whose name contains one of these strings (empty: all).
    pub filter: Vec<String>,
    /// How to start child processes; without one, child-process cases are skipped.
    pub child: Option<ChildRunner>,
}

/// Runs the suite against `backend`.
pub fn run_suite(backend: &dyn VirtualMemoryBackend, options: &RunOptions) -> Report {
    let device_name = backend
        .devices()
        .ok()
        .and_then(|d| d.into_iter().find(|d| d.id == options.device))
        .map(|d| d.name)
        .unwrap_or_else(|| "none".to_owned());
    let selected: Vec<Case> = all_cases()
        .into_iter()
        .filter(|c| options.filter.is_empty() || options.filter.iter().any(|f| c.name.contains(f)))
        .collect();
    let ctx = match Ctx::new(backend, options.device, options.child.as_ref()) {
        Ok(ctx) => ctx,
        Err(e) => {
            let reason = format!("cannot query granularity: {e}");
            let cases = selected
                .iter()
                .map(|c| CaseResult {
                    name: c.name.to_owned(),
                    status: Status::Fail,
                    reason: Some(reason.clone()),
                    micros: 0,
                })
                .collect();
            return Report::new(backend.name(), device_name, cases);
        }
    };
    let cases = selected
        .iter()
        .map(|case| {
            let start = Instant::now();
            let outcome = (case.run)(&ctx);
            let micros = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
            let (status, reason) = match outcome {
                Ok(()) => (Status::Pass, None),
                Err(Verdict::Fail(m)) => (Status::Fail, Some(m)),
                Err(Verdict::Skip(m)) => (Status::Skip, Some(m)),
            };
            CaseResult {
                name: case.name.to_owned(),
                status,
                reason,
                micros,
            }
        })
        .collect();
    Report::new(backend.name(), device_name, cases)
}

/// The report of a backend that could not be opened: every case `skip`, with `reason`.
pub fn unavailable_report(backend: &str, reason: &str) -> Report {
    let cases = all_cases()
        .iter()
        .map(|c| CaseResult {
            name: c.name.to_owned(),
            status: Status::Skip,
            reason: Some(reason.to_owned()),
            micros: 0,
        })
        .collect();
    Report::new(backend, "none", cases)
}
