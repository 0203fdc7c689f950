"""The running softmax of one KV head's tokens, a block at a time (:func:`fold_tokens`): the
loop at the heart of the decode kernels (:mod:`kvvm.kernels.triton_kernels`) and the cascade's
prefix pass (:mod:`kvvm.kernels.cascade`); its update of one block's scores
(:func:`scores`, :func:`fold_scores`) is the prefill kernel's too
(:mod:`kvvm.kernels.triton_prefill`).

A program folds ``ROWS`` query rows (the query heads sharing the KV head, padded to the 16
rows a tensor-core product takes) over the tokens ``[lo, hi)``: each block is one product
``q @ K^T``, one softmax update and one product ``p @ V``. The blocks wholly inside the range
are read without masks in a loop the compiler pipelines, the last partial one with them after
it; or (``MASK_EVERY``) every block in that loop, each masked to the range: the loads of the
last block then leave with the others' instead of after them, a memory round trip saved for a
range of a few blocks (a cascade's private tokens), a comparison a row added to every block.

The softmax runs in base 2 over the unscaled products (:func:`fold_tokens`): one
multiply-add and one ``ex2`` a score, where the natural exponent costs a multiply more.

``WIDEN`` (an FP8 cache read by a 16-bit query, on a GPU): V's e4m3 codes are widened to fp16
by inline PTX, four at a time, as they come from shared memory in rows. The compiler's own
conversion is moved past the change to the product's operand layout, where each thread holds
consecutive tokens of one dimension: V's codes then come one byte at a time (128 one-byte
loads a thread for a block of 128 tokens, each held in a register until packed), which costs
registers and instructions; the inline conversion (which the compiler leaves where it is)
widens whole rows and lets the compiler move fp16 values instead, through a transposing
matrix load. The values are the same either way (``cvt.rn.f16x2.e4m3x2`` converts exactly).
Whichever is faster for a shape is the tuner's to find (:mod:`kvvm.kernels.triton_decode`).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
"""``log2(e)``: a natural exponent times it is the base-2 one."""
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
"""``ln(2)``: a base-2 exponent times it is the natural one."""


@triton.jit
def _cap(x, softcap):
    """``softcap * tanh(x / softcap)``, the tanh from a sigmoid (``tanh(y) = 2 sigmoid(2y) - 1``)."""
    return softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)


@triton.jit
def _widen(x, dtype, WIDEN: tl.constexpr):
    """``x`` (a block of V) in ``dtype``, the products' type: with ``WIDEN``, e4m3 codes to
    fp16 four at a time by inline PTX the compiler keeps where it is (see the module)."""
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
def score_scale(sm_scale, CAPPED: tl.constexpr):
    """What :func:`fold_scores` multiplies :func:`scores` by for their base-2 exponents:
    ``sm_scale * log2(e)``, or 1 where the scores are capped (already scaled and in base 2)."""
    scale2 = sm_scale * LOG2E
    if CAPPED:
        scale2 = 1.0
    return scale2


@triton.jit
def scores(qk, sm_scale, softcap, CAPPED: tl.constexpr):
    """A block's products ``q.k`` as the running softmax takes them: as they are (the scale
    is positive, so it commutes with the max and :func:`fold_scores` applies it with the
    exponent's multiply-add), or, capped, scaled, capped and taken to base 2."""
    if CAPPED:
        qk = _cap(qk * sm_scale, softcap) * LOG2E
    return qk


