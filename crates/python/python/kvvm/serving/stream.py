"""A request's output as it is generated, as its readers take it: what the engine's loop
published after each step (:class:`~kvvm.serving.channel.OutputChannel`) in :class:`Delta`
objects, from a blocking iterator (:class:`TokenStream`), an async one
(:class:`AsyncTokenStream`) or a callback (:func:`deliver`).

A reader takes everything up to the published marks only, so that it never sees a token
without its log-probability, or text past a stop string the loop has not cut yet. Several
tokens published before a reader woke come as one delta.

Torch-free.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .channel import TokenLogprob
from .request import Request

__all__ = ["AsyncTokenStream", "Delta", "TokenStream", "callback_cursor", "deliver"]


@dataclass(frozen=True)
class Delta:
    """What a request produced since the reader's last delta: its new tokens (with their
    log-probabilities when asked), its new text (when the engine detokenizes it), and its
    finish reason once it finished (the last delta)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


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
