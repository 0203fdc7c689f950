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
import json
import sys
import time
from dataclasses import asdict
from typing import Any

import torch

import kvvm
from kvvm import bench_caches as bc
from kvvm import bench_decode as decode
from kvvm import bench_report as report
from kvvm.transformers import ATTENTION, KvvmCache, KvvmPrefix, use_kvvm_attention

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
    bc.sync(dev)
    t0 = time.perf_counter()
    dc = DynamicCache(config=cfg)
    o = model(input_ids=full, past_key_values=dc, use_cache=True, logits_to_keep=1)
    first_dyn = o.logits[:, -1].argmax(-1)
    bc.sync(dev)
    out["dynamic_ttft_ms"] = round((time.perf_counter() - t0) * 1000, 2)
    out["dynamic_kv_bytes"] = bc.kv_held("dynamic", dc)
    ref_logits = o.logits[:, -1].float()
    del o, dc
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    use_kvvm_attention(model)
    for layout in args.shared_layouts:
        mgr = kvvm.Manager(args.backend, precommit=True, headroom_tokens=args.headroom)
        total = sys_len + suf + args.new + 1024
        bc.sync(dev)
        t0 = time.perf_counter()
        prefix = KvvmPrefix.build(
            model, system, manager=mgr, max_cache_len=total, layout=layout, dtype=args.dtype
        )
        bc.sync(dev)
        t1 = time.perf_counter()
        cache = KvvmCache.from_prefix(prefix, n, total)
        pos = torch.arange(sys_len, sys_len + suf, device=dev)
        o = model(input_ids=suffix, past_key_values=cache, use_cache=True, cache_position=pos, logits_to_keep=1)
        first = o.logits[:, -1].argmax(-1)
        bc.sync(dev)
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
    out["live_kv_bytes_unshared"] = bc.kv_live_bytes(cfg, n, sys_len + suf, elem)
    use_kvvm_attention(model, enable=False)
    return out


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
        default=100,
        help="after the rounds, decode this many steps with every cache alive at once, one step "
        "of each in turn (0: not run); their p50 is compared too (default 100)",
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
        "warmup": args.warmup,
    }
    if dev.type == "cuda":
        meta["driver"] = kvvm.Backend(args.backend).devices()[0].get("driver_version", "?")
    t0 = time.perf_counter()
    model, cfg = _build_model(args)
    print(f"model built in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    kinds = [k for k in args.caches.split(",") if k]
    results: list[bc.RunResult] = []
    for batch, prompt in _parse_points(args.points):
        ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=dev)
        reference = None
        first: dict[str, bc.RunResult] = {}
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
                order = bc.rotated(order, r)
                if seed is None and reference is not None:
                    seed = bc.device_seed(reference, dev)
            for kind in order:
                if r >= args.static_repeat and kind.startswith("static"):
                    continue
                ref: dict[str, Any] | None = reference
                if r == 0 and (kind == args.reference or kind.startswith("static")):
                    ref = None
                try:
                    res, ref_new = decode.run_point(model, cfg, args, kind, ids, ref, seed if r > 0 else None)
                except torch.OutOfMemoryError as e:
                    print(f"{kind} {batch}x{prompt}: out of memory: {e}", file=sys.stderr)
                    torch.cuda.empty_cache()
                    continue
                reference = reference or ref_new
                first.setdefault(kind, res)
                rounds.setdefault(kind, []).append(res.step_p50_ms)
                print(json.dumps({"round": r, **asdict(res)}), file=sys.stderr, flush=True)
        point = [report.best_of_rounds(first[k], rounds[k]) for k in kinds if k in first]
        if args.interleaved_steps > 0 and reference is not None:
            if seed is None:
                seed = bc.device_seed(reference, dev)
            if seed is not None:
                present = [k for k in kinds if k in first]
                box = [seed]
                seed = None
                times, notes = decode.run_interleaved(model, cfg, args, present, ids, reference, box)
                for res in point:
                    t = times.get(res.cache)
                    if t:
                        p50 = bc.steady_p50(t, args.warmup)
                        res.interleaved_p50_ms = round(p50, 3)
                        res.interleaved_tokens_per_s = round(res.batch * 1000 / p50, 1)
                        res.interleaved_steps_ms = [round(x, 4) for x in t]
                    res.notes.extend(notes)
                print(json.dumps({"interleaved": {k: bc.steady_p50(v, args.warmup) for k, v in times.items()}, "notes": notes}), file=sys.stderr, flush=True)
        results.extend(point)
        print(report.verdict(point, args.warmup), file=sys.stderr, flush=True)
        del reference, seed
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    shared = run_shared_prompt(model, cfg, args) if args.shared else None
    print(report.markdown(results, shared, meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": [asdict(r) for r in results], "shared": shared}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
