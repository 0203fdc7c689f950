"""The memory of a :class:`~kvvm.transformers.KvvmCache`: its layer groups' batches in kvvm
reservations (:mod:`kvvm.transformers.cache_groups`), the requests' token counts
(:class:`~kvvm.transformers.slots.SlotState`), the batches bound as tensors, and what a caller
does with that memory between steps: admit a request into a slot, reserve a step's tokens,
free a slot, crop, shrink, release.

:class:`CacheMemory` is the base of :class:`~kvvm.transformers.cache_step.CacheStep` (one
step's writes and views) and of ``KvvmCache`` (transformers' ``Cache``); it knows nothing of
transformers. Requires torch.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..bindings import KvGeometry, LayoutPlan, Manager, SequenceBatch, geometry_from_config
from ..errors import GraphsAliveError, InvalidArgumentError, ReleasedError, ViewsAliveError
from ..kernels.fp8 import E4M3, make_scales
from .cache_groups import CacheGroup, LayerGroup
from .slots import SlotState

__all__ = ["CacheMemory"]

_TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": E4M3,
}


def _torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(f"KvvmCache does not support the KV dtype {name}") from None


class CacheMemory:
    """The layer groups of a cache of ``batch_size`` requests (and a scratch slot) in kvvm
    memory, their token counts, and the batches bound as tensors (see the module).

    Args:
        config: the decoder config (its layers, heads, head dim).
        specs: its layer groups (:func:`~kvvm.transformers.cache_groups.layer_groups`).
        batch_size, max_cache_len: requests, and the most tokens each may reach.
        manager: the kvvm manager (addressable memory); ``owns_manager``: made for this
            cache (its pre-commit worker stops with :meth:`release`).
        layout, dtype, precommit: as ``KvvmCache``'s.
        batches: one batch to bind to per group (None: made here).
        start_tokens: live tokens already in every slot of the batches.
        kv_scales: an FP8 cache's scales (:func:`kvvm.kernels.fp8.make_scales`; refused for
            any other dtype).
    """

    def __init__(
        self,
        config: Any,
        specs: list[LayerGroup],
        batch_size: int,
        max_cache_len: int,
        manager: Manager,
        *,
        owns_manager: bool,
        layout: str,
        dtype: Any,
        precommit: bool,
        batches: list[SequenceBatch | None],
        start_tokens: int,
        kv_scales: Any = None,
    ) -> None:
        precommit = precommit and manager.precommit
        geometry = geometry_from_config(config, max_cache_len, dtype)
        if kv_scales is not None and geometry.dtype != "fp8":
            raise InvalidArgumentError(f"kv_scales are an FP8 cache's; this one holds {geometry.dtype}")
        self._config = config
        self._owns_manager = owns_manager
        self.manager = manager
        #: The whole model's geometry (every layer).
        self.geometry: KvGeometry = geometry
        self._max_len = max_cache_len
        for b in batches:
            if b is not None and len(b) != batch_size + 1:
                raise InvalidArgumentError(
                    f"the batch has {len(b)} slots, not {batch_size} and the scratch slot"
                )
        #: The layer groups, each in memory of its own (:mod:`kvvm.transformers.cache_groups`).
        self.groups: list[CacheGroup] = [
            CacheGroup(spec, geometry, manager, layout, batch_size + 1, precommit, b)
            for spec, b in zip(specs, batches, strict=True)
        ]
        #: Each layer's group and its index in it.
        self._where = sorted((layer, g, j) for g, grp in enumerate(self.groups) for j, layer in enumerate(grp.spec.layers))
        self.plan: LayoutPlan = self.groups[0].plan
        self.batch: SequenceBatch = self.groups[0].batch
        self._torch_dtype = _torch_dtype(geometry.dtype)
        self._released = False
        self._slab: torch.Tensor | None = None
        self._layer_slabs: list[torch.Tensor] | None = None
        self._graphs: weakref.WeakSet[Any] = weakref.WeakSet()
        self._capturing: Any = None
        self._bind()
        assert self._slab is not None
        #: An FP8 cache's scales, fp32 ``[layers, 2, kv_heads]`` on the cache's device (each
        #: layer's K and V scale per KV head, fixed for the cache's life: :mod:`kvvm.kernels.fp8`);
        #: None for any other dtype.
        self.kv_scales: torch.Tensor | None = None
        if self._torch_dtype == E4M3:
            self.kv_scales = make_scales(geometry.layers, geometry.kv_heads, kv_scales, self._slab.device)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.kv_scales)
        #: Each layer's ``[2, kv_heads]`` scales (views of :attr:`kv_scales`), as a step's mask
        #: hands them to attention.
        self._layer_scales: list[torch.Tensor] | None = None if self.kv_scales is None else list(self.kv_scales.unbind(0))
        self.state: SlotState = SlotState(
            self.batch, self.plan, self._slab.device, more=[(g.batch, g.plan) for g in self.groups[1:]]
        )
        if any(g.spec.sliding for g in self.groups):
            self.state.before_growth = self._forget_behind
        if start_tokens:
            self.state.set_lengths({i: start_tokens for i in range(batch_size)})

    # ---- binding ----

    def _bind(self) -> None:
        """Each group's batch as one dense tensor (every slot and the scratch), and where each
        layer's K and V lie in its group's (:meth:`_kv`)."""
        if self._released:
            raise ReleasedError("the KvvmCache was released")
        slabs = [g.bind(self._torch_dtype) for g in self.groups]
        self._layouts = [self.groups[g].layouts[j] for _, g, j in self._where]
        several = len(self.groups) > 1 or self.groups[0].spec.sliding
        self._layer_slabs = [slabs[g] for _, g, _ in self._where] if several else None
        self._slab = slabs[0]

    def _unbind(self) -> None:
        self._slab = None
        self._layer_slabs = None
        for g in self.groups:
            g.slab = None

    def _kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V over every slot: ``[slots + 1, kv_heads, max, head_dim]``
        strided views of its group's memory."""
        if self._slab is None:
            raise ReleasedError("the KvvmCache was released")
        _, g, j = self._where[layer]
        return self.groups[g].kv(j)

    def _forget_behind(self, slots: list[int]) -> None:
        """A step of ``slots`` is being prepared: each sliding group gives back the windows
        behind each slot's window (see :meth:`CacheGroup.forget_behind`)."""
        lengths = {i: self.state.host_lengths[i] for i in slots}
        for g in self.groups:
            if not g.spec.sliding:
                continue
            try:
                g.forget_behind(lengths, self.state.upload, self.unbound)
            except ViewsAliveError:
                # A tensor of the cache's memory held elsewhere: the windows stay mapped (safe:
                # nothing reads them), and go with the next window the slot moves past.
                pass

    # ---- between steps ----

    @property
    def batch_size(self) -> int:
        """Requests (slots), the scratch slot not counted."""
        return self.state.slots

    def select(self, first: int, count: int = 1) -> contextlib.AbstractContextManager[None]:
        """Runs the forwards inside on slots ``first..first+count`` only: a request's
        prefill into its own slot (``model(input_ids[None], past_key_values=cache)``)."""
        return self.state.select(first, count)

    @contextlib.contextmanager
    def capture(self, graph: Any) -> Iterator[None]:
        """Captures ``graph`` (a ``torch.cuda.CUDAGraph``) over this cache: use
        ``with cache.capture(g), torch.cuda.graph(g): model(...)``. The cache keeps a weak
        reference to ``graph`` and refuses :meth:`release` while it is alive. Prepare every
        replay with :meth:`prepare` (writes a replay makes past what was prepared are refused
        on the device, see :meth:`check`)."""
        if self._capturing is not None:
            raise InvalidArgumentError("a capture over this cache is already running")
        self._capturing = graph
        try:
            yield
        finally:
            self._capturing = None
            self._graphs.add(graph)

    def forget_graph(self, graph: Any) -> None:
        """Stops counting ``graph`` (its owner reset it, so it will not replay)."""
        self._graphs.discard(graph)

    def prepare(self, q: int = 1, slots: list[int] | None = None) -> None:
        """The host's side of the next step of ``q`` tokens per selected request (or of the
        requests in ``slots``: the others are neither written nor read if suspended or free),
        for a step launched without Python (a replayed graph): commits and claims them
        (raises BackpressureError, with nothing launched and no count moved, when the budget
        cannot grant it)."""
        if self._released:
            raise ReleasedError("the KvvmCache was released")
        self.state.prepare(q, slots)

    @contextlib.contextmanager
    def unbound(self) -> Iterator[None]:
        """Runs the block with the cache's own tensor over the batch dropped (it counts as a
        view of every slot, which an unmap or an admission waits for), and binds it again at
        the same address afterwards. Captured graphs stay valid: the addresses do not
        change, and what they may touch is decided by the device limits."""
        self._unbind()
        try:
            yield
        finally:
            self._bind()

    def free(self, slot: int) -> int:
        """Retires the request in ``slot``: no step touches it any more (its device limit is
        0 first), its memory is released once the device is done with it (the pool takes it
        back), and the slot is free for another request. Returns the bytes unmapped."""
        if not 0 <= slot < self.batch_size:
            raise InvalidArgumentError(f"slot {slot} is not one of the {self.batch_size} slots")
        st = self.state
        st.set_lengths({slot: 0}, {slot: 0})
        st.suspended.discard(slot)
        with self.unbound():
            freed = sum(g.batch[slot].release() for g in self.groups)
        for g in self.groups:
            g.reset_floor(slot, st.upload)
        return freed

    def ensure_slot(self, slot: int, tokens: int) -> int:
        """Commits what a request of ``tokens`` tokens in ``slot`` holds (its admission): all
        of them in the full-attention groups, the first ``window`` at most in a sliding one
        (the rest comes step by step as its oldest windows go). Returns the bytes committed;
        raises what :meth:`kvvm.Sequence.ensure` raises."""
        if not 0 <= slot < self.batch_size:
            raise InvalidArgumentError(f"slot {slot} is not one of the {self.batch_size} slots")
        return sum(
            g.batch[slot].ensure(min(tokens, g.window) if g.spec.sliding else tokens) for g in self.groups
        )

    def bytes_for_tokens(self, tokens: int) -> int:
        """Bytes a request of ``tokens`` tokens commits at most at admission, in every layer
        group (see :meth:`ensure_slot`)."""
        return sum(
            g.plan.committed_bytes_for_tokens(min(tokens, g.window) if g.spec.sliding else tokens)
            for g in self.groups
        )

    def reserve_tokens(self, tokens: dict[int, int]) -> None:
        """Commits, in every layer group, the windows each slot of ``tokens`` needs to hold
        ``tokens[slot]`` tokens (the next step's), after a sliding group gave back the windows
        behind each slot's window: the step's own preparation then needs no grant. Raises what
        :meth:`kvvm.SequenceBatch.ensure_each` raises (BackpressureError: nothing launched)."""
        if self.state.before_growth is not None:
            self.state.before_growth(sorted(tokens))
        targets = [tokens.get(i, 0) for i in range(self.batch_size)]
        for g in self.groups:
            g.batch.ensure_each(targets, first=0)

    def step_done(self) -> None:
        """Marks the prepared step as run (after a replay), so that an eager forward next
        prepares its own."""
        self.state.prepared = False

    def check(self) -> None:
        """Raises if a step wrote past what was prepared (see :meth:`SlotState.check`)."""
        self.state.check()

    def crop_tokens(self, tokens: int) -> None:
        """Keeps ``tokens`` live tokens per request (negative: drops that many), on the host
        and the device; the memory stays committed. A sliding layer group cannot go back
        before what it forgot: InvalidArgumentError then, with nothing cropped."""
        st = self.state
        keep = {}
        for i in range(st.slots):
            n = st.host_lengths[i]
            keep[i] = max(0, min(n, tokens if tokens >= 0 else n + tokens))
        for g in self.groups:
            for i, n in keep.items():
                if n and n != st.host_lengths[i] and g.spec.kept_from(n) < g.host_floors[i]:
                    raise InvalidArgumentError(
                        f"cannot crop request {i} to {n} tokens: its sliding-window layers gave back "
                        f"the tokens before {g.host_floors[i]}"
                    )
        st.set_lengths(keep)
        self._restart([i for i, n in keep.items() if n == 0])

    def reset_counts(self) -> None:
        """Every request back to no live tokens (the memory stays committed, but for the
        windows a sliding layer group gave back: its requests start again from token 0)."""
        self.state.set_lengths({i: 0 for i in range(self.state.slots)}, {i: 0 for i in range(self.state.slots)})
        self._restart(list(range(self.state.slots)))

    def _restart(self, slots: list[int]) -> None:
        """Slots back at token 0 whose sliding groups forgot tokens start those groups again
        (released: a forgotten token is never written again)."""
        for g in self.groups:
            gone = [i for i in slots if g.host_floors[i]]
            if gone:
                with self.unbound():
                    for i in gone:
                        g.batch[i].release()
                for i in gone:
                    g.reset_floor(i, self.state.upload)

    @property
    def committed_bytes(self) -> int:
        """Bytes mapped in the requests' slots (shared prefix windows counted per slot)."""
        return sum(g.batch[i].committed_bytes for g in self.groups for i in range(self.batch_size))

    @property
    def owned_bytes(self) -> int:
        """Physical bytes the requests hold on their own (a shared prefix excluded)."""
        return sum(g.batch[i].owned_bytes for g in self.groups for i in range(self.batch_size))

    @property
    def held_bytes(self) -> int:
        """Physical bytes the cache holds on its own, the scratch slot included."""
        return sum(g.batch.owned_bytes for g in self.groups)

    def shrink(self) -> int:
        """Gives back the windows past each request's live tokens (committed ahead by the
        pre-committer or left by :meth:`crop`); returns the bytes unmapped. Safe with
        captured graphs alive: their limits drop first, and the unmap waits for the device."""
        st = self.state
        lengths = {i: st.host_lengths[i] for i in range(st.slots)}
        st.set_lengths(lengths)
        self._unbind()
        try:
            return sum(g.batch[i].shrink(n) for g in self.groups for i, n in lengths.items())
        finally:
            self._bind()

    def release(self) -> int:
        """Drops the cache's tensors and releases every slot; returns the bytes unmapped.
        Tensors obtained from the cache must be gone (else ViewsAliveError, nothing
        released), and so must graphs captured over it (else GraphsAliveError). The cache
        cannot be used afterwards."""
        if self._released:
            return 0
        alive = len(self._graphs)
        if alive:
            raise GraphsAliveError(
                f"{alive} CUDA graph(s) captured over this cache may replay into its memory: "
                "close them (DecodeGraph.close()) or delete them first",
                graphs=alive,
            )
        self._unbind()
        try:
            freed = sum(g.batch.release() for g in self.groups)
        except Exception:
            self._bind()
            raise
        self._released = True
        if self._owns_manager:
            # The manager was made for this cache: its pre-commit worker has nothing left to do.
            self.manager.stop_precommit()
        return freed
