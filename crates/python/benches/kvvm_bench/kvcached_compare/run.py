"""The run: its flags, kvcached's initialisation probed, each part on both sides, kvcached's
own tests; the report written after each part."""

from __future__ import annotations

import argparse
import importlib
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from kvvm_bench.node import broker_metrics, smi_free_bytes
from kvvm_bench.report_file import write_report

from .common import BLOCK_TOKENS, CTOR_ONLY, DEFAULT_TESTS, READY, RECIPES, RESULT, TAIL, _parse
from .processes import _clean_ipc, _kill_session, _live, _recipe_env, _Run, _say, _signal_name, _verdict
from .report import table


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``python -m kvvm_bench kvcached``."""
    p.add_argument("--parts", default="a,b,c", help="a (give/take times), b (bytes held), c (two instances)")
    p.add_argument("--model", default="llama-3-8b", help="the KV geometry's preset (both libraries)")
    p.add_argument("--layout", default="token-major", help="kvvm's layout")
    p.add_argument("--tokens", default="256,4096,32768", help="part a: tokens per request, comma-separated")
    p.add_argument("--reps", type=int, default=20, help="part a: timed repetitions per point (after one warm-up)")
    p.add_argument("--settle-ms", type=float, default=20.0, help="pause before each repetition (background work settles)")
    p.add_argument("--kvvm-pool-cap-bytes", type=int, default=0, help="kvvm's pool cap (0: its default, 1 GiB)")
    p.add_argument("--requests", type=int, default=64, help="part b: requests in the burst")
    p.add_argument("--burst-lo", type=int, default=128, help="part b: shortest request (tokens)")
    p.add_argument("--burst-hi", type=int, default=8192, help="part b: longest request (tokens)")
    p.add_argument("--idle-s", type=float, default=5.0, help="part b: idle time before the third reading")
    p.add_argument("--pressure-tokens", type=int, default=4096, help="part c: tokens per request")
    p.add_argument("--pressure-max-requests", type=int, default=4096, help="part c: most requests per instance")
    p.add_argument(
        "--pressure-budget-bytes", type=int, default=0,
        help="part c: kvvm broker's budget (0: 90%% of the device's free memory, from nvidia-smi)",
    )
    p.add_argument("--lease-batch-bytes", type=int, default=256 << 20, help="part c: kvvm's lease batch")
    p.add_argument(
        "--kvcached-limit", default="half",
        help="part c: each kvcached instance's limit: 'half' (half the budget each), 'none', or bytes",
    )
    p.add_argument("--kvvm-bin", help="the kvvm binary (runs the broker of part c; without it kvvm's part c is skipped)")
    p.add_argument("--kvcached-dir", help="where kvcached was installed (pip install --target DIR)")
    p.add_argument("--kvcached-src", help="kvcached's unpacked sdist: its own tests run from there")
    p.add_argument("--kvcached-tests", default=",".join(DEFAULT_TESTS), help="kvcached's test files, comma-separated ('' for none)")
    p.add_argument("--kvcached-recipes", default=",".join(RECIPES), help=f"initialisations tried in order, of {RECIPES}")
    p.add_argument("--kvcached-diagnose", action="store_true", help=f"try every recipe and {CTOR_ONLY!r}, not only until one works")
    p.add_argument("--worker-timeout", type=float, default=300.0, help="seconds a child may take")
    p.add_argument("--probe-timeout", type=float, default=120.0, help="seconds one initialisation attempt may take")
    p.add_argument("--test-timeout", type=float, default=120.0, help="seconds one of kvcached's test files may take")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default="auto", help="kvvm backend (host on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here (after each part)")


def worker_args(p: argparse.ArgumentParser) -> None:
    """The flags of one child (``python -m kvvm_bench kvcached-worker``), given by the run."""
    p.add_argument("--spec", required=True, help="what to run, as JSON (written by the run)")


# Initialisation and kvcached's tests ------------------------------------------------------


def _probe(run: _Run) -> dict[str, Any]:
    """Tries the recipes in order (all of them when diagnosing); the first that allocates and
    frees a block becomes the run's."""
    names = [r for r in run.args.kvcached_recipes.split(",") if r]
    if run.args.kvcached_diagnose:
        names = [CTOR_ONLY, *(n for n in names if n != CTOR_ONLY)]
    attempts = []
    for name in names:
        if run.recipe is not None and not run.args.kvcached_diagnose:
            break
        if name not in (*RECIPES, CTOR_ONLY):
            attempts.append({"recipe": name, "ok": False, "failure": f"unknown recipe; choose from {(*RECIPES, CTOR_ONLY)}"})
            continue
        spec = run.spec("kvcached", "probe", recipe=name)
        record = run.run("kvcached", f"probe-{name}", spec, log_level="INFO", timeout=run.args.probe_timeout)
        record["recipe"] = name
        attempts.append(record)
        if record["ok"] and name != CTOR_ONLY and run.recipe is None:
            run.recipe = name
        _say(f"kvcached init {name:>20}: " + ("ok" if record["ok"] else record["failure"]))
    return {"recipe": run.recipe, "attempts": attempts}


