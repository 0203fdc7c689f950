"""Reading a model's KV geometry from a Hugging Face transformers config, without torch or
transformers: :func:`geometry_from_config`, :func:`config_dtype`, :func:`decoder_config`,
:func:`dtype_name`; and :func:`open_backend`."""

from __future__ import annotations

from typing import Any

from .._native import Backend, KvGeometry
from ..errors import InvalidArgumentError

__all__ = ["config_dtype", "decoder_config", "dtype_name", "geometry_from_config", "open_backend"]

_DTYPE_NAMES = {
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.float32": "fp32",
    "torch.float8_e4m3fn": "fp8",
    "fp8_e4m3": "fp8",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
}


def open_backend(name: str = "auto") -> Backend:
    """Opens the backend ``name`` (one of :data:`~kvvm.BACKEND_NAMES`)."""
    return Backend(name)


def dtype_name(dtype: Any) -> str:
    """The kvvm name (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp8"``) of a dtype given as a
    kvvm name, a torch dtype or a numpy/str name."""
    text = str(dtype)
    if text in ("bf16", "fp16", "fp32", "fp8", "f16", "f32"):
        return text
    try:
        return _DTYPE_NAMES[text]
    except KeyError:
        raise InvalidArgumentError(f"unsupported KV dtype {dtype!r}") from None


def config_dtype(config: Any) -> Any:
    """The dtype a transformers config names: ``config.dtype``, or the deprecated
    ``torch_dtype`` on a config that has no ``dtype`` (transformers 4); None when it names
    none (a model built straight from a config holds torch's default dtype then)."""
    if hasattr(config, "dtype"):
        return config.dtype
    return getattr(config, "torch_dtype", None)


def decoder_config(config: Any) -> Any:
    """The decoder half of a config (the text config of a multimodal one), else the config."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def geometry_from_config(config: Any, max_tokens: int, dtype: Any = None) -> KvGeometry:
    """The KV geometry of a Hugging Face transformers model config (``LlamaConfig`` and
    the like): ``num_hidden_layers``, ``num_key_value_heads`` (or ``num_attention_heads``) and
    ``head_dim`` (or ``hidden_size // num_attention_heads``). ``dtype`` defaults to the
    config's (:func:`config_dtype`), else bf16."""
    try:
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
    except AttributeError as e:
        raise InvalidArgumentError(f"not a decoder config: {e}") from None
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        head_dim = int(config.hidden_size) // heads
    if dtype is None:
        dtype = config_dtype(config) or "bf16"
    return KvGeometry(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=int(head_dim),
        max_tokens=int(max_tokens),
        dtype=dtype_name(dtype),
    )
