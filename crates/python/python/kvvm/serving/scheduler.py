"""The scheduler of the serving engine: each step, which requests run and how many tokens,
decided from the requests' state and what the KV manager answers about memory. No model, no
device, no torch: it is tested with a fake KV manager and a fake runner
(``tests/test_scheduler.py``).

The contract of one step (``docs/engine.md``)::

    out = scheduler.schedule()            # SchedulerOutput: prefill runs, decode slots
    result = runner.execute(out, kv)      # RunnerOutput: the tokens sampled
    produced = scheduler.update(out, result)

:meth:`Scheduler.schedule`, in order:

1. **Growth of the decoding requests.** Each decoding request needs its next token's
   windows: the KV manager reserves them all at once (:meth:`KvSpace.reserve`). When it
   refuses, the youngest running request (the last admitted, whether decoding or
   prefilling) is preempted: its slot is freed and it goes back first in line, the tokens it
   generated appended to its context (recomputed when it is admitted again); then the
   reservation is tried again. A request alone in the batch that still cannot grow finishes
   as ``"memory"``: that is the only way a request that was admitted finishes so.
2. **Admission**, in a step that preempted nobody: waiting requests in order of arrival
   (preempted ones first, oldest first) take free slots while the KV manager admits them
   (their whole context committed, a cached prefix of it mapped). A refusal for memory
   now stops admission for this step (the request stays first in line); a context that can
   never fit the budget, whatever is freed, finishes as ``"memory"`` without running (it
   never holds up the line). The one exception to the order: a request whose context opens
   with a prefix that a request still prefilling will publish, and that it could map then,
   waits for that publication and is passed over meanwhile (``prefix_waits``), so that
   requests arriving together with one system prompt prefill it once.
3. **Growth of the requests whose prefill ends this step**: their first token comes from
   the prefill, their second from this step's decode, whose token is reserved where memory
   allows without preempting anyone (else the request decodes from the next step, as in 1;
   a request its first token finishes never needs it).
4. **Prefill runs**: each request still prefilling gets its next chunk of at most
   ``prefill_chunk`` tokens; requests in consecutive slots whose chunks have one length form
   one run (one forward) of at most ``prefill_batch_tokens`` tokens.

:meth:`Scheduler.update` then appends the sampled tokens (a request whose prefill ended gets
its first token from the prefill, and, in the same step, its second from the decode),
finishes requests at an end token, at ``max_new_tokens`` or at the cache's length, and frees
their slots.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import BackpressureError, NeverFitsError
from .request import EngineStats, Request
from .channel import TokenLogprob

__all__ = ["Admission", "KvSpace", "PrefillRun", "RunnerOutput", "Scheduler", "SchedulerOutput"]


@dataclass(frozen=True)
class Admission:
    """What the KV manager did to admit a request: ``hit_tokens`` of its context mapped from
    the prefix cache (not to be prefilled), and the host time the lookup and commit took;
    ``swapped``: those tokens were swapped back in from the host, not found in the prefix
    cache; ``host_tokens``: of ``hit_tokens``, those copied back from the prefix cache's host
    level."""

    hit_tokens: int = 0
    ms: float = 0.0
    swapped: bool = False
    host_tokens: int = 0


class KvSpace(Protocol):
    """What the scheduler asks of the KV manager (:class:`~kvvm.serving.kv_manager.KvManager`,
    or a fake in tests). Every answer about memory comes from here."""

    @property
    def slots(self) -> int:
        """Requests that can run at once."""
        ...

    def admit(self, slot: int, context: list[int]) -> Admission:
        """Makes ``slot`` hold ``context``: a cached prefix of it mapped, the rest committed.
        Raises :class:`~kvvm.errors.BackpressureError` (not now; the slot is left free) or
        :class:`~kvvm.errors.NeverFitsError` (never, even alone)."""
        ...

    def shareable(self, published: list[int], context: list[int]) -> int:
        """Tokens of ``context`` a request could map once ``published`` (another request's
        context) is published (0 without a prefix cache)."""
        ...

    def reserve(self, tokens: dict[int, int]) -> None:
        """Makes each slot's first ``tokens[slot]`` tokens committed, all or nothing as far
        as the scheduler can tell. Raises :class:`~kvvm.errors.BackpressureError`."""
        ...

    def free(self, slot: int) -> None:
        """Releases the slot's memory; the slot is free for another request."""
        ...