def _run_tests(run: _Run) -> list[dict[str, Any]]:
    """kvcached's own test files, each by pytest in its own process and session."""
    src = Path(run.args.kvcached_src).resolve()
    out = []
    for name in (t for t in run.args.kvcached_tests.split(",") if t):
        path = src / name
        if not path.exists():
            out.append({"file": name, "ok": False, "failure": f"{path} does not exist"})
            continue
        env, ipc = run.env("kvcached", f"test-{path.stem}")
        env.pop("KVCACHED_IPC_NAME")  # the tests name their own segments
        # Under the run's recipe's preload, if it has one (without it they fault as it did).
        preload = _recipe_env(run.recipe).get("LD_PRELOAD") if run.recipe else None
        if preload:
            env["LD_PRELOAD"] = preload
        cmd = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(path)]
        began = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=run.tmp, start_new_session=True)
        _live.add(proc.pid)
        try:
            text, _ = proc.communicate(timeout=run.args.test_timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid, signal.SIGABRT)
            try:
                text, _ = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                _kill_session(proc.pid)
                text, _ = proc.communicate()
            timed_out = True
        _live.discard(proc.pid)
        lines = [ln for ln in (text or "").splitlines() if ln.strip()]
        record: dict[str, Any] = {
            "file": name, "ld_preload": preload, "exit_code": proc.returncode, "ok": proc.returncode == 0,
            "summary": lines[-1] if lines else "", "wall_s": round(time.monotonic() - began, 1), "tail": lines[-TAIL:],
        }
        if proc.returncode is not None and proc.returncode < 0:
            record["signal"] = _signal_name(-proc.returncode)
        if timed_out:
            record["timed_out_after_s"] = run.args.test_timeout
        out.append(record)
        _say(f"kvcached {name}: exit {proc.returncode} {record['summary']}")
        if ipc:
            _clean_ipc(ipc)
    return out


# Part c ---------------------------------------------------------------------------------


