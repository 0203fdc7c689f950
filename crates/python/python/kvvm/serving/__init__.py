"""Serving: continuous batching of a transformers model over kvvm slots, in three parts with
a contract between them (``docs/engine.md``):

- :mod:`kvvm.serving.scheduler`: what each step runs (no model, no device, no torch);
- :mod:`kvvm.serving.kv_manager`: the memory (the cache's slots, the prefix cache; every call
  into kvvm);
- :mod:`kvvm.serving.runner`: the forwards, the captured decode step and sampling;

and :mod:`kvvm.serving.engine`, the :class:`Engine` that steps them (``schedule -> run ->
update``). The request and the scheduler import without torch; the engine, the KV manager and
the runner need torch and transformers (imported on first use of their names here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .request import HIT_TIMES_KEPT, EngineStats, Request
from .scheduler import Admission, KvSpace, PrefillRun, RunnerOutput, Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from .engine import Engine
    from .kv_manager import KvManager
    from .runner import ModelRunner

__all__ = [
    "HIT_TIMES_KEPT",
    "Admission",
    "Engine",
    "EngineStats",
    "KvManager",
    "KvSpace",
    "ModelRunner",
    "PrefillRun",
    "Request",
    "RunnerOutput",
    "Scheduler",
    "SchedulerOutput",
]

_LAZY = {"Engine": "engine", "KvManager": "kv_manager", "ModelRunner": "runner"}


def __getattr__(name: str) -> Any:
    """The torch-dependent parts, imported when first named."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvvm.serving' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)
