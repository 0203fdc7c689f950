"""The decode runs ``python -m kvvm_bench generate`` times, one cache each, and what it
measures of them.

- ``static``: transformers' ``StaticCache`` through ``generate`` (its own auto-compile of
  the decode step, CUDA graphs), padded to the longest request;
- ``dynamic``: ``DynamicCache`` through ``generate``, eager;
- ``kvvm-eager``: :class:`~kvvm.transformers.KvvmCache` with the kvvm attention through
  ``generate`` with compilation disabled;
- ``kvvm-generate``: the same, compiled by ``generate`` itself (CUDA graphs);
- ``kvvm-graph``: every request prefilled into its own slot (no padding), then a
  :class:`~kvvm.graph.DecodeGraph` replayed once per step;
- ``kvvm-graph-fused``: the same with the model's sibling projections fused
  (:func:`kvvm.transformers.projections.fuse_projections`: Q, K and V as one matrix multiply, gate and up
  as one), restored afterwards;
- ``kvvm-graph-tuned``: the same with the products run through kvvm's tuned skinny products as
  well (:func:`kvvm.transformers.tuned_products`: cuBLAS or kvvm's Triton kernel, whichever
  was measured faster for each weight's shape), restored afterwards;
- ``kvvm-graph-pdl``: the same with the step's kernels (kvvm's and the compiler's, compiled
  afresh) launched as programmatic dependents
  (:func:`kvvm.kernels.device.programmatic_launches`).

Each step is timed on the GPU: an event per step (from a logits processor inside
``generate``, around each replay otherwise), so a step's time includes whatever host work
the loop does that the GPU waits for.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import kvvm
from kvvm.transformers import use_kvvm_attention
from kvvm.graph import DecodeGraph
from kvvm.kernels.device import programmatic_launches
from kvvm.transformers.projections import fuse_projections
from kvvm.transformers.products import tuned_products
from kvvm.transformers import KvvmCache
from kvvm_bench.numerics import bf16_tie, tensor_bytes

__all__ = ["CACHES", "Run", "Workload", "run_cache", "reference_check"]

#: The caches a run can use.
CACHES = (
    "static", "dynamic", "kvvm-eager", "kvvm-generate", "kvvm-graph", "kvvm-graph-fused", "kvvm-graph-tuned",
    "kvvm-graph-pdl",
)


@dataclass
class Workload:
    """One point: ``prompts`` (one id tensor ``[1, P]`` each) and ``new`` tokens each."""

    label: str
    prompts: list[torch.Tensor]
    new: int

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def lengths(self) -> list[int]:
        return [int(p.shape[1]) for p in self.prompts]

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts left-padded to the longest, and their attention mask."""
        longest = max(self.lengths)
        ids = torch.zeros((self.batch, longest), dtype=torch.long, device=self.prompts[0].device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(self.prompts):
            ids[i, longest - p.shape[1] :] = p[0]
            mask[i, longest - p.shape[1] :] = 1
        return ids, mask


@dataclass
class Run:
    """What one cache did at one point."""

    cache: str
    point: str
    batch: int
    step_ms: list[float] = field(default_factory=list)
    p50_ms: float | None = None
    p99_ms: float | None = None
    tokens_per_s: float | None = None
    floor_ms: float | None = None
    over_floor: float | None = None
    floor_measured_ms: float | None = None
    over_measured_floor: float | None = None
    #: The floor of the bytes a step reads (``floor_ms`` less the embedding rows it does not
    #: look up: :func:`kvvm_bench.model.unread_weight_bytes`).
    floor_read_ms: float | None = None
    over_floor_read: float | None = None
    kv_bytes_held: int | None = None
    live_kv_bytes: int | None = None
    peak_gpu_bytes: int | None = None
    tokens: list[list[int]] | None = None
    #: GPU time per step by kind of kernel, in ms (``--profile``; see :func:`kernel_breakdown`).
    kernels_ms: dict[str, Any] | None = None
    note: str = ""

    def settle(self, warmup: int) -> None:
        """p50/p99 over the steps after ``warmup`` and tokens/s at the p50."""
        steps = self.step_ms[warmup:] or self.step_ms
        if steps:
            ordered = sorted(steps)
            self.p50_ms = round(statistics.median(ordered), 3)
            self.p99_ms = round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3)
            self.tokens_per_s = round(self.batch * 1000 / self.p50_ms, 1)


class _StepClock:
    """A logits processor that records a CUDA event at every step of ``generate``."""

    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.events.append(e)
        return scores

    def steps_ms(self) -> list[float]:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _kv_bytes(cache: Any) -> int:
    if isinstance(cache, KvvmCache):
        return cache.held_bytes
    return tensor_bytes(cache)


