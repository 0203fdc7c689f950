"""PyTorch's FlashAttention varlen kernel over kvvm's full-length K/V (the ``"flash"`` kernel
of :func:`kvvm.kernels.attend.attend`: several query tokens, a prefill).

The slots are seen as one packed sequence of token rows: token ``t`` of slot ``s`` is element
``s * S + t * T`` (``S``, ``T``: the slot and token strides); each request reads ``end -
start`` rows (``seqused_k``) from its first (with a sliding window, from the first token its
earliest query sees). A row starts a whole number of tokens from the packed tensor's first
element, and a slot need not (a reservation is whole granules, which the bytes of a token
need not divide): the slots fall into classes by ``s * S mod T``, each class is one call over
the rows shifted by its offset in which the other classes' requests read nothing, and each
request takes its own class's output. The classes come from the strides alone (nothing is
read on the host); one class, one call, where the slot stride is whole tokens.

What the kernel needs of a forward's token ranges (a :class:`FlashPlan`: the query and key
offsets and each class's lengths, a few small kernels to make) is the same for every layer of
that forward that has one layout: it is made by the forward's first layer and kept for the
others (:func:`flash_plan`, one small memo per thread, keyed by the ``bounds`` tensor itself
and its version counter; never while a CUDA graph is being captured, whose tensors hold
nothing until it is replayed).
"""

from __future__ import annotations

import collections
import functools
import threading
from dataclasses import dataclass

import torch

__all__ = ["PLANS_KEPT", "FlashPlan", "SlotClass", "flash", "flash_plan"]

#: The plans each thread keeps: a forward's layers of every layout it has (full and sliding
#: attention groups, each its own bounds) and a few more.
PLANS_KEPT = 8


@dataclass(frozen=True)
class SlotClass:
    """The slots whose first element lies ``offset`` elements past a whole token of the
    packed rows, and what the kernel reads of them."""

    #: Elements from slot 0's first token to this class's first row.
    offset: int
    #: Token rows of the packed tensor, from ``offset`` on.
    rows: int
    #: int32 ``[batch + 1]``: each request's first key row (0 for another class's), then ``rows``.
    cu_k: torch.Tensor
    #: int32 ``[batch]``: the key rows each request reads (0 for another class's).
    used: torch.Tensor
    #: bool ``[batch, 1, 1, 1]``: the requests that take this call's output (this class's,
    #: with a token to read).
    take: torch.Tensor


@dataclass(frozen=True)
class FlashPlan:
    """What FlashAttention's varlen call needs of one forward's token ranges, for one layout
    of the K/V: the queries' row offsets and the slot classes."""

    #: int32 ``[batch + 1]``: request ``b``'s queries are rows ``cu_q[b]..cu_q[b + 1]``.
    cu_q: torch.Tensor
    classes: tuple[SlotClass, ...]


class _Plans(threading.local):
    """One thread's plans, oldest first; each entry keeps its ``bounds`` tensor alive, so that
    no other tensor can take its ``id`` while the entry is kept."""

    def __init__(self) -> None:
        self.entries: collections.OrderedDict[tuple[int, ...], tuple[torch.Tensor, FlashPlan]] = (
            collections.OrderedDict()
        )


_PLANS = _Plans()


@functools.lru_cache(maxsize=64)
def _offsets(slots: int, slot_stride: int, token_stride: int) -> tuple[int, ...]:
    """The slot classes' offsets (slot 0's, 0, first)."""
    return tuple(sorted({s * slot_stride % token_stride for s in range(slots)}))


def flash_plan(bounds: torch.Tensor, q_len: int, window: int, key: torch.Tensor) -> FlashPlan:
    """The plan of ``bounds`` (int32 ``[batch, 3]``: slot, start, end) for ``q_len`` query
    tokens over ``key``'s layout (``[slots, kv_heads, max_tokens, head_dim]``), made or taken
    from this thread's memo."""
    slot_stride, token_stride = key.stride(0), key.stride(2)
    shape = (key.shape[0], key.shape[2], slot_stride, token_stride)
    if bounds.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _make_plan(bounds, q_len, window, *shape)
    memo_key = (id(bounds), bounds._version, q_len, window, *shape)
    entries = _PLANS.entries
    hit = entries.get(memo_key)
    if hit is not None and hit[0] is bounds:
        return hit[1]
    plan = _make_plan(bounds, q_len, window, *shape)
    entries[memo_key] = (bounds, plan)
    while len(entries) > PLANS_KEPT:
        entries.popitem(last=False)
    return plan


