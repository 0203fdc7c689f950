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

:class:`KvvmPrefix` prefills a shared system prompt once into shared memory;
:meth:`KvvmCache.from_prefix` attaches it read-only to N new requests (billed once).

Requires torch and transformers (5.x); the rest of kvvm does not.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.cache_utils import Cache

from . import (
    KvGeometry,
    LayoutPlan,
    Manager,
    ReleasedError,
    SequenceBatch,
    SharedPrefix,
    geometry_from_config,
)
from .attend import slab_kv
from .attention import ATTENTION, KvvmMask, decoder_config, register_attention, use_kvvm_attention
from .cache_layer import KvvmLayer, StepQuery, host_work
from .errors import GraphsAliveError, InvalidArgumentError, ViewsAliveError
from .slots import SlotState

__all__ = [
    "ATTENTION",
    "KvvmCache",
    "KvvmLayer",
    "KvvmPrefix",
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


def _check_full_attention(config: Any) -> None:
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        raise InvalidArgumentError(
            "KvvmCache supports full-attention decoders only (layer types: "
            f"{sorted(set(types))})"
        )
    if getattr(config, "sliding_window", None) is not None:
        raise InvalidArgumentError("KvvmCache does not support sliding-window attention")


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
        config: the model (its dtype is then the cache's) or its config (full-attention
            decoders: Llama, Mistral, Qwen2, ...).
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
            slot); made here when omitted.
        start_tokens: live tokens already in every slot of ``batch``.

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
        batch: SequenceBatch | None = None,
        start_tokens: int = 0,
    ) -> None:
        model_dtype = getattr(config, "dtype", None)
        if hasattr(config, "config") and isinstance(model_dtype, torch.dtype):
            # A model: the cache holds what its layers produce.
            config = config.config
            if dtype is None:
                dtype = model_dtype
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
        precommit = precommit and manager.precommit
        geometry = geometry_from_config(cfg, max_cache_len, dtype)
        self._config = cfg
        self.manager = manager
        self.geometry: KvGeometry = geometry
        self.plan = LayoutPlan(geometry, layout, manager.granule)
        self._max_len = max_cache_len
        self.batch = batch or SequenceBatch(
            manager, self.plan, batch_size + 1, max_cache_len, precommit=precommit
        )
        if len(self.batch) != batch_size + 1:
            raise InvalidArgumentError(
                f"the batch has {len(self.batch)} slots, not {batch_size} and the scratch slot"
            )
        self._torch_dtype = _torch_dtype(geometry.dtype)
        self._released = False
        self._slab: torch.Tensor | None = None
        self._graphs: weakref.WeakSet[Any] = weakref.WeakSet()
        self._capturing: Any = None
        self._bind()
        assert self._slab is not None
        self.state: SlotState = SlotState(self.batch, self.plan, self._slab.device)
        if start_tokens:
            self.state.set_lengths({i: start_tokens for i in range(batch_size)})
        layers: list[Any] = [KvvmLayer(self, i) for i in range(geometry.layers)]
        super().__init__(layers=layers)

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
            batch_size + 1,
            max_cache_len,
            precommit=kwargs.pop("precommit", True) and prefix.manager.precommit,
        )
        for i in range(batch_size):
            prefix.shared.attach(batch[i])
        batch.ensure(prefix.tokens, first=0, count=batch_size)
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
        tail = prefix.shared.shared_tokens
        if tail < prefix.tokens:
            if prefix.cache is None:
                raise InvalidArgumentError("the prefix's tail tokens have no owner to copy them from")
            span = slice(tail, prefix.tokens)
            for layer in range(cache.geometry.layers):
                for mine, owner in zip(cache._kv(layer), prefix.cache._kv(layer), strict=True):
                    # [1, H, t, D] broadcast into every request's slot (not the scratch).
                    mine[:batch_size, :, span].copy_(owner[:1, :, span])
        return cache

    # ---- binding ----

    def _bind(self) -> None:
        """The batch as one dense tensor (every slot and the scratch), and where each layer's
        K and V lie in it (:meth:`_kv`)."""
        if self._released:
            raise ReleasedError("the KvvmCache was released")
        slab = torch.from_dlpack(self.batch.slab())
        if slab.dtype != self._torch_dtype:
            raise InvalidArgumentError(f"slab dtype {slab.dtype}, expected {self._torch_dtype}")
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(slab)
        geo = self.geometry
        e = geo.dtype_bytes
        strides = self.plan.strides()
        self._head_stride = strides["head"] // e
        self._token_stride = strides["token"] // e
        self._offsets = [
            (layer * strides["layer"] // e, (layer * strides["layer"] + strides["kv"]) // e)
            for layer in range(geo.layers)
        ]
        self._layouts = [
            [k_off, v_off, self._head_stride, self._token_stride, geo.kv_heads, self._max_len, geo.head_dim]
            for k_off, v_off in self._offsets
        ]
        self._slab = slab

    def _unbind(self) -> None:
        self._slab = None
        for layer in self.layers:
            if isinstance(layer, KvvmLayer):
                layer.keys = layer.values = None

    def _kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V over every slot: ``[slots + 1, kv_heads, max, head_dim]``
        strided views of the slab."""
        if self._slab is None:
            raise ReleasedError("the KvvmCache was released")
        return slab_kv(self._slab, self._layouts[layer])

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
        last = layer == self.geometry.layers - 1
        if host_work():
            self._check_step(layer, q)
        elif layer == 0 and not torch.compiler.is_compiling() and self._capturing is None:
            # ``_capturing`` is read outside a trace only: a guard on it would recompile there.
            raise InvalidArgumentError(
                "a CUDA graph is being captured over a KvvmCache without its knowledge: capture "
                "inside `with cache.capture(graph):` (or use kvvm.graph.DecodeGraph)"
            )
        if self.device_lengths:
            # Written by the kvvm attention, with the step the kvvm mask computed.
            if last and host_work():
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
        return k_all.narrow(2, 0, length), v_all.narrow(2, 0, length)

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
        index, bounds = st.step(q)
        assert self._slab is not None
        return KvvmMask(bounds=bounds, slot=index.slot, token=index.token, slab=self._slab, layouts=self._layouts)

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

    def layer_mask_sizes(self, q: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of a step of ``q`` tokens (a layer's ``get_mask_sizes``):
        the reservation's length with device lengths, else the exact one."""
        if self.device_lengths:
            return self._max_len, 0
        return max(self.state.host_lengths[i] for i in self.state.selected) + q, 0

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
            return _unmap(self.batch[slot].release)

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
        and the device; the memory stays committed."""
        st = self.state
        keep = {}
        for i in range(st.slots):
            n = st.host_lengths[i]
            keep[i] = max(0, min(n, tokens if tokens >= 0 else n + tokens))
        st.set_lengths(keep)

    def reset_counts(self) -> None:
        """Every request back to no live tokens (the memory stays committed)."""
        self.state.set_lengths({i: 0 for i in range(self.state.slots)}, {i: 0 for i in range(self.state.slots)})

    @property
    def committed_bytes(self) -> int:
        """Bytes mapped in the requests' slots (shared prefix windows counted per slot)."""
        return sum(self.batch[i].committed_bytes for i in range(self.batch_size))

    @property
    def owned_bytes(self) -> int:
        """Physical bytes the requests hold on their own (a shared prefix excluded)."""
        return sum(self.batch[i].owned_bytes for i in range(self.batch_size))

    @property
    def held_bytes(self) -> int:
        """Physical bytes the cache holds on its own, the scratch slot included."""
        return self.batch.owned_bytes

    def shrink(self) -> int:
        """Gives back the windows past each request's live tokens (committed ahead by the
        pre-committer or left by :meth:`crop`); returns the bytes unmapped. Safe with
        captured graphs alive: their limits drop first, and the unmap waits for the device."""
        st = self.state
        lengths = {i: st.host_lengths[i] for i in range(st.slots)}
        st.set_lengths(lengths)
        self._unbind()
        try:
            return sum(_unmap(functools.partial(self.batch[i].shrink, n)) for i, n in lengths.items())
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
            freed = _unmap(self.batch.release)
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


def _prefix_plan(model: Any, manager: Manager, max_cache_len: int, layout: str, dtype: Any) -> tuple[Any, LayoutPlan]:
    """The decoder config and the plan a prefix of ``model`` is laid out under (the model's
    dtype unless ``dtype`` is given): one for the process that builds it and those that open it."""
    cfg = decoder_config(model.config)
    if dtype is None and isinstance(getattr(model, "dtype", None), torch.dtype):
        dtype = model.dtype
    return cfg, LayoutPlan(geometry_from_config(cfg, max_cache_len, dtype), layout, manager.granule)


class KvvmPrefix:
    """A prompt prefix prefilled once into shared kvvm memory, to be attached read-only to
    new requests with :meth:`KvvmCache.from_prefix`.

    Build it with :meth:`build`; keep it alive while caches made from it live (it holds
    the owner's sequence).
    """

    def __init__(
        self, config: Any, manager: Manager, plan: LayoutPlan, cache: KvvmCache | None, shared: SharedPrefix
    ) -> None:
        self.config = config
        self.manager = manager
        self.plan = plan
        self.cache = cache
        self.shared = shared
        #: The prefill's logits at the prefix's last token (``[1, vocab]``), set by :meth:`build`.
        self.last_logits: torch.Tensor | None = None

    def publish(self, key: str) -> int:
        """Publishes the prefix to the node's memory broker under ``key`` (its manager leases
        from one: ``Manager(broker=...)``): other processes of the tenant :meth:`open` it and
        map the same memory read-only, billed once to the tenant. Returns the bytes
        published. Let go of it with ``manager.close_prefix(key)``."""
        return self.shared.publish(self.manager, key)

    @classmethod
    def open(
        cls,
        model: Any,
        key: str,
        *,
        manager: Manager,
        max_cache_len: int,
        layout: str = "token-major",
        dtype: Any = None,
    ) -> KvvmPrefix:
        """The prefix another process published under ``key`` (:meth:`publish`), mapped
        read-only through ``manager`` (leasing from the same broker, as the same tenant).
        ``max_cache_len``, ``layout`` and ``dtype`` must be the publisher's (its plan; else
        ``InvalidArgumentError``). Its :attr:`tokens` are those in whole shared windows (the
        publisher's partial tail is not shared): prefill the rest of each prompt from there.
        Not billed here; :attr:`last_logits` is None."""
        cfg, plan = _prefix_plan(model, manager, max_cache_len, layout, dtype)
        return cls(cfg, manager, plan, None, SharedPrefix.open(manager, key, plan))

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
        cfg, plan = _prefix_plan(model, manager, max_cache_len, layout, dtype)
        geometry = plan.geometry
        batch = SequenceBatch(manager, plan, 2, max_cache_len)
        shared = batch[0].own_prefix(prompt)
        cache = KvvmCache(
            cfg, 1, max_cache_len, manager=manager, layout=layout, dtype=geometry.dtype, batch=batch
        )
        pos = torch.arange(prompt, device=input_ids.device)[None]
        out = model(input_ids=input_ids, use_cache=True, position_ids=pos, **{cache_argument(model): cache})
        if input_ids.device.type == "cuda":
            torch.cuda.synchronize(input_ids.device)
        shared.seal()
        prefix = cls(cfg, manager, plan, cache, shared)
        prefix.last_logits = out.logits[:, -1]
        return prefix
