"""What a prefix-cache hit costs, by the size of a published prefix's handles
(``python -m kvvm_bench prefix``).

A hit maps the cached prefix's physical memory read-only into the new request's own
reservation. CUDA maps a handle whole and from its offset 0, so a hit costs one mapping per
handle it attaches, and its read-only part ends on a handle boundary: handles of one window
each let it end at any window at the price of one mapping per window; handles of ``k`` windows
cost ``1/k`` of the mappings (the hit's tokens after the last whole handle are copied from the
cache instead of mapped). This benchmark publishes one
prefix per handle size and times admissions that hit it, with no model (the K/V's content
does not change the cost of a mapping).

For each handle size: the tokens per handle (the hit granularity), the tokens hit, the
mappings per hit (computed: the handles the hit covers, times the layout's fragments), the admission's time (p50 and
max over ``--hits`` admissions, each of a fresh sequence) and the time per mapping.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import kvvm

__all__ = ["run_prefix_bench"]


def _hit_times(
    manager: kvvm.Manager, plan: kvvm.LayoutPlan, ids: list[int], handle_windows: int, hits: int
) -> dict[str, Any]:
    """Publishes ``ids`` as a prefix in handles of ``handle_windows`` windows, then admits
    ``hits`` fresh sequences with the same ids, timing each admission."""
    max_tokens = plan.geometry.max_tokens
    cache = kvvm.PrefixCache(manager, plan, handle_windows=handle_windows)
    owner = kvvm.Sequence(manager, plan, max_tokens)
    try:
        cache.admit(owner, ids)
        # The K/V's content does not change what a mapping costs: declared written as is.
        owner.mark_written(len(ids))
        cache.publish(owner)
        times, hit = [], 0
        for _ in range(hits):
            seq = kvvm.Sequence(manager, plan, max_tokens)
            start = time.perf_counter()
            info = cache.admit(seq, ids)
            times.append(time.perf_counter() - start)
            hit = int(info["hit_tokens"])
            seq.release()
    finally:
        owner.release()
        cache.clear()
    per_handle = plan.mapped_tokens(1) * handle_windows
    # One mapping per handle and fragment of the layout (computed: the driver's calls are
    # not counted here).
    mappings = plan.fragments * -(-hit // per_handle)
    p50 = statistics.median(times) * 1e6
    return {
        "handle_windows": handle_windows,
        "tokens_per_handle": per_handle,
        "hit_tokens": hit,
        "mappings": mappings,
        "p50_us": round(p50, 1),
        "max_us": round(max(times) * 1e6, 1),
        "us_per_mapping": round(p50 / mappings, 2) if mappings else None,
    }


def run_prefix_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every handle size of ``--handle-windows`` against one prefix of ``--prefix`` tokens;
    returns the report."""
    manager = kvvm.Manager(args.backend)
    geometry = kvvm.KvGeometry.preset(args.model, args.prefix + 64)
    plan = kvvm.LayoutPlan(geometry, args.layout, manager.granule)
    ids = [1 + (i * 7919) % 100_000 for i in range(args.prefix)]
    rows = [_hit_times(manager, plan, ids, int(b), args.hits) for b in args.handle_windows.split(",") if b]
    manager.trim_pool(0)
    return {
        "meta": {
            "backend": manager.backend,
            "model": args.model,
            "layout": args.layout,
            "prefix_tokens": args.prefix,
            "window_tokens": plan.mapped_tokens(1),
            "granule_bytes": manager.granule,
            "hits": args.hits,
        },
        "rows": rows,
    }


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``python -m kvvm_bench prefix``."""
    p.add_argument("--backend", default="auto", help="kvvm backend (cuda on the GPU machine)")
    p.add_argument("--model", default="llama-3-8b", help="the KV geometry's preset")
    p.add_argument("--layout", default="token-major", help="KvvmCache's default")
    p.add_argument("--prefix", type=int, default=4096, help="tokens of the cached prefix")
    p.add_argument("--handle-windows", default="1,4,16,64", help="windows per handle, comma-separated")
    p.add_argument("--hits", type=int, default=20, help="admissions timed per handle size")
    p.add_argument("--json", help="write the report here")
