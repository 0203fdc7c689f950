"""The continuous-batching engine, by its historical path: ``from kvvm.engine import Engine,
Request`` keeps working. It lives in :mod:`kvvm.serving` (the scheduler, the KV manager, the
model runner and the engine over them; ``docs/engine.md``).

Requires torch and transformers.
"""

from __future__ import annotations

from .serving.engine import Engine
from .serving.request import HIT_TIMES_KEPT, EngineStats, Request

__all__ = ["HIT_TIMES_KEPT", "Engine", "EngineStats", "Request"]
