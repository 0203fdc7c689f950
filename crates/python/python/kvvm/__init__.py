"""kvvm: LLM KV caches in driver virtual memory.

A sequence reserves the address space of its maximum context once and commits physical
memory window by window as it grows: no preallocation, no copy, and the pointer never
changes. Sequences that share a prompt prefix map the same physical memory read-only
(billed once). Running out of memory raises :class:`~kvvm.errors.BackpressureError` with a
``retry_after``, never crashes.

The way in::

    import kvvm

    mgr = kvvm.Manager("auto", budget_bytes=8 << 30)        # CUDA, HIP, else the simulator
    geo = kvvm.KvGeometry(layers=32, kv_heads=8, head_dim=128, max_tokens=8192, dtype="bf16")
    plan = kvvm.LayoutPlan(geo, "seq-major", mgr.granule)
    batch = kvvm.SequenceBatch(mgr, plan, slots=4)           # 4 sequences, one strided range
    batch.ensure(1000)                                        # commit 1000 tokens in each
    k0 = torch.from_dlpack(batch.view(0, "key", end=1000))    # [4, 8, 1000, 128], zero-copy

Backends: ``"cuda"``, ``"hip"`` (GPU memory, DLPack device CUDA/ROCm), ``"host"`` (the OS's
own virtual memory: numpy views on a CPU), ``"sim"`` (simulated, not addressable), ``"auto"``.
See ``docs/python.md``.
"""

from __future__ import annotations

from typing import Any

from . import errors
from ._native import (
    BACKEND_NAMES,
    Backend,
    HostTier,
    KvGeometry,
    LayoutPlan,
    Manager,
    MemorySnapshot,
    PrefixCache,
    Sequence,
    SequenceBatch,
    SharedPrefix,
    SwappedKv,
    TensorView,
    __version__,
)
from .errors import (
    BackpressureError,
    DriverError,
    InvalidArgumentError,
    KvvmError,
    NeverFitsError,
    BusyError,
    NotCommittedError,
    NotShareableError,
    OutOfMemoryError,
    PrefixNotWrittenError,
    ReleasedError,
    TooManyTokensError,
    UnavailableError,
    ViewsAliveError,
    GraphsAliveError,
    WriteIntoSharedPrefixError,
)

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "HostTier",
    "KvGeometry",
    "LayoutPlan",
    "Manager",
    "MemorySnapshot",
    "PrefixCache",
    "Sequence",
    "SequenceBatch",
    "SharedPrefix",
    "SwappedKv",
    "TensorView",
    "open_backend",
    "config_dtype",
    "geometry_from_config",
    "errors",
    "BackpressureError",
    "DriverError",
    "InvalidArgumentError",
    "KvvmError",
    "NeverFitsError",
    "BusyError",
    "NotCommittedError",
    "NotShareableError",
    "OutOfMemoryError",
    "PrefixNotWrittenError",
    "ReleasedError",
    "TooManyTokensError",
    "UnavailableError",
    "ViewsAliveError",
    "GraphsAliveError",
    "WriteIntoSharedPrefixError",
    "__version__",
]

_DTYPE_NAMES = {
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.float32": "fp32",
    "torch.float8_e4m3fn": "fp8",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
}


def open_backend(name: str = "auto") -> Backend:
    """Opens the backend ``name`` (one of :data:`BACKEND_NAMES`, or ``"host"``)."""
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
