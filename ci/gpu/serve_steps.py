"""Runs ``python -m kvvm_bench serve`` with the engine's steps timed, on the GPU machine.

    PYTHONPATH=SITE:BENCHES python3 ci/gpu/serve_steps.py [--profile] [--repeat N] -- SERVE ARGS...

Works with any build whose ``kvvm.engine.Engine`` has ``warmup``, ``step``, ``close`` and
``stats.prefill_forwards`` / ``stats.decode_steps`` (the engine before and after its split
alike), so that two builds' steps can be compared in one call (``ci/gpu/serve_ab.sh`` with
``AB_STEPS=1``). After the benchmark it prints one line: the steps after the warm-up split
into those that ran a prefill forward and the decode-only ones (count, total and median
wall time). With ``--profile`` the steps after the warm-up run under ``torch.profiler`` and
the CUDA kernels and host operators taking the most time are printed (the profiler slows the
host: compare kernels' device time between builds, not wall time). ``--repeat N`` runs the
benchmark N times in the process (a run's report ``X.json``, the later ones' ``X-r2.json``,
...): the runs after the first find the process warm, so that a comparison of builds is not
left to one cold process each.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any


def _repeat_json(args: list[str], run: int) -> list[str]:
    """``args`` with the report of run ``run`` (from 1) named ``X-r<run>.json`` after the
    first's ``X.json``."""
    if run == 1 or "--json" not in args:
        return args
    i = args.index("--json") + 1
    stem = args[i][: -len(".json")] if args[i].endswith(".json") else args[i]
    return [*args[:i], f"{stem}-r{run}.json", *args[i + 1 :]]


def main(argv: list[str]) -> int:
    own = argv[: argv.index("--")] if "--" in argv else []
    profile = "--profile" in own
    repeat = int(own[own.index("--repeat") + 1]) if "--repeat" in own else 1
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else argv
    import torch
    from kvvm.engine import Engine

    from kvvm_bench.cli import main as bench_main

    steps: list[tuple[bool, float]] = []
    state: dict[str, Any] = {"armed": False}
    warmup, step, close = Engine.warmup, Engine.step, Engine.close

    def timed_warmup(self: Any, *args: Any, **kwargs: Any) -> None:
        warmup(self, *args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        state["armed"] = True
        if profile:
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            state["prof"] = torch.profiler.profile(activities=acts)
            state["prof"].__enter__()

    def timed_step(self: Any) -> int:
        if not state["armed"]:
            return int(step(self))
        before = self.stats.prefill_forwards
        began = time.perf_counter()
        produced = int(step(self))
        steps.append((self.stats.prefill_forwards > before, time.perf_counter() - began))
        return produced

    def timed_close(self: Any) -> None:
        prof = state.pop("prof", None)
        if prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            table = prof.key_averages()
            print(table.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
            print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        state["armed"] = False
        close(self)

    Engine.warmup, Engine.step, Engine.close = timed_warmup, timed_step, timed_close  # type: ignore[method-assign]
    rc = 0
    for run in range(1, repeat + 1):
        steps.clear()
        try:
            rc = bench_main(["serve", *_repeat_json(serve_args, run)]) or rc
        except SystemExit as e:
            rc = int(e.code or 0) or rc
        for name, want in (("prefill", True), ("decode-only", False)):
            times = [t for p, t in steps if p == want]
            if times:
                print(
                    f"steps {name} (run {run}): {len(times)}, total {sum(times) * 1e3:.1f} ms, "
                    f"median {statistics.median(times) * 1e3:.2f} ms"
                )
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
