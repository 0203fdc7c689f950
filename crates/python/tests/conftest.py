"""Fixtures: managers on the host backend (addressable memory, no GPU) and on the simulator;
the benchmarks (``crates/python/benches``, not in the wheel) made importable."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvvm

MiB = 1 << 20

# The benchmarks live beside the package, not in it; their tests import them from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))


def host_available() -> bool:
    """Whether the host backend opens here (Linux with memfd)."""
    try:
        kvvm.Backend("host")
    except kvvm.KvvmError:
        return False
    return True


needs_host = pytest.mark.skipif(
    not host_available(), reason=f"skipped: no host backend on {sys.platform}"
)


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU and kvvm's CUDA backend opens (a driver is loaded)."""
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    try:
        kvvm.Backend("cuda")
    except kvvm.KvvmError:
        return False
    return True


@pytest.fixture
def host() -> Iterator[kvvm.Manager]:
    """A host-backend manager with a 256 MiB budget."""
    if not host_available():
        pytest.skip(f"skipped: no host backend on {sys.platform}")
    mgr = kvvm.Manager("host", budget_bytes=256 * MiB)
    yield mgr
    snap = mgr.snapshot()
    assert snap.quarantined == 0, snap


@pytest.fixture
def sim() -> kvvm.Manager:
    """A simulator manager with a 1 GiB budget."""
    return kvvm.Manager("sim", budget_bytes=1 << 30)


def tiny_geometry(max_tokens: int = 1024, dtype: str = "fp16") -> kvvm.KvGeometry:
    """2 layers, 2 KV heads, head_dim 32: 512 B per token in fp16."""
    return kvvm.KvGeometry(layers=2, kv_heads=2, head_dim=32, max_tokens=max_tokens, dtype=dtype)


def kvvm_binary() -> str | None:
    """The ``kvvm`` binary (it runs the broker): ``KVVM_BIN``, else the workspace's build
    (``CARGO_TARGET_DIR`` or ``target``, release before debug), else one on ``PATH``."""
    named = os.environ.get("KVVM_BIN")
    if named:
        return named
    root = Path(__file__).resolve().parents[3]
    targets = [Path(os.environ["CARGO_TARGET_DIR"])] if os.environ.get("CARGO_TARGET_DIR") else []
    for target in [*targets, root / "target"]:
        for profile in ("release", "debug"):
            candidate = target / profile / "kvvm"
            if candidate.is_file():
                return str(candidate)
    return shutil.which("kvvm")


def tuner_on(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The kernels' autotuners on (:func:`kvvm.kernels.triton_decode.may_tune` true), outside
    the interpreter, the decode kernel's choices forgotten, no stream being captured (no CUDA
    driver here); returns ``kvvm.kernels.triton_decode``. Skips without triton."""
    pytest.importorskip("triton", reason="skipped: no triton")
    import torch

    import kvvm.kernels.triton_decode as td

    monkeypatch.setattr(td, "AUTOTUNE", True)
    monkeypatch.setattr(td, "_INTERPRETED", False)
    monkeypatch.setattr(td, "_TUNED", {})
    monkeypatch.setattr(td, "_TIMINGS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return td
