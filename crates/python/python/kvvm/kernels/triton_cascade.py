"""The cascade's kernels (:mod:`kvvm.kernels.cascade`): the prefix pass, a launch of its own
(:func:`_prefix_kernel`: before the private pass, or beside it on a second stream, each
column counted as in a launch together) or together with the private pass
(:func:`_together_kernel`).

Together, one launch holds the prefix pass's programs first and then one program per request
and KV head for its own tokens: the prefix pass's few long programs no longer run alone
before the private pass's many short ones (each prefix program folds a group's many query
rows over a split of the prefix, a chain of dependent blocks; each private program two or
four blocks), and whichever program writes a request's head's last column of partial results
merges them (:func:`~kvvm.kernels.triton_kernels.arrive_and_merge`), so no merge kernel runs
either.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_fold import fold_tokens
from .triton_kernels import (
    arrive_and_merge,
    kv_scales,
    let_dependents_launch,
    partial_program,
    product_query,
    split_range,
    wait_for_inputs,
)


@triton.jit
def _prefix_kernel(
    Q, K, V, Groups, Items, Acc, Lse, Out, Arrivals,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ab, stride_ah, stride_as,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    sm_scale, softcap, base, Scales, scale_v, heads_total,
    TILE: tl.constexpr, KV_HEADS: tl.constexpr, PROGRAMS: tl.constexpr, LAPS: tl.constexpr,
    GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK: tl.constexpr, SPLITS: tl.constexpr, PSPLITS: tl.constexpr, LOOP_WHILE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, CAPPED: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
    ARRIVE: tl.constexpr,
):
    # With ARRIVE (the private pass launched beside this one), each column is counted as it
    # is written and the last of a row's writers merges it into Out.
    wait_for_inputs(PDL)
    prefix_worker(
        tl.program_id(0), Q, K, V, Groups, Items, Acc, Lse, Out, stride_ob, stride_oh, Arrivals, heads_total,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_ab, stride_ah, stride_as, stride_lb, stride_lh, sm_scale, softcap, base, Scales, scale_v,
        TILE, KV_HEADS, PROGRAMS, LAPS, GROUP, GROUP_POW2, HEAD_DIM, DIM_PAD, BLOCK, SPLITS, PSPLITS, LOOP_WHILE,
        PRECISION, UPCAST, CAPPED, FP8, ARRIVE,
    )
    let_dependents_launch(PDL)


@triton.jit
def prefix_worker(
    program, Q, K, V, Groups, Items, Acc, Lse, Out, stride_ob, stride_oh, Arrivals, heads_total,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ab, stride_ah, stride_as, stride_lb, stride_lh, sm_scale, softcap, base, Scales, scale_v,
    TILE: tl.constexpr, KV_HEADS: tl.constexpr, PROGRAMS: tl.constexpr, LAPS: tl.constexpr,
    GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK: tl.constexpr, SPLITS: tl.constexpr, PSPLITS: tl.constexpr, LOOP_WHILE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, CAPPED: tl.constexpr, FP8: tl.constexpr, ARRIVE: tl.constexpr,
):
    """Prefix program ``program`` of ``PROGRAMS``: its work units, one after another."""
    # Each program walks the work units (item, KV head, split) from its index by the
    # programs' count: items fastest, so that neighbouring programs take one group's items
    # and read the same blocks at about the same time. LAPS covers the most units the
    # tables can hold; a lap past the step's units does nothing.
    count = tl.load(Items)
    units = count * KV_HEADS * PSPLITS
    for lap in range(LAPS):
        unit = program + lap * PROGRAMS
        if unit < units:
            _prefix_unit(
                Q, K, V, Groups, Items, Acc, Lse, Out, stride_ob, stride_oh, Arrivals, heads_total, unit, count,
                stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                stride_ab, stride_ah, stride_as, stride_lb, stride_lh, sm_scale, softcap, base, Scales, scale_v,
                TILE, KV_HEADS, GROUP, GROUP_POW2, HEAD_DIM, DIM_PAD, BLOCK, SPLITS, PSPLITS, LOOP_WHILE,
                PRECISION, UPCAST, CAPPED, FP8, ARRIVE,
            )


@triton.jit
def _prefix_unit(
    Q, K, V, Groups, Items, Acc, Lse, Out, stride_ob, stride_oh, Arrivals, heads_total, unit, count,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ab, stride_ah, stride_as, stride_lb, stride_lh, sm_scale, softcap, base, Scales, scale_v,
    TILE: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
    PSPLITS: tl.constexpr, LOOP_WHILE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    CAPPED: tl.constexpr, FP8: tl.constexpr, ARRIVE: tl.constexpr,
):
    """One work unit: an item's members' queries of one KV head over one split of their
    group's prefix, written as the split's column of partial results (with ``ARRIVE``,
    then counted: see :func:`~kvvm.kernels.triton_kernels.arrive_and_merge`)."""
    item = unit % count
    kvh = (unit // count) % KV_HEADS
    split = unit // (count * KV_HEADS)
    row = Items + (1 + item).to(tl.int64) * (1 + TILE)
    g = tl.load(row)
    offs3 = tl.arange(0, 4)
    row3 = tl.load(Groups + g * 3 + offs3, mask=offs3 < 3, other=0)
    slot = tl.sum(tl.where(offs3 == 0, row3, 0), 0)
    start = tl.sum(tl.where(offs3 == 1, row3, 0), 0)
    n = tl.sum(tl.where(offs3 == 2, row3, 0), 0)
    # Slots are counted from the one ``K`` and ``V`` point into (see decode_attention).
    slot = slot - base

    rows = tl.arange(0, TILE * GROUP_POW2)
    member = tl.load(row + 1 + rows // GROUP_POW2)
    within = rows % GROUP_POW2
    valid = (member >= 0) & (within < GROUP)
    member = tl.maximum(member, 0).to(tl.int64)
    heads = kvh * GROUP + within
    offs_d = tl.arange(0, DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + member[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    q = product_query(q, FP8)
    lo, hi = split_range(start, start + n, split, PSPLITS, BLOCK)
    # An FP8 cache's scales: K's folded into the softmax scale, V's into the output.
    k_scale, v_scale = kv_scales(Scales, kvh, scale_v, FP8)
    k_base = K + slot.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + slot.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh

    m_i, l_i, acc = fold_tokens(
        q, k_base, v_base, lo, hi, stride_kt, stride_vt, offs_d, d_mask, sm_scale * k_scale, softcap,
        TILE * GROUP_POW2, DIM_PAD, BLOCK, PRECISION, CAPPED, UPCAST, LOOP_WHILE,
    )

    has = l_i > 0.0
    out = tl.where(has[:, None], acc * v_scale / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    column = SPLITS + split
    a_ptr = Acc + member[:, None] * stride_ab + heads[:, None] * stride_ah + column * stride_as + offs_d[None, :]
    tl.store(a_ptr, out, mask=valid[:, None] & d_mask[None, :])
    tl.store(Lse + member * stride_lb + heads * stride_lh + column, lse, mask=valid)
    if ARRIVE:
        arrive_and_merge(
            Acc, Lse, Out, Arrivals, member, heads, valid, offs_d, d_mask, heads_total,
            stride_ab, stride_ah, stride_as, stride_lb, stride_lh, stride_ob, stride_oh, SPLITS + PSPLITS,
        )


@triton.jit
def _together_kernel(
    Q, K, V, Bounds, Acc, Lse, KN, VN, WS, WT, Groups, Items, Arrivals,
    stride_knb, stride_knh, stride_vnb, stride_vnh,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ab, stride_ah, stride_as,
    stride_lb, stride_lh,
    Out, stride_ob, stride_oh,
    sm_scale, softcap, Shared, base, Scales, scale_v, heads_total,
    TILE: tl.constexpr, KV_HEADS: tl.constexpr, PROGRAMS: tl.constexpr, LAPS: tl.constexpr,
    GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, PREFIX_BLOCK: tl.constexpr, PSPLITS: tl.constexpr,
    PSPLITS_PAD: tl.constexpr, LOOP_WHILE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    FUSED: tl.constexpr, CAPPED: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr, WIDEN: tl.constexpr,
    PREFIX_FIRST: tl.constexpr, MASK_EVERY: tl.constexpr,
):
    """The prefix pass's ``PROGRAMS`` programs and one program per request and KV head (KV
    heads fastest) over the request's own tokens, the prefix pass's first
    (``PREFIX_FIRST``) or last; every column counted, the last of a row's merging it."""
    pid = tl.program_id(0)
    own_programs = tl.num_programs(0) - PROGRAMS
    if PREFIX_FIRST:
        prefix = pid < PROGRAMS
        program = pid
        own = pid - PROGRAMS
    else:
        prefix = pid >= own_programs
        program = pid - own_programs
        own = pid
    if prefix:
        wait_for_inputs(PDL)
        prefix_worker(
            program, Q, K, V, Groups, Items, Acc, Lse, Out, stride_ob, stride_oh, Arrivals, heads_total,
            stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
            stride_ab, stride_ah, stride_as, stride_lb, stride_lh, sm_scale, softcap, base, Scales, scale_v,
            TILE, KV_HEADS, PROGRAMS, LAPS, GROUP, GROUP_POW2, HEAD_DIM, DIM_PAD, PREFIX_BLOCK, 1, PSPLITS,
            LOOP_WHILE, PRECISION, UPCAST, CAPPED, FP8, True,
        )
        let_dependents_launch(PDL)
    else:
        partial_program(
            own // KV_HEADS, own % KV_HEADS, 0,
            Q, K, V, Bounds, Acc, Lse, KN, VN, WS, WT,
            stride_knb, stride_knh, stride_vnb, stride_vnh, stride_qb, stride_qh,
            stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
            stride_ab, stride_ah, stride_as, stride_lb, stride_lh, Out, stride_ob, stride_oh,
            sm_scale, softcap, 0, Shared, base, Scales, scale_v, Arrivals, heads_total,
            GROUP, GROUP_PAD, HEAD_DIM, DIM_PAD, BLOCK, 1, LOOP_WHILE, PRECISION, UPCAST, FUSED, CAPPED, False,
            True, PSPLITS, PSPLITS_PAD, False, FP8, False, PDL, WIDEN, True, MASK_EVERY,
        )
