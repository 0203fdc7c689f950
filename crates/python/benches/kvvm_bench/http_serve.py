"""``python -m kvvm_bench http``: one serving trace through the engine called directly
(:func:`kvvm_bench.serve.run_engine`) and through the OpenAI-compatible server
(:mod:`kvvm.serving.http`) over the same model, in the same process and call, side by side.

The HTTP run serves the engine with uvicorn on 127.0.0.1 from a thread of this process; the
client is an ``httpx`` asyncio client in a child process (its own interpreter: a remote
client does not share the server's GIL) keeping ``--concurrency`` streamed
``/v1/completions`` requests in flight (prompts as token ids, greedy, ``ignore_eos``, the
trace's output lengths, ``return_token_ids``), or all at their arrival times with
``--real-time``. For each run: generated tokens per second from the first request to the
last token, TTFT and inter-token p50/p99 at the client (each token stamped when its chunk
arrived; the direct run stamps each token at its step's end), and the HTTP run's greedy
tokens against the direct run's. The report's ``http_over_direct`` is the ratio of their
tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from typing import Any

import kvvm
from kvvm_bench.numerics import percentiles
from kvvm_bench.report_file import write_report

__all__ = ["add_args", "client_run", "run_http_bench"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64, help="streams in flight at the client")
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals a second (0: all at once)")
    p.add_argument("--real-time", action="store_true", help="send at the arrival times (else as streams free up)")
    p.add_argument("--prompt-lo", type=int, default=128)
    p.add_argument("--prompt-hi", type=int, default=2048)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--shared-prefix", type=int, default=0)
    p.add_argument("--shared-share", type=float, default=1.0)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--max-len", type=int, default=0)
    p.add_argument("--budget-bytes", type=int, default=0)
    p.add_argument("--prefix-cache-bytes", type=int, default=8 << 30)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--fuse-projections", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default="auto", help="kvvm backend (host on a CPU)")
    p.add_argument("--client", default="process", choices=["process", "thread"],
                   help="the HTTP client in a child process (default) or in this one")
    p.add_argument("--switch-interval", type=float, default=0.001,
                   help="sys.setswitchinterval for the run: the engine's loop and the server share the GIL")
    p.add_argument("--rounds", type=int, default=2, help="direct then HTTP, this many times (the last one reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")


async def _client(url: str, jobs: list[dict[str, Any]], concurrency: int, real_time: bool) -> list[dict[str, Any]]:
    """Streams every job's completion; returns, per job, when it was sent, when each token
    arrived (monotonic seconds) and the token ids."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:

        async def one(job: dict[str, Any]) -> dict[str, Any]:
            if real_time:
                await asyncio.sleep(max(0.0, job["arrival_s"] - (time.monotonic() - start)))
            async with gate:
                sent = time.monotonic()
                stamps: list[float] = []
                tokens: list[int] = []
                async with client.stream("POST", "/v1/completions", json=job["body"]) as response:
                    if response.status_code != 200:
                        return {"sent": sent, "stamps": [], "tokens": [], "error": (await response.aread()).decode()[:300]}
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                        now = time.monotonic()
                        stamps += [now] * len(ids)
                        tokens += ids
                return {"sent": sent, "stamps": stamps, "tokens": tokens}

        return list(await asyncio.gather(*(one(j) for j in jobs)))


def client_run(url: str, jobs: list[dict[str, Any]], concurrency: int, real_time: bool) -> list[dict[str, Any]]:
    """:func:`_client` in a fresh event loop (the child process's entry point)."""
    return asyncio.run(_client(url, jobs, concurrency, real_time))


def _client_process(url: str, jobs: list[dict[str, Any]], concurrency: int, real_time: bool, conn: Any) -> None:
    conn.send(client_run(url, jobs, concurrency, real_time))
    conn.close()


def _run_client(args: argparse.Namespace, url: str, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if args.client == "thread":
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(client_run, url, jobs, args.concurrency, args.real_time).result()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_client_process, args=(url, jobs, args.concurrency, args.real_time, child))
    proc.start()
    child.close()
    results = parent.recv()
    proc.join(60)
    return list(results)


def run_direct(engine: Any, trace: list[Any], real_time: bool) -> dict[str, Any]:
    """The trace through ``engine.step()`` in this thread (the engine called directly): each
    token stamped at the end of the step that produced it."""
    pending = list(trace)
    handles: list[Any] = []
    sent: list[float] = []
    stamps: list[list[float]] = []
    start = time.monotonic()
    while pending or not engine.idle:
        now = time.monotonic() - start
        while pending and (not real_time or pending[0].arrival_s <= now):
            q = pending.pop(0)
            handles.append(engine.submit(q.prompt, q.output_tokens))
            sent.append(time.monotonic())
            stamps.append([])
        if engine.idle:
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        engine.step()
        t = time.monotonic()
        for h, st in zip(handles, stamps, strict=True):
            st.extend([t] * (len(h.tokens) - len(st)))
    return _summary("kvvm-engine", [{"sent": a, "stamps": st, "tokens": h.tokens} for a, st, h in zip(sent, stamps, handles, strict=True)])


