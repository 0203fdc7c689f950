"""FP8 KV against bf16 KV (``python -m kvvm_bench fp8``): ``--batch`` requests of ``--prompt``
tokens (random, seeded) decode through a captured step (:class:`~kvvm.transformers.DecodeGraph`)
with a ``KvvmCache`` in the model's bf16 and then in FP8 (``kv_dtype="fp8_e4m3"``), one after
the other in one process (both caches at once would not fit beside the model at 64 x 4096).

For each: the step's p50/p99 over ``--steps`` replays, its HBM floor (every weight byte, as
the ``generate`` benchmark counts them, plus the KV bytes the step reads: each request's live
tokens at the timed steps' mean length, 2 bytes an element in bf16 and 1 in FP8) and the step
over its floor; the bytes a token takes and how many tokens a budget holds (the layout plan's
committed bytes for ``--budget-gib``). Then accuracy, teacher-forced: the FP8 step is fed the
bf16 step's greedy tokens for ``--check-steps`` steps (the prefill's last logits first), and
its logits are compared with bf16's: max and mean absolute difference, and argmax agreement
where bf16's top two logits are further apart than bf16's resolution.

The Llama-3.1-8B shape with random bf16 weights on CUDA (``--tiny``: a small model); the
projections fused (``--no-fuse``: as the model has them), the step compiled (``--no-compile``:
the eager step captured, a shorter run). ``--tiny --device cpu --backend host`` runs the same
steps eagerly on a CPU (fp32, nothing timed): what the tests run.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import kvvm
from kvvm_bench.model import build_model, product_choices, unread_weight_bytes, weight_bytes
from kvvm_bench.numerics import bf16_tie, timed_greedy_steps
from kvvm_bench.report_file import write_report
from kvvm_bench.runs import kernel_breakdown

__all__ = ["add_args", "run_fp8_bench"]

#: HBM bandwidth (bytes/s) by device name, for the floor (``--bandwidth`` overrides).
_BANDWIDTH = (("H200", 4.8e12), ("H100", 3.35e12))


def add_args(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("--batch", type=int, default=64, help="requests decoded together")
    p.add_argument("--prompt", type=int, default=4096, help="tokens of each request's prompt")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--check-steps", type=int, default=16, help="teacher-forced steps whose logits are compared")
    p.add_argument("--bandwidth", type=float, default=0.0, help="HBM bytes/s of the floor (0: by the device's name)")
    p.add_argument("--budget-gib", type=float, default=40.0, help="the budget whose token capacity is reported")
    p.add_argument("--tiny", action="store_true", help="a small model instead of the Llama-3.1-8B shape")
    p.add_argument("--no-fuse", action="store_true", help="leave the Q/K/V and gate/up projections unfused")
    p.add_argument(
        "--tuned-products", action="store_true",
        help="run the model's products through kvvm's tuned skinny products (both caches)",
    )
    p.add_argument(
        "--pdl", action="store_true",
        help="launch the step's kernels (kvvm's and the compiler's) as programmatic dependents (Hopper on)",
    )
    p.add_argument("--no-compile", action="store_true", help="capture the eager step (no torch.compile)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default="auto", help="kvvm backend (host on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="each captured step's GPU time by kind of kernel, its heaviest kernels")
    p.add_argument("--json", help="write the report here")


def _bandwidth(args: argparse.Namespace) -> float:
    if args.bandwidth:
        return float(args.bandwidth)
    if args.device != "cuda":
        return 0.0
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in _BANDWIDTH if key in name), 3.35e12)


@torch.no_grad()
def _prefill(model: Any, cache: Any, prompts: torch.Tensor) -> torch.Tensor:
    """Each request's prompt in its own slot, one forward each; the last tokens' logits."""
    last = []
    for slot in range(prompts.shape[0]):
        with cache.select(slot):
            out = model(input_ids=prompts[slot : slot + 1], past_key_values=cache, use_cache=True, logits_to_keep=1)
            last.append(out.logits[:, -1].float())
    return torch.cat(last)


def _one(model: Any, mgr: kvvm.Manager, args: argparse.Namespace, prompts: torch.Tensor, kv_dtype: str | None,
         teacher: list[torch.Tensor] | None) -> tuple[dict[str, Any], list[torch.Tensor], list[torch.Tensor]]:
    """One cache's run: prefill, the teacher-forced steps (the greedy tokens when ``teacher``
    is None, else those), the timed steps. Returns its row, its logits and the tokens fed."""
    from kvvm.kernels.triton_decode import tuned_configs
    from kvvm.transformers import DecodeGraph, KvvmCache
    from kvvm_bench.shapes_step import EagerStep

    tuned_before = set(tuned_configs())
    cuda = args.device == "cuda"
    max_len = args.prompt + args.check_steps + args.steps + 64
    cache = KvvmCache(model, args.batch, max_len, manager=mgr, kv_dtype=kv_dtype)
    step = None
    try:
        logits = [_prefill(model, cache, prompts)]
        step = DecodeGraph(model, cache, compile=not args.no_compile) if cuda else EagerStep(model, cache)
        fed: list[torch.Tensor] = []
        for i in range(args.check_steps):
            tok = logits[-1].argmax(-1) if teacher is None else teacher[i]
            fed.append(tok)
            logits.append(step(tok).float().clone())
        geometry = cache.plan.geometry
        mean_len = args.prompt + args.check_steps + (args.steps + 1) / 2
        weights = weight_bytes(model)
        kv_read = geometry.bytes_per_token * args.batch * mean_len
        budget = int(args.budget_gib * (1 << 30))
        row: dict[str, Any] = {
            "kv_dtype": geometry.dtype,
            "weight_bytes": weights,
            "kv_bytes_read_per_step": int(kv_read),
            "bytes_per_token": geometry.bytes_per_token,
            "tokens_in_budget": _tokens_within(cache.plan, budget),
            "committed_bytes": cache.committed_bytes,
        }
        if cuda:
            timing = timed_greedy_steps(step, logits[-1].argmax(-1), args.steps)
            # The decode kernel's configurations the autotuner chose for this cache.
            row["decode_configs"] = [f"{k}: {v}" for k, v in tuned_configs().items() if k not in tuned_before]
            from kvvm.kernels.products import tuned_product_choices

            row["product_choices"] = tuned_product_choices()
            floor_ms = (weights + kv_read) / _bandwidth(args) * 1e3
            read_ms = (weights - unread_weight_bytes(model, args.batch) + kv_read) / _bandwidth(args) * 1e3
            row.update(
                step_p50_ms=timing["p50"], step_p99_ms=timing["p99"], floor_ms=round(floor_ms, 3),
                over_floor=round(timing["p50"] / floor_ms, 3), floor_read_ms=round(read_ms, 3),
                over_floor_read=round(timing["p50"] / read_ms, 3),
            )
            if args.profile:
                tok = logits[-1].argmax(-1)
                row["profile"] = kernel_breakdown(lambda: step(tok), steps=4)
        cache.check()
    finally:
        if step is not None:
            step.close()
        cache.release()
    return row, logits, fed


def _tokens_within(plan: Any, budget: int) -> int:
    """The most tokens one request of ``plan``'s per-token shape commits within ``budget``
    (whole windows, as the planner and the governor count them), by bisection."""
    g = plan.geometry
    most = 1 << 30
    wide = kvvm.LayoutPlan(
        kvvm.KvGeometry(layers=g.layers, kv_heads=g.kv_heads, head_dim=g.head_dim, max_tokens=most, dtype=g.dtype),
        plan.layout, plan.granule,
    )
    lo, hi = 0, most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if wide.committed_bytes_for_tokens(mid) <= budget else (lo, mid)
    return lo


def _accuracy(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, Any]:
    """Teacher-forced logits of FP8 against bf16, every step (the prefill's last first)."""
    worst, total, count, agree, checked = 0.0, 0.0, 0, 0, 0
    for r, g in zip(ref, got, strict=True):
        diff = (g - r).abs()
        worst = max(worst, diff.max().item())
        total += diff.sum().item()
        count += diff.numel()
        top2 = r.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > bf16_tie(top2[:, 0])
        agree += int(((g.argmax(-1) == r.argmax(-1)) & clear).sum())
        checked += int(clear.sum())
    return {
        "max_abs_logit_diff": round(worst, 4),
        "mean_abs_logit_diff": round(total / max(count, 1), 5),
        "argmax_agree": agree,
        "argmax_checked": checked,
        "argmax_agree_fraction": round(agree / max(checked, 1), 4),
        "logit_std_reference": round(torch.cat(ref).std().item(), 4),
    }


def run_fp8_bench(args: argparse.Namespace) -> dict[str, Any]:
    """bf16 then FP8 (see the module); the report is rewritten after each."""
    from kvvm.transformers import use_kvvm_attention
    from kvvm.transformers.projections import fuse_projections

    model = build_model(args)
    if not args.no_fuse:
        fuse_projections(model)
    if args.tuned_products:
        from kvvm.transformers import tuned_products

        tuned_products(model)
    if args.pdl:
        from kvvm.kernels.device import set_programmatic_launch

        set_programmatic_launch(True, compiler=True)  # for the whole run
    use_kvvm_attention(model)
    backend = args.backend if args.backend != "auto" else ("cuda" if args.device == "cuda" else "host")
    mgr = kvvm.Manager(backend, precommit=True)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), generator=gen)
    prompts = prompts.to(next(model.parameters()).device)
    name = "a small Llama" if args.tiny else "the Llama-3.1-8B shape"
    report: dict[str, Any] = {
        "model": f"{name}, random {next(model.parameters()).dtype} weights",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "point": f"{args.batch}x{args.prompt}",
        "bandwidth": _bandwidth(args),
        "fused_projections": not args.no_fuse,
        "tuned_products": args.tuned_products, "pdl": args.pdl,
        "compiled": not args.no_compile,
        "runs": [],
    }
    bf16, ref, teacher = _one(model, mgr, args, prompts, None, None)
    report["runs"].append(bf16)
    print(bf16, flush=True)
    write_report(args.json, report)
    fp8, got, _ = _one(model, mgr, args, prompts, "fp8_e4m3", teacher)
    report["runs"].append(fp8)
    print(fp8, flush=True)
    if "step_p50_ms" in fp8:
        report["fp8_speedup"] = round(bf16["step_p50_ms"] / fp8["step_p50_ms"], 3)
    report["budget_tokens_ratio"] = round(fp8["tokens_in_budget"] / max(bf16["tokens_in_budget"], 1), 3)
    report["accuracy"] = _accuracy(ref, got)
    report["product_choices"] = product_choices()
    print({k: report.get(k) for k in ("fp8_speedup", "budget_tokens_ratio", "accuracy")}, flush=True)
    write_report(args.json, report)
    return report
