"""A fake KV manager and a fake model runner for the scheduler's tests: no model, no device,
no torch. :class:`FakeKv` keeps kvvm's books in windows exactly (a scratch window held for
good, each slot's own windows, published prefixes billed once and evicted least recently
used when a grant needs them and no slot maps them, refusals for memory now and never), and
checks the contract on every call: a forward writes only into windows committed before it
ran. :class:`FakeRunner` "samples" a token that depends only on the request and the token's
index, so that a request's tokens are the same whatever preemptions recompute it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvvm.errors import BackpressureError, NeverFitsError
from kvvm.serving.request import Request
from kvvm.serving.scheduler import Admission, PrefillRun, RunnerOutput, Scheduler, SchedulerOutput

#: The end token of :class:`FakeRunner`; ordinary tokens are below it.
EOS = 1000


def windows(tokens: int, window: int) -> int:
    return -(-tokens // window)


@dataclass
class _Slot:
    context: list[int]
    committed: int = 0  # windows mapped in the slot, shared ones included
    own: int = 0  # of which its own (not a published prefix's)
    written: int = 0  # tokens the forwards wrote
    pins: list[tuple[int, ...]] = field(default_factory=list)


@dataclass
class _Entry:
    pins: int = 0
    used: int = 0


class FakeKv:
    """A KV manager of ``slots`` slots over ``budget`` windows of ``window`` tokens, the
    scratch slot holding one; with ``unit`` (windows a handle), a prefix cache."""

    def __init__(self, *, slots: int, budget: int, window: int, unit: int | None = None) -> None:
        self._slots = slots
        self.budget = budget
        self.window = window
        self.unit = unit
        self.scratch = 1
        self.table: dict[int, _Slot] = {}
        self.entries: dict[tuple[int, ...], _Entry] = {}
        self.clock = 0
        self.refusals = 0

    # ---- the books ----

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def used(self) -> int:
        unit = self.unit or 0
        return self.scratch + sum(s.own for s in self.table.values()) + unit * len(self.entries)

    def _grant(self, n: int) -> None:
        """``n`` more windows, evicting idle prefixes first; BackpressureError if not."""
        while self.used + n > self.budget and self._evict():
            pass
        if self.used + n > self.budget:
            self.refusals += 1
            raise BackpressureError(f"{n} windows, {self.budget - self.used} free")

    def _evict(self) -> bool:
        """Drops the least recently used prefix entry no slot maps and none extends."""
        idle = [
            k for k, e in self.entries.items()
            if e.pins == 0 and not any(len(o) > len(k) and o[: len(k)] == k for o in self.entries)
        ]
        if not idle:
            return False
        del self.entries[min(idle, key=lambda k: self.entries[k].used)]
        return True

    # ---- what the scheduler asks ----

    def admit(self, slot: int, context: list[int]) -> Admission:
        assert slot not in self.table and 0 <= slot < self._slots, slot
        need = windows(len(context), self.window)
        if need + self.scratch > self.budget:
            raise NeverFitsError(f"{need} windows and the scratch over {self.budget}")
        s = _Slot(list(context))
        hit = self._lookup(s)
        try:
            self._grant(need - s.committed)
        except BackpressureError:
            self._release(s)
            raise
        s.own += need - s.committed
        s.committed = need
        s.written = hit
        self.table[slot] = s
        return Admission(hit)

    def _lookup(self, s: _Slot) -> int:
        """Maps (pins) the longest cached prefix of the slot's context but its last token."""
        if self.unit is None:
            return 0
        tokens = self.unit * self.window
        k = 0
        while tuple(s.context[: (k + 1) * tokens]) in self.entries and (k + 1) * tokens <= len(s.context) - 1:
            k += 1
            key = tuple(s.context[: k * tokens])
            self.clock += 1
            self.entries[key].pins += 1
            self.entries[key].used = self.clock
            s.pins.append(key)
        s.committed = k * self.unit
        return k * tokens

    def shareable(self, published: list[int], context: list[int]) -> int:
        if self.unit is None:
            return 0
        tokens = self.unit * self.window
        n = 0
        while n + tokens <= min(len(published), len(context)) and published[n : n + tokens] == context[n : n + tokens]:
            n += tokens
        return n

    def reserve(self, tokens: dict[int, int]) -> None:
        # Slot by slot in slot order, as SequenceBatch.ensure_each: a refusal may leave the
        # earlier slots grown.
        for slot in sorted(tokens):
            s = self.table[slot]
            need = windows(tokens[slot], self.window)
            if need > s.committed:
                self._grant(need - s.committed)
                s.own += need - s.committed
                s.committed = need

    def free(self, slot: int) -> None:
        self._release(self.table.pop(slot))

    def _release(self, s: _Slot) -> None:
        for key in s.pins:
            self.entries[key].pins -= 1
        s.pins.clear()
        s.own = s.committed = 0

    # ---- what the runner asks ----

    @contextlib.contextmanager
    def prefill(self, run: PrefillRun) -> Iterator[None]:
        for slot in run.slots:
            s = self.table[slot]
            s.written += run.tokens
            assert s.written <= s.committed * self.window, "a prefill wrote past its committed windows"
            assert s.written <= len(s.context)
        yield
        for slot, done in zip(run.slots, run.completing, strict=True):
            s = self.table[slot]
            assert done == (s.written == len(s.context))
            if done:
                self._publish(s)

    def _publish(self, s: _Slot) -> None:
        """The context's whole handles (its last token aside) become cached prefixes, the
        slot's own windows billed once to the cache."""
        if self.unit is None:
            return
        tokens = self.unit * self.window
        for k in range(1, (len(s.context) - 1) // tokens + 1):
            key = tuple(s.context[: k * tokens])
            if key in s.pins or key in self.entries:
                continue
            self.clock += 1
            self.entries[key] = _Entry(pins=1, used=self.clock)
            s.pins.append(key)
            s.own -= self.unit

    def prepare_decode(self, slots: list[int]) -> None:
        for slot in slots:
            s = self.table[slot]
            s.written += 1
            assert s.written <= s.committed * self.window, "a decode step needed a grant at run time"

    # ---- after ----

    def clear_prefixes(self) -> None:
        assert all(e.pins == 0 for e in self.entries.values())
        self.entries.clear()


class FakeRunner:
    """Runs a schedule against :class:`FakeKv`: request ``r``'s ``i``-th token (from 1) is
    :data:`EOS` when ``i == stops.get(r.id)``, else ``token(r.id, i)``."""

    def __init__(self, stops: dict[int, int]) -> None:
        self.stops = stops

    def token(self, r: Request, index: int) -> int:
        if self.stops.get(r.id) == index:
            return EOS
        return (r.id * 31 + index * 7) % EOS

    def execute(self, out: SchedulerOutput, kv: FakeKv) -> RunnerOutput:
        result = RunnerOutput()
        for run in out.prefill:
            with kv.prefill(run):
                pass
            for slot, r, done in zip(run.slots, run.requests, run.completing, strict=True):
                if done:
                    result.first_tokens[slot] = self.token(r, len(r.tokens) + 1)
        if out.decode:
            kv.prepare_decode(out.decode)
            result.decode_tokens = [
                self.token(r, len(r.tokens) + 1 + (slot in result.first_tokens))
                for slot, r in zip(out.decode, out.decode_requests, strict=True)
            ]
        return result


def step(sched: Scheduler, kv: FakeKv, runner: FakeRunner) -> SchedulerOutput:
    """One engine step over the fakes: schedule -> run -> update."""
    out = sched.schedule()
    sched.update(out, runner.execute(out, kv))
    return out


class StepChecks:
    """The scheduling properties that hold at every step, checked around one: a request
    finishes as ``"memory"`` only when its context can never fit (``never_fits``) or when it
    was alone (every other running request preempted in that step); admissions follow the
    line (a request is admitted before one ahead of it only when that one waits for a
    prefix another request is prefilling, and nobody is admitted in a step that preempted);
    requests never admitted wait in the order they arrived."""

    def __init__(self, sched: Scheduler, never_fits: Callable[[list[int]], bool]) -> None:
        self.sched = sched
        self.never_fits = never_fits
        self.running: list[Request] = []
        self.waiting: list[Request] = []

    def before(self) -> None:
        self.running = list(self.sched.running.values())
        self.waiting = list(self.sched.waiting)
        fresh = [r.id for r in self.waiting if r._admitted < 0 and not r.preemptions]
        assert fresh == sorted(fresh), f"requests never admitted wait out of order: {fresh}"

    def after(self, out: SchedulerOutput) -> None:
        preempted = {r.id for r in out.preempted}
        for r in out.finished:
            assert r.finish_reason == "memory"
            if any(r is x for x in self.running):
                others = {x.id for x in self.running if x is not r}
                assert others <= preempted, f"request {r.id} ran out of memory beside {others - preempted}"
            else:
                assert self.never_fits(r._context), f"request {r.id} refused though its context fits"
        if out.preempted:
            assert not out.admitted, "admitted in a step that preempted"
        skipped = {r.id for r in out.passed_over} | {r.id for r in out.finished}
        admitted = [r.id for r in out.admitted]
        for b in admitted:
            ahead = [a.id for a in self.waiting[: next(i for i, x in enumerate(self.waiting) if x.id == b)]]
            for a in ahead:
                assert a in skipped or a in admitted[: admitted.index(b)], (
                    f"request {b} admitted before {a}, which was neither waiting for a prefix nor refused for good"
                )
