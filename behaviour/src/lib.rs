//! # kvvm-behaviour: the manager's behaviour suite, on every backend
//!
//! The manager's and the KV layer's promises, written once over `dyn VirtualMemoryBackend`
//! (as the conformance suite is for the drivers' semantics) and run against any backend: the
//! simulator and the host backend in CI, CUDA and HIP on a GPU machine (`kvvm behaviour`).
//!
//! Every case runs in its own manager over a stack of two decorators
//! ([`kvvm_hal::decorate`]): a [`FaultInjecting`](kvvm_hal::decorate::FaultInjecting) backend
//! that fails chosen driver calls, under a [`Recording`](kvvm_hal::decorate::Recording) one
//! that keeps the books of every range, handle and mapping, so the invariants of the design
//! are checked against what really reached the driver, on any backend:
//!
//! 1. committed bytes = granule x mapped windows, and the driver maps exactly the manager's
//!    blocks, parked windows and quarantined mappings;
//! 2. the governor's used bytes = the live physical bytes; nothing pending; no accounting
//!    error;
//! 3. no driver rule broken (no second release or free, no map over a mapping, no free under
//!    a mapping); after teardown the driver holds exactly what the quarantine lists, and once
//!    that is given back nothing is left (no leak);
//! 4. a sequence's committed tokens lie in mapped windows.
//!
//! Two kinds of cases:
//!
//! * **behaviour cases** (`cases.rs`): growth in place, pool and parking reuse, typed
//!   backpressure and never-fits, shared windows billed once and read-only, strided slots,
//!   sequence round trips, prefix-cache hits, and the pre-committer against concurrent
//!   reclaim and release (every `Ready` checked against the driver's books);
//! * **fault scenarios** (`scenarios.rs`), one per multi-step operation (commit, commit of
//!   ranges, release, truncate, KV growth, shrink and release, the pre-committer's job steps,
//!   shared commit, attach and withdraw, teardown, unpark, pool trim, prefix publish, hit and
//!   evict), and the host tier's steps (`tier.rs`: swap out, swap in, both with a mapped
//!   prefix, trim, a host budget spent; `tier_prefix.rs`: the prefix cache's host level, a
//!   prefix evicted to the host, hit there, both), run by `faults.rs` with no fault, then every driver
//!   step failing alone, then every ordered pair of steps failing ([`FaultDepth`]); the
//!   tier's scenarios fail its calls too (pinned memory, copies, events), check the host's
//!   books beside the device's, and that no swap loses a byte.
//!
//! ```
//! use std::sync::Arc;
//! use kvvm_behaviour::{run_behaviour, BehaviourOptions, FaultDepth};
//! use kvvm_sim::{SimBackend, SimConfig};
//!
//! let sim: Arc<dyn kvvm_hal::VirtualMemoryBackend> =
//!     Arc::new(SimBackend::new(SimConfig::single(64 << 10, 64 << 20)));
//! let options = BehaviourOptions { depth: FaultDepth::Single, ..BehaviourOptions::default() };
//! let report = run_behaviour(&sim, &options);
//! assert_eq!(report.report.failed, 0, "{}", report.to_table());
//! assert!(report.faults_fired > 0);
//! ```

#![forbid(unsafe_code)]

mod cases;
mod check;
mod faults;
mod scenarios;
mod suite;
mod tier;
mod tier_prefix;
mod world;

pub use check::{books, clean};
pub use faults::{all_scenarios, exhaust, FaultDepth, FaultStats};
pub use scenarios::{Scenario, Step};
pub use suite::{run_behaviour, BehaviourOptions, BehaviourReport, FaultCase};
pub use world::{State, World, WorldSpec};
