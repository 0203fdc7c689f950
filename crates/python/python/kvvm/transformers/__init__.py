"""The Hugging Face transformers integration: a ``Cache`` whose K/V live in kvvm memory
(:class:`KvvmCache`), the kvvm attention that reads each request's tokens from it
(:func:`use_kvvm_attention`), prompt prefixes prefilled once into shared memory
(:class:`KvvmPrefix`), a decode step captured as a CUDA graph (:class:`DecodeGraph`), and which
architectures it serves (:func:`check_servable`, :func:`refusal_reason`).

Modules: ``cache`` (``KvvmCache``, over ``cache_step`` and ``cache_memory``), ``cache_layer``
(one layer as transformers sees it), ``cache_groups`` (full and sliding-window layers, each
group in memory of its own), ``slots`` (the requests' token counts on the device),
``attention``, ``architectures``, ``prefix``, ``graph``, ``projections`` (fused Q/K/V and
gate/up projections), ``products`` (linear layers through kvvm's tuned skinny products). Pure Python over torch and transformers (5.x); its native part is the
bindings' (:mod:`kvvm.bindings`).
"""

from __future__ import annotations

from .architectures import check_servable, refusal_reason
from .attention import ATTENTION, register_attention, use_kvvm_attention
from .cache import KvvmCache, KvvmLayer, cache_argument
from .graph import DecodeGraph
from .prefix import KvvmPrefix
from .products import TunedProducts, tuned_products
from .projections import fuse_projections

__all__ = [
    "ATTENTION",
    "DecodeGraph",
    "KvvmCache",
    "KvvmLayer",
    "KvvmPrefix",
    "TunedProducts",
    "cache_argument",
    "check_servable",
    "fuse_projections",
    "refusal_reason",
    "register_attention",
    "tuned_products",
    "use_kvvm_attention",
]
