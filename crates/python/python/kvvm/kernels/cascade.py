"""Cascade decode attention: a prefix shared by several requests of a step read once for all.

Requests that opened with one shared prefix hold the same bytes at the start of their token
ranges: kvvm maps the prefix's windows read-only into every one of their slots and copies its
tail into each. Decoding them one by one reads those tokens once per request; the cascade reads
them once per group and per KV head for every member's queries together (one matrix product
against the prefix's K instead of one vector product per request), then merges each request's
result over the prefix with its result over its own tokens by their log-sum-exps.

The groups live on the device (:class:`CascadeTables`: each request's shared tokens, each
group's prefix and members): a captured CUDA graph replays correctly as requests join and leave
groups, the tables rewritten in place between replays. A request in no group (shared tokens 0)
reads all its tokens itself, as :func:`~kvvm.kernels.triton_decode.decode_attention` does.

The prefix pass of one group is cut into programs of at most ``members_per_program`` members
(about 64 query rows each, the size of one tensor-core product); those programs read the same
prefix blocks at about the same time, from the L2 cache after the first.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check it without a GPU).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_decode import (
    _INTERPRETED,
    Config,
    _pow2_at_least,
    buffers,
    choose_splits,
    from_last_slot,
    precision,
    run_merge,
    run_partial,
    upcast,
)
from .triton_kernels import fold_tokens, kv_scales, product_query, split_range

__all__ = [
    "PREFIX_SPLIT_TOKENS", "CascadeTables", "Plan", "Share", "Tables", "cascade_attention", "choose_prefix_splits",
    "member_tiles", "plan_groups", "query_rows",
]

#: The device tables of a step's groups: each request's shared tokens (int32 ``[batch]``), each
#: group's prefix (int32 ``[groups, 3]``: slot, start, tokens), each group's members (int32
#: ``[groups, batch]``, -1 past the last) and the prefix pass's programs per (group, KV head).
Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]

#: Query rows one prefix program takes at most (members times query heads per KV head).
_ROWS = 64


@dataclass(frozen=True)
class Share:
    """What one request of a step shares: the first ``tokens`` tokens of its range (which
    starts at ``start`` in slot ``slot``) are prefix ``key``'s, byte for byte the same in every
    request that shares ``key`` with the same ``tokens`` and ``start``."""

    key: Hashable
    slot: int
    start: int
    tokens: int


@dataclass(frozen=True)
class Plan:
    """The groups of one step, on the host: each request's shared tokens, each group's prefix
    (slot, start, tokens: read from its first member's slot) and members (batch rows)."""

    shared: list[int]
    groups: list[tuple[int, int, int]]
    members: list[list[int]]


def plan_groups(shares: Sequence[Share | None], max_groups: int) -> Plan:
    """Requests grouped by what they share: a group is two or more requests with the same
    prefix, tokens and start (a request alone gains nothing and reads its tokens itself, as
    does one with no share or a share of no tokens). Groups are numbered by their first
    member; past ``max_groups`` groups, the rest read their tokens themselves."""
    by_prefix: dict[tuple[Hashable, int, int], list[tuple[int, Share]]] = {}
    for row, share in enumerate(shares):
        if share is not None and share.tokens > 0:
            by_prefix.setdefault((share.key, share.tokens, share.start), []).append((row, share))
    shared = [0] * len(shares)
    groups: list[tuple[int, int, int]] = []
    members: list[list[int]] = []
    for found in by_prefix.values():
        if len(found) < 2 or len(groups) == max_groups:
            continue
        first = found[0][1]
        groups.append((first.slot, first.start, first.tokens))
        members.append([row for row, _ in found])
        for row, _ in found:
            shared[row] = first.tokens
    return Plan(shared, groups, members)


def query_rows(group: int) -> int:
    """Query rows per member in a prefix program: the query heads per KV head, to a power of
    two."""
    return _pow2_at_least(group)


class CascadeTables:
    """The groups of a step on the device, at fixed sizes (a graph captured over them replays
    with any grouping written in place by :meth:`update`).

    Args:
        batch: requests per step.
        device: where the tables live.
        max_groups: groups at most (``batch // 2`` by default: a group has two members or
            more).
        prefix_splits: programs per (group, KV head) along the prefix's tokens (a power of
            two).
    """

    def __init__(self, batch: int, device: torch.device | str, max_groups: int | None = None,
                 prefix_splits: int = 1) -> None:
        if batch < 1:
            raise ValueError(f"a cascade needs a batch of one request or more, not {batch}")
        if prefix_splits < 1 or prefix_splits & (prefix_splits - 1):
            raise ValueError(f"prefix_splits must be a power of two, not {prefix_splits}")
        self.batch = batch
        self.max_groups = max(1, batch // 2) if max_groups is None else max_groups
        if self.max_groups < 1:
            raise ValueError(f"max_groups must be at least 1, not {self.max_groups}")
        self.prefix_splits = prefix_splits
        self.shared = torch.zeros(batch, dtype=torch.int32, device=device)
        self.groups = torch.zeros((self.max_groups, 3), dtype=torch.int32, device=device)
        self.members = torch.full((self.max_groups, batch), -1, dtype=torch.int32, device=device)
        self.count = 0

    def update(self, shares: Sequence[Share | None]) -> Plan:
        """Writes the grouping of ``shares`` (one per request, ``None`` for no share) in place
        and returns it."""
        if len(shares) != self.batch:
            raise ValueError(f"{len(shares)} shares for a batch of {self.batch}")
        plan = plan_groups(shares, self.max_groups)
        groups = [list(g) for g in plan.groups] + [[0, 0, 0]] * (self.max_groups - len(plan.groups))
        members = [rows + [-1] * (self.batch - len(rows)) for rows in plan.members]
        members += [[-1] * self.batch] * (self.max_groups - len(plan.members))
        self.shared.copy_(torch.tensor(plan.shared, dtype=torch.int32))
        self.groups.copy_(torch.tensor(groups, dtype=torch.int32))
        self.members.copy_(torch.tensor(members, dtype=torch.int32))
        self.count = len(plan.groups)
        return plan

    @property
    def tables(self) -> Tables:
        """The tensors the kernels read (:data:`Tables`)."""
        return self.shared, self.groups, self.members, self.prefix_splits


@triton.jit
def _prefix_kernel(
    Q, K, V, Groups, Members, Acc, Lse,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ab, stride_ah, stride_as,
    stride_lb, stride_lh,
    sm_scale, softcap, base, Scales, scale_v,
    MEMBERS: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr,
    GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK: tl.constexpr, SPLITS: tl.constexpr, PSPLITS: tl.constexpr, LOOP_WHILE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, CAPPED: tl.constexpr, FP8: tl.constexpr,
):
    # Programs of one group side by side (the first grid axis varies fastest): they read the
    # same blocks at about the same time.
    g = tl.program_id(0) // TILES
    tile = tl.program_id(0) % TILES
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs3 = tl.arange(0, 4)
    row3 = tl.load(Groups + g * 3 + offs3, mask=offs3 < 3, other=0)
    slot = tl.sum(tl.where(offs3 == 0, row3, 0), 0)
    start = tl.sum(tl.where(offs3 == 1, row3, 0), 0)
    n = tl.sum(tl.where(offs3 == 2, row3, 0), 0)
    # Slots are counted from the one ``K`` and ``V`` point into (see decode_attention).
    slot = slot - base

    rows = tl.arange(0, TILE * GROUP_POW2)
    index = tile * TILE + rows // GROUP_POW2
    within = rows % GROUP_POW2
    member = tl.load(Members + g * MEMBERS + index, mask=index < MEMBERS, other=-1)
    valid = (member >= 0) & (within < GROUP)
    # A program with no member reads nothing.
    n = tl.where(tl.max(valid.to(tl.int32), 0) > 0, n, 0)
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


def cascade_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    config: Config | int,
    tables: Tables,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    *,
    softcap: float = 0.0,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its tokens, the prefixes shared by the
    groups of ``tables`` read once per group.

    The arguments are :func:`~kvvm.kernels.triton_decode.decode_attention`'s (no sliding
    window: a query that sees only its last tokens shares none of a prefix it has moved past)
    and ``tables``, the step's groups (:attr:`CascadeTables.tables`); ``config`` is the
    private pass's; ``kv_scales``: K and V are an FP8 cache's, of these scales (both passes
    dequantize as they read). Returns ``[batch, 1, heads, head_dim]`` in the query's dtype.
    """
    batch, heads, _, dim = query.shape
    shared, groups, members, prefix_splits = tables
    if shared.shape[0] != batch or members.shape[1] != batch:
        raise ValueError(f"cascade tables for a batch of {shared.shape[0]}, queries for {batch}")
    c = config if isinstance(config, Config) else Config(config)
    kv_heads = key.shape[1]
    if kv_scales is not None:
        kv_scales = kv_scales.to(torch.float32).contiguous()
    group = heads // kv_heads
    total = c.splits + prefix_splits
    out, acc, lse = buffers(query, total)
    run_partial(
        query, key, value, bounds, scale, c, new, out, acc, lse, softcap=softcap, shared=shared,
        prefix_splits=prefix_splits, kv_scales=kv_scales,
    )
    tile, tiles = member_tiles(batch, group)
    q = query[:, :, 0]
    base, k_from, v_from = from_last_slot(key, value)
    _prefix_kernel[(groups.shape[0] * tiles, kv_heads, prefix_splits)](
        q, k_from, v_from, groups, members, acc, lse,
        q.stride(0), q.stride(1),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        acc.stride(0), acc.stride(1), acc.stride(2),
        lse.stride(0), lse.stride(1),
        scale, float(softcap) or 1.0, base, groups if kv_scales is None else kv_scales, kv_heads,
        MEMBERS=batch, TILE=tile, TILES=tiles,
        GROUP=group, GROUP_POW2=query_rows(group),
        HEAD_DIM=dim, DIM_PAD=max(16, _pow2_at_least(dim)),
        BLOCK=c.block, SPLITS=c.splits, PSPLITS=prefix_splits, LOOP_WHILE=_INTERPRETED,
        PRECISION=precision(query.dtype), UPCAST=upcast(query.dtype), CAPPED=bool(softcap),
        FP8=kv_scales is not None, num_warps=c.warps, num_stages=c.stages,
    )
    run_merge(acc, lse, out, total)
    return out


def member_tiles(batch: int, group: int) -> tuple[int, int]:
    """Members per prefix program and programs per group: at least 16 query rows (a
    tensor-core product's least), at most about :data:`_ROWS` where the heads allow."""
    per_member = query_rows(group)
    tile = max(triton.cdiv(16, per_member), min(_ROWS // per_member, _pow2_at_least(batch)))
    return tile, triton.cdiv(batch, tile)


#: Tokens of a prefix one program reads at least: every split adds a column of partial
#: results per request and head to write and merge (at 64 requests of 32 heads, a column is
#: 1 MiB a layer), which a prefix pass of few tokens per program does not repay (measured on
#: an H100 at 64 x (2048 + 256) tokens of the Llama-3.1-8B shape: 32 splits of 64 tokens made
#: the step 1.8 times slower than 4 splits of 512).
PREFIX_SPLIT_TOKENS = 512


def choose_prefix_splits(batch: int, heads: int, kv_heads: int, max_tokens: int, multiprocessors: int) -> int:
    """Programs per (group, KV head) along a prefix: about four programs per multiprocessor
    for one group of the whole batch (:func:`~kvvm.kernels.triton_decode.choose_splits` over
    its member programs), but no fewer than :data:`PREFIX_SPLIT_TOKENS` tokens each for the
    longest prefix a request may hold (a power of two)."""
    _, tiles = member_tiles(batch, heads // kv_heads)
    most = 1 << max(0, (max_tokens // PREFIX_SPLIT_TOKENS).bit_length() - 1)
    return max(1, min(choose_splits(tiles, kv_heads, max_tokens, multiprocessors), most))
