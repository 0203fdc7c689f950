"""The benchmarks that run without a GPU (``crates/python/benches``): ``python -m kvvm_bench
prefix`` on the simulator; kvvm's side of ``python -m kvvm_bench kvcached`` on the host backend
(kvcached's side needs a CUDA GPU and is recorded as skipped); ``python -m kvvm_bench shapes``
in its tiny mode (the Triton kernel in Triton's interpreter, nothing timed). Skipped without
torch, as the rest of the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import host_available, kvvm_binary

# The benchmarks import torch (their package's command line does, for every subcommand).
pytest.importorskip("torch", reason="skipped: no torch")

#: What ``python -m kvvm_bench kvcached`` records for kvcached's side on a CPU.
KVCACHED_SKIPPED = {"skipped": "skipped: kvcached needs a CUDA GPU"}


def test_prefix_hits_map_one_handle_per_mapping(tmp_path: Path) -> None:
    """A 4096-token prefix (token-major llama-3-8b: 16 tokens a window) hit in full at every
    handle size, with one mapping per handle: 256 at one window a handle, 16 at sixteen."""
    import kvvm_bench

    out = tmp_path / "prefix.json"
    assert kvvm_bench.main(["prefix", "--backend", "sim", "--hits", "2", "--handle-windows", "1,16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["handle_windows"]: r for r in report["rows"]}
    assert report["meta"]["window_tokens"] == 16
    assert rows[1]["hit_tokens"] == rows[16]["hit_tokens"] == 4096
    assert (rows[1]["tokens_per_handle"], rows[1]["mappings"]) == (16, 256)
    assert (rows[16]["tokens_per_handle"], rows[16]["mappings"]) == (256, 16)
    assert all(r["p50_us"] > 0 for r in rows.values())


def _kvcached_bench(out: Path, *flags: str) -> dict:
    """``python -m kvvm_bench kvcached`` on the host backend with small points; its report."""
    import kvvm_bench

    if not host_available():
        pytest.skip("skipped: no host backend here")
    argv = [
        "kvcached", "--device", "cpu", "--backend", "host", "--tokens", "256,1024", "--reps", "3", "--requests", "6",
        "--burst-lo", "64", "--burst-hi", "512", "--idle-s", "0.1", "--settle-ms", "0", "--json", str(out), *flags,
    ]
    assert kvvm_bench.main(argv) == 0
    report: dict = json.loads(out.read_text())
    return report


def test_kvcached_bench_gives_and_takes_tokens_on_the_host(tmp_path: Path) -> None:
    """Part a: every point timed, cold (the pool emptied first) and warm (the previous release
    pooled); part b: the burst committed at least its live bytes, nothing committed once every
    request finished, nothing held after the trim. kvcached's side: skipped on a CPU."""
    report = _kvcached_bench(tmp_path / "kvcached.json", "--parts", "a,b")
    assert report["kvcached_init"] == KVCACHED_SKIPPED
    assert report["give_take"]["kvcached"] == report["footprint"]["kvcached"] == KVCACHED_SKIPPED
    side = report["give_take"]["kvvm"]
    assert side["ok"] and side["exit_code"] == 0, side
    rows = {(r["tokens"], r["mode"]): r for r in side["result"]["rows"]}
    assert set(rows) == {(256, "cold"), (256, "warm"), (1024, "cold"), (1024, "warm")}
    per_token = report["meta"]["geometry"]["bytes_per_token"]
    for (tokens, _), r in rows.items():
        assert r["refused"] is None
        assert r["give_us"]["p50"] > 0 and r["take_us"]["p50"] > 0 and r["reserve_us"]["p50"] > 0
        assert r["bytes"] >= tokens * per_token
    assert rows[(1024, "cold")]["pooled_bytes_before"] == 0
    assert rows[(1024, "warm")]["pooled_bytes_before"] > 0
    burst = report["footprint"]["kvvm"]
    assert burst["ok"], burst
    readings = burst["result"]["readings"]
    assert readings["peak"]["committed"] >= report["footprint"]["live_bytes"] > 0
    assert readings["after_burst"]["committed"] == 0
    assert readings["after_trim"]["held"] == 0
    assert "pressure" not in report


def test_kvcached_bench_two_kvvm_instances_share_a_broker_on_the_host(tmp_path: Path) -> None:
    """Part c, kvvm's side: two processes under one broker of 256 MiB grow requests of 256
    tokens (32 MiB) until refused; together they hold no more than the budget."""
    binary = kvvm_binary()
    if binary is None:
        pytest.skip("skipped: no kvvm binary (cargo build -p kvvm-cli, or set KVVM_BIN)")
    budget = 256 << 20
    report = _kvcached_bench(
        tmp_path / "kvcached.json", "--parts", "c", "--kvvm-bin", binary, "--pressure-budget-bytes", str(budget),
        "--pressure-tokens", "256", "--lease-batch-bytes", str(32 << 20),
    )
    pressure = report["pressure"]
    assert pressure["kvcached"] == KVCACHED_SKIPPED
    instances = pressure["kvvm"]["instances"]
    assert len(instances) == 2 and all(i["ok"] for i in instances), instances
    results = [i["result"] for i in instances]
    assert all(r["refusal"]["type"] in ("BackpressureError", "NeverFitsError") for r in results), results
    assert 0 < sum(r["books"]["committed"] for r in results) <= budget


