"""The caches ``python -m kvvm.bench generate`` compares and what it measures of them: their
labels (``"kvvm:token-major@kvvm_sdpa"``), how each is made and seeded with a prompt's K/V,
the KV bytes each holds, and one run's result."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from kvvm.transformers import KvvmCache

KV_KERNEL_WORDS = ("flash", "fmha", "attention", "sdpa", "cat", "copy", "index", "repeat")


@dataclass
class RunResult:
    """One cache at one point."""

    cache: str
    batch: int
    prompt: int
    new_tokens: int
    prefill_ms: float
    step_p50_ms: float
    tokens_per_s: float
    kv_gpu_us_per_step: float | None
    kv_bytes_held: int
    kv_bytes_live: int
    peak_allocated_decode: int
    peak_reserved_decode: int
    attention: str = "sdpa"
    kv_bytes_held_before_shrink: int = 0
    kv_peak_bytes_decode: int = 0
    peak_total_decode: int = 0
    max_abs_logit_diff: float | None = None
    argmax_checked: int | None = None
    argmax_disagree: int | None = None
    #: The step p50 of every run of this cache at this point (the first prefilled through the
    #: model, the others seeded); ``step_p50_ms`` is their minimum.
    rounds_p50_ms: list[float] = field(default_factory=list)
    step_p50_median_ms: float = 0.0
    #: The step p50 in the step-interleaved phase (every cache alive at once, one decode step
    #: of each in turn), and its tokens/s; None when that phase did not run for this cache.
    interleaved_p50_ms: float | None = None
    interleaved_tokens_per_s: float | None = None
    #: Every step time of the step-interleaved phase, in step order (step ``i`` of every
    #: cache ran in the same rotation, a few steps' time apart).
    interleaved_steps_ms: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timer(dev: torch.device) -> Any:
    if dev.type == "cuda":
        return torch.cuda.Event(enable_timing=True)
    return None


def kv_live_bytes(cfg: Any, batch: int, tokens: int, elem: int) -> int:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return batch * tokens * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elem


def split_kind(kind: str) -> tuple[str, str]:
    """``"kvvm:seq-major@kvvm_sdpa"`` -> (``"kvvm:seq-major"``, ``"kvvm_sdpa"``)."""
    base, _, attn = kind.partition("@")
    return base, attn or "sdpa"


def make_cache(kind: str, cfg: Any, args: argparse.Namespace, batch: int, total: int) -> Any:
    from transformers import DynamicCache, StaticCache

    if kind == "dynamic":
        return DynamicCache(config=cfg)
    if kind == "static":
        return StaticCache(config=cfg, max_cache_len=total + 1024)
    # "kvvm:LAYOUT" grows through the pre-committer, "kvvm:LAYOUT+inline" commits on the
    # decode path when a step crosses into a new window.
    layout, _, mode = kind.split(":", 1)[1].partition("+")
    return KvvmCache(
        cfg,
        batch,
        total + 1024,
        backend=args.backend,
        layout=layout,
        dtype=args.dtype,
        precommit=mode != "inline",
        headroom_tokens=args.headroom,
    )


def kv_held(kind: str, cache: Any) -> int:
    if kind.startswith("kvvm"):
        return int(cache.committed_bytes)
    total = 0
    for layer in cache.layers:
        if layer.keys is not None:
            total += layer.keys.numel() * layer.keys.element_size()
            total += layer.values.numel() * layer.values.element_size()
    return total


def kv_kernel_us(prof: Any, steps: int) -> float:
    total = 0.0
    for evt in prof.key_averages():
        name = evt.key.lower()
        if any(w in name for w in KV_KERNEL_WORDS):
            total += float(getattr(evt, "self_device_time_total", 0.0))
    return total / max(steps, 1)


def snapshot(cache: Any, prompt: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's prompt K/V after a prefill, copied to host memory (outside PyTorch's
    CUDA memory statistics)."""
    return [
        (layer.keys[:, :, :prompt].to("cpu", copy=True), layer.values[:, :, :prompt].to("cpu", copy=True))
        for layer in cache.layers
    ]


def seed_cache(cache: Any, seed: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Writes a prefill's K/V into a fresh cache through the cache's own ``update`` (what
    the model's prefill calls), without running the model."""
    for i, (k, v) in enumerate(seed):
        cache.update(k, v, i)


def is_kvvm(label: str) -> bool:
    """Whether a cache label names a KvvmCache."""
    return label.startswith("kvvm")


def steady_p50(steps_ms: list[float], warmup: int) -> float:
    """The median step time after the first ``warmup`` steps (all of them when there are no
    more)."""
    return statistics.median(steps_ms[warmup:] or steps_ms)


def paired_ratio(fast: list[float], slow: list[float], warmup: int) -> float | None:
    """The median over the steps after ``warmup`` of ``slow[i] / fast[i]``: how many times
    faster ``fast`` ran than ``slow`` in the same rotation (a paired estimate, which host load
    that drifts over the phase moves less than a ratio of two p50s). None without common
    steps."""
    n = min(len(fast), len(slow))
    ratios = [slow[i] / fast[i] for i in range(warmup, n) if fast[i] > 0]
    return statistics.median(ratios) if ratios else None


def rotated(items: list[str], n: int) -> list[str]:
    """``items`` rotated left by ``n`` (the caches' order in round or step ``n``)."""
    if not items:
        return []
    k = n % len(items)
    return items[k:] + items[:k]


def device_seed(reference: dict[str, Any], dev: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The reference's prompt K/V (kept in host memory by its first run) moved to ``dev``,
    once: the host copy is dropped from ``reference``."""
    host = reference.pop("seed", None)
    return None if host is None else [(k.to(dev), v.to(dev)) for k, v in host]
