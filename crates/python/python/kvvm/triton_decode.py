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
from dataclasses import dataclass
import torch
import triton
import triton.language as tl

__all__ = ["AUTOTUNE", "Config", "choose_splits", "decode_attention", "tuned_config"]

#: Tokens a program reads per iteration, by default.
BLOCK_N = 64


@dataclass(frozen=True)
class Config:
    """How :func:`decode_attention` runs: programs per (request, KV head) along the tokens
    (a power of two), tokens per iteration, warps per program, pipeline stages."""

    splits: int
    block: int = BLOCK_N
    warps: int = 4
    stages: int = 2


#: (tokens per iteration, warps, stages) tried at every split count by :func:`tuned_config`.
_SHAPES = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 3), (128, 8, 3))

#: What a configuration the device cannot run raises when it is compiled.
_TOO_BIG: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(getattr(triton, "runtime", None), "OutOfResources", None),) if isinstance(e, type)
)

#: The fastest configuration measured per shape (:func:`tuned_config`).
_TUNED: dict[tuple[object, ...], Config] = {}

#: Whether kernels run in Triton's interpreter (on CPU tensors).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: Whether :func:`tuned_config` measures configurations. Off (``KVVM_TRITON_AUTOTUNE=0``, or
#: this set to False), it returns :func:`choose_splits`' configuration untimed, as in the
#: interpreter: one compile per shape instead of one per candidate, a shorter first step.
AUTOTUNE = os.environ.get("KVVM_TRITON_AUTOTUNE", "1") not in ("", "0")


@triton.jit
def _cap(x, softcap):
    """``softcap * tanh(x / softcap)``, the tanh from a sigmoid (``tanh(y) = 2 sigmoid(2y) - 1``)."""
    return softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)


