"""``python -m kvvm_bench sampling``: the engine's decode step with sampling on, against greedy.

``--slots`` requests of ``--prompt`` tokens decode together (every slot busy, the captured
step on a GPU); each sampling configuration times ``--steps`` whole engine steps (the
forward, the sampling on the device, the one copy of the tokens back to the host, the
scheduler's update) after ``--warmup`` ones: greedy; temperature alone (the Gumbel-max draw);
top-p with top-k (one sort of the vocabulary); min-p; repetition, presence and frequency
penalties; log-probabilities with the 5 likeliest; all of them. Each line gives p50/p99 in ms
and the p50's ratio to greedy's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import kvvm
from kvvm.serving.params import SamplingParams
from kvvm_bench.report_file import write_report

__all__ = ["CONFIGS", "add_args", "run_sampling_bench"]

#: The configurations timed, by name.
CONFIGS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(),
    "temperature": SamplingParams(temperature=0.8),
    "top-p+top-k": SamplingParams(temperature=0.8, top_p=0.95, top_k=50),
    "min-p": SamplingParams(temperature=0.8, min_p=0.05),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    "logprobs-5": SamplingParams(logprobs=True, top_logprobs=5),
    "all": SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.05, repetition_penalty=1.1,
                          presence_penalty=0.5, frequency_penalty=0.5, logprobs=True, top_logprobs=5),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default="auto", help="kvvm backend (host on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")


def run_sampling_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration's step times; returns the report."""
    from kvvm_bench.cli import _build_model

    import torch

    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)
    try:
        return _bench(args, _build_model(args))
    finally:
        torch.set_num_threads(threads)


def _bench(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    import random

    from kvvm.serving.engine import Engine

    vocab = model.config.vocab_size
    rnd = random.Random(args.seed)
    prompts = [[rnd.randrange(vocab) for _ in range(args.prompt)] for _ in range(args.slots)]
    new = args.warmup + args.steps + 4
    manager = kvvm.Manager(args.backend, precommit=True, headroom_tokens=4)
    engine = Engine(model, slots=args.slots, max_len=args.prompt + new + 16, manager=manager, eos_token_ids=[],
                    prefill_chunk=max(args.prompt, 1))
    engine.warmup(prompt_tokens=args.prompt)
    report: dict[str, Any] = {"slots": args.slots, "prompt": args.prompt, "steps": args.steps, "vocab": vocab, "configs": {}}
    for name in [c for c in args.configs.split(",") if c]:
        params = CONFIGS[name].with_seed(args.seed)
        reqs = [engine.submit(p, new, sampling=params) for p in prompts]
        while not all(r.tokens for r in reqs):
            engine.step()
        times = []
        for _ in range(args.warmup + args.steps):
            t = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t) * 1000)
        for r in reqs:
            engine.cancel(r)
        kept = sorted(times[args.warmup :])
        report["configs"][name] = {"p50_ms": round(statistics.median(kept), 3),
                                   "p99_ms": round(kept[min(len(kept) - 1, int(0.99 * len(kept)))], 3)}
        write_report(args.json, report)
    engine.close()
    greedy = report["configs"].get("greedy", {}).get("p50_ms")
    for row in report["configs"].values():
        row["over_greedy"] = round(row["p50_ms"] / greedy, 3) if greedy else None
    write_report(args.json, report)
    return report
