"""Responses that end the requests of a client that went away: :class:`EventStream` (server-sent
events) and :func:`until_disconnect` (a plain response's wait).

Both watch the ASGI ``receive`` channel for ``http.disconnect`` while the engine works: a
client that closes its connection has its requests cancelled at once (their slots and memory
back), not when the next token fails to be written.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["EventStream", "merge", "until_disconnect"]

T = TypeVar("T")


async def _disconnected(receive: Receive) -> None:
    """Returns once the client disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Awaits ``work`` unless the client disconnects first: ``(True, result)``, or ``(False,
    None)`` with ``work`` cancelled."""
    result: list[T] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            result.append(await work)
            tg.cancel_scope.cancel()

        async def watch() -> None:
            await _disconnected(receive)
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(watch)
    return (True, result[0]) if result else (False, None)


class EventStream(Response):
    """``text/event-stream`` of ``events`` (each already ``data: ...\\n\\n``); ``on_close`` runs
    once the stream ended, whether it finished, the client disconnected or writing failed
    (shielded from cancellation)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    await _disconnected(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                try:
                    await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                    async for event in self.events:
                        await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:
                    pass  # the client is gone: on_close cancels what is left
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.events, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self.on_close()


async def merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """The items of several async iterators as they come, each with its iterator's index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    pending: dict[asyncio.Task[Any], int] = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield i, item
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
