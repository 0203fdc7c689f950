"""``python -m kvvm_bench swap``: what the host tier costs and buys (``docs/host-tier.md``).

Five parts, each in the same process and run (``--parts``):

* ``copy``: a sequence of the model's KV geometry (Llama-3.1-8B by default, token-major, its
  windows scattered among other sequences' so that they are not one run) swapped to the host
  and back, ``--repeat`` times: the copies' bandwidth each way (bytes over the time from
  queuing them to their event, the release and the commit apart) and the whole step's (the
  release and the commit included), against a plain pinned copy of the same bytes in the same
  run (``torch``'s ``copy_(non_blocking=True)`` between one device tensor and one pinned host
  tensor: ``cudaMemcpyAsync``; a host-to-host copy on a CPU);
* ``decode``: the engine's decode step (``--slots`` requests of ``--prompt`` tokens) p50 and
  p99 without swapping, then while another thread swaps a sequence of ``--swap-tokens``
  tokens out and back without pause (on the tier's copy stream; the mean time of each of a
  round trip's four calls beside), then while a thread copies the same bytes out and back
  with plain pinned copies on a side stream (what the copies alone do to the step); at each
  of ``--copy-caps`` (the tier's ``max_copy_bytes``, and the plain copies cut alike); on a
  GPU the same three for the captured step replayed back to back between CUDA events (the
  device's time alone, without the host's step);
* ``crossover``: at each length of ``--lengths``, the time to swap a request back (commit and
  copies) and out, against the time to prefill it again (one forward of that many tokens):
  the shortest length above which swapping back beats recomputing;
* ``prefix``: at each length of ``--lengths``, a hit on the prefix cache's host level (an
  evicted prefix copied back) against a miss and a prefill of it (``prefix_host.py``): the
  shortest length above which the host hit wins;
* ``trace``: the serving benchmark's synthetic trace (``--requests``, prompts uniform in
  ``--prompt-lo..--prompt-hi``, ``--output`` tokens each) through the engine under a budget
  (``--budget-bytes``) that forces preemptions, once recomputing them and once swapping them
  (``--host-tier-bytes``, decided by measured costs), ``--trace-repeat`` times each in turn:
  tokens/s, TTFT p50/p99, preemptions, swaps and their host time, the engine's steps; on a
  GPU also transformers' ``generate_batch`` with ``cpu_offload_space`` set to the host
  tier's bytes and its cache to the budget's share of the free memory (``--no-peer``: not;
  ``swap_trace.py``).

On a CPU (``--device cpu --backend host --tiny``) every part runs small (what CI does); the
figures that matter come from a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import kvvm
from kvvm_bench.model import build_model
from kvvm_bench.numerics import percentiles
from kvvm_bench.prefix_host import prefix_part
from kvvm_bench.report_file import write_report
from kvvm_bench.swap_trace import trace_part

__all__ = ["add_args", "run_swap_bench"]

PARTS = ("copy", "decode", "crossover", "prefix", "trace")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plan(manager: kvvm.Manager, geometry: kvvm.KvGeometry) -> kvvm.LayoutPlan:
    return kvvm.LayoutPlan(geometry, "token-major", manager.granule)


def _wait(swap: kvvm.SwappedKv) -> None:
    """Spins until the swap's copies are done (their event)."""
    while not swap.is_done():
        pass


def _swap_times(seq: kvvm.Sequence, tier: kvvm.HostTier, tokens: int) -> dict[str, float]:
    """One round trip of ``seq``'s first ``tokens`` tokens: seconds of each phase (the copies
    out: from queuing them to their event; back: the way back less a commit of the same
    tokens, timed after it)."""
    t0 = time.perf_counter()
    swap = seq.swap_out(tier, tokens)
    _wait(swap)
    t1 = time.perf_counter()
    seq.finish_swap_out(swap)
    t2 = time.perf_counter()
    seq.swap_in(swap)
    t3 = time.perf_counter()
    _wait(swap)
    t4 = time.perf_counter()
    seq.finish_swap_in(swap)
    t5 = time.perf_counter()
    # The commit alone, to take out of the way back (its copies may start while it queues
    # them, and a backend whose copies are synchronous makes them while it does).
    seq.release()
    t6 = time.perf_counter()
    seq.ensure(tokens)
    commit = time.perf_counter() - t6
    return {
        "out_copy_s": t1 - t0, "out_s": t2 - t0, "in_commit_s": commit,
        "in_copy_s": max(t4 - t2 - commit, 1e-9), "in_s": t5 - t2,
    }


