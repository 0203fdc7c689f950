//! The event-driven replay of a trace through every policy, and its report.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvvm_hal::{AllocationProperties, DeviceId, VirtualMemoryBackend};
use kvvm_layout::{KvDtype, KvGeometry, PrefixShareability};

use crate::classic_policy::ClassicPolicy;
use crate::error::{WorkloadError, WorkloadResult};
use crate::kvvm_policy::KvvmPolicy;
use crate::paged_policy::PagedPolicy;
use crate::policy::{Costs, Policy, PolicyKind, Shape, PAGED_BLOCK_TOKENS};
use crate::replay_loop::{replay_one, Tally};
use crate::report::{PolicyReport, SimulationReport, TraceSummary};
use crate::trace::{Trace, TraceSource};

/// Default memory budget: 8 GiB, a budget under which the policies serve differently. On the
/// default trace `static-max` (4 GiB a request at the default 32768-token context) runs two
/// requests at a time, `realloc-copy` and the head- and seq-major layouts make requests wait,
/// while token-major and the paged policies serve every request at once; with the ample
/// 40 GiB every policy but `static-max` serves the same and only memory tells them apart.
pub const DEFAULT_BUDGET_BYTES: u64 = 8 << 30;

/// How a replay runs.
#[derive(Debug, Clone)]
pub struct SimulationConfig {
    /// Model preset ([`KvGeometry::preset`]).
    pub model: String,
    /// Element type of the KV cache.
    pub dtype: KvDtype,
    /// Maximum context in tokens: what `static-max` preallocates and kvvm reserves.
    pub max_context: u64,
    /// The memory budget every policy runs under, in bytes.
    pub budget_bytes: u64,
    /// Duration of one decode step (every running sequence gains one token per step).
    pub step: Duration,
    /// The policies, in report order.
    pub policies: Vec<PolicyKind>,
    /// The device to use.
    pub device: DeviceId,
    /// Write real KV bytes (`copy_to_device`) for the tokens of kvvm policies. `None`: only
    /// on backends other than the simulator.
    pub write_kv: Option<bool>,
}

impl Default for SimulationConfig {
    /// llama-3-8b fp16, 32768-token context, 8 GiB, 20 ms decode steps, every policy.
    fn default() -> Self {
        SimulationConfig {
            model: "llama-3-8b".into(),
            dtype: KvDtype::F16,
            max_context: 32_768,
            budget_bytes: DEFAULT_BUDGET_BYTES,
            step: Duration::from_millis(20),
            policies: PolicyKind::all(),
            device: DeviceId(0),
            write_kv: None,
        }
    }
}

/// Progress of a replay, for a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Policies done.
    pub policies_done: usize,
    /// Policies in total.
    pub policies: usize,
    /// Requests completed (or rejected) by the policy running now.
    pub requests_done: usize,
    /// Requests in the trace.
    pub requests: usize,
}

/// Replays `trace` through every policy of `config`, the kvvm ones through the manager on
/// `backend`. `progress` is called as requests complete.
pub fn simulate(
    trace: &Trace,
    backend: Arc<dyn VirtualMemoryBackend>,
    config: &SimulationConfig,
    progress: &mut dyn FnMut(Progress),
) -> WorkloadResult<SimulationReport> {
    let wall = Instant::now();
    let shape = shape_of(trace, config)?;
    let write_kv = config.write_kv.unwrap_or(backend.name() != "sim");
    let granule = manager_granule(&*backend, config.device)?;
    let n_policies = config.policies.len();
    let requests = trace.requests.len();
    let mut reports = Vec::with_capacity(n_policies);
    for (pi, kind) in config.policies.iter().enumerate() {
        let policy = open_policy(*kind, &backend, config, trace, shape, write_kv)?;
        let mut policy_progress = |done| {
            progress(Progress {
                policies_done: pi,
                policies: n_policies,
                requests_done: done,
                requests,
            })
        };
        let report = replay_policy(
            *kind,
            policy,
            trace,
            shape,
            config.step,
            &mut policy_progress,
        )?;
        reports.push(report);
    }
    progress(Progress {
        policies_done: n_policies,
        policies: n_policies,
        requests_done: requests,
        requests,
    });
    Ok(SimulationReport {
        backend: backend.name().to_owned(),
        model: config.model.clone(),
        dtype: config.dtype.to_string(),
        bytes_per_token: shape.bytes_per_token,
        max_context: config.max_context,
        granule_bytes: granule,
        budget_bytes: config.budget_bytes,
        step_ms: config.step.as_secs_f64() * 1e3,
        trace: summary(trace),
        policies: reports,
        elapsed_s: wall.elapsed().as_secs_f64(),
    })
}

