"""One layer of a :class:`~kvvm.transformers.KvvmCache` as transformers sees it, and the hook
through which the kvvm mask function reaches the cache.

Every layer shares its cache's token counts and slab; the layer only forwards what
transformers asks of it. Requires torch and transformers.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, cast

import torch
from transformers.cache_utils import CacheLayerMixin

__all__ = ["KvvmLayer", "StepQuery", "host_work"]


class _Cache(Protocol):
    """What a layer and the mask hook ask of their :class:`~kvvm.transformers.KvvmCache`:
    its per-step interface, public methods all."""

    @property
    def max_cache_len(self) -> int: ...

    @property
    def device_lengths(self) -> bool: ...

    def layer_update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def step_mask(self, q: int, padding_mask: Any, batch: Any = None) -> Any: ...

    def layer_mask_sizes(self, q: int, layer: int = 0) -> tuple[int, int]: ...

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def crop_tokens(self, tokens: int) -> None: ...

    def reset_counts(self) -> None: ...


def host_work() -> bool:
    """Whether Python runs eagerly now (not traced by torch.compile, not captured)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class StepQuery:
    """What the cache answers to ``get_query_offset``: the hook through which the kvvm mask
    function (:func:`kvvm.transformers.attention.kvvm_mask`) asks the cache for the step's token ranges.
    Any other mask function cannot use it (it is not a number)."""

    def __init__(self, cache: _Cache) -> None:
        self._cache = cache

    def kvvm_mask(self, q: int, padding_mask: Any, batch: Any = None) -> Any:
        """The step's mask for ``q`` query tokens, as the cache makes it (its ``step_mask``)."""
        return self._cache.step_mask(q, padding_mask, batch)


class KvvmLayer(CacheLayerMixin):
    """One layer of a :class:`KvvmCache`. ``keys``/``values`` are every token the layer holds
    of the selected requests, as views of the cache's memory, read when asked for
    (:meth:`KvvmCache.layer_kv <kvvm.transformers.cache_step.CacheStep.layer_kv>`), as a
    ``DynamicCache``'s layer holds them, whatever the attention."""

    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: _Cache, index: int, sliding: bool = False) -> None:
        super().__init__()
        # A proxy, not a reference: no cycle keeps the cache (and its manager's worker) alive.
        self._cache = cast(_Cache, weakref.proxy(cache))
        self._index = index
        #: Whether the layer attends over a sliding window (its group forgets what lies behind).
        self.is_sliding = sliding
        self.is_initialized = True

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        """Whether the model attends with the kvvm attention (then nothing depends on a
        length known on the host)."""
        return self._cache.device_lengths

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the batch is reserved and bound when the cache is made."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes ``key_states``/``value_states`` (``[batch, kv_heads, q, head_dim]``) after
        each request's live tokens and returns what attention reads (see the module)."""
        return self._cache.layer_update(self._index, key_states, value_states)

    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor:
        """K of every token the layer holds, ``[requests, kv_heads, tokens, head_dim]``."""
        return self._cache.layer_kv(self._index)[0]

    @keys.setter
    def keys(self, value: Any) -> None:
        """What transformers' layer sets (None at first) is not kept: the K/V live in the
        cache's memory."""

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor:
        """V of every token the layer holds, ``[requests, kv_heads, tokens, head_dim]``."""
        return self._cache.layer_kv(self._index)[1]

    @values.setter
    def values(self, value: Any) -> None:
        """See :attr:`keys`."""

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the exact length with exact-length views (from the
        first token a sliding layer keeps); the reservation's length with device lengths (only
        the kvvm mask reads it)."""
        return self._cache.layer_mask_sizes(query_length, self._index)

    def get_seq_length(self) -> int:
        """Live tokens (the longest request's, in a ragged batch)."""
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        """The most tokens a request may reach."""
        return self._cache.max_cache_len

    def crop(self, tokens_to_remove: int) -> None:
        """See :meth:`KvvmCache.crop` (every layer shares the token counts)."""
        if self._index == 0:
            self._cache.crop_tokens(tokens_to_remove)

    def reset(self) -> None:
        """See :meth:`KvvmCache.reset`."""
        if self._index == 0:
            self._cache.reset_counts()

    def offload(self) -> None:  # pragma: no cover - a method transformers may call
        """Refused: a :class:`KvvmCache` keeps its K/V on its device."""
        raise NotImplementedError("KvvmCache keeps K/V on its device (no offloading)")

    def prefetch(self) -> None:  # pragma: no cover
        """Nothing to fetch: the K/V never leave the device (see :meth:`offload`)."""
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Refused: a :class:`KvvmCache` does not reorder its slots (no beam search)."""
        raise NotImplementedError("KvvmCache does not reorder slots (no beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refused: make the cache with a slot a request and beam instead."""
        raise NotImplementedError(
            "KvvmCache does not repeat slots: make it with batch_size = requests x beams"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Refused: a :class:`KvvmCache` does not select slots."""
        raise NotImplementedError("KvvmCache does not select slots")
