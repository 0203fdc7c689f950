"""What the device offers the kernels' launches: the multiprocessors their programs spread
over (how many splits a decode takes, how many programs walk the cascade's prefix work), a
second stream for a pass that runs beside another (:func:`second_stream`), and whether they
may launch as programmatic dependents.

A programmatic dependent launch (Hopper on: compute capability 9 or more) lets a kernel's
programs start while the kernel before it in the stream finishes: each waits
(``griddepcontrol.wait``) for that kernel's completion and memory before it reads or writes
anything, and lets the next kernel launch once its own main loop is done. Between the small
kernels of a decode step, that hides part of each launch's latency. kvvm's decode-step kernels
(the decode attention and its merge, the cascade's prefix pass, the skinny products) launch
so when :func:`set_programmatic_launch` (or ``KVVM_PDL=1`` in the environment) turns it on;
off by default. PyTorch's compiler has its own switch for its kernels
(``torch._inductor.config.triton.enable_pdl``); :func:`programmatic_launches` sets both
around a step's capture.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "INTERPRETER_MULTIPROCESSORS", "launch_options", "multiprocessors", "programmatic", "programmatic_launches",
    "second_stream", "set_programmatic_launch",
]

#: The multiprocessors Triton's interpreter is treated as having (a CPU has none): a few, so
#: that launches sized by them still spread work over several programs.
INTERPRETER_MULTIPROCESSORS = 4


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def multiprocessors(device: torch.device) -> int:
    """The multiprocessors a kernel's programs spread over: the CUDA device's, or
    :data:`INTERPRETER_MULTIPROCESSORS` in Triton's interpreter."""
    if device.type != "cuda":
        return INTERPRETER_MULTIPROCESSORS
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _second_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)


def second_stream(device: torch.device) -> torch.cuda.Stream:
    """A CUDA stream of ``device`` beside the one kernels run on, one per device for the
    process (made on first use): a pass launched on it after it waits for the current stream,
    and waited for before the current stream goes on, runs beside the current stream's
    kernels (in a captured graph, a branch)."""
    return _second_stream(device.index if device.index is not None else torch.cuda.current_device())


class _Switch:
    """Whether kvvm's decode-step kernels launch as programmatic dependents (where the
    device allows)."""

    on = os.environ.get("KVVM_PDL", "0") not in ("", "0")


def set_programmatic_launch(on: bool, *, compiler: bool = False) -> bool:
    """Turns programmatic dependent launches of kvvm's decode-step kernels on or off for the
    process (kernels launched from then on; a captured graph keeps how it was captured);
    ``compiler``: PyTorch's compiler's switch too (``torch._inductor.config.triton.enable_pdl``,
    for what it compiles from then on). Returns kvvm's switch as it was."""
    if compiler:
        from torch._inductor import config

        config.triton.enable_pdl = bool(on)
    before, _Switch.on = _Switch.on, bool(on)
    return before


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def programmatic(device: torch.device) -> bool:
    """Whether a kernel on ``device`` launches as a programmatic dependent now: the switch is
    on and the device an NVIDIA GPU of compute capability 9 or more (never in Triton's
    interpreter, never on ROCm)."""
    if not _Switch.on or device.type != "cuda" or torch.version.hip is not None:
        return False
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def launch_options(pdl: bool) -> dict[str, Any]:
    """The launch's options for a kernel that does (``pdl``) or does not launch as a
    programmatic dependent (none at all then: Triton's interpreter takes no such option)."""
    return {"launch_pdl": True} if pdl else {}


@contextlib.contextmanager
def programmatic_launches(on: bool = True) -> Iterator[None]:
    """Within the block, kvvm's decode-step kernels launch as programmatic dependents
    (:func:`set_programmatic_launch`) and PyTorch's compiler generates its own kernels to
    launch so as well (``torch._inductor.config.triton.enable_pdl``, for what it compiles in
    the block): made in it, a :class:`~kvvm.transformers.DecodeGraph` captures its step so and
    replays it so after. Process-wide; both switches as they were after the block. A step
    compiled before with the same code and guards may be reused by the compiler as it was
    (``torch._dynamo.reset()`` first compiles afresh)."""
    from torch._inductor import config

    inductor_before = config.triton.enable_pdl
    before = set_programmatic_launch(on, compiler=True)
    try:
        yield
    finally:
        config.triton.enable_pdl = inductor_before
        set_programmatic_launch(before)
