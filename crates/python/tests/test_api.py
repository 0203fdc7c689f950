"""The API over the simulator and the host backend: objects, books, errors, bad input."""

from __future__ import annotations

import pytest

import kvvm
from conftest import MiB, tiny_geometry


def test_backends_open_by_name_and_unknown_names_are_invalid() -> None:
    b = kvvm.open_backend("sim")
    assert b.name == "sim" and not b.addressable
    dev = b.devices()[0]
    assert dev["total_memory"] > 0 and dev["granularity"] > 0
    with pytest.raises(kvvm.InvalidArgumentError, match="unknown backend"):
        kvvm.Backend("nosuch")
    assert "host" in kvvm.BACKEND_NAMES


def test_unavailable_backends_raise_unavailable_or_open() -> None:
    for name in ("cuda", "hip"):
        try:
            b = kvvm.Backend(name)
        except kvvm.UnavailableError as e:
            assert name in str(e).lower() or "unavailable" in str(e).lower()
        else:
            assert b.name == name


def test_manager_arguments_are_checked(sim: kvvm.Manager) -> None:
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.Manager("sim", budget_bytes=0)
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.Manager("sim", granularity="huge")
    with pytest.raises(kvvm.InvalidArgumentError, match="no device 7"):
        kvvm.Manager("sim", device=7)
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.Manager(42)  # type: ignore[arg-type]
    with pytest.raises(kvvm.InvalidArgumentError, match="not a count or size"):
        kvvm.Manager("sim", budget_bytes=-1)
    assert sim.granule == 2 * MiB and sim.budget_bytes == 1 << 30


def test_geometry_and_plan() -> None:
    g = tiny_geometry()
    assert (g.layers, g.kv_heads, g.head_dim, g.dtype, g.bytes_per_token) == (2, 2, 32, "fp16", 512)
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.KvGeometry(0, 2, 32, 10)
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.KvGeometry(2, 2, 32, 10, dtype="int3")
    with pytest.raises(kvvm.InvalidArgumentError, match="not a count or size"):
        kvvm.KvGeometry(2, 2, -32, 10)
    p = kvvm.LayoutPlan(g, "seq-major", 4096)
    assert p.layout == "seq-major" and p.fragments == 4
    assert p.strides()["token"] == 2 * 32 * 2
    assert p.committed_bytes_for_tokens(1) == 4 * 4096
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.LayoutPlan(g, "diagonal", 4096)
    v = kvvm.LayoutPlan(kvvm.KvGeometry.preset("llama-3-8b", 8192), "head-major", 2 * MiB).shareability(4096)
    assert not v["shareable"] and "8192 tokens" in v["reason"]


def test_geometry_from_a_transformers_like_config() -> None:
    class Cfg:
        num_hidden_layers = 32
        num_attention_heads = 32
        num_key_value_heads = 8
        hidden_size = 4096
        torch_dtype = "bfloat16"

    g = kvvm.geometry_from_config(Cfg(), 4096)
    assert (g.layers, g.kv_heads, g.head_dim, g.dtype) == (32, 8, 128, "bf16")
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.geometry_from_config(object(), 10)


def test_sequences_grow_shrink_release_and_keep_the_books(sim: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "token-major", sim.granule)
    s = kvvm.Sequence(sim, plan, max_tokens=1024)
    assert s.is_empty and s.committed_tokens == 0
    assert s.ensure(100) == sim.granule
    assert s.ensure(50) == 0
    assert s.committed_tokens == 100 and s.committed_bytes == sim.granule
    assert sim.snapshot().committed == sim.granule
    addr = s.address
    assert s.ensure(1024) == 0  # 1024 x 512 B = one 512 KiB... within the 2 MiB window
    assert s.address == addr
    assert s.release() == sim.granule
    assert s.is_empty and sim.snapshot().committed == 0
    with pytest.raises(kvvm.TooManyTokensError) as e:
        s.ensure(1025)
    assert e.value.max_tokens == 1024
    with pytest.raises(kvvm.InvalidArgumentError, match="not a count or size"):
        s.ensure(-1)


def test_a_snapshot_prints_every_figure_it_holds(sim: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "token-major", sim.granule)
    s = kvvm.Sequence(sim, plan)
    s.ensure(10)
    snap = sim.snapshot()
    text = repr(snap)
    for name in ("used", "committed", "pooled", "shared", "quarantined", "pending", "budget", "free"):
        assert f"{name}={getattr(snap, name)}" in text, (name, text)
    assert snap.free == (1 << 30) - sim.granule
    assert repr(kvvm.Manager("sim").snapshot()).endswith("budget=None, free=None)")


def test_write_and_read_tokens_round_trip_with_bad_input_refused(sim: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "seq-major", sim.granule)
    s = kvvm.Sequence(sim, plan, max_tokens=256)
    s.ensure(4)
    data = bytes(range(256)) * 8  # 4 tokens x 512 B
    s.write_tokens(0, data)
    assert s.read_tokens(0, 4) == data
    with pytest.raises(kvvm.NotCommittedError):
        s.read_tokens(2, 4)
    with pytest.raises(kvvm.InvalidArgumentError):
        s.write_tokens(0, b"odd length")
    with pytest.raises(kvvm.InvalidArgumentError):
        s.read_tokens(0, 1 << 62)
    with pytest.raises(TypeError):
        s.write_tokens(0, "text")  # type: ignore[arg-type]


