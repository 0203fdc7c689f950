//! Running the suite: every behaviour case, then every fault scenario at the chosen depth,
//! each in its own fresh manager over the backend under test; a [`BehaviourReport`].

use std::sync::Arc;
use std::time::Instant;

use kvvm_conformance::{CaseResult, Report, Status};
use kvvm_hal::{DeviceId, VirtualMemoryBackend};

use crate::cases;
use crate::check::clean;
use crate::faults::{all_scenarios, exhaust, FaultDepth, FaultStats};
use crate::world::{State, World, WorldSpec};

/// Options of a run.
#[derive(Debug, Clone)]
pub struct BehaviourOptions {
    /// The device to test.
    pub device: DeviceId,
    /// Run only cases whose name contains one of these (empty: all).
    pub filter: Vec<String>,
    /// How many faults each fault run injects at most.
    pub depth: FaultDepth,
}

impl Default for BehaviourOptions {
    fn default() -> Self {
        BehaviourOptions {
            device: DeviceId(0),
            filter: Vec::new(),
            depth: FaultDepth::Pairs,
        }
    }
}

/// A case with no injected fault.
struct Case {
    name: &'static str,
    spec: WorldSpec,
    run: fn(&World, &mut State) -> Result<(), String>,
}

fn plain_cases() -> Vec<Case> {
    let d = WorldSpec::default();
    let pooled = WorldSpec {
        pool_granules: 8,
        ..d
    };
    vec![
        Case {
            name: "grows_in_place",
            spec: d,
            run: cases::grows_in_place,
        },
        Case {
            name: "pool_reuse_makes_no_create",
            spec: pooled,
            run: cases::pool_reuse_makes_no_create,
        },
        Case {
            name: "parked_reuse_makes_no_driver_call",
            spec: WorldSpec {
                park: true,
                ..pooled
            },
            run: cases::parked_reuse_makes_no_driver_call,
        },
        Case {
            name: "backpressure_and_never_fits_are_typed",
            spec: WorldSpec {
                budget_granules: Some(8),
                ..d
            },
            run: cases::backpressure_and_never_fits_are_typed,
        },
        Case {
            name: "shared_windows_are_billed_once_and_read_only",
            spec: d,
            run: cases::shared_windows_are_billed_once_and_read_only,
        },
        Case {
            name: "strided_slots_commit_independently",
            spec: d,
            run: cases::strided_slots_commit_independently,
        },
        Case {
            name: "sequence_round_trip",
            spec: d,
            run: cases::sequence_round_trip,
        },
        Case {
            name: "prefix_cache_hit_shares_memory",
            spec: d,
            run: cases::prefix_cache_hit_shares_memory,
        },
        Case {
            name: "precommit_ready_is_always_mapped",
            spec: WorldSpec {
                budget_granules: Some(16),
                pool_granules: 4,
                park: false,
                max_handle_granules: 0,
                ..WorldSpec::default()
            },
            run: cases::precommit_ready_is_always_mapped,
        },
        Case {
            name: "precommit_grows_in_handles_within_its_bound",
            spec: WorldSpec {
                budget_granules: None,
                pool_granules: 0,
                park: false,
                max_handle_granules: 16,
                ..WorldSpec::default()
            },
            run: cases::precommit_grows_in_handles_within_its_bound,
        },
    ]
}

/// One fault scenario's figures in a report.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FaultCase {
    /// The case's name (`fault_<scenario>`).
    pub name: String,
    /// Its figures (zero when it failed before finishing).
    #[serde(flatten)]
    pub stats: FaultStats,
}

/// A behaviour run: the cases (in the conformance report's shape), the fault figures, and
/// the driver's free memory before and after.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BehaviourReport {
    /// Cases passed, failed and skipped, and each case.
    #[serde(flatten)]
    pub report: Report,
    /// Faults each fault run injected at most.
    pub depth: FaultDepth,
    /// Every fault scenario's figures.
    pub faults: Vec<FaultCase>,
    /// Fault runs in all.
    pub fault_runs: u64,
    /// Faults fired in all.
    pub faults_fired: u64,
    /// The driver's free bytes on the device before the run (`null`: not reported).
    pub driver_free_before: Option<u64>,
    /// ... and after it.
    pub driver_free_after: Option<u64>,
}

impl BehaviourReport {
    /// One line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self)
            .unwrap_or_else(|e| format!("{{\"error\": \"cannot serialize report: {e}\"}}"))
    }

    /// The case table and a summary of the fault runs.
    pub fn to_table(&self) -> String {
        let mut out = self.report.to_table();
        out.push_str(&format!(
            "fault injection ({:?}): {} runs over {} scenarios, {} faults fired\n",
            self.depth,
            self.fault_runs,
            self.faults.len(),
            self.faults_fired
        ));
        if let (Some(b), Some(a)) = (self.driver_free_before, self.driver_free_after) {
            out.push_str(&format!(
                "driver free memory: {b} bytes before, {a} after ({:+} bytes)\n",
                a as i128 - b as i128
            ));
        }
        out
    }
}

fn result(name: String, started: Instant, outcome: Result<(), String>) -> CaseResult {
    let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    let (status, reason) = match outcome {
        Ok(()) => (Status::Pass, None),
        Err(m) => (Status::Fail, Some(m)),
    };
    CaseResult {
        name,
        status,
        reason,
        micros,
    }
}

/// Runs the suite against `backend` (see the crate docs).
pub fn run_behaviour(
    backend: &Arc<dyn VirtualMemoryBackend>,
    options: &BehaviourOptions,
) -> BehaviourReport {
    let wanted = |name: &str| {
        options.filter.is_empty() || options.filter.iter().any(|f| name.contains(f.as_str()))
    };
    let device_name = backend
        .device_name(options.device)
        .unwrap_or_else(|| "none".to_owned());
    let free = || backend.memory_info(options.device).ok().map(|m| m.free);
    let driver_free_before = free();
    let mut results = Vec::new();
    for case in plain_cases().into_iter().filter(|c| wanted(c.name)) {
        let started = Instant::now();
        let outcome = World::new(backend, options.device, case.spec).and_then(|w| {
            let mut state = State::default();
            let r = (case.run)(&w, &mut state);
            drop(state);
            let cleaned = clean(w);
            r.and(cleaned.map(|_| ()))
        });
        results.push(result(case.name.to_owned(), started, outcome));
    }
    let mut faults = Vec::new();
    for sc in all_scenarios() {
        let name = format!("fault_{}", sc.name);
        if !wanted(&name) {
            continue;
        }
        let started = Instant::now();
        let outcome = exhaust(backend, options.device, &sc, options.depth);
        let stats = outcome.as_ref().copied().unwrap_or_default();
        faults.push(FaultCase {
            name: name.clone(),
            stats,
        });
        results.push(result(name, started, outcome.map(|_| ())));
    }
    let report = Report::new(backend.name(), device_name, results);
    BehaviourReport {
        report,
        depth: options.depth,
        fault_runs: faults.iter().map(|f| f.stats.runs).sum(),
        faults_fired: faults.iter().map(|f| f.stats.faults_fired).sum(),
        faults,
        driver_free_before,
        driver_free_after: free(),
    }
}