/// The shape every policy runs at, once the trace and the budget are checked.
fn shape_of(trace: &Trace, config: &SimulationConfig) -> WorkloadResult<Shape> {
    if trace.requests.is_empty() {
        return Err(WorkloadError::EmptyTrace);
    }
    if config.budget_bytes == 0 {
        return Err(WorkloadError::Config("the budget must be positive".into()));
    }
    let geometry = KvGeometry::preset(&config.model, config.dtype, config.max_context)?;
    trace.check_fits(config.max_context)?;
    Ok(Shape {
        geometry,
        bytes_per_token: geometry.bytes_per_token(),
        max_context: config.max_context,
        budget: config.budget_bytes,
    })
}

/// The granule the manager will use on `backend` (the recommended one when it is a multiple
/// of the minimum, as `VmmConfig::default()` chooses).
fn manager_granule(backend: &dyn VirtualMemoryBackend, device: DeviceId) -> WorkloadResult<u64> {
    let g = backend.granularity(&AllocationProperties::device(device))?;
    Ok(
        if g.recommended != 0 && g.minimum != 0 && g.recommended % g.minimum == 0 {
            g.recommended
        } else {
            g.minimum
        },
    )
}

/// The policy of `kind`, the kvvm ones through a manager on `backend`.
fn open_policy(
    kind: PolicyKind,
    backend: &Arc<dyn VirtualMemoryBackend>,
    config: &SimulationConfig,
    trace: &Trace,
    shape: Shape,
    write_kv: bool,
) -> WorkloadResult<Box<dyn Policy>> {
    Ok(match kind {
        PolicyKind::Kvvm {
            layout,
            prefix_sharing,
        } => Box::new(KvvmPolicy::new(
            backend.clone(),
            config.device,
            layout,
            prefix_sharing,
            trace.system_prompt_tokens,
            shape,
            write_kv,
        )?),
        PolicyKind::Paged16 => Box::new(PagedPolicy::new(shape, false, 0)),
        PolicyKind::Paged16Prefix => {
            Box::new(PagedPolicy::new(shape, true, trace.system_prompt_tokens))
        }
        other => Box::new(ClassicPolicy::new(other, shape)),
    })
}

/// Replays `trace` through `policy`, closes it, and reports what it did.
fn replay_policy(
    kind: PolicyKind,
    mut policy: Box<dyn Policy>,
    trace: &Trace,
    shape: Shape,
    step: Duration,
    progress: &mut dyn FnMut(usize),
) -> WorkloadResult<PolicyReport> {
    progress(0);
    let tally = replay_one(trace, policy.as_mut(), step, progress)?;
    let costs = policy.close()?;
    drop(policy);
    Ok(report_of(kind, &tally, costs, trace, shape.bytes_per_token))
}

fn summary(trace: &Trace) -> TraceSummary {
    let (kind, path, seed, rate) = match &trace.source {
        TraceSource::Synthetic(s) => ("synthetic", None, Some(s.seed), Some(s.rate_per_s)),
        TraceSource::Jsonl { path } => ("jsonl", Some(path.clone()), None, None),
    };
    TraceSummary {
        kind,
        path,
        seed,
        rate_per_s: rate,
        requests: trace.requests.len(),
        prompt_tokens: trace.prompt_tokens(),
        output_tokens: trace.output_tokens(),
        system_prompt_tokens: trace.system_prompt_tokens,
        shared_prefix_requests: trace.shared_prefix_requests(),
        duration_s: trace.duration_s(),
    }
}

