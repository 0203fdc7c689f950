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

mod case;
mod cases;
mod child;
mod ctx;
mod report;
mod scratch;
mod suite;
mod verdict;

pub use case::Case;
pub use cases::all_cases;
pub use child::{
    report_child_error, requested_child, ChildRequest, ChildRunner, ChildVerdict,
    CHILD_BACKEND_ENV, CHILD_DEVICE_ENV, CHILD_ENV, CHILD_KERNEL_STORE, CHILD_PEER_STORE,
};
pub use ctx::Ctx;
pub use report::{CaseResult, Report, Status};
pub use suite::{run_child, run_suite, run_suite_with_progress, unavailable_report, RunOptions};
pub use verdict::{Outcome, Verdict};
