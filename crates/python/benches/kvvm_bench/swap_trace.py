"""The ``trace`` part of ``python -m kvvm_bench swap``: the serving benchmark's synthetic trace
through the engine under a device budget that forces preemptions, recomputing them and
swapping them to a host tier in turn, ``--trace-repeat`` times each (``docs/host-tier.md``);
on a GPU also transformers' ``generate_batch`` with ``cpu_offload_space`` on the same trace.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

import kvvm

__all__ = ["trace_part"]


def trace_part(
    args: argparse.Namespace, model: Any, device: torch.device, progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The trace recomputing its preemptions, then swapping them, ``--trace-repeat`` times in
    turn (see the module's text): each run's figures under ``runs``, and each runner's median
    run (by tokens/s) as ``recompute`` and ``swap`` (none with ``--trace-repeat 0``: the peer
    alone); ``progress`` is given the part's results so far after each run."""
    from kvvm_bench import serve as sv

    vocab = model.config.vocab_size
    trace = sv.synthetic_trace(
        args.requests, vocab, prompt_lo=args.prompt_lo, prompt_hi=args.prompt_hi, output=args.output,
        shared_prefix=0, shared_share=0.0, rate=0.0, seed=args.seed,
    )
    out: dict[str, Any] = {"requests": len(trace), "budget_bytes": args.budget_bytes, "runs": []}
    for _ in range(args.trace_repeat):
        for name, host in (("recompute", 0), ("swap", args.host_tier_bytes)):
            out["runs"].append({"runner": name, **_trace_run(args, model, trace, host)})
            _median_runs(out)
            if progress is not None:
                progress(out)
    if out["runs"]:
        rec, swp = out["recompute"], out["swap"]
        out["swap_faster"] = swp["tokens_per_s"] > rec["tokens_per_s"]
        out["swap_lower_ttft_p99"] = swp["ttft_ms"].get("p99", 0) < rec["ttft_ms"].get("p99", 0)
    if args.peer and device.type == "cuda":
        out["generate_batch_offload"] = _peer(model, trace, args, device)
    return out


def _trace_run(args: argparse.Namespace, model: Any, trace: list[Any], host: int) -> dict[str, Any]:
    """One run of ``trace`` through the engine under the trace's budget, swapping to a host
    tier of ``host`` bytes (0: recomputing)."""
    from kvvm_bench import serve as sv

    manager = kvvm.Manager(
        args.backend, budget_bytes=args.budget_bytes or None, precommit=True, headroom_tokens=4,
        host_budget_bytes=host or None,
    )
    res = sv.run_engine(
        model, trace, manager=manager, slots=args.trace_slots, max_len=args.prompt_hi + args.output + 8,
        prefix_cache_bytes=0, prefill_chunk=args.prefill_chunk, real_time=False, bandwidth=args.bandwidth,
        flops=args.flops, engine_kwargs={"host_tier_bytes": host} if host else None,
    )
    return {
        "tokens_per_s": res.tokens_per_s, "ttft_ms": res.ttft_ms, "itl_ms": res.itl_ms,
        "preemptions": res.preemptions, "preempted_requests": res.preempted_requests,
        "preempted_share": round((res.preempted_requests or 0) / len(trace), 3),
        "swaps": res.swaps, "steps": res.engine_steps, "wall_s": round(res.wall_s, 3),
    }


def _median_runs(out: dict[str, Any]) -> None:
    """Sets ``out[runner]`` to each runner's median run by tokens/s (the lower middle one of
    an even count), with every run's tokens/s beside it."""
    for name in ("recompute", "swap"):
        runs = sorted((r for r in out["runs"] if r["runner"] == name), key=lambda r: r["tokens_per_s"])
        if runs:
            mid = {k: v for k, v in runs[(len(runs) - 1) // 2].items() if k != "runner"}
            out[name] = {**mid, "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


def _peer(model: Any, trace: list[Any], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """transformers' continuous batching on the same trace with its cache's memory set to the
    budget's share of the free memory and ``cpu_offload_space`` set to the host tier's bytes
    (where it runs: a runner that fails is recorded with its error)."""
    from kvvm_bench import serve as sv

    free, _ = torch.cuda.mem_get_info(device)
    fraction = min(0.9, args.budget_bytes / free) if args.budget_bytes else None
    res = sv.run_generate_batch(model, trace, memory_fraction=fraction, cpu_offload_gib=args.host_tier_bytes / 2**30)
    return {
        "runner": res.runner, "tokens_per_s": res.tokens_per_s, "ttft_ms": res.ttft_ms, "itl_ms": res.itl_ms,
        "wall_s": round(res.wall_s, 3), "note": res.note,
    }