/// The `q`-quantile (0..=1) of `values` by nearest rank, in milliseconds (0 when empty).
fn quantile_ms(values: &[u64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_unstable();
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    let rank = (q * n as f64).ceil().clamp(1.0, n as f64) as usize;
    v.get(rank - 1).map_or(0.0, |us| *us as f64 / 1e3)
}

fn report_of(
    kind: PolicyKind,
    tally: &Tally,
    costs: Costs,
    trace: &Trace,
    bytes_per_token: u64,
) -> PolicyReport {
    let start = trace.requests.first().map_or(0, |r| r.arrival_us);
    let span = u128::from(tally.last_t.saturating_sub(start)).max(1);
    let mean = |integral: u128| u64::try_from(integral / span).unwrap_or(u64::MAX);
    let admitted = tally.admitted.len() as u64;
    let (shareable, shared, refusal) = prefix_fields(kind, &costs);
    PolicyReport {
        name: kind.name(),
        through_manager: kind.is_kvvm(),
        peak_committed_bytes: tally.peak,
        mean_committed_bytes: mean(tally.committed_integral),
        mean_live_bytes: mean(
            tally
                .tokens_integral
                .saturating_mul(u128::from(bytes_per_token)),
        ),
        mean_stored_live_bytes: mean(tally.live_integral),
        waste_ratio: waste_ratio(tally),
        peak_held_bytes: tally.peak_held.max(tally.peak),
        admitted,
        deferred: tally.deferred.len() as u64,
        waited: tally.waited,
        refusals: tally.refusals,
        rejected: tally.rejected,
        preemptions: tally.preemptions,
        completed: tally.completed,
        mean_queue_delay_ms: if admitted == 0 {
            0.0
        } else {
            tally.queue_delay_us as f64 / admitted as f64 / 1e3
        },
        queue_delay_p50_ms: quantile_ms(&tally.delays_us, 0.50),
        queue_delay_p99_ms: quantile_ms(&tally.delays_us, 0.99),
        peak_running: tally.peak_running,
        mean_running: tally.running_integral as f64 / span as f64,
        makespan_s: span as f64 / 1e6,
        driver_calls: costs.driver_calls,
        mappings: costs.mappings,
        handles: costs.handles,
        peak_mappings: costs.peak_mappings,
        driver_time_us: u64::try_from(costs.driver_time.as_micros()).unwrap_or(u64::MAX),
        driver_time_share: costs.driver_time.as_secs_f64() / (span as f64 / 1e6),
        driver_time_source: if costs.measured {
            "measured"
        } else {
            "latency-model"
        },
        copy_bytes: costs.copy_bytes,
        kv_write_bytes: costs.kv_write_bytes,
        prefix_shareable: shareable,
        prefix_shared_bytes: shared,
        prefix_refusal: refusal,
        samples: tally.samples.clone(),
    }
}

/// The time-averaged share of committed bytes that hold no live KV.
fn waste_ratio(tally: &Tally) -> f64 {
    if tally.committed_integral == 0 {
        0.0
    } else {
        let waste = tally.committed_integral.saturating_sub(tally.live_integral);
        waste as f64 / tally.committed_integral as f64
    }
}

/// Whether `kind` shared the trace's prefix, the bytes it shared, and why not: the kvvm
/// verdict when there was one, the paged prefix cache's blocks, or the absence of a common
/// system prompt for a policy that shares prefixes (`None` for the others).
fn prefix_fields(kind: PolicyKind, costs: &Costs) -> (Option<bool>, Option<u64>, Option<String>) {
    match &costs.shareability {
        Some(v) => share_fields(v),
        None if kind == PolicyKind::Paged16Prefix => match costs.block_prefix_bytes {
            Some(bytes) => (Some(true), Some(bytes), None),
            None => (
                Some(false),
                Some(0),
                Some(format!(
                    "the trace has no common system prompt of at least one {PAGED_BLOCK_TOKENS}-token block"
                )),
            ),
        },
        None if matches!(
            kind,
            PolicyKind::Kvvm {
                prefix_sharing: true,
                ..
            }
        ) =>
        {
            (
                Some(false),
                Some(0),
                Some("the trace has no common system prompt".to_owned()),
            )
        }
        None => (None, None, None),
    }
}

fn share_fields(v: &PrefixShareability) -> (Option<bool>, Option<u64>, Option<String>) {
    (
        Some(v.shareable),
        Some(if v.shareable { v.shared_bytes } else { 0 }),
        v.refusal_reason(),
    )
}

#[cfg(test)]
#[path = "replay_tests.rs"]
mod tests;
