"""The engine served from other threads: a request's output as a blocking iterator, an async
iterator and a callback; ``cancel`` giving a slot and its memory back at once; the
background loop (``start``/``stop``) with submissions and cancellations raced against it; a
failing loop; a full queue. Tiny random fp32 Llamas on the host backend; greedy tokens are
checked against transformers' one-request-at-a-time reference.

The races assert only what holds on every schedule (each request ends once, with the reason
its thread's order allows; every greedy request that was not cancelled has its reference
tokens; nothing is held afterwards), and order their threads with barriers and the requests'
own streams, never with sleeps."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import NoReturn, TypedDict

import pytest

import kvvm
from conftest import host_available

torch = pytest.importorskip("torch", reason="skipped: no torch")
pytest.importorskip("transformers", reason="skipped: no transformers")

from kvvm.engine import Engine, Request  # noqa: E402
from kvvm.serving.params import SamplingParams  # noqa: E402
from kvvm.serving.stream import Delta  # noqa: E402
from test_engine import prompts, reference, tiny  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

#: Rounds of each race test (each round a fresh set of requests on one engine).
ROUNDS = 6


@pytest.fixture(scope="module")
def models() -> tuple[object, object]:
    return tiny()


@pytest.fixture
def engine(models: tuple[object, object]):
    model, _ = models
    # No pre-committer: the books then hold exactly what the requests hold.
    mgr = kvvm.Manager("host")
    eng = Engine(model, slots=3, max_len=96, manager=mgr, compile=False, prefix_cache_bytes=16 << 20)
    # What the engine holds with no request: its scratch window.
    eng.baseline = mgr.snapshot().committed  # type: ignore[attr-defined]
    yield eng
    eng.close()
    snap = mgr.snapshot()
    assert (snap.committed, snap.shared, snap.quarantined) == (0, 0, 0), snap


def _joined(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.tokens]


def _holds_only_the_scratch(eng: Engine) -> None:
    eng.kv.clear_prefixes()
    snap = eng.manager.snapshot()
    assert eng.idle and not eng.running, (eng.waiting, eng.running)
    assert (snap.committed, snap.shared) == (eng.baseline, 0), snap  # type: ignore[attr-defined]


def test_a_steps_metrics_recorded_at_once_are_the_requests_recorded_one_by_one() -> None:
    from kvvm.serving.metrics import EngineMetrics

    one_by_one, at_once = EngineMetrics(), EngineMetrics()
    tokens = [(1, True, 0.2), (3, False, 0.03), (0, False, 0.5), (1, False, 0.008)]
    finished = [("stop", 1.5), ("length", 30.0), ("stop", 0.4)]
    for t in tokens:
        one_by_one.on_tokens(*t)
    for f in finished:
        one_by_one.on_finish(*f)
    at_once.record(tokens, finished)
    assert at_once.render() == one_by_one.render()
    assert at_once.generated_tokens == 5 and at_once.itl.count == 4 and at_once.ttft.count == 1


def test_a_publish_wakes_a_blocked_reader_and_one_with_none_waiting_moves_the_marks() -> None:
    from kvvm.serving.channel import OutputChannel

    ch = OutputChannel()
    ch.publish(1, 0, None)  # nobody waits: the marks move all the same
    assert ch.marks() == (1, 0, None)
    woke: list[tuple[int, int, str | None]] = []

    def reader() -> None:
        ch.wait((1, 0), None)
        woke.append(ch.marks())

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    # Publish only once the reader is blocked in wait() (counted under the channel's lock;
    # the deadline only bounds a broken count).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with ch._cond:  # noqa: SLF001
            if ch._blocked:  # noqa: SLF001
                break
    assert ch._blocked == 1  # noqa: SLF001
    ch.publish(2, 0, "stop")
    t.join(10)
    assert not t.is_alive() and woke == [(2, 0, "stop")]


@pytest.mark.parametrize("readers", [1, 4])
def test_readers_racing_a_publisher_never_miss_a_move(readers: int) -> None:
    """Readers wait (no timeout) while a publisher moves the marks one at a time and skips the
    notification whenever no reader is counted blocked: were a reader ever to block after a
    publish that saw it not counted, it would wait for ever (the join's bound only turns that
    hang into a failure). 200 rounds of 1 or 4 readers and 50 moves, the start ordered by a
    barrier; every other move is published once every reader is blocked."""
    from kvvm.serving.channel import OutputChannel

    for _ in range(200):
        ch = OutputChannel()
        start = threading.Barrier(readers + 1)
        done: list[int] = []

        def reader() -> None:
            start.wait()
            while True:
                tokens, text, reason = ch.marks()
                if reason is not None:
                    done.append(tokens)
                    return
                ch.wait((tokens, text), None)

        threads = [threading.Thread(target=reader, daemon=True) for _ in range(readers)]
        for t in threads:
            t.start()
        start.wait()
        for n in range(1, 51):
            if n % 2 == 0:
                # Every other move waits until every reader is counted blocked (a publish that
                # must wake them); the others race the readers as they come.
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    with ch._cond:  # noqa: SLF001
                        if ch._blocked == readers:  # noqa: SLF001
                            break
            ch.publish(n, 0, "stop" if n == 50 else None)
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads) and done == [50] * readers


def test_the_blocking_stream_steps_the_engine_and_ends_with_the_reason(engine: Engine, models: tuple[object, object]) -> None:
    _, ref = models
    a, b = prompts([9, 14])
    ra = engine.submit(a, 6)
    rb = engine.submit(b, 4)
    deltas = list(engine.stream(ra))
    assert _joined(deltas) == reference(ref, a, 6)
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1) and deltas[-1].finish_reason == "length"
    engine.run()
    assert rb.tokens == reference(ref, b, 4)
    # A finished request's stream gives its whole output at once.
    again = list(engine.stream(rb))
    assert _joined(again) == rb.tokens and again[-1].finish_reason == "length"
    _holds_only_the_scratch(engine)


def test_the_background_loop_serves_threads_async_readers_and_callbacks(engine: Engine, models: tuple[object, object]) -> None:
    _, ref = models
    ps = prompts([5, 11, 17, 8, 23], seed=4)
    called: dict[int, list[Delta]] = {}
    lock = threading.Lock()

    def collect(r: object, delta: Delta) -> None:
        with lock:
            called.setdefault(r.id, []).append(delta)  # type: ignore[attr-defined]

    engine.start()
    got: dict[int, list[int]] = {}
    reqs: dict[int, object] = {}

    def client(i: int) -> None:
        r = engine.submit(ps[i], 5, on_output=collect)
        reqs[i] = r
        got[i] = _joined(list(engine.stream(r)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()

    async def readers() -> list[list[int]]:
        async def one(p: list[int]) -> list[int]:
            r = engine.submit(p, 5)
            return [t for d in [d async for d in engine.astream(r)] for t in d.tokens]

        return list(await asyncio.gather(one(ps[3]), one(ps[4])))

    async_got = asyncio.run(readers())
    for t in threads:
        t.join()
    for i in range(3):
        assert got[i] == reference(ref, ps[i], 5)
        assert _joined(called[reqs[i].id]) == got[i] and called[reqs[i].id][-1].finish_reason == "length"  # type: ignore[attr-defined]
    assert async_got == [reference(ref, ps[3], 5), reference(ref, ps[4], 5)]
    engine.stop()
    assert not engine.background
    _holds_only_the_scratch(engine)


def test_cancel_gives_the_slot_and_its_memory_back_at_once(engine: Engine, models: tuple[object, object]) -> None:
    _, ref = models
    long, other, queued = prompts([30, 12, 7], seed=5)
    r = engine.submit(long, 60)
    s = engine.submit(other, 3)
    for _ in range(3):
        engine.step()
    assert r.slot is not None and len(r.tokens) > 0
    held = engine.manager.snapshot().committed
    w = [engine.submit(queued, 3) for _ in range(3)]  # more than the free slots: the last waits
    stream = engine.stream(r)
    assert engine.cancel(r) is True
    assert r.finish_reason == "cancelled" and r.slot is None and r.id not in {x.id for x in engine.running.values()}
    assert engine.manager.snapshot().committed < held, "its windows went back when cancel returned"
    assert list(stream)[-1].finish_reason == "cancelled"
    assert engine.cancel(r) is False
    assert engine.cancel(w[-1]) is True and w[-1].tokens == []
    engine.run()
    assert s.tokens == reference(ref, other, 3)
    assert all(x.tokens == reference(ref, queued, 3) for x in w[:-1])
    assert engine.stats.cancelled == 2
    _holds_only_the_scratch(engine)


class _RaceOut(TypedDict, total=False):
    """What each thread of a race round hands back."""

    finish: list[int]
    after_first: tuple[Request, list[Delta]]
    at_once: Request


def _race_round(engine: Engine, ps: list[list[int]], want: list[list[int]], round_: int) -> None:
    """Three threads on the running loop: one submits and lets its request finish, one
    cancels its request once its first token arrived, one cancels its request as soon as it
    submitted it (queued, waiting or running: wherever the loop has it then)."""
    barrier = threading.Barrier(3)
    errors: list[BaseException] = []
    out: _RaceOut = {}

    def finish() -> None:
        barrier.wait()
        r = engine.submit(ps[0], 4)
        out["finish"] = _joined(list(engine.stream(r)))

    def after_first() -> None:
        barrier.wait()
        r = engine.submit(ps[1], 40)
        stream = engine.stream(r)
        first = next(stream)
        assert first.tokens, first
        engine.cancel(r)
        rest = list(stream)
        out["after_first"] = (r, rest)

    def at_once() -> None:
        barrier.wait()
        r = engine.submit(ps[2], 40, sampling=SamplingParams(temperature=1.0, seed=round_))
        engine.cancel(r)
        out["at_once"] = r

    def run(body: object) -> None:
        try:
            body()  # type: ignore[operator]
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(f,)) for f in (finish, after_first, at_once)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert out["finish"] == want[0]
    r, rest = out["after_first"]
    assert r.finish_reason in ("cancelled", "length") and r.tokens == want[1][: len(r.tokens)]
    assert rest == [] or rest[-1].finish_reason == r.finish_reason
    q = out["at_once"]
    assert q.finish_reason == "cancelled" and len(q.tokens) < 40


def test_submissions_and_cancellations_race_the_background_loop(engine: Engine, models: tuple[object, object]) -> None:
    _, ref = models
    ps = prompts([6, 13, 9], seed=6)
    want = [reference(ref, ps[0], 4), reference(ref, ps[1], 40)]
    engine.start()
    for i in range(ROUNDS):
        _race_round(engine, ps, want, i)
        engine.stop()  # between rounds: the loop's state is what the next round starts from
        _holds_only_the_scratch(engine)
        engine.start()
    engine.stop()


def test_cancel_from_many_threads_ends_each_request_once(engine: Engine) -> None:
    """Every thread cancels every request at once: each request is cancelled exactly once
    (one ``True``), whatever the order."""
    ps = prompts([8, 10, 12, 14], seed=7)
    engine.start()
    for _ in range(ROUNDS):
        reqs = [engine.submit(p, 30) for p in ps]
        barrier = threading.Barrier(3)
        wins: list[bool] = []
        lock = threading.Lock()

        def cancel_all() -> None:
            barrier.wait()
            mine = [engine.cancel(r) for r in reqs]
            with lock:
                wins.extend(mine)

        threads = [threading.Thread(target=cancel_all) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(wins) == len(reqs) and all(r.finish_reason == "cancelled" for r in reqs)
        for r in reqs:
            assert list(engine.stream(r))[-1].finish_reason == "cancelled"
    engine.stop()
    _holds_only_the_scratch(engine)


def test_a_failing_loop_ends_every_request_with_the_error(models: tuple[object, object]) -> None:
    model, _ = models
    mgr = kvvm.Manager("host", precommit=True)
    engine = Engine(model, slots=2, max_len=64, manager=mgr, compile=False)
    boom = RuntimeError("device lost")

    def fail(out: object, kv: object) -> NoReturn:
        raise boom

    engine.runner.execute = fail  # type: ignore[method-assign]
    reqs = [engine.submit(p, 4) for p in prompts([5, 6, 7])]
    engine.start()
    for r in reqs:
        assert list(engine.stream(r))[-1].finish_reason == "error" and r.error is boom
    with pytest.raises(kvvm.KvvmError, match="device lost"):
        engine.submit([1, 2], 3)
    del engine.runner.execute
    engine.close()
    snap = mgr.snapshot()
    assert (snap.committed, snap.shared) == (0, 0), snap


def test_a_full_queue_refuses_with_backpressure(models: tuple[object, object]) -> None:
    model, _ = models
    engine = Engine(model, slots=1, max_len=64, backend="host", compile=False, max_waiting=2)
    a, b = engine.submit([1, 2, 3], 2), engine.submit([4, 5], 2)
    assert engine.queue_depth == 2
    with pytest.raises(kvvm.BackpressureError, match="max_waiting") as refused:
        engine.submit([6], 2)
    assert refused.value.retry_after > 0
    with pytest.raises(kvvm.BackpressureError):
        engine.submit_n([6], 2, 2)
    engine.step()  # one admitted: room for one more
    c = engine.submit([6], 2)
    engine.run()
    assert all(r.finish_reason == "length" for r in (a, b, c))
    with pytest.raises(kvvm.InvalidArgumentError, match="max_waiting"):
        Engine(model, slots=1, max_len=64, backend="host", max_waiting=0)
    engine.close()
