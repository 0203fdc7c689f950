"""``python -m kvvm_bench serve``: a serving trace replayed, side by side in one process, by
kvvm's continuous-batching engine (:class:`~kvvm.engine.Engine`), transformers'
``generate_batch`` (its continuous batching: a paged cache, CUDA graphs; with its defaults and
with its memory fraction set to what the engine needed) and padded ``generate()`` batches
with ``DynamicCache``.

The trace is the JSONL ``kvvm simulate`` reads (``arrival_s``, ``prompt_tokens`` or
``token_ids``, ``output_tokens``, ``shared_prefix_tokens``; ``docs/simulate.md``) or a seeded
synthetic one. Requests are submitted as fast as possible (every request at the start) or, with
``--real-time``, at their arrival times (the engine only). For each runner: generated tokens
per second, time to first token and inter-token latency p50/p99, peak GPU memory beyond the
weights (PyTorch's reserved peak + kvvm's committed bytes), KV bytes held over time (kvvm),
prefix hits and preemptions (kvvm), and each request's greedy tokens against a
one-request-at-a-time ``DynamicCache`` reference (teacher-forced: the share that
agrees, ties bf16 cannot order aside). The floor of the trace is its prefill FLOPs at the dense bf16 rate plus every
decode step of the engine at its HBM floor (weights + the distinct KV bytes of the step).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvvm import Manager
from kvvm.transformers import use_kvvm_attention
from kvvm.engine import Engine
from kvvm_bench.numerics import bf16_tie, percentiles

__all__ = [
    "TraceRequest",
    "ServeResult",
    "load_trace",
    "synthetic_trace",
    "save_trace",
    "simulate_prediction",
    "run_engine",
    "run_padded",
    "run_generate_batch",
]


@dataclass
class TraceRequest:
    """One request of a trace, with its token ids."""

    arrival_s: float
    prompt: list[int]
    output_tokens: int
    shared_prefix_tokens: int = 0


@dataclass
class ServeResult:
    """What one runner did with the trace."""

    runner: str
    wall_s: float = 0.0
    generated_tokens: int = 0
    tokens_per_s: float = 0.0
    ttft_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    peak_gpu_bytes: int | None = None
    kv_bytes_over_time: list[tuple[float, int]] = field(default_factory=list)
    prefix_hits: int | None = None
    #: Admissions put off until a prefix another request was prefilling was published.
    prefix_waits: int | None = None
    preemptions: int | None = None
    #: Requests preempted at least once (kvvm).
    preempted_requests: int | None = None
    #: The engine's swaps to the host tier (``swapped_out``, ``swapped_in``, ``fallbacks``)
    #: and its measured costs, with a host tier.
    swaps: dict[str, Any] | None = None
    #: The engine's step counts (``steps``, ``decode_steps``, ``prefill_forwards``,
    #: ``prefill_chunks``, ``admission_refusals``): where a run's time went (kvvm's engine).
    engine_steps: dict[str, int] | None = None
    floor_s: float | None = None
    #: The share of generated tokens that agree with the reference (:func:`reference_check`).
    agreement: float | None = None
    #: :func:`reference_check`'s whole report.
    reference: dict[str, Any] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)
    #: What was held after the trace (the engine): the manager's books once the engine
    #: closed (``committed``, ``shared``, ``pooled``, ``quarantined``), then ``pooled_after_trim``
    #: once the pool was emptied; on a GPU also the driver's free memory and torch's reserved
    #: bytes before the engine was made and after (``driver_free_*``, ``torch_reserved_*``):
    #: their sums before and after differ by what something else than torch still holds.
    after: dict[str, int] = field(default_factory=dict)
    note: str = ""
    #: The runner could not run the trace (``note`` says why): ``python -m kvvm_bench serve``
    #: exits 1 after writing its report.
    failed: bool = False


def load_trace(path: str, vocab: int, seed: int = 0) -> list[TraceRequest]:
    """The requests of a JSONL trace; ``prompt_tokens`` become seeded random ids, the first
    ``shared_prefix_tokens`` of them the trace's common system prompt."""
    rnd = random.Random(seed)
    rows = [json.loads(line) for line in open(path) if line.strip()]
    system_len = max((int(r.get("shared_prefix_tokens", 0)) for r in rows), default=0)
    system = [rnd.randrange(vocab) for _ in range(system_len)]
    out = []
    for r in rows:
        if "token_ids" in r:
            prompt = [int(t) % vocab for t in r["token_ids"]]
            shared = 0
        else:
            shared = int(r.get("shared_prefix_tokens", 0))
            n = int(r["prompt_tokens"])
            prompt = system[:shared] + [rnd.randrange(vocab) for _ in range(n - shared)]
        out.append(TraceRequest(float(r["arrival_s"]), prompt, int(r["output_tokens"]), shared))
    return sorted(out, key=lambda q: q.arrival_s)


