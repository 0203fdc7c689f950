"""Benchmarks of kvvm's decode path on a Llama-architecture model.

``python -m kvvm_bench generate`` builds a model from a config with random weights (no
download; the Llama-3.1-8B shape in bf16 by default) and decodes, side by side in one process,
with transformers' compiled ``StaticCache``, eager ``DynamicCache``, ``KvvmCache`` eager,
``KvvmCache`` compiled by ``generate`` and ``KvvmCache`` captured once as a graph
(:mod:`kvvm_bench.runs`), at uniform batch x prompt points and at a ragged batch (prompt
lengths uniform in a range, seeded). For every cache: decode step p50 and p99, tokens/s, the
HBM floor of a step (weight bytes + live KV bytes, over the memory bandwidth) and the step's
ratio to it, peak GPU memory (PyTorch's reserved peak + kvvm's committed bytes), KV bytes held
against the live ones, greedy agreement with DynamicCache; and for the captured kvvm step,
teacher-forced logits against DynamicCache (max |diff|, argmax agreement where the top two
logits are apart).

``python -m kvvm_bench kernels`` measures the attention kernels alone
(:mod:`kvvm_bench.kernels`); ``python -m kvvm_bench serve`` replays a serving trace through the
continuous-batching engine and its peers (:mod:`kvvm_bench.serve`); ``python -m kvvm_bench
prefix`` times prefix-cache hits by handle size, on any backend (:mod:`kvvm_bench.prefix`);
``python -m kvvm_bench engines`` runs engine processes on one device under a broker and under
fixed fractions (:mod:`kvvm_bench.engines`); ``python -m kvvm_bench sliding`` decodes a
Gemma-3-shaped model to 32k tokens with KvvmCache and DynamicCache (:mod:`kvvm_bench.sliding`);
``python -m kvvm_bench shapes`` runs the decode kernel and the captured step on every head dim,
GQA ratio and dtype (:mod:`kvvm_bench.shapes`); ``python -m kvvm_bench http`` replays a trace
through the engine directly and through its OpenAI-compatible server (:mod:`kvvm_bench.http_serve`);
``python -m kvvm_bench sampling`` times the engine's step with sampling on against greedy
(:mod:`kvvm_bench.sampling_step`); ``python -m kvvm_bench fp8`` times the captured step with
FP8 KV against bf16 KV, each over its own floor, with their logits compared
(:mod:`kvvm_bench.fp8`); ``python -m kvvm_bench swap`` measures the host
tier: copy bandwidth against a plain pinned copy, decode while swapping, the swap-vs-recompute
crossover and a memory-pressure trace (:mod:`kvvm_bench.swap`).

``--tiny`` runs a small model (what the tests do); the figures that matter come from a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import os
import statistics
import sys
import tempfile
from dataclasses import asdict
from typing import Any

import torch

import kvvm
from kvvm_bench import runs
from kvvm_bench.model import build_model, product_choices, unread_weight_bytes, weight_bytes
from kvvm_bench.report_file import write_report

__all__ = ["main"]


def _points(text: str) -> list[tuple[int, int]]:
    out = []
    for part in filter(None, text.split(",")):
        b, s = part.lower().split("x")
        out.append((int(b), int(s)))
    return out


def _workloads(args: argparse.Namespace, vocab: int) -> list[runs.Workload]:
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    out = []
    for b, p in _points(args.points):
        prompts = [torch.randint(0, vocab, (1, p), generator=gen).cuda() for _ in range(b)]
        out.append(runs.Workload(f"{b}x{p}", prompts, args.new))
    if args.ragged:
        n, span = args.ragged.split(":")
        lo, hi = (int(x) for x in span.split("-"))
        rnd = random.Random(args.seed)
        lengths = [rnd.randint(lo, hi) for _ in range(int(n))]
        prompts = [torch.randint(0, vocab, (1, m), generator=gen).cuda() for m in lengths]
        out.append(runs.Workload(f"ragged {n}x{lo}..{hi}", prompts, args.new))
    return out


def _settle(r: runs.Run, w: runs.Workload, cfg: Any, weights: int, unread: int, args: argparse.Namespace) -> None:
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    r.settle(args.warmup)
    r.live_kv_bytes = per_token * sum(n + w.new for n in w.lengths)
    mid = per_token * sum(n + w.new // 2 for n in w.lengths)
    r.floor_ms = round((weights + mid) / args.bandwidth * 1000, 3)
    r.floor_measured_ms = round((weights + mid) / args.measured_bandwidth * 1000, 3)
    r.floor_read_ms = round((weights - unread + mid) / args.bandwidth * 1000, 3)
    if r.p50_ms:
        r.over_floor = round(r.p50_ms / r.floor_ms, 2)
        r.over_measured_floor = round(r.p50_ms / r.floor_measured_ms, 2)
        r.over_floor_read = round(r.p50_ms / r.floor_read_ms, 2)


def _agreement(r: runs.Run, ref: runs.Run | None) -> float | None:
    if r.tokens is None or ref is None or ref.tokens is None:
        return None
    same = total = 0
    for a, b in zip(r.tokens, ref.tokens, strict=False):
        for x, y in zip(a, b, strict=False):
            total += 1
            same += x == y
            if x != y:
                break  # greedy continuations part at the first difference
    return round(same / max(total, 1), 4)


def run_generate(args: argparse.Namespace) -> dict[str, Any]:
    """Every cache at every point; returns the report."""
    torch._dynamo.config.cache_size_limit = 64
    model = build_model(args)
    cfg = model.config
    weights = weight_bytes(model)
    caches = [c for c in args.caches.split(",") if c]
    unknown = set(caches) - set(runs.CACHES)
    if unknown:
        raise SystemExit(f"unknown caches {sorted(unknown)}; choose from {runs.CACHES}")
    manager = kvvm.Manager("cuda", precommit=True, headroom_tokens=args.headroom)
    report: dict[str, Any] = {"meta": _meta(args, weights), "points": []}
    for w in _workloads(args, cfg.vocab_size):
        max_len = args.max_len or (max(w.lengths) + w.new + 64)
        point: dict[str, Any] = {"point": w.label, "batch": w.batch, "lengths": [min(w.lengths), max(w.lengths)], "runs": []}
        if args.check_steps:
            point["check"] = runs.reference_check(model, w, manager, max_len, args.check_steps)
        done: dict[str, runs.Run] = {}
        for c in caches:
            r = runs.run_cache(model, w, c, manager, max_len, args.graph_mode, args.profile)
            if c in ("static", "kvvm-generate") and not r.note:
                # The first run compiled; time the second.
                r = runs.run_cache(model, w, c, manager, max_len, args.graph_mode, args.profile)
            _settle(r, w, cfg, weights, unread_weight_bytes(model, w.batch), args)
            done[c] = r
            print(_line(r), file=sys.stderr, flush=True)
        for r in done.values():
            row = asdict(r)
            row["greedy_agree_with_dynamic"] = _agreement(r, done.get("dynamic"))
            row.pop("tokens")
            point["runs"].append(row)
        _verdict(point, done)
        point["triton_configs"] = _triton_configs()
        point["product_choices"] = product_choices()
        report["points"].append(point)
        write_report(args.json, report)
    return report


def _triton_configs() -> list[str]:
    """The attention configurations the autotuner chose so far (shape: configuration)."""
    try:
        from kvvm.kernels.triton_decode import tuned_configs
    except ImportError:
        return []
    return [f"{k}: {v}" for k, v in tuned_configs().items()]


def _verdict(point: dict[str, Any], done: dict[str, runs.Run]) -> None:
    graph, static = done.get("kvvm-graph"), done.get("static")
    fused = done.get("kvvm-graph-fused")
    if fused and fused.p50_ms:
        point["graph_fused_over_floor"] = fused.over_floor
        if static and static.p50_ms:
            point["graph_fused_vs_static_speed"] = round(static.p50_ms / fused.p50_ms, 2)
    if graph and graph.p50_ms and static and static.p50_ms:
        point["graph_vs_static_speed"] = round(static.p50_ms / graph.p50_ms, 2)
    if graph and graph.kv_bytes_held and static and static.kv_bytes_held:
        point["graph_vs_static_kv_bytes"] = round(graph.kv_bytes_held / static.kv_bytes_held, 3)
    if graph and graph.over_floor:
        point["graph_over_floor"] = graph.over_floor


def _line(r: runs.Run) -> str:
    if r.note:
        return f"{r.point:>22} {r.cache:>14}: {r.note}"
    return (
        f"{r.point:>22} {r.cache:>14}: step p50 {r.p50_ms} ms p99 {r.p99_ms} ms, {r.tokens_per_s} tok/s, "
        f"{r.over_floor}x the floor ({r.floor_ms} ms; {r.over_measured_floor}x at the copy bandwidth; "
        f"{r.over_floor_read}x the bytes read, {r.floor_read_ms} ms), KV held {(r.kv_bytes_held or 0) / 2**30:.2f} GiB "
        f"(live {(r.live_kv_bytes or 0) / 2**30:.2f}), peak {(r.peak_gpu_bytes or 0) / 2**30:.2f} GiB"
        + (f"; per step (ms): {r.kernels_ms}" if r.kernels_ms else "")
    )


def _meta(args: argparse.Namespace, weights: int) -> dict[str, Any]:
    import transformers

    props = torch.cuda.get_device_properties(0)
    backend = kvvm.Backend("cuda")
    return {
        "device": props.name,
        "driver": backend.devices()[0].get("driver_version", "?"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvvm": kvvm.__version__,
        "weight_bytes": weights,
        "bandwidth_bytes_per_s": args.bandwidth,
        "measured_bandwidth_bytes_per_s": args.measured_bandwidth,
        "new_tokens": args.new,
        "warmup_steps": args.warmup,
    }


def run_kernel_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every attention kernel at every point."""
    from kvvm_bench.kernels import run_kernels

    out: dict[str, Any] = {"meta": {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}, "results": []}
    points = [(b, [p] * b) for b, p in _points(args.points)]
    if args.ragged:
        n, span = args.ragged.split(":")
        lo, hi = (int(x) for x in span.split("-"))
        rnd = random.Random(args.seed)
        points.append((int(n), [rnd.randint(lo, hi) for _ in range(int(n))]))
    for batch, lengths in points:
        for r in run_kernels(batch, lengths, max(lengths) + 256, bandwidth=args.bandwidth):
            out["results"].append(asdict(r))
            print(f"{r.batch:>3} x {r.tokens:>10} {r.kernel:>7}: {r.us_per_call} us ({r.over_floor}x floor "
                  f"{r.floor_us} us), |diff| {r.max_abs_diff}, graph-safe {r.captured} {r.note}", file=sys.stderr, flush=True)
        write_report(args.json, out)
    return out


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    """A trace through every runner; returns the report."""
    from kvvm_bench import serve as sv

    model = build_model(args)
    vocab = model.config.vocab_size
    if args.trace:
        trace = sv.load_trace(args.trace, vocab, args.seed)
    else:
        trace = sv.synthetic_trace(
            args.requests, vocab, prompt_lo=args.prompt_lo, prompt_hi=args.prompt_hi, output=args.output,
            shared_prefix=args.shared_prefix, shared_share=args.shared_share, rate=args.rate, seed=args.seed,
        )
    runners = [r for r in args.runners.split(",") if r]
    max_len = args.max_len or max(len(q.prompt) + q.output_tokens for q in trace) + 16
    on_gpu = args.device == "cuda"
    free_at_start = torch.cuda.mem_get_info()[0] if on_gpu else 0
    results: list[Any] = []

    def done(r: Any) -> None:
        # Each runner's line as soon as it finished: a run cut short keeps what it measured.
        if args.reference and r.outputs:
            r.reference = sv.reference_check(model, trace, r.outputs)
            r.agreement = r.reference["agreement"]
        print(f"{r.runner:>24}: {r.tokens_per_s} tok/s in {r.wall_s:.2f} s, TTFT {r.ttft_ms} ms, ITL {r.itl_ms} ms, "
              f"peak {(r.peak_gpu_bytes or 0) / 2**30:.2f} GiB, agreement {r.agreement} {r.note}"
              + (f", held after: {r.after}" if r.after else ""), file=sys.stderr, flush=True)
        results.append(r)

    if "kvvm-engine" in runners:
        # The engine without the cascade decode or programmatic launches, with them, or both
        # (one after the other, each on a manager of its own).
        for cascade, pdl in _engine_variants(args.cascade, args.programmatic_launches):
            # Each run compiles its own step (the compiler would otherwise reuse the last
            # run's, made with the other launch setting); compiling is before the timed trace.
            torch._dynamo.reset()
            manager = kvvm.Manager(args.backend, budget_bytes=args.budget_bytes or None, precommit=True, headroom_tokens=4)
            r = sv.run_engine(
                model, trace, manager=manager, slots=args.slots, max_len=max_len,
                prefix_cache_bytes=args.prefix_cache_bytes, prefill_chunk=args.prefill_chunk, real_time=args.real_time,
                bandwidth=args.bandwidth, flops=args.flops, fuse_projections=args.fuse_projections,
                engine_kwargs={"cascade": cascade, "programmatic_launches": pdl, "tuned_products": args.tuned_products},
            )
            r.runner = "kvvm-engine" + ("-cascade" if cascade else "") + ("-pdl" if pdl else "")
            done(r)
    if "generate-batch" in runners:
        done(sv.run_generate_batch(model, trace, memory_fraction=None))
        engine_peak = results[0].peak_gpu_bytes if results and results[0].peak_gpu_bytes else 0
        if engine_peak and free_at_start:
            done(sv.run_generate_batch(model, trace, memory_fraction=min(0.9, engine_peak / free_at_start)))
    if "padded" in runners:
        done(sv.run_padded(model, trace, batch=args.padded_batch))
    report: dict[str, Any] = {
        "requests": len(trace),
        "prompt_tokens": sum(len(q.prompt) for q in trace),
        "output_tokens": sum(q.output_tokens for q in trace),
        "results": [],
    }
    for r in results:
        row = asdict(r)
        row.pop("outputs")
        report["results"].append(row)
    report["failed"] = [r.runner for r in results if r.failed]
    engine_run = next((r for r in results if r.runner == "kvvm-engine"), None)
    if args.kvvm_bin and engine_run and engine_run.kv_bytes_over_time:
        report["simulate"] = _simulate(args, trace, engine_run, free_at_start)
        if "error" in report["simulate"]["predicted"]:
            report["failed"].append("simulate")
    write_report(args.json, report)
    return report


