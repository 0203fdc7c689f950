"""The cascade decode against the plain one (``python -m kvvm_bench cascade``): ``--batch``
requests, each opening with one of ``--groups`` shared prefixes of ``--prefix`` tokens (mapped
read-only into every request's slot, its tail copied) and holding ``--own`` tokens of its own,
decode together through a captured step (:class:`~kvvm.transformers.DecodeGraph`); the same
requests in a second cache without the cascade's tables read each prefix once per request.

For each group count: both steps' p50/p99 over ``--steps`` replays, the speedup, the HBM floor
of a step that reads every weight and each prefix once (the cascade's) and of one that reads it
per request (the plain step's), each step over its floor, and the greedy tokens of both steps
compared (the Llama-3.1-8B shape with random bf16 weights on CUDA; ``--tiny`` a small model;
``--fp32`` in fp32, where every token must agree). The kernel is the Triton one (on a CPU in
Triton's interpreter: ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

import kvvm
from kvvm_bench.model import build_model, product_choices, unread_weight_bytes, weight_bytes
from kvvm_bench.numerics import timed_greedy_steps
from kvvm_bench.report_file import write_report
from kvvm_bench.runs import kernel_breakdown
from kvvm_bench.shapes_step import EagerStep

__all__ = ["add_args", "run_cascade_bench"]


def add_args(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("--batch", type=int, default=64, help="requests decoded together")
    p.add_argument("--prefix", type=int, default=2048, help="tokens of each shared prefix")
    p.add_argument("--own", type=int, default=256, help="each request's own tokens after its prefix")
    p.add_argument("--groups", default="1,4", help="distinct prefixes per batch, comma-separated (each divides --batch)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--check-steps", type=int, default=8, help="greedy steps whose tokens both steps must share")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="HBM bytes/s of the floor (H200: 4.8e12; H100: 3.35e12)")
    p.add_argument("--tiny", action="store_true", help="a small model instead of the Llama-3.1-8B shape")
    p.add_argument("--fp32", action="store_true", help="the model and its K/V in fp32 (where every token must agree)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default="auto", help="kvvm backend (host on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fuse", action="store_true", help="fuse the Q/K/V and gate/up projections first")
    p.add_argument(
        "--tuned-products", action="store_true",
        help="run the model's products through kvvm's tuned skinny products (both steps)",
    )
    p.add_argument(
        "--pdl", action="store_true",
        help="launch the step's kernels (kvvm's and the compiler's) as programmatic dependents (Hopper on)",
    )
    p.add_argument("--profile", action="store_true", help="each captured step's GPU time by kind of kernel, its heaviest kernels")
    p.add_argument(
        "--prefix-splits", type=int, default=0,
        help="splits of each prefix work item for the cascade's tables (a power of two; 0: choose_prefix_splits' choice)",
    )
    p.add_argument(
        "--prefix-rows", type=int, default=0,
        help="query rows a prefix work item takes at most in the cascade's tables (16, 32, 64 or 128; 0: the tables' default)",
    )
    p.add_argument(
        "--prefix-config", type=_prefix_config, default=None,
        help="pin the prefix pass's configuration in the cascade step instead of tuning it: "
             "BLOCK,WARPS,STAGES[,beside|together][,last] (beside: on a second stream; together: in the private "
             "pass's launch; last: launched after the private pass)",
    )
    p.add_argument("--json", help="write the report here")


def _prefix_config(text: str) -> Any:
    """``--prefix-config``'s value as a :class:`~kvvm.kernels.cascade.PrefixConfig`."""
    from kvvm.kernels.cascade import PrefixConfig

    parts = [p.strip() for p in text.split(",")]
    words = set(parts[3:])
    if len(parts) < 3 or not all(p.isdigit() for p in parts[:3]) or not words <= {"beside", "together", "last"}:
        raise argparse.ArgumentTypeError(f"BLOCK,WARPS,STAGES[,beside|together][,last], not {text!r}")
    block, warps, stages = (int(p) for p in parts[:3])
    try:
        return PrefixConfig(block, warps, stages, together="together" in words, prefix_first="last" not in words,
                            concurrent="beside" in words)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from e


