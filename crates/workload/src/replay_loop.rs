//! The decode-step loop that replays a trace through one policy, and the tally it keeps.
//!
//! Each step: the requests that arrived are queued; the queue is admitted first come first
//! served; every running sequence asks for one more token; when all of them are refused, the
//! youngest is preempted; the finished ones leave; and the memory is observed.

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use crate::error::{WorkloadError, WorkloadResult};
use crate::policy::{Outcome, Policy};
use crate::report::Sample;
use crate::trace::{Request, Trace};

/// Consecutive decode steps without any progress (no token, admission, completion or
/// preemption) after which a replay gives up: a bug, never a property of a trace.
const MAX_IDLE_STEPS: u64 = 100_000;

#[derive(Debug, Clone, Copy)]
struct Running {
    id: usize,
    tokens: u64,
    target: u64,
    stalled: bool,
}

/// What a replay through one policy counted, for its report.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub(crate) admitted: HashSet<usize>,
    pub(crate) deferred: HashSet<usize>,
    pub(crate) waited: u64,
    pub(crate) refusals: u64,
    pub(crate) rejected: u64,
    pub(crate) preemptions: u64,
    pub(crate) completed: u64,
    pub(crate) queue_delay_us: u128,
    /// Each admitted request's wait, from the step it arrived in to its first admission.
    pub(crate) delays_us: Vec<u64>,
    /// Most requests running at once.
    pub(crate) peak_running: u64,
    /// Integral of the requests running over time, and of their tokens.
    pub(crate) running_integral: u128,
    pub(crate) tokens_integral: u128,
    last_running: u64,
    last_tokens: u64,
    pub(crate) peak: u64,
    pub(crate) peak_held: u64,
    pub(crate) committed_integral: u128,
    pub(crate) live_integral: u128,
    pub(crate) last_t: u64,
    last_committed: u64,
    last_live: u64,
    pub(crate) samples: Vec<Sample>,
}

/// `integral` plus `level` held for `dt`.
fn accrue(integral: u128, level: u64, dt: u128) -> u128 {
    integral.saturating_add(u128::from(level).saturating_mul(dt))
}

impl Tally {
    /// Records the state after a step: bytes committed, live (a shared prefix once) and held,
    /// and the requests running with their tokens.
    fn observe(&mut self, t_us: u64, committed: u64, live: u64, held: u64, running: &[Running]) {
        let dt = u128::from(t_us.saturating_sub(self.last_t));
        self.running_integral = accrue(self.running_integral, self.last_running, dt);
        self.tokens_integral = accrue(self.tokens_integral, self.last_tokens, dt);
        self.last_running = running.len() as u64;
        self.last_tokens = running.iter().fold(0u64, |a, r| a.saturating_add(r.tokens));
        self.peak_running = self.peak_running.max(self.last_running);
        self.committed_integral = accrue(self.committed_integral, self.last_committed, dt);
        self.live_integral = accrue(self.live_integral, self.last_live, dt);
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

/// Replays `trace` through one policy, one decode step of `step` at a time; `progress` is
/// called with the requests done (completed or rejected) so far.
pub(crate) fn replay_one(
    trace: &Trace,
    policy: &mut dyn Policy,
    step: Duration,
    progress: &mut dyn FnMut(usize),
) -> WorkloadResult<Tally> {
    let step_us = u64::try_from(step.as_micros())
        .ok()
        .filter(|s| *s > 0)
        .ok_or_else(|| WorkloadError::Config("the decode step must be at least 1 us".into()))?;
    let mut replay = Replay::new(&trace.requests, policy, progress);
    loop {
        if replay.is_idle() && !replay.jump_to_next_arrival() {
            break;
        }
        replay.enqueue_arrivals();
        let admitted = replay.admit_waiting()?;
        replay.count_first_waits();
        let grew = replay.decode_step()?;
        let preempted = replay.preempt_if_all_stalled()?;
        let finished = replay.retire_finished()?;
        replay.observe_step();
        if replay.is_idle() && replay.next >= replay.reqs.len() {
            break;
        }
        replay.count_idle_step(admitted || grew || preempted || finished)?;
        replay.t = replay.t.saturating_add(step_us);
        replay.policy.advance(step);
    }
    replay.observe_end();
    Ok(replay.tally)
}

/// The state of a replay through one policy.
struct Replay<'a> {
    reqs: &'a [Request],
    policy: &'a mut dyn Policy,
    progress: &'a mut dyn FnMut(usize),
    tally: Tally,
    /// Now, in microseconds.
    t: u64,
    /// The next request to arrive.
    next: usize,
    /// Waiting requests: (id, tokens already computed before a preemption).
    waiting: VecDeque<(usize, u64)>,
    running: Vec<Running>,
    first_admit: Vec<Option<u64>>,
    /// The step each request arrived in: its wait starts there (the time to the next step
    /// boundary is the engine's batching, not queueing).
    enqueued: Vec<u64>,
    waited: Vec<bool>,
    /// Requests completed or rejected.
    done: usize,
    /// Whether a running sequence was refused growth in the last step.
    pressure: bool,
    idle_steps: u64,
}

impl<'a> Replay<'a> {
    fn new(
        reqs: &'a [Request],
        policy: &'a mut dyn Policy,
        progress: &'a mut dyn FnMut(usize),
    ) -> Self {
        let mut tally = Tally::default();
        let start = reqs.first().map_or(0, |r| r.arrival_us);
        tally.last_t = start;
        tally.samples.push(Sample {
            t_s: start as f64 / 1e6,
            committed_bytes: 0,
        });
        Replay {
            reqs,
            policy,
            progress,
            tally,
            t: start,
            next: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            first_admit: vec![None; reqs.len()],
            enqueued: vec![0; reqs.len()],
            waited: vec![false; reqs.len()],
            done: 0,
            pressure: false,
            idle_steps: 0,
        }
    }

