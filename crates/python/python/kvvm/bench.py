"""End-to-end benchmark: a Llama-architecture model generating on kvvm memory.

``python -m kvvm.bench generate`` builds a model from a config with random weights (no
download; the Llama-3.1-8B shape in bf16 with SDPA by default) and runs, side by side in one
process, greedy decoding with ``DynamicCache``, ``StaticCache`` and :class:`KvvmCache`
(seq-major and token-major) at several batch x prompt points, then the shared-prompt case.
For every point it reports:

* correctness: KvvmCache is teacher-forced on DynamicCache's tokens and its per-step logits
  are compared (max |diff|, argmax agreement wherever the top two logits are further apart
  than the bf16 tolerance);
* decode step p50 (CUDA events, after warm-up steps) and tokens/s, and the GPU time per step
  of the kernels that update the cache or run attention (torch profiler, by kernel name);
* memory: KV bytes held at the end of decoding (tensor bytes for DynamicCache, preallocated
  bytes for StaticCache, committed bytes for kvvm), the live KV bytes, and PyTorch's peak
  allocated/reserved memory during decoding (after prefill).

The shared-prompt case prefills a system prompt once into shared memory, attaches it
read-only to N requests and prefills only their suffixes, against DynamicCache prefilling
every full prompt: time to first token of the batch and KV bytes.

``--tiny --device cpu --backend host`` runs the same code on a small model on the CPU (what
the test suite does); the figures that matter come from a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import kvvm
from kvvm.transformers import ATTENTION, KvvmCache, KvvmPrefix, use_kvvm_attention

KV_KERNEL_WORDS = ("flash", "fmha", "attention", "sdpa", "cat", "copy", "index", "repeat")


@dataclass
class RunResult:
    """One cache at one point."""

    cache: str
    batch: int
    prompt: int
    new_tokens: int
    prefill_ms: float
    step_p50_ms: float
    tokens_per_s: float
    kv_gpu_us_per_step: float | None
    kv_bytes_held: int
    kv_bytes_live: int
    peak_allocated_decode: int
    peak_reserved_decode: int
    attention: str = "sdpa"
    kv_bytes_held_before_shrink: int = 0
    kv_peak_bytes_decode: int = 0
    peak_total_decode: int = 0
    max_abs_logit_diff: float | None = None
    argmax_checked: int | None = None
    argmax_disagree: int | None = None
    #: The step p50 of every run of this cache at this point (the first prefilled through the
    #: model, the others seeded); ``step_p50_ms`` is their minimum.
    rounds_p50_ms: list[float] = field(default_factory=list)
    step_p50_median_ms: float = 0.0
    #: The step p50 in the step-interleaved phase (every cache alive at once, one decode step
    #: of each in turn), and its tokens/s; None when that phase did not run for this cache.
    interleaved_p50_ms: float | None = None
    interleaved_tokens_per_s: float | None = None
    notes: list[str] = field(default_factory=list)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timer(dev: torch.device) -> Any:
    if dev.type == "cuda":
        return torch.cuda.Event(enable_timing=True)
    return None


def _build_model(args: argparse.Namespace) -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.tiny:
        cfg = LlamaConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=2048,
            max_position_embeddings=16384,
        )
    else:
        cfg = LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=16384,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        )
    cfg._attn_implementation = "sdpa"
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model, cfg


def _kv_live_bytes(cfg: Any, batch: int, tokens: int, elem: int) -> int:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return batch * tokens * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elem


def _split(kind: str) -> tuple[str, str]:
    """``"kvvm:seq-major@kvvm_sdpa"`` -> (``"kvvm:seq-major"``, ``"kvvm_sdpa"``)."""
    base, _, attn = kind.partition("@")
    return base, attn or "sdpa"


def _make_cache(kind: str, cfg: Any, args: argparse.Namespace, batch: int, total: int) -> Any:
    from transformers import DynamicCache, StaticCache

    if kind == "dynamic":
        return DynamicCache(config=cfg)
    if kind == "static":
        return StaticCache(config=cfg, max_cache_len=total + 1024)
    # "kvvm:LAYOUT" grows through the pre-committer, "kvvm:LAYOUT+inline" commits on the
    # decode path when a step crosses into a new window.
    layout, _, mode = kind.split(":", 1)[1].partition("+")
    return KvvmCache(
        cfg,
        batch,
        total + 1024,
        backend=args.backend,
        layout=layout,
        dtype=args.dtype,
        precommit=mode != "inline",
        headroom_tokens=args.headroom,
    )


def _kv_held(kind: str, cache: Any) -> int:
    if kind.startswith("kvvm"):
        return int(cache.committed_bytes)
    total = 0
    for layer in cache.layers:
        if layer.keys is not None:
            total += layer.keys.numel() * layer.keys.element_size()
            total += layer.values.numel() * layer.values.element_size()
    return total


def _kv_kernel_us(prof: Any, steps: int) -> float:
    total = 0.0
    for evt in prof.key_averages():
        name = evt.key.lower()
        if any(w in name for w in KV_KERNEL_WORDS):
            total += float(getattr(evt, "self_device_time_total", 0.0))
    return total / max(steps, 1)


def _snapshot(cache: Any, prompt: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's prompt K/V after a prefill, copied to host memory (outside PyTorch's
    CUDA memory statistics)."""
    return [
        (layer.keys[:, :, :prompt].to("cpu", copy=True), layer.values[:, :, :prompt].to("cpu", copy=True))
        for layer in cache.layers
    ]


