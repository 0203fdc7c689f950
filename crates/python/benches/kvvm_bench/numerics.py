"""How close two bf16 (or fp16) logits can be before their order means nothing, and the
percentiles the benchmarks report."""

from __future__ import annotations

import statistics

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
