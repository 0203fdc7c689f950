"""Attention over kvvm's full-length K/V with each request's token range on the device.

:func:`attend` takes K and V as views of whole reservations (``[slots, kv_heads, max_tokens,
head_dim]``, most of it possibly unmapped) and an int32 ``[batch, 3]`` tensor giving each
request its slot and live tokens ``[start, end)``; the queries are each request's last ``q``
tokens. No
token outside a request's range is read, no mask is materialized, query heads share their KV
head without ``repeat_kv``, and nothing about the lengths is read on the host: one CUDA graph
replays correctly at every length.

It is the custom operator ``kvvm::attend``, so that ``torch.compile`` treats it as one opaque
call (the kernels below are chosen at run time, on the tensors' device):

- ``"triton"`` (CUDA, one query token): split-KV decode attention (:mod:`kvvm.triton_decode`);
- ``"flash"`` (CUDA): PyTorch's FlashAttention varlen kernel with ``seqused_k`` over the
  slots seen as one packed sequence (causal, aligned to each request's end, for several
  query tokens);
- ``"sdpa"``: SDPA on each request's exact tokens, one request at a time, lengths read on
  the host (the CPU kernel; on a GPU eager only, a reference).

``"auto"`` picks ``"triton"`` for one query token on CUDA, ``"flash"`` for more, ``"sdpa"``
on CPU. Measured against each other and against FlexAttention in ``docs/python.md``.
"""

from __future__ import annotations

import functools
import math
import torch

__all__ = ["KERNELS", "attend", "kernel_for"]

#: The kernels :func:`attend` may be asked for.
KERNELS = ("auto", "triton", "flash", "sdpa")


def kernel_for(device: torch.device, q_tokens: int, kernel: str = "auto") -> str:
    """The kernel ``kernel`` resolves to for ``q_tokens`` query tokens on ``device``."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; one of {KERNELS}")
    if device.type != "cuda":
        return "sdpa"
    if kernel != "auto":
        return kernel
    return "triton" if q_tokens == 1 and _has_triton() else "flash"


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
          scale: float) -> torch.Tensor:
    """One request at a time over its exact tokens (lengths read on the host)."""
    batch, heads, q_len, dim = query.shape
    out = torch.zeros((batch, q_len, heads, dim), dtype=query.dtype, device=query.device)
    for b, (slot, start, end) in enumerate(bounds.tolist()):
        if end <= start:
            continue
        k = key[slot : slot + 1, :, start:end]
        v = value[slot : slot + 1, :, start:end]
        q = query[b : b + 1]
        n = end - start
        mask = None
        if q_len > 1:
            # Query i is token n - q_len + i: it sees the tokens up to itself.
            rows = torch.arange(q_len, device=query.device)[:, None] + (n - q_len)
            mask = torch.arange(n, device=query.device)[None, :] <= rows
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != key.shape[1]
        )
        out[b] = o[0].transpose(0, 1)
    return out


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
           scale: float) -> torch.Tensor:
    """FlashAttention varlen over the slots as one packed sequence: slot ``s``'s token ``t``
    is row ``s * rows_per_slot + t``; each request starts at its slot's ``start`` and reads
    ``end - start`` rows (``seqused_k``)."""
    batch, heads, q_len, dim = query.shape
    rows_per_slot, packed = [], []
    for t in (key, value):
        if t.stride(0) % t.stride(2) != 0:
            raise ValueError("the flash kernel needs a slot stride that is a whole number of tokens")
        per = t.stride(0) // t.stride(2)
        rows_per_slot.append(per)
        total = (t.shape[0] - 1) * per + t.shape[2]
        packed.append(t.as_strided((total, t.shape[1], dim), (t.stride(2), t.stride(1), 1), t.storage_offset()))
    if rows_per_slot[0] != rows_per_slot[1]:
        raise ValueError("the flash kernel needs K and V at the same slot stride")
    ids = torch.arange(batch + 1, device=query.device, dtype=torch.int32)
    used = (bounds[:, 2] - bounds[:, 1]).clamp_min(0).to(torch.int32)
    first = bounds[:, 0] * rows_per_slot[0] + bounds[:, 1]
    last = torch.full((1,), packed[0].shape[0], dtype=torch.int32, device=query.device)
    cu_k = torch.cat([first, last]).to(torch.int32)
    cu_q = ids * q_len
    q = query.transpose(1, 2).reshape(batch * q_len, heads, dim)
    out = torch.ops.aten._flash_attention_forward(
        q, packed[0], packed[1], cu_q, cu_k, q_len, key.shape[2], 0.0, q_len > 1, False,
        scale=scale, seqused_k=used,
    )[0]
    out = out.view(batch, q_len, heads, dim)
    # A request with no tokens reads nothing: zeros, as the other kernels give.
    return torch.where((used > 0).view(batch, 1, 1, 1), out, torch.zeros((), dtype=out.dtype, device=out.device))


def _triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
            scale: float) -> torch.Tensor:
    from .triton_decode import choose_splits, decode_attention

    index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    splits = choose_splits(query.shape[0], key.shape[1], key.shape[2], _multiprocessors(index))
    return decode_attention(query, key, value, bounds, scale, splits)


_KERNEL_FNS = {"sdpa": _sdpa, "flash": _flash, "triton": _triton}


@torch.library.custom_op("kvvm::attend", mutates_args=())
def _attend_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
    scale: float, kernel: str,
) -> torch.Tensor:
    name = kernel_for(query.device, query.shape[2], kernel)
    if name == "triton" and query.shape[2] != 1:
        raise ValueError("the triton kernel takes one query token per request")
    return _KERNEL_FNS[name](query, key, value, bounds.to(torch.int32), scale)


@_attend_op.register_fake
def _attend_fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
    scale: float, kernel: str,
) -> torch.Tensor:
    batch, heads, q_len, dim = query.shape
    return query.new_empty((batch, q_len, heads, dim))


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    scale: float | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Attention of each request's last ``q`` tokens over its tokens ``[start, end)``.

    Args:
        query: ``[batch, heads, q, head_dim]``.
        key, value: ``[slots, kv_heads, max_tokens, head_dim]`` with a unit last stride
            (``heads`` a multiple of ``kv_heads``); only each request's range is read.
        bounds: int32 ``[batch, 3]`` on the query's device: request ``b``'s slot (the index
            into ``key``/``value``) and tokens ``[start, end)``; the queries are tokens
            ``end - q .. end - 1`` (causal among themselves); an empty range gives zeros.
        scale: the softmax scale (default ``head_dim ** -0.5``).
        kernel: one of :data:`KERNELS`.

    Returns:
        ``[batch, q, heads, head_dim]`` (the layout transformers' attention functions return).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    return torch.ops.kvvm.attend(query, key, value, bounds, float(scale), kernel)
