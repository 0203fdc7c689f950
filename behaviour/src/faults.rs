//! The fault harness: run a scenario once with no fault to count its driver steps, then once
//! per step with that step failing, then once per ordered pair of steps (the first fault at
//! step `i`, the second at any later step of that run), checking the invariants after each run
//! and the leak check after its teardown.

use std::sync::Arc;

use kvvm_hal::{DeviceId, VirtualMemoryBackend};

use crate::check::{books, clean};
use crate::scenarios::{manager_scenarios, Scenario};
use crate::tier::tier_scenarios;
use crate::tier_prefix::tier_prefix_scenarios;
use crate::world::{State, World};

/// Every fault scenario, in report order: the manager's and the KV layer's
/// (`scenarios.rs`), then the host tier's (`tier.rs`), then the prefix cache's host level's
/// (`tier_prefix.rs`).
pub fn all_scenarios() -> Vec<Scenario> {
    [
        manager_scenarios(),
        tier_scenarios(),
        tier_prefix_scenarios(),
    ]
    .concat()
}

/// How many faults each run injects at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultDepth {
    /// No fault: the operation must succeed.
    None,
    /// Every step failing alone.
    Single,
    /// Every step alone and every ordered pair of steps.
    Pairs,
}

impl FaultDepth {
    /// Parses `none`, `single` or `pairs`.
    pub fn parse(s: &str) -> Option<FaultDepth> {
        match s {
            "none" => Some(FaultDepth::None),
            "single" => Some(FaultDepth::Single),
            "pairs" => Some(FaultDepth::Pairs),
            _ => None,
        }
    }
}

/// What a scenario's fault runs came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct FaultStats {
    /// Driver steps of the operation with no fault.
    pub steps: u64,
    /// Runs made (each with its own fresh manager).
    pub runs: u64,
    /// Faults that fired.
    pub faults_fired: u64,
    /// Bytes the injected faults left in quarantine, given back after each run.
    pub quarantined_bytes: u64,
}

/// One run with the faults at counted steps `at`: returns the steps counted.
fn run_once(
    base: &Arc<dyn VirtualMemoryBackend>,
    device: DeviceId,
    sc: &Scenario,
    at: &[u64],
    stats: &mut FaultStats,
) -> Result<u64, String> {
    let w = World::new(base, device, sc.spec)?;
    let mut state = State::default();
    (sc.setup)(&w, &mut state).map_err(|e| format!("setup: {e}"))?;
    books(&w, &state).map_err(|e| format!("after setup: {e}"))?;
    w.faults.arm(&sc.spec.counted_ops(), at);
    let result = (sc.op)(&w, &mut state);
    let counted = w.faults.counted();
    let fired = w.faults.disarm();
    stats.runs = stats.runs.saturating_add(1);
    stats.faults_fired = stats.faults_fired.saturating_add(fired.len() as u64);
    let context = || {
        let f: Vec<String> = fired
            .iter()
            .map(|f| format!("{} at step {}", f.op.as_str(), f.call))
            .collect();
        format!("faults [{}]", f.join(", "))
    };
    if at.is_empty() {
        result.map_err(|e| format!("with no fault the operation failed: {e}"))?;
    }
    books(&w, &state).map_err(|e| format!("{}: {e}", context()))?;
    drop(state);
    let q = clean(w).map_err(|e| format!("{}: teardown: {e}", context()))?;
    stats.quarantined_bytes = stats.quarantined_bytes.saturating_add(q);
    Ok(counted)
}

/// Runs `sc` at `depth` (see the module docs). The first violated invariant is the error.
pub fn exhaust(
    base: &Arc<dyn VirtualMemoryBackend>,
    device: DeviceId,
    sc: &Scenario,
    depth: FaultDepth,
) -> Result<FaultStats, String> {
    let mut stats = FaultStats::default();
    let steps = run_once(base, device, sc, &[], &mut stats)?;
    stats.steps = steps;
    if depth == FaultDepth::None {
        return Ok(stats);
    }
    for i in 1..=steps {
        let steps_i = run_once(base, device, sc, &[i], &mut stats)?;
        if depth == FaultDepth::Pairs {
            for j in i.saturating_add(1)..=steps_i {
                run_once(base, device, sc, &[i, j], &mut stats)?;
            }
        }
    }
    Ok(stats)
}
