"""When the decode kernel's autotuner may measure: a per-thread switch, free of Triton (the
serving engine sets it on CPU-only machines too).

:func:`~kvvm.kernels.triton_decode.tuned_config` times a few configurations the first time
it meets a shape, compiling each: seconds, worth it for a step a captured graph replays
thousands of times. A call that runs once does not repay it: a serving engine's prefill
forward of one token a row (a request swapped back in, or a context one token past a whole
chunk) would stop every request of the engine while each new batch size is timed. Inside
:func:`untuned`, the tuner measures nothing on this thread: a shape it tuned before gets
that configuration, any other the heuristic one, and nothing is remembered.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["tuning_allowed", "untuned"]

_STATE = threading.local()


def tuning_allowed() -> bool:
    """Whether the autotuner may measure a new shape on this thread now (outside
    :func:`untuned`)."""
    return not getattr(_STATE, "untuned", False)


@contextlib.contextmanager
def untuned() -> Iterator[None]:
    """Within the block, on this thread only, the decode kernel's autotuner measures nothing
    (see the module's text). Nests; the switch is as it was after the block."""
    before = getattr(_STATE, "untuned", False)
    _STATE.untuned = True
    try:
        yield
    finally:
        _STATE.untuned = before