def _generate(model: Any, w: Workload, cache_kind: str, manager: kvvm.Manager | None, max_len: int) -> Run:
    from transformers import DynamicCache, LogitsProcessorList

    run = Run(cache_kind, w.label, w.batch)
    ids, mask = w.padded()
    kwargs: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=w.new, do_sample=False, min_new_tokens=w.new)
    use_kvvm_attention(model, enable=cache_kind.startswith("kvvm"))
    cache: Any = None
    if cache_kind == "static":
        kwargs["cache_implementation"] = "static"
        kwargs["return_dict_in_generate"] = True
    elif cache_kind == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = KvvmCache(model.config, w.batch, max_len, manager=manager)
        if cache_kind == "kvvm-eager":
            kwargs["disable_compile"] = True
    if cache is not None:
        kwargs["past_key_values"] = cache
    clock = _StepClock()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    out = model.generate(ids, logits_processor=LogitsProcessorList([clock]), **kwargs)
    run.step_ms = [round(x, 4) for x in clock.steps_ms()]
    run.peak_gpu_bytes = torch.cuda.max_memory_reserved() - base
    if cache_kind == "static":
        cache = out.past_key_values
        out = out.sequences
    run.kv_bytes_held = _kv_bytes(cache)
    if isinstance(cache, KvvmCache):
        run.peak_gpu_bytes += cache.manager.snapshot().committed
    run.tokens = out[:, ids.shape[1] :].tolist()
    if isinstance(cache, KvvmCache):
        cache.release()
    del cache, out
    use_kvvm_attention(model, enable=False)
    _free()
    return run


@torch.no_grad()
def _graph(
    model: Any, w: Workload, manager: kvvm.Manager, max_len: int, mode: str | None = None, profile: bool = False,
    fuse: bool = False,
    tune: bool = False,
    pdl: bool = False,
) -> Run:
    kind = "kvvm-graph-pdl" if pdl else "kvvm-graph-tuned" if tune else "kvvm-graph-fused" if fuse else "kvvm-graph"
    run = Run(kind, w.label, w.batch)
    use_kvvm_attention(model)
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    cache = KvvmCache(model.config, w.batch, max_len, manager=manager)
    first = torch.empty(w.batch, dtype=torch.long, device=w.prompts[0].device)
    for slot, prompt in enumerate(w.prompts):
        with cache.select(slot):
            logits = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        first[slot] = logits[0, -1].argmax()
        del logits
    fused = fuse_projections(model) if fuse or tune or pdl else None
    tuned = tuned_products(model) if tune or pdl else None
    if pdl:
        torch._dynamo.reset()  # the compiler's kernels generated afresh, to launch so
    try:
        with programmatic_launches(pdl):
            step = DecodeGraph(model, cache, mode=mode)
    finally:
        # The captured step keeps the modules it traced.
        if tuned is not None:
            tuned.restore()
        if fused is not None:
            fused.restore()
    tokens = [first]
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(w.new)]
    tok = first
    for i in range(w.new - 1):
        marks[i].record()
        tok = step(tok).argmax(-1)
        tokens.append(tok)
    marks[w.new - 1].record()
    torch.cuda.synchronize()
    cache.check()
    run.step_ms = [round(a.elapsed_time(b), 4) for a, b in zip(marks, marks[1:])]
    run.peak_gpu_bytes = torch.cuda.max_memory_reserved() - base + manager.snapshot().committed
    run.kv_bytes_held = cache.held_bytes
    run.tokens = torch.stack(tokens, dim=1).tolist()
    if profile:
        run.kernels_ms = kernel_breakdown(lambda: step(tok), steps=4)
        cache.check()
    step.close()
    cache.release()
    use_kvvm_attention(model, enable=False)
    _free()
    return run


def run_cache(
    model: Any,
    w: Workload,
    cache_kind: str,
    manager: kvvm.Manager | None,
    max_len: int,
    graph_mode: str | None = None,
    profile: bool = False,
) -> Run:
    """One cache at one point (a failure, such as running out of memory, is a note). The
    manager's handle pool is emptied afterwards: the next run starts from the same memory."""
    try:
        if cache_kind.startswith("kvvm-graph"):
            assert manager is not None
            return _graph(
                model, w, manager, max_len, graph_mode, profile, fuse=cache_kind == "kvvm-graph-fused",
                tune=cache_kind == "kvvm-graph-tuned", pdl=cache_kind == "kvvm-graph-pdl",
            )
        return _generate(model, w, cache_kind, manager, max_len)
    except (torch.OutOfMemoryError, kvvm.KvvmError, RuntimeError) as e:
        use_kvvm_attention(model, enable=False)
        _free()
        return Run(cache_kind, w.label, w.batch, note=f"{type(e).__name__}: {e}"[:300])
    finally:
        if manager is not None:
            manager.trim_pool(0)


