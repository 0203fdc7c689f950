"""``python -m kvvm_bench products``: a decode step's skinny products, cuBLAS against kvvm's
Triton kernel, weight by weight.

For each distinct weight shape of the model with its sibling projections fused (the
Llama-3.1-8B shape: Q/K/V, O, gate/up, down, the output head) and each row count of
``--rows`` (a decode step's requests), the product ``x @ W.T`` is timed in a captured graph
(each repeat on its own copy of the weight, so that none reads it from the L2 cache, as a
step never does) through PyTorch (cuBLAS) and through
:func:`kvvm.kernels.products.product` in each candidate configuration, checked against
PyTorch's result first. The down projection is timed twice:
alone, and gated as a step runs it (``down+silu``: PyTorch's SiLU and multiply kernels then
cuBLAS, against the kernel computing the activation as it loads its input, and, as
``separate_us``, kvvm's activation kernel then cuBLAS); a step's sums count the gated one.
Each line gives the microseconds, the rate the weight streamed at, and the layer's products
together (each weight as often as a layer has it, the output head a 32nd); a reduction
measured in the same process gives the rate a read stream reaches on the card. The weights
are random (the time does not depend on them).
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch

from kvvm_bench.report_file import write_report
from kvvm_bench.shapes import read_bandwidth

__all__ = ["add_args", "run_products_bench"]

#: (name, rows of W, columns, times a step of the Llama-3.1-8B shape's 32 layers runs it,
#: gated: the input a gate and an up projection side by side).
_SHAPES = (
    ("qkv", 6144, 4096, 32, False), ("o", 4096, 4096, 32, False), ("gate_up", 28672, 4096, 32, False),
    ("down", 4096, 14336, 0, False), ("down+silu", 4096, 14336, 32, True), ("lm_head", 128256, 4096, 1, False),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default="16,64", help="rows of x (a decode step's requests), comma-separated")
    p.add_argument("--json", help="write the report here")


def _one(rows: int, name: str, n: int, k: int, gated: bool) -> dict[str, Any]:
    from kvvm.kernels.products import candidates, gate_activation, product, torch_product
    from kvvm.kernels.triton_decode import TOO_BIG
    from kvvm.kernels.tuning import cold_copies, graph_time

    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + n)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(rows, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = torch_product(x, w, None, gated).float()
    # Each repeat of a timed graph reads its own copy of the weight (none is in the L2 cache).
    ws = itertools.cycle(cold_copies(w))
    row: dict[str, Any] = {"rows": rows, "weight": name, "n": n, "k": k, "bytes": n * k * 2}
    row["cublas_us"] = round(graph_time(lambda _: torch_product(x, next(ws), None, gated), None) * 1e3, 2)
    if gated:
        # The activation in one kernel of its own, then cuBLAS (what the tuner's separate way
        # runs where cuBLAS is the plain product's choice).
        separate = graph_time(lambda _: torch.nn.functional.linear(gate_activation(x), next(ws)), None)
        row["separate_us"] = round(separate * 1e3, 2)
    kernel: list[dict[str, Any]] = []
    for c in candidates():
        try:
            err = (product(x, w, None, c, gated=gated).float() - ref).abs().max().item()
            us = graph_time(lambda c: product(x, next(ws), None, c, gated=gated), c) * 1e3
        except TOO_BIG:
            continue
        kernel.append({"config": str(c), "us": round(us, 2), "max_abs_diff": round(err, 5)})
    best = min(kernel, key=lambda r: r["us"])
    row.update(kernel=kernel, best=best["config"], best_us=best["us"])
    row["best_over_cublas"] = round(best["us"] / row["cublas_us"], 3)
    return row


def run_products_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every shape at every row count; returns the report (written after each shape)."""
    # What a read stream reaches (a reduction): the rate a product that only reads its
    # weight could reach at best.
    rate = read_bandwidth(torch.device("cuda"), 2 << 30) or 0.0
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "read_bytes_per_s": round(rate),
        "results": [], "per_step": {},
    }
    print(f"a reduction reads {rate / 1e12:.3f} TB/s", flush=True)
    for rows in (int(r) for r in args.rows.split(",") if r):
        step = {"cublas_ms": 0.0, "best_ms": 0.0, "read_rate_ms": 0.0}
        for name, n, k, times, gated in _SHAPES:
            r = _one(rows, name, n, k, gated)
            report["results"].append(r)
            step["cublas_ms"] += times * r["cublas_us"] / 1e3
            step["best_ms"] += times * min(r["best_us"], r["cublas_us"]) / 1e3
            step["read_rate_ms"] += times * r["bytes"] / rate * 1e3
            print(
                f"rows {rows:3d} {name:8s}: cuBLAS {r['cublas_us']:8.1f} us ({r['bytes'] / r['cublas_us'] / 1e6:.2f} TB/s),"
                f" kvvm {r['best_us']:8.1f} us ({r['bytes'] / r['best_us'] / 1e6:.2f} TB/s, {r['best']}),"
                f" {r['best_over_cublas']}x", flush=True,
            )
            write_report(args.json, report)
        report["per_step"][rows] = {k: round(v, 3) for k, v in step.items()}
        print(f"rows {rows}: a step's products {step['cublas_ms']:.3f} ms by cuBLAS, {step['best_ms']:.3f} ms by the "
              f"faster of each, {step['read_rate_ms']:.3f} ms at a reduction's rate", flush=True)
        write_report(args.json, report)
    return report
