//! # kvvm-workload: replay a serving trace through KV-cache memory policies
//!
//! The library behind `kvvm simulate` (see `docs/simulate.md`).
//!
//! * [`Trace`]: requests (arrival, prompt tokens, output tokens, shared system-prompt tokens),
//!   synthetic and seeded ([`Trace::synthetic`], [`SyntheticTrace`]) or read from a JSONL
//!   file ([`Trace::parse_jsonl`]).
//! * [`PolicyKind`]: `static-max`, `realloc-copy`, `paged-16`, and kvvm with each layout,
//!   with and without prefix sharing.
//! * [`simulate`]: an event-driven replay of the trace through every policy, one after the
//!   other, on the same trace and the same budget; [`SimulationReport`] holds the figures,
//!   [`render_table`] and [`render_svg`] present them.
//!
//! ## The replay
//!
//! The clock jumps from event to event: to the next arrival when nothing runs, and by one
//! decode step (20 ms by default) while sequences run. At each step the engine admits
//! waiting requests first come first served (prefill: the whole prompt at once), then every
//! running sequence gains one token. A request whose admission or growth is refused (HTTP 429:
//! the governor or the budget said no) is *deferred*: it waits and retries at the next step,
//! as a serving engine would. If every running sequence is refused growth at once, the
//! youngest is preempted (its memory released, recomputed when readmitted). A request refused
//! when nothing else runs can never fit and is rejected.
//!
//! ## kvvm policies run through the real manager
//!
//! A kvvm policy opens a [`VirtualMemory`](kvvm_vmm::VirtualMemory) on the backend with a
//! [`Governor`](kvvm_vmm::Governor) holding the budget (its clock follows the replay's time),
//! reserves the maximum context for each request under the layout
//! ([`LayoutPlan`](kvvm_kv::LayoutPlan)), commits the granule windows that hold live bytes
//! as tokens arrive, and releases everything when the request ends. Every driver call goes
//! through a [`CountingBackend`], which counts it and attributes the H200 latency model's
//! cost (or measures it on a GPU).
//!
//! Two emulations, because the manager's API does not offer them yet:
//!
//! * **Sparse commits.** [`Reservation::commit`](kvvm_vmm::Reservation::commit) maps after the
//!   committed end only, while a layout's live windows are one run per fragment. Each
//!   fragment therefore gets its own reservation; the create, map, set-access and unmap calls
//!   are exactly those of a sparse commit into one reservation, and the extra reserve/free
//!   calls are left out of `driver_calls` (reported as `emulation_calls_excluded`).
//! * **Prefix sharing.** The shared-prefix API (`SharedDevicePrefix`,
//!   `map_shared_prefix_readonly`, issue 6) has not landed. A `+prefix` policy commits the
//!   system prompt's whole windows ([`evaluate_prefix_shareability`](kvvm_kv::evaluate_prefix_shareability))
//!   once through the manager, holds them while a sharer runs, and commits only each
//!   sharer's windows after the shared ones; the sharers' read-only mappings are counted and
//!   timed from the latency model (`modelled_shared_map_calls`), not executed.

mod driver;
mod error;
mod policy;
mod render;
mod replay;
mod rng;
mod trace;

pub use driver::{classic, CountingBackend, DriverTally};
pub use error::{WorkloadError, WorkloadResult};
pub use policy::{PolicyKind, PAGED_BLOCK_TOKENS};
pub use render::{render_svg, render_table};
pub use replay::{
    simulate, PolicyReport, Progress, Sample, SimulationConfig, SimulationReport, TraceSummary,
    DEFAULT_BUDGET_BYTES,
};
pub use rng::SplitMix64;
pub use trace::{Request, SyntheticTrace, Trace, TraceSource};