def _pair(run: _Run, side: str, specs: list[dict[str, Any]], sample: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Two instances started together: set up, told to go together, each growing until
    refused; ``sample`` read while both hold; then both finish."""
    deadline = time.monotonic() + float(run.args.worker_timeout)

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    children = [run.start(side, f"c-{side}-{i}", s) for i, s in enumerate(specs)]
    ready = [c.wait_for(READY, left()) is not None for c, _ in children]
    for (c, _), r in zip(children, ready, strict=True):
        if r:
            c.send("go")
    results = [_parse(c.wait_for(RESULT, left()) if r else c.early_result) for (c, _), r in zip(children, ready, strict=True)]
    held = sample()
    for c, _ in children:
        c.send("done")
    records = []
    for (c, ipc), result in zip(children, results, strict=True):
        record = _verdict(result, c.finish(max(left(), 30.0)))
        if ipc:
            record["ipc_name"] = ipc
            _clean_ipc(ipc)
        records.append(record)
    got = [r["result"]["books"]["held"] for r in records if r["result"] and "books" in r["result"]]
    return {"instances": records, "held_while_both_hold": held, "library_held_total": sum(got) if got else None}


def _pressure(run: _Run, budget: int | None) -> dict[str, Any]:
    """Part c on both sides."""
    a = run.args
    out: dict[str, Any] = {"budget_bytes": budget, "tokens_per_request": a.pressure_tokens}
    common = {"request_tokens": a.pressure_tokens, "max_requests": a.pressure_max_requests}
    if budget is None:
        out["kvvm"] = out["kvcached"] = {"skipped": "no budget: pass --pressure-budget-bytes (nvidia-smi gave none)"}
        return out
    free_before = smi_free_bytes(a.device)
    out["device_free_before"] = free_before
    if not a.kvvm_bin:
        out["kvvm"] = {"skipped": "no --kvvm-bin (the broker)"}
    else:
        socket, metrics, log = (Path(run.tmp) / name for name in ("broker.sock", "broker.prom", "broker.log"))
        with open(log, "w") as err:
            broker = subprocess.Popen(
                [a.kvvm_bin, "broker", "--socket", str(socket), "--budget-bytes", str(budget), "--tenant", "a",
                 "--tenant", "b", "--metrics-file", str(metrics), "--metrics-interval-ms", "100"],
                stdout=subprocess.PIPE, stderr=err, text=True,
            )
        assert broker.stdout is not None
        first = broker.stdout.readline()
        try:
            if "listening on" not in first:
                out["kvvm"] = {"ok": False, "failure": f"the broker did not start: {first!r} (exit {broker.poll()})",
                               "stderr_tail": log.read_text().splitlines()[-TAIL:]}
            else:
                specs = [run.spec("kvvm", "c", socket=str(socket), tenant=t, lease_batch_bytes=a.lease_batch_bytes, **common)
                         for t in ("a", "b")]

                def sample() -> dict[str, Any]:
                    time.sleep(0.3)  # one metrics interval and more
                    return {"device_free": smi_free_bytes(a.device), **broker_metrics(metrics)}

                out["kvvm"] = _pair(run, "kvvm", specs, sample)
        finally:
            broker.terminate()
            try:
                broker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                broker.kill()
    if run.kvcached_skip or run.recipe is None:
        out["kvcached"] = {"skipped": run.kvcached_skip or "no kvcached initialisation worked (see kvcached_init)"}
        return out
    limit = {"half": budget // 2, "none": 0}.get(a.kvcached_limit)
    limit = int(a.kvcached_limit) if limit is None else limit
    specs = [run.spec("kvcached", "c", limit_bytes=limit, **common) for _ in range(2)]
    out["kvcached_limit_bytes"] = limit
    out["kvcached"] = _pair(run, "kvcached", specs, lambda: {"device_free": smi_free_bytes("cuda")})
    return out


def _geometry(model: str) -> dict[str, Any]:
    import kvvm

    g = kvvm.KvGeometry.preset(model, BLOCK_TOKENS)
    return {"model": model, "layers": g.layers, "kv_heads": g.kv_heads, "head_dim": g.head_dim, "dtype": g.dtype,
            "dtype_bytes": g.dtype_bytes, "bytes_per_token": g.bytes_per_token}


def run_kvcached_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every part asked for, kvvm's side and kvcached's; the report (also written after each
    part with ``--json``)."""
    parts = {p for p in args.parts.split(",") if p}
    geometry = _geometry(args.model)
    rnd = random.Random(args.seed)
    lengths = [rnd.randint(args.burst_lo, args.burst_hi) for _ in range(args.requests)]
    order = list(range(len(lengths)))
    rnd.shuffle(order)
    report: dict[str, Any] = {
        "meta": {
            "device": args.device, "backend": args.backend, "geometry": geometry, "block_tokens": BLOCK_TOKENS,
            "layout": args.layout, "kvcached_dir": args.kvcached_dir, "kvcached_src": args.kvcached_src,
            "kvvm": getattr(importlib.import_module("kvvm"), "__version__", None),
        },
    }
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        _run_parts(args, parts, geometry, lengths, order, report)
    finally:
        # Children run in sessions of their own: a run stopped (a timeout's SIGTERM) takes them along.
        for pid in list(_live):
            _kill_session(pid)
        _live.clear()
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    _say(table(report))
    return report


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _run_parts(
    args: argparse.Namespace, parts: set[str], geometry: dict[str, Any], lengths: list[int], order: list[int],
    report: dict[str, Any],
) -> None:
    """The parts, each written into ``report`` (and ``--json``) as soon as it is measured."""
    with tempfile.TemporaryDirectory(prefix="kvvm-kvcached-") as tmp:
        run = _Run(args, tmp, geometry)
        if run.kvcached_skip:
            report["kvcached_init"] = {"skipped": run.kvcached_skip}
        else:
            report["kvcached_init"] = _probe(run)
        write_report(args.json, report)
        if "a" in parts:
            report["give_take"] = {"kvvm": run.run("kvvm", "a-kvvm", run.spec("kvvm", "a"))}
            report["give_take"]["kvcached"] = _kvcached_part(run, "a", run.spec("kvcached", "a"))
            write_report(args.json, report)
        if "b" in parts:
            burst = {"lengths": lengths, "order": order, "idle_s": args.idle_s}
            report["footprint"] = {
                "requests": len(lengths), "live_bytes": sum(lengths) * geometry["bytes_per_token"],
                "kvvm": run.run("kvvm", "b-kvvm", run.spec("kvvm", "b", **burst)),
                "kvcached": _kvcached_part(run, "b", run.spec("kvcached", "b", **burst)),
            }
            write_report(args.json, report)
        if "c" in parts:
            budget = args.pressure_budget_bytes or None
            if budget is None and args.device == "cuda":
                free = smi_free_bytes("cuda")
                budget = int(free * 0.9) if free else None
            report["pressure"] = _pressure(run, budget)
            write_report(args.json, report)
        if args.kvcached_src and not run.kvcached_skip and args.kvcached_tests:
            report["kvcached_tests"] = _run_tests(run)
            write_report(args.json, report)


def _kvcached_part(run: _Run, part: str, spec: dict[str, Any]) -> dict[str, Any]:
    if run.kvcached_skip:
        return {"skipped": run.kvcached_skip}
    if run.recipe is None:
        return {"skipped": "no kvcached initialisation worked (see kvcached_init)"}
    return run.run("kvcached", f"{part}-kvcached", spec)


