//! The event-driven replay of a trace through every policy, and its report.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvvm_hal::{AllocationProperties, DeviceId, VirtualMemoryBackend};
use kvvm_layout::{KvDtype, KvGeometry, PrefixShareability};

use crate::classic_policy::ClassicPolicy;
use crate::error::{WorkloadError, WorkloadResult};
use crate::kvvm_policy::KvvmPolicy;
use crate::paged_policy::PagedPolicy;
use crate::policy::{Costs, Outcome, Policy, PolicyKind, Shape, PAGED_BLOCK_TOKENS};
use crate::report::{PolicyReport, Sample, SimulationReport, TraceSummary};
use crate::trace::{Trace, TraceSource};

/// Default memory budget: 8 GiB, a budget under which the policies serve differently. On the
/// default trace `static-max` (4 GiB a request at the default 32768-token context) runs two
/// requests at a time, `realloc-copy` and the head- and seq-major layouts make requests wait,
/// while token-major and the paged policies serve every request at once; with the ample
/// 40 GiB every policy but `static-max` serves the same and only memory tells them apart.
pub const DEFAULT_BUDGET_BYTES: u64 = 8 << 30;

/// Consecutive decode steps without any progress (no token, admission, completion or
/// preemption) after which a replay gives up: a bug, never a property of a trace.
const MAX_IDLE_STEPS: u64 = 100_000;

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

#[derive(Debug, Clone, Copy)]
struct Running {
    id: usize,
    tokens: u64,
    target: u64,
    stalled: bool,
}

#[derive(Debug, Default)]
struct Tally {
    admitted: HashSet<usize>,
    deferred: HashSet<usize>,
    waited: u64,
    refusals: u64,
    rejected: u64,
    preemptions: u64,
    completed: u64,
    queue_delay_us: u128,
    /// Each admitted request's wait, from the step it arrived in to its first admission.
    delays_us: Vec<u64>,
    /// Most requests running at once.
    peak_running: u64,
    /// Integral of the requests running over time, and of their tokens.
    running_integral: u128,
    tokens_integral: u128,
    last_running: u64,
    last_tokens: u64,
    peak: u64,
    peak_held: u64,
    committed_integral: u128,
    live_integral: u128,
    last_t: u64,
    last_committed: u64,
    last_live: u64,
    samples: Vec<Sample>,
}

impl Tally {
    /// Records the state after a step: bytes committed, live (a shared prefix once) and held,
    /// and the requests running with their tokens.
    fn observe(&mut self, t_us: u64, committed: u64, live: u64, held: u64, running: &[Running]) {
        let dt = u128::from(t_us.saturating_sub(self.last_t));
        self.running_integral = self
            .running_integral
            .saturating_add(u128::from(self.last_running).saturating_mul(dt));
        self.tokens_integral = self
            .tokens_integral
            .saturating_add(u128::from(self.last_tokens).saturating_mul(dt));
        self.last_running = running.len() as u64;
        self.last_tokens = running.iter().fold(0u64, |a, r| a.saturating_add(r.tokens));
        self.peak_running = self.peak_running.max(self.last_running);
        self.committed_integral = self
            .committed_integral
            .saturating_add(u128::from(self.last_committed).saturating_mul(dt));
        self.live_integral = self
            .live_integral
            .saturating_add(u128::from(self.last_live).saturating_mul(dt));
        self.last_t = t_us;
        self.last_committed = committed;
        self.last_live = live;
        self.peak = self.peak.max(committed);
        self.peak_held = self.peak_held.max(held);
        let t_s = t_us as f64 / 1e6;
        match self.samples.last() {
            Some(s) if s.committed_bytes == committed => {}
            _ => self.samples.push(Sample {
                t_s,
                committed_bytes: committed,
            }),
        }
    }
}

