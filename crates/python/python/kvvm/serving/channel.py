"""What the engine's loop publishes of a request after each step: its tokens' log-probabilities
(:class:`TokenLogprob`) and how far its output goes (:class:`OutputChannel`), which the readers
of :mod:`kvvm.serving.stream` wait on.

The engine's loop appends a request's tokens, log-probabilities and text, then publishes how
far they go (:meth:`OutputChannel.publish`, under the channel's lock) and wakes its readers.

Torch-free.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

__all__ = ["OutputChannel", "TokenLogprob"]


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (the log-softmax of its logits,
    before temperature, penalties and truncation) and, when asked, the likeliest tokens and
    theirs (``top``: ``(token id, logprob)``, likeliest first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class OutputChannel:
    """The published marks of one request's output and the readers waiting on them."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        #: Tokens, text characters and the finish reason published so far.
        self.tokens = 0
        self.text = 0
        self.finish_reason: str | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        #: Threads blocked in :meth:`wait` (counted under the lock: a publish with none to
        #: wake skips the notification).
        self._blocked = 0

    def publish(self, tokens: int, text: int, finish_reason: str | None) -> None:
        """Moves the marks (the engine's loop, after it appended what they cover) and wakes
        every reader."""
        with self._lock:  # the condition's own lock (entered without its Python wrapper)
            self.tokens, self.text, self.finish_reason = tokens, text, finish_reason
            if self._blocked:
                self._cond.notify_all()
            if not self._waiters:
                return
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_wake, fut)

    def marks(self) -> tuple[int, int, str | None]:
        """The published marks, read together."""
        with self._cond:
            return self.tokens, self.text, self.finish_reason

    def wait(self, seen: tuple[int, int], timeout: float | None) -> None:
        """Blocks until the marks moved past ``seen`` (tokens, text), the request finished, or
        ``timeout`` seconds passed."""
        with self._cond:
            if (self.tokens, self.text) == seen and self.finish_reason is None:
                self._blocked += 1
                try:
                    self._cond.wait(timeout)
                finally:
                    self._blocked -= 1

    def waiter(self, seen: tuple[int, int]) -> asyncio.Future[None]:
        """A future of the running event loop, done once the marks moved past ``seen`` or the
        request finished (at once when they already did)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if (self.tokens, self.text) != seen or self.finish_reason is not None:
                fut.set_result(None)
            else:
                self._waiters.append((loop, fut))
        return fut


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
