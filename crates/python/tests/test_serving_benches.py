"""The serving benchmarks' CPU modes (the figures come from a GPU: ``docs/server.md``):
``python -m kvvm_bench http`` replays a trace through the engine directly and through its
OpenAI server (a client in a child process, streams over 127.0.0.1), and ``python -m
kvvm_bench sampling`` times the engine's step per sampling configuration. Tiny random Llama,
host backend."""

from __future__ import annotations

import json

import pytest
from conftest import host_available

pytest.importorskip("torch", reason="skipped: no torch")
pytest.importorskip("transformers", reason="skipped: no transformers")
pytest.importorskip("starlette", reason="skipped: no starlette")
pytest.importorskip("uvicorn", reason="skipped: no uvicorn")
pytest.importorskip("httpx", reason="skipped: no httpx")

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")


def test_the_http_benchmark_runs_on_the_cpu(tmp_path) -> None:
    import kvvm_bench

    out = tmp_path / "http.json"
    rc = kvvm_bench.main([
        "http", "--tiny", "--device", "cpu", "--backend", "host", "--requests", "6", "--concurrency", "3",
        "--prompt-lo", "8", "--prompt-hi", "40", "--output", "5", "--slots", "3", "--rounds", "1",
        "--prefix-cache-bytes", str(64 << 20), "--json", str(out),
    ])
    assert rc == 0
    report = json.loads(out.read_text())
    for run in (report["direct"], report["http"]):
        assert run["generated_tokens"] == 30 and run["tokens_per_s"] > 0 and run["ttft_ms"]["p50"] > 0
        assert run["errors"] == []
    assert report["http"]["outputs_equal_direct"] == "6/6", "greedy through HTTP is the engine's greedy"
    assert report["http_over_direct"] > 0 and len(report["rounds"]) == 1


def test_the_sampling_benchmark_runs_on_the_cpu(tmp_path) -> None:
    import kvvm_bench

    out = tmp_path / "sampling.json"
    rc = kvvm_bench.main([
        "sampling", "--tiny", "--device", "cpu", "--backend", "host", "--slots", "2", "--prompt", "16",
        "--steps", "3", "--warmup", "1", "--configs", "greedy,all", "--json", str(out),
    ])
    assert rc == 0
    rows = json.loads(out.read_text())["configs"]
    assert set(rows) == {"greedy", "all"} and rows["greedy"]["over_greedy"] == 1.0
    assert all(r["p50_ms"] > 0 for r in rows.values())