_SWITCH = {"off": [False], "on": [True], "both": [False, True]}


def _engine_variants(cascade: str, programmatic: str) -> list[tuple[bool, bool]]:
    """The engine runs a serve report makes: (cascade, programmatic launches) for each
    ``off``/``on``/``both`` of the two switches, the plain engine first."""
    return [(c, p) for c in _SWITCH[cascade] for p in _SWITCH[programmatic]]


def _simulate(args: argparse.Namespace, trace: list[Any], engine_run: Any, free_at_start: int) -> dict[str, Any]:
    """What the engine held beside ``kvvm simulate``'s prediction for the trace. The trace is
    written next to the report (``<json>.trace.jsonl``), or without a report into a temporary
    folder removed afterwards: nothing lands in the working folder."""
    from kvvm_bench import serve as sv

    held = [b for _, b in engine_run.kv_bytes_over_time]
    step_ms = engine_run.wall_s * 1000 / max(len(held), 1)
    with tempfile.TemporaryDirectory(prefix="kvvm-serve-") as tmp:
        trace_path = args.json + ".trace.jsonl" if args.json else os.path.join(tmp, "serve.trace.jsonl")
        sv.save_trace(trace, trace_path)
        predicted = sv.simulate_prediction(
            args.kvvm_bin, trace_path, args.simulate_model, step_ms, args.budget_bytes or free_at_start or None
        )
    return {
        "measured_peak_bytes": max(held),
        "measured_mean_bytes": round(statistics.mean(held)),
        "predicted": predicted,
    }