def test_backpressure_is_retryable_and_too_big_never_fits() -> None:
    mgr = kvvm.Manager("sim", budget_bytes=8 * MiB)
    # 512 B per token, one fragment: 4096 tokens per 2 MiB window.
    plan = kvvm.LayoutPlan(tiny_geometry(16384), "token-major", mgr.granule)
    a = kvvm.Sequence(mgr, plan)
    b = kvvm.Sequence(mgr, plan)
    a.ensure(12288)  # 6 MiB
    with pytest.raises(kvvm.BackpressureError) as e:
        b.ensure(8192)  # 4 MiB more: 2 MiB short
    assert e.value.retry_after >= 0
    assert e.value.needed_bytes == 4 * MiB and e.value.available_bytes == 2 * MiB
    assert mgr.available_bytes() == e.value.available_bytes, "one figure of what is available"
    assert kvvm.Manager("sim").available_bytes() is None, "no budget: no limit"
    assert b.is_empty, "a refused commit commits nothing"
    a.release()
    b.ensure(8192)  # retrying after memory was freed succeeds
    big = kvvm.Sequence(mgr, kvvm.LayoutPlan(kvvm.KvGeometry(32, 8, 128, 1 << 16), "token-major", mgr.granule))
    with pytest.raises(kvvm.NeverFitsError) as n:
        big.ensure(1 << 16)
    assert n.value.limit == "budget" and n.value.limit_bytes == 8 * MiB
    assert not isinstance(n.value, kvvm.BackpressureError)


def test_a_batch_is_strided_and_its_slots_are_independent(sim: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "seq-major", sim.granule)
    batch = kvvm.SequenceBatch(sim, plan, 4, max_tokens=1024)
    assert len(batch) == 4 and batch.slot_stride == plan.reservation_bytes
    assert [batch[i].address - batch[0].address for i in range(4)] == [i * batch.slot_stride for i in range(4)]
    batch[1].ensure(10)
    assert batch[0].is_empty and not batch[1].is_empty
    assert batch.ensure(20) > 0
    assert batch[-1].committed_tokens == 20
    with pytest.raises(IndexError):
        batch[4]
    with pytest.raises(kvvm.InvalidArgumentError):
        batch.ensure(1, first=3, count=2)
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.SequenceBatch(sim, plan, 0)
    assert batch.release() > 0
    assert sim.snapshot().committed == 0


def test_the_simulator_has_no_addressable_memory(sim: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "seq-major", sim.granule)
    s = kvvm.Sequence(sim, plan)
    s.ensure(1)
    with pytest.raises(kvvm.UnavailableError, match="not addressable"):
        s.view(0)


def test_available_bytes_count_the_windows_a_pre_committer_can_give_back() -> None:
    """A window the pre-committer holds ahead of a sequence's live end is committed (not
    free) yet available: a grant would reclaim it first."""
    mgr = kvvm.Manager("sim", budget_bytes=8 * MiB, precommit=True, headroom_tokens=8)
    plan = kvvm.LayoutPlan(tiny_geometry(16384), "token-major", mgr.granule)
    s = kvvm.Sequence(mgr, plan, precommit=True)
    s.ensure(4096)  # one whole window live; the worker commits the next one ahead
    mgr.wait_precommit_idle()
    assert s.committed_tokens > 4096
    snap = mgr.snapshot()
    assert (snap.committed, snap.free, snap.pooled) == (4 * MiB, 4 * MiB, 0)
    assert mgr.available_bytes() == 6 * MiB
    mgr.stop_precommit()
    other = kvvm.Sequence(mgr, plan)
    other.ensure(12288)  # 6 MiB: granted by reclaiming the window ahead
    assert s.committed_tokens == 4096 and mgr.available_bytes() == 0


def test_pre_committed_sequences_grow_ahead() -> None:
    mgr = kvvm.Manager("sim", precommit=True, headroom_tokens=8)
    plan = kvvm.LayoutPlan(tiny_geometry(8192), "token-major", mgr.granule)
    s = kvvm.Sequence(mgr, plan, precommit=True)
    assert s.precommitted
    s.ensure(10)
    mgr.wait_precommit_idle()
    assert s.committed_tokens >= 10
    stats = mgr.precommit_stats()
    assert stats is not None and stats["inline_commits"] + stats["background_commits"] >= 1
    assert kvvm.Manager("sim").precommit_stats() is None
    mgr.stop_precommit()
    assert s.ensure(5000) > 0  # committed inline once the worker is gone
    assert s.shrink(5000) == 0 and s.committed_tokens == 5000
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.Manager("sim", precommit=True, headroom_tokens=0)


def test_counts_and_sizes_out_of_range_are_invalid_arguments(sim: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "token-major", sim.granule)
    s = kvvm.Sequence(sim, plan)
    for bad in (-1, 1 << 64, -(1 << 70)):
        with pytest.raises(kvvm.InvalidArgumentError, match="not a count or size"):
            s.ensure(bad)
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.SequenceBatch(sim, plan, -3)
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.KvGeometry(2, 1 << 40, 32, 10)
    with pytest.raises(TypeError):
        s.ensure("ten")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        s.ensure(1.5)  # type: ignore[arg-type]
