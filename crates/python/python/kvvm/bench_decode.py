"""The timed decode of ``python -m kvvm.bench generate``: one cache at one point (prefilled
through the model, or seeded from the reference's prompt K/V), and the step-interleaved
phase with every cache alive at once."""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

import kvvm
from kvvm import bench_caches as bc
from kvvm.transformers import ATTENTION, use_kvvm_attention

@torch.no_grad()
def run_point(
    model: Any,
    cfg: Any,
    args: argparse.Namespace,
    kind: str,
    ids: torch.Tensor,
    reference: dict[str, Any] | None,
    seed: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[bc.RunResult, dict[str, Any] | None]:
    """Prefill `ids`, then `args.new` greedy steps. The reference cache records its tokens,
    logits and prompt K/V (:func:`snapshot`); the others are teacher-forced on its tokens and
    compared.

    With ``seed`` (a later round) the prompt's K/V are written from it instead of prefilled
    through the model, every cache (the reference too) is teacher-forced on the reference's
    tokens without comparing logits, and only the decode steps count: a round then costs
    the decode, not the prefill, so more rounds fit and their best step p50 says more."""
    dev = torch.device(args.device)
    batch, prompt = ids.shape
    elem = torch.finfo(getattr(torch, args.dtype)).bits // 8
    label = kind
    kind, attention = bc.split_kind(kind)
    use_kvvm_attention(model, enable=attention == ATTENTION)
    bc.sync(dev)
    cache = bc.make_cache(kind, cfg, args, batch, prompt + args.new)
    pos = torch.arange(prompt, device=dev)
    seeded = seed is not None and reference is not None
    t0 = time.perf_counter()
    if seeded:
        assert seed is not None and reference is not None
        bc.seed_cache(cache, seed)
        bc.sync(dev)
        prefill_ms = (time.perf_counter() - t0) * 1000
        tok = reference["tokens"][0]
        return _decode(model, cfg, args, label, kind, attention, cache, ids, reference, prefill_ms, tok, elem, seeded)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=pos, logits_to_keep=1)
    bc.sync(dev)
    prefill_ms = (time.perf_counter() - t0) * 1000
    tok = out.logits[:, -1:].argmax(-1)
    del out
    record = reference is None and label == args.reference
    wants_seed = args.repeat > 1 or args.interleaved_steps > 0
    snap = bc.snapshot(cache, prompt) if record and wants_seed else None
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
) -> tuple[bc.RunResult, dict[str, Any] | None]:
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
        e0, e1 = bc.timer(dev), bc.timer(dev)
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
        held = bc.kv_held(kind, cache)
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
        kv_us = bc.kv_kernel_us(prof, prof_steps)
        # Memory is reported at the end of the timed decode: count the extra tokens out.
        if kind == "dynamic" or kind.startswith("kvvm"):
            cache.crop(-prof_steps)
    p50 = bc.steady_p50(steps, args.warmup)
    held_before = bc.kv_held(kind, cache)
    if kind.startswith("kvvm"):
        # Decoding is over: stop the pre-committer and give its headroom past the live tokens
        # back; what stays is what the requests hold.
        cache.manager.stop_precommit()
        cache.shrink()
    held = bc.kv_held(kind, cache)
    res = bc.RunResult(
        cache=label,
        batch=batch,
        prompt=prompt,
        new_tokens=args.new,
        prefill_ms=round(prefill_ms, 2),
        step_p50_ms=round(p50, 3),
        tokens_per_s=round(batch * 1000 / p50, 1),
        kv_gpu_us_per_step=None if kv_us is None else round(kv_us, 1),
        kv_bytes_held=held,
        kv_bytes_live=bc.kv_live_bytes(cfg, batch, prompt + args.new, elem),
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
    order = sorted(kinds, key=lambda k: (0 if bc.is_kvvm(k) else 2 if k.startswith("static") else 1))
    for label in order:
        kind, _ = bc.split_kind(label)
        try:
            cache = bc.make_cache(kind, cfg, args, batch, prompt + steps)
            bc.seed_cache(cache, seed)
            if bc.is_kvvm(label):
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
        for label in bc.rotated(labels, i):
            _, attention = bc.split_kind(label)
            use_kvvm_attention(model, enable=attention == ATTENTION)
            tok = tokens[min(i, len(tokens) - 1)]
            p = torch.tensor([prompt + i], device=dev)
            bc.sync(dev)
            e0, e1 = bc.timer(dev), bc.timer(dev)
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
                if bc.is_kvvm(label):
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
        if bc.is_kvvm(label):
            cache.release()
    caches.clear()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return times, notes
