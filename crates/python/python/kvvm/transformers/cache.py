"""A Hugging Face transformers ``Cache`` whose K/V live in kvvm reservations.

:class:`KvvmCache` keeps every layer's K and V of a batch in a :class:`~kvvm.SequenceBatch`
(one slot per request, all slots at a constant stride): growth commits windows in place (no
``torch.cat``, no copy, the pointer never changes) and only the windows holding live tokens
are committed. Each request's token count lives in a device tensor
(:class:`~kvvm.transformers.slots.SlotState`): a step writes each request's new K/V at its own position
with device-side indices, so requests of different lengths decode in one batch, without
padding.

What attention receives depends on the model's attention implementation:

- with :data:`~kvvm.transformers.attention.ATTENTION` (:func:`use_kvvm_attention`): full-length K/V views
  whose addresses never change and each request's token range as a device tensor
  (:func:`kvvm.kernels.attend.attend` reads exactly those tokens). Nothing depends on a length known
  on the host, so the cache is compileable: ``generate`` compiles its decode step with CUDA
  graphs by itself, and a decode step can be captured by hand (:mod:`kvvm.transformers.graph`);
- with any other attention: exact-length views (every request of the batch at the same
  length, as ``generate`` pads them), for SDPA and the like. Eager only.

Before every step the host makes the tokens it will write committed and claimed (a growth the
budget cannot grant is raised then, as :class:`~kvvm.errors.BackpressureError`, before
anything is launched); on the device a write past what the host prepared goes to a scratch
slot instead of unmapped memory.

:class:`kvvm.transformers.KvvmPrefix` prefills a shared system prompt once into shared memory;
:meth:`KvvmCache.from_prefix` gives it to N new requests (billed once: its whole windows
mapped read-only, the few bytes past them copied into each request's own memory; on
sliding-window layers the last tokens copied).

The class is written in three files: :mod:`~kvvm.transformers.cache_memory` (the memory and
what is done with it between steps), :mod:`~kvvm.transformers.cache_step` (one step) and this
one (transformers' ``Cache``: construction, the layers, the lengths transformers asks for).

Requires torch and transformers (5.x); the rest of kvvm does not.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache

from ..bindings import LayoutPlan, Manager, SequenceBatch, decoder_config
from ..errors import InvalidArgumentError
from ..kernels.fp8 import kv_storage
from .architectures import check_servable
from .attention import ATTENTION, register_attention, use_kvvm_attention
from .cache_groups import layer_groups
from .cache_layer import KvvmLayer, StepQuery
from .cache_step import CacheStep

__all__ = [
    "ATTENTION",
    "KvvmCache",
    "KvvmLayer",
    "cache_argument",
    "register_attention",
    "use_kvvm_attention",
]


def cache_argument(model: Any) -> str:
    """The keyword under which ``model``'s forward and ``generate`` take a cache: ``"cache"``
    from transformers 5.24 on (which deprecates the old name), ``"past_key_values"`` before.
    Use it as ``model.generate(ids, **{cache_argument(model): cache})``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


class Prefix(Protocol):
    """What :meth:`KvvmCache.from_prefix` asks of a prefix (a
    :class:`~kvvm.transformers.KvvmPrefix`)."""

    @property
    def config(self) -> Any: ...

    @property
    def manager(self) -> Manager: ...

    @property
    def plan(self) -> LayoutPlan: ...

    @property
    def tokens(self) -> int: ...

    @property
    def kv_scales(self) -> Any: ...

    def batches_for(self, batch_size: int, max_cache_len: int, precommit: bool) -> tuple[list[SequenceBatch], list[int]]: ...


def _model_config(config: Any, dtype: Any) -> tuple[Any, Any]:
    """The decoder config of ``config`` (a model or its config) and the K/V dtype: ``dtype``,
    else a model's own (the cache holds what its layers produce)."""
    model_dtype = getattr(config, "dtype", None)
    if hasattr(config, "config") and isinstance(model_dtype, torch.dtype):
        config = config.config
        if dtype is None:
            dtype = model_dtype
    return decoder_config(config), dtype


def _batches(batch: SequenceBatch | list[SequenceBatch] | None, groups: int) -> list[SequenceBatch | None]:
    """One batch to bind to (or None: made) per layer group."""
    batches: list[SequenceBatch | None] = (
        list(batch) if isinstance(batch, list) else [None] * groups if batch is None else [batch]
    )
    if len(batches) != groups:
        raise InvalidArgumentError(f"{len(batches)} batch(es) to bind to for the model's {groups} layer group(s)")
    return batches


