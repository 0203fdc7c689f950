"""``python -m kvvm_bench shapes``: the Triton decode kernel and the captured decode step on
every attention shape: head dims 64, 96, 128 and 256; 1, 4, 8 and 16 query heads per KV head
(of 16 query heads: 16 is one KV head); bf16 and fp16; at one point, ``--batch`` requests of
``--tokens`` tokens each.

For each shape:

- the kernel alone (:func:`kvvm_bench.kernels.run_kernels`, the ``triton`` kernel): microseconds
  per call inside a CUDA graph, the HBM floor of the call (the live K/V bytes at the bandwidth)
  and the ratio, the largest difference to SDPA over each request's exact tokens, and whether
  the captured call is right again after the lengths changed on the device;
- the decode step of a Llama-shaped model of that head dim and ratio (random weights,
  ``--layers`` layers, hidden size = heads x head dim): every request prefilled into its own
  slot of a KvvmCache and the step captured as a :class:`~kvvm.graph.DecodeGraph`; its logits
  over ``--check-steps`` teacher-forced steps against the same weights over a DynamicCache per
  request (SDPA): the largest difference and the argmax agreement where the reference's top
  two logits are further apart than the dtype resolves; then ``--steps`` greedy steps, one
  event per replay: p50 and p99, the HBM floor of a step (every weight byte and the live K/V
  at the mean timed length) at the device's bandwidth and at the bandwidth a device-to-device
  copy reaches on it, and the ratios.

The Triton configuration is :func:`~kvvm.kernels.triton_decode.choose_splits`' (untimed: one compile
per shape) unless ``--tune``, which runs the per-shape tuner the decode step runs by default
(up to 26 compiles per shape). ``--compile`` compiles the step before the capture (each
shape's model its own compile); by default the eager step is captured, its pointwise kernels
unfused.

Without CUDA (``--device cpu --tiny``, under ``TRITON_INTERPRET=1``): the host backend, the
kernel in Triton's interpreter and the step run eagerly (a CUDA graph needs CUDA), their
results checked as on the GPU; nothing is timed, and the report says so.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

import kvvm
from kvvm_bench.report_file import write_report
from kvvm_bench.shapes_step import DTYPES, Shape, StepResult, run_step, step_tokens

__all__ = ["BANDWIDTHS", "DTYPES", "GQA", "HEAD_DIMS", "Shape", "add_args", "copy_bandwidth", "run_shapes_bench", "table"]

HEAD_DIMS = (64, 96, 128, 256)
GQA = (1, 4, 8, 16)

#: HBM bytes/s by device name, the first match winning (the vendors' figures).
BANDWIDTHS = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))

#: Sizes of ``--tiny`` (a CPU runs them in seconds), for the flags left unset.
_TINY = {"batch": 2, "tokens": 40, "layers": 1, "hidden": 64, "vocab": 256, "check_steps": 2, "steps": 4}
_FULL = {"batch": 16, "tokens": 2048, "layers": 4, "hidden": 0, "vocab": 32000, "check_steps": 4, "steps": 32}


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``python -m kvvm_bench shapes``."""
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)), help="comma-separated")
    p.add_argument("--gqa", default=",".join(map(str, GQA)), help="query heads per KV head, comma-separated")
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {list(DTYPES)}")
    p.add_argument("--heads", type=int, default=16, help="query heads (each ratio must divide it)")
    p.add_argument("--batch", type=int, help=f"requests (default {_FULL['batch']}; --tiny {_TINY['batch']})")
    p.add_argument("--tokens", type=int, help=f"prompt tokens per request (default {_FULL['tokens']}; --tiny {_TINY['tokens']})")
    p.add_argument("--layers", type=int, help=f"layers of the step's model (default {_FULL['layers']}; --tiny {_TINY['layers']})")
    p.add_argument("--hidden", type=int, help=f"hidden size (default heads x head dim; --tiny {_TINY['hidden']})")
    p.add_argument("--vocab", type=int, help=f"vocabulary (default {_FULL['vocab']}; --tiny {_TINY['vocab']})")
    p.add_argument("--intermediate-ratio", type=float, default=3.5, help="MLP width over the hidden size")
    p.add_argument("--check-steps", type=int, help=f"teacher-forced steps whose logits are checked (default {_FULL['check_steps']})")
    p.add_argument("--steps", type=int, help=f"greedy steps timed after the check (default {_FULL['steps']})")
    p.add_argument("--parts", default="kernel,step", help="comma-separated, of kernel, step")
    p.add_argument(
        "--bandwidth", type=float, default=0.0,
        help="HBM bytes/s of the floor (0: by device name, " + ", ".join(f"{n} {b:.3g}" for n, b in BANDWIDTHS) + ")",
    )
    p.add_argument(
        "--measured-bandwidth", type=float, default=0.0,
        help="bytes/s of the second floor (0: a device-to-device copy measured at the start)",
    )
    p.add_argument("--tune", action="store_true", help="the Triton tuner per shape (default: choose_splits' configuration)")
    p.add_argument("--compile", action="store_true", help="torch.compile the step before the capture")
    p.add_argument("--tiny", action="store_true", help="small sizes (what the CPU test runs)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: under TRITON_INTERPRET=1, untimed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default="", help="the commit of the kvvm build, recorded in the report")
    p.add_argument("--json", help="write the report here (after every shape)")


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    base = _TINY if args.tiny else _FULL
    return {k: v if getattr(args, k) is None else int(getattr(args, k)) for k, v in base.items()}


def _shapes(args: argparse.Namespace) -> list[Shape]:
    dims = [int(x) for x in args.head_dims.split(",") if x]
    ratios = [int(x) for x in args.gqa.split(",") if x]
    dtypes = [x for x in args.dtypes.split(",") if x]
    bad = [r for r in ratios if r <= 0 or args.heads % r] + [d for d in dtypes if d not in DTYPES]
    if bad:
        raise SystemExit(f"--gqa must divide --heads {args.heads}; --dtypes of {list(DTYPES)}: {bad}")
    return [Shape(d, r, t, args.heads) for t in dtypes for d in dims for r in ratios]


def _bandwidth(args: argparse.Namespace, device: torch.device) -> tuple[float, str]:
    """The floor's bytes/s and where it came from."""
    if args.bandwidth > 0:
        return args.bandwidth, "--bandwidth"
    if device.type != "cuda":
        return dict(BANDWIDTHS)["H100"], "no CUDA: the H100 figure (the floors mean nothing here)"
    name = torch.cuda.get_device_name(device)
    for key, value in BANDWIDTHS:
        if key in name:
            return value, f"{key} (by device name)"
    raise SystemExit(f"no HBM bandwidth known for {name!r}: pass --bandwidth")


def _best_seconds(call: Callable[[], object]) -> float:
    """The shortest of five timed runs of ``call`` on the current CUDA stream (after one
    untimed run), in seconds."""
    call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        call()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return best


def copy_bandwidth(device: torch.device, size: int = 1 << 30) -> float | None:
    """Bytes/s a device-to-device copy of ``size`` bytes reaches (read and written), best of
    five; None without CUDA."""
    if device.type != "cuda":
        return None
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * size / _best_seconds(lambda: dst.copy_(src))


def read_bandwidth(device: torch.device, size: int = 1 << 30) -> float | None:
    """Bytes/s a reduction over ``size`` bytes reads (a read stream, nothing written back),
    best of five; None without CUDA."""
    if device.type != "cuda":
        return None
    data = torch.ones(size // 4, dtype=torch.float32, device=device)
    return size / _best_seconds(data.sum)


def _meta(args: argparse.Namespace, device: torch.device, bandwidth: tuple[float, str], measured: float | None) -> dict[str, Any]:
    import transformers
    import triton

    on_gpu = device.type == "cuda"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if on_gpu else f"cpu ({platform.processor() or platform.machine()})",
        "driver": kvvm.Backend("cuda").devices()[0].get("driver_version", "?") if on_gpu else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "kvvm": kvvm.__version__,
        "commit": args.commit or None,
        # ci/gpu/python.sh lays the working tree's Python modules over the wheel's with it.
        "python_overlay": os.environ.get("KVVM_PY_OVERLAY", "") not in ("", "0"),
        "python": platform.python_version(),
        "sizes": _sizes(args),
        "heads": args.heads,
        "intermediate_ratio": args.intermediate_ratio,
        "bandwidth_bytes_per_s": bandwidth[0],
        "bandwidth_from": bandwidth[1],
        "measured_bandwidth_bytes_per_s": measured,
        "triton_config": "tuned per shape" if args.tune else "choose_splits (untuned)",
        "step": "torch.compile, then captured" if args.compile else "eager, captured",
        "timing": "CUDA events" if on_gpu else "skipped: no CUDA (the kernel in Triton's interpreter, the step eagerly)",
    }


def run_shapes_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every shape; returns the report (also written to ``--json`` after each shape)."""
    from kvvm.kernels import triton_decode

    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise SystemExit("on the CPU the Triton kernel runs in Triton's interpreter: set TRITON_INTERPRET=1")
    shapes = _shapes(args)
    parts = {p for p in args.parts.split(",") if p}
    if not parts or parts - {"kernel", "step"}:
        raise SystemExit(f"--parts: of kernel, step (not {args.parts!r})")
    bandwidth = _bandwidth(args, device)
    measured = args.measured_bandwidth or copy_bandwidth(device)
    report: dict[str, Any] = {"meta": _meta(args, device, bandwidth, measured), "points": []}
    backend = "cuda" if device.type == "cuda" else "host"
    manager = kvvm.Manager(backend, precommit=True, headroom_tokens=4)
    tune, triton_decode.AUTOTUNE = triton_decode.AUTOTUNE, args.tune
    try:
        for shape in shapes:
            point = _point(shape, parts, args, device, manager, bandwidth[0], measured)
            report["points"].append(point)
            print(_line(point), file=sys.stderr, flush=True)
            report["markdown"] = table(report["points"])
            write_report(args.json, report)
    finally:
        triton_decode.AUTOTUNE = tune
    print(report["markdown"], file=sys.stderr, flush=True)
    return report


def _point(
    shape: Shape, parts: set[str], args: argparse.Namespace, device: torch.device, manager: kvvm.Manager,
    bandwidth: float, measured: float | None,
) -> dict[str, Any]:
    from kvvm.kernels.triton_decode import tuned_configs

    sizes = _sizes(args)
    tuned_before = set(tuned_configs())
    point: dict[str, Any] = {**asdict(shape), "kv_heads": shape.kv_heads, "batch": sizes["batch"], "tokens": sizes["tokens"]}
    if "kernel" in parts:
        point["kernel"] = _kernel(shape, sizes, device, bandwidth, measured)
    if "step" in parts:
        try:
            step = run_step(shape, sizes, args, device, manager, bandwidth, measured)
        except (torch.OutOfMemoryError, kvvm.KvvmError, RuntimeError) as e:
            step = StepResult(sizes["layers"], 0, note=f"{type(e).__name__}: {e}"[:300])
        point["step"] = asdict(step)
    point["triton_configs"] = _configs(shape, sizes, device, parts, tuned_before)
    if args.compile:
        torch._dynamo.reset()  # each shape's model is another; its step compiles afresh
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    manager.trim_pool(0)
    return point


def _configs(shape: Shape, sizes: dict[str, int], device: torch.device, parts: set[str], tuned_before: set[Any]) -> list[str]:
    """The Triton configurations the shape ran: those the tuner chose for it, else
    :func:`~kvvm.kernels.triton_decode.choose_splits`' for the kernel's and the step's reservations."""
    from kvvm.kernels.device import multiprocessors
    from kvvm.kernels.triton_decode import Config, choose_splits, tuned_configs

    tuned = [f"{k}: {v}" for k, v in tuned_configs().items() if k not in tuned_before]
    if tuned:
        return tuned
    mp = multiprocessors(device)
    batch, out = sizes["batch"], []
    for part, reserved in (("kernel", _kernel_tokens(sizes)), ("step", step_tokens(sizes))):
        if part in parts:
            out.append(f"{part}: {Config(choose_splits(batch, shape.kv_heads, reserved, mp))} (untuned)")
    return out


def _kernel_tokens(sizes: dict[str, int]) -> int:
    """Tokens reserved per request by the kernel's K/V."""
    return sizes["tokens"] + 256


def _kernel(shape: Shape, sizes: dict[str, int], device: torch.device, bandwidth: float, measured: float | None) -> dict[str, Any]:
    """The Triton kernel alone at the point (:func:`kvvm_bench.kernels.run_kernels`)."""
    from kvvm_bench.kernels import run_kernels

    batch, tokens = sizes["batch"], sizes["tokens"]
    (r,) = run_kernels(
        batch, [tokens] * batch, _kernel_tokens(sizes), heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        bandwidth=bandwidth, kernels=("triton",), dtype=shape.torch_dtype, device=device.type,
    )
    out = asdict(r)
    if measured:
        out["floor_measured_us"] = round(r.floor_us * bandwidth / measured, 2)
        out["over_measured_floor"] = round(r.us_per_call / out["floor_measured_us"], 2) if r.us_per_call else None
    return out


def _line(point: dict[str, Any]) -> str:
    out = [f"head dim {point['head_dim']:>3} gqa {point['gqa']:>2} ({point['heads']}/{point['kv_heads']}) {point['dtype']}"]
    k, s = point.get("kernel"), point.get("step")
    if k:
        timed = f"{k['us_per_call']} us, {k['over_floor']}x" if k["us_per_call"] is not None else "not timed"
        out.append(f"kernel {timed} (floor {k['floor_us']} us), |diff| {k['max_abs_diff']}, graph-safe {k['captured']} {k['note']}")
    if s:
        timed = f"p50 {s['p50_ms']} ms, {s['over_floor']}x" if s["p50_ms"] is not None else "not timed"
        out.append(f"step {timed} (floor {s['floor_ms']} ms), logits |diff| {s['max_abs_logit_diff']}, "
                   f"argmax {s['argmax_agree']}/{s['argmax_checked']} {s['note']}")
    return "; ".join(out)


def table(points: list[dict[str, Any]]) -> str:
    """The report's figures as a markdown table, one row per shape."""
    rows = [
        "| head dim | query/KV heads | dtype | kernel us | kernel floor us | kernel / floor | kernel max diff "
        "| step p50 ms | step p99 ms | step floor ms | step / floor | step / copy floor | logits max diff | argmax agree |",
        "|---" * 14 + "|",
    ]
    for p in points:
        k, s = p.get("kernel") or {}, p.get("step") or {}
        cells = [
            p["head_dim"], f"{p['heads']}/{p['kv_heads']}", p["dtype"], k.get("us_per_call"), k.get("floor_us"),
            k.get("over_floor"), _fmt(k.get("max_abs_diff")), s.get("p50_ms"), s.get("p99_ms"), s.get("floor_ms"),
            s.get("over_floor"), s.get("over_measured_floor"), _fmt(s.get("max_abs_logit_diff")),
            f"{s['argmax_agree']}/{s['argmax_checked']}" if s.get("argmax_checked") is not None else None,
        ]
        rows.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(rows)


def _fmt(x: float | None) -> str | None:
    return None if x is None else f"{x:.3g}"
