"""kvvm: LLM KV caches in driver virtual memory.

A sequence reserves the address space of its maximum context once and commits physical
memory window by window as it grows: no preallocation, no copy, and the pointer never
changes. Sequences that share a prompt prefix map the same physical memory read-only
(billed once). Running out of memory raises :class:`~kvvm.errors.BackpressureError` with a
``retry_after``, never crashes.

The way in (on a CPU, the ``"host"`` backend: the OS's own virtual memory)::

    import kvvm
    import numpy as np

    mgr = kvvm.Manager("host", budget_bytes=1 << 30)
    geo = kvvm.KvGeometry(layers=2, kv_heads=2, head_dim=64, max_tokens=4096, dtype="fp16")
    plan = kvvm.LayoutPlan(geo, "seq-major", mgr.granule)
    batch = kvvm.SequenceBatch(mgr, plan, slots=4)            # 4 sequences, one strided range
    batch.ensure(1000)                                        # commit 1000 tokens in each
    k0 = np.from_dlpack(batch.view(0, "key", end=1000))       # [4, 2, 1000, 64], zero-copy

Backends: ``"cuda"``, ``"hip"`` (GPU memory, DLPack device CUDA/ROCm), ``"host"`` (the OS's
own virtual memory: numpy or torch CPU views), ``"sim"`` (simulated, not addressable),
``"auto"``.

The package, by concept:

- :mod:`kvvm` (:mod:`kvvm.bindings`): the native classes above and the exceptions
  (:mod:`kvvm.errors`), both made in Rust;
- :mod:`kvvm.transformers`: a Hugging Face transformers cache (:class:`KvvmCache`), the kvvm
  attention, shared prefixes (:class:`KvvmPrefix`) and a captured decode step
  (:class:`DecodeGraph`);
- :mod:`kvvm.kernels`: attention over each request's token range (SDPA, FlashAttention,
  Triton);
- :mod:`kvvm.serving`: a continuous-batching engine (scheduler, KV manager, model runner).

See ``docs/python.md``.
"""

from __future__ import annotations

from . import bindings, errors
from .bindings import *  # noqa: F403 (the native classes and the config helpers)
from .errors import *  # noqa: F403 (the exception hierarchy)

#: What ``from kvvm import *`` gives: the bindings and the exceptions.
__all__ = ["bindings", "errors"]
__all__ += bindings.__all__
__all__ += errors.__all__
