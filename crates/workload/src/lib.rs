//! # kvvm-workload: replay a serving trace through KV-cache memory policies
//!
//! The library behind `kvvm simulate` (see `docs/simulate.md`).
//!
//! * [`Trace`]: requests (arrival, prompt tokens, output tokens, shared system-prompt tokens),
//!   synthetic and seeded ([`Trace::synthetic`], [`SyntheticTrace`]) or read from a JSONL
//!   file ([`Trace::parse_jsonl`]).
//! * [`PolicyKind`]: `static-max`, `realloc-copy`, `paged-16`, `paged-16+prefix` (vLLM's
//!   automatic prefix caching: the system prompt's whole 16-token blocks held once), and kvvm
//!   with each layout, with and without prefix sharing.
//! * [`simulate`]: an event-driven replay of the trace through every policy, one after the
//!   other, on the same trace and the same budget; [`SimulationReport`] holds the figures,
//!   [`render_table`] and [`render_svg`] present them, and [`verdict`] concludes: the best
//!   kvvm policy against the best of the others ([`render_verdict`]).
//!
//! ```
//! use std::sync::Arc;
//! use kvvm_sim::SimBackend;
//! use kvvm_workload::{render_table, simulate, SimulationConfig, SyntheticTrace, TableWidth, Trace};
//!
//! # fn main() -> Result<(), kvvm_workload::WorkloadError> {
//! let trace = Trace::synthetic(&SyntheticTrace { requests: 20, ..SyntheticTrace::default() })?;
//! let sim = Arc::new(SimBackend::h200());
//! let report = simulate(&trace, sim.clone(), &SimulationConfig::default(), &mut |_| {})?;
//! let waste = |name| report.policy(name).map_or(1.0, |p| p.waste_ratio);
//! assert!(waste("kvvm-token-major") < waste("kvvm-seq-major"));
//! assert!(waste("kvvm-seq-major") < waste("kvvm-head-major"));
//! assert!(sim.ledger().is_empty()); // every reservation and handle was given back
//! println!("{}", render_table(&report, TableWidth::Narrow));
//! # Ok(())
//! # }
//! ```
//!
//! ## The replay
//!
//! The clock jumps from event to event: to the next arrival when nothing runs, and by one
//! decode step (20 ms by default) while sequences run. At each step the engine admits
//! waiting requests first come first served (prefill: the whole prompt at once), then every
//! running sequence gains one token. A request whose admission or growth is refused (HTTP 429:
//! the governor or the budget said no) is *deferred*: it waits and retries at the next step,
//! as a serving engine would. Running sequences come first: while one of them is refused
//! growth, nothing new is admitted. If every running sequence is refused growth at once, the
//! youngest is preempted (its memory released, recomputed when readmitted). A request that
//! is refused when nothing else runs can never fit the budget and is rejected.
//!
//! ## kvvm policies run through the real manager
//!
//! A kvvm policy opens a [`VirtualMemory`](kvvm_vmm::VirtualMemory) on the backend with a
//! [`Governor`](kvvm_vmm::Governor) holding the budget (its clock follows the replay's time)
//! and runs every request as a [`SequenceKv`](kvvm_kv::SequenceKv) of the KV layer: reserved
//! at the maximum context under the layout ([`LayoutPlan`](kvvm_layout::LayoutPlan)), grown with
//! `ensure_tokens` whenever a token needs a new granule window (the windows holding live
//! bytes, one run per fragment, committed as one transaction through the governor:
//! `Reservation::commit_ranges`), and released when the request ends. Every driver call goes
//! through a [`CountingBackend`], which counts it and attributes the H200 latency model's cost
//! (or measures it on a GPU). On a real GPU the KV bytes of the tokens are written with
//! `SequenceKv::write_tokens`, batched at each commit and before release.
//!
//! With prefix sharing (`+prefix`), the first request that opens with the system prompt
//! becomes the owner of a [`SharedDevicePrefix`](kvvm_kv::SharedDevicePrefix)
//! (`reserve_unwritten`: the prompt's whole windows, read-write, billed once; written on a GPU,
//! then sealed), and every later one maps it read-only (`map_shared_prefix_readonly`) and
//! commits only the windows after it. The policy holds the prefix while a sharer runs and
//! drops it with the last one (the owner may finish first). When the layout cannot share the
//! prompt ([`evaluate_prefix_shareability`](kvvm_layout::evaluate_prefix_shareability): every
//! fragment's part of it is smaller than a granule), the refusal reason is reported and the
//! policy runs without sharing.

#![forbid(unsafe_code)]

mod classic_policy;
mod driver;
mod error;
mod kvvm_policy;
mod paged_policy;
mod plot;
mod policy;
mod replay;
mod replay_loop;
mod report;
mod table;
mod trace;
mod trace_line;
mod verdict;

pub use driver::{classic, CountingBackend, DriverTally};
pub use error::{WorkloadError, WorkloadResult};
pub use kvvm_num::SplitMix64;
pub use plot::render_svg;
pub use policy::{PolicyKind, PAGED_BLOCK_TOKENS};
pub use replay::{simulate, Progress, SimulationConfig, DEFAULT_BUDGET_BYTES};
pub use report::{PolicyReport, Sample, SimulationReport, TraceSummary};
pub use table::{render_table, render_verdict, TableWidth};
pub use trace::{Request, SyntheticTrace, Trace, TraceSource};
pub use verdict::{format_wait, verdict, Verdict, REPORT_COLUMNS};