@torch.no_grad()
def reference_check(model: Any, w: Workload, manager: kvvm.Manager, max_len: int, steps: int) -> dict[str, Any]:
    """Teacher-forced logits of the captured kvvm step against DynamicCache (each request on
    its own, its exact prompt): max |diff| over ``steps`` steps, and how often the argmax
    agrees where the reference's top two logits are further apart than bf16's resolution."""
    from transformers import DynamicCache

    use_kvvm_attention(model)
    cache = KvvmCache(model.config, w.batch, max_len, manager=manager)
    refs = [DynamicCache(config=model.config) for _ in w.prompts]
    want, got = [], []
    for slot, (prompt, dc) in enumerate(zip(w.prompts, refs, strict=True)):
        with cache.select(slot):
            got.append(model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1])
        use_kvvm_attention(model, enable=False)
        want.append(model(input_ids=prompt, past_key_values=dc, use_cache=True, logits_to_keep=1).logits[:, -1])
        use_kvvm_attention(model)
    # Captured without torch.compile: the check is of kvvm's write and attention, not of the
    # compiler's fusions (which move bf16 logits as much for every cache).
    step = DecodeGraph(model, cache, compile=False)
    worst, agree, checked = 0.0, 0, 0
    ref = torch.cat(want).float()
    out = torch.cat(got).float()
    for i in range(steps + 1):
        worst = max(worst, (out - ref).abs().max().item())
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > bf16_tie(top2[:, 0])
        agree += int(((out.argmax(-1) == ref.argmax(-1)) & clear).sum())
        checked += int(clear.sum())
        if i == steps:
            break
        tok = ref.argmax(-1)
        out = step(tok).float()
        use_kvvm_attention(model, enable=False)
        ref = torch.cat(
            [model(input_ids=tok[j : j + 1, None], past_key_values=dc, use_cache=True).logits[:, -1] for j, dc in enumerate(refs)]
        ).float()
        use_kvvm_attention(model)
    cache.check()
    step.close()
    cache.release()
    use_kvvm_attention(model, enable=False)
    del refs
    _free()
    return {"max_abs_logit_diff": round(worst, 4), "argmax_agree": agree, "argmax_checked": checked}


#: Kernel name fragments by kind, first match wins (cuBLAS and CUTLASS GEMMs, the kvvm
#: attention's Triton kernels and the cascade's prefix pass, Inductor's fused Triton kernels).
_KERNEL_KINDS = (
    ("attention", ("_partial_kernel", "_merge_kernel", "_prefix_kernel", "flash", "fmha")),
    ("matmul", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk", "_product_kernel")),
    ("fused", ("triton_",)),
)


#: Kernels named one by one in :func:`kernel_breakdown`'s ``top``.
_TOP_KERNELS = 12


def kernel_breakdown(step: Any, steps: int) -> dict[str, Any]:
    """GPU time per step of ``step()`` by kind of kernel (``matmul``, ``attention``,
    ``fused``: Inductor's kernels, ``other``), ``kernels``: their sum, ``wall``: the steps'
    time between events, and ``idle``: the difference (launch gaps, waits on the host), all
    in ms, from ``torch.profiler`` over ``steps`` calls; ``launches``: kernels per step, and
    ``launches_<kind>`` of each kind; ``top``: the heaviest kernels, each as its name (cut
    to 80 characters), its ms and its launches per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        begin.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {"matmul": 0.0, "attention": 0.0, "fused": 0.0, "other": 0.0}
    counts: dict[str, int] = dict.fromkeys(kinds, 0)
    named: list[tuple[float, str, float]] = []
    for e in prof.key_averages():
        us = float(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0))
        if us <= 0 or e.key.startswith("ProfilerStep"):
            continue
        name = e.key.lower()
        kind = next((k for k, frags in _KERNEL_KINDS if any(f in name for f in frags)), "other")
        kinds[kind] += us / 1000 / steps
        counts[kind] += int(e.count)
        named.append((us / 1000 / steps, e.key[:80], e.count / steps))
    out: dict[str, Any] = {k: round(v, 4) for k, v in kinds.items()}
    out["kernels"] = round(sum(kinds.values()), 4)
    out["wall"] = round(begin.elapsed_time(end) / steps, 4)
    out["idle"] = round(out["wall"] - out["kernels"], 4)
    out["launches"] = round(sum(counts.values()) / steps, 1)
    for k, n in counts.items():
        out[f"launches_{k}"] = round(n / steps, 1)
    out["top"] = [[name, round(ms, 4), round(n, 1)] for ms, name, n in sorted(named, reverse=True)[:_TOP_KERNELS]]
    return out


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and its wall time in seconds."""
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t
