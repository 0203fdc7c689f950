"""The cascade's launches (:func:`~kvvm.kernels.cascade.cascade_attention` chooses one): the
prefix pass in a launch of its own (:func:`run_prefix`), before the private pass or beside it
on a second stream with every column counted as it is written (:func:`run_beside`), or both
passes in one launch (:func:`run_together`); how the prefix pass runs (:class:`PrefixConfig`)
and what a counted launch reads and writes (:class:`Counted`).

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check it without a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .device import launch_options, multiprocessors, programmatic, second_stream
from .triton_decode import (
    _INTERPRETED,
    Config,
    _new_rows,
    _pow2_at_least,
    from_last_slot,
    precision,
    run_partial,
    upcast,
    widens,
)
from .triton_cascade import _prefix_kernel, _together_kernel

__all__ = [
    "PREFIX_PROGRAMS_PER_MULTIPROCESSOR", "Counted", "PrefixConfig", "Tables", "query_rows", "run_beside", "run_prefix",
    "run_together",
]

#: The device tables of a step's groups: each request's shared tokens (int32 ``[batch]``), each
#: group's prefix (int32 ``[groups, 3]``: slot, start, tokens), the prefix pass's work items
#: (int32 ``[1 + items, 1 + tile]``: row 0 starts with their count, each next row is a group
#: and up to ``tile`` of its members, -1 past the last), the prefix splits (the programs'
#: share of each item along its prefix's tokens) and the arrivals (int32 ``[batch, heads]``,
#: zero between launches: the columns of each request's head written so far by a launch that
#: runs both passes together, see :class:`PrefixConfig`).
Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]

#: Programs of the prefix pass per multiprocessor: each walks the work list from its index
#: by the programs' count.
PREFIX_PROGRAMS_PER_MULTIPROCESSOR = 2


@dataclass(frozen=True)
class PrefixConfig:
    """How the prefix pass runs: prefix tokens per iteration, warps, pipeline stages. Its
    products are of an item's query rows (its members' heads: up to the tables' 16 to 128)
    where the private pass's are of a request's few heads: the configuration that suits one
    need not suit the other.

    ``together``: the prefix pass runs in the private pass's launch (its programs first),
    whose warps and stages then apply to both (``warps`` and ``stages`` here are not read);
    each column of partial results is counted as it is written and the last one of a
    request's head merges them (:mod:`kvvm.kernels.triton_cascade`). Only with a private
    pass of one split. ``prefix_first``: the launch's first programs are the prefix pass's
    (else its last).

    ``concurrent``: the prefix pass in a launch of its own (in ``block``, ``warps`` and
    ``stages``) on a second stream, beside the private pass's (a fork and a join, branches of
    a captured graph), its columns counted and merged as together; ``prefix_first`` then
    says which of the two is launched first (on a CPU, in Triton's interpreter, they run one
    after the other in that order). Only with a private pass of one split. Not both: made
    with both, it raises ``ValueError``."""

    block: int
    warps: int
    stages: int
    together: bool = False
    prefix_first: bool = True
    concurrent: bool = False

    def __post_init__(self) -> None:
        if self.together and self.concurrent:
            raise ValueError("the prefix pass runs either together with the private pass or beside it, not both")

    @property
    def counted(self) -> bool:
        """Whether each column is counted as it is written (``together`` or ``concurrent``):
        only beside a private pass of one split."""
        return self.together or self.concurrent


@dataclass(frozen=True)
class Counted:
    """One cascade call whose columns are counted as they are written (its prefix pass
    ``together`` with the private pass or ``concurrent`` beside it), as :func:`run_together`
    and :func:`run_beside` launch it: the call's inputs, the private pass's configuration
    (``private``) and the prefix pass's (``prefix``), and the output and partial-result
    buffers (:func:`~kvvm.kernels.triton_decode.buffers`)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    bounds: torch.Tensor
    tables: Tables
    scale: float
    private: Config
    prefix: PrefixConfig
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    out: torch.Tensor
    acc: torch.Tensor
    lse: torch.Tensor
    softcap: float
    kv_scales: torch.Tensor | None
    programs: int | None


def query_rows(group: int) -> int:
    """Query rows per member in a prefix item: the query heads per KV head, to a power of
    two."""
    return _pow2_at_least(group)


def run_beside(call: Counted) -> None:
    """The prefix pass on a second stream beside the private pass (``prefix.concurrent``), each
    column counted as it is written and each row merged into ``out`` by whichever program
    counts its last (:func:`~kvvm.kernels.triton_kernels.arrive_and_merge`). The current
    stream waits for the second before this returns, so nothing the passes use is freed or
    reused while either runs."""
    shared, _, _, prefix_splits, arrivals = call.tables
    query = call.query

    def private() -> None:
        run_partial(
            query, call.key, call.value, call.bounds, call.scale, call.private, call.new, call.out, call.acc,
            call.lse, softcap=call.softcap, shared=shared, prefix_splits=prefix_splits, kv_scales=call.kv_scales,
            arrivals=arrivals,
        )

    def prefix() -> None:
        run_prefix(
            query, call.key, call.value, call.tables, call.acc, call.lse, call.scale, call.private, call.prefix,
            call.softcap, call.kv_scales, call.programs, call.out,
        )

    # Each pass and whether it runs on the second stream, in launch order.
    first = call.prefix.prefix_first
    launches = [(prefix, True), (private, False)] if first else [(private, False), (prefix, True)]
    if not query.is_cuda:
        for run, _ in launches:
            run()
        return
    main = torch.cuda.current_stream(query.device)
    beside = second_stream(query.device)
    beside.wait_stream(main)
    for run, aside in launches:
        with torch.cuda.stream(beside if aside else main):
            run()
    main.wait_stream(beside)