def _summary(runner: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    ends = [r["stamps"][-1] for r in results if r["stamps"]]
    wall = (max(ends) if ends else time.monotonic()) - min(r["sent"] for r in results)
    generated = sum(len(r["tokens"]) for r in results)
    return {
        "runner": runner,
        "wall_s": round(wall, 3),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / max(wall, 1e-9), 1),
        "ttft_ms": percentiles([(r["stamps"][0] - r["sent"]) * 1000 for r in results if r["stamps"]]),
        "itl_ms": percentiles([(b - a) * 1000 for r in results for a, b in zip(r["stamps"], r["stamps"][1:]) if b > a]),
        "errors": [r["error"] for r in results if "error" in r][:5],
        "outputs": [list(r["tokens"]) for r in results],
    }


def run_http(engine: Any, trace: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """The trace through the OpenAI server over ``engine`` (its background loop on for the
    run), the client as ``--client`` says."""
    from kvvm.serving.http import BackgroundServer, OpenAIServer, ServerConfig

    jobs = [{"arrival_s": q.arrival_s, "body": {
        "model": "bench", "prompt": q.prompt, "max_tokens": q.output_tokens, "temperature": 0, "stream": True,
        "ignore_eos": True, "return_token_ids": True}} for q in trace]
    server = OpenAIServer(engine, ServerConfig(model_name="bench"))
    with BackgroundServer(server.app) as http:
        results = _run_client(args, http.url, jobs)
    return _summary("kvvm-http", results)


def run_http_bench(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`_http_bench` with the process's switch interval and torch's threads put back
    afterwards."""
    import sys

    import torch

    interval, threads = sys.getswitchinterval(), torch.get_num_threads()
    try:
        return _http_bench(args)
    finally:
        sys.setswitchinterval(interval)
        torch.set_num_threads(threads)


def _http_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The trace directly and through HTTP on one warmed-up engine, ``--rounds`` times in
    turn (the prefix cache emptied before each run); returns the report (the last round's
    figures, and every round's tokens per second)."""
    import torch

    from kvvm.serving.engine import Engine
    from kvvm_bench import serve as sv
    from kvvm_bench.cli import _build_model

    import sys

    sys.setswitchinterval(args.switch_interval)
    if args.device == "cpu":
        torch.set_num_threads(1)  # two threads spinning for each other on a busy 2-core machine: 10-20x slower
    model = _build_model(args)
    trace = sv.synthetic_trace(args.requests, model.config.vocab_size, prompt_lo=args.prompt_lo, prompt_hi=args.prompt_hi,
                               output=args.output, shared_prefix=args.shared_prefix, shared_share=args.shared_share,
                               rate=args.rate, seed=args.seed)
    max_len = args.max_len or max(len(q.prompt) + q.output_tokens for q in trace) + 16
    manager = kvvm.Manager(args.backend, budget_bytes=args.budget_bytes or None, precommit=True, headroom_tokens=4)
    engine = Engine(model, slots=args.slots, max_len=max_len, manager=manager, prefill_chunk=args.prefill_chunk,
                    prefix_cache_bytes=args.prefix_cache_bytes, eos_token_ids=[], fuse_projections=args.fuse_projections,
                    max_waiting=max(len(trace), 1))
    engine.warmup(prompt_tokens=min(max_len - 8, max(1, sorted(len(q.prompt) for q in trace)[len(trace) // 2])))
    report: dict[str, Any] = {"requests": len(trace), "concurrency": args.concurrency, "client": args.client,
                              "switch_interval_s": args.switch_interval,
                              "prompt_tokens": sum(len(q.prompt) for q in trace),
                              "output_tokens": sum(q.output_tokens for q in trace), "rounds": []}
    if torch.cuda.is_available() and args.device == "cuda":
        report["device"] = torch.cuda.get_device_name()
    for _ in range(args.rounds):
        engine.kv.clear_prefixes()
        direct = run_direct(engine, trace, args.real_time)
        engine.kv.clear_prefixes()
        http = run_http(engine, trace, args)
        same = sum(a == b for a, b in zip(http.pop("outputs"), direct.pop("outputs"), strict=True))
        http["outputs_equal_direct"] = f"{same}/{len(trace)}"
        report["direct"], report["http"] = direct, http
        report["http_over_direct"] = round(http["tokens_per_s"] / max(direct["tokens_per_s"], 1e-9), 3)
        report["rounds"].append({"direct_tokens_per_s": direct["tokens_per_s"], "http_tokens_per_s": http["tokens_per_s"]})
        write_report(args.json, report)
    report["prefix_hits"] = engine.stats.prefix_hits
    engine.close()
    write_report(args.json, report)
    return report
