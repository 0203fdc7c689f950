"""The running softmax of one KV head's tokens, a block at a time (:func:`fold_tokens`): the
loop at the heart of the decode kernels (:mod:`kvvm.kernels.triton_kernels`) and the cascade's
prefix pass (:mod:`kvvm.kernels.cascade`).

A program folds ``ROWS`` query rows (the query heads sharing the KV head, padded to the 16
rows a tensor-core product takes) over the tokens ``[lo, hi)``. The blocks wholly inside the
range are read without masks, the last partial one with them.

Two ways through a block:

- ``LANES == 1``: the whole block is one product ``q @ K^T`` (the program's warps share its
  columns), one softmax update, one product ``p @ V``.
- ``LANES > 1``: the block is ``LANES`` sub-blocks of consecutive tokens, each folded into a
  running softmax of its own (a batched product whose batch the compiler gives a warp each):
  no reduction and no exchange of ``p`` crosses warps inside the loop, and the lanes are
  merged by their log-sum-exps once, after it. Over an FP8 cache, whose blocks carry twice the
  tokens a byte of a 16-bit one, the loop's instructions a byte are what bound the read rate.

``WIDEN`` (FP8 on a GPU only): K and V widened from e4m3 to fp16 by an opaque conversion of
four codes at a time after a vectorised load from shared memory, instead of the compiler's,
which it moves past the layout change and so gathers V's operand byte by byte (``cvt.rn.
f16x2.e4m3x2`` either way: the same values, exactly).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _cap(x, softcap):
    """``softcap * tanh(x / softcap)``, the tanh from a sigmoid (``tanh(y) = 2 sigmoid(2y) - 1``)."""
    return softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)


@triton.jit
def _widen(x, dtype, WIDEN: tl.constexpr):
    """``x`` (a block of K or V) in ``dtype``, the products' type: with ``WIDEN``, e4m3 codes
    to fp16 four at a time by inline PTX the compiler keeps where it is (see the module)."""
    if WIDEN:
        out = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4,
        )
    else:
        out = x.to(dtype)
    return out


@triton.jit
def _block(
    q, k_base, v_base, t, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap,
    BLOCK: tl.constexpr, PRECISION: tl.constexpr, CAPPED: tl.constexpr, UPCAST: tl.constexpr,
    MASKED: tl.constexpr, WIDEN: tl.constexpr,
):
    """One block of tokens ``t..t+BLOCK`` (those below ``hi`` when ``MASKED``) folded into the
    running softmax: returns the new ``(max, sum, accumulator)``."""
    offs_n = t + tl.arange(0, BLOCK)
    n_mask = offs_n < hi
    rows = offs_n.to(tl.int64)
    kv_mask = (n_mask[:, None] | (not MASKED)) & d_mask[None, :]
    # An FP8 cache's K and V are widened to the query's dtype as they are loaded (a no-op for
    # a cache of the query's dtype); their scales are applied outside the loop.
    k = tl.load(k_base + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
    k = _widen(k, q.dtype, WIDEN == 2)
    if UPCAST:
        # Triton's interpreter multiplies bf16 operands as their raw 16-bit patterns: widened
        # to fp32 there (on a GPU the tensor cores take bf16 as it is).
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
    if CAPPED:
        qk = _cap(qk, softcap)
    if MASKED:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    v = _widen(v, q.dtype, WIDEN >= 1)
    p = p.to(v.dtype)
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_new, acc


@triton.jit
def _lanes_block(
    q3, k_base, v_base, t, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap,
    LANES: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr, CAPPED: tl.constexpr,
    UPCAST: tl.constexpr, MASKED: tl.constexpr, WIDEN: tl.constexpr,
):
    """One block of tokens ``t..t+BLOCK`` as ``LANES`` sub-blocks of consecutive tokens, each
    folded into its lane's running softmax (``m_i``, ``l_i``: ``[LANES, ROWS]``; ``acc``:
    ``[LANES, ROWS, DIM_PAD]``)."""
    SUB: tl.constexpr = BLOCK // LANES
    offs_n = t + tl.arange(0, LANES)[:, None] * SUB + tl.arange(0, SUB)[None, :]
    n_mask = offs_n < hi
    rows = offs_n.to(tl.int64)
    kv_mask = (n_mask[:, :, None] | (not MASKED)) & d_mask[None, None, :]
    k = tl.load(k_base + rows[:, :, None] * stride_kt + offs_d[None, None, :], mask=kv_mask, other=0.0)
    k = _widen(k, q3.dtype, WIDEN == 2)
    q = q3
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k, (0, 2, 1)), input_precision=PRECISION) * sm_scale
    if CAPPED:
        qk = _cap(qk, softcap)
    if MASKED:
        qk = tl.where(n_mask[:, None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 2))
    # A lane with no token yet keeps -inf: its factors are taken against 0, not -inf - -inf.
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(qk - m_safe[:, :, None])
    l_new = l_i * alpha + tl.sum(p, 2)
    v = tl.load(v_base + rows[:, :, None] * stride_vt + offs_d[None, None, :], mask=kv_mask, other=0.0)
    v = _widen(v, q3.dtype, WIDEN >= 1)
    p = p.to(v.dtype)
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, :, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_new, acc


@triton.jit
def _merge_lanes(m_i, l_i, acc):
    """The lanes' running softmaxes (``[LANES, ROWS]``, ``[LANES, ROWS]``, ``[LANES, ROWS,
    DIM]``) as one: ``(max, sum, accumulator)`` of ``ROWS`` rows."""
    m = tl.max(m_i, 0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    w = tl.exp(m_i - m_safe[None, :])
    return m, tl.sum(l_i * w, 0), tl.sum(acc * w[:, :, None], 0)


@triton.jit
def _fold_blocks(
    q, k_base, v_base, lo, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap,
    BLOCK: tl.constexpr, PRECISION: tl.constexpr, CAPPED: tl.constexpr, UPCAST: tl.constexpr,
    LOOP_WHILE: tl.constexpr, LANES: tl.constexpr, WIDEN: tl.constexpr,
):
    """The blocks of ``[lo, hi)``: every whole one unmasked, then the partial one (if any)
    masked. ``q`` and the state are a lane fold's (3-D) when ``LANES > 1``."""
    full = lo + ((hi - lo) // BLOCK) * BLOCK
    if LOOP_WHILE:
        # Triton's interpreter (CPU) takes a loop bound only as a Python int.
        t = lo
        while t < full:
            m_i, l_i, acc = _step(
                q, k_base, v_base, t, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap,
                BLOCK, PRECISION, CAPPED, UPCAST, False, LANES, WIDEN,
            )
            t += BLOCK
    else:
        for t in range(lo, full, BLOCK):
            m_i, l_i, acc = _step(
                q, k_base, v_base, t, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap,
                BLOCK, PRECISION, CAPPED, UPCAST, False, LANES, WIDEN,
            )
    if full < hi:
        m_i, l_i, acc = _step(
            q, k_base, v_base, full, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap,
            BLOCK, PRECISION, CAPPED, UPCAST, True, LANES, WIDEN,
        )
    return m_i, l_i, acc


@triton.jit
def _step(
    q, k_base, v_base, t, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap,
    BLOCK: tl.constexpr, PRECISION: tl.constexpr, CAPPED: tl.constexpr, UPCAST: tl.constexpr,
    MASKED: tl.constexpr, LANES: tl.constexpr, WIDEN: tl.constexpr,
):
    """One block, by :func:`_block` or, with lanes, :func:`_lanes_block`."""
    if LANES == 1:
        m_i, l_i, acc = _block(
            q, k_base, v_base, t, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap,
            BLOCK, PRECISION, CAPPED, UPCAST, MASKED, WIDEN,
        )
    else:
        m_i, l_i, acc = _lanes_block(
            q, k_base, v_base, t, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap,
            LANES, BLOCK, PRECISION, CAPPED, UPCAST, MASKED, WIDEN,
        )
    return m_i, l_i, acc


@triton.jit
def fold_tokens(
    q, k_base, v_base, lo, hi, stride_kt, stride_vt, offs_d, d_mask, sm_scale, softcap,
    ROWS: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    CAPPED: tl.constexpr, UPCAST: tl.constexpr, LOOP_WHILE: tl.constexpr,
    LANES: tl.constexpr = 1, WIDEN: tl.constexpr = 0,
):
    """The running softmax of ``ROWS`` query rows (``q``: ``[ROWS, DIM_PAD]``) over the tokens
    ``[lo, hi)`` of one KV head, ``BLOCK`` at a time, in ``LANES`` lanes (see the module):
    returns its ``(max, sum, accumulator)``."""
    if LANES == 1:
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, DIM_PAD], dtype=tl.float32)
        m_i, l_i, acc = _fold_blocks(
            q, k_base, v_base, lo, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap,
            BLOCK, PRECISION, CAPPED, UPCAST, LOOP_WHILE, LANES, WIDEN,
        )
    else:
        q3 = tl.broadcast_to(q[None, :, :], (LANES, ROWS, DIM_PAD))
        m3 = tl.full([LANES, ROWS], float("-inf"), dtype=tl.float32)
        l3 = tl.zeros([LANES, ROWS], dtype=tl.float32)
        acc3 = tl.zeros([LANES, ROWS, DIM_PAD], dtype=tl.float32)
        m3, l3, acc3 = _fold_blocks(
            q3, k_base, v_base, lo, hi, stride_kt, stride_vt, offs_d, d_mask, m3, l3, acc3, sm_scale, softcap,
            BLOCK, PRECISION, CAPPED, UPCAST, LOOP_WHILE, LANES, WIDEN,
        )
        m_i, l_i, acc = _merge_lanes(m3, l3, acc3)
    return m_i, l_i, acc