def run_prefix(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables: Tables, acc: torch.Tensor,
    lse: torch.Tensor, scale: float, c: Config, pc: PrefixConfig, softcap: float, kv_scales: torch.Tensor | None,
    programs: int | None, out: torch.Tensor | None = None,
) -> None:
    """The prefix pass: each group's prefix read once per KV head for its members' queries,
    into the columns of ``acc``/``lse`` after the private pass's ``c.splits``; with ``out``,
    the private pass runs beside it (:func:`run_beside`): each column is counted in the
    tables' arrivals and the last of a row's merges it into ``out``, and the launch is no
    programmatic dependent (the kernel before it on its stream is another layer's)."""
    _, heads, _, dim = query.shape
    _, groups, items, prefix_splits, arrivals = tables
    kv_heads = key.shape[1]
    group = heads // kv_heads
    tile = items.shape[1] - 1
    units = (items.shape[0] - 1) * kv_heads * prefix_splits
    programs = _prefix_programs(query.device, programs, units)
    q = query[:, :, 0]
    base, k_from, v_from = from_last_slot(key, value)
    pdl = programmatic(query.device) and out is None
    o = q if out is None else out[:, 0]
    _prefix_kernel[(programs,)](
        q, k_from, v_from, groups, items, acc, lse, o, arrivals,
        q.stride(0), q.stride(1),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        acc.stride(0), acc.stride(1), acc.stride(2),
        lse.stride(0), lse.stride(1),
        o.stride(0), o.stride(1),
        scale, float(softcap) or 1.0, base, groups if kv_scales is None else kv_scales, kv_heads, heads,
        TILE=tile, KV_HEADS=kv_heads, PROGRAMS=programs, LAPS=triton.cdiv(units, programs),
        GROUP=group, GROUP_POW2=query_rows(group),
        HEAD_DIM=dim, DIM_PAD=max(16, _pow2_at_least(dim)),
        BLOCK=pc.block, SPLITS=c.splits, PSPLITS=prefix_splits, LOOP_WHILE=_INTERPRETED,
        PRECISION=precision(query.dtype), UPCAST=upcast(query.dtype), CAPPED=bool(softcap),
        FP8=kv_scales is not None, PDL=pdl, ARRIVE=out is not None, num_warps=pc.warps, num_stages=pc.stages,
        **launch_options(pdl),
    )


def run_together(call: Counted) -> None:
    """Both passes in one launch (:func:`~kvvm.kernels.triton_cascade._together_kernel`): the
    prefix pass's programs, then one per request and KV head over its own tokens; the private
    pass's column 0 of ``acc``/``lse`` and the prefix's columns after it, each request's heads
    merged into ``out`` by whichever program writes their last column (a request in no group:
    by its own program, directly)."""
    query, key, value, bounds, out, acc, lse = call.query, call.key, call.value, call.bounds, call.out, call.acc, call.lse
    c, pc, scale, softcap, kv_scales = call.private, call.prefix, call.scale, call.softcap, call.kv_scales
    batch, heads, _, dim = query.shape
    shared, groups, items, prefix_splits, arrivals = call.tables
    kv_heads = key.shape[1]
    group = heads // kv_heads
    units = (items.shape[0] - 1) * kv_heads * prefix_splits
    programs = _prefix_programs(query.device, call.programs, units)
    fused = call.new is not None
    kn, vn, ws, wt = _new_rows(call.new, bounds)
    q, o = query[:, :, 0], out[:, 0]
    base, k_from, v_from = from_last_slot(key, value)
    pdl = programmatic(query.device)
    _together_kernel[(programs + batch * kv_heads,)](
        q, k_from, v_from, bounds, acc, lse, kn, vn, ws, wt, groups, items, arrivals,
        kn.stride(0) if fused else 0, kn.stride(1) if fused else 0,
        vn.stride(0) if fused else 0, vn.stride(1) if fused else 0,
        q.stride(0), q.stride(1),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        acc.stride(0), acc.stride(1), acc.stride(2),
        lse.stride(0), lse.stride(1),
        o, o.stride(0), o.stride(1),
        scale, float(softcap) or 1.0, shared, base, bounds if kv_scales is None else kv_scales, kv_heads, heads,
        TILE=items.shape[1] - 1, KV_HEADS=kv_heads, PROGRAMS=programs, LAPS=triton.cdiv(units, programs),
        GROUP=group, GROUP_POW2=query_rows(group), GROUP_PAD=max(16, _pow2_at_least(group)),
        HEAD_DIM=dim, DIM_PAD=max(16, _pow2_at_least(dim)), BLOCK=c.block, PREFIX_BLOCK=pc.block,
        PSPLITS=prefix_splits, PSPLITS_PAD=_pow2_at_least(prefix_splits), LOOP_WHILE=_INTERPRETED,
        PRECISION=precision(query.dtype), UPCAST=upcast(query.dtype), FUSED=fused, CAPPED=bool(softcap),
        FP8=kv_scales is not None, PDL=pdl, WIDEN=c.widen and widens(query.dtype, kv_scales),
        PREFIX_FIRST=pc.prefix_first, MASK_EVERY=c.masked, num_warps=c.warps, num_stages=c.stages, **launch_options(pdl),
    )


def _prefix_programs(device: torch.device, programs: int | None, units: int) -> int:
    """The prefix pass's programs: ``programs`` (default
    :data:`PREFIX_PROGRAMS_PER_MULTIPROCESSOR` per multiprocessor), no more than the units
    the tables can hold."""
    if programs is None:
        programs = PREFIX_PROGRAMS_PER_MULTIPROCESSOR * multiprocessors(device)
    return max(1, min(programs, units))
