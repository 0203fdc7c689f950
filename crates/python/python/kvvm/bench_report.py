"""What ``python -m kvvm.bench generate`` prints: the best of each cache's rounds, each
point's verdict (best kvvm against the best baseline) and the Markdown table."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from typing import Any

from kvvm import bench_caches as bc

def best_of_rounds(first: bc.RunResult, p50s: list[float]) -> bc.RunResult:
    """The first run's result (correctness, memory, prefill) with the best step p50 of all
    rounds."""
    best = min(p50s)
    res = bc.RunResult(**{**asdict(first), "notes": list(first.notes)})
    res.rounds_p50_ms = list(p50s)
    res.step_p50_ms = best
    res.step_p50_median_ms = round(statistics.median(p50s), 3)
    res.tokens_per_s = round(res.batch * 1000 / best, 1)
    return res


def verdict(point: list[bc.RunResult], warmup: int = 4) -> str:
    """One line per point: the best KvvmCache against the best other cache, by best runs and
    by the median of the rounds' ratios (each round's best kvvm over its best baseline), then
    in the step-interleaved phase by p50 and per step, paired (``warmup`` steps left out)."""
    kv = [r for r in point if bc.is_kvvm(r.cache)]
    base = [r for r in point if not bc.is_kvvm(r.cache)]
    if not kv or not base:
        return ""
    bk = max(kv, key=lambda r: r.tokens_per_s)
    bb = max(base, key=lambda r: r.tokens_per_s)
    # Round i's ratio is over the caches that ran in round i (StaticCache may run fewer).
    n = max(len(r.rounds_p50_ms) for r in point)
    paired = []
    for i in range(n):
        b = [r.rounds_p50_ms[i] for r in base if len(r.rounds_p50_ms) > i]
        k = [r.rounds_p50_ms[i] for r in kv if len(r.rounds_p50_ms) > i]
        if b and k:
            paired.append(min(b) / min(k))
    n = len(paired)
    med = statistics.median(paired) if paired else float("nan")
    line = (
        f"{bk.batch}x{bk.prompt}: best kvvm {bk.cache} {bk.tokens_per_s} tokens/s, best baseline "
        f"{bb.cache} {bb.tokens_per_s}: {bk.tokens_per_s / bb.tokens_per_s:.3f}x; median of "
        f"{n} rounds' ratios {med:.3f}x"
    )
    ik = [r for r in kv if r.interleaved_tokens_per_s]
    ib = [r for r in base if r.interleaved_tokens_per_s]
    if ik and ib:
        ik_best = max(ik, key=lambda r: r.interleaved_tokens_per_s or 0.0)
        ib_best = max(ib, key=lambda r: r.interleaved_tokens_per_s or 0.0)
        kt, bt = ik_best.interleaved_tokens_per_s or 0.0, ib_best.interleaved_tokens_per_s or 1.0
        line += (
            f"; step-interleaved: {ik_best.cache} {kt} vs {ib_best.cache} {bt} tokens/s: "
            f"{kt / bt:.3f}x"
        )
        # Paired per step: the median of the baseline's step time over kvvm's in the same
        # rotation, which a host load drifting over the phase moves less than the p50s.
        pr = bc.paired_ratio(ik_best.interleaved_steps_ms, ib_best.interleaved_steps_ms, warmup)
        if pr is not None:
            line += f", paired per step {pr:.3f}x"
    return line


def fmt_opt(x: float | None, digits: int) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def markdown(results: list[bc.RunResult], shared: dict[str, Any] | None, meta: dict[str, Any]) -> str:
    lines = [
        f"device: {meta['device_name']}, driver {meta.get('driver', '?')}, torch {meta['torch']}, "
        f"transformers {meta['transformers']}, kvvm {meta['kvvm']}, {meta['date']}",
        "",
        "| cache | batch x prompt | prefill ms | step p50 ms (best run) | median of runs | tokens/s | "
        "step-interleaved p50 ms | tokens/s | "
        "KV GPU us/step | KV held | "
        "live KV | peak alloc (decode) | peak alloc + kvvm | peak reserved | max abs logit diff | "
        "argmax (disagree/checked) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        agree = "" if r.argmax_checked is None else f"{r.argmax_disagree}/{r.argmax_checked}"
        diff = "" if r.max_abs_logit_diff is None else f"{r.max_abs_logit_diff:.4g}"
        kv = "" if r.kv_gpu_us_per_step is None else f"{r.kv_gpu_us_per_step:.0f}"
        lines.append(
            f"| {r.cache} | {r.batch} x {r.prompt} | {r.prefill_ms:.0f} | {r.step_p50_ms:.2f} | "
            f"{r.step_p50_median_ms:.2f} | {r.tokens_per_s:.1f} | {fmt_opt(r.interleaved_p50_ms, 2)} | "
            f"{fmt_opt(r.interleaved_tokens_per_s, 1)} | {kv} | {fmt_bytes(r.kv_bytes_held)} | {fmt_bytes(r.kv_bytes_live)} | "
            f"{fmt_bytes(r.peak_allocated_decode)} | {fmt_bytes(r.peak_total_decode)} | "
            f"{fmt_bytes(r.peak_reserved_decode)} | {diff} | {agree} |"
        )
    points: dict[tuple[int, int], list[bc.RunResult]] = {}
    for r in results:
        points.setdefault((r.batch, r.prompt), []).append(r)
    verdicts = [v for v in (verdict(p, int(meta.get("warmup", 4))) for p in points.values()) if v]
    if verdicts:
        lines += [""] + [f"- {v}" for v in verdicts]
    if shared:
        lines += ["", "shared prompt: " + json.dumps(shared)]
    return "\n".join(lines)
