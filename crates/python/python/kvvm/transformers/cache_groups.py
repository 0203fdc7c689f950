"""The layer groups of a :class:`~kvvm.transformers.KvvmCache`: a model's decoder layers grouped
by what their attention reads, each group laid out in memory of its own.

Full-attention layers read every token a request has; a sliding-window layer reads only the
last ``window`` tokens (transformers' convention: the query at token ``p`` sees the tokens
``p - window < k <= p``). The two kinds are kept apart, each group under its own
:class:`~kvvm.LayoutPlan` (token-major over the group's layers, by default) in its own
:class:`~kvvm.SequenceBatch`, so that one token's bytes of the sliding layers lie together and
a window holding only tokens behind the sliding window can be unmapped while the full layers
keep theirs. A sliding group's memory is committed one handle per window and given back as
decoding proceeds (:meth:`CacheGroup.forget_behind`): it holds the windows of the last
``window - 1`` tokens and the step's, whatever the request's length, at the same addresses
all along. A full-attention model has one group, laid out as the cache always was.

Which layers slide comes from the config as transformers reads it: ``layer_types``
(``"full_attention"``, ``"sliding_attention"``: Gemma 2 and 3, Qwen2 with
``use_sliding_window``, Ministral), else ``sliding_window`` on every layer (Mistral). A window
at least as long as the cache never slides: those layers join the full group.

Requires torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..bindings import KvGeometry, LayoutPlan, Manager, SequenceBatch
from ..errors import InvalidArgumentError
from ..kernels.attend import slab_kv

__all__ = [
    "CacheGroup",
    "LayerGroup",
    "SLIDING_PREFIX_CACHE_REFUSAL",
    "group_plan",
    "layer_groups",
    "refuse_sliding_prefix_cache",
]

#: Why the engine's automatic prefix cache is not run for a model with sliding-window layers
#: (an explicit :class:`kvvm.transformers.KvvmPrefix` is shared across them).
SLIDING_PREFIX_CACHE_REFUSAL = (
    "the engine's prefix cache is refused for models with sliding-window layers: it keeps one "
    "chain of shared segments per layout plan, and a sliding model's two layer groups would "
    "need each entry's segments kept, hit and evicted together; share a system prompt with "
    "kvvm.prefix.KvvmPrefix and KvvmCache.from_prefix instead"
)

#: The layer types a KvvmCache lays out.
_SUPPORTED = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LayerGroup:
    """Decoder layers laid out together: ``layers`` (the model's indices, ascending) and the
    ``window`` their attention reads (``None``: every token)."""

    layers: tuple[int, ...]
    window: int | None

    @property
    def sliding(self) -> bool:
        """Whether these layers read a sliding window only."""
        return self.window is not None

    def kept_from(self, length: int) -> int:
        """The first token a step after ``length`` tokens may read on these layers: the
        ``window - 1`` tokens before it and the step's own are all a query of it sees."""
        if self.window is None:
            return 0
        return max(0, length - self.window + 1)


def _layer_types(config: Any) -> list[str]:
    """Each decoder layer's attention type, as transformers' caches read it."""
    layers = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [str(t) for t in types]
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * layers
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * layers
    return ["full_attention"] * layers


def layer_groups(config: Any, max_cache_len: int) -> list[LayerGroup]:
    """The layer groups of a decoder ``config`` for requests of at most ``max_cache_len``
    tokens: the full-attention layers first (if any), then the sliding ones. Raises
    InvalidArgumentError, with the reason, for what a KvvmCache cannot lay out: other
    attention types (chunked, linear, ...), layers sharing another's K/V, bidirectional
    attention."""
    if getattr(config, "num_kv_shared_layers", None):
        raise InvalidArgumentError("KvvmCache does not serve layers that share another layer's K/V (num_kv_shared_layers)")
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        raise InvalidArgumentError("KvvmCache serves causal decoders only (bidirectional attention)")
    types = _layer_types(config)
    other = sorted(set(types) - set(_SUPPORTED))
    if other:
        raise InvalidArgumentError(
            f"KvvmCache serves full and sliding-window attention layers; this model also has {other}"
        )
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise InvalidArgumentError(f"sliding-window layers need a positive sliding_window, not {window!r}")
    slides = isinstance(window, int) and window < max_cache_len
    full = tuple(i for i, t in enumerate(types) if t == "full_attention" or not slides)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention" and slides)
    groups = [LayerGroup(full, None)] if full else []
    if sliding and isinstance(window, int):
        groups.append(LayerGroup(sliding, window))
    return groups


def refuse_sliding_prefix_cache(config: Any, max_cache_len: int) -> None:
    """Raises InvalidArgumentError (:data:`SLIDING_PREFIX_CACHE_REFUSAL`) when ``config`` has
    layers whose window slides within ``max_cache_len`` tokens."""
    if any(g.sliding for g in layer_groups(config, max_cache_len)):
        raise InvalidArgumentError(SLIDING_PREFIX_CACHE_REFUSAL)


def group_plan(spec: LayerGroup, geometry: KvGeometry, layout: str, granule: int) -> LayoutPlan:
    """The plan of layer group ``spec`` of a model of ``geometry`` (every layer): the
    geometry's heads, head dim, dtype and maximum tokens over the group's layers."""
    if len(spec.layers) != geometry.layers:
        geometry = KvGeometry(
            layers=len(spec.layers),
            kv_heads=geometry.kv_heads,
            head_dim=geometry.head_dim,
            max_tokens=geometry.max_tokens,
            dtype=geometry.dtype,
        )
    return LayoutPlan(geometry, layout, granule)


class CacheGroup:
    """One layer group's memory in a KvvmCache: its plan, its batch (one slot per request and
    the scratch slot), the batch as one tensor while bound, each layer's place in it and,
    for a sliding group, each request's first token kept (``floors``, on the host and the
    device: attention never reads before it).

    Args:
        spec: the layers and their window.
        geometry: the whole model's geometry (heads, head dim, dtype, max tokens).
        manager, layout: as the cache's.
        slots: the batch's slots, the scratch included.
        precommit: grow through the manager's pre-committer.
        batch: a batch to bind to (made here when omitted).
    """

    def __init__(
        self,
        spec: LayerGroup,
        geometry: KvGeometry,
        manager: Manager,
        layout: str,
        slots: int,
        precommit: bool,
        batch: SequenceBatch | None = None,
    ) -> None:
        self.spec = spec
        self.plan = group_plan(spec, geometry, layout, manager.granule)
        self.geometry = self.plan.geometry
        self.batch = batch or SequenceBatch(
            manager, self.plan, slots, geometry.max_tokens, precommit=precommit, window_handles=spec.sliding
        )
        strides = self.plan.strides()
        e = geometry.dtype_bytes
        self._token_bytes = int(strides["token"])
        #: Each of the group's layers' place in the slab (see :func:`kvvm.kernels.attend.slab_kv`).
        self.layouts = [
            [
                j * strides["layer"] // e,
                (j * strides["layer"] + strides["kv"]) // e,
                strides["head"] // e,
                strides["token"] // e,
                geometry.kv_heads,
                geometry.max_tokens,
                geometry.head_dim,
            ]
            for j in range(len(spec.layers))
        ]
        self.slab: torch.Tensor | None = None
        requests = slots - 1
        self.host_floors = [0] * requests
        self.floors: torch.Tensor | None = None

    @property
    def window(self) -> int:
        """The sliding window (0: full attention)."""
        return self.spec.window or 0

    # ---- binding ----

    def bind(self, dtype: torch.dtype) -> torch.Tensor:
        """The batch as one dense tensor of ``dtype`` (a view of every slot), kept as
        :attr:`slab`; the device floors are made on its device the first time."""
        slab = torch.from_dlpack(self.batch.slab())
        if slab.dtype != dtype:
            raise InvalidArgumentError(f"slab dtype {slab.dtype}, expected {dtype}")
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(slab)
        if self.floors is None:
            self.floors = torch.zeros(len(self.host_floors), dtype=torch.int32, device=slab.device)
            torch._dynamo.mark_static_address(self.floors)
        self.slab = slab
        return slab

    def kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's ``index``-th layer's K and V over every slot."""
        if self.slab is None:
            raise InvalidArgumentError("the cache's memory is not bound")
        return slab_kv(self.slab, self.layouts[index])

    # ---- a sliding window's tokens ----

    def _windows_behind(self, tokens: int) -> int:
        return tokens * self._token_bytes // self.plan.granule

    def next_floor(self, slot: int, length: int) -> int:
        """The first token ``slot`` keeps once a step after ``length`` tokens is prepared:
        where its window starts when that gives back at least one window, else where it is
        (the tokens are forgotten a window at a time: each time costs a device
        synchronization)."""
        floor = self.host_floors[slot]
        keep = self.spec.kept_from(length)
        return keep if self._windows_behind(keep) > self._windows_behind(floor) else floor

    def bounds(self, bounds: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """A step's ``[slot, start, end]`` rows of slots ``first..first+count`` with each
        start raised to the slot's first kept token: on the device, so that nothing, not
        even a step launched without its preparation, reads a window given back."""
        if self.floors is None or not self.spec.sliding:
            return bounds
        floors = self.floors.narrow(0, first, count)
        start = torch.minimum(torch.maximum(bounds[:, 1], floors), bounds[:, 2])
        return torch.stack([bounds[:, 0], start, bounds[:, 2]], dim=1)

    def forget_behind(
        self, lengths: dict[int, int], upload: Callable[[torch.Tensor, list[int]], None], unbound: Callable[[], Any],
    ) -> int:
        """Gives back, for each slot of ``lengths`` (slot: tokens before the coming step),
        the windows wholly behind its window: the device floors are raised first (ordered
        before the next step), then, with the cache's tensors dropped (``unbound``: a
        context) and the device synchronized, the windows are unmapped. Returns the bytes
        unmapped (0, with nothing done, when no slot has a whole window behind)."""
        moved = {i: f for i, n in lengths.items() if (f := self.next_floor(i, n)) != self.host_floors[i]}
        if not moved:
            return 0
        for i, f in moved.items():
            self.host_floors[i] = f
        assert self.floors is not None
        upload(self.floors, self.host_floors)
        first, last = min(moved), max(moved)
        tokens = [moved.get(i, 0) for i in range(first, last + 1)]
        with unbound():
            return int(self.batch.forget_each(tokens, first=first))

    def start_floors(self, first: int, upload: Callable[[torch.Tensor, list[int]], None]) -> None:
        """Every request slot starts at token ``first``: the tokens before it were forgotten
        from the start (a sliding group given a prefix's last tokens)."""
        if not first:
            return
        self.host_floors = [first] * len(self.host_floors)
        if self.floors is not None:
            upload(self.floors, self.host_floors)

    def reset_floor(self, slot: int, upload: Callable[[torch.Tensor, list[int]], None]) -> None:
        """``slot`` starts again from token 0 (its memory was released)."""
        if self.host_floors[slot]:
            self.host_floors[slot] = 0
            if self.floors is not None:
                upload(self.floors, self.host_floors)
