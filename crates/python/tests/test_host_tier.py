"""The host tier from Python: a sequence's tokens swapped to page-locked host memory and back,
byte-exact at the same address, billed to the host budget while there; refusals that change
nothing; misuse refused."""

from __future__ import annotations

import os

import pytest

import kvvm
from conftest import MiB, needs_host, tiny_geometry


def _written(mgr: kvvm.Manager, tokens: int, precommit: bool = False) -> tuple[kvvm.Sequence, bytes]:
    g = tiny_geometry()
    plan = kvvm.LayoutPlan(g, "head-major", mgr.granule)
    seq = kvvm.Sequence(mgr, plan, precommit=precommit)
    seq.ensure(tokens)
    data = os.urandom(tokens * g.bytes_per_token)
    seq.write_tokens(0, data)
    return seq, data


def _round_trip(mgr: kvvm.Manager, precommit: bool = False) -> None:
    seq, data = _written(mgr, 1000, precommit)
    tier = kvvm.HostTier(mgr, slab_windows=4)
    address, committed = seq.address, mgr.snapshot().committed
    swap = seq.swap_out(tier, 1000)
    assert swap.phase == "copying_out" and swap.tokens == 1000
    released = seq.finish_swap_out(swap)
    assert swap.phase == "on_host" and seq.is_empty and released > 0
    assert mgr.snapshot().committed == committed - released
    host = mgr.host_snapshot()
    assert host.committed == swap.bytes == tier.stats()["held_bytes"] > 0
    seq.swap_in(swap)
    assert swap.phase == "copying_in"
    copied = seq.finish_swap_in(swap)
    assert swap.phase == "done" and copied > 0 and swap.bytes == 0
    assert seq.address == address and seq.read_tokens(0, 1000) == data
    stats = tier.stats()
    assert stats["swaps_out"] == stats["swaps_in"] == 1 and stats["held_bytes"] == 0
    assert mgr.host_snapshot().committed == 0
    del swap
    assert tier.trim() > 0 and mgr.host_snapshot().used == 0


def test_round_trip_on_the_simulator(sim: kvvm.Manager) -> None:
    _round_trip(sim)


@needs_host
def test_round_trip_on_the_host_backend(host: kvvm.Manager) -> None:
    _round_trip(host)


def test_copies_are_cut_at_64_mib_by_default_and_at_what_is_asked(sim: kvvm.Manager) -> None:
    """A sequence of 1100 tokens of 128 KiB (69 adjacent 2 MiB windows, 138 MiB) moves in
    copies of at most 64 MiB by default, in one copy with ``max_copy_bytes=None``, in copies
    of 16 MiB when asked; byte-exact each way."""
    g = kvvm.KvGeometry(layers=32, kv_heads=8, head_dim=128, max_tokens=2048, dtype="bf16")
    seq = kvvm.Sequence(sim, kvvm.LayoutPlan(g, "token-major", sim.granule))
    seq.ensure(1100)
    data = os.urandom(4096) * (1100 * g.bytes_per_token // 4096)
    seq.write_tokens(0, data)
    for tier, copies in (
        (kvvm.HostTier(sim), 3),
        (kvvm.HostTier(sim, max_copy_bytes=None), 1),
        (kvvm.HostTier(sim, max_copy_bytes=16 * MiB), 9),
    ):
        swap = seq.swap_out(tier, 1100)
        assert swap.copies == copies
        seq.finish_swap_out(swap)
        seq.swap_in(swap)
        assert swap.copies == copies
        seq.finish_swap_in(swap)
        assert seq.read_tokens(0, 1100) == data
        del swap
        tier.trim()


def test_round_trip_of_a_precommitted_sequence() -> None:
    mgr = kvvm.Manager("sim", budget_bytes=1 << 30, precommit=True)
    _round_trip(mgr, precommit=True)
    mgr.wait_precommit_idle()
    mgr.stop_precommit()


def test_a_spent_host_budget_refuses_and_changes_nothing() -> None:
    mgr = kvvm.Manager("sim", budget_bytes=1 << 30, host_budget_bytes=2 * MiB)
    seq, data = _written(mgr, 1000)
    tier = kvvm.HostTier(mgr)
    with pytest.raises((kvvm.NeverFitsError, kvvm.BackpressureError)):
        seq.swap_out(tier, 1000)
    assert seq.read_tokens(0, 1000) == data and mgr.host_snapshot().used == 0


def test_misuse_is_refused(sim: kvvm.Manager) -> None:
    seq, _ = _written(sim, 100)
    tier = kvvm.HostTier(sim)
    swap = seq.swap_out(tier, 100)
    with pytest.raises(kvvm.InvalidArgumentError, match="copying_out"):
        seq.swap_in(swap)
    other, _ = _written(sim, 100)
    with pytest.raises(kvvm.InvalidArgumentError, match="belongs to"):
        other.finish_swap_out(swap)
    seq.finish_swap_out(swap)
    with pytest.raises(kvvm.NotCommittedError):
        other.swap_out(tier, 10_000)
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.Manager("sim", host_budget_bytes=0)


@needs_host
def test_a_swap_does_not_release_memory_under_a_view(host: kvvm.Manager) -> None:
    seq, data = _written(host, 100)
    tier = kvvm.HostTier(host)
    view = seq.view(0)
    swap = seq.swap_out(tier, 100)
    with pytest.raises(kvvm.ViewsAliveError):
        seq.finish_swap_out(swap)
    assert swap.phase == "copying_out" and seq.read_tokens(0, 100) == data
    del view
    seq.finish_swap_out(swap)
    assert swap.phase == "on_host" and seq.is_empty
