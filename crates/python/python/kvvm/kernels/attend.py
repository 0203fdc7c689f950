"""Attention over kvvm's full-length K/V with each request's token range on the device.

:func:`attend` takes K and V as views of whole reservations (``[slots, kv_heads, max_tokens,
head_dim]``, most of it possibly unmapped) and an int32 ``[batch, 3]`` tensor giving each
request its slot and live tokens ``[start, end)``; the queries are each request's last ``q``
tokens. No token outside a request's range is read, no mask is materialized, query heads share their KV
head without ``repeat_kv``, and nothing about the lengths is read on the host: one CUDA graph
replays correctly at every length.

:func:`write_attend` is what a :class:`~kvvm.transformers.KvvmCache` runs per layer: the
step's new K/V written into the batch's memory, then :func:`attend`, as one custom operator
(``kvvm::write_attend``) that ``torch.compile`` treats as an opaque call, so that the batch's
memory is never copied by the compiler. The kernels are chosen at run time, on the tensors'
device:

- ``"triton"`` (CUDA): split-KV decode attention for one query token
  (:mod:`kvvm.kernels.triton_decode`), a causal block kernel for several
  (:mod:`kvvm.kernels.triton_prefill`);
- ``"flash"`` (CUDA): PyTorch's FlashAttention varlen kernel with ``seqused_k`` over the
  slots seen as one packed sequence (causal, aligned to each request's end, for several
  query tokens; one call per class of slots where a slot is not a whole number of tokens;
  :mod:`kvvm.kernels.flash`);
- ``"sdpa"``: SDPA on each request's exact tokens, one request at a time, lengths read on
  the host (the CPU kernel; on a GPU eager only, a reference).

``"auto"`` picks ``"triton"`` for one query token on CUDA, ``"flash"`` for more (``"sdpa"``
for fp32; ``"triton"`` for an FP8 cache), ``"sdpa"`` on CPU; under Triton's interpreter (``TRITON_INTERPRET=1``) the CPU runs
``"triton"`` for one query token too, as CUDA would (how the tests check the decode step
without a GPU). Measured against each other and against FlexAttention in
``docs/python.md``.

Every kernel takes a sliding ``window`` (a query at token ``p`` sees the tokens ``p - window <
k <= p``, transformers' convention; 0: all) and reads no token before the window, and an
attention-logit soft cap (``softcap * tanh(logits / softcap)``, Gemma 2's; 0: none), which
FlashAttention does not have: with a soft cap ``"auto"`` picks ``"sdpa"`` where it would pick
``"flash"``.

A cache in FP8 (:mod:`kvvm.kernels.fp8`) passes its layer's scales (``kv_scales``): the step's
new K/V are quantized as they are written (inside the Triton kernel, which writes them), and
each kernel dequantizes what it reads (Triton: each block widened as it is loaded, the scales
folded into the softmax scale and the output; ``"sdpa"``: one request's tokens at a time).
FlashAttention takes no FP8: on CUDA ``"auto"`` picks ``"triton"`` for several query tokens
then (the prefill kernel).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .device import multiprocessors
from .flash import flash
from .fp8 import E4M3, dequantize, quantize

if TYPE_CHECKING:
    from .cascade import Tables

__all__ = ["KERNELS", "attend", "kernel_for", "slab_kv", "write_attend"]

#: The kernels :func:`attend` may be asked for.
KERNELS = ("auto", "triton", "flash", "sdpa")


def kernel_for(
    device: torch.device, q_tokens: int, kernel: str = "auto", dtype: torch.dtype = torch.bfloat16,
    softcap: float = 0.0, fp8: bool = False,
) -> str:
    """The kernel ``kernel`` resolves to for ``q_tokens`` query tokens of ``dtype`` on
    ``device`` (FlashAttention takes fp16 and bf16 only, no soft cap and no FP8 K/V: ``fp8``,
    an FP8 cache, reads several query tokens with ``"sdpa"``)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; one of {KERNELS}")
    if fp8 and kernel == "flash":
        raise ValueError("the flash kernel takes no FP8 K/V; use 'triton', 'sdpa' or 'auto'")
    if device.type != "cuda":
        if q_tokens == 1 and kernel in ("auto", "triton") and _interpreted():
            return "triton"
        return "sdpa"
    if kernel == "flash" and softcap:
        raise ValueError("the flash kernel has no attention-logit soft cap; use 'sdpa' or 'auto'")
    if kernel != "auto":
        return kernel
    if (q_tokens == 1 or fp8) and _has_triton():
        return "triton"
    return "flash" if dtype in (torch.float16, torch.bfloat16) and not softcap and not fp8 else "sdpa"


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _interpreted() -> bool:
    """Whether Triton's kernels run in its interpreter, on CPU tensors (read once, as Triton
    does)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and _has_triton()


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
          scale: float, window: int = 0, softcap: float = 0.0, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One request at a time over its exact tokens (lengths read on the host), from the
    first token its earliest query's window reaches; an FP8 cache's (``kv_scales``) widened
    one request's tokens at a time."""
    batch, heads, q_len, dim = query.shape
    out = torch.zeros((batch, q_len, heads, dim), dtype=query.dtype, device=query.device)
    for b, (slot, start, end) in enumerate(bounds.tolist()):
        if window:
            start = max(start, end - q_len - window + 1)
        if end <= start:
            continue
        k = key[slot : slot + 1, :, start:end]
        v = value[slot : slot + 1, :, start:end]
        if kv_scales is not None:
            k, v = dequantize(k, kv_scales[0], query.dtype), dequantize(v, kv_scales[1], query.dtype)
        q = query[b : b + 1]
        n = end - start
        mask = None
        if q_len > 1 or window:
            # Query i is token n - q_len + i: it sees the tokens up to itself (and, with a
            # window, none at or before itself - window).
            rows = torch.arange(q_len, device=query.device)[:, None] + (n - q_len)
            cols = torch.arange(n, device=query.device)[None, :]
            mask = cols <= rows
            if window:
                mask = mask & (cols > rows - window)
        if softcap:
            o = _capped(q, k, v, mask, scale, softcap)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != key.shape[1]
            )
        out[b] = o[0].transpose(0, 1)
    return out


