"""How close two bf16 (or fp16) logits can be before their order means nothing, the
percentiles the benchmarks report (of a captured step's greedy replays too), and the bytes a
transformers cache's tensors hold."""

from __future__ import annotations

import statistics
from typing import Any

import torch

#: Relative resolution of a bf16 logit: two logits closer than twice this (relative to the
#: larger, at least 1 in absolute terms) are a tie bf16 cannot order.
BF16_TIE = 2 * 2**-7


def bf16_tie(top: torch.Tensor) -> torch.Tensor:
    """The gap under which a logit of magnitude ``top`` ties with the top one in bf16."""
    return BF16_TIE * top.abs().clamp_min(1)


def tie(top: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gap under which a logit of magnitude ``top`` ties with the top one in ``dtype``:
    twice its relative resolution (``bf16_tie`` for bf16; 8 times finer for fp16)."""
    return 2 * torch.finfo(dtype).eps * top.abs().clamp_min(1)


def percentiles(xs: list[float]) -> dict[str, float]:
    """``p50`` (the median) and ``p99`` of ``xs``, rounded to 3 places (empty for none)."""
    if not xs:
        return {}
    s = sorted(xs)
    return {"p50": round(statistics.median(s), 3), "p99": round(s[min(len(s) - 1, int(0.99 * len(s)))], 3)}



def timed_greedy_steps(step: Any, tok: torch.Tensor, steps: int) -> dict[str, float]:
    """``steps`` greedy replays of ``step`` (logits in, the argmax fed back), a CUDA event
    before each and after the last: the percentiles of their times in ms."""
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    for i in range(steps):
        marks[i].record()
        tok = step(tok).argmax(-1)
    marks[steps].record()
    torch.cuda.synchronize()
    return percentiles([a.elapsed_time(b) for a, b in zip(marks, marks[1:])])

def tensor_bytes(cache: object) -> int:
    """What the K/V tensors of a transformers cache's layers hold (a DynamicCache's, a
    StaticCache's)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
