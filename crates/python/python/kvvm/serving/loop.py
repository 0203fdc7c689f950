"""The engine's background loop (:class:`BackgroundLoop`): a thread that steps the engine while
it has work and sleeps while it is idle, so that callers submit, stream and cancel from any
thread (as transformers' ``ContinuousBatchingManager`` does with ``start()``/``stop()``).

Wake-ups cannot be lost: the loop clears its event *before* it looks at the engine, and a
submission queues its request *before* it sets the event. A step that raises ends the loop:
every request not finished is finished as ``"error"`` (its :attr:`~Request.error` set, its
readers woken) and the engine refuses new requests with that error. Torch-free.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

__all__ = ["BackgroundLoop", "Steppable"]

log = logging.getLogger("kvvm.serving")

#: Seconds the loop sleeps after a step that moved nothing (memory held outside the engine
#: keeps the first waiting request out): it tries again then, or at the next submission.
STALL_WAIT_S = 0.05


class Steppable(Protocol):
    """What the loop needs of the engine."""

    @property
    def idle(self) -> bool: ...

    def _loop_step(self) -> bool:
        """One step; whether it changed anything."""
        ...

    def _fail_all(self, error: BaseException) -> None:
        """Finishes every request as ``"error"``."""
        ...


class BackgroundLoop:
    """Steps ``engine`` on a thread of its own between :meth:`start` and :meth:`stop`."""

    def __init__(self, engine: Steppable) -> None:
        self.engine = engine
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        #: What ended the loop, if a step raised.
        self.error: BaseException | None = None

    @property
    def running(self) -> bool:
        """Whether the thread is stepping (or waiting for work)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Starts the thread (nothing when it runs already)."""
        if self.running:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvvm-engine-loop", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Tells the loop there is work (a submission, a cancellation, a stop)."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Stops the thread after its current step and waits for it (requests not finished
        stay queued or running: :meth:`start` or ``step()`` carries on with them)."""
        thread = self._thread
        if thread is None:
            return
        self._stop = True
        self._wake.set()
        if thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        engine = self.engine
        while not self._stop:
            self._wake.clear()
            if engine.idle:
                self._wake.wait()
                continue
            try:
                moved = engine._loop_step()
            except BaseException as e:  # noqa: BLE001 - every request is told, then the loop ends
                log.exception("the engine's loop failed")
                self.error = e
                engine._fail_all(e)
                return
            if not moved:
                self._wake.wait(STALL_WAIT_S)
