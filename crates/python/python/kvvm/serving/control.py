"""The engine's controls for callers on other threads (:class:`EngineControl`, a base of
:class:`~kvvm.serving.engine.Engine`): the background loop (:meth:`~EngineControl.start`,
:meth:`~EngineControl.stop`), a request's output as a blocking or an async iterator, and
:meth:`~EngineControl.cancel`.

Thread safety, in one rule: a step holds the engine's lock from its start to its last
publication; :meth:`cancel` and the drain of submitted requests take the same lock, so they
happen between two steps; :meth:`Engine.submit <kvvm.serving.engine.Engine.submit>` only
queues (under a lock of its own) and never waits for a step. Readers read what the loop
published (``stream.py``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..errors import InvalidArgumentError, KvvmError
from .loop import BackgroundLoop
from .output import OutputProcessor
from .request import EngineStats, Request
from .scheduler import Scheduler
from .stream import AsyncTokenStream, TokenStream

__all__ = ["EngineControl"]


class EngineControl:
    """Start, stop, stream and cancel (see the module's text)."""

    if TYPE_CHECKING:
        _lock: threading.RLock
        _loop: BackgroundLoop
        _outputs: OutputProcessor
        scheduler: Scheduler

        @property
        def idle(self) -> bool: ...

        @property
        def stats(self) -> EngineStats: ...

        def step(self) -> int: ...

        def _check_open(self) -> None: ...

        def _drain(self) -> None: ...

    # ---- the background loop ----

    def start(self) -> None:
        """Steps the engine on a thread of its own from now on: submit, stream and cancel
        from any thread. Idempotent."""
        self._check_open()
        if self._loop.error is not None:
            raise KvvmError(f"the engine's loop failed: {self._loop.error!r}") from self._loop.error
        self._loop.start()

    def stop(self) -> None:
        """Stops the background loop after its current step (requests not finished stay
        queued or running; ``start()`` or ``step()`` carries on with them)."""
        self._loop.stop()

    @property
    def background(self) -> bool:
        """Whether the background loop runs."""
        return self._loop.running

    def _loop_step(self) -> bool:
        """One step of the background loop; whether it moved anything."""
        before = (self.stats.admitted, self.stats.finished)
        produced = self.step()
        return produced > 0 or before != (self.stats.admitted, self.stats.finished)

    def _fail_all(self, error: BaseException) -> None:
        """Finishes every request as ``"error"`` after the loop failed (what can be freed is)."""
        with self._lock:
            try:
                self._drain()
            except Exception:  # noqa: BLE001 - the loop has failed already; what is left goes
                pass
            for r in [*self.scheduler.waiting, *self.scheduler.running.values()]:
                r.error = error
                try:
                    self.scheduler.finish(r, "error")
                except Exception:  # noqa: BLE001 - its memory could not be freed; it still ends
                    r.finish_reason = "error"
                self._outputs.publish(r, self.scheduler)

    # ---- a request's output and its end ----

    def cancel(self, request: Request) -> bool:
        """Finishes ``request`` now (``finish_reason == "cancelled"``), waiting or running:
        its slot and its memory are back when this returns (after the step in flight, if
        any); its readers get their last delta. Safe from any thread (not from its own
        ``on_output`` callback's: that runs inside the step). Returns False when it had
        finished already."""
        with self._lock:
            self._drain()
            if not self.scheduler.finish(request, "cancelled"):
                return False
            self.stats.cancelled += 1
            self._outputs.publish(request, self.scheduler)
            return True

    def stream(self, request: Request) -> TokenStream:
        """``request``'s output as a blocking iterator of
        :class:`~kvvm.serving.stream.Delta`: each one holds what was produced since the
        last; the last one carries the finish reason. With the background loop it waits for
        the loop; without, it steps the engine itself (every request advances)."""
        return TokenStream(request, self._drive)

    def astream(self, request: Request) -> AsyncTokenStream:
        """``request``'s output as an async iterator of
        :class:`~kvvm.serving.stream.Delta` (``async for delta in engine.astream(r)``); the
        background loop must run (:meth:`start`): the event loop is never blocked by a
        step."""
        if not self._loop.running:
            raise InvalidArgumentError("astream needs the background loop: call engine.start() first")
        return AsyncTokenStream(request)

    def _drive(self) -> bool:
        """A step for a blocking reader when no background loop runs (False: the loop runs,
        the reader waits for it)."""
        if self._loop.running:
            return False
        if self._loop.error is not None:
            raise KvvmError(f"the engine's loop failed: {self._loop.error!r}") from self._loop.error
        self.step()
        return True
