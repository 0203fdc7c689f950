"""Split-KV decode attention in Triton over per-request token ranges read from the device.

One query token per request (a decode step), grouped-query attention without repeating K/V
(each program reads one KV head once for all the query heads that share it), K/V given as
full-length strided tensors over every slot (kvvm's views of whole reservations) and each
request's slot and live range ``[start, end)`` as an int32 device tensor: nothing about a
request's length is known on
the host, so a CUDA graph captured once replays correctly at every length, and no token
outside a request's range (possibly unmapped memory) is ever read.

The work of one (request, KV head) is split over ``splits`` programs along the tokens (flash
decoding), so that a batch of a few long requests still fills the GPU; a second kernel merges
the partial results by their log-sum-exp.

A sliding window (``window``: the query at token ``end - 1`` sees the tokens from ``end -
window`` on) moves each request's first token up before anything is read, and Gemma 2's
attention-logit soft cap (``softcap * tanh(logits / softcap)``) is applied to every logit.

Requires triton (shipped with PyTorch's CUDA wheels). Runs on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests check it without a GPU).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import triton

from .device import launch_options, programmatic
from .triton_kernels import _merge_kernel, _partial_kernel
from .tuning import graph_time, may_time

__all__ = [
    "AUTOTUNE", "Config", "choose_splits", "decode_attention", "may_tune", "tuned_config", "tuned_configs", "tuned_timings",
    "widens",
]

#: Tokens a program reads per iteration, by default.
BLOCK_N = 64


@dataclass(frozen=True)
class Config:
    """How :func:`decode_attention` runs: programs per (request, KV head) along the tokens
    (a power of two), tokens per iteration, warps per program, pipeline stages; widen: an
    FP8 cache's V widened by the kernels' own conversion (:mod:`kvvm.kernels.triton_fold`;
    on a GPU, for a 16-bit query; ignored otherwise); masked: every block of a program's
    range read in the one pipelined loop, masked (:mod:`kvvm.kernels.triton_fold`), where
    otherwise the last partial block is read after the loop."""

    splits: int
    block: int = BLOCK_N
    warps: int = 4
    stages: int = 2
    widen: bool = False
    masked: bool = False


#: (tokens per iteration, warps, stages) tried at every split count by :func:`tuned_config`.
_SHAPES = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 3), (128, 8, 3))

#: Tried as well for a cache of one byte an element (FP8), each also with V widened by the
#: kernels' own conversion: blocks of 128 tokens keep as many bytes in flight as bf16's of
#: 64. On an H100 at 64 requests of 4096 tokens (the Llama-3.1-8B shape) 128 tokens with 4
#: warps and 3 stages read FP8 fastest alone (191-201 us a layer-call, against 215 for 8 warps
#: and 2 stages; 256 tokens slower still), and in the captured step with V widened (200 us a
#: layer, against 209 without).
_SHAPES_FP8 = ((128, 4, 3), (128, 8, 2))

#: What a configuration the device cannot run raises when it is compiled.
TOO_BIG: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(getattr(triton, "runtime", None), "OutOfResources", None),) if isinstance(e, type)
)

#: The fastest configuration measured per shape (:func:`tuned_config`).
_TUNED: dict[tuple[object, ...], Config] = {}

#: Every configuration's time per tuned shape, the fastest first (:func:`tuned_timings`).
_TIMINGS: dict[tuple[object, ...], list[tuple[float, Config]]] = {}

#: Whether kernels run in Triton's interpreter (on CPU tensors).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: Whether :func:`tuned_config` measures configurations. Off (``KVVM_TRITON_AUTOTUNE=0``, or
#: this set to False), it returns :func:`choose_splits`' configuration untimed, as in the
#: interpreter: one compile per shape instead of one per candidate, a shorter first step.
AUTOTUNE = os.environ.get("KVVM_TRITON_AUTOTUNE", "1") not in ("", "0")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def may_tune() -> bool:
    """Whether the kernels' autotuners (this one, the cascade's prefix pass's, the skinny
    products') may time candidates now: :data:`AUTOTUNE` on, outside Triton's interpreter,
    and :func:`~kvvm.kernels.tuning.may_time` (no capture, no compiler's trace, not
    :func:`~kvvm.kernels.tuning.untuned`)."""
    return AUTOTUNE and not _INTERPRETED and may_time()


def choose_splits(batch: int, kv_heads: int, max_tokens: int, multiprocessors: int) -> int:
    """Splits per (request, KV head): enough programs for about four per multiprocessor, a
    power of two (the merge reads them as one block), and no split shorter than one block of
    the longest possible request."""
    want = _pow2_at_least(math.ceil(4 * multiprocessors / max(batch * kv_heads, 1)))
    most = _pow2_at_least(max(1, math.ceil(max_tokens / BLOCK_N)))
    return max(1, min(want, most, 64))


def tuned_config(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor, scale: float,
    multiprocessors: int,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kv_scales: torch.Tensor | None = None,
    *,
    timed: Callable[[Config], torch.Tensor] | None = None,
    variant: Hashable = None,
) -> Config:
    """The fastest of a few configurations around :func:`choose_splits`' for this shape,
    measured once on these very inputs (each replayed in a captured graph, as the decode
    step runs it, its K/V read from memory and not from the L2 cache:
    :func:`~kvvm.kernels.tuning.graph_time`'s ``cold``) and remembered; the
    heuristic one while a graph is captured or a compiler traces (nothing may be timed
    then), inside :func:`~kvvm.kernels.tuning.untuned` (a call that runs once), in Triton's
    interpreter and without :data:`AUTOTUNE`.

    ``timed``: the call to time in a configuration, when it is not :func:`decode_attention`
    of these inputs (the cascade's, whose passes read other ranges than a plain decode's);
    ``variant`` names it, so that its configuration is remembered apart from the plain
    kernel's at the same shape."""
    batch, heads, _, dim = query.shape
    shape = (
        batch, heads, key.shape[1], dim, query.dtype, key.dtype, key.shape[2], tuple(key.stride()), multiprocessors,
        variant,
    )
    found = _TUNED.get(shape)
    if found is not None:
        return found
    splits = choose_splits(batch, key.shape[1], key.shape[2], multiprocessors)
    default = Config(splits)
    if not may_tune():
        return default
    candidates = {default}
    # Fewer splits with more warps and stages keep as many bytes in flight with fewer
    # programs; one split needs no merge kernel at all.
    # Each also with every block masked in the loop: the partial last block's loads then go
    # with the others' (one memory round trip less for a range of few blocks, a comparison
    # more a block; measured on an H100 with every fold masked, a cascade's private pass of
    # 256 tokens a request took 1.13 ms a step in 64-token blocks, 1.47 unmasked in 128).
    # V widened by the kernel's own conversion only where the kernel widens (a 16-bit query
    # on a GPU): elsewhere such a configuration runs as the one without.
    fp8 = _SHAPES_FP8 if key.element_size() == 1 else ()
    widened = fp8 if widens(query.dtype, kv_scales) else ()
    for s in sorted({1, 2, max(1, splits // 2), splits, min(64, splits * 2)}):
        for masked in (False, True):
            for block, warps, stages in _SHAPES + fp8:
                candidates.add(Config(s, block, warps, stages, masked=masked))
            for block, warps, stages in widened:
                candidates.add(Config(s, block, warps, stages, widen=True, masked=masked))
    if timed is None:
        def timed(c: Config) -> torch.Tensor:
            return decode_attention(query, key, value, bounds, scale, c, new, kv_scales=kv_scales)

    timings = []
    for c in sorted(candidates, key=lambda c: (c.splits, c.block, c.warps, c.stages, c.widen, c.masked)):
        try:
            timings.append((graph_time(timed, c, cold=True), c))
        except TOO_BIG:
            continue  # more shared memory or registers than the device has
    chosen = min(timings, key=lambda t: t[0])[1]
    _TUNED[shape] = chosen
    _TIMINGS[shape] = sorted(timings, key=lambda t: t[0])
    return chosen


def tuned_configs() -> dict[str, Config]:
    """The configurations :func:`tuned_config` measured and chose so far, each under a
    description of its shape (requests, query heads over KV heads, tokens reserved a slot,
    the K/V element type)."""
    return {_described(k): v for k, v in _TUNED.items()}


def tuned_timings(top: int = 5) -> dict[str, list[tuple[Config, float]]]:
    """The ``top`` fastest configurations :func:`tuned_config` measured per shape (described
    as by :func:`tuned_configs`) and each one's time (ms a call, as the tuner timed it), the
    fastest first: how far apart the tuner found them."""
    return {_described(k): [(c, ms) for ms, c in t[:top]] for k, t in _TIMINGS.items()}


def _described(shape: tuple[object, ...]) -> str:
    """A tuned shape's key, in words (see :func:`tuned_configs`)."""
    variant = f", {shape[9]}" if shape[9] else ""
    return f"batch {shape[0]}, heads {shape[1]}/{shape[2]}, {shape[6]} tokens reserved, K/V {shape[5]}{variant}"


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    config: Config | int,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its own tokens.

    Args:
        query: ``[batch, heads, 1, head_dim]`` (any strides with a unit last one).
        key, value: ``[slots, kv_heads, tokens, head_dim]``, unit last stride: full-length
            views; only ``bounds`` decides which tokens are read.
        bounds: int32 ``[batch, 3]`` on the device: each request's slot and tokens
            ``[start, end)`` (the query is the token at ``end - 1``); an empty range gives
            zeros.
        scale: the softmax scale.
        config: a :class:`Config` (:func:`tuned_config`), or only its ``splits``
            (:func:`choose_splits`; a power of two).
        new: the step's new K and V (``[batch, kv_heads, 1, head_dim]``, any strides with a
            unit last one) and where they go
            (slot and token, int64 ``[batch, 1]``): written by the kernel itself and attended
            from registers (``bounds``' ends include them when their write lands at the end).
        window: a sliding window: the query reads only the tokens from ``end - window`` on
            (0: all).
        softcap: the attention-logit soft cap (0: none).
        kv_scales: K and V are an FP8 cache's, of these scales (fp32 ``[2, kv_heads]``,
            :mod:`kvvm.kernels.fp8`): dequantized inside the kernel as they are read, the
            step's new token quantized as the kernel writes it.

    Returns:
        ``[batch, 1, heads, head_dim]`` in the query's dtype (transformers' layout).
    """
    c = config if isinstance(config, Config) else Config(config)
    out, acc, lse = buffers(query, c.splits)
    run_partial(
        query, key, value, bounds, scale, c, new, out, acc, lse, window=window, softcap=softcap, kv_scales=kv_scales,
    )
    if c.splits > 1:
        run_merge(acc, lse, out, c.splits)
    return out


def run_partial(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor, scale: float,
    c: Config, new: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor, acc: torch.Tensor, lse: torch.Tensor, *, window: int = 0, softcap: float = 0.0,
    shared: torch.Tensor | None = None, prefix_splits: int = 0, kv_scales: torch.Tensor | None = None,
    arrivals: torch.Tensor | None = None,
) -> None:
    """Each request's own tokens, ``c.splits`` programs per (request, KV head): into ``out``
    when one split sees them all and nothing else is merged, else into the columns
    ``0..c.splits`` of ``acc``/``lse``. With ``shared`` (int32 ``[batch]``), each request's
    range starts that many tokens later (a cascade's prefix pass reads them, into the
    ``prefix_splits`` columns after those), and a request sharing none marks those columns
    empty; with ``c.splits`` 1 the prefix pass runs first and each request's program merges
    its columns itself, into ``out`` (no merge kernel after). With ``kv_scales`` (fp32 ``[2,
    kv_heads]``: each KV head's K and V scale), K and V are an FP8 cache's
    (:mod:`kvvm.kernels.fp8`): dequantized as they are read, the step's new token quantized
    as it is written. With ``arrivals`` (a cascade's int32 ``[batch, heads]`` counts, zero
    between launches; one split), the prefix pass runs beside this launch, not before it:
    each program of a request in a group writes column 0 and counts it, and whichever
    program counts a row's last column merges the row
    (:func:`~kvvm.kernels.triton_kernels.arrive_and_merge`)."""
    fused = new is not None
    cascade = shared is not None
    if kv_scales is not None:
        # Read as [2, kv_heads] fp32 rows (a no-op for a cache's own scales).
        kv_scales = kv_scales.to(torch.float32).contiguous()
    kn, vn, ws, wt = _new_rows(new, bounds)
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    # One program per request and KV head writes the output itself (in a cascade, merging the
    # prefix pass's columns first).
    direct = c.splits == 1
    o = out[:, 0]
    q = query[:, :, 0]
    base, k_from, v_from = from_last_slot(key, value)
    pdl = programmatic(query.device)
    _partial_kernel[(batch, kv_heads, c.splits)](
        q, k_from, v_from, bounds, acc, lse, kn, vn, ws, wt,
        kn.stride(0) if fused else 0, kn.stride(1) if fused else 0,
        vn.stride(0) if fused else 0, vn.stride(1) if fused else 0,
        q.stride(0), q.stride(1),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        acc.stride(0), acc.stride(1), acc.stride(2) if acc.dim() == 4 else 0,
        lse.stride(0), lse.stride(1),
        o, o.stride(0), o.stride(1),
        scale, float(softcap) or 1.0, int(window), shared if cascade else bounds, base,
        bounds if kv_scales is None else kv_scales, key.shape[1], bounds if arrivals is None else arrivals, heads,
        GROUP=heads // kv_heads, GROUP_PAD=max(16, _pow2_at_least(heads // kv_heads)),
        HEAD_DIM=dim, DIM_PAD=max(16, _pow2_at_least(dim)),
        BLOCK=c.block, SPLITS=c.splits, LOOP_WHILE=_INTERPRETED,
        # fp32 caches get fp32 products (Triton's default for fp32 is TF32).
        PRECISION=precision(query.dtype),
        # Products in fp32 for bf16 in the interpreter only (see _block).
        UPCAST=upcast(query.dtype),
        FUSED=fused, CAPPED=bool(softcap), SLIDING=bool(window),
        CASCADE=cascade, PSPLITS=prefix_splits, PSPLITS_PAD=_pow2_at_least(max(prefix_splits, 1)), DIRECT=direct,
        FP8=kv_scales is not None, MERGE=cascade and direct and arrivals is None, PDL=pdl,
        WIDEN=c.widen and widens(query.dtype, kv_scales), MASK_EVERY=c.masked, ARRIVE=arrivals is not None,
        num_warps=c.warps, num_stages=c.stages, **launch_options(pdl),
    )


def from_last_slot(key: torch.Tensor, value: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """K and V as the kernels take them: from their last slot on (kvvm's scratch slot, whose
    first token is always mapped), every slot reached at a negative offset from it. Triton
    checks that a pointer argument points into device memory, and the first slot's first
    token need not be mapped (a free slot, a sliding layer's windows given back). Returns
    the last slot's index (the kernels subtract it from every slot) and the two views."""
    base = key.shape[0] - 1
    return base, key[base:], value[base:]


def run_merge(acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, splits: int) -> None:
    """Each (request, head)'s ``splits`` partial results merged by their log-sum-exps into
    ``out``."""
    batch, heads, _, dim = acc.shape
    o = out[:, 0]
    pdl = programmatic(out.device)
    _merge_kernel[(batch, heads)](
        acc, lse, o,
        acc.stride(0), acc.stride(1), acc.stride(2),
        lse.stride(0), lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=dim,
        DIM_PAD=max(16, _pow2_at_least(dim)),
        SPLITS=splits,
        SPLITS_PAD=_pow2_at_least(splits),
        PDL=pdl,
        num_warps=4,
        **launch_options(pdl),
    )


def precision(dtype: torch.dtype) -> str:
    """The products' precision: fp32 caches get fp32 products (Triton's default for fp32 is
    TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def widens(dtype: torch.dtype, kv_scales: torch.Tensor | None) -> bool:
    """Whether the kernels may widen an FP8 cache's V by their own conversion (e4m3 to fp16,
    :mod:`kvvm.kernels.triton_fold`): an FP8 cache read by a 16-bit query (whose products
    take fp16), on a GPU (the interpreter runs no inline PTX)."""
    return kv_scales is not None and not _INTERPRETED and dtype in (torch.bfloat16, torch.float16)


def upcast(dtype: torch.dtype) -> bool:
    """Whether products are taken in fp32: bf16 in Triton's interpreter only (see _block)."""
    return _INTERPRETED and dtype == torch.bfloat16


def _new_rows(
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None, bounds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's new K and V rows (``[batch, kv_heads, head_dim]``) and where they go (slot
    and token, ``[batch]``); without them, placeholders the kernel does not read."""
    if new is None:
        return bounds, bounds, bounds, bounds
    key_new, value_new, w_slot, w_token = new
    # Each read at its own strides (V a slice of a fused projection's output, K the
    # rotary's): no copy kernel, unless a last stride is not 1 (the kernel reads rows).
    kn, vn = (t[:, :, 0] if t.stride(-1) == 1 else t[:, :, 0].contiguous() for t in (key_new, value_new))
    return kn, vn, w_slot.reshape(-1), w_token.reshape(-1)


def buffers(query: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output (``[batch, 1, heads, head_dim]``), and the partial results and their
    log-sum-exps of ``splits`` columns (one column is the output itself: the output stands
    in for both, unread)."""
    batch, heads, _, dim = query.shape
    out = torch.empty((batch, 1, heads, dim), dtype=query.dtype, device=query.device)
    if splits == 1:
        return out, out[:, 0], out[:, 0]
    acc = torch.empty((batch, heads, splits, dim), dtype=torch.float32, device=query.device)
    lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=query.device)
    return out, acc, lse
