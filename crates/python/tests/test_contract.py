"""The API keeps its documented contract where a careless call used to slip: token ids, the
buffers write_tokens takes, precommit without a pre-committer, budgets past the device,
admissions of a sequence in use or of another manager, a batch too large for the address
space, and what a released sequence is."""

from __future__ import annotations

import numpy as np
import pytest

import kvvm
from conftest import host_available, needs_host, tiny_geometry


def plan_of(mgr: kvvm.Manager, layout: str = "seq-major") -> kvvm.LayoutPlan:
    return kvvm.LayoutPlan(tiny_geometry(), layout, mgr.granule)


def test_a_bad_token_id_is_an_invalid_argument_naming_it(sim: kvvm.Manager) -> None:
    plan = plan_of(sim)
    cache = kvvm.PrefixCache(sim, plan)
    seq = kvvm.Sequence(sim, plan, 256)
    for ids, shown in [([1, 2, -1], "token_ids[2] = -1"), ([2**32], "token_ids[0] = 4294967296")]:
        with pytest.raises(kvvm.InvalidArgumentError, match=r"0\.\.=4294967295") as e:
            cache.admit(seq, ids)
        assert shown in str(e.value)
        assert not isinstance(e.value, OverflowError)
    with pytest.raises(TypeError):
        cache.admit(seq, ["a"])  # type: ignore[list-item]
    assert seq.is_empty


def test_write_tokens_takes_any_bytes_like_object(sim: kvvm.Manager) -> None:
    plan = plan_of(sim)
    bpt = plan.geometry.bytes_per_token
    seq = kvvm.Sequence(sim, plan, 256)
    seq.ensure(8)
    raw = bytes(range(256)) * (bpt // 256)
    fp16 = np.frombuffer(raw, dtype=np.float16).copy()
    for i, data in enumerate(
        [raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, dtype=np.uint8), fp16]
    ):
        seq.write_tokens(i, data)
        assert seq.read_tokens(i, 1) == raw, type(data)
    with pytest.raises(TypeError, match="bytes-like"):
        seq.write_tokens(0, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(kvvm.InvalidArgumentError, match="C-contiguous"):
        seq.write_tokens(0, np.concatenate([fp16, fp16])[::2])


def test_precommit_needs_a_manager_with_a_pre_committer(sim: kvvm.Manager) -> None:
    plan = plan_of(sim)
    with pytest.raises(kvvm.InvalidArgumentError, match="precommit=True"):
        kvvm.Sequence(sim, plan, precommit=True)
    with pytest.raises(kvvm.InvalidArgumentError, match="precommit=True"):
        kvvm.SequenceBatch(sim, plan, 2, precommit=True)
    mgr = kvvm.Manager("sim", precommit=True, headroom_tokens=8)
    assert kvvm.Sequence(mgr, plan, precommit=True).precommitted
    mgr.stop_precommit()


def test_a_budget_past_the_device_is_refused() -> None:
    with pytest.raises(kvvm.InvalidArgumentError, match="exceeds the memory of device 0"):
        kvvm.Manager("sim", budget_bytes=2**62)
    if host_available():
        with pytest.raises(kvvm.InvalidArgumentError, match="exceeds the memory"):
            kvvm.Manager("host", budget_bytes=2**62)
    assert kvvm.Manager("sim", budget_bytes=1 << 30).budget_bytes == 1 << 30


def test_admitting_a_sequence_in_use_says_so(sim: kvvm.Manager) -> None:
    plan = plan_of(sim)
    cache = kvvm.PrefixCache(sim, plan)
    seq = kvvm.Sequence(sim, plan, 256)
    seq.ensure(10)
    with pytest.raises(kvvm.InvalidArgumentError, match="in use") as e:
        cache.admit(seq, list(range(40)))
    assert "plan mismatch" not in str(e.value)


def test_a_prefix_cache_refuses_another_managers_sequence_at_once(sim: kvvm.Manager) -> None:
    other = kvvm.Manager("sim", budget_bytes=1 << 30)
    plan = plan_of(sim)
    cache = kvvm.PrefixCache(sim, plan)
    foreign = kvvm.Sequence(other, plan, 256)
    with pytest.raises(kvvm.InvalidArgumentError, match="another manager"):
        cache.admit(foreign, list(range(40)))
    assert foreign.is_empty
    theirs = kvvm.PrefixCache(other, plan)
    theirs.admit(foreign, list(range(40)))
    with pytest.raises(kvvm.InvalidArgumentError, match="another manager"):
        cache.publish(foreign)
    assert cache.stats()["cached_entries"] == 0


@needs_host
def test_a_batch_past_the_address_space_says_address_space(host: kvvm.Manager) -> None:
    plan = plan_of(host)
    with pytest.raises(kvvm.OutOfMemoryError, match="address space, not memory"):
        kvvm.SequenceBatch(host, plan, 10**9)
    assert host.snapshot().used == 0


def test_a_released_sequence_keeps_its_reservation_and_grows_again(sim: kvvm.Manager) -> None:
    """Release unmaps and keeps the address range, by design (a slot is reused for the next
    request): ensure after release grows the same sequence again; nothing is 'released for
    good' here, so no ReleasedError."""
    plan = plan_of(sim)
    seq = kvvm.Sequence(sim, plan, 256)
    base = seq.address
    seq.ensure(100)
    assert seq.release() > 0 and seq.is_empty
    assert sim.snapshot().committed == 0
    seq.ensure(50)
    assert seq.address == base and seq.committed_tokens >= 50
    assert "reservation is kept" in (kvvm.Sequence.release.__doc__ or "")
    seq.release()


def test_geometry_from_config_reads_dtype_not_the_deprecated_torch_dtype() -> None:
    class Config:
        num_hidden_layers = 2
        num_attention_heads = 4
        num_key_value_heads = 2
        hidden_size = 128
        dtype = None

        @property
        def torch_dtype(self) -> str:
            raise AssertionError("torch_dtype is deprecated and must not be read")

    assert kvvm.geometry_from_config(Config(), 64).dtype == "bf16"
    c = Config()
    c.dtype = "float32"  # type: ignore[assignment]
    assert kvvm.geometry_from_config(c, 64).dtype == "fp32"

    class Old:
        num_hidden_layers = 2
        num_attention_heads = 4
        hidden_size = 128
        torch_dtype = "float16"

    assert kvvm.geometry_from_config(Old(), 64).dtype == "fp16"
