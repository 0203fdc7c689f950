"""The engine's scheduling as properties, over random workloads: arrivals, budgets, prompt
and output lengths, shared prefixes, end tokens, preemptions.

- every request that fits the budget alone finishes, with the tokens it would have had
  alone (whatever preemptions recomputed it);
- ``"memory"`` only when truly alone (every other running request preempted in that step)
  or for a context that can never fit;
- no livelock: every workload finishes within a bound of steps;
- the order of service is FIFO, up to the documented exception (a request waiting for a
  prefix another request is prefilling is passed over) and the contexts that never fit;
- the KV manager holds nothing once every request finished (and nothing at all once its
  prefix cache is emptied).

Most examples run on the scheduler itself with the fakes of ``serving_fakes.py`` (which model
the budget in windows exactly and check that every forward writes only into windows reserved
before it ran); a smaller set runs the real engine on the host backend with a tiny random
Llama, its tokens checked against a one-request-at-a-time reference.

Seeded and bounded: by default Hypothesis is derandomized (the same examples every run, no
example database); ``KVVM_PROPERTY_SEED=<int>`` explores other examples instead (and prints
the reproduction of a failure), ``KVVM_PROPERTY_CASES=<n>`` runs ``n`` examples a test. A
counterexample found that way is kept here as an ``@example`` of its test.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="skipped: no hypothesis")

from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serving_fakes import EOS, FakeKv, FakeRunner, StepChecks, windows  # noqa: E402

from kvvm.serving import Request, Scheduler, SchedulerOutput  # noqa: E402

_SEED = os.environ.get("KVVM_PROPERTY_SEED")


def _settings(examples: int, shrink: bool = True) -> settings:
    """``examples`` examples, derandomized unless a seed is given; ``shrink=False`` for slow
    examples (a failure is reported as found, and replays as it is)."""
    phases = list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate]
    common: dict[str, Any] = {
        "max_examples": int(os.environ.get("KVVM_PROPERTY_CASES", examples)), "deadline": None, "phases": phases,
        "suppress_health_check": [HealthCheck.too_slow],
    }
    if _SEED is None:
        return settings(derandomize=True, database=None, **common)
    return settings(database=None, print_blob=True, **common)


def _seeded(test):  # type: ignore[no-untyped-def]
    return hypothesis.seed(int(_SEED))(test) if _SEED is not None else test


@dataclass
class Job:
    """One request of a workload: when it arrives (step), its prompt, its output limit and
    the index of its end token (None: none)."""

    arrival: int
    prompt: list[int]
    max_new: int
    stop_at: int | None


@dataclass
class Workload:
    slots: int
    budget: int
    window: int
    unit: int | None
    chunk: int
    batch: int
    max_len: int
    jobs: list[Job]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    window = draw(st.sampled_from([2, 4, 8]))
    unit = draw(st.sampled_from([None, 1, 1, 2]))
    max_len = draw(st.integers(24, 96))
    chunk = draw(st.integers(1, 12))
    handle = (unit or 1) * window
    systems = [
        [900 + 10 * s + t % 10 for t in range(draw(st.integers(0, 3)) * handle)] for s in range(2)
    ]
    jobs = []
    for _ in range(draw(st.integers(1, 12))):
        system = systems[draw(st.integers(0, 1))] if draw(st.integers(0, 2)) else []
        tail = [draw(st.integers(0, 99)) for _ in range(draw(st.integers(1, 16)))]
        prompt = (system + tail)[: max_len - 1]
        max_new = draw(st.integers(1, 24))
        stop_at = draw(st.one_of(st.none(), st.integers(1, max_new)))
        jobs.append(Job(draw(st.integers(0, 8)), prompt, max_new, stop_at))
    jobs.sort(key=lambda j: j.arrival)
    return Workload(
        slots=draw(st.integers(1, 5)), budget=draw(st.integers(2, 24)), window=window, unit=unit,
        chunk=chunk, batch=draw(st.integers(chunk, 48)), max_len=max_len, jobs=jobs,
    )


def generated(job: Job, max_len: int) -> int:
    """Tokens the job generates unconstrained by memory."""
    return min(job.max_new, job.stop_at or job.max_new, max_len - len(job.prompt))


def step_bound(jobs: list[Job], chunk: int) -> int:
    """Steps within which a workload must finish: its last arrival, then for every token of
    every request a recomputation of its whole context (a preemption after each token)."""
    last = max(j.arrival for j in jobs)
    return last + 2 + sum((j.max_new + 1) * (-(-(len(j.prompt) + j.max_new) // chunk) + 2) for j in jobs)


def _events(stats: object, reqs: list[Request]) -> None:
    """What the example exercised (``--hypothesis-show-statistics`` counts them)."""
    for name in ("preempted", "prefix_waits", "prefix_hits", "admission_refusals"):
        if getattr(stats, name):
            hypothesis.event(name)
    for reason in {r.finish_reason for r in reqs}:
        hypothesis.event(f"finished: {reason}")
    if any(r.finish_reason == "memory" and r.tokens for r in reqs):
        hypothesis.event("memory while running")


def serve(submit, step, idle, jobs: list[Job], bound: int) -> list[Request]:  # type: ignore[no-untyped-def]
    """Submits each job at its arrival step and steps until everything finished."""
    reqs: list[Request] = []
    pending = list(jobs)
    t = 0
    while pending or not idle():
        while pending and pending[0].arrival <= t:
            reqs.append(submit(pending.pop(0)))
        if not idle():
            step()
        t += 1
        assert t <= bound, f"no end after {t} steps: a livelock"
    return reqs


@_seeded
@_settings(300)
@given(workloads())
@example(Workload(slots=2, budget=4, window=4, unit=None, chunk=2, batch=8, max_len=64, jobs=[
    Job(0, [1, 2], 6, None), Job(0, [3, 4, 5, 6, 7, 8, 9], 2, None)]))
def test_the_scheduler_serves_every_request_that_fits_alone(w: Workload) -> None:
    kv = FakeKv(slots=w.slots, budget=w.budget, window=w.window, unit=w.unit)
    sched = Scheduler(kv, max_len=w.max_len, prefill_chunk=w.chunk, prefill_batch_tokens=w.batch)
    runner = FakeRunner({i: j.stop_at for i, j in enumerate(w.jobs) if j.stop_at is not None})
    checks = StepChecks(sched, lambda ctx: windows(len(ctx), w.window) + kv.scratch > w.budget)

    ids = itertools.count()

    def submit(job: Job) -> Request:
        r = Request(next(ids), job.prompt, job.max_new, eos=frozenset([EOS]))
        sched.add(r)
        return r

    def step() -> SchedulerOutput:
        checks.before()
        out = sched.schedule()
        sched.update(out, runner.execute(out, kv))
        checks.after(out)
        return out

    reqs = serve(submit, step, lambda: sched.idle, w.jobs, step_bound(w.jobs, w.chunk))
    for r, job in zip(reqs, w.jobs, strict=True):
        n = generated(job, w.max_len)
        want = [runner.token(r, i) for i in range(1, n + 1)]
        fits = windows(len(job.prompt) + n - 1, w.window) + kv.scratch <= w.budget
        if fits:
            assert r.finish_reason in ("stop", "length") and r.tokens == want, (r.id, r.finish_reason)
        else:
            assert r.finish_reason in ("memory", "stop", "length") and r.tokens == want[: len(r.tokens)]
        assert r.finish_reason != "memory" or not fits
    _events(sched.stats, reqs)
    assert not kv.table and all(e.pins == 0 for e in kv.entries.values()), "a finished request holds memory"
    kv.clear_prefixes()
    assert kv.used == kv.scratch


# ---- the real engine, a smaller set ----

#: A system prompt of one window of the tiny model the engine runs.
_SYSTEM = list(range(500, 564))


@st.composite
def engine_workloads(draw: st.DrawFn) -> Workload:
    jobs = []
    system = _SYSTEM  # one window of the tiny model below
    for _ in range(draw(st.integers(1, 4))):
        shared = system if draw(st.booleans()) else []
        tail = [draw(st.integers(0, 999)) for _ in range(draw(st.integers(1, 70)))]
        jobs.append(Job(draw(st.integers(0, 4)), shared + tail, draw(st.integers(1, 30)), None))
    jobs.sort(key=lambda j: j.arrival)
    chunk = draw(st.sampled_from([32, 64]))
    return Workload(
        slots=draw(st.integers(1, 3)), budget=draw(st.integers(2, 4)), window=64,
        unit=draw(st.one_of(st.none(), st.just(1))), chunk=chunk, batch=128, max_len=256, jobs=jobs,
    )


@_seeded
@_settings(6, shrink=False)
@given(engine_workloads())
# A younger request preempted while prefilling, then recomputed.
@example(Workload(slots=2, budget=4, window=64, unit=None, chunk=32, batch=128, max_len=256, jobs=[
    Job(0, list(range(1, 61)), 20, None), Job(0, list(range(100, 220)), 5, None)]))
# Requests arriving together with one system prompt: they wait for its prefill and map it.
@example(Workload(slots=3, budget=6, window=64, unit=1, chunk=32, batch=128, max_len=256, jobs=[
    Job(0, _SYSTEM + [7, 8, 9], 4, None), Job(0, _SYSTEM + [1] * 10, 4, None), Job(1, _SYSTEM + [2, 3], 4, None)]))
def test_the_engine_serves_every_request_that_fits_alone(w: Workload) -> None:
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    pytest.importorskip("transformers", reason="skipped: no transformers")
    from conftest import host_available

    if not host_available():
        pytest.skip("skipped: no host backend")
    import kvvm
    from kvvm.engine import Engine
    from test_engine import _budgeted, reference

    model, ref, mgr, per_window = _budgeted(w.budget)
    assert per_window == w.window
    engine = Engine(
        model, slots=w.slots, max_len=w.max_len, manager=mgr, prefill_chunk=w.chunk,
        prefix_cache_bytes=(64 << 20) if w.unit else 0, prefix_handle_tokens=per_window,
    )
    scratch = mgr.granule
    checks = StepChecks(
        engine.scheduler,
        lambda ctx: engine.cache.plan.committed_bytes_for_tokens(len(ctx)) + scratch > w.budget * mgr.granule,
    )

    def step() -> None:
        checks.before()
        schedule = engine.scheduler.schedule
        outs: list[SchedulerOutput] = []

        def recorded() -> SchedulerOutput:
            outs.append(schedule())
            return outs[-1]

        engine.scheduler.schedule = recorded  # type: ignore[method-assign]
        try:
            engine.step()
        finally:
            del engine.scheduler.schedule
        checks.after(outs[0])

    with torch.no_grad():
        reqs = serve(lambda j: engine.submit(j.prompt, j.max_new), step, lambda: engine.idle, w.jobs,
                     step_bound(w.jobs, w.chunk))
    _events(engine.stats, reqs)
    assert engine.cache.committed_bytes == 0, "a finished request holds memory"
    for r, job in zip(reqs, w.jobs, strict=True):
        n = generated(job, w.max_len)
        fits = engine.cache.plan.committed_bytes_for_tokens(len(job.prompt) + n - 1) + scratch <= w.budget * mgr.granule
        if fits:
            assert r.finish_reason == "length", (r.id, r.finish_reason)
        else:
            assert r.finish_reason in ("memory", "length")
        assert not r.tokens or r.tokens == reference(ref, r.prompt, len(r.tokens))
    engine.close()
    snap = mgr.snapshot()
    assert snap.committed == snap.shared == 0
    assert isinstance(mgr, kvvm.Manager)


@_seeded
@_settings(400)
@given(
    st.lists(st.integers(0, 2), max_size=90), st.lists(st.integers(0, 2), max_size=90), st.integers(1, 12),
    st.integers(0, 90),
)
def test_the_shared_units_are_the_longest_common_prefix_in_whole_units(
    a: list[int], tail: list[int], unit: int, common: int,
) -> None:
    """The KV manager's common prefix in whole hit units (galloping over the units) is the
    unit-by-unit scan's, for every pair of contexts and unit (a long common prefix made
    likely: the second context opens with the first's first ``common`` tokens)."""
    from kvvm.serving.kv_manager import shared_units

    b = a[:common] + tail
    want = 0
    while want + unit <= min(len(a), len(b)) and a[want : want + unit] == b[want : want + unit]:
        want += unit
    assert shared_units(a, b, unit) == want
    assert shared_units(b, a, unit) == want
