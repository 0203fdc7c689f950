"""The OpenAI server's command line (``python -m kvvm.serving.http``): what its flags make of
the engine, on the CPU (the host backend, a tiny random model, no warm-up)."""

from __future__ import annotations

import pytest
from conftest import host_available

pytest.importorskip("torch", reason="skipped: no torch")
pytest.importorskip("transformers", reason="skipped: no transformers")
pytest.importorskip("starlette", reason="skipped: no starlette")
pytest.importorskip("uvicorn", reason="skipped: no uvicorn")

from kvvm.serving.http.__main__ import _parser, build  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

_BASE = ["--random-config", "tiny", "--device", "cpu", "--slots", "2", "--max-len", "64", "--no-warmup"]


def test_the_engines_features_are_the_flags() -> None:
    """FP8 K/V, the host tier, the cascade and programmatic launches reach the engine as asked
    (the host tier on the manager the server makes, which holds its budget)."""
    args = _parser().parse_args(
        [*_BASE, "--kv-dtype", "fp8_e4m3", "--host-tier-bytes", str(16 << 20), "--cascade", "--programmatic-launches"]
    )
    engine, _ = build(args)
    try:
        assert engine.cache.kv_scales is not None, "K/V held in FP8, with their scales"
        assert engine.swapper is not None, "preempted requests swap to the host tier"
        assert engine.manager.host_snapshot().budget == 16 << 20, "its bytes the host's budget"
        assert engine.cache.cascade and engine.prefix_cache is not None
        assert engine.runner.programmatic_launches
        assert engine.swapper.mode == "auto" and engine.kv.host_level, "evicted prefixes kept on the host"
    finally:
        engine.close()


def test_the_swap_mode_and_the_prefix_host_level_are_the_flags() -> None:
    """``--swap`` reaches the swapper; ``--no-prefix-host`` keeps evicted prefixes off the host
    tier (the tier still swaps); ``--prefill-batch-tokens`` reaches the scheduler."""
    args = _parser().parse_args(
        [*_BASE, "--host-tier-bytes", str(16 << 20), "--swap", "always", "--no-prefix-host",
         "--prefill-batch-tokens", "96"]
    )
    engine, _ = build(args)
    try:
        assert engine.swapper is not None and engine.swapper.mode == "always"
        assert not engine.kv.host_level
        assert engine.scheduler.prefill_batch_tokens == 96
    finally:
        engine.close()


def test_without_the_flags_the_engine_has_none_of_them() -> None:
    engine, _ = build(_parser().parse_args(_BASE))
    try:
        assert engine.cache.kv_scales is None and engine.swapper is None
        assert not engine.cache.cascade and not engine.runner.programmatic_launches
        assert not engine.kv.host_level
    finally:
        engine.close()


def test_an_unknown_kv_dtype_or_swap_mode_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args([*_BASE, "--kv-dtype", "int4"])
    with pytest.raises(SystemExit):
        _parser().parse_args([*_BASE, "--swap", "sometimes"])
