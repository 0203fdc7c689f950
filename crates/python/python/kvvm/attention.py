"""``kvvm_sdpa``: transformers' SDPA attention restricted to the kernels that take any KV
length as it comes, registered with transformers, and the model wrapper that selects it.

:class:`~kvvm.transformers.KvvmCache` hands attention exact-length K/V views, so no mask is
needed and SDPA runs its own GQA; what is left is the kernel choice. PyTorch dispatches such
calls to cuDNN, which plans every new KV length on the CPU (1.3 ms per layer and step on an
H200 with torch 2.11): ``kvvm_sdpa`` leaves cuDNN out, once per model forward.

Requires torch and transformers (5.x).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ATTENTION", "register_attention", "use_kvvm_attention"]

#: The transformers attention implementation :func:`register_attention` registers: SDPA with
#: its own GQA (no mask, no ``repeat_kv``), restricted to the FlashAttention, memory-efficient
#: and math kernels.
ATTENTION = "kvvm_sdpa"

_SCOPE = threading.local()
_SDPA_FORWARD: list[Callable[..., Any]] = []


@contextlib.contextmanager
def _kernel_scope() -> Iterator[None]:
    """Restricts SDPA to the kernels that take any KV length as it comes (FlashAttention,
    memory-efficient, math), once per scope: nested scopes (a layer inside a model's forward)
    cost nothing more.

    cuDNN's SDPA builds a new execution plan for every new KV length, on the CPU: 1.3 ms per
    layer and step on an H200 with torch 2.11, which makes a decode step host-bound; an
    exact-length cache changes the length at every step."""
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


def _kvvm_sdpa_forward(*args: Any, **kwargs: Any) -> Any:
    if not _SDPA_FORWARD:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _SDPA_FORWARD.append(sdpa_attention_forward)
    forward = _SDPA_FORWARD[0]
    if getattr(_SCOPE, "active", False):
        # Inside a model forward wrapped by use_kvvm_attention: the kernels are set already.
        return forward(*args, **kwargs)
    with _kernel_scope():
        return forward(*args, **kwargs)


def register_attention() -> str:
    """Registers :data:`ATTENTION` with transformers (attention and mask interfaces; idempotent)
    and returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _kvvm_sdpa_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


def use_kvvm_attention(model: Any, enable: bool = True) -> None:
    """Makes ``model`` attend with :data:`ATTENTION` (or, with ``enable=False``, with plain
    ``"sdpa"`` again). Recommended with :class:`KvvmCache` on GPUs: the cache hands attention
    exact-length K/V views, so no mask is needed and SDPA runs its own GQA; this picks the
    kernels that need no per-length planning on the CPU.

    The kernel choice is made once per call of ``model.forward`` (which is wrapped; the wrapper
    is removed with ``enable=False``), not once per layer: a decode step is host-bound."""
    name = register_attention() if enable else "sdpa"
    _wrap_forward(model, enable)
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        try:
            setter(name)
            return
        except (ValueError, KeyError, TypeError):
            pass
    for cfg in {id(c): c for c in (model.config, decoder_config(model.config))}.values():
        cfg._attn_implementation = name


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
        with _kernel_scope():
            return inner(*args, **kwargs)

    model._kvvm_original_forward = inner
    model.forward = forward


def decoder_config(config: Any) -> Any:
    """The decoder half of a config (the text config of a multimodal one), else the config."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config
