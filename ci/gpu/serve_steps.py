"""Runs ``python -m kvvm_bench serve`` with the engine's steps timed, on the GPU machine.

    PYTHONPATH=SITE:BENCHES python3 ci/gpu/serve_steps.py [--profile] -- SERVE ARGS...

Works with any build whose ``kvvm.engine.Engine`` has ``warmup``, ``step``, ``close`` and
``stats.prefill_forwards`` / ``stats.decode_steps`` (the engine before and after its split
alike), so that two builds' steps can be compared in one call (``ci/gpu/serve_ab.sh`` with
``AB_STEPS=1``). After the benchmark it prints one line: the steps after the warm-up split
into those that ran a prefill forward and the decode-only ones (count, total and median
wall time). With ``--profile`` the steps after the warm-up run under ``torch.profiler`` and
the CUDA kernels and host operators taking the most time are printed (the profiler slows the
host: compare kernels' device time between builds, not wall time).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any


def main(argv: list[str]) -> int:
    profile = "--profile" in argv[: argv.index("--")] if "--" in argv else False
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
    try:
        rc = bench_main(["serve", *serve_args])
    except SystemExit as e:
        rc = int(e.code or 0)
    for name, want in (("prefill", True), ("decode-only", False)):
        times = [t for p, t in steps if p == want]
        if times:
            print(
                f"steps {name}: {len(times)}, total {sum(times) * 1e3:.1f} ms, "
                f"median {statistics.median(times) * 1e3:.2f} ms"
            )
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