@triton.jit
def fold_scores(qk, m_i, l_i, scale2, SAFE: tl.constexpr):
    """One block of :func:`scores` (masked ones ``-inf``) into the running max ``m_i`` (in
    the scores' units) and sum ``l_i``: returns the new max and sum, the factor the
    accumulator is rescaled by and the block's weights, each one multiply-add and one
    ``ex2`` a score. ``SAFE``: a row whose every score so far is masked stays at ``-inf``,
    its weights 0 (not NaN)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = m_new
    if SAFE:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m_i - m_ref) * scale2)
    p = tl.exp2(qk * scale2 - (m_ref * scale2)[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def natural_max(m_i, sm_scale, CAPPED: tl.constexpr):
    """A running max of :func:`scores` in the natural exponent's units (a score
    ``sm_scale * q.k``, capped when ``CAPPED``)."""
    if CAPPED:
        m_i = m_i * LN2
    else:
        m_i = m_i * sm_scale
    return m_i


@triton.jit
def _block(
    q, k_base, v_base, t, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap, scale2,
    BLOCK: tl.constexpr, PRECISION: tl.constexpr, CAPPED: tl.constexpr, UPCAST: tl.constexpr,
    MASKED: tl.constexpr, WIDEN: tl.constexpr,
):
    """One block of tokens ``t..t+BLOCK`` (those below ``hi`` when ``MASKED``; all of them
    otherwise) folded into the running softmax: returns the new ``(max, sum, accumulator)``,
    the max in the scores' units (see :func:`fold_tokens`)."""
    offs_n = t + tl.arange(0, BLOCK)
    n_mask = offs_n < hi
    rows = offs_n.to(tl.int64)
    kv_mask = (n_mask[:, None] | (not MASKED)) & d_mask[None, :]
    # An FP8 cache's K and V are widened to the query's dtype as they are loaded (a no-op for
    # a cache of the query's dtype); their scales are applied outside the loop.
    k = tl.load(k_base + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    if UPCAST:
        # Triton's interpreter multiplies bf16 operands as their raw 16-bit patterns: widened
        # to fp32 there (on a GPU the tensor cores take bf16 as it is).
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    qk = scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), sm_scale, softcap, CAPPED)
    if MASKED:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new, l_new, alpha, p = fold_scores(qk, m_i, l_i, scale2, False)
    v = tl.load(v_base + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    v = _widen(v, q.dtype, WIDEN)
    p = p.to(v.dtype)
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_new, acc


@triton.jit
def fold_tokens(
    q, k_base, v_base, lo, hi, stride_kt, stride_vt, offs_d, d_mask, sm_scale, softcap,
    ROWS: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    CAPPED: tl.constexpr, UPCAST: tl.constexpr, LOOP_WHILE: tl.constexpr, WIDEN: tl.constexpr = False,
    MASK_EVERY: tl.constexpr = False,
):
    """The running softmax of ``ROWS`` query rows (``q``: ``[ROWS, DIM_PAD]``) over the tokens
    ``[lo, hi)`` of one KV head, ``BLOCK`` at a time: every whole block unmasked, then the
    partial one (if any) masked; with ``MASK_EVERY``, every block masked in one loop (see the
    module). Returns its ``(max, sum, accumulator)``, the max in the natural exponent's units
    (a score ``sm_scale * q.k``, capped when ``CAPPED``).

    Inside, the softmax runs in base 2 over the unscaled products (the scale is positive, so
    it commutes with the max): a score's exponential is one multiply-add and one ``ex2``,
    ``2^(qk * scale2 - max * scale2)``, where ``scale2`` is ``sm_scale * log2(e)`` (a capped
    score is scaled and capped first, then taken to base 2, and ``scale2`` is 1)."""
    scale2 = score_scale(sm_scale, CAPPED)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], dtype=tl.float32)
    # The loop's end: past the last whole block, or the range's own end.
    full = hi if MASK_EVERY else lo + ((hi - lo) // BLOCK) * BLOCK
    if LOOP_WHILE:
        # Triton's interpreter (CPU) takes a loop bound only as a Python int.
        t = lo
        while t < full:
            m_i, l_i, acc = _block(
                q, k_base, v_base, t, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap, scale2,
                BLOCK, PRECISION, CAPPED, UPCAST, MASK_EVERY, WIDEN,
            )
            t += BLOCK
    else:
        for t in range(lo, full, BLOCK):
            m_i, l_i, acc = _block(
                q, k_base, v_base, t, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap, scale2,
                BLOCK, PRECISION, CAPPED, UPCAST, MASK_EVERY, WIDEN,
            )
    if not MASK_EVERY:
        if full < hi:
            m_i, l_i, acc = _block(
                q, k_base, v_base, full, hi, stride_kt, stride_vt, offs_d, d_mask, m_i, l_i, acc, sm_scale, softcap, scale2,
                BLOCK, PRECISION, CAPPED, UPCAST, True, WIDEN,
            )
    return natural_max(m_i, sm_scale, CAPPED), l_i, acc
