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
        """Publishes each request the step changed (see :meth:`publish`)."""
        for r in requests:
            self.publish(r, scheduler)

    def publish(self, r: Request, scheduler: Scheduler) -> None:
        """Its new text (a stop string finishes it now), its metrics, then the marks its
        readers see, then its callback."""
        d = self._detok.get(r.id)
        if d is not None and len(r.tokens) > d.added:
            if d.add(r.tokens[d.added :]):
                if not scheduler.finish(r, "stop"):
                    r.finish_reason = "stop"
            r.text = d.text
        count = len(r.tokens)
        new = count - r.channel.tokens
        now = time.monotonic()
        if new > 0:
            first = r.channel.tokens == 0
            self.metrics.on_tokens(new, first, now - (r.submitted_at if first else r.last_token_at))
            r.last_token_at = now
        text = d.safe_length(r.done) if d is not None else 0
        if r.done:
            self.metrics.on_finish(str(r.finish_reason), now - r.submitted_at)
            self._detok.pop(r.id, None)
        r.channel.publish(count, text, r.finish_reason)
        cursor = self._cursors.get(r.id)
        if cursor is not None:
            try:
                deliver(r, cursor)
            except Exception:  # noqa: BLE001 - a caller's callback never fails the step of others
                log.exception("the on_output callback of request %d raised", r.id)
            if r.done:
                self._cursors.pop(r.id, None)
