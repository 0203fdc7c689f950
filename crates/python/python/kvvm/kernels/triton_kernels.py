"""The split-KV decode kernels in Triton (:mod:`kvvm.kernels.triton_decode` launches them):
one program per (request, KV head, split of its tokens) folds its blocks into a running
softmax (:func:`kvvm.kernels.triton_fold.fold_tokens`) and stores its partial result
(:func:`_partial_kernel`), a second kernel merges the partial results by their log-sum-exps
(:func:`_merge_kernel`). In a cascade whose private pass is one program per request and KV
head, that program merges the prefix pass's results itself (:func:`_fold_prefix`): no merge
kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_fold import _cap, fold_tokens


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Launched as a programmatic dependent (``PDL``): waits here for the kernel before it
    in the stream to finish and its writes to show (:mod:`kvvm.kernels.device`). Called
    before the program touches any memory."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def let_dependents_launch(PDL: tl.constexpr):
    """Launched as a programmatic dependent (``PDL``): the next kernel may launch once every
    program has passed here (it still waits for this one to finish before reading)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _request(Bounds, Shared, b, window, SLIDING: tl.constexpr, CASCADE: tl.constexpr):
    """Request ``b``'s slot and tokens ``[start, end)``, in one load reduced to scalars; with a
    sliding window the query (token ``end - 1``) sees the window's tokens only; in a cascade,
    the request's first ``Shared[b]`` tokens are its group's (the prefix pass reads them)."""
    offs = tl.arange(0, 4)
    row = tl.load(Bounds + b * 3 + offs, mask=offs < 3, other=0)
    slot = tl.sum(tl.where(offs == 0, row, 0), 0)
    start = tl.sum(tl.where(offs == 1, row, 0), 0)
    end = tl.sum(tl.where(offs == 2, row, 0), 0)
    if SLIDING:
        start = tl.maximum(start, end - window)
    if CASCADE:
        start = start + tl.load(Shared + b)
    return slot, start, end


@triton.jit
def kv_scales(Scales, kvh, scale_v, FP8: tl.constexpr):
    """KV head ``kvh``'s dequantization scales of an FP8 cache (``Scales[kvh]`` for K,
    ``Scales[scale_v + kvh]`` for V: the layer's ``[2, kv_heads]`` fp32 scales); 1 for any
    other cache (``Scales`` is not read)."""
    if FP8:
        k_scale = tl.load(Scales + kvh)
        v_scale = tl.load(Scales + scale_v + kvh)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k_scale, v_scale


@triton.jit
def product_query(q, FP8: tl.constexpr):
    """The query as the products over an FP8 cache take it: a bf16 query as fp16, saturated
    at fp16's largest finite value (65504), so that the blocks of K and V are widened to fp16
    as they are loaded (one conversion instruction for two e4m3 codes, where widening them to
    bf16 takes five, through fp16 and fp32; measured on an H100, the decode kernel then reads
    FP8 at 2.6-2.8 TB/s instead of 2.2). Every e4m3 code is exact in fp16, and so is every
    bf16 value from 2**-14 to 65504 (fp16 keeps 11 significant bits to bf16's 8); a smaller
    element rounds to fp16's subnormals (within 2**-25). ``q`` itself for any other cache or
    query dtype."""
    out = q
    if FP8:
        if q.dtype == tl.bfloat16:
            out = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return out


@triton.jit
def quantize(x, scale, dtype, FP8: tl.constexpr):
    """``x`` as an FP8 cache stores it: divided by its scale, saturated at e4m3's largest
    finite value (448) and rounded to ``dtype`` (the cache's element type); ``x`` itself for
    any other cache. One return: the compiler wants every return of a function to have one
    type, even one a constant condition leaves out."""
    stored = x
    if FP8:
        # Division rounded as IEEE's (``/`` may be approximate on a GPU): the same codes as
        # :func:`kvvm.kernels.fp8.quantize`.
        stored = tl.minimum(tl.maximum(tl.div_rn(x.to(tl.float32), scale), -448.0), 448.0).to(dtype)
    return stored


