"""When the kernels' autotuners may measure (a per-thread switch, free of Triton: the serving
engine sets it on CPU-only machines too), and how they time a candidate (:func:`graph_time`).

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
import math
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

__all__ = ["cold_copies", "graph_time", "may_time", "tuning_allowed", "untuned"]

C = TypeVar("C")

#: Calls per captured graph when a configuration is timed.
_REPEATS = 10

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


def may_time() -> bool:
    """Whether a tuner may time a candidate now: tuning is allowed on this thread, and no
    graph is being captured and no compiler traces (nothing may run for timing then)."""
    return tuning_allowed() and not torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling()


def graph_time(call: Callable[[C], object], config: C) -> float:
    """The GPU time of one ``call(config)`` (ms), as a captured graph replays it: calls
    launched one by one would time the host's launches (a kernel's and its allocations),
    which a replay does not pay. Runs it once first (compiling it). The call must be
    harmless to repeat (a decode step's token written again: the same values at the same
    place)."""
    call(config)
    graph = torch.cuda.CUDAGraph()
    # Thread-local: another thread's driver calls (the pre-committer's) are not this capture's.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(_REPEATS):
            call(config)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    try:
        graph.replay()
        for _ in range(2):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / _REPEATS)
    finally:
        graph.reset()
    return best


def cold_copies(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` and copies of it, for a timed call to read each repeat from a different one: as
    many as make their bytes together at least twice the device's L2 cache (at most one a
    repeat of :func:`graph_time`), so that no repeat finds the last one's bytes in the cache,
    as a decode step never finds a weight there (a step reads every other weight between two
    reads of one). On a CPU, ``t`` alone."""
    if not t.is_cuda:
        return [t]
    l2 = torch.cuda.get_device_properties(t.device).L2_cache_size
    copies = min(_REPEATS, max(1, math.ceil(2 * l2 / max(1, t.numel() * t.element_size()))))
    return [t] + [t.clone() for _ in range(copies - 1)]