def _failures(report: dict[str, Any]) -> str:
    """Why the runs of a serve report that could not run did not, one line each."""
    notes = {r["runner"]: r.get("note", "") for r in report.get("results", [])}
    if "simulate" in report:
        notes["simulate"] = str(report["simulate"]["predicted"].get("error", ""))
    return "\n".join(f"  {name}: {notes.get(name) or 'failed'}" for name in report.get("failed", []))


#: The commands a module of their own runs: its name and its run function. Most write
#: ``--json`` as they go (after every run, shape or part).
_RUNNERS = {
    "prefix": ("prefix", "run_prefix_bench"), "engines": ("engines", "run_engines_bench"),
    "kvcached": ("kvcached_compare", "run_kvcached_bench"), "sliding": ("sliding", "run_sliding_bench"),
    "shapes": ("shapes", "run_shapes_bench"), "cascade": ("cascade", "run_cascade_bench"),
    "fp8": ("fp8", "run_fp8_bench"), "swap": ("swap", "run_swap_bench"), "http": ("http_serve", "run_http_bench"),
    "products": ("products", "run_products_bench"), "sampling": ("sampling_step", "run_sampling_bench"),
}


def _run(args: argparse.Namespace) -> dict[str, Any]:
    """The report of the command ``args`` name."""
    if args.cmd in _RUNNERS:
        module, fn = _RUNNERS[args.cmd]
        return getattr(importlib.import_module(f"kvvm_bench.{module}"), fn)(args)  # type: ignore[no-any-return]
    return {"generate": run_generate, "kernels": run_kernel_bench, "serve": run_serve_bench}[args.cmd](args)