@dataclass
class PrefillRun:
    """Requests in consecutive ``slots`` whose next chunk has ``tokens`` tokens: one forward.
    ``completing[i]``: the chunk ends request ``i``'s context (its first token is sampled)."""

    slots: list[int]
    tokens: int
    requests: list[Request]
    completing: list[bool]


@dataclass
class SchedulerOutput:
    """What one step runs, and what the schedule decided on the way."""

    #: Prefill forwards, in slot order.
    prefill: list[PrefillRun] = field(default_factory=list)
    #: Slots that decode one token this step (their windows reserved), and their requests.
    decode: list[int] = field(default_factory=list)
    decode_requests: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    #: Requests passed over at admission: they wait for a prefix another is prefilling.
    passed_over: list[Request] = field(default_factory=list)
    #: Requests finished by the schedule itself (``"memory"``).
    finished: list[Request] = field(default_factory=list)

    def scheduled_tokens(self) -> dict[int, int]:
        """Tokens each request (by id) runs this step: its prefill chunk, plus one when it
        decodes."""
        n: dict[int, int] = collections.Counter()
        for run in self.prefill:
            for r in run.requests:
                n[r.id] += run.tokens
        for r in self.decode_requests:
            n[r.id] += 1
        return dict(n)


@dataclass
class RunnerOutput:
    """What the runner sampled: the first token of each request whose prefill ended this step
    (by slot) and one token per decode slot (in :attr:`SchedulerOutput.decode`'s order); with
    each, for the requests that ask for them, its log-probabilities (by slot, and one entry
    or None per decode slot; empty when no request of the step asks)."""

    first_tokens: dict[int, int] = field(default_factory=dict)
    decode_tokens: list[int] = field(default_factory=list)
    first_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    decode_logprobs: list[TokenLogprob | None] = field(default_factory=list)


