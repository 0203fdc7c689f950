"""A Hugging Face transformers ``Cache`` whose K/V live in kvvm reservations.

:class:`KvvmCache` keeps every layer's K and V of a batch in a :class:`~kvvm.SequenceBatch`
(one slot per request, all slots at a constant stride): growth commits windows in place (no
``torch.cat``, no copy, the pointer never changes) and only the windows holding live tokens
are committed. Each request's token count lives in a device tensor
(:class:`~kvvm.slots.SlotState`): a step writes each request's new K/V at its own position
with device-side indices, so requests of different lengths decode in one batch, without
padding.

What attention receives depends on the model's attention implementation:

- with :data:`~kvvm.attention.ATTENTION` (:func:`use_kvvm_attention`): full-length K/V views
  whose addresses never change and each request's token range as a device tensor
  (:func:`kvvm.attend.attend` reads exactly those tokens). Nothing depends on a length known
  on the host, so the cache is compileable: ``generate`` compiles its decode step with CUDA
  graphs by itself, and a decode step can be captured by hand (:mod:`kvvm.graph`);
- with any other attention: exact-length views (every request of the batch at the same
  length, as ``generate`` pads them), for SDPA and the like. Eager only.

Before every step the host makes the tokens it will write committed and claimed (a growth the
budget cannot grant is raised then, as :class:`~kvvm.errors.BackpressureError`, before
anything is launched); on the device a write past what the host prepared goes to a scratch
slot instead of unmapped memory.

:class:`kvvm.prefix.KvvmPrefix` prefills a shared system prompt once into shared memory;
:meth:`KvvmCache.from_prefix` gives it to N new requests (billed once: its whole windows
mapped read-only, the few bytes past them copied into each request's own memory; on
sliding-window layers the last tokens copied).

Requires torch and transformers (5.x); the rest of kvvm does not.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache

from . import (
    KvGeometry,
    LayoutPlan,
    Manager,
    ReleasedError,
    SequenceBatch,
    geometry_from_config,
)
from .architectures import check_servable
from .attention import ATTENTION, KvvmMask, decoder_config, register_attention, use_kvvm_attention
from .cache_groups import CacheGroup, layer_groups
from .cache_layer import KvvmLayer, StepQuery, host_work
from .errors import GraphsAliveError, InvalidArgumentError, ViewsAliveError
from .slots import SlotState

if TYPE_CHECKING:
    from .prefix import KvvmPrefix

__all__ = [
    "ATTENTION",
    "KvvmCache",
    "KvvmLayer",
    "cache_argument",
    "register_attention",
    "use_kvvm_attention",
]

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


def cache_argument(model: Any) -> str:
    """The keyword under which ``model``'s forward and ``generate`` take a cache: ``"cache"``
    from transformers 5.24 on (which deprecates the old name), ``"past_key_values"`` before.
    Use it as ``model.generate(ids, **{cache_argument(model): cache})``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _unmap(unmap: Callable[[], int]) -> int:
    """``unmap()`` (a release or shrink of the cache's memory), once more after a collection
    of unreachable Python objects when it is refused because views are alive: a view kept
    only by a reference cycle (a frame kept by an exception's traceback, for one) reads
    nothing and is freed by the collector, at a time that would otherwise decide whether the
    unmap succeeds. A view something can still reach keeps the refusal."""
    try:
        return unmap()
    except ViewsAliveError:
        gc.collect()
        return unmap()


