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
    finally:
        engine.close()


def test_without_the_flags_the_engine_has_none_of_them() -> None:
    engine, _ = build(_parser().parse_args(_BASE))
    try:
        assert engine.cache.kv_scales is None and engine.swapper is None
        assert not engine.cache.cascade and not engine.runner.programmatic_launches
    finally:
        engine.close()


def test_an_unknown_kv_dtype_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args([*_BASE, "--kv-dtype", "int4"])
