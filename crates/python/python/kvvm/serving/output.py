"""What the engine does with a step's tokens once the scheduler took them
(:class:`OutputProcessor`): each request's text and stop strings, the metrics, the
publication to its readers and its callback.

It runs on the engine's loop, under the engine's lock, after :meth:`Scheduler.update
<kvvm.serving.scheduler.Scheduler.update>`: a stop string found finishes the request there
and then (its slot and memory back before the next step). Torch-free.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .metrics import EngineMetrics
from .request import Request
from .scheduler import Scheduler, SchedulerOutput
from .stream import callback_cursor, deliver
from .text import Detokenizer

__all__ = ["OutputProcessor", "touched"]

log = logging.getLogger("kvvm.serving")


def touched(out: SchedulerOutput) -> list[Request]:
    """The requests a step may have changed: those that took a token or finished."""
    if not out.prefill and not out.finished:
        return list(out.decode_requests)  # one per decode slot: no request twice
    seen: dict[int, Request] = {}
    for run in out.prefill:
        for r, done in zip(run.requests, run.completing, strict=True):
            if done:
                seen[r.id] = r
    for r in [*out.decode_requests, *out.finished]:
        seen[r.id] = r
    return list(seen.values())


class OutputProcessor:
    """Per request: its detokenizer, its callback's cursor; and the engine's metrics."""

    def __init__(self, tokenizer: Any, metrics: EngineMetrics) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._detok: dict[int, Detokenizer] = {}
        self._cursors: dict[int, Any] = {}

    def register(self, r: Request) -> None:
        """Takes a new request (at submission): its detokenizer and callback cursor."""
        r.submitted_at = time.monotonic()
        if r.detokenize and self.tokenizer is not None:
            self._detok[r.id] = Detokenizer(self.tokenizer, r.prompt, r.sampling.stop)
        if r.on_output is not None:
            self._cursors[r.id] = callback_cursor(r)
        self.metrics.on_submit(len(r.prompt))

    def after_step(self, requests: list[Request], scheduler: Scheduler) -> None:
        """Publishes each request the step changed (see :meth:`publish`): one clock reading
        and one metrics update for the whole step, each request's metrics recorded before
        its marks move."""
        self._publish_all(requests, scheduler, time.monotonic())

    def publish(self, r: Request, scheduler: Scheduler) -> None:
        """Its new text (a stop string finishes it now), its metrics, then the marks its
        readers see, then its callback."""
        self._publish_all([r], scheduler, time.monotonic())

    def _publish_all(self, requests: list[Request], scheduler: Scheduler, now: float) -> None:
        """:meth:`publish` of ``requests`` at ``now``: the text and metrics of all of them
        first (the metrics in one update), then each one's marks and callback."""
        tokens: list[tuple[int, bool, float]] = []
        finished: list[tuple[str, float]] = []
        texts = [self._text(r, scheduler) for r in requests] if self._detok else [0] * len(requests)
        for r in requests:
            seen = r.channel.tokens
            if len(r.tokens) > seen:
                first = seen == 0
                tokens.append((len(r.tokens) - seen, first, now - (r.submitted_at if first else r.last_token_at)))
                r.last_token_at = now
            if r.finish_reason is not None:
                finished.append((r.finish_reason, now - r.submitted_at))
        self.metrics.record(tokens, finished)
        for r, text in zip(requests, texts, strict=True):
            r.channel.publish(len(r.tokens), text, r.finish_reason)
            if self._cursors:
                self._deliver(r)

    def _text(self, r: Request, scheduler: Scheduler) -> int:
        """Detokenizes ``r``'s new tokens (a stop string finishes it now); returns how much
        of its text may be published (0 when it has no detokenizer)."""
        d = self._detok.get(r.id)
        if d is None:
            return 0
        if len(r.tokens) > d.added:
            if d.add(r.tokens[d.added :]):
                if not scheduler.finish(r, "stop"):
                    r.finish_reason = "stop"
            r.text = d.text
        if r.done:
            self._detok.pop(r.id, None)
        return d.safe_length(r.done)

    def _deliver(self, r: Request) -> None:
        """Hands ``r``'s new delta to its callback, if it has one."""
        cursor = self._cursors.get(r.id)
        if cursor is None:
            return
        try:
            deliver(r, cursor)
        except Exception:  # noqa: BLE001 - a caller's callback never fails the step of others
            log.exception("the on_output callback of request %d raised", r.id)
        if r.done:
            self._cursors.pop(r.id, None)
