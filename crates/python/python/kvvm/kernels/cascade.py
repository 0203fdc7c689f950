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

The prefix pass's work is a list on the device (:class:`CascadeTables`): each item a group and
up to a tile of its members (about 64 query rows, the size of one tensor-core product), taken
once per KV head and prefix split. A fixed number of programs, a few per multiprocessor, walk
that list whatever its length, so a step's launch never carries programs with nothing to read
(sized for the most groups a batch can hold, most of them would be). Items of one group sit
side by side: their programs read the same prefix blocks at about the same time, from the L2
cache after the first. The launches that run the two passes, one after the other, beside each
other or as one, are :mod:`kvvm.kernels.cascade_launch`'s.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check it without a GPU).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import triton

from .cascade_launch import (
    PREFIX_PROGRAMS_PER_MULTIPROCESSOR,
    Counted,
    PrefixConfig,
    Tables,
    query_rows,
    run_beside,
    run_prefix,
    run_together,
)
from .triton_decode import Config, _pow2_at_least, buffers, choose_splits, run_merge, run_partial

__all__ = [
    "PREFIX_PROGRAMS_PER_MULTIPROCESSOR", "PREFIX_SPLIT_TOKENS", "CascadeTables", "Counted", "Plan", "PrefixConfig",
    "Share", "Tables", "cascade_attention", "choose_prefix_splits", "item_rows", "member_tiles", "most_items",
    "plan_groups", "prefix_items", "query_rows", "run_beside", "run_prefix", "run_together",
]

#: Query rows one prefix item takes at most (members times query heads per KV head), by
#: default, and those the tables may be made for: a launch of the prefix pass's own reads a
#: prefix once per 64 rows (once per 128 in tables of 128 rows, whose programs read half the
#: bytes a row: 16 warps hold them in 126 registers a thread, compiled for sm_90a); in the
#: private pass's launch (:class:`PrefixConfig`), a program of 16 rows is no bigger than a
#: private one (measured at 64 rows, the launch's programs need all 255 registers a thread
#: may hold and spill).
_ROWS = 64
_ROW_CHOICES = (16, 32, 64, 128)

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


def prefix_items(members: Sequence[Sequence[int]], tile: int) -> list[list[int]]:
    """The prefix pass's work items of groups of ``members`` (batch rows per group): each
    group cut into items of at most ``tile`` members, a row ``[group, rows..., -1...]`` of
    ``1 + tile`` each; one group's items side by side."""
    items = []
    for group, rows in enumerate(members):
        for first in range(0, len(rows), tile):
            chunk = list(rows[first:first + tile])
            items.append([group, *chunk] + [-1] * (tile - len(chunk)))
    return items