class KvvmCache(CacheStep, Cache):
    """A transformers cache over a kvvm :class:`~kvvm.SequenceBatch`.

    Args:
        config: the model (its dtype is then the cache's) or its config (decoders of full
            and sliding-window attention layers: Llama, Mistral, Qwen2, Gemma 2 and 3, ...).
        batch_size: requests (slots) in the batch.
        max_cache_len: the most tokens a request may reach (prompt + generated); reserved as
            address space only.
        manager: a :class:`~kvvm.Manager`; made from ``backend``/``device``/``budget_bytes``
            with the pre-committer when omitted.
        layout: ``"token-major"`` (default), ``"seq-major"`` or ``"head-major"``. Token-major
            keeps a request's K/V for every layer in one fragment, so at most one granule per
            request is committed beyond its live tokens and a shared prefix maps as one
            handle (``docs/python.md``).
        dtype: the K/V dtype. Default: the model's when ``config`` is the model, else the
            config's ``dtype``, else bf16. A config often names none (a model built from a
            config and cast with ``.to(...)``): pass the model or ``dtype=``. K/V of another
            dtype than the cache's are refused with InvalidArgumentError naming both.
        precommit: grow through the manager's background pre-committer, when it runs one.
        headroom_tokens: how far ahead of each request's live tokens the pre-committer keeps
            windows mapped (for a manager made here).
        batch: a batch to bind to, of ``batch_size + 1`` slots (the last is the scratch
            slot), or a list of one per layer group (:mod:`kvvm.transformers.cache_groups`, in their order);
            made here when omitted.
        start_tokens: live tokens already in every slot of ``batch``.
        cascade: make the device tables of the cascade decode now, so that a step captured
            later reads a prefix shared by several requests once for all of them
            (:meth:`share_prefix`, :mod:`kvvm.kernels.cascade`; the Triton kernel on CUDA,
            full-attention models). :meth:`from_prefix` makes them by default.
        kv_dtype: what K/V are stored as: None (``dtype``), or ``"fp8_e4m3"``: FP8 KV
            (:mod:`kvvm.kernels.fp8`, ``docs/fp8-kv.md``), one byte an element, quantized
            as they are written and dequantized inside attention; the model attends with the
            kvvm attention (:func:`use_kvvm_attention`) and computes in its own dtype.
            ``"fp8_e5m2"`` is refused (InvalidArgumentError).
        kv_scales: an FP8 cache's scales, fixed for its life: a ``(k_scale, v_scale)`` pair
            (default ``(1.0, 1.0)``) or an fp32 tensor ``[layers, 2, kv_heads]``; kept as
            :attr:`kv_scales`. A value is stored as ``x / scale`` in e4m3 (saturated at 448).

    The layers are laid out in groups (:mod:`kvvm.transformers.cache_groups`): the full-attention layers
    in one batch, a model's sliding-window layers in another whose windows behind the window
    are given back as requests grow (each request holds about ``window`` tokens there,
    whatever its length). :attr:`groups` lists them; :attr:`plan` and :attr:`batch` are the
    first group's (the only one of a full-attention model). A shared prefix
    (:class:`kvvm.transformers.KvvmPrefix`) is laid out in the same groups (:meth:`from_prefix`).

    Use it as ``model.generate(..., past_key_values=KvvmCache(model, B, L))`` (transformers
    5.24 and later name the argument ``cache=``), in a hand-written decode loop, or captured
    (:class:`kvvm.transformers.DecodeGraph`); call :meth:`release` (or use it as a context manager)
    to give the memory back. Beam search is not supported (the cache does not reorder its
    slots).
    """

    def __init__(
        self,
        config: Any,
        batch_size: int,
        max_cache_len: int,
        *,
        manager: Manager | None = None,
        backend: str = "auto",
        device: int = 0,
        budget_bytes: int | None = None,
        layout: str = "token-major",
        dtype: Any = None,
        precommit: bool = True,
        headroom_tokens: int = 4,
        batch: SequenceBatch | list[SequenceBatch] | None = None,
        start_tokens: int = 0,
        cascade: bool = False,
        kv_dtype: Any = None,
        kv_scales: Any = None,
    ) -> None:
        check_servable(config)
        cfg, dtype = _model_config(config, dtype)
        dtype = kv_storage(kv_dtype, dtype)
        if batch_size <= 0 or max_cache_len <= 0:
            raise InvalidArgumentError("batch_size and max_cache_len must be positive")
        specs = layer_groups(cfg, max_cache_len)
        batches = _batches(batch, len(specs))
        owns_manager = manager is None
        if manager is None:
            manager = Manager(
                backend, device=device, budget_bytes=budget_bytes, precommit=precommit, headroom_tokens=headroom_tokens
            )
        if not manager.addressable:
            raise InvalidArgumentError(
                f"the {manager.backend} backend's memory cannot hold torch tensors; "
                "use 'cuda', 'hip' or 'host'"
            )
        CacheStep.__init__(
            self, cfg, specs, batch_size, max_cache_len, manager, owns_manager=owns_manager, layout=layout,
            dtype=dtype, precommit=precommit, batches=batches, start_tokens=start_tokens, cascade=cascade,
            kv_scales=kv_scales,
        )
        layers: list[Any] = [KvvmLayer(self, i, self.groups[g].spec.sliding) for i, g, _ in self._where]
        Cache.__init__(self, layers=layers)

    # ---- construction from a shared prefix ----

    @classmethod
    def from_prefix(
        cls, prefix: Prefix, batch_size: int, max_cache_len: int, **kwargs: Any
    ) -> KvvmCache:
        """A cache of ``batch_size`` new requests that all start with ``prefix``
        (:class:`kvvm.transformers.KvvmPrefix`), at ``prefix.tokens`` live tokens. On full-attention
        layers its whole windows are mapped read-only into every slot (billed once) and its
        bytes past them copied into each slot's own windows (a request never writes into
        read-only memory, whatever the model's bytes per token); on sliding-window layers each
        slot takes, by copy, only the last tokens the next step reads. Prefill each request's
        own suffix next. Every slot shares the prefix (:meth:`share_prefix`): a decode step
        reads it once for all of them (``cascade=False`` to read it per request). An FP8
        prefix gives its scales too: its tokens are read with the scales they were written
        with."""
        for fixed in ("dtype", "layout", "manager", "batch", "start_tokens", "kv_dtype", "kv_scales"):
            if fixed in kwargs:
                raise InvalidArgumentError(f"{fixed} comes from the prefix; do not pass it")
        precommit = kwargs.pop("precommit", True)
        kwargs.setdefault("cascade", True)
        batches, firsts = prefix.batches_for(batch_size, max_cache_len, precommit)
        cache = cls(
            prefix.config,
            batch_size,
            max_cache_len,
            manager=prefix.manager,
            layout=prefix.plan.layout,
            dtype=prefix.plan.geometry.dtype,
            kv_scales=prefix.kv_scales,
            batch=batches,
            start_tokens=prefix.tokens,
            **kwargs,
        )
        for group, first in zip(cache.groups, firsts, strict=True):
            group.start_floors(first, cache.state.upload)
        cache.share_prefix(range(batch_size), ("from_prefix", id(prefix)), prefix.tokens)
        return cache

    # ---- what transformers asks ----

    def get_query_offset(self, layer_idx: int = 0) -> Any:
        """With device lengths, the hook of the kvvm mask (not a number: the offset differs
        per request); otherwise the live tokens."""
        if self.device_lengths:
            return StepQuery(self)
        return self.get_seq_length()

    @property
    def max_cache_len(self) -> int:
        """The most tokens a request may reach (each slot's reservation)."""
        return self._max_len

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """The most tokens a request may reach."""
        return self._max_len

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Live tokens of the selected requests (the longest, in a ragged batch)."""
        return max(self.state.host_lengths[i] for i in self.state.selected)

    def crop(self, max_length: int) -> None:
        """Drops tokens from the end of every request (``max_length`` < 0: that many; >= 0:
        keep that many). The memory stays committed until :meth:`shrink` or release."""
        self.crop_tokens(max_length)

    def __enter__(self) -> KvvmCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V of every token it holds (see :meth:`layer_kv`), as iterating
        over a ``DynamicCache`` gives them."""
        for layer in range(len(self._where)):
            yield self.layer_kv(layer)
