"""``kvvm``: the attention implementation for models whose cache is a
:class:`~kvvm.transformers.KvvmCache`, registered with transformers, and the model wrapper
that selects it.

With a KvvmCache, the mask function registered under this name does not build a mask: it
asks the cache for each request's token range ``[start, end)`` of the step (an int32 tensor,
handed to attention in the mask's place), and attention reads exactly those tokens from the
cache's full-length K/V with :func:`kvvm.kernels.attend.attend`. No mask, no ``repeat_kv``, no
length known on the host: the step compiles and captures.

With any other cache (or none) it is transformers' SDPA attention and mask, restricted to the
kernels that take any KV length as it comes (FlashAttention, memory-efficient, math): cuDNN's
SDPA plans every new KV length on the CPU (1.3 ms per layer and step on an H200 with torch
2.11).

Requires torch and transformers (5.x).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..bindings import decoder_config
from ..kernels.attend import KERNELS, write_attend
from .architectures import check_servable

if TYPE_CHECKING:
    from ..kernels.cascade import Tables

__all__ = [
    "ATTENTION",
    "AttentionSwitch",
    "KvvmMask",
    "kvvm_attention",
    "kvvm_mask",
    "register_attention",
    "switch_attention",
    "use_kvvm_attention",
]

#: The transformers attention implementation :func:`register_attention` registers.
ATTENTION = "kvvm"

_SCOPE = threading.local()
_SDPA: list[tuple[Callable[..., Any], Callable[..., Any]]] = []


def _sdpa() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """transformers' SDPA attention and mask functions (imported once)."""
    if not _SDPA:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import sdpa_mask

        _SDPA.append((sdpa_attention_forward, sdpa_mask))
    return _SDPA[0]


@contextlib.contextmanager
def _kernel_scope() -> Iterator[None]:
    """Restricts SDPA to the kernels that take any KV length as it comes, once per scope:
    nested scopes (a layer inside a model's forward) cost nothing more."""
    if getattr(_SCOPE, "active", False):
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        _SCOPE.active = True
        try:
            yield
        finally:
            _SCOPE.active = False


@dataclass
class KvvmMask:
    """What the kvvm mask function hands attention, in the mask's place, for a step of a
    :class:`~kvvm.transformers.KvvmCache`: where each request's new K/V go (``slot``,
    ``token``: int64 ``[batch, q]``), each request's slot and tokens once they are written
    (``bounds``: int32 ``[batch, 3]``), the batch's memory (``slab``) and where each layer
    lies in it (``layouts``). Built once per forward, before the first layer.

    A cache whose layers form several groups (full and sliding attention, each group its own
    memory) gives each layer its group's memory, token ranges and window (``layer_slabs``,
    ``layer_bounds``, ``windows``: one entry per layer; a window of 0 is full attention)."""

    bounds: Any
    slot: Any
    token: Any
    slab: Any
    layouts: list[list[int]]
    layer_slabs: list[Any] | None = None
    layer_bounds: list[Any] | None = None
    windows: list[int] | None = None
    #: The step's groups of requests sharing a prefix (:mod:`kvvm.kernels.cascade`), read by
    #: the full-attention layers of a decode step.
    cascade: Tables | None = None
    #: An FP8 cache's scales, one fp32 ``[2, kv_heads]`` tensor per layer (None: not FP8).
    layer_scales: list[Any] | None = None
    #: transformers' mask preparation takes any 4-D mask as finished and passes it through.
    ndim: int = 4

    def attend(
        self, layer: int, query: Any, key_new: Any, value_new: Any, scale: float | None, kernel: str,
        softcap: float = 0.0,
    ) -> Any:
        """Layer ``layer``'s write of the step's K/V and its attention (one operator), over
        its group's tokens and window, with the model's attention-logit soft cap."""
        slab = self.slab if self.layer_slabs is None else self.layer_slabs[layer]
        bounds = self.bounds if self.layer_bounds is None else self.layer_bounds[layer]
        window = 0 if self.windows is None else self.windows[layer]
        return write_attend(
            query, key_new, value_new, slab, self.slot, self.token, bounds, self.layouts[layer], scale, kernel,
            window, softcap, None if window else self.cascade,
            None if self.layer_scales is None else self.layer_scales[layer],
        )

    def check_window(self, layer: int, sliding_window: Any) -> None:
        """Refuses a layer the model attends with a sliding window the cache did not lay out
        for it (the cache holds what its config's layer types say)."""
        window = 0 if self.windows is None else self.windows[layer]
        if sliding_window is not None and window not in (0, int(sliding_window)):
            raise ValueError(
                f"layer {layer} attends over a window of {sliding_window} tokens; the cache keeps {window}"
            )
        if sliding_window is None and window:
            raise ValueError(f"layer {layer} attends to every token; the cache keeps a window of {window}")


def kvvm_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Any = None,
    **kwargs: Any,
) -> Any:
    """The mask function of :data:`ATTENTION`: a :class:`KvvmMask` when the cache is a
    KvvmCache (its ``get_query_offset`` is the hook), else SDPA's mask."""
    hook = getattr(q_offset, "kvvm_mask", None)
    if hook is not None:
        return hook(q_length, attention_mask, batch_size)
    return _sdpa()[1](
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )


def kvvm_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Any, None]:
    """The attention function of :data:`ATTENTION`: with a :class:`KvvmMask`, the step's new
    K/V (``key``, ``value``) written into the KvvmCache and each request's tokens attended
    (:func:`kvvm.kernels.attend.write_attend`), over the layer's sliding window if it has one, with
    the model's attention-logit soft cap (``softcap``, Gemma 2's); else transformers' SDPA
    attention (in the kernel scope)."""
    if isinstance(attention_mask, KvvmMask):
        if kwargs.get("s_aux") is not None:
            raise NotImplementedError("the kvvm attention has no attention sinks (s_aux)")
        kernel = getattr(getattr(module, "config", None), "kvvm_kernel", "auto")
        if "sliding_window" in kwargs:
            attention_mask.check_window(module.layer_idx, kwargs["sliding_window"])
        softcap = float(kwargs.get("softcap") or 0.0)
        return attention_mask.attend(module.layer_idx, query, key, value, scaling, kernel, softcap), None
    forward = _sdpa()[0]
    with _kernel_scope():
        return forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register_attention() -> str:
    """Registers :data:`ATTENTION` with transformers (attention and mask interfaces; idempotent)
    and returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, kvvm_attention)
    AttentionMaskInterface.register(ATTENTION, kvvm_mask)
    return ATTENTION


def use_kvvm_attention(model: Any, enable: bool = True, kernel: str = "auto") -> None:
    """Makes ``model`` attend with :data:`ATTENTION` (or, with ``enable=False``, with plain
    ``"sdpa"`` again). With a :class:`~kvvm.transformers.KvvmCache` this is what makes the
    decode step compileable and ragged batches possible; with other caches it is SDPA.

    ``kernel`` picks the kernel over a KvvmCache's token ranges (one of
    :data:`kvvm.kernels.attend.KERNELS`; kept in the config as ``kvvm_kernel``). The SDPA kernel
    choice is made once per call of ``model.forward`` (which is wrapped; the wrapper is
    removed with ``enable=False``), not once per layer: an eager step is host-bound.

    A model kvvm or its attention cannot serve is refused first, with the reason
    (:func:`kvvm.transformers.architectures.check_servable`), and left as it was."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; one of {KERNELS}")
    if enable:
        check_servable(model, attention=True)
    name = register_attention() if enable else "sdpa"
    _wrap_forward(model, enable)
    for cfg in {id(c): c for c in (model.config, decoder_config(model.config))}.values():
        cfg.kvvm_kernel = kernel
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        try:
            setter(name)
            return
        except (ValueError, KeyError, TypeError):
            pass
    for cfg in {id(c): c for c in (model.config, decoder_config(model.config))}.values():
        cfg._attn_implementation = name


_MISSING = object()


@dataclass
class AttentionSwitch:
    """How a model attended before :func:`switch_attention` moved it to the kvvm attention;
    :meth:`restore` puts it back as it was."""

    model: Any
    #: Whether the model's forward was wrapped already (by an earlier switch).
    wrapped: bool
    #: Every config of the model and its attention implementation then (set directly back:
    #: no recursion through sub-configs).
    implementations: list[tuple[Any, Any]]
    #: Every config and its ``kvvm_kernel`` then (``_MISSING``: none).
    kernels: list[tuple[Any, Any]]

    def restore(self) -> None:
        """The model's attention implementations, kernel choices and forward as they were
        before the switch (idempotent)."""
        if not self.wrapped:
            _wrap_forward(self.model, False)
        for cfg, name in self.implementations:
            if name is _MISSING:
                cfg.__dict__.pop("_attn_implementation_internal", None)
            else:
                cfg._attn_implementation_internal = name
        for cfg, kernel in self.kernels:
            if kernel is _MISSING:
                cfg.__dict__.pop("kvvm_kernel", None)
            else:
                cfg.kvvm_kernel = kernel


def _configs(model: Any) -> list[Any]:
    """Every config of ``model``: its own, its decoder's, its sub-models' and their
    sub-configs, each once."""
    seen: dict[int, Any] = {}
    stack = [model.config, decoder_config(model.config)]
    modules = getattr(model, "modules", None)
    if callable(modules):
        stack += [m.config for m in modules() if getattr(m, "config", None) is not None]
    while stack:
        cfg = stack.pop()
        if id(cfg) in seen:
            continue
        seen[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", None) or {}:
            sub = getattr(cfg, key, None)
            if sub is not None and hasattr(sub, "__dict__"):
                stack.append(sub)
    return list(seen.values())


def switch_attention(model: Any, kernel: str = "auto") -> AttentionSwitch:
    """:func:`use_kvvm_attention` on ``model``, remembering what it changes: the returned
    :class:`AttentionSwitch` gives the model back its own attention implementation (``sdpa``,
    ``eager``, a flash kernel, ... whatever it had) with :meth:`AttentionSwitch.restore`."""
    configs = _configs(model)
    switch = AttentionSwitch(
        model,
        "_kvvm_original_forward" in model.__dict__,
        [(c, c.__dict__.get("_attn_implementation_internal", _MISSING)) for c in configs],
        [(c, c.__dict__.get("kvvm_kernel", _MISSING)) for c in configs],
    )
    try:
        use_kvvm_attention(model, kernel=kernel)
    except BaseException:
        switch.restore()
        raise
    return switch


def _wrap_forward(model: Any, enable: bool) -> None:
    """Runs ``model.forward`` inside one kernel scope (see :func:`_kernel_scope`)."""
    original = model.__dict__.get("_kvvm_original_forward")
    if not enable:
        if original is not None:
            del model._kvvm_original_forward
            if getattr(original, "__self__", None) is model:
                # The class's own forward: drop the instance attribute.
                model.__dict__.pop("forward", None)
            else:
                model.forward = original
        return
    if original is not None:
        return
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        import torch

        if torch.compiler.is_compiling():
            # Traced code runs the kvvm kernels (or compiled SDPA): no scope to enter.
            return inner(*args, **kwargs)
        with _kernel_scope():
            return inner(*args, **kwargs)

    model._kvvm_original_forward = inner
    model.forward = forward