def _command_args(sub: Any) -> None:
    """The commands whose arguments their own modules define."""
    from kvvm_bench import prefix as bench_prefix

    bench_prefix.add_args(sub.add_parser("prefix", help="what a prefix-cache hit costs, by handle size"))
    from kvvm_bench import engines

    engines.add_args(sub.add_parser("engines", help="engine processes on one device: a broker vs fixed fractions"))
    engines.worker_args(sub.add_parser("engines-worker", help="one process of `engines` (started by it)"))
    from kvvm_bench import sliding as bench_sliding

    bench_sliding.add_args(sub.add_parser("sliding", help="a Gemma-3-shaped model to 32k tokens: KvvmCache vs DynamicCache"))
    from kvvm_bench import shapes as bench_shapes

    bench_shapes.add_args(sub.add_parser("shapes", help="the decode kernel and the captured step on every head dim, GQA ratio and dtype"))
    from kvvm_bench import kvcached_compare as bench_kvcached

    bench_kvcached.add_args(sub.add_parser("kvcached", help="kvvm beside kvcached: give/take times, bytes held, two instances"))
    bench_kvcached.worker_args(sub.add_parser("kvcached-worker", help="one process of `kvcached` (started by it)"))
    from kvvm_bench import cascade as bench_cascade

    bench_cascade.add_args(sub.add_parser("cascade", help="the cascade decode over shared prefixes against the plain one"))
    from kvvm_bench import fp8 as bench_fp8

    bench_fp8.add_args(sub.add_parser("fp8", help="the captured decode step with FP8 KV against bf16 KV: floors, accuracy"))
    from kvvm_bench import swap as bench_swap

    bench_swap.add_args(sub.add_parser("swap", help="the host tier: copy bandwidth, decode while swapping, crossover, a trace"))
    from kvvm_bench import products as bench_products

    bench_products.add_args(sub.add_parser("products", help="a decode step's skinny products: cuBLAS against kvvm's kernel"))
    from kvvm_bench import http_serve, sampling_step

    http_serve.add_args(sub.add_parser("http", help="a trace through the engine directly and through its OpenAI server"))
    sampling_step.add_args(sub.add_parser("sampling", help="the engine's decode step with sampling on against greedy"))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m kvvm_bench``."""
    ap = argparse.ArgumentParser(prog="python -m kvvm_bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    _decode_args(sub)
    _serve_args(sub)
    _command_args(sub)
    args = ap.parse_args(argv)
    if args.cmd == "engines-worker":
        from kvvm_bench import engines

        print(json.dumps(engines.worker(args)), flush=True)
        return 0
    if args.cmd == "kvcached-worker":
        from kvvm_bench import kvcached_compare

        return kvcached_compare.worker(args)
    if args.cmd != "prefix" and getattr(args, "device", "cuda") == "cuda" and not torch.cuda.is_available():
        print("python -m kvvm_bench needs a CUDA GPU (serve, http, sampling, shapes, sliding, cascade, fp8 and swap also run with --device cpu)",
              file=sys.stderr)
        return 2
    report = _run(args)
    if args.cmd == "prefix":
        write_report(args.json, report)
    json.dump(report, sys.stdout, indent=1)
    print()
    if args.cmd == "serve" and report["failed"]:
        print(f"python -m kvvm_bench serve: {len(report['failed'])} of the runs could not run (the report "
              f"keeps what the others measured):\n{_failures(report)}", file=sys.stderr)
        return 1
    return 0


def _decode_args(sub: Any) -> None:
    """The ``generate`` and ``kernels`` commands' arguments."""
    for name, helptext in (("generate", "decode with every cache side by side"), ("kernels", "attention kernels alone")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--points", default="1x4096,16x2048,16x4096,64x2048", help="batch x prompt, comma-separated")
        p.add_argument("--ragged", default="64:128-4096", help="N:LO-HI prompts uniform in LO..HI ('' for none)")
        p.add_argument("--bandwidth", type=float, default=4.8e12, help="HBM bytes/s of the floor (H200: 4.8e12)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", help="write the report here")
    g = sub.choices["generate"]
    g.add_argument("--tiny", action="store_true", help="a small model instead of the Llama-3.1-8B shape")
    g.add_argument(
        "--measured-bandwidth", type=float, default=4.3e12,
        help="a device-to-device copy's bytes/s on the device (H200, measured: 4.3e12), for a second floor",
    )
    g.add_argument("--new", type=int, default=64, help="tokens generated per request")
    g.add_argument("--warmup", type=int, default=4, help="steps left out of p50/p99")
    g.add_argument("--caches", default=",".join(runs.CACHES), help=f"comma-separated, of {runs.CACHES}")
    g.add_argument("--check-steps", type=int, default=8, help="teacher-forced steps of the logits check (0: none)")
    g.add_argument("--headroom", type=int, default=4, help="pre-commit headroom tokens")
    g.add_argument("--max-len", type=int, default=0, help="KvvmCache's max_cache_len (0: longest prompt + new + 64)")
    g.add_argument("--graph-mode", default=None, help="torch.compile mode of the captured kvvm step (default: its default)")
    g.add_argument("--profile", action="store_true", help="the captured kvvm step's GPU time by kind of kernel")


def _serve_args(sub: Any) -> None:
    p = sub.add_parser("serve", help="a serving trace through the continuous-batching engine and its peers")
    p.add_argument("--trace", help="a JSONL trace (kvvm simulate's format); default: a seeded synthetic one")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals a second (0: all at once)")
    p.add_argument("--prompt-lo", type=int, default=128)
    p.add_argument("--prompt-hi", type=int, default=2048)
    p.add_argument("--output", type=int, default=128, help="tokens generated per request")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens of a common system prompt (0: none)")
    p.add_argument("--shared-share", type=float, default=1.0, help="share of requests that open with it")
    p.add_argument("--runners", default="kvvm-engine,generate-batch,padded")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--max-len", type=int, default=0)
    p.add_argument("--budget-bytes", type=int, default=0)
    p.add_argument("--prefix-cache-bytes", type=int, default=8 << 30)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--padded-batch", type=int, default=64)
    p.add_argument("--fuse-projections", action="store_true", help="the engine fuses Q/K/V and gate/up (kvvm.transformers.projections)")
    p.add_argument("--cascade", default="off", choices=["off", "on", "both"],
                   help="the engine's cascade decode (a shared prefix read once per group): off, on, or both runs")
    p.add_argument("--programmatic-launches", default="off", choices=["off", "on", "both"],
                   help="the engine's decode step captured with programmatic launches: off, on, or both runs")
    p.add_argument("--tuned-products", action="store_true", help="the engine's step multiplies through kvvm's tuned products")
    p.add_argument("--real-time", action="store_true", help="submit at the arrival times (the engine)")
    p.add_argument("--reference", action="store_true", help="check greedy tokens against one request at a time (teacher-forced DynamicCache)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default="auto", help="kvvm backend (host on a CPU)")
    p.add_argument("--bandwidth", type=float, default=4.8e12)
    p.add_argument("--flops", type=float, default=7.9e14, help="dense bf16 FLOP/s of the prefill floor")
    p.add_argument("--kvvm-bin", help="the kvvm binary: compare the engine's KV bytes with kvvm simulate's prediction")
    p.add_argument("--simulate-model", default="llama-3-8b", help="kvvm simulate's model preset for the prediction")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
