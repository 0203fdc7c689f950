"""The native module's Python face: the classes ``kvvm._native`` defines in Rust (their stub is
``kvvm/_native.pyi``, checked by ``mypy.stubtest kvvm._native``), the exceptions it makes
(:mod:`kvvm.errors`), and the few helpers that read a model's KV geometry from its config.

Everything here is re-exported by :mod:`kvvm` itself; the other subpackages (the
transformers integration, the kernels, serving) import it from here. Needs neither torch nor
transformers.
"""

from __future__ import annotations

from .._native import (
    BACKEND_NAMES,
    Backend,
    HostTier,
    KvGeometry,
    LayoutPlan,
    Manager,
    MemorySnapshot,
    PREFIX_META_BYTES,
    PrefixCache,
    Sequence,
    SequenceBatch,
    SharedPrefix,
    SwappedKv,
    TensorView,
    __version__,
)
from .config import config_dtype, decoder_config, dtype_name, geometry_from_config, open_backend

__all__ = [
    "BACKEND_NAMES", "Backend", "HostTier", "KvGeometry", "LayoutPlan", "Manager", "MemorySnapshot", "PREFIX_META_BYTES",
    "PrefixCache", "Sequence", "SequenceBatch", "SharedPrefix", "SwappedKv", "TensorView", "__version__",
    "config_dtype", "decoder_config", "dtype_name", "geometry_from_config", "open_backend",
]