def _caches(model: Any, mgr: kvvm.Manager, prefixes: list[Any], args: argparse.Namespace) -> list[Any]:
    """Two caches of ``--batch`` slots, slot ``i`` opening with prefix ``i // (batch / groups)``
    (its whole windows mapped read-only, the rest copied): the first with the cascade's
    tables and each slot's share recorded, the second without."""
    from kvvm.transformers import KvvmCache

    per = args.batch // len(prefixes)
    max_len = args.prefix + args.own + args.check_steps + args.steps + 64
    made = []
    for cascade in (True, False):
        plan = prefixes[0].plan
        batch = kvvm.SequenceBatch(mgr, plan, args.batch + 1, max_len, precommit=mgr.precommit)
        for i in range(args.batch):
            prefixes[i // per].shared.attach(batch[i])
        with _tables_made(args.prefix_splits, args.prefix_rows):
            cache = KvvmCache(
                model, args.batch, max_len, manager=mgr, layout=plan.layout, dtype=plan.geometry.dtype, batch=batch,
                start_tokens=args.prefix, cascade=cascade,
            )
        if cascade:
            for g in range(len(prefixes)):
                cache.share_prefix(range(g * per, (g + 1) * per), g, args.prefix)
        made.append(cache)
    return made


@contextlib.contextmanager
def _tables_made(splits: int, rows: int) -> Iterator[None]:
    """Within the block, caches made with the cascade's tables take ``splits`` splits a prefix
    work item instead of :func:`~kvvm.kernels.cascade.choose_prefix_splits`' choice, and
    items of at most ``rows`` query rows instead of the tables' default (0: the choice, the
    default)."""
    from kvvm.kernels import cascade

    with contextlib.ExitStack() as stack:
        if splits:
            stack.enter_context(mock.patch.object(cascade, "choose_prefix_splits", return_value=splits))
        if rows:
            stack.enter_context(mock.patch.object(cascade, "CascadeTables", functools.partial(cascade.CascadeTables, rows=rows)))
        yield


@torch.no_grad()
def _prefill_own(model: Any, cache: Any, own: torch.Tensor, start: int) -> torch.Tensor:
    """Every request's own tokens after its prefix, in one forward; the logits of the last."""
    pos = torch.arange(start, start + own.shape[1], device=own.device)[None].expand(own.shape[0], -1)
    out = model(input_ids=own, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def _floors(model: Any, args: argparse.Namespace, groups: int, bandwidth: float) -> dict[str, float]:
    """The HBM floors of a step at the timed steps' mean length: every weight, each request's
    own tokens, and each prefix once (the cascade) or once per request (the plain step)."""
    cfg = model.config
    dtype_bytes = next(model.parameters()).element_size()
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * dtype_bytes
    weights = weight_bytes(model)
    own = args.own + args.check_steps + (args.steps + 1) / 2
    once = weights + per_token * (groups * args.prefix + args.batch * own)
    each = weights + per_token * args.batch * (args.prefix + own)
    unread = unread_weight_bytes(model, args.batch)
    return {
        "floor_once_ms": round(once / bandwidth * 1e3, 3), "floor_each_ms": round(each / bandwidth * 1e3, 3),
        "floor_once_read_ms": round((once - unread) / bandwidth * 1e3, 3),
    }


def _in_us(timings: dict[str, list[tuple[Any, float]]]) -> dict[str, list[list[Any]]]:
    """A tuner's timings (configuration, ms) per shape as the report holds them: each
    configuration in words beside its microseconds."""
    return {k: [[str(c), round(ms * 1e3, 1)] for c, ms in t] for k, t in timings.items()}


def _one(model: Any, mgr: kvvm.Manager, args: argparse.Namespace, groups: int) -> dict[str, Any]:
    """Both steps over ``groups`` distinct prefixes: tokens compared, then timed (CUDA)."""
    from kvvm.prefix import KvvmPrefix
    from kvvm.transformers import DecodeGraph

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed + groups)
    max_len = args.prefix + args.own + args.check_steps + args.steps + 64
    prefixes = [
        KvvmPrefix.build(model, torch.randint(0, vocab, (1, args.prefix), generator=gen).to(device), manager=mgr, max_cache_len=max_len)
        for _ in range(groups)
    ]
    own = torch.randint(0, vocab, (args.batch, args.own), generator=gen).to(device)
    caches = _caches(model, mgr, prefixes, args)
    steps: list[Any] = []
    row: dict[str, Any] = {
        "groups": groups, "requests": args.batch, "prefix": args.prefix, "own": args.own,
        "prefix_splits": caches[0].prefix_splits,
        "prefix_rows": caches[0].prefix_rows,
    }
    try:
        firsts = [_prefill_own(model, c, own, args.prefix).argmax(-1) for c in caches]
        cuda = device.type == "cuda"
        steps = [DecodeGraph(model, c) if cuda else EagerStep(model, c) for c in caches]
        tokens: list[list[list[int]]] = [[], []]
        toks = list(firsts)
        for _ in range(args.check_steps):
            toks = [s(t).argmax(-1) for s, t in zip(steps, toks)]
            for out, t in zip(tokens, toks):
                out.append(t.tolist())
        agree = sum(a == b for x, y in zip(*tokens) for a, b in zip(x, y))
        row.update(tokens_compared=args.batch * args.check_steps, tokens_agree=agree)
        if cuda:
            cascade, plain = (timed_greedy_steps(s, t, args.steps) for s, t in zip(steps, toks))
            row.update(_floors(model, args, groups, args.bandwidth))
            row.update(cascade_p50_ms=cascade["p50"], cascade_p99_ms=cascade["p99"], plain_p50_ms=plain["p50"], plain_p99_ms=plain["p99"])
            row["speedup"] = round(plain["p50"] / cascade["p50"], 2)
            row["cascade_over_floor_once"] = round(cascade["p50"] / row["floor_once_ms"], 2)
            row["cascade_over_floor_once_read"] = round(cascade["p50"] / row["floor_once_read_ms"], 2)
            row["plain_over_floor_each"] = round(plain["p50"] / row["floor_each_ms"], 2)
            from kvvm.kernels.cascade_tuning import tuned_prefix_configs, tuned_prefix_timings
            from kvvm.kernels.triton_decode import tuned_configs, tuned_timings

            row["decode_configs"] = {k: str(v) for k, v in tuned_configs().items()}
            row["prefix_configs"] = {k: str(v) for k, v in tuned_prefix_configs().items()}
            # How far apart the tuners found their best candidates (us a call, timed alone).
            row["decode_timings_us"] = _in_us(tuned_timings())
            row["prefix_timings_us"] = _in_us(tuned_prefix_timings())
            if args.profile:
                for name, s, t in zip(("cascade", "plain"), steps, toks):
                    row[f"{name}_profile"] = kernel_breakdown(lambda s=s, t=t: s(t), steps=4)
    finally:
        for s in steps:
            s.close()
        for c in caches:
            c.release()
        del prefixes
    return row


def run_cascade_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every group count of ``--groups`` (see the module); the report is rewritten after each."""
    from kvvm.kernels.cascade_tuning import pinned_prefix_config
    from kvvm.transformers import use_kvvm_attention

    groups = [int(g) for g in args.groups.split(",") if g]
    if any(g < 1 or args.batch % g for g in groups):
        raise SystemExit(f"every group count must divide --batch {args.batch}: {groups}")
    from kvvm.transformers.projections import fuse_projections

    model = build_model(args)
    if args.fp32:
        model = model.float()
    if args.fuse:
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
    name = "a small Llama" if args.tiny else "the Llama-3.1-8B shape"
    report: dict[str, Any] = {
        "model": f"{name}, random {next(model.parameters()).dtype} weights", "fused_projections": args.fuse,
        "tuned_products": args.tuned_products, "pdl": args.pdl, "results": [],
    }
    if args.device == "cuda":
        report["device"] = torch.cuda.get_device_name()
    if args.prefix_config is not None:
        report["prefix_config_pinned"] = str(args.prefix_config)
    with pinned_prefix_config(args.prefix_config):
        for g in groups:
            report["results"].append(_one(model, mgr, args, g))
            report["product_choices"] = product_choices()
            print(report["results"][-1], flush=True)
            write_report(args.json, report)
    return report
