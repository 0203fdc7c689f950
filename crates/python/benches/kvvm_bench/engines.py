"""Several engine processes on one device (``python -m kvvm_bench engines``): each a
``KvvmCache`` decode loop over a batch of requests that open with one system prompt, run side
by side as separate processes, twice:

* ``broker``: one ``kvvm broker`` owns the node's budget; every process leases from it
  (``Manager(broker=...)``); the first process prefills the system prompt and publishes it
  (``KvvmPrefix.publish``), the others open it (``KvvmPrefix.open``) and map the same memory
  read-only: the prompt is held once on the node.
* ``fraction``: every process has a fixed budget of ``1/N`` of the node's and prefills the
  system prompt itself, as engines that reserve a fraction each do today.

Each process reports its decode steps' p50/p99 (ms), tokens/s, the bytes its manager holds
(committed, shared, leased) and, with a broker, the lease's hit rate and the mean and longest
top-up round trip. Across processes: the device's free memory once every process is set up
(on a GPU, from the driver), and with a broker its held and prefix bytes per tenant (its
Prometheus metrics file). ``--tiny --device cpu --backend host`` runs it on a CPU (the
tests do).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvvm_bench.node import broker_metrics, smi_free_bytes
from kvvm_bench.report_file import write_report

__all__ = ["add_args", "run_engines_bench", "worker"]

#: The prefix key every process of a run uses.
KEY = "system-prompt"


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``python -m kvvm_bench engines``."""
    p.add_argument("--processes", default="2,4", help="process counts to run, comma-separated")
    p.add_argument("--modes", default="broker,fraction", help="broker and/or fraction")
    p.add_argument("--prefix", type=int, default=4096, help="tokens of the shared system prompt")
    p.add_argument("--suffix", type=int, default=128, help="each request's own prompt tokens")
    p.add_argument("--batch", type=int, default=16, help="requests per process")
    p.add_argument("--steps", type=int, default=128, help="decode steps per process")
    p.add_argument("--budget-bytes", type=int, default=32 << 30, help="the node's KV budget")
    p.add_argument("--lease-batch-bytes", type=int, default=256 << 20)
    p.add_argument("--kvvm-bin", required=True, help="the kvvm binary (runs the broker)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default="auto", help="kvvm backend (host on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")


def worker_args(p: argparse.ArgumentParser) -> None:
    """The flags of one process (``python -m kvvm_bench engines-worker``), given by the run."""
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--mode", required=True)
    p.add_argument("--socket", default="")
    p.add_argument("--budget-bytes", type=int, default=0)
    for name in ("prefix", "suffix", "batch", "steps", "lease-batch-bytes", "seed"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="auto")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One process: its manager, the system prompt (built and published, opened, or built
    privately), a cache of ``batch`` requests from it, the suffixes prefilled; prints
    ``ready`` and waits for a line on stdin; then ``steps`` decode steps, timed."""
    import torch

    import kvvm
    from kvvm.attention import use_kvvm_attention
    from kvvm.transformers import KvvmCache
    from kvvm.prefix import KvvmPrefix
    from kvvm_bench.cli import _build_model
    from kvvm_bench.numerics import percentiles

    model = _build_model(args)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    system = torch.randint(0, vocab, (1, args.prefix), generator=g).to(args.device)
    max_len = args.prefix + args.suffix + args.steps + 16
    if args.mode == "broker":
        mgr = kvvm.Manager(args.backend, broker=args.socket, tenant="engines", lease_batch_bytes=args.lease_batch_bytes)
    else:
        mgr = kvvm.Manager(args.backend, budget_bytes=args.budget_bytes)
    use_kvvm_attention(model, enable=False)
    if args.mode == "broker" and args.index > 0:
        prefix = KvvmPrefix.open(model, KEY, manager=mgr, max_cache_len=max_len)
    else:
        prefix = KvvmPrefix.build(model, system, manager=mgr, max_cache_len=max_len)
        if args.mode == "broker":
            prefix.publish(KEY)
    cache = KvvmCache.from_prefix(prefix, args.batch, max_len)
    rest = torch.randint(0, vocab, (args.batch, args.prefix - prefix.tokens + args.suffix), generator=g)
    rest[:, : args.prefix - prefix.tokens] = system[0, prefix.tokens :].cpu()
    rest = rest.to(args.device)
    with torch.no_grad():
        pos = torch.arange(prefix.tokens, prefix.tokens + rest.shape[1], device=args.device)[None].expand(args.batch, -1)
        logits = model(input_ids=rest, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
    tok = logits.argmax(-1)
    step = _decode_step(model, cache, args.device)
    step(tok)  # compiled and captured before the clock starts
    if args.device == "cuda":
        # The prefill's activations go back to the driver, so that the driver's free memory
        # tells the KV bytes apart from what torch keeps (reported as ``torch_reserved``).
        torch.cuda.empty_cache()
    print("ready", flush=True)
    sys.stdin.readline()
    times = []
    for _ in range(args.steps - 1):
        began = time.perf_counter()
        tok = step(tok).argmax(-1)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1000)
    snap = mgr.snapshot()
    out: dict[str, Any] = {
        "index": args.index,
        "mode": args.mode,
        "prefix_tokens_mapped": prefix.tokens,
        "step_ms": percentiles(times),
        "tokens_per_s": round(args.batch * len(times) / max(sum(times) / 1000, 1e-9), 1),
        "committed": snap.committed,
        "shared": snap.shared,
        "leased": mgr.leased_bytes,
        "lease": mgr.lease_stats,
        "torch_reserved": torch.cuda.memory_reserved() if args.device == "cuda" else None,
    }
    return out


def _decode_step(model: Any, cache: Any, device: str) -> Any:
    """One decode step of every request: the captured graph on a GPU, eager on a CPU."""
    import torch

    from kvvm.attention import use_kvvm_attention

    use_kvvm_attention(model)
    if device == "cuda":
        from kvvm.graph import DecodeGraph

        return DecodeGraph(model, cache)

    def eager(tok: torch.Tensor) -> torch.Tensor:
        cache.prepare(1)
        pos = cache.state.positions(1)
        with torch.no_grad():
            out = model(input_ids=tok[:, None], position_ids=pos, past_key_values=cache, use_cache=True)
        cache.step_done()
        return out.logits[:, -1]

    return eager


def _spawn(args: argparse.Namespace, index: int, mode: str, n: int, socket: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "kvvm_bench", "engines-worker", "--index", str(index), "--mode", mode,
        "--socket", socket, "--budget-bytes", str(args.budget_bytes // n), "--prefix", str(args.prefix),
        "--suffix", str(args.suffix), "--batch", str(args.batch), "--steps", str(args.steps),
        "--lease-batch-bytes", str(args.lease_batch_bytes), "--seed", str(args.seed + index),
        "--device", args.device, "--backend", args.backend, *(["--tiny"] if args.tiny else []),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _wait_ready(p: subprocess.Popen[str]) -> None:
    assert p.stdout is not None
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise RuntimeError(f"a worker did not start: {line!r} (exit {p.wait()})")


def _run_one(args: argparse.Namespace, mode: str, n: int, tmp: Path) -> dict[str, Any]:
    """``n`` processes in ``mode``; their reports and what the node held."""
    socket, metrics = tmp / f"{mode}-{n}.sock", tmp / f"{mode}-{n}.prom"
    broker = None
    if mode == "broker":
        broker = subprocess.Popen(
            [args.kvvm_bin, "broker", "--socket", str(socket), "--budget-bytes", str(args.budget_bytes),
             "--tenant", "engines", "--metrics-file", str(metrics), "--metrics-interval-ms", "100"],
            stdout=subprocess.PIPE, text=True,
        )
        assert broker.stdout is not None and "listening on" in broker.stdout.readline()
    free_before = smi_free_bytes(args.device)
    procs: list[subprocess.Popen[str]] = []
    try:
        # The first process publishes the prompt before the others open it.
        procs.append(_spawn(args, 0, mode, n, str(socket)))
        _wait_ready(procs[0])
        procs += [_spawn(args, i, mode, n, str(socket)) for i in range(1, n)]
        for p in procs[1:]:
            _wait_ready(p)
        time.sleep(0.3)
        held: dict[str, Any] = {"device_free_before": free_before, "device_free_set_up": smi_free_bytes(args.device)}
        held.update(broker_metrics(metrics, ("kvvm_broker_held_bytes", "kvvm_broker_prefix_bytes")))
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = []
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"a worker failed (exit {p.returncode})")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if broker is not None:
            broker.terminate()
            broker.wait(timeout=30)
    p99 = [r["step_ms"].get("p99", 0.0) for r in reports]
    return {
        "mode": mode, "processes": n, "held": held, "workers": reports,
        "step_p99_ms_max": max(p99), "tokens_per_s": round(sum(r["tokens_per_s"] for r in reports), 1),
        "step_p50_ms_median": statistics.median(r["step_ms"].get("p50", 0.0) for r in reports),
    }


def run_engines_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every process count in every mode; the report."""
    results: list[dict[str, Any]] = []
    report = {"prefix": args.prefix, "batch": args.batch, "steps": args.steps, "results": results}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.processes.split(",") if x):
            for mode in (m for m in args.modes.split(",") if m):
                r = _run_one(args, mode, n, Path(tmp))
                print(f"{mode:>8} x {n}: {r['tokens_per_s']} tok/s, step p50 {r['step_p50_ms_median']} ms, "
                      f"p99 {r['step_p99_ms_max']} ms, held {r['held']}", file=sys.stderr, flush=True)
                results.append(r)
                write_report(args.json, report)
    return report