/// Replays `trace` through one policy.
fn replay_one(
    trace: &Trace,
    policy: &mut dyn Policy,
    step: Duration,
    progress: &mut dyn FnMut(usize),
) -> WorkloadResult<Tally> {
    let step_us = u64::try_from(step.as_micros())
        .ok()
        .filter(|s| *s > 0)
        .ok_or_else(|| WorkloadError::Config("the decode step must be at least 1 us".into()))?;
    let reqs = &trace.requests;
    let mut tally = Tally::default();
    let start = reqs.first().map_or(0, |r| r.arrival_us);
    tally.last_t = start;
    tally.samples.push(Sample {
        t_s: start as f64 / 1e6,
        committed_bytes: 0,
    });
    let mut t = start;
    let mut next = 0usize;
    // Waiting requests: (id, tokens already computed before a preemption).
    let mut waiting: VecDeque<(usize, u64)> = VecDeque::new();
    let mut running: Vec<Running> = Vec::new();
    let mut first_admit: Vec<Option<u64>> = vec![None; reqs.len()];
    // The step each request arrived in: its wait starts there (the time to the next step
    // boundary is the engine's batching, not queueing).
    let mut enqueued: Vec<u64> = vec![0; reqs.len()];
    let mut waited: Vec<bool> = vec![false; reqs.len()];
    let mut done = 0usize;
    let mut pressure = false;
    let mut idle_steps = 0u64;
    loop {
        if running.is_empty() && waiting.is_empty() {
            match reqs.get(next) {
                // Nothing to do until the next arrival: jump there.
                Some(r) => {
                    let dt = r.arrival_us.saturating_sub(t);
                    policy.advance(Duration::from_micros(dt));
                    t = t.max(r.arrival_us);
                }
                None => break,
            }
        }
        while let Some(r) = reqs.get(next) {
            if r.arrival_us > t {
                break;
            }
            if let Some(e) = enqueued.get_mut(next) {
                *e = t;
            }
            waiting.push_back((next, 0));
            next += 1;
        }
        // Admission, first come first served; the first refusal stops it for this step.
        // Running sequences come first: while one of them was refused growth in the last
        // step, nothing new is admitted (else a preempted sequence would take back the
        // memory it just gave up, and the engine would thrash).
        let mut progressed = false;
        while let Some(&(id, computed)) = waiting.front() {
            if pressure {
                break;
            }
            let Some(req) = reqs.get(id) else { break };
            let tokens = req.prompt_tokens.max(computed);
            match policy.admit(id, req, tokens)? {
                Outcome::Done => {
                    waiting.pop_front();
                    progressed = true;
                    tally.admitted.insert(id);
                    if first_admit.get(id).is_some_and(|a| a.is_none()) {
                        if let Some(slot) = first_admit.get_mut(id) {
                            *slot = Some(t);
                        }
                        let wait = t.saturating_sub(enqueued.get(id).copied().unwrap_or(t));
                        tally.queue_delay_us =
                            tally.queue_delay_us.saturating_add(u128::from(wait));
                        tally.delays_us.push(wait);
                    }
                    running.push(Running {
                        id,
                        tokens,
                        target: req.total_tokens(),
                        stalled: false,
                    });
                }
                Outcome::Refused(_) => {
                    tally.refusals = tally.refusals.saturating_add(1);
                    tally.deferred.insert(id);
                    if running.is_empty() {
                        // Nothing else holds memory: this request can never fit.
                        waiting.pop_front();
                        tally.rejected = tally.rejected.saturating_add(1);
                        done += 1;
                        progress(done);
                        continue;
                    }
                    break;
                }
            }
        }
        // Every request still queued after admission has waited (at least one step before
        // its first admission). New arrivals are at the back and the first wait is counted
        // once, so walking back from the end to the first request already counted (or
        // already admitted once: a preempted one) is enough.
        for &(id, _) in waiting.iter().rev() {
            let first_wait = first_admit.get(id).is_some_and(Option::is_none)
                && waited.get(id).is_some_and(|w| !*w);
            if !first_wait {
                break;
            }
            if let Some(w) = waited.get_mut(id) {
                *w = true;
            }
            tally.waited = tally.waited.saturating_add(1);
        }
        // One decode step: every running sequence gains a token if its growth is granted.
        for r in running.iter_mut() {
            r.stalled = false;
            if r.tokens >= r.target {
                continue;
            }
            match policy.grow(r.id, r.tokens.saturating_add(1))? {
                Outcome::Done => {
                    r.tokens = r.tokens.saturating_add(1);
                    progressed = true;
                }
                Outcome::Refused(_) => {
                    r.stalled = true;
                    tally.refusals = tally.refusals.saturating_add(1);
                    tally.deferred.insert(r.id);
                }
            }
        }
        pressure = running.iter().any(|r| r.stalled);
        if !running.is_empty() && running.iter().all(|r| r.stalled) {
            if let Some(victim) = running.pop() {
                policy.finish(victim.id)?;
                progressed = true;
                if running.is_empty() {
                    // Alone and still refused: it can never fit the budget.
                    tally.rejected = tally.rejected.saturating_add(1);
                    done += 1;
                    progress(done);
                } else {
                    // Nobody can progress: preempt the youngest; it is recomputed when
                    // readmitted.
                    tally.preemptions = tally.preemptions.saturating_add(1);
                    waiting.push_front((victim.id, victim.tokens));
                }
            }
        }
        let mut i = 0;
        while i < running.len() {
            match running.get(i) {
                Some(r) if r.tokens >= r.target => {
                    policy.finish(r.id)?;
                    running.swap_remove(i);
                    tally.completed = tally.completed.saturating_add(1);
                    progressed = true;
                    done += 1;
                    progress(done);
                }
                _ => i += 1,
            }
        }
        let held = policy.held_bytes();
        tally.observe(
            t,
            policy.committed_bytes(),
            policy.live_bytes(),
            held,
            &running,
        );
        tally.peak = tally.peak.max(policy.transient_peak());
        if running.is_empty() && waiting.is_empty() && next >= reqs.len() {
            break;
        }
        idle_steps = if progressed || running.is_empty() {
            0
        } else {
            idle_steps.saturating_add(1)
        };
        if idle_steps > MAX_IDLE_STEPS {
            return Err(WorkloadError::Stalled {
                t_s: t as f64 / 1e6,
            });
        }
        t = t.saturating_add(step_us);
        policy.advance(step);
    }
    tally.observe(
        t,
        policy.committed_bytes(),
        policy.live_bytes(),
        policy.held_bytes(),
        &running,
    );
    Ok(tally)
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
    if trace.requests.is_empty() {
        return Err(WorkloadError::EmptyTrace);
    }
    if config.budget_bytes == 0 {
        return Err(WorkloadError::Config("the budget must be positive".into()));
    }
    let geometry = KvGeometry::preset(&config.model, config.dtype, config.max_context)?;
    trace.check_fits(config.max_context)?;
    let shape = Shape {
        geometry,
        bytes_per_token: geometry.bytes_per_token(),
        max_context: config.max_context,
        budget: config.budget_bytes,
    };
    let write_kv = config.write_kv.unwrap_or(backend.name() != "sim");
    // The granule the manager will use (the recommended one when it is a multiple of the
    // minimum, as `VmmConfig::default()` chooses).
    let g = backend.granularity(&AllocationProperties::device(config.device))?;
    let granule = if g.recommended != 0 && g.minimum != 0 && g.recommended % g.minimum == 0 {
        g.recommended
    } else {
        g.minimum
    };
    let mut reports = Vec::with_capacity(config.policies.len());
    let n_policies = config.policies.len();
    for (pi, kind) in config.policies.iter().enumerate() {
        let mut policy: Box<dyn Policy> = match kind {
            PolicyKind::Kvvm {
                layout,
                prefix_sharing,
            } => {
                let p = KvvmPolicy::new(
                    backend.clone(),
                    config.device,
                    *layout,
                    *prefix_sharing,
                    trace.system_prompt_tokens,
                    shape,
                    write_kv,
                )?;
                Box::new(p)
            }
            PolicyKind::Paged16 => Box::new(PagedPolicy::new(shape, false, 0)),
            PolicyKind::Paged16Prefix => {
                Box::new(PagedPolicy::new(shape, true, trace.system_prompt_tokens))
            }
            other => Box::new(ClassicPolicy::new(*other, shape)),
        };
        let requests = trace.requests.len();
        progress(Progress {
            policies_done: pi,
            policies: n_policies,
            requests_done: 0,
            requests,
        });
        let tally = replay_one(trace, policy.as_mut(), config.step, &mut |done| {
            progress(Progress {
                policies_done: pi,
                policies: n_policies,
                requests_done: done,
                requests,
            })
        })?;
        let costs = policy.close()?;
        drop(policy);
        reports.push(report_of(
            *kind,
            &tally,
            costs,
            trace,
            shape.bytes_per_token,
        ));
    }
    progress(Progress {
        policies_done: n_policies,
        policies: n_policies,
        requests_done: trace.requests.len(),
        requests: trace.requests.len(),
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
    let waste_ratio = if tally.committed_integral == 0 {
        0.0
    } else {
        let waste = tally.committed_integral.saturating_sub(tally.live_integral);
        waste as f64 / tally.committed_integral as f64
    };
    let admitted = tally.admitted.len() as u64;
    let (shareable, shared, refusal) = match &costs.shareability {
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
    };
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
        waste_ratio,
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