def test_sliding_bench_runs_tiny_on_the_cpu(tmp_path: Path) -> None:
    """``python -m kvvm_bench sliding --tiny`` on the host backend: both caches at both
    lengths, KvvmCache's sliding layers no larger at 640 tokens than at 256 (their windows
    behind went back) while a cache of every token grows, and DynamicCache's greedy tokens
    (fp32). The captured step needs CUDA: left out on a CPU."""
    import kvvm_bench

    if not host_available():
        pytest.skip("skipped: no host backend here")
    out = tmp_path / "sliding.json"
    argv = [
        "sliding", "--tiny", "--device", "cpu", "--backend", "host", "--lengths", "256,640", "--steps", "3",
        "--chunk", "128", "--batch", "2", "--json", str(out),
    ]
    assert kvvm_bench.main(argv) == 0
    report = json.loads(out.read_text())
    runs = {r["cache"]: r["rows"] for r in report["runs"]}
    assert set(runs) == {"dynamic", "kvvm-eager"}
    assert report["meta"]["sliding_layers"] == 5 and report["meta"]["sliding_window"] == 64
    dynamic, kv = runs["dynamic"], runs["kvvm-eager"]
    assert [r["length"] for r in dynamic] == [r["length"] for r in kv] == [256, 640]
    short, long = kv
    assert long["by_group"]["sliding"] <= short["by_group"]["sliding"]
    assert long["every_token_bytes"] > 2 * short["every_token_bytes"]
    assert all(r["step_ms"]["p50"] > 0 and r["greedy_agree_with_dynamic"] == 1.0 for r in kv)
    assert all(r["kv_bytes"] > 0 for r in dynamic)


def test_shapes_bench_checks_the_kernel_and_the_step_on_the_cpu_untimed(tmp_path: Path) -> None:
    """``python -m kvvm_bench shapes --tiny --device cpu`` under Triton's interpreter (a process
    of its own: Triton reads ``TRITON_INTERPRET`` once): the kernel alone against SDPA and the
    decode step of a model of the shape over a KvvmCache against DynamicCache, at one shape in
    both dtypes; the timing parts skipped, and the report says so."""
    pytest.importorskip("torch", reason="skipped: no torch")
    pytest.importorskip("triton", reason="skipped: no triton")
    if not host_available():
        pytest.skip("skipped: no host backend here")
    out = tmp_path / "shapes.json"
    benches = str(Path(__file__).resolve().parents[1] / "benches")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [benches, os.environ.get("PYTHONPATH")])))
    argv = ["shapes", "--tiny", "--device", "cpu", "--head-dims", "96", "--gqa", "8", "--dtypes", "bf16,fp16", "--json", str(out)]
    r = subprocess.run([sys.executable, "-m", "kvvm_bench", *argv], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    meta = report["meta"]
    assert meta["timing"].startswith("skipped: no CUDA") and meta["device"].startswith("cpu")
    assert all(meta[k] for k in ("date", "torch", "triton", "transformers", "kvvm"))
    assert [(p["head_dim"], p["heads"], p["kv_heads"], p["dtype"]) for p in report["points"]] == [
        (96, 16, 2, "bf16"), (96, 16, 2, "fp16"),
    ]
    for p in report["points"]:
        tol = 2e-2 if p["dtype"] == "bf16" else 2e-3
        kernel, step = p["kernel"], p["step"]
        assert kernel["us_per_call"] is None and "no CUDA" in kernel["note"] and kernel["floor_us"] > 0
        assert kernel["max_abs_diff"] < tol, kernel
        assert step["p50_ms"] is None and "no CUDA" in step["note"] and step["floor_ms"] > 0
        assert step["max_abs_logit_diff"] < tol, step
        assert 0 < step["argmax_checked"] == step["argmax_agree"], step
        assert step["live_kv_bytes"] > 0 and step["weight_bytes"] > 0
        assert p["triton_configs"] and all("untuned" in c for c in p["triton_configs"])
    rows = report["markdown"].splitlines()
    assert len(rows) == 4 and rows[2].startswith("| 96 | 16/2 | bf16 |") and rows[3].startswith("| 96 | 16/2 | fp16 |")
    # One line a shape, the kernel and the step each "not timed".
    assert r.stderr.count("kernel not timed") == r.stderr.count("step not timed") == 2, r.stderr