def synthetic_trace(
    requests: int, vocab: int, *, prompt_lo: int, prompt_hi: int, output: int, shared_prefix: int,
    shared_share: float, rate: float, seed: int = 0,
) -> list[TraceRequest]:
    """``requests`` Poisson arrivals at ``rate`` a second (0: all at once), prompts uniform
    in ``prompt_lo..prompt_hi``; a ``shared_share`` of them open with a common
    ``shared_prefix``-token system prompt."""
    rnd = random.Random(seed)
    system = [rnd.randrange(vocab) for _ in range(shared_prefix)]
    t, out = 0.0, []
    for _ in range(requests):
        shared = shared_prefix if shared_prefix and rnd.random() < shared_share else 0
        n = rnd.randint(prompt_lo, prompt_hi)
        out.append(TraceRequest(t, system[:shared] + [rnd.randrange(vocab) for _ in range(n)], output, shared))
        if rate > 0:
            t += rnd.expovariate(rate)
    return out


def save_trace(trace: list[TraceRequest], path: str) -> None:
    """Writes ``trace`` as JSONL that ``kvvm simulate --trace`` reads (token ids)."""
    with open(path, "w") as f:
        for q in trace:
            f.write(json.dumps({"arrival_s": q.arrival_s, "token_ids": q.prompt, "output_tokens": q.output_tokens}) + "\n")


