"""What the device offers the kernels' launches: the multiprocessors their programs spread
over (how many splits a decode takes, how many programs walk the cascade's prefix work)."""

from __future__ import annotations

import functools

import torch

__all__ = ["INTERPRETER_MULTIPROCESSORS", "multiprocessors"]

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