def _seed(cache: Any, seed: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Writes a prefill's K/V into a fresh cache through the cache's own ``update`` (what
    the model's prefill calls), without running the model."""
    for i, (k, v) in enumerate(seed):
        cache.update(k, v, i)


@torch.no_grad()
def run_point(
    model: Any,
    cfg: Any,
    args: argparse.Namespace,
    kind: str,
    ids: torch.Tensor,
    reference: dict[str, Any] | None,
    seed: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[RunResult, dict[str, Any] | None]:
    """Prefill `ids`, then `args.new` greedy steps. The reference cache records its tokens,
    logits and prompt K/V (:func:`_snapshot`); the others are teacher-forced on its tokens and
    compared.

    With ``seed`` (a later round) the prompt's K/V are written from it instead of prefilled
    through the model, every cache (the reference too) is teacher-forced on the reference's
    tokens without comparing logits, and only the decode steps count: a round then costs
    the decode, not the prefill, so more rounds fit and their best step p50 says more."""
    dev = torch.device(args.device)
    batch, prompt = ids.shape
    elem = torch.finfo(getattr(torch, args.dtype)).bits // 8
    label = kind
    kind, attention = _split(kind)
    use_kvvm_attention(model, enable=attention == ATTENTION)
    _sync(dev)
    cache = _make_cache(kind, cfg, args, batch, prompt + args.new)
    pos = torch.arange(prompt, device=dev)
    seeded = seed is not None and reference is not None
    t0 = time.perf_counter()
    if seeded:
        assert seed is not None and reference is not None
        _seed(cache, seed)
        _sync(dev)
        prefill_ms = (time.perf_counter() - t0) * 1000
        tok = reference["tokens"][0]
        return _decode(model, cfg, args, label, kind, attention, cache, ids, reference, prefill_ms, tok, elem, seeded)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=pos, logits_to_keep=1)
    _sync(dev)
    prefill_ms = (time.perf_counter() - t0) * 1000
    tok = out.logits[:, -1:].argmax(-1)
    del out
    record = reference is None and label == args.reference
    wants_seed = args.repeat > 1 or args.interleaved_steps > 0
    snap = _snapshot(cache, prompt) if record and wants_seed else None
    res, new_ref = _decode(model, cfg, args, label, kind, attention, cache, ids, reference, prefill_ms, tok, elem, False)
    if new_ref is not None:
        new_ref["seed"] = snap
    return res, new_ref


def _decode(
    model: Any,
    cfg: Any,
    args: argparse.Namespace,
    label: str,
    kind: str,
    attention: str,
    cache: Any,
    ids: torch.Tensor,
    reference: dict[str, Any] | None,
    prefill_ms: float,
    tok: torch.Tensor,
    elem: int,
    seeded: bool,
) -> tuple[RunResult, dict[str, Any] | None]:
    """The timed decode steps of :func:`run_point` after the prompt is in ``cache``."""
    dev = torch.device(args.device)
    batch, prompt = ids.shape
    record = reference is None and label == args.reference
    compare = reference is not None and not seeded
    kv_peak = 0
    # Peaks are taken per step, from just before the step to just after it: the logit
    # comparison between steps is the benchmark's work, not the cache's. kvvm's memory is
    # not PyTorch's: a step's total is PyTorch's peak in the step plus kvvm's committed bytes
    # after it (a decode only grows them, so that bounds every moment of the step).
    peak_alloc = peak_res = peak_total = 0
    is_kv = kind.startswith("kvvm")
    ref_tokens: list[torch.Tensor] = []
    ref_logits: list[torch.Tensor] = []
    steps: list[float] = []
    max_diff = 0.0
    checked = disagree = 0
    for i in range(args.new):
        if reference is not None:
            tok = reference["tokens"][i]
        if record:
            ref_tokens.append(tok)
        p = torch.tensor([prompt + i], device=dev)
        e0, e1 = _timer(dev), _timer(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        w0 = time.perf_counter()
        if e0 is not None:
            e0.record()
        out = model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=p)
        logits = out.logits[:, -1]
        nxt = logits.argmax(-1, keepdim=True)
        if e1 is not None:
            e1.record()
            torch.cuda.synchronize(dev)
            steps.append(e0.elapsed_time(e1))
        else:
            steps.append((time.perf_counter() - w0) * 1000)
        held = _kv_held(kind, cache)
        kv_peak = max(kv_peak, held)
        if dev.type == "cuda":
            step_alloc = torch.cuda.max_memory_allocated(dev)
            peak_alloc = max(peak_alloc, step_alloc)
            peak_res = max(peak_res, torch.cuda.max_memory_reserved(dev))
            peak_total = max(peak_total, step_alloc + (held if is_kv else 0))
        if record:
            ref_logits.append(logits.clone())
        if compare:
            assert reference is not None
            ref = reference["logits"][i].float()
            got = logits.float()
            max_diff = max(max_diff, (ref - got).abs().max().item())
            tol = reference["tol"] * ref.abs().max().item()
            top2 = ref.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
            agree = ref.argmax(-1) == got.argmax(-1)
            checked += int(clear.sum().item())
            disagree += int((clear & ~agree).sum().item())
        tok = nxt
        del out
    kv_us: float | None = None
    if dev.type == "cuda" and args.profile and not seeded:
        # Kernel times of a few more steps, outside the timed ones (the profiler costs time).
        prof_steps = 3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for j in range(prof_steps):
                p = torch.tensor([prompt + args.new + j], device=dev)
                out = model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=p)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                del out
            torch.cuda.synchronize(dev)
        kv_us = _kv_kernel_us(prof, prof_steps)
        # Memory is reported at the end of the timed decode: count the extra tokens out.
        if kind == "dynamic" or kind.startswith("kvvm"):
            cache.crop(-prof_steps)
    steady = sorted(steps[args.warmup :]) or sorted(steps)
    p50 = statistics.median(steady)
    held_before = _kv_held(kind, cache)
    if kind.startswith("kvvm"):
        # Decoding is over: stop the pre-committer and give its headroom past the live tokens
        # back; what stays is what the requests hold.
        cache.manager.stop_precommit()
        cache.shrink()
    held = _kv_held(kind, cache)
    res = RunResult(
        cache=label,
        batch=batch,
        prompt=prompt,
        new_tokens=args.new,
        prefill_ms=round(prefill_ms, 2),
        step_p50_ms=round(p50, 3),
        tokens_per_s=round(batch * 1000 / p50, 1),
        kv_gpu_us_per_step=None if kv_us is None else round(kv_us, 1),
        kv_bytes_held=held,
        kv_bytes_live=_kv_live_bytes(cfg, batch, prompt + args.new, elem),
        peak_allocated_decode=peak_alloc,
        peak_reserved_decode=peak_res,
        attention=attention,
        kv_bytes_held_before_shrink=held_before,
        kv_peak_bytes_decode=kv_peak,
        peak_total_decode=peak_total,
    )
    if compare:
        res.max_abs_logit_diff = max_diff
        res.argmax_checked = checked
        res.argmax_disagree = disagree
    if kind.startswith("kvvm"):
        stats = cache.manager.precommit_stats()
        if stats:
            res.notes.append(
                f"precommit ready {stats['ready']} inline {stats['inline_commits']} "
                f"background {stats['background_commits']}"
            )
        cache.release()
    del cache
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    new_ref = None
    if record:
        new_ref = {"tokens": ref_tokens, "logits": ref_logits, "tol": args.tol}
    return res, new_ref


@torch.no_grad()
def run_shared_prompt(model: Any, cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """N requests sharing a system prompt with private suffixes: kvvm prefix sharing vs
    DynamicCache prefilling every full prompt."""
    from transformers import DynamicCache

    dev = torch.device(args.device)
    n, sys_len, suf = args.shared_requests, args.shared_prompt, args.shared_suffix
    elem = torch.finfo(getattr(torch, args.dtype)).bits // 8
    system = torch.randint(0, cfg.vocab_size, (1, sys_len), device=dev)
    suffix = torch.randint(0, cfg.vocab_size, (n, suf), device=dev)
    full = torch.cat([system.expand(n, -1), suffix], dim=1)
    out: dict[str, Any] = {"requests": n, "system_prompt": sys_len, "suffix": suf}
    # DynamicCache: every request prefills its whole prompt.
    use_kvvm_attention(model, enable=False)
    _sync(dev)
    t0 = time.perf_counter()
    dc = DynamicCache(config=cfg)
    o = model(input_ids=full, past_key_values=dc, use_cache=True, logits_to_keep=1)
    first_dyn = o.logits[:, -1].argmax(-1)
    _sync(dev)
    out["dynamic_ttft_ms"] = round((time.perf_counter() - t0) * 1000, 2)
    out["dynamic_kv_bytes"] = _kv_held("dynamic", dc)
    ref_logits = o.logits[:, -1].float()
    del o, dc
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    use_kvvm_attention(model)
    for layout in args.shared_layouts:
        mgr = kvvm.Manager(args.backend, precommit=True, headroom_tokens=args.headroom)
        total = sys_len + suf + args.new + 1024
        _sync(dev)
        t0 = time.perf_counter()
        prefix = KvvmPrefix.build(
            model, system, manager=mgr, max_cache_len=total, layout=layout, dtype=args.dtype
        )
        _sync(dev)
        t1 = time.perf_counter()
        cache = KvvmCache.from_prefix(prefix, n, total)
        pos = torch.arange(sys_len, sys_len + suf, device=dev)
        o = model(input_ids=suffix, past_key_values=cache, use_cache=True, cache_position=pos, logits_to_keep=1)
        first = o.logits[:, -1].argmax(-1)
        _sync(dev)
        t2 = time.perf_counter()
        snap = mgr.snapshot()
        got = o.logits[:, -1].float()
        key = layout.replace("-", "_")
        out[f"kvvm_{key}_prefix_prefill_ms"] = round((t1 - t0) * 1000, 2)
        out[f"kvvm_{key}_attach_and_suffix_ms"] = round((t2 - t1) * 1000, 2)
        out[f"kvvm_{key}_ttft_cold_ms"] = round((t2 - t0) * 1000, 2)
        out[f"kvvm_{key}_kv_bytes"] = snap.committed + snap.shared
        out[f"kvvm_{key}_shared_bytes"] = snap.shared
        out[f"kvvm_{key}_max_abs_logit_diff"] = (got - ref_logits).abs().max().item()
        out[f"kvvm_{key}_first_token_agree"] = int((first == first_dyn).sum().item())
        out[f"kvvm_{key}_bytes_ratio"] = round((snap.committed + snap.shared) / out["dynamic_kv_bytes"], 4)
        out[f"kvvm_{key}_ttft_speedup_warm"] = round(out["dynamic_ttft_ms"] / max((t2 - t1) * 1000, 1e-6), 2)
        out[f"kvvm_{key}_ttft_speedup_cold"] = round(out["dynamic_ttft_ms"] / max((t2 - t0) * 1000, 1e-6), 2)
        del o
        cache.release()
        prefix.cache.release()
        del cache, prefix
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out["live_kv_bytes_unshared"] = _kv_live_bytes(cfg, n, sys_len + suf, elem)
    use_kvvm_attention(model, enable=False)
    return out


@torch.no_grad()
def run_interleaved(
    model: Any,
    cfg: Any,
    args: argparse.Namespace,
    kinds: list[str],
    ids: torch.Tensor,
    reference: dict[str, Any],
    seed_box: list[list[tuple[torch.Tensor, torch.Tensor]]],
) -> tuple[dict[str, list[float]], list[str]]:
    """Every cache alive at once, seeded with the prompt's K/V, then ``interleaved_steps``
    decode steps of each in turn (the order rotates every step), teacher-forced on the
    reference's tokens: each cache's step times are sampled under the same host conditions,
    a step apart, which runs a few seconds apart are not. Returns the step times per cache
    and notes (a cache that did not fit in memory is left out and named).

    ``seed_box`` holds the one reference to the prompt's K/V: it is emptied once every cache
    is seeded, so that its memory is free while they decode. KvvmCaches are made first and
    StaticCache last: where they do not all fit, a baseline is what is left out."""
    dev = torch.device(args.device)
    batch, prompt = ids.shape
    steps = args.interleaved_steps
    caches: dict[str, Any] = {}
    notes: list[str] = []
    seed = seed_box.pop()
    order = sorted(kinds, key=lambda k: (0 if is_kvvm(k) else 2 if k.startswith("static") else 1))
    for label in order:
        kind, _ = _split(label)
        try:
            cache = _make_cache(kind, cfg, args, batch, prompt + steps)
            _seed(cache, seed)
            if is_kvvm(label):
                # Every cache grows at once here, and PyTorch keeps what it frees: kvvm
                # commits the phase's tokens now (the pre-committer has a decode step's
                # windows ready anyway), so that it is not starved of driver memory later.
                cache._ensure(prompt + steps)
        except (torch.OutOfMemoryError, kvvm.KvvmError) as e:
            notes.append(f"{label} left out of the interleaved phase: {type(e).__name__}")
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            continue
        caches[label] = cache
    del seed
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    times: dict[str, list[float]] = {label: [] for label in caches}
    labels = [k for k in kinds if k in caches]
    tokens = reference["tokens"]
    for i in range(steps):
        labels = [k for k in labels if k in caches]
        shift = i % max(len(labels), 1)
        for label in labels[shift:] + labels[:shift]:
            _, attention = _split(label)
            use_kvvm_attention(model, enable=attention == ATTENTION)
            tok = tokens[min(i, len(tokens) - 1)]
            p = torch.tensor([prompt + i], device=dev)
            _sync(dev)
            e0, e1 = _timer(dev), _timer(dev)
            w0 = time.perf_counter()
            if e0 is not None:
                e0.record()
            try:
                out = model(input_ids=tok, past_key_values=caches[label], use_cache=True, cache_position=p)
                out.logits[:, -1].argmax(-1, keepdim=True)
            except (torch.OutOfMemoryError, kvvm.KvvmError) as e:
                # Out of memory with every cache alive: this one leaves the phase (its
                # step times so far are dropped too), the others go on.
                notes.append(f"{label} left the interleaved phase at step {i}: {type(e).__name__}")
                gone = caches.pop(label)
                if is_kvvm(label):
                    gone.release()
                del gone
                times.pop(label, None)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            if e1 is not None:
                e1.record()
                torch.cuda.synchronize(dev)
                times[label].append(e0.elapsed_time(e1))
            else:
                times[label].append((time.perf_counter() - w0) * 1000)
            del out
    for label, cache in caches.items():
        if is_kvvm(label):
            cache.release()
    caches.clear()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return times, notes


def _best_of_rounds(first: RunResult, p50s: list[float]) -> RunResult:
    """The first run's result (correctness, memory, prefill) with the best step p50 of all
    rounds."""
    best = min(p50s)
    res = RunResult(**{**asdict(first), "notes": list(first.notes)})
    res.rounds_p50_ms = list(p50s)
    res.step_p50_ms = best
    res.step_p50_median_ms = round(statistics.median(p50s), 3)
    res.tokens_per_s = round(res.batch * 1000 / best, 1)
    return res


def is_kvvm(label: str) -> bool:
    """Whether a cache label names a KvvmCache."""
    return label.startswith("kvvm")


def _verdict(point: list[RunResult]) -> str:
    """One line per point: the best KvvmCache against the best other cache, by best runs and
    by the median of the rounds' ratios (each round's best kvvm over its best baseline)."""
    kv = [r for r in point if is_kvvm(r.cache)]
    base = [r for r in point if not is_kvvm(r.cache)]
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
    return line


def _opt(x: float | None, digits: int) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _markdown(results: list[RunResult], shared: dict[str, Any] | None, meta: dict[str, Any]) -> str:
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
            f"{r.step_p50_median_ms:.2f} | {r.tokens_per_s:.1f} | {_opt(r.interleaved_p50_ms, 2)} | "
            f"{_opt(r.interleaved_tokens_per_s, 1)} | {kv} | {_fmt_bytes(r.kv_bytes_held)} | {_fmt_bytes(r.kv_bytes_live)} | "
            f"{_fmt_bytes(r.peak_allocated_decode)} | {_fmt_bytes(r.peak_total_decode)} | "
            f"{_fmt_bytes(r.peak_reserved_decode)} | {diff} | {agree} |"
        )
    points: dict[tuple[int, int], list[RunResult]] = {}
    for r in results:
        points.setdefault((r.batch, r.prompt), []).append(r)
    verdicts = [v for v in (_verdict(p) for p in points.values()) if v]
    if verdicts:
        lines += [""] + [f"- {v}" for v in verdicts]
    if shared:
        lines += ["", "shared prompt: " + json.dumps(shared)]
    return "\n".join(lines)


def _parse_points(text: str) -> list[tuple[int, int]]:
    pts = []
    for part in text.split(","):
        b, s = part.lower().split("x")
        pts.append((int(b), int(s)))
    return pts


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m kvvm.bench``."""
    ap = argparse.ArgumentParser(prog="python -m kvvm.bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="DynamicCache vs StaticCache vs KvvmCache on a Llama model")
    g.add_argument("--points", default="1x4096,16x2048,16x4096,64x2048", help="batch x prompt list")
    g.add_argument("--new", type=int, default=48, help="new tokens per point (>= 48 for the report)")
    g.add_argument("--warmup", type=int, default=4, help="decode steps left out of the p50")
    g.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="runs per cache and point, interleaved (the first prefills, the others start from "
        "the reference's prompt K/V; the best step p50 is kept)",
    )
    g.add_argument(
        "--interleaved-steps",
        type=int,
        default=0,
        help="after the rounds, decode this many steps with every cache alive at once, one step "
        "of each in turn (0: not run); their p50 is compared too",
    )
    g.add_argument(
        "--static-repeat",
        type=int,
        default=None,
        help="runs of StaticCache per point (default: --repeat; its decode is the slowest)",
    )
    g.add_argument(
        "--caches",
        default=f"dynamic,static,dynamic@{ATTENTION},kvvm:seq-major@{ATTENTION},kvvm:token-major@{ATTENTION}",
        help="caches to compare; '@kvvm_sdpa' runs one with kvvm's attention registration",
    )
    g.add_argument(
        "--reference",
        default="dynamic",
        help="the cache whose tokens and logits the others are checked against",
    )
    g.add_argument("--device", default="cuda")
    g.add_argument("--backend", default="auto", help="kvvm backend (cuda on a GPU, host on a CPU)")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--tiny", action="store_true", help="a small model (for tests on the CPU)")
    g.add_argument("--tol", type=float, default=2.0**-7, help="relative logit tolerance (bf16)")
    g.add_argument("--headroom", type=int, default=4, help="pre-commit headroom tokens (KvvmCache's default)")
    g.add_argument("--no-profile", dest="profile", action="store_false")
    g.add_argument("--shared-requests", type=int, default=16)
    g.add_argument("--shared-prompt", type=int, default=4096)
    g.add_argument("--shared-suffix", type=int, default=128)
    g.add_argument("--shared-layouts", default="token-major,seq-major")
    g.add_argument("--no-shared", dest="shared", action="store_false")
    g.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    args.shared_layouts = [s for s in args.shared_layouts.split(",") if s]
    if args.static_repeat is None:
        args.static_repeat = args.repeat
    if args.repeat < 1 or args.static_repeat < 1:
        ap.error("--repeat and --static-repeat must be at least 1")
    if args.interleaved_steps and args.interleaved_steps <= args.warmup:
        ap.error("--interleaved-steps must exceed --warmup")
    if args.new <= args.warmup:
        ap.error("--new must exceed --warmup")
    if args.dtype not in ("bfloat16", "float16", "float32"):
        ap.error("--dtype must be bfloat16, float16 or float32")
    torch.manual_seed(0)
    import transformers

    dev = torch.device(args.device)
    meta: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvvm": kvvm.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    }
    if dev.type == "cuda":
        meta["driver"] = kvvm.Backend(args.backend).devices()[0].get("driver_version", "?")
    t0 = time.perf_counter()
    model, cfg = _build_model(args)
    print(f"model built in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    kinds = [k for k in args.caches.split(",") if k]
    results: list[RunResult] = []
    for batch, prompt in _parse_points(args.points):
        ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=dev)
        reference = None
        first: dict[str, RunResult] = {}
        rounds: dict[str, list[float]] = {}
        seed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # Every cache runs `repeat` times, interleaved, in a rotating order; the first run of
        # each prefills through the model (correctness, memory, prefill time and the profile
        # come from it), the later ones start from the reference's prompt K/V. Each cache's
        # best step p50 is kept: host noise between runs is larger than the differences
        # measured, and the best run is the one least disturbed.
        for r in range(args.repeat):
            order = [args.reference] if args.reference in kinds else []
            order += [k for k in kinds if k != args.reference]
            if r > 0:
                shift = r % len(order)
                order = order[shift:] + order[:shift]
                if seed is None and reference is not None and reference.get("seed") is not None:
                    seed = [(k.to(dev), v.to(dev)) for k, v in reference.pop("seed")]
            for kind in order:
                if r >= args.static_repeat and kind.startswith("static"):
                    continue
                ref: dict[str, Any] | None = reference
                if r == 0 and (kind == args.reference or kind.startswith("static")):
                    ref = None
                try:
                    res, ref_new = run_point(model, cfg, args, kind, ids, ref, seed if r > 0 else None)
                except torch.OutOfMemoryError as e:
                    print(f"{kind} {batch}x{prompt}: out of memory: {e}", file=sys.stderr)
                    torch.cuda.empty_cache()
                    continue
                reference = reference or ref_new
                first.setdefault(kind, res)
                rounds.setdefault(kind, []).append(res.step_p50_ms)
                print(json.dumps({"round": r, **asdict(res)}), file=sys.stderr, flush=True)
        point = [_best_of_rounds(first[k], rounds[k]) for k in kinds if k in first]
        if args.interleaved_steps > 0 and reference is not None:
            if seed is None and reference.get("seed") is not None:
                seed = [(k.to(dev), v.to(dev)) for k, v in reference.pop("seed")]
            if seed is not None:
                present = [k for k in kinds if k in first]
                box = [seed]
                seed = None
                times, notes = run_interleaved(model, cfg, args, present, ids, reference, box)
                for res in point:
                    t = times.get(res.cache)
                    if t:
                        steady = t[args.warmup :] or t
                        p50 = statistics.median(steady)
                        res.interleaved_p50_ms = round(p50, 3)
                        res.interleaved_tokens_per_s = round(res.batch * 1000 / p50, 1)
                    res.notes.extend(notes)
                print(json.dumps({"interleaved": {k: statistics.median(v[args.warmup :] or v) for k, v in times.items()}, "notes": notes}), file=sys.stderr, flush=True)
        results.extend(point)
        print(_verdict(point), file=sys.stderr, flush=True)
        del reference, seed
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    shared = run_shared_prompt(model, cfg, args) if args.shared else None
    print(_markdown(results, shared, meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": [asdict(r) for r in results], "shared": shared}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
