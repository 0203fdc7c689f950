"""The captured decode step, by its historical path: ``from kvvm.graph import DecodeGraph`` keeps
working. It lives in :mod:`kvvm.transformers.graph` (also ``kvvm.transformers.DecodeGraph``).

Requires torch with CUDA and transformers.
"""

from __future__ import annotations

from .transformers.graph import DecodeGraph

__all__ = ["DecodeGraph"]
