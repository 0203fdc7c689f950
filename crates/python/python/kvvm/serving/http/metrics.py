"""``GET /metrics``: the server's and its engine's figures in the Prometheus text format
(``docs/server.md``, metrics)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..metrics import render_counter, render_gauge

__all__ = ["render_metrics"]


def render_metrics(engine: Any, responses: Counter[tuple[str, int]]) -> str:
    """HTTP responses by route and status, the engine's requests, tokens and latency
    histograms, its queue and running requests, the KV bytes its manager holds and commits,
    prefix-cache hits and preemptions."""
    stats = engine.stats
    snap = engine.manager.snapshot()
    budget = engine.manager.budget_bytes
    parts = [
        render_counter("kvvm_http_responses_total", "HTTP responses, by route and status.",
                       [({"route": route, "status": str(status)}, n) for (route, status), n in sorted(responses.items())]
                       or [({"route": "/health", "status": "200"}, 0)]),
        engine.metrics.render(),
        render_gauge("kvvm_engine_queue_depth", "Requests waiting for a slot.", engine.queue_depth),
        render_gauge("kvvm_engine_running_requests", "Requests holding a slot (prefilling or decoding).",
                     len(engine.running)),
        render_gauge("kvvm_engine_slots", "Requests the engine runs at once at most.", engine.kv.slots),
        render_gauge("kvvm_kv_committed_bytes", "KV bytes committed to the engine's requests (their own windows).",
                     snap.committed),
        render_gauge("kvvm_kv_shared_bytes", "KV bytes of shared prefixes (the prefix cache), each counted once.",
                     snap.shared),
        render_gauge("kvvm_kv_held_bytes", "KV bytes held: committed plus shared.", snap.committed + snap.shared),
        render_gauge("kvvm_kv_pooled_bytes", "Released KV bytes kept for reuse.", snap.pooled),
        render_gauge("kvvm_kv_budget_bytes", "The memory budget (0: none).", budget or 0),
        render_counter("kvvm_engine_prefix_hits_total", "Admissions that hit a cached prefix, by level (device: "
                       "mapped; host: copied back from the host level).",
                       [({"level": "device"}, stats.prefix_hits - stats.prefix_host_hits),
                        ({"level": "host"}, stats.prefix_host_hits)]),
        render_counter("kvvm_engine_prefix_hit_tokens_total", "Prompt tokens taken from the prefix cache, by level.",
                       [({"level": "device"}, stats.prefix_hit_tokens - stats.prefix_host_hit_tokens),
                        ({"level": "host"}, stats.prefix_host_hit_tokens)]),
        render_counter("kvvm_engine_preemptions_total", "Requests preempted for memory (recomputed later).",
                       [({}, stats.preempted)]),
        render_counter("kvvm_engine_admission_refusals_total", "Admissions put off for memory.",
                       [({}, stats.admission_refusals)]),
        render_counter("kvvm_engine_cancelled_total", "Requests cancelled (client gone, or cancel()).",
                       [({}, stats.cancelled)]),
        render_counter("kvvm_engine_steps_total", "Engine steps.", [({}, stats.steps)]),
    ]
    return "".join(parts)