def most_items(batch: int, max_groups: int, tile: int) -> int:
    """The most work items a batch's groups can need: every member is in one item and each
    group of ``m`` members needs ``ceil(m / tile) <= 1 + (m - 1) / tile`` of them, so at
    most ``min(batch, groups + batch // tile)``."""
    return min(batch, max_groups + batch // tile)


class CascadeTables:
    """The groups of a step on the device, at fixed sizes (a graph captured over them replays
    with any grouping written in place by :meth:`update`).

    Args:
        batch: requests per step.
        device: where the tables live.
        max_groups: groups at most (``batch // 2`` by default: a group has two members or
            more).
        prefix_splits: programs per work item along the prefix's tokens (a power of two).
        heads_per_kv: the model's query heads per KV head: they set the members per work
            item (:func:`member_tiles`), and a step of any other ratio is refused.
        kv_heads: the model's KV heads (with ``heads_per_kv``, its query heads: the
            arrivals' rows).
        rows: query rows a prefix work item takes at most (16, 32, 64 or 128).
    """

    def __init__(self, batch: int, device: torch.device | str, max_groups: int | None = None,
                 prefix_splits: int = 1, *, heads_per_kv: int, kv_heads: int, rows: int = _ROWS) -> None:
        if batch < 1:
            raise ValueError(f"a cascade needs a batch of one request or more, not {batch}")
        if prefix_splits < 1 or prefix_splits & (prefix_splits - 1):
            raise ValueError(f"prefix_splits must be a power of two, not {prefix_splits}")
        if heads_per_kv < 1:
            raise ValueError(f"heads_per_kv must be at least 1, not {heads_per_kv}")
        if kv_heads < 1:
            raise ValueError(f"kv_heads must be at least 1, not {kv_heads}")
        if rows not in _ROW_CHOICES:
            raise ValueError(f"a prefix work item takes 16, 32, 64 or 128 query rows, not {rows}")
        self.batch = batch
        self.max_groups = max(1, batch // 2) if max_groups is None else max_groups
        if self.max_groups < 1:
            raise ValueError(f"max_groups must be at least 1, not {self.max_groups}")
        self.prefix_splits = prefix_splits
        self.heads_per_kv = heads_per_kv
        self.rows = rows
        self.tile = member_tiles(batch, heads_per_kv, rows)[0]
        self.max_items = most_items(batch, self.max_groups, self.tile)
        self.shared = torch.zeros(batch, dtype=torch.int32, device=device)
        self.groups = torch.zeros((self.max_groups, 3), dtype=torch.int32, device=device)
        self.items = torch.zeros((1 + self.max_items, 1 + self.tile), dtype=torch.int32, device=device)
        self.arrivals = torch.zeros((batch, heads_per_kv * kv_heads), dtype=torch.int32, device=device)
        self.count = 0

    def update(self, shares: Sequence[Share | None]) -> Plan:
        """Writes the grouping of ``shares`` (one per request, ``None`` for no share) in place
        and returns it."""
        if len(shares) != self.batch:
            raise ValueError(f"{len(shares)} shares for a batch of {self.batch}")
        plan = plan_groups(shares, self.max_groups)
        groups = [list(g) for g in plan.groups] + [[0, 0, 0]] * (self.max_groups - len(plan.groups))
        items = prefix_items(plan.members, self.tile)
        empty = [0] + [-1] * self.tile
        rows = [[len(items)] + [0] * self.tile, *items] + [empty] * (self.max_items - len(items))
        self.shared.copy_(torch.tensor(plan.shared, dtype=torch.int32))
        self.groups.copy_(torch.tensor(groups, dtype=torch.int32))
        self.items.copy_(torch.tensor(rows, dtype=torch.int32))
        self.count = len(plan.groups)
        return plan

    @property
    def tables(self) -> Tables:
        """The tensors the kernels read (:data:`Tables`)."""
        return self.shared, self.groups, self.items, self.prefix_splits, self.arrivals


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
    programs: int | None = None,
    prefix_config: PrefixConfig | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its tokens, the prefixes shared by the
    groups of ``tables`` read once per group.

    The arguments are :func:`~kvvm.kernels.triton_decode.decode_attention`'s (no sliding
    window: a query that sees only its last tokens shares none of a prefix it has moved past)
    and ``tables``, the step's groups (:attr:`CascadeTables.tables`, made for the query's
    heads per KV head); ``config`` is the private pass's; ``kv_scales``: K and V are an FP8
    cache's, of these scales (both passes dequantize as they read); ``programs``: the prefix
    pass's (default :data:`PREFIX_PROGRAMS_PER_MULTIPROCESSOR` per multiprocessor, fewer
    where the tables hold fewer units); ``prefix_config``: the prefix pass's block, warps and
    stages, and whether it runs in the private pass's launch (default: the private pass's
    block, warps and stages, a launch of its own). Returns ``[batch, 1, heads, head_dim]`` in
    the query's dtype.
    """
    batch, heads, _, dim = query.shape
    shared, groups, items, prefix_splits, arrivals = tables
    if shared.shape[0] != batch:
        raise ValueError(f"cascade tables for a batch of {shared.shape[0]}, queries for {batch}")
    kv_heads = key.shape[1]
    group = heads // kv_heads
    tile, want = items.shape[1] - 1, sorted({member_tiles(batch, group, rows)[0] for rows in _ROW_CHOICES})
    if tile not in want:
        raise ValueError(
            f"cascade tables of {tile} members an item, not one of the {want} of a batch of {batch} at {group} "
            "query heads per KV head (made for another heads_per_kv)"
        )
    if programs is not None and programs < 1:
        raise ValueError(f"the prefix pass needs one program or more, not {programs}")
    c = config if isinstance(config, Config) else Config(config)
    pc = prefix_config or PrefixConfig(c.block, c.warps, c.stages)
    counted = pc.counted
    if counted and c.splits != 1:
        raise ValueError(f"the prefix pass runs together or beside only a private pass of one split, not {c.splits}")
    if counted and tuple(arrivals.shape) != (batch, heads):
        raise ValueError(
            f"cascade tables counting arrivals of {tuple(arrivals.shape)}, not of the step's {(batch, heads)} "
            "(made for another kv_heads)"
        )
    if kv_scales is not None:
        kv_scales = kv_scales.to(torch.float32).contiguous()
    out, acc, lse = buffers(query, c.splits + prefix_splits)
    if counted:
        # Each column counted as it is written: both passes in one launch, or side by side.
        counting = run_together if pc.together else run_beside
        counting(Counted(query, key, value, bounds, tables, scale, c, pc, new, out, acc, lse, softcap, kv_scales, programs))
        return out
    run_prefix(query, key, value, tables, acc, lse, scale, c, pc, softcap, kv_scales, programs)
    # With one private program per request and KV head, that program merges the prefix's
    # columns itself; with more, the merge kernel folds every column.
    run_partial(
        query, key, value, bounds, scale, c, new, out, acc, lse, softcap=softcap, shared=shared,
        prefix_splits=prefix_splits, kv_scales=kv_scales,
    )
    if c.splits > 1:
        run_merge(acc, lse, out, c.splits + prefix_splits)
    return out


def item_rows(tables: Tables, group: int) -> int:
    """The query rows of the items of ``tables`` at ``group`` query heads per KV head."""
    return (tables[2].shape[1] - 1) * query_rows(group)


def member_tiles(batch: int, group: int, rows: int = _ROWS) -> tuple[int, int]:
    """Members per prefix work item and items for a group of the whole batch: at least 16
    query rows (a tensor-core product's least), at most about ``rows`` where the heads
    allow."""
    per_member = query_rows(group)
    tile = max(triton.cdiv(16, per_member), min(rows // per_member, _pow2_at_least(batch)))
    return tile, triton.cdiv(batch, tile)


#: Tokens of a prefix one program reads at least: every split adds a column of partial
#: results per request and head to write and merge (at 64 requests of 32 heads, a column is
#: 1 MiB a layer), which a prefix pass of few tokens per program does not repay (measured on
#: an H100 at 64 x (2048 + 256) tokens of the Llama-3.1-8B shape: 32 splits of 64 tokens made
#: the step 1.8 times slower than 4 splits of 512).
PREFIX_SPLIT_TOKENS = 512


def choose_prefix_splits(batch: int, heads: int, kv_heads: int, max_tokens: int, multiprocessors: int) -> int:
    """Splits of each prefix work item along its prefix's tokens: about four units per
    multiprocessor for one group of the whole batch
    (:func:`~kvvm.kernels.triton_decode.choose_splits` over its items), but no fewer than
    :data:`PREFIX_SPLIT_TOKENS` tokens each for the longest prefix a request may hold (a
    power of two)."""
    _, tiles = member_tiles(batch, heads // kv_heads)
    most = 1 << max(0, (max_tokens // PREFIX_SPLIT_TOKENS).bit_length() - 1)
    return max(1, min(choose_splits(tiles, kv_heads, max_tokens, multiprocessors), most))
