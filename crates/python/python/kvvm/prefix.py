"""Shared prompt prefixes, by their historical path: ``from kvvm.prefix import KvvmPrefix`` keeps
working. They live in :mod:`kvvm.transformers.prefix` (also ``kvvm.transformers.KvvmPrefix``).

Requires torch and transformers.
"""

from __future__ import annotations

from .transformers.prefix import KvvmPrefix, group_key

__all__ = ["KvvmPrefix", "group_key"]