    /// Nothing runs and nothing waits.
    fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// With nothing to do until the next arrival, jumps there; `false` when no request is
    /// left to arrive.
    fn jump_to_next_arrival(&mut self) -> bool {
        let Some(r) = self.reqs.get(self.next) else {
            return false;
        };
        let dt = r.arrival_us.saturating_sub(self.t);
        self.policy.advance(Duration::from_micros(dt));
        self.t = self.t.max(r.arrival_us);
        true
    }

    /// Queues every request that has arrived by now.
    fn enqueue_arrivals(&mut self) {
        while let Some(r) = self.reqs.get(self.next) {
            if r.arrival_us > self.t {
                break;
            }
            if let Some(e) = self.enqueued.get_mut(self.next) {
                *e = self.t;
            }
            self.waiting.push_back((self.next, 0));
            self.next += 1;
        }
    }

    /// Admission, first come first served; the first refusal stops it for this step.
    /// Running sequences come first: while one of them was refused growth in the last step,
    /// nothing new is admitted (else a preempted sequence would take back the memory it just
    /// gave up, and the engine would thrash). Returns whether a request was admitted.
    fn admit_waiting(&mut self) -> WorkloadResult<bool> {
        let reqs = self.reqs;
        let mut admitted = false;
        while let Some(&(id, computed)) = self.waiting.front() {
            if self.pressure {
                break;
            }
            let Some(req) = reqs.get(id) else { break };
            let tokens = req.prompt_tokens.max(computed);
            match self.policy.admit(id, req, tokens)? {
                Outcome::Done => {
                    self.waiting.pop_front();
                    admitted = true;
                    self.start_running(id, tokens, req.total_tokens());
                }
                Outcome::Refused(_) => {
                    self.tally.refusals = self.tally.refusals.saturating_add(1);
                    self.tally.deferred.insert(id);
                    if !self.running.is_empty() {
                        break;
                    }
                    // Nothing else holds memory: this request can never fit.
                    self.waiting.pop_front();
                    self.reject_one();
                }
            }
        }
        Ok(admitted)
    }

    /// Runs request `id`, admitted with `tokens` of its `target`, and records its wait if
    /// this is its first admission.
    fn start_running(&mut self, id: usize, tokens: u64, target: u64) {
        self.tally.admitted.insert(id);
        if self.first_admit.get(id).is_some_and(|a| a.is_none()) {
            if let Some(slot) = self.first_admit.get_mut(id) {
                *slot = Some(self.t);
            }
            let wait = self
                .t
                .saturating_sub(self.enqueued.get(id).copied().unwrap_or(self.t));
            self.tally.queue_delay_us = self.tally.queue_delay_us.saturating_add(u128::from(wait));
            self.tally.delays_us.push(wait);
        }
        self.running.push(Running {
            id,
            tokens,
            target,
            stalled: false,
        });
    }

