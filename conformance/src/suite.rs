//! Running the suite: [`run_suite`], [`unavailable_report`], and [`run_child`] (the child-process
//! side of the cases that need one).

use std::io::Write as _;
use std::time::Instant;

use kvvm_hal::{DeviceId, VirtualMemoryBackend};

use crate::case::{Case, Verdict};
use crate::cases::{all_cases, kernels, peers};
use crate::child::{ChildRunner, ChildVerdict, CHILD_KERNEL_STORE, CHILD_PEER_STORE};
use crate::ctx::Ctx;
use crate::report::{CaseResult, Report, Status};

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
    run_suite_with_progress(backend, options, &mut |_, _, _| {})
}

/// Like [`run_suite`], calling `progress(done, total, next case)` before each case and
/// `progress(total, total, "")` at the end.
pub fn run_suite_with_progress(
    backend: &dyn VirtualMemoryBackend,
    options: &RunOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Report {
    let device_name = backend
        .device_name(options.device)
        .unwrap_or_else(|| "none".to_owned());
    let selected: Vec<Case> = all_cases()
        .into_iter()
        .filter(|c| options.filter.is_empty() || options.filter.iter().any(|f| c.name.contains(f)))
        .collect();
    let ctx = match Ctx::new(backend, options.device, options.child.as_ref()) {
        Ok(ctx) => ctx,
        Err(e) => {
            let reason = format!("cannot query granularity: {e}");
            let cases = not_run(&selected, Status::Fail, &reason);
            return Report::new(backend.name(), device_name, cases);
        }
    };
    let total = selected.len();
    let cases = selected
        .iter()
        .enumerate()
        .map(|(i, case)| {
            progress(i, total, case.name);
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
    progress(total, total, "");
    Report::new(backend.name(), device_name, cases)
}

/// The report of a backend that could not be opened: every case `skip`, with `reason`.
pub fn unavailable_report(backend: &str, reason: &str) -> Report {
    Report::new(backend, "none", not_run(&all_cases(), Status::Skip, reason))
}

/// The results of `cases` none of which could run: each `status`, with `reason`.
fn not_run(cases: &[Case], status: Status, reason: &str) -> Vec<CaseResult> {
    cases
        .iter()
        .map(|c| CaseResult {
            name: c.name.to_owned(),
            status,
            reason: Some(reason.to_owned()),
            micros: 0,
        })
        .collect()
}

/// Runs child case `case` on device `device` of `backend` (`None`: the request named no
/// valid device), prints the verdict line, returns the exit code.
pub fn run_child(backend: &dyn VirtualMemoryBackend, case: &str, device: Option<DeviceId>) -> i32 {
    let body: Option<fn(&Ctx<'_>) -> ChildVerdict> = match case {
        CHILD_KERNEL_STORE => Some(kernels::kernel_store_child),
        CHILD_PEER_STORE => Some(peers::peer_store_child),
        _ => None,
    };
    let verdict = match (body, device) {
        (None, _) => ChildVerdict::Error(format!("unknown child case {case:?}")),
        (Some(_), None) => ChildVerdict::Error("the device ordinal is not a number".into()),
        (Some(body), Some(device)) => match Ctx::new(backend, device, None) {
            Ok(ctx) => body(&ctx),
            Err(e) => ChildVerdict::Error(e.to_string()),
        },
    };
    // The parent reads this line; if it has gone, there is no one left to tell.
    let _ = writeln!(std::io::stdout(), "{}", verdict.to_line());
    match verdict {
        ChildVerdict::Error(_) => 2,
        _ => 0,
    }
}
