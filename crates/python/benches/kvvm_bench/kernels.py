"""``python -m kvvm_bench kernels``: the attention kernels that read each request's length on
the device, one decode query token per request, measured per layer-call inside a CUDA graph.

K/V are strided like kvvm's token-major layout (one layer's K of ``[slots, tokens, layers, 2,
kv_heads, head_dim]``); requests may have different lengths. For each kernel: microseconds per
call (a graph of ``calls`` calls replayed, CUDA events), the HBM floor of the call (the K/V
bytes of the live tokens at the given bandwidth) and the ratio, and the largest difference to
SDPA over each request's exact tokens. The lengths change after the capture and the replay
is checked again: a kernel whose graph only knew the lengths of the capture fails there.

- ``triton``: kvvm's split-KV decode kernel (:mod:`kvvm.kernels.triton_decode`);
- ``triton-fp8``: the same kernel over the K/V stored as an FP8 cache holds them (e4m3, a
  scale per KV head, :mod:`kvvm.kernels.fp8`), dequantized as they are read: its floor counts
  one byte an element, and it is checked against SDPA over the dequantized K/V;
- ``flash``: PyTorch's FlashAttention varlen with ``seqused_k`` (:mod:`kvvm.kernels.attend`);
- ``flex``: FlexAttention, its block mask built from the lengths inside ``torch.compile``
  (block 128: it reads whole blocks, up to 127 tokens past a request's end, which kvvm's
  memory may not have mapped);
- ``sdpa``: SDPA on exact-length views (one uniform batch; not capturable: eager time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["KernelResult", "run_kernels"]


@dataclass
class KernelResult:
    """One kernel at one point."""

    kernel: str
    batch: int
    tokens: str
    us_per_call: float | None
    floor_us: float
    over_floor: float | None
    max_abs_diff: float | None
    captured: bool
    note: str = ""


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    out = []
    for b, n in enumerate(lengths):
        o = torch.nn.functional.scaled_dot_product_attention(
            q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], enable_gqa=True
        )
        out.append(o.transpose(1, 2))
    return torch.cat(out)


def _time_graph(fn: Callable[[], torch.Tensor], calls: int) -> tuple[float, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            out = fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            out = fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best, out


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, _, tokens = k.shape[0], k.shape[1], k.shape[2]

    @torch.compile(fullgraph=True, dynamic=False)
    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> Any:
        def live(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kv_idx < lens[b]

        mask = create_block_mask(live, batch, None, 1, tokens, device=q.device, BLOCK_SIZE=128)
        out = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        assert isinstance(out, torch.Tensor)
        return out.transpose(1, 2)

    return lambda: step(q, k, v, lens)


def run_kernels(
    batch: int,
    lengths: list[int],
    max_tokens: int,
    *,
    layers: int = 32,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    bandwidth: float = 4.8e12,
    calls: int = 20,
    kernels: tuple[str, ...] = ("triton", "triton-fp8", "flash", "flex", "sdpa"),
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
) -> list[KernelResult]:
    """Every kernel of ``kernels`` at one point (``lengths``: one per request). On a CPU
    (``device="cpu"``; the Triton kernel in Triton's interpreter) each kernel runs once,
    checked against SDPA, neither timed nor captured."""
    from kvvm.kernels.attend import attend

    dev = torch.device(device)
    torch.manual_seed(0)
    slab = torch.randn((batch, max_tokens, min(layers, 2), 2, kv_heads, head_dim), dtype=dtype, device=dev)
    k, v = slab[:, :, 1, 0].transpose(1, 2), slab[:, :, 1, 1].transpose(1, 2)
    q = torch.randn((batch, 1, heads, head_dim), dtype=dtype, device=dev).transpose(1, 2)
    bounds = torch.tensor([[b, 0, n] for b, n in enumerate(lengths)], dtype=torch.int32, device=dev)
    lens = bounds[:, 2].clone()
    label = str(lengths[0]) if len(set(lengths)) == 1 else f"{min(lengths)}..{max(lengths)}"
    floor = 2 * sum(lengths) * kv_heads * head_dim * slab.element_size() / bandwidth * 1e6
    want = _reference(q, k, v, lengths)
    k8, v8, scales, k_ref, v_ref = _fp8(slab, kv_heads) if "triton-fp8" in kernels else (k, v, None, k, v)
    fns: dict[str, Callable[[], torch.Tensor]] = {
        "triton": lambda: attend(q, k, v, bounds, kernel="triton"),
        "triton-fp8": lambda: attend(q, k8, v8, bounds, kernel="triton", kv_scales=scales),
        "flash": lambda: attend(q, k, v, bounds, kernel="flash"),
        "flex": lambda: _flex(q, k, v, lens)(),
    }
    results = []
    for name in kernels:
        fp8 = name == "triton-fp8"
        # An FP8 cache: one byte an element, checked against its own dequantized K/V.
        kk, vv = (k_ref, v_ref) if fp8 else (k, v)
        expected = _reference(q, kk, vv, lengths) if fp8 else want
        bound = floor / slab.element_size() if fp8 else floor
        if dev.type != "cuda":
            results.append(_untimed(name, fns, batch, label, bound, expected))
            continue
        if name == "sdpa":
            results.append(_time_sdpa(q, k, v, lengths, label, floor, want, calls))
            continue
        try:
            us, out = _time_graph(fns[name], calls)
            diff = (out.float() - expected.float()).abs().max().item()
            captured = _still_right_after_lengths_change(fns[name], bounds, lens, q, kk, vv, lengths)
            results.append(KernelResult(name, batch, label, round(us, 2), round(bound, 2), round(us / bound, 2), diff, captured))
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run is reported, not fatal
            results.append(KernelResult(name, batch, label, None, round(bound, 2), None, None, False, f"{type(e).__name__}: {e}"[:200]))
    return results


def _fp8(slab: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """``slab``'s K and V as an FP8 cache stores them (a scale per KV head: its largest
    magnitude over e4m3's largest), strided as ``slab``'s views; their ``[2, kv_heads]``
    scales; and the values they hold (dequantized, in ``slab``'s dtype), for the reference."""
    from kvvm.kernels.fp8 import E4M3, E4M3_MAX, dequantize, quantize

    stored = torch.empty(slab.shape, dtype=E4M3, device=slab.device)
    scales = torch.empty((2, kv_heads), dtype=torch.float32, device=slab.device)
    for i in range(2):
        part = slab[:, :, :, i]
        scales[i] = part.abs().amax(dim=(0, 1, 2, 4)).float().clamp_min(1e-6) / E4M3_MAX
        stored[:, :, :, i] = quantize(part, scales[i], head_dim=3)
    held = torch.stack([dequantize(stored[:, :, :, i], scales[i], slab.dtype, head_dim=3) for i in range(2)], dim=3)
    views = [t[:, :, 1, i].transpose(1, 2) for t in (stored, held) for i in range(2)]
    return views[0], views[1], scales, views[2], views[3]


def _untimed(
    name: str, fns: dict[str, Callable[[], torch.Tensor]], batch: int, label: str, floor: float, want: torch.Tensor,
) -> KernelResult:
    """One call of kernel ``name`` without a GPU: its difference to SDPA only."""
    note = "no CUDA: run once, not timed, not captured"
    try:
        diff = (fns[name]().float() - want.float()).abs().max().item()
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run is reported, not fatal
        return KernelResult(name, batch, label, None, round(floor, 2), None, None, False, f"{note}; {type(e).__name__}: {e}"[:200])
    return KernelResult(name, batch, label, None, round(floor, 2), None, diff, False, note)


def _still_right_after_lengths_change(
    fn: Callable[[], torch.Tensor], bounds: torch.Tensor, lens: torch.Tensor, q: torch.Tensor,
    k: torch.Tensor, v: torch.Tensor, lengths: list[int],
) -> bool:
    """Captures one call, changes every length (on the device), replays: right again?"""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    shorter = [max(1, n // 2 + b) for b, n in enumerate(lengths)]
    bounds[:, 2] = torch.tensor(shorter, dtype=torch.int32, device=bounds.device)
    lens.copy_(bounds[:, 2])
    g.replay()
    torch.cuda.synchronize()
    ok = (out.float() - _reference(q, k, v, shorter).float()).abs().max().item() < 2e-2
    bounds[:, 2] = torch.tensor(lengths, dtype=torch.int32, device=bounds.device)
    lens.copy_(bounds[:, 2])
    return ok


def _time_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], label: str, floor: float,
    want: torch.Tensor, calls: int,
) -> KernelResult:
    batch = q.shape[0]
    if len(set(lengths)) != 1:
        return KernelResult("sdpa", batch, label, None, round(floor, 2), None, None, False, "ragged: one call per request")
    n = lengths[0]
    kk, vv = k[:, :, :n], v[:, :, :n]
    for _ in range(3):
        out = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        out = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1000 / calls
    diff = (out.transpose(1, 2).float() - want.float()).abs().max().item()
    return KernelResult("sdpa", batch, label, round(us, 2), round(floor, 2), round(us / floor, 2), diff, False, "eager, exact-length views")