    /// Counts a request that can never fit the budget as done.
    fn reject_one(&mut self) {
        self.tally.rejected = self.tally.rejected.saturating_add(1);
        self.done += 1;
        (self.progress)(self.done);
    }

    /// Every request still queued after admission has waited (at least one step before its
    /// first admission). New arrivals are at the back and the first wait is counted once, so
    /// walking back from the end to the first request already counted (or already admitted
    /// once: a preempted one) is enough.
    fn count_first_waits(&mut self) {
        for &(id, _) in self.waiting.iter().rev() {
            let first_wait = self.first_admit.get(id).is_some_and(Option::is_none)
                && self.waited.get(id).is_some_and(|w| !*w);
            if !first_wait {
                break;
            }
            if let Some(w) = self.waited.get_mut(id) {
                *w = true;
            }
            self.tally.waited = self.tally.waited.saturating_add(1);
        }
    }

    /// One decode step: every running sequence gains a token if its growth is granted.
    /// Returns whether one did.
    fn decode_step(&mut self) -> WorkloadResult<bool> {
        let mut grew = false;
        for r in self.running.iter_mut() {
            r.stalled = false;
            if r.tokens >= r.target {
                continue;
            }
            match self.policy.grow(r.id, r.tokens.saturating_add(1))? {
                Outcome::Done => {
                    r.tokens = r.tokens.saturating_add(1);
                    grew = true;
                }
                Outcome::Refused(_) => {
                    r.stalled = true;
                    self.tally.refusals = self.tally.refusals.saturating_add(1);
                    self.tally.deferred.insert(r.id);
                }
            }
        }
        self.pressure = self.running.iter().any(|r| r.stalled);
        Ok(grew)
    }

    /// When every running sequence was refused growth, nobody can progress: the youngest is
    /// preempted (recomputed when readmitted), or rejected if it ran alone. Returns whether
    /// one was.
    fn preempt_if_all_stalled(&mut self) -> WorkloadResult<bool> {
        if self.running.is_empty() || !self.running.iter().all(|r| r.stalled) {
            return Ok(false);
        }
        let Some(victim) = self.running.pop() else {
            return Ok(false);
        };
        self.policy.finish(victim.id)?;
        if self.running.is_empty() {
            // Alone and still refused: it can never fit the budget.
            self.reject_one();
        } else {
            self.tally.preemptions = self.tally.preemptions.saturating_add(1);
            self.waiting.push_front((victim.id, victim.tokens));
        }
        Ok(true)
    }

    /// Finishes the sequences that reached their length. Returns whether one did.
    fn retire_finished(&mut self) -> WorkloadResult<bool> {
        let mut finished = false;
        let mut i = 0;
        while i < self.running.len() {
            match self.running.get(i) {
                Some(r) if r.tokens >= r.target => {
                    self.policy.finish(r.id)?;
                    self.running.swap_remove(i);
                    self.tally.completed = self.tally.completed.saturating_add(1);
                    finished = true;
                    self.done += 1;
                    (self.progress)(self.done);
                }
                _ => i += 1,
            }
        }
        Ok(finished)
    }

    /// Records the memory after a step, the policy's transient peak included.
    fn observe_step(&mut self) {
        let held = self.policy.held_bytes();
        self.tally.observe(
            self.t,
            self.policy.committed_bytes(),
            self.policy.live_bytes(),
            held,
            &self.running,
        );
        self.tally.peak = self.tally.peak.max(self.policy.transient_peak());
    }

    /// Records the memory at the end of the replay.
    fn observe_end(&mut self) {
        self.tally.observe(
            self.t,
            self.policy.committed_bytes(),
            self.policy.live_bytes(),
            self.policy.held_bytes(),
            &self.running,
        );
    }

    /// Counts a step that made no progress while sequences run; too many in a row is a
    /// stall.
    fn count_idle_step(&mut self, progressed: bool) -> WorkloadResult<()> {
        self.idle_steps = if progressed || self.running.is_empty() {
            0
        } else {
            self.idle_steps.saturating_add(1)
        };
        if self.idle_steps > MAX_IDLE_STEPS {
            return Err(WorkloadError::Stalled {
                t_s: self.t as f64 / 1e6,
            });
        }
        Ok(())
    }
}