def _capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float) -> torch.Tensor:
    """Attention with soft-capped logits, as Gemma 2's eager attention computes it: scaled
    logits, ``softcap * tanh(logits / softcap)``, masked, a softmax in fp32, the values."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.matmul(q, k.transpose(2, 3)) * scale
    logits = torch.tanh(logits / softcap) * softcap
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
           scale: float, window: int = 0, softcap: float = 0.0, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """FlashAttention varlen over the slots seen as one packed sequence of token rows
    (:func:`kvvm.kernels.flash.flash`); no soft cap, no FP8 K/V."""
    if softcap:
        raise ValueError("the flash kernel has no attention-logit soft cap")
    if kv_scales is not None:
        raise ValueError("the flash kernel takes no FP8 K/V")
    return flash(query, key, value, bounds, scale, window)


def _triton(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor, scale: float,
    window: int = 0, softcap: float = 0.0,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    cascade: Tables | None = None, kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    from .triton_decode import Config, decode_attention, tuned_config

    if query.shape[2] > 1:
        from .triton_prefill import prefill_attention

        return prefill_attention(query, key, value, bounds, scale, window=window, softcap=softcap, kv_scales=kv_scales)
    if cascade is not None and not window:
        from .cascade import PrefixConfig, cascade_attention, item_rows
        from .cascade_tuning import tuned_prefix_config

        tables = cascade

        def run(c: Config, prefix: PrefixConfig | None = None) -> torch.Tensor:
            return cascade_attention(
                query, key, value, bounds, scale, c, tables, new, softcap=softcap, kv_scales=kv_scales,
                prefix_config=prefix,
            )

        # Tuned as the cascade runs: its private pass reads each request's own tokens only
        # (tuned with the prefix pass in the same configuration), then the prefix pass's
        # configuration beside it (its products are of an item's many query rows).
        variant = ("cascade", cascade[3], tuple(cascade[2].shape))
        config = tuned_config(
            query, key, value, bounds, scale, multiprocessors(query.device), new, kv_scales, timed=run, variant=variant,
        )
        shape = (tuple(query.shape), query.dtype, key.dtype, tuple(key.shape), tuple(key.stride()), variant)
        rows = item_rows(tables, query.shape[1] // key.shape[1])
        return run(config, tuned_prefix_config(shape, config, lambda p: run(config, p), rows))
    config = tuned_config(query, key, value, bounds, scale, multiprocessors(query.device), new, kv_scales)
    return decode_attention(
        query, key, value, bounds, scale, config, new, window=window, softcap=softcap, kv_scales=kv_scales,
    )


_KERNEL_FNS: dict[str, Callable[..., torch.Tensor]] = {"sdpa": _sdpa, "flash": _flash, "triton": _triton}


def _run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
         scale: float, kernel: str, window: int = 0, softcap: float = 0.0,
         kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    name = kernel_for(query.device, query.shape[2], kernel, query.dtype, softcap, kv_scales is not None)
    return _KERNEL_FNS[name](query, key, value, bounds.to(torch.int32), scale, window, softcap, kv_scales=kv_scales)


def _check_fp8(key: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """K/V of an FP8 cache come with their scales, and scales with FP8 K/V only."""
    if (key.dtype == E4M3) != (kv_scales is not None):
        raise ValueError(
            f"K/V of {key.dtype} with{'' if kv_scales is not None else 'out'} kv_scales: an FP8 cache's "
            "K/V are read with their scales ([2, kv_heads] fp32), any other cache's without"
        )


@torch.library.custom_op("kvvm::write_attend", mutates_args=())
def _write_attend(
    query: torch.Tensor,
    key_new: torch.Tensor,
    value_new: torch.Tensor,
    slab: torch.Tensor,
    slot: torch.Tensor,
    token: torch.Tensor,
    bounds: torch.Tensor,
    layout: list[int],
    scale: float,
    kernel: str,
    window: int = 0,
    softcap: float = 0.0,
    shared: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
    items: torch.Tensor | None = None,
    prefix_splits: int = 0,
    kv_scales: torch.Tensor | None = None,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    # ``slab`` is written in place although the schema says it is not: the compiler must not
    # see a mutation of it, or it would copy it whole (functionalization, autotuning clones),
    # reading windows that are not mapped. Nothing else in a graph reads the slab: this op
    # is the only reader and writer of the K/V memory, and it orders its write before its read.
    # ``arrivals`` (a cascade's counts) too: counted up and set back to zero within one launch,
    # unchanged from before the op to after it.
    key, value = slab_kv(slab, layout)
    _check_fp8(key, kv_scales)
    name = kernel_for(query.device, query.shape[2], kernel, query.dtype, softcap, kv_scales is not None)
    if name == "triton" and query.shape[2] == 1:
        # One kernel writes the token and attends (the token read from registers).
        cascade = (
            None if shared is None or groups is None or items is None or arrivals is None
            else (shared, groups, items, prefix_splits, arrivals)
        )
        return _triton(
            query, key, value, bounds.to(torch.int32), scale, window, softcap, (key_new, value_new, slot, token), cascade,
            kv_scales,
        )
    if kv_scales is not None:
        # Quantized at the write, with the layer's scales (index by index on the head axis).
        key_new, value_new = quantize(key_new, kv_scales[0]), quantize(value_new, kv_scales[1])
    key[slot, :, token] = key_new.transpose(1, 2)
    value[slot, :, token] = value_new.transpose(1, 2)
    return _run(query, key, value, bounds, scale, kernel, window, softcap, kv_scales)


@_write_attend.register_fake
def _write_attend_fake(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """What the operator returns, without running it (for the compiler): the attention's
    output in transformers' layout, ``[batch, q, heads, head_dim]``; the other arguments are
    the operator's."""
    batch, heads, q_len, dim = query.shape
    return query.new_empty((batch, q_len, heads, dim))