class KvvmCache(Cache):
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
            slot), or a list of one per layer group (:mod:`kvvm.cache_groups`, in their order);
            made here when omitted.
        start_tokens: live tokens already in every slot of ``batch``.

    The layers are laid out in groups (:mod:`kvvm.cache_groups`): the full-attention layers
    in one batch, a model's sliding-window layers in another whose windows behind the window
    are given back as requests grow (each request holds about ``window`` tokens there,
    whatever its length). :attr:`groups` lists them; :attr:`plan` and :attr:`batch` are the
    first group's (the only one of a full-attention model). A shared prefix
    (:class:`kvvm.prefix.KvvmPrefix`) is laid out in the same groups (:meth:`from_prefix`).

    Use it as ``model.generate(..., past_key_values=KvvmCache(model, B, L))`` (transformers
    5.24 and later name the argument ``cache=``), in a hand-written decode loop, or captured
    (:class:`kvvm.graph.DecodeGraph`); call :meth:`release` (or use it as a context manager)
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
    ) -> None:
        check_servable(config)
        model_dtype = getattr(config, "dtype", None)
        if hasattr(config, "config") and isinstance(model_dtype, torch.dtype):
            # A model: the cache holds what its layers produce.
            config = config.config
            if dtype is None:
                dtype = model_dtype
        cfg = decoder_config(config)
        if batch_size <= 0 or max_cache_len <= 0:
            raise InvalidArgumentError("batch_size and max_cache_len must be positive")
        specs = layer_groups(cfg, max_cache_len)
        batches: list[SequenceBatch | None] = (
            list(batch) if isinstance(batch, list) else [None] * len(specs) if batch is None else [batch]
        )
        if len(batches) != len(specs):
            raise InvalidArgumentError(
                f"{len(batches)} batch(es) to bind to for the model's {len(specs)} layer group(s)"
            )
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
        precommit = precommit and manager.precommit
        geometry = geometry_from_config(cfg, max_cache_len, dtype)
        self._config = cfg
        self.manager = manager
        #: The whole model's geometry (every layer).
        self.geometry: KvGeometry = geometry
        self._max_len = max_cache_len
        for b in batches:
            if b is not None and len(b) != batch_size + 1:
                raise InvalidArgumentError(
                    f"the batch has {len(b)} slots, not {batch_size} and the scratch slot"
                )
        #: The layer groups, each in memory of its own (:mod:`kvvm.cache_groups`).
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
        self._graphs: weakref.WeakSet[Any] = weakref.WeakSet()
        self._capturing: Any = None
        self._bind()
        assert self._slab is not None
        self.state: SlotState = SlotState(
            self.batch, self.plan, self._slab.device, more=[(g.batch, g.plan) for g in self.groups[1:]]
        )
        if any(g.spec.sliding for g in self.groups):
            self.state.before_growth = self._forget_behind
        if start_tokens:
            self.state.set_lengths({i: start_tokens for i in range(batch_size)})
        layers: list[Any] = [KvvmLayer(self, i, self.groups[g].spec.sliding) for i, g, _ in self._where]
        super().__init__(layers=layers)

    # ---- construction from a shared prefix ----

    @classmethod
    def from_prefix(
        cls, prefix: KvvmPrefix, batch_size: int, max_cache_len: int, **kwargs: Any
    ) -> KvvmCache:
        """A cache of ``batch_size`` new requests that all start with ``prefix``
        (:class:`kvvm.prefix.KvvmPrefix`), at ``prefix.tokens`` live tokens. On full-attention
        layers its whole windows are mapped read-only into every slot (billed once) and its
        bytes past them copied into each slot's own windows (a request never writes into
        read-only memory, whatever the model's bytes per token); on sliding-window layers each
        slot takes, by copy, only the last tokens the next step reads. Prefill each request's
        own suffix next."""
        for fixed in ("dtype", "layout", "manager", "batch", "start_tokens"):
            if fixed in kwargs:
                raise InvalidArgumentError(f"{fixed} comes from the prefix; do not pass it")
        precommit = kwargs.pop("precommit", True)
        batches, firsts = prefix.batches_for(batch_size, max_cache_len, precommit)
        cache = cls(
            prefix.config,
            batch_size,
            max_cache_len,
            manager=prefix.manager,
            layout=prefix.plan.layout,
            dtype=prefix.plan.geometry.dtype,
            batch=batches,
            start_tokens=prefix.tokens,
            **kwargs,
        )
        for group, first in zip(cache.groups, firsts, strict=True):
            group.start_floors(first, cache.state.upload)
        return cache

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
        for layer in self.layers:
            if isinstance(layer, KvvmLayer):
                layer.keys = layer.values = None

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
                g.forget_behind(lengths, self.state.upload, self.unbound, _unmap)
            except ViewsAliveError:
                # A tensor of the cache's memory held elsewhere: the windows stay mapped (safe:
                # nothing reads them), and go with the next window the slot moves past.
                pass

    # ---- one step ----

    @property
    def device_lengths(self) -> bool:
        """Whether attention gets full-length views and device token ranges (the model
        attends with the kvvm attention) rather than exact-length views."""
        return getattr(self._config, "_attn_implementation", None) == ATTENTION

    @property
    def batch_size(self) -> int:
        """Requests (slots), the scratch slot not counted."""
        return self.state.slots

    def layer_update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s part of a forward (what its :class:`KvvmLayer` runs): writes the
        step's new ``keys``/``values`` (``[batch, kv_heads, q, head_dim]``) after each selected
        request's live tokens and returns what attention reads (exact-length views, or the
        full-length tensors when lengths live on the device)."""
        st = self.state
        if keys.dtype != self._torch_dtype:
            raise InvalidArgumentError(
                f"the model's K/V are {keys.dtype} and this KvvmCache holds {self._torch_dtype}: "
                f"make the cache with dtype={keys.dtype} (or pass the model itself, "
                "KvvmCache(model, ...), to take its dtype)"
            )
        self._check_batch(keys.shape[0])
        q = keys.shape[2]
        last = layer == len(self._where) - 1
        if host_work():
            self._check_step(layer, q)
        elif layer == 0 and not torch.compiler.is_compiling() and self._capturing is None:
            # ``_capturing`` is read outside a trace only: a guard on it would recompile there.
            raise InvalidArgumentError(
                "a CUDA graph is being captured over a KvvmCache without its knowledge: capture "
                "inside `with cache.capture(graph):` (or use kvvm.graph.DecodeGraph)"
            )
        if self.device_lengths:
            # Written by the kvvm attention, with the step the kvvm mask computed (once or,
            # a mask per attention type, twice: the last layer moves the counts on).
            if last:
                st.advance(st.index(q))
                if host_work():
                    st.prepared = False
            return keys, values
        index = st.index(q)
        k_all, v_all = self._kv(layer)
        k_all[index.slot, :, index.token] = keys.transpose(1, 2)
        v_all[index.slot, :, index.token] = values.transpose(1, 2)
        if last:
            st.advance(index)
            st.prepared = False
        k_all, v_all = k_all.narrow(0, st.first, st.count), v_all.narrow(0, st.first, st.count)
        length = self._uniform_length()
        lo = self._exact_floor(self._where[layer][1])
        return k_all.narrow(2, lo, length - lo), v_all.narrow(2, lo, length - lo)

    def _exact_floor(self, group: int, q: int = 0) -> int:
        """Where exact-length views of ``group`` start: the first token every selected request
        keeps there once the step is prepared (0 for full attention). ``q``: the step's
        tokens, when it is not prepared yet (what its preparation will forget is known)."""
        g = self.groups[group]
        if not g.spec.sliding:
            return 0
        st = self.state
        if q:
            return max(g.next_floor(i, st.host_lengths[i]) for i in st.selected)
        return max(g.host_floors[i] for i in st.selected)

    def _check_batch(self, batch: int) -> None:
        """A forward of ``batch`` sequences over the selected slots: one each."""
        count = self.state.count
        if batch != count:
            raise InvalidArgumentError(
                f"a batch of {batch} sequences for {count} KvvmCache slot(s): make the "
                "cache with one slot per sequence (requests x num_return_sequences). Beam search "
                "(num_beams > 1) is not supported: KvvmCache does not reorder its slots"
            )

    def _check_step(self, layer: int, q: int) -> None:
        """Eagerly, at the first layer: the step is prepared (with exact-length views the
        update prepares it; with the kvvm attention the kvvm mask must have)."""
        if layer != 0:
            return
        if self._released:
            raise ReleasedError("the KvvmCache was released")
        if self.state.prepared:
            return
        if self.device_lengths:
            raise InvalidArgumentError(
                "the step has no kvvm mask: with the kvvm attention, pass no attention mask of "
                "your own (or a 2-D padding mask) so that the cache's mask is built"
            )
        self.state.prepare(q)

    def _uniform_length(self) -> int:
        lengths = {self.state.host_lengths[i] for i in self.state.selected}
        if len(lengths) != 1:
            raise InvalidArgumentError(
                "requests of different lengths need the kvvm attention (use_kvvm_attention(model))"
            )
        return lengths.pop()

    def step_mask(self, q: int, padding_mask: Any, batch: Any = None) -> KvvmMask:
        """The kvvm mask of the next forward of ``batch`` sequences: the step's device work
        (where each request's new tokens go, each request's tokens after them, the counts
        moved on), after its host work when Python runs eagerly (the forward's batch checked
        against the selected slots, then the step's tokens committed and claimed; from a 2-D
        padding mask, a new batch's left padding recorded). A mask already made for this
        forward (``generate`` makes it before the forward) is handed back as it is."""
        if isinstance(padding_mask, KvvmMask):
            return padding_mask
        st = self.state
        if host_work():
            if self._released:
                raise ReleasedError("the KvvmCache was released")
            if isinstance(batch, int):
                self._check_batch(batch)
            if isinstance(padding_mask, torch.Tensor) and padding_mask.dim() == 2:
                self._check_batch(int(padding_mask.shape[0]))
                self._prepare_from_padding(q, padding_mask)
            elif not st.prepared:
                st.prepare(q)
        index, bounds = st.bounds(q)
        assert self._slab is not None
        mask = KvvmMask(bounds=bounds, slot=index.slot, token=index.token, slab=self._slab, layouts=self._layouts)
        if self._layer_slabs is not None:
            group_bounds = [g.bounds(bounds, st.first, st.count) for g in self.groups]
            mask.layer_slabs = self._layer_slabs
            mask.layer_bounds = [group_bounds[g] for _, g, _ in self._where]
            mask.windows = [self.groups[g].window for _, g, _ in self._where]
        return mask

    def _prepare_from_padding(self, q: int, mask: torch.Tensor) -> None:
        """``generate``'s step: ``mask`` covers every request's tokens so far and the step's.
        Prepared once per step (``generate`` may build the mask, then the forward again)."""
        st = self.state
        length = self._uniform_length()
        if st.prepared and length == mask.shape[-1]:
            return
        self._check_padding(q, mask)
        st.prepare(q)

    def _check_padding(self, q: int, mask: torch.Tensor) -> None:
        """A 2-D mask of ``generate``: every request's tokens so far plus the step's, padded
        on the left. A new batch's padding is recorded (never read); afterwards the mask must
        match the cache's length."""
        st = self.state
        length = self._uniform_length()
        if mask.shape[-1] != length + q:
            raise InvalidArgumentError(
                f"the attention mask covers {mask.shape[-1]} tokens; the cache holds {length} "
                f"and the step adds {q}"
            )
        if length:
            return
        m = mask.to(torch.bool)
        starts = (~m).to(torch.int32).cumprod(-1).sum(-1)
        live = m.sum(-1)
        if not bool(torch.equal(live + starts, torch.full_like(live, m.shape[-1]))):
            raise InvalidArgumentError("KvvmCache takes left padding only (ones after the first one)")
        sel = st.selected
        st.set_lengths({i: 0 for i in sel}, {i: int(s) for i, s in zip(sel, starts.tolist(), strict=True)})

    def layer_mask_sizes(self, q: int, layer: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of a step of ``q`` tokens at ``layer`` (its
        ``get_mask_sizes``): the reservation's length with device lengths, else the exact
        one, from the first token the layer's group keeps."""
        if self.device_lengths:
            return self._max_len, 0
        end = max(self.state.host_lengths[i] for i in self.state.selected) + q
        lo = self._exact_floor(self._where[layer][1], q)
        return end - lo, lo

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

    # ---- public ----

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
            freed = sum(_unmap(g.batch[slot].release) for g in self.groups)
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

    def crop(self, max_length: int) -> None:
        """Drops tokens from the end of every request (``max_length`` < 0: that many; >= 0:
        keep that many). The memory stays committed until :meth:`shrink` or release."""
        self.crop_tokens(max_length)

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
                        _unmap(g.batch[i].release)
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
            return sum(
                _unmap(functools.partial(g.batch[i].shrink, n)) for g in self.groups for i, n in lengths.items()
            )
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
            freed = sum(_unmap(g.batch.release) for g in self.groups)
        except Exception:
            self._bind()
            raise
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
            if isinstance(layer, KvvmLayer):
                yield layer.keys, layer.values
