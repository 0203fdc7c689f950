"""The benchmarks that run without a GPU (``crates/python/benches``): ``python -m kvvm_bench
prefix`` on the simulator; kvvm's side of ``python -m kvvm_bench kvcached`` on the host backend
(kvcached's side needs a CUDA GPU and is recorded as skipped); ``python -m kvvm_bench shapes``
in its tiny mode (the Triton kernel in Triton's interpreter, nothing timed). Skipped without
torch, as the rest of the suite."""

from __future__ import annotations

import argparse
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


def test_kernel_bench_checks_the_fp8_kernel_against_its_dequantized_kv_on_the_cpu() -> None:
    """``kvvm_bench.kernels.run_kernels`` under Triton's interpreter (a process of its own):
    the decode kernel over bf16 K/V and over the same K/V stored as FP8 with a scale per KV
    head, each against SDPA over what it holds; the FP8 floor counts half the bytes."""
    pytest.importorskip("torch", reason="skipped: no torch")
    pytest.importorskip("triton", reason="skipped: no triton")
    benches = str(Path(__file__).resolve().parents[1] / "benches")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [benches, os.environ.get("PYTHONPATH")])))
    code = (
        "import json; from dataclasses import asdict; from kvvm_bench.kernels import run_kernels; "
        "rows = run_kernels(2, [40, 70], 128, layers=2, heads=4, kv_heads=2, head_dim=64, "
        "kernels=('triton', 'triton-fp8'), device='cpu', bandwidth=1e6); print(json.dumps([asdict(r) for r in rows]))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    bf16, fp8 = json.loads(r.stdout.strip().splitlines()[-1])
    assert (bf16["kernel"], fp8["kernel"]) == ("triton", "triton-fp8")
    assert fp8["floor_us"] == pytest.approx(bf16["floor_us"] / 2, rel=1e-2)
    assert bf16["max_abs_diff"] < 2e-2 and fp8["max_abs_diff"] < 2e-2, (bf16, fp8)
    assert "no CUDA" in fp8["note"] and fp8["us_per_call"] is None


def test_cascade_bench_compares_the_tokens_on_the_cpu_untimed(tmp_path: Path) -> None:
    """``python -m kvvm_bench cascade --tiny --fp32 --device cpu`` under Triton's interpreter:
    two prefixes of two requests each, the projections fused, the prefix split in two, its
    pass pinned beside the private pass, the cascade step's greedy tokens against the plain
    step's (all equal in fp32); no timing without CUDA."""
    pytest.importorskip("torch", reason="skipped: no torch")
    pytest.importorskip("triton", reason="skipped: no triton")
    if not host_available():
        pytest.skip("skipped: no host backend here")
    out = tmp_path / "cascade.json"
    benches = str(Path(__file__).resolve().parents[1] / "benches")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [benches, os.environ.get("PYTHONPATH")])))
    argv = [
        "cascade", "--tiny", "--fp32", "--device", "cpu", "--backend", "host", "--batch", "4", "--prefix", "24",
        "--own", "4", "--groups", "2", "--check-steps", "2", "--fuse", "--prefix-splits", "2", "--prefix-rows", "16",
        "--json", str(out),
        "--tuned-products", "--pdl", "--prefix-config", "16,4,1,beside",
    ]
    r = subprocess.run([sys.executable, "-m", "kvvm_bench", *argv], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert report["fused_projections"] is True and report["tuned_products"] is True and report["pdl"] is True
    assert (row["groups"], row["requests"], row["tokens_compared"]) == (2, 4, 8)
    assert row["tokens_agree"] == 8 and "cascade_p50_ms" not in row
    assert row["prefix_splits"] == 2, "the tables took the splits asked for (their own choice here: 1)"
    assert row["prefix_rows"] == 16, "the tables took the rows asked for (by default 64)"
    from kvvm.kernels.cascade import PrefixConfig

    assert report["prefix_config_pinned"] == str(PrefixConfig(16, 4, 1, concurrent=True))


def test_the_cascade_benchs_prefix_config_is_parsed_or_refused() -> None:
    """``--prefix-config``: three numbers, then ``beside`` or ``together`` and ``last``."""
    from kvvm.kernels.cascade import PrefixConfig
    from kvvm_bench.cascade import _prefix_config

    assert _prefix_config("64,4,2") == PrefixConfig(64, 4, 2)
    assert _prefix_config("64, 4, 3, beside, last") == PrefixConfig(64, 4, 3, prefix_first=False, concurrent=True)
    assert _prefix_config("32,4,2,together") == PrefixConfig(32, 4, 2, together=True)
    for bad in ("64,4", "64,4,x", "64,4,2,sideways", "64,4,2,beside,together"):
        with pytest.raises(argparse.ArgumentTypeError):
            _prefix_config(bad)


#: A small serve run on the CPU (the host backend): two short requests.
SERVE_CPU = [
    "serve", "--tiny", "--device", "cpu", "--backend", "host", "--requests", "2", "--prompt-lo", "8",
    "--prompt-hi", "16", "--output", "2", "--slots", "2", "--prefix-cache-bytes", "0", "--padded-batch", "2",
]


def test_a_serve_runner_that_cannot_run_fails_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A runner that cannot run (here transformers' ``generate_batch``, made to refuse) is
    reported in the JSON with its reason, and the command exits 1 saying which and why, after
    the other runners ran."""
    pytest.importorskip("transformers", reason="skipped: no transformers")
    if not host_available():
        pytest.skip("skipped: no host backend")
    from transformers import LlamaForCausalLM

    import kvvm_bench

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no continuous batching on this machine")

    home = next(c for c in LlamaForCausalLM.__mro__ if "generate_batch" in c.__dict__)
    monkeypatch.setattr(home, "generate_batch", refuse)
    out = tmp_path / "serve.json"
    rc = kvvm_bench.main([*SERVE_CPU, "--runners", "kvvm-engine,generate-batch", "--json", str(out)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "could not run" in err and "generate_batch: RuntimeError: no continuous batching on this machine" in err
    report = json.loads(out.read_text())
    assert report["failed"] == ["generate_batch"]
    rows = {r["runner"]: r for r in report["results"]}
    assert rows["generate_batch"]["failed"] and "no continuous batching" in rows["generate_batch"]["note"]
    assert not rows["kvvm-engine"]["failed"] and rows["kvvm-engine"]["generated_tokens"] == 4


def test_serve_with_the_kvvm_binary_and_no_report_file_leaves_nothing_in_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--kvvm-bin`` the trace goes to ``kvvm simulate``; without ``--json`` it is written
    into a temporary folder (with ``--json``, next to the report), never the working folder."""
    pytest.importorskip("transformers", reason="skipped: no transformers")
    binary = kvvm_binary()
    if binary is None or not host_available():
        pytest.skip("skipped: no kvvm binary or no host backend")
    import kvvm_bench

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert kvvm_bench.main([*SERVE_CPU, "--runners", "kvvm-engine", "--kvvm-bin", binary]) == 0
    assert list(work.iterdir()) == []
    out = tmp_path / "serve.json"
    assert kvvm_bench.main([*SERVE_CPU, "--runners", "kvvm-engine", "--kvvm-bin", binary, "--json", str(out)]) == 0
    assert list(work.iterdir()) == []
    assert (tmp_path / "serve.json.trace.jsonl").is_file()
    report = json.loads(out.read_text())
    assert report["failed"] == [] and report["simulate"]["predicted"]["completed"] == 2
def test_swap_bench_runs_tiny_on_the_host_backend(tmp_path: Path) -> None:
    """``python -m kvvm_bench swap --tiny`` on the host backend, every part small: the copies'
    bandwidth both ways beside a plain copy of the same bytes, the decode step while a thread
    swaps, the crossover's rows, and a trace whose budget preempts: recomputed in one run,
    swapped out and back in the other (a swapped request that crossed into a window it had
    not committed gets it at its admission, not in its prefill). CPU figures: nothing timed is
    asserted."""
    import kvvm_bench

    if not host_available():
        pytest.skip("skipped: no host backend here")
    out = tmp_path / "swap.json"
    window = 2 << 20
    argv = [
        "swap", "--tiny", "--device", "cpu", "--backend", "host", "--model", "llama-3-8b",
        "--copy-tokens", "256", "--repeat", "2", "--slots", "2", "--prompt", "32", "--decode-steps", "4",
        "--swap-tokens", "4096", "--copy-caps", "0,1", "--lengths", "32,64", "--requests", "3", "--prompt-lo", "990", "--prompt-hi", "1010",
        "--output", "40", "--trace-slots", "3", "--budget-bytes", str(4 * window),
        "--host-tier-bytes", str(8 * window), "--prefill-chunk", "512", "--json", str(out),
    ]
    assert kvvm_bench.main(argv) == 0
    report = json.loads(out.read_text())
    copy = report["copy"]
    assert copy["bytes"] > 0 and copy["tokens"] == 256
    assert all(copy[k] > 0 for k in ("kvvm_out_Bps", "kvvm_in_Bps", "plain_out_Bps", "plain_in_Bps"))
    assert copy["tier"]["swaps_out"] == copy["tier"]["swaps_in"] == 2 and copy["tier"]["held_bytes"] == 0
    decode = report["decode"]
    assert decode["step_ms_without"]["p50"] > 0 and decode["step_ms_while_swapping"]["p50"] > 0
    assert decode["step_ms_while_copying"]["p50"] > 0 and decode["plain_round_trips_during"] > 0
    assert set(decode["round_trip_call_ms"]) == {"swap_out", "finish_swap_out", "swap_in", "finish_swap_in"}
    whole, cut = decode["caps"]
    assert (whole["max_copy_bytes"], cut["max_copy_bytes"]) == (None, 1)
    assert cut["copies_each_way"] > whole["copies_each_way"] >= 1, "a cap of one byte copies window by window"
    assert [r["tokens"] for r in report["crossover"]["rows"]] == [32, 64]
    prefix = report["prefix"]
    assert [(r["tokens"], r["host_hit_tokens"]) for r in prefix["rows"]] == [(32, 32), (64, 64)]
    assert prefix["cache"]["host_hits"] == 2 * 2 and prefix["cache"]["host_entries"] == 0
    trace = report["trace"]
    recompute, swap = trace["recompute"], trace["swap"]
    assert [r["runner"] for r in trace["runs"]] == ["recompute", "swap"]
    assert swap["steps"]["steps"] >= swap["steps"]["decode_steps"] > 0 and swap["swaps"]["out_ms"] > 0
    assert recompute["preempted_requests"] > 0 and recompute["swaps"] is None
    assert swap["preemptions"] > 0
    s = swap["swaps"]
    assert s["swapped_out"] > 0 and s["swapped_in"] == s["swapped_out"] and s["fallbacks"] == 0


def test_fp8_bench_compares_the_logits_on_the_cpu_untimed(tmp_path: Path) -> None:
    """``python -m kvvm_bench fp8 --tiny --device cpu``: the bf16-then-FP8 run's eager steps on a
    CPU (an fp32 model: its cache against FP8), nothing timed: a quarter of the bytes a token,
    four times the tokens in a budget, FP8's teacher-forced logits near the reference's."""
    pytest.importorskip("transformers", reason="skipped: no transformers")
    if not host_available():
        pytest.skip("skipped: no host backend here")
    out = tmp_path / "fp8.json"
    benches = str(Path(__file__).resolve().parents[1] / "benches")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [benches, os.environ.get("PYTHONPATH")])))
    argv = [
        "fp8", "--tiny", "--device", "cpu", "--backend", "host", "--batch", "3", "--prompt", "40",
        "--check-steps", "4", "--budget-gib", "1", "--json", str(out),
    ]
    r = subprocess.run([sys.executable, "-m", "kvvm_bench", *argv], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    ref, fp8 = report["runs"]
    assert (ref["kv_dtype"], fp8["kv_dtype"]) == ("fp32", "fp8")
    assert ref["bytes_per_token"] == 4 * fp8["bytes_per_token"]
    assert report["budget_tokens_ratio"] >= 3.8 and "step_p50_ms" not in fp8
    acc = report["accuracy"]
    assert 0 < acc["mean_abs_logit_diff"] < 0.1 * acc["logit_std_reference"] + 0.05, acc
    assert acc["argmax_checked"] > 0 and acc["argmax_agree_fraction"] >= 0.75, acc