class Scheduler:
    """Decides each step of the engine (see the module's text).

    Args:
        kv: the KV manager.
        max_len: the most tokens a request may reach (prompt + generated).
        prefill_chunk: context tokens prefilled per request and step.
        prefill_batch_tokens: the most tokens one prefill forward takes.
    """

    def __init__(self, kv: KvSpace, *, max_len: int, prefill_chunk: int, prefill_batch_tokens: int) -> None:
        self.kv = kv
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.prefill_batch_tokens = prefill_batch_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        #: Running requests by slot, in order of admission.
        self.running: dict[int, Request] = {}
        self.stats = EngineStats()
        self._order = itertools.count()

    def add(self, r: Request) -> None:
        """Queues a request (checked already) last in line."""
        self.waiting.append(r)

    @property
    def idle(self) -> bool:
        """Whether nothing waits and nothing runs."""
        return not self.waiting and not self.running

    # ---- schedule ----

    def schedule(self) -> SchedulerOutput:
        """This step's work: growth (and preemptions), admissions, prefill runs, decode slots."""
        self.stats.steps += 1
        out = SchedulerOutput()
        decode = self._grow_decoding(out)
        if not out.preempted:
            self._admit(out)
        decode |= self._grow_prefilled()
        out.prefill = self._prefill_runs()
        out.decode = [s for s in self.running if s in decode]
        out.decode_requests = [self.running[s] for s in out.decode]
        return out

    def _grow_decoding(self, out: SchedulerOutput) -> set[int]:
        """Reserves the next token of every decoding request (its cache then holds its
        prompt and every token it generated but the last, which this step writes),
        preempting the youngest running request until the KV manager grants them all."""
        while True:
            # A running request decodes once its context is all in the cache (``prefilled``).
            targets = {
                s: len(r.prompt) + len(r.tokens) for s, r in self.running.items() if r._filled >= len(r._context)
            }
            if not targets:
                return set()
            if self._reserve(targets):
                return set(targets)
            self._make_room(out)

    def _grow_prefilled(self) -> set[int]:
        """Reserves, where memory allows without preempting anyone, the decode token of each
        request whose prefill ends this step (its first token comes from the prefill, its
        second from this step's decode); one that gets none decodes from the next step, and
        one that its first token finishes never needs it."""
        targets = {}
        for s, r in self.running.items():
            if not 0 < len(r._context) - r._filled <= self.prefill_chunk:
                continue  # decoding, or its prefill does not end this step
            generated = len(r.tokens) + 1
            if generated < r.max_new_tokens and len(r.prompt) + generated < self.max_len:
                targets[s] = len(r.prompt) + generated
        if not targets or self._reserve(targets):
            return set(targets)
        return {s for s, t in targets.items() if self._reserve({s: t})}

    def _reserve(self, targets: dict[int, int]) -> bool:
        """Asks the KV manager for every slot's target at once; False (nothing reserved) when
        the budget refuses them."""
        try:
            self.kv.reserve(targets)
        except BackpressureError:
            return False
        return True

    def _make_room(self, out: SchedulerOutput) -> None:
        """Preempts the youngest running request, or finishes it as ``"memory"`` when it is
        alone (nothing else holds memory the engine could free)."""
        slot, r = max(self.running.items(), key=lambda item: item[1]._admitted)
        if len(self.running) == 1:
            self._finish(slot, r, "memory")
            out.finished.append(r)
            return
        self.running.pop(slot)
        self._vacate(slot, r)
        r.slot, r._filled, r.preemptions = None, 0, r.preemptions + 1
        r._context = r.prompt + r.tokens
        self.waiting.appendleft(r)
        self.stats.preempted += 1
        out.preempted.append(r)

    def _admit(self, out: SchedulerOutput) -> None:
        """Admits waiting requests in order into free slots until memory refuses one (see the
        module's text for the prefix waits and the contexts that never fit)."""
        if not self.waiting:
            return
        free = [i for i in range(self.kv.slots) if i not in self.running]
        for r in list(self.waiting):
            if not free:
                return
            if self._waits_for_prefill(r):
                self.stats.prefix_waits += 1
                out.passed_over.append(r)
                continue
            slot = free[0]
            try:
                admission = self._admit_one(slot, r)
            except BackpressureError:
                self.stats.admission_refusals += 1
                return
            except NeverFitsError:
                self.waiting.remove(r)
                r.finish_reason = "memory"
                self.stats.finished += 1
                out.finished.append(r)
                continue
            self.waiting.remove(r)
            free.pop(0)
            self._start(slot, r, admission)
            out.admitted.append(r)

    def _vacate(self, slot: int, r: Request) -> None:
        """Frees a preempted request's slot: its context is computed again at its next
        admission (a :class:`~kvvm.serving.swap.SwapScheduler` may swap it out instead)."""
        self.kv.free(slot)

    def _admit_one(self, slot: int, r: Request) -> Admission:
        """Admits ``r`` into the free ``slot`` (raises what :meth:`KvSpace.admit` raises)."""
        return self.kv.admit(slot, r._context)

    def _start(self, slot: int, r: Request, admission: Admission) -> None:
        hit = admission.hit_tokens
        r.slot, r._filled, r._admitted = slot, hit, next(self._order)
        r.prefix_hit_tokens = hit
        self.running[slot] = r
        self.stats.admitted += 1
        if hit and not admission.swapped:
            self.stats.prefix_hits += 1
            self.stats.prefix_hit_tokens += hit
            self.stats.prefix_hit_ms.append((hit, admission.ms))
            if admission.host_tokens:
                self.stats.prefix_host_hits += 1
                self.stats.prefix_host_hit_tokens += admission.host_tokens

    def _waits_for_prefill(self, r: Request) -> bool:
        """Whether a request still prefilling will publish more of ``r``'s context than it
        found cached itself (what ``r`` could map once it is published, and cannot map now).
        The last token is always computed (its logits give the first new token)."""
        mine = r._context[:-1]
        return any(
            self.kv.shareable(other._context, mine) > other.prefix_hit_tokens
            for other in self.running.values()
            if other._filled < len(other._context)
        )

    def _prefill_runs(self) -> list[PrefillRun]:
        """The requests still prefilling as runs of consecutive slots whose next chunk has
        the same length, each of at most ``prefill_batch_tokens`` tokens (one row at least)."""
        chunks = sorted(
            (slot, min(r.remaining_prefill, self.prefill_chunk))
            for slot, r in self.running.items()
            if r._filled < len(r._context)
        )
        runs: list[PrefillRun] = []
        for slot, n in chunks:
            r = self.running[slot]
            last = runs[-1] if runs else None
            if (
                last is not None
                and last.tokens == n
                and last.slots[-1] == slot - 1
                and (len(last.slots) + 1) * n <= self.prefill_batch_tokens
            ):
                run = last
            else:
                run = PrefillRun([], n, [], [])
                runs.append(run)
            run.slots.append(slot)
            run.requests.append(r)
            run.completing.append(r.remaining_prefill <= n)
        return runs

    # ---- update ----

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> int:
        """Takes the step's results: prefill progress, each token sampled (the first tokens,
        then the decode's), finished requests' slots freed. Returns the tokens generated."""
        produced = 0
        for run in out.prefill:
            self.stats.prefill_chunks += len(run.slots)
            self.stats.prefill_forwards += 1
            for slot, r, completing in zip(run.slots, run.requests, run.completing, strict=True):
                r._filled += run.tokens
                if completing:
                    produced += self._accept(slot, r, result.first_tokens[slot], result.first_logprobs.get(slot))
        lps = result.decode_logprobs or [None] * len(out.decode)
        decoded = 0
        for slot, r, token, lp in zip(out.decode, out.decode_requests, result.decode_tokens, lps, strict=True):
            # A request its first token finished (an end token) takes no decode token.
            if r.finish_reason is None:
                decoded += 1
                produced += self._accept(slot, r, token, lp)
        if decoded:
            self.stats.decode_steps += 1
        return produced

    def _accept(self, slot: int, r: Request, token: int, logprob: TokenLogprob | None = None) -> int:
        """Appends ``token`` (and its log-probabilities, when the request asks for them) to
        the request; finishes it on an end token, at its limit or at the cache's length."""
        if logprob is not None:
            r.logprobs.append(logprob)
        r.tokens.append(token)
        self.stats.generated_tokens += 1
        if token in r.eos:
            self._finish(slot, r, "stop")
        elif len(r.tokens) >= r.max_new_tokens or len(r.prompt) + len(r.tokens) >= self.max_len:
            self._finish(slot, r, "length")
        return 1

    def finish(self, r: Request, reason: str) -> bool:
        """Finishes ``r`` now with ``reason`` wherever it is: a waiting request leaves the
        line, a running one gives its slot back (its memory released at once). Between steps
        only. Returns False when it had finished already."""
        if r.done:
            return False
        if r.slot is not None and self.running.get(r.slot) is r:
            self._finish(r.slot, r, reason)
            return True
        try:
            self.waiting.remove(r)
        except ValueError:
            return False
        r.finish_reason = reason
        self.stats.finished += 1
        return True

    def _finish(self, slot: int, r: Request, reason: str) -> None:
        r.finish_reason = reason
        r.slot = None
        self.running.pop(slot, None)
        self.kv.free(slot)
        self.stats.finished += 1