def simulate_prediction(
    kvvm_bin: str, trace_path: str, model: str, step_ms: float, budget_bytes: int | None = None
) -> dict[str, Any]:
    """What ``kvvm simulate`` predicts for the trace under kvvm's token-major layout with
    prefix sharing: its peak and mean committed KV bytes (and its step, the simulator's clock).
    ``budget_bytes``: the engine's budget (the simulator's default of 8 GiB otherwise, which
    holds back admissions an engine with more memory makes)."""
    import subprocess

    cmd = [kvvm_bin, "simulate", "--trace", trace_path, "--json", "--backend", "sim", "--model", model,
           "--policies", "kvvm-token-major+prefix", "--step-ms", str(max(1, round(step_ms)))]
    if budget_bytes:
        cmd += ["--budget-bytes", str(budget_bytes)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-300:]}
    p = json.loads(out.stdout)["policies"][0]
    return {
        "peak_committed_bytes": p["peak_committed_bytes"],
        "mean_committed_bytes": p["mean_committed_bytes"],
        "completed": p["completed"],
        "step_ms": step_ms,
        "budget_bytes": budget_bytes,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_start(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_reserved(device)


def _peak(device: torch.device, base: int) -> int | None:
    return torch.cuda.max_memory_reserved(device) - base if device.type == "cuda" else None


@torch.no_grad()
def run_engine(
    model: Any, trace: list[TraceRequest], *, manager: Manager, slots: int, max_len: int,
    prefix_cache_bytes: int, prefill_chunk: int, real_time: bool, bandwidth: float, flops: float,
    fuse_projections: bool = False, engine_kwargs: dict[str, Any] | None = None,
) -> ServeResult:
    """The trace through :class:`~kvvm.engine.Engine` (made with ``engine_kwargs`` too)."""
    res = ServeResult("kvvm-engine")
    device = next(model.parameters()).device
    memory_before = _device_memory(device, "before")
    engine = Engine(
        model, slots=slots, max_len=max_len, manager=manager, prefill_chunk=prefill_chunk,
        prefix_cache_bytes=prefix_cache_bytes, eos_token_ids=[], fuse_projections=fuse_projections,
        **(engine_kwargs or {}),
    )
    # Compiled and captured before the trace, on prompts of the trace's median length.
    engine.warmup(prompt_tokens=min(max_len - 8, max(1, int(statistics.median(len(q.prompt) for q in trace)))))
    per_token = engine.cache.geometry.bytes_per_token
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    base = _peak_start(device)
    pending = list(trace)
    handles: list[Any] = []
    submitted: list[float] = []
    stamps: list[list[float]] = []
    floor = 2 * sum(p.numel() for p in model.parameters()) * sum(len(q.prompt) for q in trace) / flops
    peak_kv = 0
    start = time.perf_counter()
    while pending or not engine.idle:
        now = time.perf_counter() - start
        while pending and (not real_time or pending[0].arrival_s <= now):
            q = pending.pop(0)
            handles.append(engine.submit(q.prompt, q.output_tokens))
            submitted.append(time.perf_counter())
            stamps.append([])
        if engine.idle:
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        decoding = [r for r in engine.running.values() if r.prefilled]
        engine.step()
        t = time.perf_counter()
        live = sum(len(r.prompt) + len(r.tokens) - r.prefix_hit_tokens for r in decoding)
        floor += (weights + per_token * live) / bandwidth if decoding else 0.0
        for h, st in zip(handles, stamps, strict=True):
            st.extend([t] * (len(h.tokens) - len(st)))
        snap = manager.snapshot()
        held = snap.committed + snap.shared
        peak_kv = max(peak_kv, held)
        res.kv_bytes_over_time.append((round(t - start, 4), held))
    _sync(device)
    res.wall_s = time.perf_counter() - start
    res.outputs = [h.tokens for h in handles]
    res.generated_tokens = sum(len(o) for o in res.outputs)
    res.tokens_per_s = round(res.generated_tokens / res.wall_s, 1)
    res.ttft_ms = percentiles([(st[0] - s) * 1000 for s, st in zip(submitted, stamps, strict=True) if st])
    res.itl_ms = percentiles([(b - a) * 1000 for st in stamps for a, b in zip(st, st[1:]) if b > a])
    peak = _peak(device, base)
    res.peak_gpu_bytes = None if peak is None else peak + peak_kv
    res.prefix_hits = engine.stats.prefix_hits
    res.prefix_waits = engine.stats.prefix_waits
    res.preemptions = engine.stats.preempted
    res.preempted_requests = sum(1 for h in handles if h.preemptions)
    if engine.swapper is not None:
        es = engine.stats
        res.swaps = {
            "swapped_out": es.swapped_out, "swapped_in": es.swapped_in, "fallbacks": es.swap_fallbacks,
            "out_ms": round(es.swap_out_ms, 3), "in_ms": round(es.swap_in_ms, 3),
            **engine.swapper.costs.as_dict(),
        }
    res.engine_steps = {
        k: getattr(engine.stats, k)
        for k in ("steps", "decode_steps", "prefill_forwards", "prefill_chunks", "admission_refusals")
    }
    res.floor_s = floor
    engine.close()  # the model attends as before the engine again
    res.after = _held_after(manager, device, memory_before)
    return res


def _device_memory(device: torch.device, when: str) -> dict[str, int]:
    """The driver's free bytes and torch's reserved bytes now (on a GPU; nothing on a CPU)."""
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    return {f"driver_free_{when}": int(free), f"torch_reserved_{when}": int(torch.cuda.memory_reserved(device))}


def _held_after(manager: Manager, device: torch.device, before: dict[str, int]) -> dict[str, int]:
    """The manager's books after the engine closed and after its pool was emptied, with the
    device's memory before and now (see :attr:`ServeResult.after`)."""
    snap = manager.snapshot()
    out = {
        "committed": snap.committed, "shared": snap.shared, "pooled": snap.pooled, "quarantined": snap.quarantined,
    }
    manager.trim_pool(0)
    out["pooled_after_trim"] = manager.snapshot().pooled
    return {**out, **before, **_device_memory(device, "after")}


@torch.no_grad()
def run_padded(model: Any, trace: list[TraceRequest], *, batch: int) -> ServeResult:
    """The trace in arrival order as padded ``generate()`` batches of ``batch`` requests with
    ``DynamicCache`` (each batch generates its longest output)."""
    res = ServeResult("padded-dynamic")
    device = next(model.parameters()).device
    use_kvvm_attention(model, enable=False)
    base = _peak_start(device)
    ttft, itl = [], []
    start = time.perf_counter()
    for i in range(0, len(trace), batch):
        group = trace[i : i + batch]
        longest = max(len(q.prompt) for q in group)
        ids = torch.zeros((len(group), longest), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for j, q in enumerate(group):
            ids[j, longest - len(q.prompt) :] = torch.tensor(q.prompt, device=device)
            mask[j, longest - len(q.prompt) :] = 1
        marks: list[float] = []

        def stamp(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            marks.append(time.perf_counter())
            return scores

        from transformers import LogitsProcessorList

        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max(q.output_tokens for q in group), do_sample=False,
            logits_processor=LogitsProcessorList([stamp]), pad_token_id=0,
        )
        _sync(device)
        ttft += [(marks[0] - start) * 1000] * len(group)
        itl += [(b - a) * 1000 for a, b in zip(marks, marks[1:])]
        for j, q in enumerate(group):
            res.outputs.append(out[j, longest : longest + q.output_tokens].tolist())
    res.wall_s = time.perf_counter() - start
    res.generated_tokens = sum(len(o) for o in res.outputs)
    res.tokens_per_s = round(res.generated_tokens / res.wall_s, 1)
    res.ttft_ms, res.itl_ms = percentiles(ttft), percentiles(itl)
    res.peak_gpu_bytes = _peak(device, base)
    return res


@torch.no_grad()
def run_generate_batch(
    model: Any, trace: list[TraceRequest], *, memory_fraction: float | None, cpu_offload_gib: float = 0.0
) -> ServeResult:
    """The trace through transformers' ``generate_batch`` (every request at the start); with
    ``cpu_offload_gib``, its evicted blocks are copied to that much pinned host memory and back
    (``cpu_offload_space``) instead of recomputed."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    label = "generate_batch" + ("" if memory_fraction is None else f"@{memory_fraction:.3f}")
    label += f"+offload{cpu_offload_gib:g}GiB" if cpu_offload_gib else ""
    res = ServeResult(label)
    device = next(model.parameters()).device
    use_kvvm_attention(model, enable=False)
    config = ContinuousBatchingConfig(max_memory_percent=memory_fraction, cpu_offload_space=cpu_offload_gib)
    try:
        # Its CUDA graphs and compiled kernels are made on a first call: made before the trace.
        model.generate_batch(
            inputs=[q.prompt for q in trace[:2]],
            generation_config=GenerationConfig(max_new_tokens=4, do_sample=False),
            continuous_batching_config=config,
        )
    except Exception as e:  # noqa: BLE001 - a runner that cannot run is reported, and fails the run
        res.note, res.failed = f"{type(e).__name__}: {e}"[:300], True
        return res
    base = _peak_start(device)
    start = time.perf_counter()
    try:
        outs = model.generate_batch(
            inputs=[q.prompt for q in trace],
            generation_config=GenerationConfig(max_new_tokens=max(q.output_tokens for q in trace), do_sample=False),
            continuous_batching_config=config,
            record_timestamps=True,
        )
    except Exception as e:  # noqa: BLE001 - a runner that cannot run is reported, and fails the run
        res.note, res.failed = f"{type(e).__name__}: {e}"[:300], True
        return res
    _sync(device)
    res.wall_s = time.perf_counter() - start
    ordered = [outs[k] for k in sorted(outs, key=lambda k: int(str(k).split("_")[-1]) if str(k).split("_")[-1].isdigit() else 0)]
    ttft, itl = [], []
    for q, o in zip(trace, ordered, strict=False):
        res.outputs.append(list(o.generated_tokens)[: q.output_tokens])
        ts = o.timestamps or []
        if ts:
            ttft.append((ts[0] - start) * 1000)
            itl += [(b - a) * 1000 for a, b in zip(ts, ts[1:])]
    res.generated_tokens = sum(len(o) for o in res.outputs)
    res.tokens_per_s = round(res.generated_tokens / max(res.wall_s, 1e-9), 1)
    res.ttft_ms, res.itl_ms = percentiles(ttft), percentiles(itl)
    res.peak_gpu_bytes = _peak(device, base)
    return res


@torch.no_grad()
def reference_check(model: Any, trace: list[TraceRequest], outputs: list[list[int]]) -> dict[str, Any]:
    """Each request's greedy tokens against a one-request-at-a-time ``DynamicCache`` reference,
    teacher-forced: one forward of the request's prompt and its own tokens gives the
    reference's logits at every generated position, so one early difference does not hide
    the rest. A token agrees when the reference ranks it first, or when its reference logit is
    within bf16's resolution of the first (a tie bf16 cannot order). Returns ``agreement``
    (the share of generated tokens that agree), ``argmax_equal`` (the share equal to the
    reference's argmax), ``clear_checked`` / ``clear_equal`` (positions whose top two are
    further apart than a tie, and how many of them are the argmax) and ``ties``."""
    from transformers import DynamicCache

    use_kvvm_attention(model, enable=False)
    device = next(model.parameters()).device
    total = equal = agree = clear = clear_equal = 0
    for q, out in zip(trace, outputs, strict=False):
        if not out:
            continue
        ids = torch.tensor([q.prompt + out[:-1]], device=device)
        logits = model(
            input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=len(out)
        ).logits[0].float()
        tokens = torch.tensor(out, device=device)
        top2 = logits.topk(2, dim=-1).values
        tie = bf16_tie(top2[:, 0])
        is_max = logits.argmax(-1) == tokens
        near = (top2[:, 0] - logits.gather(-1, tokens[:, None])[:, 0]) <= tie
        is_clear = (top2[:, 0] - top2[:, 1]) > tie
        total += len(out)
        equal += int(is_max.sum())
        agree += int((is_max | near).sum())
        clear += int(is_clear.sum())
        clear_equal += int((is_max & is_clear).sum())
    return {
        "agreement": round(agree / max(total, 1), 4),
        "argmax_equal": round(equal / max(total, 1), 4),
        "tokens": total,
        "clear_checked": clear,
        "clear_equal": clear_equal,
        "ties": total - clear,
    }