def _pinned_pair(nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``nbytes`` of page-locked host memory (plain host memory on a CPU) and as many on
    ``device``: the two ends of a plain copy."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    return host, torch.empty(nbytes, dtype=torch.uint8, device=device)


def _plain_copy(nbytes: int, device: torch.device, repeat: int) -> dict[str, float]:
    """Bytes/s of a plain pinned copy of ``nbytes`` each way (median of ``repeat``)."""
    pinned = device.type == "cuda"
    host, dev = _pinned_pair(nbytes, device)
    out, back = [], []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=pinned)
        _sync(device)
        t1 = time.perf_counter()
        dev.copy_(host, non_blocking=pinned)
        _sync(device)
        t2 = time.perf_counter()
        out.append(t1 - t0)
        back.append(t2 - t1)
    return {"out_Bps": nbytes / statistics.median(out), "in_Bps": nbytes / statistics.median(back)}


def copy_part(args: argparse.Namespace, manager: kvvm.Manager, device: torch.device) -> dict[str, Any]:
    """The copies' bandwidth each way against a plain pinned copy (see the module's text)."""
    geometry = kvvm.KvGeometry.preset(args.model, args.copy_tokens)
    plan = _plan(manager, geometry)
    nbytes = plan.committed_bytes_for_tokens(args.copy_tokens)
    # One page-locked allocation for the whole sequence: its adjacent windows, one copy.
    tier = kvvm.HostTier(manager, slab_windows=max(1, nbytes // manager.granule))
    tier.prewarm(nbytes)
    # Interleaved with another sequence's windows: not one contiguous run.
    seq, other = kvvm.Sequence(manager, plan), kvvm.Sequence(manager, plan)
    step = plan.mapped_tokens(1)
    for n in range(step, args.copy_tokens + step, step):
        seq.ensure(min(n, args.copy_tokens))
        other.ensure(min(n, args.copy_tokens))
    rows = [_swap_times(seq, tier, args.copy_tokens) for _ in range(args.repeat)]
    nbytes = seq.committed_bytes
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    plain = _plain_copy(nbytes, device, args.repeat)
    out_bw, in_bw = nbytes / med["out_copy_s"], nbytes / med["in_copy_s"]
    seq.release()
    other.release()
    return {
        "bytes": nbytes,
        "tokens": args.copy_tokens,
        "median_s": {k: round(v, 6) for k, v in med.items()},
        "kvvm_out_Bps": round(out_bw), "kvvm_in_Bps": round(in_bw),
        "kvvm_out_with_release_Bps": round(nbytes / med["out_s"]),
        "kvvm_in_with_commit_Bps": round(nbytes / med["in_s"]),
        "plain_out_Bps": round(plain["out_Bps"]), "plain_in_Bps": round(plain["in_Bps"]),
        "ratio_out": round(out_bw / plain["out_Bps"], 3), "ratio_in": round(in_bw / plain["in_Bps"], 3),
        "tier": tier.stats(),
    }


def _decode_steps(engine: Any, steps: int) -> list[float]:
    """Seconds of ``steps`` decode-only engine steps."""
    times = []
    for _ in range(steps):
        if engine.idle:
            break
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def decode_part(args: argparse.Namespace, model: Any, manager: kvvm.Manager, device: torch.device) -> dict[str, Any]:
    """Decode step p50/p99 without, while swapping and while copying, at each copy size of
    ``--copy-caps`` (see the module's text)."""
    from kvvm.engine import Engine

    caps = [int(c) or None for c in args.copy_caps.split(",") if c]
    rounds = 1 + 2 * len(caps)
    max_len = args.prompt + (rounds + 1) * args.decode_steps + 16
    engine = Engine(model, slots=args.slots, max_len=max_len, manager=manager, prefill_chunk=args.prompt, eos_token_ids=[])
    vocab = model.config.vocab_size
    for i in range(args.slots):
        engine.submit([(7 + 13 * (i * args.prompt + t)) % vocab for t in range(args.prompt)], (rounds + 1) * args.decode_steps + 8)
    while any(not r.prefilled for r in engine.running.values()) or engine.waiting:
        engine.step()
    _decode_steps(engine, 4)
    quiet = percentiles([x * 1000 for x in _decode_steps(engine, args.decode_steps)])
    replay_quiet = _replay_ms(engine, args.decode_steps)
    plan = _plan(manager, kvvm.geometry_from_config(model.config, args.swap_tokens, dtype=model.dtype))
    seq = kvvm.Sequence(manager, plan, args.swap_tokens)
    seq.ensure(args.swap_tokens)
    # The copies out wait for this idle stream only (nobody writes the swapped sequence): no
    # device synchronization under the decode.
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    rows = []
    ends = _pinned_pair(seq.committed_bytes, device)
    for cap in caps:
        tier = kvvm.HostTier(manager, max_copy_bytes=cap)
        tier.prewarm(seq.committed_bytes)
        row = _swapping_steps(engine, args, seq, tier, side, quiet)
        copying, copies = _steps_beside(
            engine, args.decode_steps, _plain_round_trip(*ends, side, cap),
        )
        c = percentiles([x * 1000 for x in copying])
        row.update(
            step_ms_while_copying=c, plain_round_trips_during=copies,
            p50_ratio_copying=round(c["p50"] / quiet["p50"], 3) if quiet.get("p50") else None,
        )
        if replay_quiet is not None:
            # The device's share: the captured step replayed back to back, no host in the loop.
            swapping = _beside(lambda: _replay_ms(engine, args.decode_steps), _swap_round_trip(seq, tier, args, side))
            copying_ms = _beside(lambda: _replay_ms(engine, args.decode_steps), _plain_round_trip(*ends, side, cap))
            row.update(
                replay_ms_while_swapping=swapping, replay_ms_while_copying=copying_ms,
                replay_ratio=round(swapping / replay_quiet, 3), replay_ratio_copying=round(copying_ms / replay_quiet, 3),
            )
        rows.append({"max_copy_bytes": cap, **row})
        tier.trim(0)
    seq.release()
    engine.close()
    return {
        "slots": args.slots, "prompt": args.prompt, "swap_tokens": args.swap_tokens,
        "step_ms_without": quiet, "replay_ms_without": replay_quiet, "caps": rows,
        # The first cap's figures, as the acceptance reads them.
        **{k: v for k, v in rows[0].items() if k != "max_copy_bytes"},
    }


#: The four calls of a round trip to the host and back.
_CALLS = ("swap_out", "finish_swap_out", "swap_in", "finish_swap_in")


def _swap_round_trip(
    seq: kvvm.Sequence, tier: kvvm.HostTier, args: argparse.Namespace, side: Any,
    spent: dict[str, float] | None = None, copies: list[int] | None = None,
) -> Callable[[], None]:
    """A function swapping ``seq`` out to ``tier`` (after ``side``) and back; each call's
    seconds added to ``spent`` and the copies each way put in ``copies[0]`` when given."""

    def round_trip() -> None:
        t0 = time.perf_counter()
        swap = seq.swap_out(tier, args.swap_tokens, after=side)
        t1 = time.perf_counter()
        seq.finish_swap_out(swap)
        t2 = time.perf_counter()
        seq.swap_in(swap)
        t3 = time.perf_counter()
        seq.finish_swap_in(swap)
        if copies is not None:
            copies[0] = swap.copies
        if spent is not None:
            for name, took in zip(_CALLS, (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3), strict=True):
                spent[name] += took

    return round_trip


def _swapping_steps(
    engine: Any, args: argparse.Namespace, seq: kvvm.Sequence, tier: kvvm.HostTier, side: Any, quiet: dict[str, float],
) -> dict[str, Any]:
    """Decode steps while a thread swaps ``seq`` out to ``tier`` and back without pause: their
    p50/p99, the round trips and the mean time of each of a round trip's calls."""
    spent = dict.fromkeys(_CALLS, 0.0)
    copies = [0]
    busy, swaps = _steps_beside(engine, args.decode_steps, _swap_round_trip(seq, tier, args, side, spent, copies))
    b = percentiles([x * 1000 for x in busy])
    return {
        "step_ms_while_swapping": b, "round_trips_during": swaps, "copies_each_way": copies[0],
        "p50_ratio": round(b["p50"] / quiet["p50"], 3) if quiet.get("p50") else None,
        "round_trip_call_ms": {k: round(v * 1000 / max(swaps, 1), 3) for k, v in spent.items()},
    }


def _steps_beside(engine: Any, steps: int, work: Callable[[], None]) -> tuple[list[float], int]:
    """``steps`` decode steps while another thread repeats ``work()`` without pause; the
    steps' seconds and the rounds of ``work`` done meanwhile."""
    rounds = [0]

    def counted() -> None:
        work()
        rounds[0] += 1

    return _beside(lambda: _decode_steps(engine, steps), counted), rounds[0]


def _beside(measure: Callable[[], Any], work: Callable[[], None]) -> Any:
    """``measure()``'s result, taken while another thread repeats ``work()`` without pause."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            work()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        return measure()
    finally:
        stop.set()
        t.join()


def _replay_ms(engine: Any, replays: int) -> float | None:
    """Milliseconds of one replay of the engine's captured decode step, ``replays`` of them
    back to back between two CUDA events (the device's time alone: no host step in the loop;
    each replays the step last prepared, writing the same token); None without a graph."""
    graph = getattr(engine.runner, "_graph", None)
    if graph is None or graph.graph is None:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.graph.replay()
    start.record()
    for _ in range(replays):
        graph.graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / replays, 4)


def _plain_round_trip(host: torch.Tensor, dev: torch.Tensor, stream: Any, most: int | None = None) -> Any:
    """A function copying ``dev`` to ``host`` (:func:`_pinned_pair`) and back on ``stream``
    (waiting for each), as plain ``cudaMemcpyAsync`` calls of at most ``most`` bytes each
    (None: one call each way)."""
    nbytes = host.numel()
    step = most or nbytes
    pieces = [(i, min(i + step, nbytes)) for i in range(0, nbytes, step)]

    def round_trip() -> None:
        if stream is None:
            host.copy_(dev)
            dev.copy_(host)
            return
        with torch.cuda.stream(stream):
            for a, b in pieces:
                host[a:b].copy_(dev[a:b], non_blocking=True)
            stream.synchronize()
            for a, b in pieces:
                dev[a:b].copy_(host[a:b], non_blocking=True)
        stream.synchronize()

    return round_trip


def _prefill_s(model: Any, tokens: int, device: torch.device, repeat: int) -> float:
    """Median seconds of one forward of ``tokens`` tokens (a prefill, DynamicCache)."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    times = []
    with torch.no_grad():
        for _ in range(repeat):
            _sync(device)
            t0 = time.perf_counter()
            model(ids, use_cache=True)
            _sync(device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def crossover_part(args: argparse.Namespace, model: Any, manager: kvvm.Manager, device: torch.device) -> dict[str, Any]:
    """Swap back (and out) against a prefill, by length (see the module's text)."""
    lengths = [int(x) for x in args.lengths.split(",") if x]
    geometry = kvvm.geometry_from_config(model.config, max(lengths), dtype=model.dtype)
    plan = _plan(manager, geometry)
    tier = kvvm.HostTier(manager)
    tier.prewarm(plan.committed_bytes_for_tokens(max(lengths)))
    rows = []
    for n in lengths:
        seq = kvvm.Sequence(manager, plan, n)
        seq.ensure(n)
        times = [_swap_times(seq, tier, n) for _ in range(args.repeat)]
        seq.release()
        back = statistics.median(t["in_s"] for t in times)
        out = statistics.median(t["out_s"] for t in times)
        prefill = _prefill_s(model, n, device, args.repeat)
        rows.append({
            "tokens": n, "swap_in_s": round(back, 6), "swap_out_s": round(out, 6), "prefill_s": round(prefill, 6),
            "swap_in_wins": back < prefill, "round_trip_wins": back + out < prefill,
        })
    wins = [r["tokens"] for r in rows if r["swap_in_wins"]]
    trip = [r["tokens"] for r in rows if r["round_trip_wins"]]
    return {
        "rows": rows,
        "swap_in_beats_prefill_from": min(wins) if wins else None,
        "round_trip_beats_prefill_from": min(trip) if trip else None,
    }


def run_swap_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The parts of ``--parts``; the report is written after each."""
    device = torch.device(args.device)
    parts = [p for p in args.parts.split(",") if p]
    report: dict[str, Any] = {"meta": {
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "device": args.device, "backend": args.backend,
        "torch": torch.__version__, "kvvm": kvvm.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "driver": _driver(),
    }}
    model = build_model(args) if {"decode", "crossover", "prefix", "trace"} & set(parts) else None
    for part in parts:
        if part == "copy":
            report["copy"] = copy_part(args, kvvm.Manager(args.backend), device)
        elif part == "decode":
            report["decode"] = decode_part(args, model, kvvm.Manager(args.backend, precommit=True), device)
        elif part == "crossover":
            report["crossover"] = crossover_part(args, model, kvvm.Manager(args.backend), device)
        elif part == "prefix":
            report["prefix"] = prefix_part(args, model, kvvm.Manager(args.backend), device, _prefill_s)
        elif part == "trace":

            def progress(so_far: dict[str, Any]) -> None:
                report["trace"] = so_far
                write_report(args.json, report)
                print("trace run:", so_far["runs"][-1], flush=True)

            report["trace"] = trace_part(args, model, device, progress)
        else:
            raise SystemExit(f"unknown part {part!r}: one of {PARTS}")
        write_report(args.json, report)
    return report


def _driver() -> str | None:
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``python -m kvvm_bench swap``."""
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default="auto", help="kvvm backend (host on a CPU)")
    p.add_argument("--tiny", action="store_true", help="a small model instead of the Llama-3.1-8B shape")
    p.add_argument("--model", default="llama-3-8b", help="the copy part's KV geometry preset")
    p.add_argument("--copy-tokens", type=int, default=16384, help="tokens of the copy part's sequence")
    p.add_argument("--repeat", type=int, default=5, help="round trips (and prefills) per measurement")
    p.add_argument("--slots", type=int, default=16, help="requests decoding in the decode part")
    p.add_argument("--prompt", type=int, default=1024, help="their prompts' tokens")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps timed, without and while swapping")
    p.add_argument("--swap-tokens", type=int, default=8192, help="tokens of the sequence swapped meanwhile")
    p.add_argument(
        "--copy-caps", default="67108864,0",
        help="the decode part's most bytes a copy moves, comma-separated (0: whole runs), each measured in turn "
        "(the first is the one reported as p50_ratio; default: the tier's default, then whole runs)",
    )
    p.add_argument("--lengths", default="128,256,512,1024,2048,4096,8192,16384", help="the crossover's and the prefix part's lengths")
    p.add_argument("--requests", type=int, default=64)
    # The trace's defaults preempt about 30 % of its requests under recompute (the share
    # grows with the new tokens against the prompt, hardly with the budget).
    p.add_argument("--prompt-lo", type=int, default=256)
    p.add_argument("--prompt-hi", type=int, default=2048)
    p.add_argument("--output", type=int, default=512)
    p.add_argument("--trace-slots", type=int, default=32)
    p.add_argument("--budget-bytes", type=int, default=2 << 30, help="the trace's device budget (forces preemptions)")
    p.add_argument("--host-tier-bytes", type=int, default=32 << 30, help="the trace's host tier")
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument(
        "--trace-repeat", type=int, default=1,
        help="runs of the trace per runner, recompute and swap in turn (each runner's median run is reported; "
        "0: none, the peer alone)",
    )
    p.add_argument(
        "--no-peer", dest="peer", action="store_false",
        help="leave out transformers' generate_batch with cpu_offload_space on the trace (CUDA only)",
    )
    p.add_argument("--bandwidth", type=float, default=4.8e12)
    p.add_argument("--flops", type=float, default=7.9e14)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
