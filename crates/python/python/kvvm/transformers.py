"""A Hugging Face transformers ``Cache`` whose K/V live in kvvm reservations.

:class:`KvvmCache` gives every layer's K and V of a batch as one strided tensor over a
:class:`~kvvm.SequenceBatch` (one slot per request, all slots at a constant stride): growth
commits windows in place (no ``torch.cat``, no copy, the pointer never changes), the views it
hands to attention have the exact live length (no padding, so transformers runs SDPA with
its own GQA and no mask), and only the windows holding live tokens are committed. With the
manager's pre-committer the decode step finds its windows already mapped.

:class:`KvvmPrefix` is the flow a server needs for a shared system prompt: prefill it once
into shared memory, then :meth:`KvvmCache.from_prefix` attaches it read-only to N new
requests (billed once) and only their own suffixes are prefilled.

Requires torch and transformers (5.x); the rest of kvvm does not.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import (
    KvGeometry,
    LayoutPlan,
    Manager,
    ReleasedError,
    SequenceBatch,
    SharedPrefix,
    geometry_from_config,
)
from .attention import ATTENTION, decoder_config, register_attention, use_kvvm_attention
from .errors import DriverError, InvalidArgumentError, UnavailableError

__all__ = ["ATTENTION", "KvvmCache", "KvvmLayer", "KvvmPrefix", "register_attention", "use_kvvm_attention"]

_TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


def _torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(f"KvvmCache does not support the KV dtype {name}") from None


def _check_full_attention(config: Any) -> None:
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        raise InvalidArgumentError(
            "KvvmCache supports full-attention decoders only (layer types: "
            f"{sorted(set(types))})"
        )
    if getattr(config, "sliding_window", None) is not None:
        raise InvalidArgumentError("KvvmCache does not support sliding-window attention")


class KvvmLayer(CacheLayerMixin):
    """One layer of a :class:`KvvmCache`: K and V of every slot as strided views.

    ``keys``/``values`` are the live views ``[batch, kv_heads, length, head_dim]`` after each
    update; the full-length backing tensors cover the whole reservation and are only ever
    touched below the committed length.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: KvvmCache, index: int) -> None:
        super().__init__()
        # A proxy, not a reference: no cycle keeps the cache (and its manager's worker) alive.
        self._cache = cast("KvvmCache", weakref.proxy(cache))
        self._index = index
        self._k_full: torch.Tensor | None = None
        self._v_full: torch.Tensor | None = None
        self.length = 0

    def _bind(self, k_full: torch.Tensor, v_full: torch.Tensor, length: int) -> None:
        self._k_full, self._v_full = k_full, v_full
        self.dtype, self.device = k_full.dtype, k_full.device
        self.length = length
        self.keys = k_full[:, :, :length]
        self.values = v_full[:, :, :length]
        self.is_initialized = True

    def _unbind(self) -> None:
        self._k_full = self._v_full = None
        self.keys = self.values = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Binds the layer's views (the batch is reserved when the cache is made)."""
        self._cache._bind_layers()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes ``key_states``/``value_states`` (``[batch, kv_heads, q, head_dim]``) after the
        live tokens, in place, and returns the live views including them."""
        k_full = self._k_full
        if k_full is None:
            self.lazy_initialization(key_states, value_states)
            k_full = self._k_full
        v_full = self._v_full
        assert k_full is not None and v_full is not None
        if key_states.shape[0] != k_full.shape[0]:
            raise InvalidArgumentError(
                f"batch of {key_states.shape[0]} for a KvvmCache of {k_full.shape[0]} slots"
            )
        start = self.length
        q = key_states.shape[-2]
        end = start + q
        cache = self._cache
        if end > cache._ensured:
            cache._ensure(end)
        # The step's slices are made once for all layers: per layer, two copies (or one row
        # store) and no view.
        k_live, v_live = cache._step_views(start, q)
        i = self._index
        if q == 1 and cache._row_store:
            cache._store(i, start, key_states, value_states)
        else:
            k_dst, v_dst = cache._step_targets(start, q)
            k_dst[i].copy_(key_states)
            v_dst[i].copy_(value_states)
        self.length = end
        keys = self.keys = k_live[i]
        values = self.values = v_live[i]
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the exact live length (no padding, so no mask is needed
        when every request has the same length)."""
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        """Live tokens."""
        return self.length

    def get_max_length(self) -> int:
        """``-1``: the cache grows as needed (up to its reservation) like a dynamic one."""
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drops tokens from the end (``tokens_to_remove`` < 0: that many; > 0: keep that
        many). The memory stays committed until :meth:`KvvmCache.shrink` or release."""
        keep = tokens_to_remove if tokens_to_remove > 0 else self.length + tokens_to_remove
        self.length = max(0, min(self.length, keep))
        if self._k_full is not None and self._v_full is not None:
            self.keys = self._k_full[:, :, : self.length]
            self.values = self._v_full[:, :, : self.length]

    def reset(self) -> None:
        """Forgets the live tokens (memory stays committed until release)."""
        self.length = 0
        if self._k_full is not None and self._v_full is not None:
            self.keys = self._k_full[:, :, :0]
            self.values = self._v_full[:, :, :0]

    def offload(self) -> None:  # pragma: no cover - a method transformers may call
        raise NotImplementedError("KvvmCache keeps K/V on its device (no offloading)")

    def prefetch(self) -> None:  # pragma: no cover
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KvvmCache does not reorder slots (no beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("KvvmCache does not repeat slots")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("KvvmCache does not select slots")


class KvvmCache(Cache):
    """A transformers cache over a kvvm :class:`~kvvm.SequenceBatch`.

    Args:
        config: the model's config (full-attention decoders: Llama, Mistral, Qwen2, ...).
        batch_size: requests (slots) in the batch.
        max_cache_len: the most tokens a request may reach (prompt + generated); reserved as
            address space only.
        manager: a :class:`~kvvm.Manager`; made from ``backend``/``device``/``budget_bytes``
            with the pre-committer when omitted.
        layout: ``"token-major"`` (default), ``"seq-major"`` or ``"head-major"``. Token-major
            keeps a request's K/V for every layer in one fragment, so at most one granule per
            request is committed beyond its live tokens and a shared prefix maps as one
            handle; seq-major rounds each of its ``layers x 2`` fragments up to a window
            (measured on the H200: 24 GiB against 16.4 GiB live at 64 x 2048 tokens, decode
            equally fast; ``docs/python.md``).
        dtype: the K/V dtype (default: the config's, else bf16).
        precommit: grow through the manager's background pre-committer.
        headroom_tokens: how far ahead of each request's live tokens the pre-committer keeps
            windows mapped (for a manager made here). A decode step adds one token and the
            pre-committer looks every millisecond, so a few tokens keep every step off the
            driver; each token more costs bytes in every request (and a window boundary
            reached costs a whole window).
        batch: an existing batch to bind to (used by :meth:`from_prefix`).
        start_tokens: live tokens already in ``batch``.

    Use it as ``model.generate(..., past_key_values=KvvmCache(model.config, B, L))`` or in a
    hand-written decode loop; call :meth:`release` (or use it as a context manager) to give
    the memory back.
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
        batch: SequenceBatch | None = None,
        start_tokens: int = 0,
    ) -> None:
        cfg = decoder_config(config)
        _check_full_attention(cfg)
        if batch_size <= 0 or max_cache_len <= 0:
            raise InvalidArgumentError("batch_size and max_cache_len must be positive")
        self._owns_manager = manager is None
        if manager is None:
            manager = Manager(
                backend,
                device=device,
                budget_bytes=budget_bytes,
                precommit=precommit,
                headroom_tokens=headroom_tokens,
            )
        if not manager.addressable:
            raise InvalidArgumentError(
                f"the {manager.backend} backend's memory cannot hold torch tensors; "
                "use 'cuda', 'hip' or 'host'"
            )
        geometry = geometry_from_config(cfg, max_cache_len, dtype)
        self.manager = manager
        self.geometry: KvGeometry = geometry
        self.plan = LayoutPlan(geometry, layout, manager.granule)
        self.batch = batch or SequenceBatch(
            manager, self.plan, batch_size, max_cache_len, precommit=precommit
        )
        if len(self.batch) != batch_size:
            raise InvalidArgumentError(f"the batch has {len(self.batch)} slots, not {batch_size}")
        self._max_len = max_cache_len
        self._torch_dtype = _torch_dtype(geometry.dtype)
        self._ensured = 0
        self._start = start_tokens
        self._released = False
        self._bound = False
        # Every layer's K and V as two tensors [layers, batch, heads, max_len, head_dim].
        self._k_all: torch.Tensor | None = None
        self._v_all: torch.Tensor | None = None
        # One decode step's slices of them, shared by every layer: (start, q) and, per layer,
        # the views to write the new tokens into and the live views to hand to attention.
        self._step: tuple[int, int] = (-1, -1)
        self._step_dst: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] = ((), ())
        self._step_live: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] = ((), ())
        # A decode step's token goes in with SequenceBatch.store (one row copy per K and V,
        # a row per slot) on GPU backends whose layout keeps a token as one run per slot:
        # torch's own copy splits a destination spanning every slot (tens of GiB) into
        # 32-bit-indexable pieces, a kernel launch each. Turned off for good if the backend
        # refuses it (no row copies there, or sources it cannot take).
        self._row_store = manager.backend in ("cuda", "hip") and self.batch.can_store(1)
        self._stream: Any = None
        layers: list[Any] = [KvvmLayer(self, i) for i in range(geometry.layers)]
        super().__init__(layers=layers)
        self._bind_layers()

    # ---- construction from a shared prefix ----

    @classmethod
    def from_prefix(
        cls, prefix: KvvmPrefix, batch_size: int, max_cache_len: int, **kwargs: Any
    ) -> KvvmCache:
        """A cache of ``batch_size`` new requests that all start with ``prefix``: its shared
        windows are mapped read-only into every slot (billed once, no copy), the few tail
        tokens outside whole windows are copied from the owner, and the cache starts at
        ``prefix.tokens`` live tokens. Prefill each request's own suffix next."""
        if max_cache_len < prefix.tokens:
            raise InvalidArgumentError("max_cache_len is shorter than the prefix")
        for fixed in ("dtype", "layout", "manager", "batch", "start_tokens"):
            if fixed in kwargs:
                raise InvalidArgumentError(f"{fixed} comes from the prefix; do not pass it")
        batch = SequenceBatch(
            prefix.manager,
            prefix.plan,
            batch_size,
            max_cache_len,
            precommit=kwargs.pop("precommit", True),
        )
        for i in range(batch_size):
            prefix.shared.attach(batch[i])
        batch.ensure(prefix.tokens)
        cache = cls(
            prefix.config,
            batch_size,
            max_cache_len,
            manager=prefix.manager,
            layout=prefix.plan.layout,
            dtype=prefix.plan.geometry.dtype,
            batch=batch,
            start_tokens=prefix.tokens,
            **kwargs,
        )
        cache._ensured = prefix.tokens
        tail = prefix.shared.shared_tokens
        if tail < prefix.tokens:
            for layer, owner in zip(cache.layers, prefix.cache.layers, strict=True):
                assert isinstance(layer, KvvmLayer) and isinstance(owner, KvvmLayer)
                assert layer._k_full is not None and owner._k_full is not None
                assert layer._v_full is not None and owner._v_full is not None
                span = slice(tail, prefix.tokens)
                # [1, H, t, D] broadcast into every slot.
                layer._k_full[:, :, span].copy_(owner._k_full[:, :, span])
                layer._v_full[:, :, span].copy_(owner._v_full[:, :, span])
        return cache

    # ---- internals ----

    def _bind_layers(self) -> None:
        if self._released:
            raise ReleasedError("the KvvmCache was released")
        if self._bound:
            return
        kv = torch.from_dlpack(self.batch.view_all(0, self._max_len, allow_uncommitted=True))
        if kv.dtype != self._torch_dtype:
            raise InvalidArgumentError(f"view dtype {kv.dtype}, expected {self._torch_dtype}")
        self._k_all, self._v_all = kv[:, 0], kv[:, 1]
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, KvvmLayer)
            layer._bind(self._k_all[i], self._v_all[i], self._start)
        self._step = (-1, -1)
        self._bound = True

    def _step_views(self, start: int, q: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Per layer, the live views of tokens ``0..start+q`` (K, V). Made once per step for
        all layers (four calls instead of two per layer: the step is host-bound)."""
        if self._step != (start, q):
            k_all, v_all = self._k_all, self._v_all
            assert k_all is not None and v_all is not None
            end = start + q
            self._step_live = (k_all.narrow(3, 0, end).unbind(0), v_all.narrow(3, 0, end).unbind(0))
            self._step_dst = ((), ())
            self._step = (start, q)
            if self._row_store:
                self._stream = torch.cuda.current_stream(k_all.device)
        return self._step_live

    def _step_targets(self, start: int, q: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Per layer, where tokens ``start..start+q`` go (K, V), for ``copy_``; made once per
        step, and only when a step is not written with row stores."""
        self._step_views(start, q)
        if not self._step_dst[0]:
            k_all, v_all = self._k_all, self._v_all
            assert k_all is not None and v_all is not None
            self._step_dst = (k_all.narrow(3, start, q).unbind(0), v_all.narrow(3, start, q).unbind(0))
        return self._step_dst

    def _store(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Writes one decode token of layer ``layer`` into every slot with row copies on the
        current stream (the step's views are made); falls back to ``copy_`` into them (and
        stays there) if the backend refuses."""
        try:
            self.batch.store(layer, start, keys, values, self._stream)
        except (DriverError, UnavailableError, InvalidArgumentError):
            self._row_store = False
            k_dst, v_dst = self._step_targets(start, 1)
            k_dst[layer].copy_(keys)
            v_dst[layer].copy_(values)

    def _ensure(self, tokens: int) -> None:
        if tokens > self._ensured:
            if self._released:
                raise ReleasedError("the KvvmCache was released")
            self.batch.ensure(tokens)
            self._ensured = tokens

    # ---- public ----

    @property
    def committed_bytes(self) -> int:
        """Bytes mapped in the batch's slots (shared prefix windows counted per slot)."""
        return self.batch.committed_bytes

    @property
    def owned_bytes(self) -> int:
        """Physical bytes the batch holds on its own (a shared prefix excluded)."""
        return self.batch.owned_bytes

    @property
    def batch_size(self) -> int:
        """Slots."""
        return len(self.batch)

    def shrink(self) -> int:
        """Gives back the windows past the live tokens (committed ahead by the pre-committer
        or left by :meth:`crop`); returns the bytes unmapped."""
        length = self.get_seq_length()
        self._unbind()
        try:
            total = 0
            for i in range(len(self.batch)):
                total += self.batch[i].shrink(length)
            self._ensured = min(self._ensured, length)
            return total
        finally:
            self._start = length
            self._bind_layers()

    def _unbind(self) -> None:
        for layer in self.layers:
            assert isinstance(layer, KvvmLayer)
            layer._unbind()
        self._k_all = self._v_all = None
        self._step = (-1, -1)
        self._step_dst = self._step_live = ((), ())
        self._bound = False

    def release(self) -> int:
        """Drops the cache's views and releases every slot; returns the bytes unmapped.
        Tensors obtained from the cache must be gone (else ViewsAliveError, nothing
        released). The cache cannot be used afterwards."""
        if self._released:
            return 0
        self._unbind()
        freed = self.batch.release()
        self._released = True
        if self._owns_manager:
            # The manager was made for this cache: its pre-commit worker has nothing left to do.
            self.manager.stop_precommit()
        return freed

    def __enter__(self) -> KvvmCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __iter__(self) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
        for layer in self.layers:
            assert isinstance(layer, KvvmLayer)
            yield layer.keys, layer.values


class KvvmPrefix:
    """A prompt prefix prefilled once into shared kvvm memory, to be attached read-only to
    new requests with :meth:`KvvmCache.from_prefix`.

    Build it with :meth:`build`; keep it alive while caches made from it live (it holds
    the owner's sequence).
    """

    def __init__(
        self, config: Any, manager: Manager, plan: LayoutPlan, cache: KvvmCache, shared: SharedPrefix
    ) -> None:
        self.config = config
        self.manager = manager
        self.plan = plan
        self.cache = cache
        self.shared = shared
        #: The prefill's logits at the prefix's last token (``[1, vocab]``), set by :meth:`build`.
        self.last_logits: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        """The prefix's length in tokens."""
        return self.shared.tokens

    @property
    def bytes(self) -> int:
        """Physical bytes of the shared windows (billed once)."""
        return self.shared.bytes

    @classmethod
    @torch.no_grad()
    def build(
        cls,
        model: Any,
        input_ids: torch.Tensor,
        *,
        manager: Manager,
        max_cache_len: int,
        layout: str = "token-major",
        dtype: Any = None,
    ) -> KvvmPrefix:
        """Prefills ``input_ids`` (``[1, P]``) with ``model`` into a new shared prefix: the
        owner sequence commits the prefix's windows as shared memory, the model writes its
        K/V there, then it is sealed read-only. Returns the prefix and the owner's logits
        through :attr:`last_logits`."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InvalidArgumentError("input_ids must be [1, prefix_tokens]")
        prompt = int(input_ids.shape[1])
        cfg = decoder_config(model.config)
        geometry = geometry_from_config(cfg, max_cache_len, dtype)
        plan = LayoutPlan(geometry, layout, manager.granule)
        batch = SequenceBatch(manager, plan, 1, max_cache_len)
        shared = batch[0].own_prefix(prompt)
        cache = KvvmCache(
            cfg, 1, max_cache_len, manager=manager, layout=layout, dtype=geometry.dtype, batch=batch
        )
        cache._ensured = prompt
        pos = torch.arange(prompt, device=input_ids.device)
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, cache_position=pos)
        if input_ids.device.type == "cuda":
            torch.cuda.synchronize(input_ids.device)
        shared.seal()
        prefix = cls(cfg, manager, plan, cache, shared)
        prefix.last_logits = out.logits[:, -1]
        return prefix