def _make_plan(
    bounds: torch.Tensor, q_len: int, window: int, slots: int, tokens: int, slot_stride: int, token_stride: int
) -> FlashPlan:
    """The plan's tensors, computed on the device (see :class:`FlashPlan`)."""
    batch = bounds.shape[0]
    begin = bounds[:, 1]
    if window:
        begin = torch.maximum(begin, bounds[:, 2] - (q_len + window - 1))
    used = (bounds[:, 2] - begin).clamp_min(0).to(torch.int32)
    cu_q = torch.arange(batch + 1, device=bounds.device, dtype=torch.int32) * q_len
    offsets = _offsets(slots, slot_stride, token_stride)
    if len(offsets) == 1:
        # The slot stride is whole tokens: every slot starts on a row of one packed tensor.
        rows = (slots - 1) * (slot_stride // token_stride) + tokens
        first = bounds[:, 0].to(torch.int64) * (slot_stride // token_stride) + begin
        cu_k = torch.cat([first, first.new_full((1,), rows)]).to(torch.int32)
        return FlashPlan(cu_q, (SlotClass(0, rows, cu_k, used, (used > 0).view(batch, 1, 1, 1)),))
    start = bounds[:, 0].to(torch.int64) * slot_stride + begin.to(torch.int64) * token_stride
    classes = []
    for offset in offsets:
        # Rows from `offset` elements on: every slot of this class starts on one of them.
        rows = ((slots - 1) * slot_stride - offset) // token_stride + tokens
        mine = start % token_stride == offset
        first = torch.where(mine, (start - offset) // token_stride, 0)
        cu_k = torch.cat([first, first.new_full((1,), rows)]).to(torch.int32)
        classes.append(
            SlotClass(offset, rows, cu_k, torch.where(mine, used, 0), (mine & (used > 0)).view(batch, 1, 1, 1))
        )
    return FlashPlan(cu_q, tuple(classes))


def _flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
    max_k: int, causal: bool, scale: float, used: torch.Tensor, window: int = 0,
) -> torch.Tensor:
    """PyTorch's FlashAttention varlen forward: request ``b``'s queries are rows
    ``cu_q[b]..cu_q[b+1]`` of ``q``, its keys ``used[b]`` rows of ``k``/``v`` from
    ``cu_k[b]`` (with a sliding ``window``, each query sees its last ``window`` keys)."""
    sliding = {"window_size_left": window - 1, "window_size_right": 0} if window else {}
    out: torch.Tensor = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, seqused_k=used, **sliding,
    )[0]
    return out


def flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
          scale: float, window: int = 0) -> torch.Tensor:
    """Attention of each request's last ``q`` tokens over its tokens (the arguments and result
    of :func:`kvvm.kernels.attend.attend`, ``bounds`` int32): one FlashAttention call per slot
    class; a request with no tokens gets zeros, as the other kernels give."""
    batch, heads, q_len, dim = query.shape
    slot_stride, token_stride = key.stride(0), key.stride(2)
    if (value.stride(0), value.stride(2)) != (slot_stride, token_stride):
        raise ValueError("the flash kernel needs K and V at the same slot and token strides")
    plan = flash_plan(bounds, q_len, window, key)
    q = query.transpose(1, 2).reshape(batch * q_len, heads, dim)
    out: torch.Tensor | None = None
    for c in plan.classes:
        packed = [
            t.as_strided((c.rows, t.shape[1], dim), (token_stride, t.stride(1), 1), t.storage_offset() + c.offset)
            for t in (key, value)
        ]
        part = _flash_forward(
            q, packed[0], packed[1], plan.cu_q, c.cu_k, q_len, key.shape[2], q_len > 1, scale, c.used, window,
        ).view(batch, q_len, heads, dim)
        # A request of another class, or with no tokens, read nothing: zeros.
        out = torch.where(c.take, part, 0.0 if out is None else out)
    # Every layout has slot 0's class: the loop ran.
    return out if out is not None else query.new_zeros((batch, q_len, heads, dim))