def slab_kv(slab: torch.Tensor, layout: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V over every slot of ``slab`` (``[slots, elements]``), as strided
    ``[slots, kv_heads, max_tokens, head_dim]`` views: ``layout`` is ``[k_offset, v_offset,
    head_stride, token_stride, kv_heads, max_tokens, head_dim]`` in elements."""
    k_off, v_off, head_stride, token_stride, heads, tokens, dim = layout
    size = (slab.shape[0], heads, tokens, dim)
    stride = (slab.stride(0), head_stride, token_stride, 1)
    return slab.as_strided(size, stride, k_off), slab.as_strided(size, stride, v_off)


def write_attend(
    query: torch.Tensor,
    key_new: torch.Tensor,
    value_new: torch.Tensor,
    slab: torch.Tensor,
    slot: torch.Tensor,
    token: torch.Tensor,
    bounds: torch.Tensor,
    layout: list[int],
    scale: float | None = None,
    kernel: str = "auto",
    window: int = 0,
    softcap: float = 0.0,
    cascade: Tables | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes one layer's new K/V of a step into ``slab`` and attends, as one operator
    (``kvvm::write_attend``): what :class:`~kvvm.transformers.KvvmCache` runs per layer with
    the kvvm attention.

    Args:
        query: ``[batch, heads, q, head_dim]``.
        key_new, value_new: ``[batch, kv_heads, q, head_dim]``: the step's new K and V.
        slab: the batch's memory, ``[slots, elements]`` (:meth:`kvvm.SequenceBatch.slab`).
        slot, token: int64 ``[batch, q]``: where each new token goes (a refused write points
            at the scratch slot).
        bounds: int32 ``[batch, 3]``: each request's slot and tokens ``[start, end)``
            after the write (see :func:`attend`).
        layout: the layer's place in the slab (see :func:`slab_kv`).
        scale, kernel, window, softcap: as :func:`attend`.
        cascade: the step's groups of requests sharing a prefix
            (:attr:`kvvm.kernels.cascade.CascadeTables.tables`): with the Triton kernel and
            no window, each group's prefix is read once for all its members
            (:func:`kvvm.kernels.cascade.cascade_attention`); other kernels read every
            request's tokens themselves, as without.
        kv_scales: the slab is an FP8 cache's (:mod:`kvvm.kernels.fp8`) and these are the
            layer's scales (fp32 ``[2, kv_heads]``: K's, V's): the new K/V are quantized as
            they are written, and every kernel dequantizes what it reads.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    shared, groups, items, prefix_splits, arrivals = (None, None, None, 0, None) if cascade is None else cascade
    return torch.ops.kvvm.write_attend(
        query, key_new, value_new, slab, slot, token, bounds, layout, float(scale), kernel, int(window),
        float(softcap), shared, groups, items, int(prefix_splits), kv_scales, arrivals,
    )


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    scale: float | None = None,
    kernel: str = "auto",
    window: int = 0,
    softcap: float = 0.0,
    kv_scales: torch.Tensor | None = None,
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
        window: a sliding window: the query at token ``p`` sees only the tokens ``p - window
            < k <= p`` (no token before the earliest query's window is read); 0: all.
        softcap: the attention-logit soft cap (``softcap * tanh(logits / softcap)`` before
            the softmax); 0: none.
        kv_scales: K and V are an FP8 cache's (``torch.float8_e4m3fn``) of these scales
            (fp32 ``[2, kv_heads]``, :mod:`kvvm.kernels.fp8`), dequantized as they are read.

    Returns:
        ``[batch, q, heads, head_dim]`` (the layout transformers' attention functions return).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    _check_fp8(key, kv_scales)
    return _run(query, key, value, bounds, float(scale), kernel, int(window), float(softcap), kv_scales)
