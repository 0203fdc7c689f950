"""The ``prefix`` part of ``python -m kvvm_bench swap``: a hit on the prefix cache's host level
(a prefix evicted from the device, copied back into a request's own windows) against
prefilling it, by prefix length (``docs/host-tier.md``, the prefix level).

At each length ``n`` of ``--lengths``: a prompt of ``n`` tokens is admitted, marked written,
published and evicted to the host tier; then, ``--repeat`` times, a request of the same prompt
and one more token is admitted with the host hit taken (``host_s``: the lookup, the commit of
the prompt and the copies back, waited for) and with it refused (``miss_s``: the lookup and
the commit), and one forward of ``n`` tokens is timed (``prefill_s``). The host hit wins when
``host_s < miss_s + prefill_s``; ``host_hit_beats_prefill_from`` is the shortest such length.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import kvvm

__all__ = ["prefix_part"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _admit_s(cache: kvvm.PrefixCache, seq: kvvm.Sequence, ids: list[int], host: int | None, device: torch.device) -> tuple[float, int]:
    """Seconds of one admission of ``ids`` into ``seq`` (released after), and its host hit."""
    _sync(device)
    t0 = time.perf_counter()
    info = cache.admit(seq, ids, host_min_tokens=host)
    _sync(device)
    took = time.perf_counter() - t0
    seq.release()
    return took, int(info["host_hit_tokens"])


def prefix_part(
    args: argparse.Namespace, model: Any, manager: kvvm.Manager, device: torch.device, prefill_s: Any
) -> dict[str, Any]:
    """A host hit against a prefill, by length (see the module's text); ``prefill_s(model,
    tokens, device, repeat)`` times a forward."""
    lengths = [int(x) for x in args.lengths.split(",") if x]
    geometry = kvvm.geometry_from_config(model.config, max(lengths) + 1, dtype=model.dtype)
    plan = kvvm.LayoutPlan(geometry, "token-major", manager.granule)
    tier = kvvm.HostTier(manager)
    tier.prewarm(plan.committed_bytes_for_tokens(max(lengths)))
    cache = kvvm.PrefixCache(manager, plan)
    cache.attach_host_tier(tier)
    rows = []
    for i, n in enumerate(lengths):
        ids = [(i * 7919 + t) % 32000 for t in range(n)]
        seq = kvvm.Sequence(manager, plan, n + 1)
        cache.admit(seq, ids)
        seq.mark_written(n)
        cache.publish(seq)
        seq.release()
        cache.evict(1 << 62)
        host = [_admit_s(cache, seq, ids + [1], 1, device) for _ in range(args.repeat)]
        miss = [_admit_s(cache, seq, ids + [1], None, device) for _ in range(args.repeat)]
        host_s, miss_s = statistics.median(h[0] for h in host), statistics.median(m[0] for m in miss)
        forward = prefill_s(model, n, device, args.repeat)
        rows.append({
            "tokens": n, "host_hit_tokens": host[0][1], "host_s": round(host_s, 6), "miss_s": round(miss_s, 6),
            "prefill_s": round(forward, 6), "host_wins": host[0][1] > 0 and host_s < miss_s + forward,
        })
    cache.clear()
    tier.trim()
    wins = [r["tokens"] for r in rows if r["host_wins"]]
    return {
        "rows": rows,
        "host_hit_beats_prefill_from": min(wins) if wins else None,
        "cache": cache.stats(),
    }
