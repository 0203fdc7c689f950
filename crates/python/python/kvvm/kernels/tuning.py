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

__all__ = ["cold_copies", "graph_time", "may_time", "scrub_buffer", "tuning_allowed", "untuned"]

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


def graph_time(call: Callable[[C], object], config: C, *, cold: bool = False) -> float:
    """The GPU time of one ``call(config)`` (ms), as a captured graph replays it: calls
    launched one by one would time the host's launches (a kernel's and its allocations),
    which a replay does not pay. Runs it once first (compiling it). The call must be
    harmless to repeat (a decode step's token written again: the same values at the same
    place).

    ``cold``: each repeat comes after a read of a buffer twice the size of the device's L2
    cache (:func:`scrub_buffer`), and that read's own time, replayed alone the same way, is
    taken off: no repeat finds the bytes of the one before in the cache, as a decode step's
    attention never finds its layer's K/V there (the step reads the layer's weights between).
    Repeated over bytes the cache holds, a call is timed at the cache's speed, and the
    configuration that suits the cache is chosen (measured on an H100: the cascade's private
    pass over 64 MiB a layer tuned warm took 1.45 ms a step in the step, where another
    configuration took 1.13)."""
    call(config)
    if not cold:
        return _replayed(lambda: call(config))
    scrub = scrub_buffer(torch.cuda.current_device())
    both = _replayed(lambda: (scrub.sum(), call(config)))
    alone = _replayed(scrub.sum)
    return max(both - alone, 0.0)


def _replayed(body: Callable[[], object]) -> float:
    """The GPU time of one ``body()`` (ms): the best of two replays of a graph capturing it
    :data:`_REPEATS` times."""
    graph = torch.cuda.CUDAGraph()
    # Thread-local: another thread's driver calls (the pre-committer's) are not this capture's.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(_REPEATS):
            body()
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


def scrub_buffer(device: int | torch.device) -> torch.Tensor:
    """A zeroed fp32 buffer of twice the L2 cache of CUDA device ``device``, read between
    :func:`graph_time`'s cold repeats; made anew for each timing and dropped after it (its
    bytes stay in torch's caching allocator for the process's later tensors, as the timed
    call's own allocations do)."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return torch.zeros(max(1, 2 * l2 // 4), dtype=torch.float32, device=device)


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
