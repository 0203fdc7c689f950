"""A request's output as it is generated: what the engine's loop publishes after each step
(:class:`OutputChannel`) and what a consumer reads from it (:class:`Delta`), as a blocking
iterator (:class:`TokenStream`) or an async one (:class:`AsyncTokenStream`).

The engine's loop appends a request's tokens, log-probabilities and text, then publishes how
far they go (:meth:`OutputChannel.publish`, under the channel's lock) and wakes its readers.
A reader takes everything up to the published marks only, so that it never sees a token
without its log-probability, or text past a stop string the loop has not cut yet. Several
tokens published before a reader woke come as one delta.

Torch-free.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .request import Request

__all__ = ["AsyncTokenStream", "Delta", "OutputChannel", "TokenLogprob", "TokenStream"]


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (the log-softmax of its logits,
    before temperature, penalties and truncation) and, when asked, the likeliest tokens and
    theirs (``top``: ``(token id, logprob)``, likeliest first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    """What a request produced since the reader's last delta: its new tokens (with their
    log-probabilities when asked), its new text (when the engine detokenizes it), and its
    finish reason once it finished (the last delta)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class OutputChannel:
    """The published marks of one request's output and the readers waiting on them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: Tokens, text characters and the finish reason published so far.
        self.tokens = 0
        self.text = 0
        self.finish_reason: str | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def publish(self, tokens: int, text: int, finish_reason: str | None) -> None:
        """Moves the marks (the engine's loop, after it appended what they cover) and wakes
        every reader."""
        with self._cond:
            self.tokens, self.text, self.finish_reason = tokens, text, finish_reason
            self._cond.notify_all()
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
                self._cond.wait(timeout)

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


class _Cursor:
    """How far a reader has read one request."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.tokens = 0
        self.text = 0
        self.done = False

    def take(self) -> Delta | None:
        """The delta up to the published marks (None when there is nothing new and the
        request has not finished); after the last delta, StopIteration's business."""
        r = self.request
        tokens, text, finish = r.channel.marks()
        if tokens == self.tokens and text == self.text and finish is None:
            return None
        delta = Delta(
            tokens=r.tokens[self.tokens : tokens],
            text=r.text[self.text : text],
            logprobs=r.logprobs[self.tokens : tokens] if r.sampling.logprobs else [],
            finish_reason=finish,
        )
        self.tokens, self.text, self.done = tokens, text, finish is not None
        return delta


class TokenStream(Iterator[Delta]):
    """A request's deltas as a blocking iterator (:meth:`Engine.stream
    <kvvm.serving.engine.Engine.stream>`): each ``next`` returns what was produced since the
    last one, waiting for it; the last delta carries the finish reason. ``drive``, when the
    engine has no background loop, is called instead of waiting (it steps the engine)."""

    def __init__(self, request: Request, drive: Callable[[], bool] | None) -> None:
        self._cursor = _Cursor(request)
        self._drive = drive

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> Delta:
        cursor = self._cursor
        while not cursor.done:
            delta = cursor.take()
            if delta is not None:
                return delta
            if self._drive is None or not self._drive():
                cursor.request.channel.wait((cursor.tokens, cursor.text), 0.5)
        raise StopIteration


class AsyncTokenStream(AsyncIterator[Delta]):
    """A request's deltas as an async iterator (:meth:`Engine.astream
    <kvvm.serving.engine.Engine.astream>`), woken by the engine's background loop through
    the event loop (never blocking it)."""

    def __init__(self, request: Request) -> None:
        self._cursor = _Cursor(request)

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> Delta:
        cursor = self._cursor
        while not cursor.done:
            delta = cursor.take()
            if delta is not None:
                return delta
            await cursor.request.channel.waiter((cursor.tokens, cursor.text))
        raise StopAsyncIteration


def deliver(request: Request, cursor: Any) -> None:
    """Hands ``request``'s new delta to its ``on_output`` callback (the engine's loop)."""
    if request.on_output is None:
        return
    delta = cursor.take()
    if delta is not None:
        request.on_output(request, delta)


def callback_cursor(request: Request) -> _Cursor:
    """A cursor of the callback's own (see :func:`deliver`)."""
    return _Cursor(request)
