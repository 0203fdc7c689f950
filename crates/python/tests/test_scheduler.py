"""The engine's scheduler on its own (``kvvm.serving.scheduler``), with no model, no device
and no torch: a fake KV manager that keeps kvvm's books in windows exactly and checks that
every forward writes only into windows reserved before it ran, and a fake runner whose
tokens depend only on the request and the token's index (``serving_fakes.py``). What each
step schedules, in the cases the engine's limits are about."""

from __future__ import annotations

from serving_fakes import EOS, FakeKv, FakeRunner, StepChecks, step

from kvvm.serving import Request, Scheduler


def _world(
    *, slots: int, budget: int, window: int = 4, unit: int | None = None, chunk: int = 4, batch: int = 64,
    max_len: int = 256, stops: dict[int, int] | None = None,
) -> tuple[Scheduler, FakeKv, FakeRunner]:
    kv = FakeKv(slots=slots, budget=budget, window=window, unit=unit)
    sched = Scheduler(kv, max_len=max_len, prefill_chunk=chunk, prefill_batch_tokens=batch)
    return sched, kv, FakeRunner(stops or {})


def _request(i: int, prompt: int | list[int], new: int) -> Request:
    ids = prompt if isinstance(prompt, list) else [(i * 13 + t) % 97 for t in range(prompt)]
    return Request(i, ids, new, eos=frozenset([EOS]))


def _drain(sched: Scheduler, kv: FakeKv, runner: FakeRunner, steps: int = 1000) -> list:
    checks = StepChecks(sched, lambda ctx: -(-len(ctx) // kv.window) + kv.scratch > kv.budget)
    outs = []
    while not sched.idle:
        checks.before()
        outs.append(step(sched, kv, runner))
        checks.after(outs[-1])
        assert len(outs) <= steps
    return outs


def test_a_request_whose_prefill_ends_decodes_in_the_same_step() -> None:
    sched, kv, runner = _world(slots=2, budget=8, chunk=8)
    r = _request(0, 6, 3)
    sched.add(r)
    out = step(sched, kv, runner)
    assert out.scheduled_tokens() == {0: 7}, "six prompt tokens and one decode token"
    assert r.tokens == [runner.token(r, 1), runner.token(r, 2)]
    step(sched, kv, runner)
    assert r.finish_reason == "length" and sched.idle and kv.used == 1


def test_a_request_its_first_token_finishes_takes_no_decode_token() -> None:
    sched, kv, runner = _world(slots=1, budget=3, chunk=8, stops={0: 1})
    # Two windows of prompt: a decode token would need a third, which the budget lacks.
    r = _request(0, 8, 5)
    sched.add(r)
    out = step(sched, kv, runner)
    assert out.decode == [] and r.finish_reason == "stop" and r.tokens == [EOS]


def test_the_youngest_running_request_gives_way_even_while_prefilling() -> None:
    """Budget 4 windows of 4 tokens: the scratch, an older request of one window decoding,
    a younger one of two windows prefilling in chunks of 2. The older needs a second window:
    the younger is preempted, not the older truncated."""
    sched, kv, runner = _world(slots=2, budget=4, chunk=2)
    older, younger = _request(0, 2, 6), _request(1, 7, 2)
    sched.add(older)
    sched.add(younger)
    out = step(sched, kv, runner)
    while not out.preempted:
        assert not younger.tokens
        out = step(sched, kv, runner)
    assert out.preempted == [younger] and younger.tokens == [], "preempted while prefilling"
    assert out.decode == [older.slot]
    _drain(sched, kv, runner)
    assert older.finish_reason == "length" and older.preemptions == 0
    assert younger.preemptions == 1 and younger.finish_reason == "length"
    assert younger.tokens == [runner.token(younger, i) for i in (1, 2)]


def test_memory_only_alone_and_a_context_that_never_fits_holds_up_no_one() -> None:
    sched, kv, runner = _world(slots=2, budget=3, chunk=8)
    never = _request(0, 12, 2)  # three windows and the scratch: over the budget for good
    grows = _request(1, 3, 20)  # grows until it holds both windows, alone
    sched.add(never)
    sched.add(grows)
    outs = _drain(sched, kv, runner)
    assert never.finish_reason == "memory" and never.tokens == [] and outs[0].finished == [never]
    assert grows.finish_reason == "memory" and grows.preemptions == 0
    # Two windows hold the prompt and every token but the last.
    assert len(grows.tokens) == 8 - 3 + 1
    assert kv.used == 1


def test_requests_with_one_prefix_wait_for_its_prefill_and_others_pass_them() -> None:
    sched, kv, runner = _world(slots=4, budget=32, unit=1, chunk=4)
    system = list(range(40, 52))  # three windows of a common prompt
    together = [_request(i, system + [i, i + 1], 2) for i in range(3)]
    other = _request(3, 5, 2)
    for r in [*together, other]:
        sched.add(r)
    outs = _drain(sched, kv, runner)
    assert [r.prefix_hit_tokens for r in together] == [0, 12, 12]
    assert outs[0].admitted == [together[0], other] and outs[0].passed_over == together[1:]
    assert sched.stats.prefix_waits > 0 and sched.stats.prefix_hits == 2
    kv.clear_prefixes()
    assert kv.used == kv.scratch


def test_prefill_runs_batch_consecutive_slots_with_one_chunk_length() -> None:
    sched, kv, runner = _world(slots=4, budget=64, chunk=4, batch=8)
    for i, n in enumerate([10, 10, 10, 3]):
        sched.add(_request(i, n, 1))
    out = sched.schedule()
    assert [(run.slots, run.tokens) for run in out.prefill] == [([0, 1], 4), ([2], 4), ([3], 3)]
    assert [run.completing for run in out.prefill] == [[False, False], [False], [True]]