@triton.jit
def split_range(start, end, split, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Split ``split`` of ``SPLITS`` of the tokens ``[start, end)``: each a whole number of
    blocks (the last what is left)."""
    n = tl.maximum(end - start, 0)
    per_split = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK) * BLOCK
    lo = start + split * per_split
    return lo, tl.minimum(lo + per_split, end)


@triton.jit
def _write_and_fold_new(
    K, V, kn, vn, w_slot, w_token, has_new, kvh, split, q, offs_d, d_mask, m_i, l_i, acc,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, sm_scale, softcap,
    SPLITS: tl.constexpr, CAPPED: tl.constexpr,
):
    """The step's new token (``kn``, ``vn``, in registers): written to its slot and token by
    the first split, attended to from registers by the last one (no program reads it from
    memory, so none races its write). Returns the running softmax with it folded in."""
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
    return m_i, l_i, acc


@triton.jit
def _store_partial(
    Out, Acc, Lse, b, heads, split, offs_d, g_mask, d_mask, m_i, l_i, acc,
    stride_ob, stride_oh, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
    DIRECT: tl.constexpr,
):
    """The split's normalized output: the output itself when one program saw every token
    (``DIRECT``), else a partial result and its log-sum-exp for the merge."""
    has = l_i > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    if DIRECT:
        o_ptr = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        a_ptr = Acc + b.to(tl.int64) * stride_ab + heads[:, None] * stride_ah + split * stride_as
        tl.store(a_ptr + offs_d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(Lse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _no_prefix(
    Lse, b, heads, g_mask, stride_lb, stride_lh,
    GROUP_PAD: tl.constexpr, SPLITS: tl.constexpr, PSPLITS: tl.constexpr, PSPLITS_PAD: tl.constexpr,
):
    """A request no group reads for: its prefix pass's columns (after the ``SPLITS`` of its
    own pass) weigh nothing in the merge."""
    offs_p = tl.arange(0, PSPLITS_PAD)
    l_ptr = Lse + b.to(tl.int64) * stride_lb + heads[:, None] * stride_lh + SPLITS + offs_p[None, :]
    none = tl.full([GROUP_PAD, PSPLITS_PAD], float("-inf"), dtype=tl.float32)
    tl.store(l_ptr, none, mask=g_mask[:, None] & (offs_p < PSPLITS)[None, :])


@triton.jit
def _fold_prefix(
    Acc, Lse, Shared, b, heads, g_mask, offs_d, d_mask, m_i, l_i, acc,
    stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
    FIRST: tl.constexpr, PSPLITS: tl.constexpr,
):
    """A cascade's merge, done by the request's one private program: the prefix pass's
    ``PSPLITS`` columns of partial results (from column ``FIRST``; written by the pass
    launched before this one) folded into the running softmax of the request's own tokens.
    Nothing is read for a request in no group (its columns were not written)."""
    if tl.load(Shared + b) > 0:
        a_row = Acc + b.to(tl.int64) * stride_ab + heads[:, None] * stride_ah + offs_d[None, :]
        l_row = Lse + b.to(tl.int64) * stride_lb + heads * stride_lh
        m_i, l_i, acc = fold_columns(a_row, l_row, g_mask, d_mask, m_i, l_i, acc, stride_as, FIRST, PSPLITS, "")
    return m_i, l_i, acc


@triton.jit
def fold_columns(
    a_row, l_row, rows, d_mask, m_i, l_i, acc, stride_as,
    FIRST: tl.constexpr, COLUMNS: tl.constexpr, CACHE: tl.constexpr,
):
    """Columns ``FIRST`` to ``FIRST + COLUMNS`` of partial results folded into a running
    softmax by their log-sum-exps: ``a_row`` points at each row's column 0 (``[ROWS,
    DIM_PAD]``), ``l_row`` at its log-sum-exp's; only ``rows`` are read, with the loads'
    cache modifier ``CACHE``. Returns the new ``(max, sum, accumulator)``."""
    for j in tl.static_range(COLUMNS):
        lse = tl.load(l_row + FIRST + j, mask=rows, other=float("-inf"), cache_modifier=CACHE)
        m_new = tl.maximum(m_i, lse)
        live = m_new > float("-inf")
        m_safe = tl.where(live, m_new, 0.0)
        alpha = tl.where(live, tl.exp(m_i - m_safe), 0.0)
        beta = tl.where(live, tl.exp(lse - m_safe), 0.0)
        # A column that weighs nothing is not read (an empty split's may hold anything).
        part = tl.load(
            a_row + (FIRST + j) * stride_as, mask=(rows & (beta > 0.0))[:, None] & d_mask[None, :], other=0.0,
            cache_modifier=CACHE,
        )
        l_i = l_i * alpha + beta
        acc = acc * alpha[:, None] + part * beta[:, None]
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _partial_kernel(
    Q, K, V, Bounds, Acc, Lse, KN, VN, WS, WT,
    stride_knb, stride_knh, stride_vnb, stride_vnh,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ab, stride_ah, stride_as,
    stride_lb, stride_lh,
    Out, stride_ob, stride_oh,
    sm_scale, softcap, window, Shared, base, Scales, scale_v, Arrivals, heads_total,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK: tl.constexpr, SPLITS: tl.constexpr, LOOP_WHILE: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, FUSED: tl.constexpr, CAPPED: tl.constexpr, SLIDING: tl.constexpr,
    CASCADE: tl.constexpr, PSPLITS: tl.constexpr, PSPLITS_PAD: tl.constexpr, DIRECT: tl.constexpr,
    FP8: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr, WIDEN: tl.constexpr, MASK_EVERY: tl.constexpr,
    ARRIVE: tl.constexpr,
):
    partial_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2),
        Q, K, V, Bounds, Acc, Lse, KN, VN, WS, WT,
        stride_knb, stride_knh, stride_vnb, stride_vnh, stride_qb, stride_qh,
        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_ab, stride_ah, stride_as, stride_lb, stride_lh, Out, stride_ob, stride_oh,
        sm_scale, softcap, window, Shared, base, Scales, scale_v, Arrivals, heads_total,
        GROUP, GROUP_PAD, HEAD_DIM, DIM_PAD, BLOCK, SPLITS, LOOP_WHILE, PRECISION, UPCAST, FUSED, CAPPED, SLIDING,
        CASCADE, PSPLITS, PSPLITS_PAD, DIRECT, FP8, MERGE, PDL, WIDEN, ARRIVE, MASK_EVERY,
    )


@triton.jit
def partial_program(
    b, kvh, split,
    Q, K, V, Bounds, Acc, Lse, KN, VN, WS, WT,
    stride_knb, stride_knh, stride_vnb, stride_vnh,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ab, stride_ah, stride_as,
    stride_lb, stride_lh,
    Out, stride_ob, stride_oh,
    sm_scale, softcap, window, Shared, base, Scales, scale_v, Arrivals, heads_total,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK: tl.constexpr, SPLITS: tl.constexpr, LOOP_WHILE: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, FUSED: tl.constexpr, CAPPED: tl.constexpr, SLIDING: tl.constexpr,
    CASCADE: tl.constexpr, PSPLITS: tl.constexpr, PSPLITS_PAD: tl.constexpr, DIRECT: tl.constexpr,
    FP8: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr, WIDEN: tl.constexpr, ARRIVE: tl.constexpr,
    MASK_EVERY: tl.constexpr,
):
    """The program of request ``b``, KV head ``kvh`` and split ``split`` of its own tokens
    (``MASK_EVERY``: every block of them masked in one loop, :mod:`kvvm.kernels.triton_fold`).
    With ``ARRIVE`` (a cascade whose prefix pass runs in the same launch or beside it, one split), a
    request in a group writes its partial result as column 0 and arrives
    (:func:`arrive_and_merge`: the last of the row's programs merges it); one in no group
    writes its output."""
    wait_for_inputs(PDL)
    slot, start, end = _request(Bounds, Shared, b, window, SLIDING, CASCADE)
    # An FP8 cache: K's scale folds into the softmax scale, V's into the output.
    k_scale, v_scale = kv_scales(Scales, kvh, scale_v, FP8)
    sm_scale = sm_scale * k_scale
    if FUSED:
        # The step's new token is attended from registers (see _write_and_fold_new): the
        # range read from memory ends before it when its write lands at the end.
        w_slot = tl.load(WS + b)
        w_token = tl.load(WT + b)
        has_new = (w_slot == slot) & (w_token == end - 1)
        end = end - has_new.to(end.dtype)
        w_slot = w_slot - base
    # Slots are counted from the one ``K`` and ``V`` point into (see decode_attention).
    slot = slot - base
    lo, hi = split_range(start, end, split, SPLITS, BLOCK)

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
    q = product_query(q, FP8)
    k_base = K + slot.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + slot.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh

    m_i, l_i, acc = fold_tokens(
        q, k_base, v_base, lo, hi, stride_kt, stride_vt, offs_d, d_mask, sm_scale, softcap,
        GROUP_PAD, DIM_PAD, BLOCK, PRECISION, CAPPED, UPCAST, LOOP_WHILE, WIDEN, MASK_EVERY,
    )
    let_dependents_launch(PDL)

    if FUSED:
        kn = tl.load(KN + b.to(tl.int64) * stride_knb + kvh.to(tl.int64) * stride_knh + offs_d, mask=d_mask, other=0.0)
        vn = tl.load(VN + b.to(tl.int64) * stride_vnb + kvh.to(tl.int64) * stride_vnh + offs_d, mask=d_mask, other=0.0)
        # Written as stored and attended as read back (in the scales' units, as the rest).
        kn = quantize(kn, k_scale, K.dtype.element_ty, FP8)
        vn = quantize(vn, v_scale, V.dtype.element_ty, FP8)
        m_i, l_i, acc = _write_and_fold_new(
            K, V, kn, vn, w_slot, w_token, has_new, kvh, split, q, offs_d, d_mask, m_i, l_i, acc,
            stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, sm_scale, softcap, SPLITS, CAPPED,
        )
    if FP8:
        acc = acc * v_scale
    _finish(
        Acc, Lse, Out, Shared, Arrivals, b, heads, split, offs_d, g_mask, d_mask, m_i, l_i, acc, heads_total,
        stride_ob, stride_oh, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
        GROUP_PAD, SPLITS, CASCADE, PSPLITS, PSPLITS_PAD, DIRECT, MERGE, ARRIVE,
    )


@triton.jit
def _finish(
    Acc, Lse, Out, Shared, Arrivals, b, heads, split, offs_d, g_mask, d_mask, m_i, l_i, acc, heads_total,
    stride_ob, stride_oh, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
    GROUP_PAD: tl.constexpr, SPLITS: tl.constexpr, CASCADE: tl.constexpr, PSPLITS: tl.constexpr,
    PSPLITS_PAD: tl.constexpr, DIRECT: tl.constexpr, MERGE: tl.constexpr, ARRIVE: tl.constexpr,
):
    """A private program's result written: counted and merged by the last of its columns'
    writers (``ARRIVE``), merged with the prefix's columns it reads itself (``MERGE``), or
    stored as the output or a partial result."""
    if ARRIVE:
        if tl.load(Shared + b) > 0:
            _store_partial(
                Out, Acc, Lse, b, heads, 0, offs_d, g_mask, d_mask, m_i, l_i, acc,
                stride_ob, stride_oh, stride_ab, stride_ah, stride_as, stride_lb, stride_lh, False,
            )
            rows_b = tl.full([GROUP_PAD], 0, dtype=tl.int32) + b
            arrive_and_merge(
                Acc, Lse, Out, Arrivals, rows_b, heads, g_mask, offs_d, d_mask, heads_total,
                stride_ab, stride_ah, stride_as, stride_lb, stride_lh, stride_ob, stride_oh, 1 + PSPLITS,
            )
        else:
            _store_partial(
                Out, Acc, Lse, b, heads, 0, offs_d, g_mask, d_mask, m_i, l_i, acc,
                stride_ob, stride_oh, stride_ab, stride_ah, stride_as, stride_lb, stride_lh, True,
            )
    else:
        if MERGE:
            m_i, l_i, acc = _fold_prefix(
                Acc, Lse, Shared, b, heads, g_mask, offs_d, d_mask, m_i, l_i, acc,
                stride_ab, stride_ah, stride_as, stride_lb, stride_lh, SPLITS, PSPLITS,
            )
        elif CASCADE:
            if (split == 0) & (tl.load(Shared + b) == 0):
                _no_prefix(Lse, b, heads, g_mask, stride_lb, stride_lh, GROUP_PAD, SPLITS, PSPLITS, PSPLITS_PAD)
        _store_partial(
            Out, Acc, Lse, b, heads, split, offs_d, g_mask, d_mask, m_i, l_i, acc,
            stride_ob, stride_oh, stride_ab, stride_ah, stride_as, stride_lb, stride_lh, DIRECT,
        )


@triton.jit
def arrive_and_merge(
    Acc, Lse, Out, Arrivals, rows_b, rows_h, valid, offs_d, d_mask, heads_total,
    stride_ab, stride_ah, stride_as, stride_lb, stride_lh, stride_ob, stride_oh,
    COLUMNS: tl.constexpr,
):
    """Arrival at rows (request ``rows_b``, query head ``rows_h``; ``valid`` ones only) whose
    column of partial results this program has just written: a row's ``COLUMNS`` columns
    are written by as many programs of one launch, each counting itself in ``Arrivals``
    (int32 ``[batch, heads_total]``, zero between launches); the program that counts a row
    last merges its columns by their log-sum-exps into ``Out`` and sets its count back to
    zero.

    The order that makes this safe: a barrier puts every thread's stores of the column
    before any of the program's arrivals, each arrival (an atomic add, acquire-release at
    the device's scope) publishes them and sees every arrival before it, a second barrier
    puts the merging program's loads after its arrivals, and the loads bypass the
    multiprocessor's L1 cache (which other multiprocessors' writes do not reach)."""
    tl.debug_barrier()
    count = Arrivals + rows_b.to(tl.int64) * heads_total + rows_h
    seen = tl.atomic_add(count, 1, mask=valid, sem="acq_rel", scope="gpu")
    last = valid & (seen == COLUMNS - 1)
    tl.debug_barrier()
    if tl.max(last.to(tl.int32), 0) > 0:
        a_row = Acc + rows_b.to(tl.int64)[:, None] * stride_ab + rows_h[:, None] * stride_ah + offs_d[None, :]
        l_row = Lse + rows_b.to(tl.int64) * stride_lb + rows_h * stride_lh
        m_i = tl.full(rows_h.shape, float("-inf"), dtype=tl.float32)
        l_i = tl.zeros(rows_h.shape, dtype=tl.float32)
        acc = tl.zeros(a_row.shape, dtype=tl.float32)
        m_i, l_i, acc = fold_columns(a_row, l_row, last, d_mask, m_i, l_i, acc, stride_as, 0, COLUMNS, ".cg")
        has = l_i > 0.0
        out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        o_ptr = Out + rows_b.to(tl.int64)[:, None] * stride_ob + rows_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=last[:, None] & d_mask[None, :])
        tl.store(count, 0, mask=last)


@triton.jit
def _merge_kernel(
    Acc, Lse, Out,
    stride_ab, stride_ah, stride_as,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    wait_for_inputs(PDL)
    let_dependents_launch(PDL)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_mask = offs_s < SPLITS
    offs_d = tl.arange(0, DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(Lse + b.to(tl.int64) * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    finite = m > float("-inf")
    w = tl.where(finite, tl.exp(lse - tl.where(finite, m, 0.0)), 0.0)
    total = tl.sum(w, 0)
    parts = tl.load(
        Acc + b.to(tl.int64) * stride_ab + h * stride_ah + offs_s[:, None] * stride_as + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    # A part that weighs nothing is not read into the sum (a cascade's unwritten column may
    # hold anything).
    out = tl.sum(tl.where(w[:, None] > 0.0, parts * w[:, None], 0.0), 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=d_mask,
    )