@triton.jit
def _block(
    q,
    k_base,
    v_base,
    t,
    hi,
    stride_kt,
    stride_vt,
    offs_d,
    d_mask,
    m_i,
    l_i,
    acc,
    sm_scale,
    softcap,
    BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
    CAPPED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One block of tokens ``t..t+BLOCK`` (those below ``hi``) folded into the running
    softmax: returns the new ``(max, sum, accumulator)``."""
    offs_n = t + tl.arange(0, BLOCK)
    n_mask = offs_n < hi
    rows = offs_n.to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        # Triton's interpreter multiplies bf16 operands as their raw 16-bit patterns: widened
        # to fp32 there (on a GPU the tensor cores take bf16 as it is).
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
    if CAPPED:
        qk = _cap(qk, softcap)
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    p = p.to(v.dtype)
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_new, acc


@triton.jit
def _partial_kernel(
    Q,
    K,
    V,
    Bounds,
    Acc,
    Lse,
    KN,
    VN,
    WS,
    WT,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ab,
    stride_ah,
    stride_as,
    stride_lb,
    stride_lh,
    Out,
    stride_ob,
    stride_oh,
    sm_scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
    LOOP_WHILE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    FUSED: tl.constexpr,
    CAPPED: tl.constexpr,
    SLIDING: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # The request's slot and tokens in one load, reduced to scalars.
    offs = tl.arange(0, 4)
    row = tl.load(Bounds + b * 3 + offs, mask=offs < 3, other=0)
    slot = tl.sum(tl.where(offs == 0, row, 0), 0)
    start = tl.sum(tl.where(offs == 1, row, 0), 0)
    end = tl.sum(tl.where(offs == 2, row, 0), 0)
    if SLIDING:
        # The query (token end - 1) sees the window's tokens only: nothing before is read.
        start = tl.maximum(start, end - window)
    if FUSED:
        # The step's new token (K and V in registers) is written here and attended to from
        # registers: no program reads it from memory, so none races its write.
        w_slot = tl.load(WS + b)
        w_token = tl.load(WT + b)
        has_new = (w_slot == slot) & (w_token == end - 1)
        end = end - has_new.to(end.dtype)
    n = tl.maximum(end - start, 0)
    # Every split of a request gets a whole number of blocks.
    per_split = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK) * BLOCK
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, end)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    k_base = K + slot.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + slot.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    if LOOP_WHILE:
        # Triton's interpreter (CPU) takes a loop bound only as a Python int.
        t = lo
        while t < hi:
            m_i, l_i, acc = _block(
                q, k_base, v_base, t, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc,
                sm_scale, softcap, BLOCK, PRECISION, CAPPED, UPCAST,
            )
            t += BLOCK
    else:
        for t in range(lo, hi, BLOCK):
            m_i, l_i, acc = _block(
                q, k_base, v_base, t, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc,
                sm_scale, softcap, BLOCK, PRECISION, CAPPED, UPCAST,
            )

    if FUSED:
        kn_at = b.to(tl.int64) * stride_knb + kvh.to(tl.int64) * stride_knh
        vn_at = b.to(tl.int64) * stride_vnb + kvh.to(tl.int64) * stride_vnh
        kn = tl.load(KN + kn_at + offs_d, mask=d_mask, other=0.0)
        vn = tl.load(VN + vn_at + offs_d, mask=d_mask, other=0.0)
        if split == 0:
            w_off = w_slot.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh + w_token.to(tl.int64) * stride_kt
            tl.store(K + w_off + offs_d, kn, mask=d_mask)
            v_off = w_slot.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh + w_token.to(tl.int64) * stride_vt
            tl.store(V + v_off + offs_d, vn, mask=d_mask)
        if (split == SPLITS - 1) & has_new:
            qk_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * sm_scale
            if CAPPED:
                qk_new = _cap(qk_new, softcap)
            m_new = tl.maximum(m_i, qk_new)
            alpha = tl.exp(m_i - m_new)
            p_new = tl.exp(qk_new - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * vn.to(tl.float32)[None, :]
            m_i = m_new
    has = l_i > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    if SPLITS == 1:
        # One program saw every token: its result is the output (no merge).
        o_ptr = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        a_ptr = Acc + b.to(tl.int64) * stride_ab + heads[:, None] * stride_ah + split * stride_as
        tl.store(a_ptr + offs_d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(Lse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _merge_kernel(
    Acc,
    Lse,
    Out,
    stride_ab,
    stride_ah,
    stride_as,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(Lse + b.to(tl.int64) * stride_lb + h * stride_lh + offs_s)
    m = tl.max(lse, 0)
    finite = m > float("-inf")
    w = tl.where(finite, tl.exp(lse - tl.where(finite, m, 0.0)), 0.0)
    total = tl.sum(w, 0)
    parts = tl.load(
        Acc + b.to(tl.int64) * stride_ab + h * stride_ah + offs_s[:, None] * stride_as + offs_d[None, :],
        mask=d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=d_mask,
    )


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


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
) -> Config:
    """The fastest of a few configurations around :func:`choose_splits`' for this shape,
    measured once on these very inputs (each replayed in a captured graph, as the decode
    step runs it) and remembered; the
    heuristic one while a graph is captured or a compiler traces (nothing may be timed
    then), in Triton's interpreter and without :data:`AUTOTUNE`."""
    batch, heads, _, dim = query.shape
    shape = (batch, heads, key.shape[1], dim, query.dtype, key.shape[2], tuple(key.stride()), multiprocessors)
    found = _TUNED.get(shape)
    if found is not None:
        return found
    splits = choose_splits(batch, key.shape[1], key.shape[2], multiprocessors)
    default = Config(splits)
    if not AUTOTUNE or _INTERPRETED or torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
        return default
    candidates = {default}
    # Fewer splits with more warps and stages keep as many bytes in flight with fewer
    # programs; one split needs no merge kernel at all.
    for s in sorted({1, 2, max(1, splits // 2), splits, min(64, splits * 2)}):
        for block, warps, stages in _SHAPES:
            candidates.add(Config(s, block, warps, stages))
    timings = []
    for c in sorted(candidates, key=lambda c: (c.splits, c.block, c.warps, c.stages)):
        try:
            timings.append((_graph_time(query, key, value, bounds, scale, c, new), c))
        except _TOO_BIG:
            continue  # more shared memory or registers than the device has
    chosen = min(timings, key=lambda t: t[0])[1]
    _TUNED[shape] = chosen
    return chosen


#: Calls per captured graph when a configuration is timed.
_REPEATS = 10


def _graph_time(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor, scale: float,
    config: Config, new: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> float:
    """The GPU time of one call in ``config`` (ms), as a captured graph replays it: calls
    launched one by one would time the host's launches (two kernels and two allocations for
    several splits, one kernel for one split), which a replay does not pay. Compiles it first.
    Writing the step's token again is harmless (the same values at the same place)."""
    decode_attention(query, key, value, bounds, scale, config, new)
    graph = torch.cuda.CUDAGraph()
    # Thread-local: another thread's driver calls (the pre-committer's) are not this capture's.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(_REPEATS):
            decode_attention(query, key, value, bounds, scale, config, new)
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

    Returns:
        ``[batch, 1, heads, head_dim]`` in the query's dtype (transformers' layout).
    """
    c = config if isinstance(config, Config) else Config(config)
    fused = new is not None
    if new is not None:
        key_new, value_new, w_slot, w_token = new
        # Each read at its own strides (V a slice of a fused projection's output, K the
        # rotary's): no copy kernel, unless a last stride is not 1 (the kernel reads rows).
        kn, vn = (t[:, :, 0] if t.stride(-1) == 1 else t[:, :, 0].contiguous() for t in (key_new, value_new))
        ws, wt = w_slot.reshape(-1), w_token.reshape(-1)
    else:
        kn = vn = ws = wt = bounds
    splits = c.splits
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    out = torch.empty((batch, 1, heads, dim), dtype=query.dtype, device=query.device)
    o = out[:, 0]
    if splits == 1:
        acc = lse = o  # not read: the partial kernel writes the output itself
    else:
        acc = torch.empty((batch, heads, splits, dim), dtype=torch.float32, device=query.device)
        lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=query.device)
    q = query[:, :, 0]
    _partial_kernel[(batch, kv_heads, splits)](
        q,
        key,
        value,
        bounds,
        acc,
        lse,
        kn,
        vn,
        ws,
        wt,
        kn.stride(0) if fused else 0,
        kn.stride(1) if fused else 0,
        vn.stride(0) if fused else 0,
        vn.stride(1) if fused else 0,
        q.stride(0),
        q.stride(1),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2) if splits > 1 else 0,
        lse.stride(0),
        lse.stride(1),
        o,
        o.stride(0),
        o.stride(1),
        scale,
        float(softcap) or 1.0,
        int(window),
        GROUP=group,
        GROUP_PAD=max(16, _pow2_at_least(group)),
        HEAD_DIM=dim,
        DIM_PAD=max(16, _pow2_at_least(dim)),
        BLOCK=c.block,
        SPLITS=splits,
        LOOP_WHILE=_INTERPRETED,
        # fp32 caches get fp32 products (Triton's default for fp32 is TF32).
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        # Products in fp32 for bf16 in the interpreter only (see _block).
        UPCAST=_INTERPRETED and query.dtype == torch.bfloat16,
        FUSED=fused,
        CAPPED=bool(softcap),
        SLIDING=bool(window),
        num_warps=c.warps,
        num_stages=c.stages,
    )
    if splits == 1:
        return out
    _merge_kernel[(batch, heads)](
        acc,
        lse,
        o,
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        lse.stride(0),
        lse.stride(1),
        o.stride(0),
        o.stride(1),
        HEAD_DIM=dim,
        DIM_PAD=max(16, _pow2_at_least(dim)),
        SPLITS=splits,
        num_warps=4,
    )
    return out
