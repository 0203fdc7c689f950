"""Attention of several query tokens per request (a prefill chunk) in Triton, over kvvm's
full-length K/V and each request's token range read from the device: what the ``"triton"``
kernel runs for more than one query token, and what ``"auto"`` picks on CUDA for an FP8 cache
(FlashAttention takes no FP8).

One program per (request, query head, block of ``BLOCK_M`` query tokens) folds the blocks of
keys its queries see into a running softmax: from the request's first token (with a sliding
``window``, from the first its earliest query sees) to its last query, causal within the
chunk. The queries are each request's last ``q`` tokens, ``end - q .. end - 1``. An FP8
cache's K and V are widened to the query's dtype as each block is loaded, K's scale folded
into the softmax scale and V's into the output (:mod:`kvvm.kernels.fp8`): no dequantized copy.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check it without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode import _INTERPRETED, _pow2_at_least, from_last_slot, precision, upcast
from .triton_fold import fold_scores, score_scale, scores
from .triton_kernels import _request, kv_scales, product_query

__all__ = ["prefill_attention"]

#: Query tokens and key tokens a program takes per block.
BLOCK_M, BLOCK_N = 64, 64


@triton.jit
def _prefill_block(
    q, k_base, v_base, t, lo, hi, pos, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap,
    scale2, window, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, CAPPED: tl.constexpr, UPCAST: tl.constexpr,
    SLIDING: tl.constexpr,
):
    """Keys ``t..t+BLOCK_N`` (those in ``[lo, hi)``) folded into the queries at positions
    ``pos``, each seeing the keys at or before itself (and, with a window, after ``pos -
    window``); ``scale2``: the scores' base-2 scale (:func:`~kvvm.kernels.triton_fold.score_scale`)."""
    offs_n = t + tl.arange(0, BLOCK_N)
    n_mask = (offs_n >= lo) & (offs_n < hi)
    rows = offs_n.to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(v_base + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), sm_scale, softcap, CAPPED)
    seen = n_mask[None, :] & (offs_n[None, :] <= pos[:, None])
    if SLIDING:
        seen = seen & (offs_n[None, :] > pos[:, None] - window)
    qk = tl.where(seen, qk, float("-inf"))
    # A row that has seen nothing yet stays at -inf: its terms are 0, not NaN.
    m_new, l_i, alpha, p = fold_scores(qk, m_i, l_i, scale2, True)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    Q, K, V, Out, Bounds, Scales, scale_v,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_ot, stride_oh,
    sm_scale, softcap, window, q_len, base,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, LOOP_WHILE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    CAPPED: tl.constexpr, SLIDING: tl.constexpr, FP8: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    block = tl.program_id(2)
    slot, start, end = _request(Bounds, Bounds, b, 0, False, False)
    slot = slot - base
    kvh = h // GROUP
    k_scale, v_scale = kv_scales(Scales, kvh, scale_v, FP8)
    sm_scale = sm_scale * k_scale
    scale2 = score_scale(sm_scale, CAPPED)

    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    pos = end - q_len + offs_m
    offs_d = tl.arange(0, DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None].to(tl.int64) * stride_qt
        + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q = product_query(q, FP8)
    # The keys this block's queries see: from the request's first (the earliest query's
    # window's) to the last query's own.
    lo = start
    if SLIDING:
        lo = tl.maximum(start, end - q_len + block * BLOCK_M - window + 1)
    hi = tl.minimum(end, end - q_len + tl.minimum((block + 1) * BLOCK_M, q_len))
    k_base = K + slot.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + slot.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    first = lo - lo % BLOCK_N
    if LOOP_WHILE:
        # Triton's interpreter (CPU) takes a loop bound only as a Python int.
        t = first
        while t < hi:
            m_i, l_i, acc = _prefill_block(
                q, k_base, v_base, t, lo, hi, pos, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale,
                softcap, scale2, window, BLOCK_N, PRECISION, CAPPED, UPCAST, SLIDING,
            )
            t += BLOCK_N
    else:
        for t in range(first, hi, BLOCK_N):
            m_i, l_i, acc = _prefill_block(
                q, k_base, v_base, t, lo, hi, pos, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale,
                softcap, scale2, window, BLOCK_N, PRECISION, CAPPED, UPCAST, SLIDING,
            )
    has = l_i > 0.0
    out = tl.where(has[:, None], acc * v_scale / tl.where(has, l_i, 1.0)[:, None], 0.0)
    o_ptr = (
        Out + b.to(tl.int64) * stride_ob + offs_m[:, None].to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh
        + offs_d[None, :]
    )
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each request's last ``q`` tokens over its tokens.

    Args:
        query: ``[batch, heads, q, head_dim]`` (any strides with a unit last one).
        key, value: ``[slots, kv_heads, tokens, head_dim]``, unit last stride: full-length
            views (only ``bounds`` decides which tokens are read), their last slot's first
            token mapped (kvvm's scratch slot).
        bounds: int32 ``[batch, 3]`` on the device: each request's slot and tokens ``[start,
            end)``, the queries being tokens ``end - q .. end - 1`` (causal among themselves).
        scale: the softmax scale.
        window: a sliding window: the query at token ``p`` sees the tokens ``p - window < k <=
            p`` (0: all).
        softcap: the attention-logit soft cap (0: none).
        kv_scales: K and V are an FP8 cache's, of these scales (fp32 ``[2, kv_heads]``).

    Returns:
        ``[batch, q, heads, head_dim]`` in the query's dtype (a query that sees no token: zeros).
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    out = torch.empty((batch, q_len, heads, dim), dtype=query.dtype, device=query.device)
    if kv_scales is not None:
        kv_scales = kv_scales.to(torch.float32).contiguous()
    base, k_from, v_from = from_last_slot(key, value)
    _prefill_kernel[(batch, heads, triton.cdiv(q_len, BLOCK_M))](
        query, k_from, v_from, out, bounds, bounds if kv_scales is None else kv_scales, kv_heads,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        scale, float(softcap) or 1.0, int(window), q_len, base,
        GROUP=heads // kv_heads, HEAD_DIM=dim, DIM_PAD=max(16, _pow2_at_least(dim)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        LOOP_WHILE=_INTERPRETED, PRECISION=precision(query.dtype), UPCAST=upcast(query.dtype),
        CAPPED=bool(softcap), SLIDING=bool(window), FP8=kv_scales is not None,
        num_warps=4, num_stages=2,
    )
    return out
