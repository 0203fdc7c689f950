"""A manager whose budget is a lease from the node's memory broker (``kvvm broker``): managers
of two tenants in one budget, a tenant's ceiling, the bytes one gives back reaching the other,
and the arguments a broker excludes. The broker is the ``kvvm`` binary (``KVVM_BIN``, or the
workspace's build); the host backend holds the memory."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import needs_host

import kvvm

MiB = 1 << 20
#: One window of the geometry below: 2 MiB (the host's granule) of 256-byte tokens.
WINDOW_TOKENS = 8192


def _kvvm_binary() -> str | None:
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


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Path]:
    """A broker of 8 MiB: tenant ``a`` between 2 and 6 MiB, tenant ``b`` anything left."""
    binary = _kvvm_binary()
    if binary is None:
        pytest.skip("skipped: no kvvm binary (cargo build --release -p kvvm-cli, or set KVVM_BIN)")
    socket = tmp_path / "broker.sock"
    daemon = subprocess.Popen(
        [binary, "broker", "--socket", str(socket), "--budget-bytes", "8MiB", "--tenant", "a:2MiB:6MiB", "--tenant", "b"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert daemon.stdout is not None
    line = daemon.stdout.readline()
    assert "listening on" in line, (line, daemon.stderr.read() if daemon.poll() is not None and daemon.stderr else "")
    try:
        yield socket
    finally:
        daemon.terminate()
        assert daemon.wait(timeout=20) == 0


def _sequence(mgr: kvvm.Manager) -> kvvm.Sequence:
    geometry = kvvm.KvGeometry(layers=1, kv_heads=1, head_dim=64, max_tokens=16 * WINDOW_TOKENS)
    plan = kvvm.LayoutPlan(geometry, "token-major", mgr.granule)
    assert plan.mapped_tokens(1) == WINDOW_TOKENS
    return kvvm.Sequence(mgr, plan, 16 * WINDOW_TOKENS)


@needs_host
def test_two_tenants_share_one_budget_and_bytes_given_back_reach_the_other(broker: Path) -> None:
    a = kvvm.Manager("host", broker=broker, tenant="a", lease_batch_bytes=2 * MiB)
    b = kvvm.Manager("host", broker=broker, tenant="b", lease_batch_bytes=2 * MiB)
    assert a.budget_bytes is None and a.leased_bytes == 0
    sa = _sequence(a)
    sa.ensure(3 * WINDOW_TOKENS)
    assert a.snapshot().committed == 6 * MiB and (a.leased_bytes or 0) >= 6 * MiB
    with pytest.raises((kvvm.BackpressureError, kvvm.NeverFitsError)):
        _sequence(a).ensure(1)  # past a's ceiling of 6 MiB
    sb = _sequence(b)
    sb.ensure(WINDOW_TOKENS)
    more = _sequence(b)
    with pytest.raises(kvvm.BackpressureError):
        more.ensure(WINDOW_TOKENS)  # the node's 8 MiB are all in use
    assert more.is_empty
    # a lets go: its lease above two batches goes back to the broker (a message its socket
    # carries without an answer, so b asks again until the broker has read it).
    sa.release()
    a.trim_pool(0)
    assert (a.leased_bytes or 0) <= 4 * MiB
    deadline = time.monotonic() + 20
    while True:
        try:
            more.ensure(WINDOW_TOKENS)
            break
        except kvvm.BackpressureError:
            assert time.monotonic() < deadline, "the bytes a gave back never reached b"
            time.sleep(0.01)
    assert b.snapshot().committed == 4 * MiB
    for s in (sb, more):
        s.release()


def test_a_broker_and_a_local_budget_exclude_each_other(tmp_path: Path) -> None:
    with pytest.raises(kvvm.InvalidArgumentError, match="exclude each other"):
        kvvm.Manager("sim", broker=tmp_path / "broker.sock", budget_bytes=MiB)
    with pytest.raises(kvvm.InvalidArgumentError, match="lease_batch_bytes"):
        kvvm.Manager("sim", broker=tmp_path / "broker.sock", lease_batch_bytes=0)


def test_a_broker_that_is_not_there_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(kvvm.UnavailableError, match="memory broker"):
        kvvm.Manager("sim", broker=tmp_path / "nobody.sock", tenant="a")
    assert kvvm.Manager("sim").leased_bytes is None
