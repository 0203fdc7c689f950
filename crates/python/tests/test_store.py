"""SequenceBatch.store: a decode step's K and V written into every slot with one row copy per
K and V (a row per slot), checked on the host backend with sources in kvvm memory and in
ordinary host memory (numpy arrays)."""

from __future__ import annotations

import numpy as np
import pytest

import kvvm
from conftest import needs_host, tiny_geometry

HEADS, DIM = 2, 32


def token_of(raw: bytes) -> np.ndarray:
    """One token in the host layout [layer][K, V][head][dim] (fp16)."""
    return np.frombuffer(raw, dtype=np.float16).reshape(2, 2, HEADS, DIM)


def source(host: kvvm.Manager, plan: kvvm.LayoutPlan, slots: int, seed: int) -> tuple[kvvm.Sequence, np.ndarray, np.ndarray]:
    """A scratch sequence holding `slots` tokens of known K and V, and two arrays over it shaped
    [slots, kv_heads, 1, head_dim] (slot i is the scratch's token i): sources in mapped memory."""
    scratch = kvvm.Sequence(host, plan)
    scratch.ensure(slots)
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((slots, 2, 2, HEADS, DIM)).astype(np.float16)
    scratch.write_tokens(0, data.tobytes())
    k = np.from_dlpack(scratch.view(1, "key", end=slots)).transpose(1, 0, 2)[:, :, None, :]
    v = np.from_dlpack(scratch.view(1, "value", end=slots)).transpose(1, 0, 2)[:, :, None, :]
    return scratch, k, v


@needs_host
@pytest.mark.parametrize("layout", ["seq-major", "token-major"])
def test_store_writes_one_token_of_a_layer_into_every_slot(host: kvvm.Manager, layout: str) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), layout, host.granule)
    batch = kvvm.SequenceBatch(host, plan, 3, max_tokens=256)
    batch.ensure(8)
    assert batch.can_store(1)
    scratch, k, v = source(host, plan, 3, seed=1)
    batch.store(1, 5, k, v)
    for slot in range(3):
        tok = token_of(batch[slot].read_tokens(5, 1))
        np.testing.assert_array_equal(tok[1, 0], k[slot, :, 0])
        np.testing.assert_array_equal(tok[1, 1], v[slot, :, 0])
        assert not tok[0].any(), "layer 0 was written"
        assert not token_of(batch[slot].read_tokens(4, 1)).any()
        assert not token_of(batch[slot].read_tokens(6, 1)).any()
    # A run of slots only.
    batch.store(0, 7, k[:2], v[:2], first=1, count=2)
    assert not token_of(batch[0].read_tokens(7, 1)).any()
    np.testing.assert_array_equal(token_of(batch[2].read_tokens(7, 1))[0, 0], k[1, :, 0])
    del k, v
    scratch.release()
    assert batch.release() > 0


@needs_host
def test_seq_major_stores_several_tokens_per_row(host: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "seq-major", host.granule)
    batch = kvvm.SequenceBatch(host, plan, 2, max_tokens=256)
    batch.ensure(16)
    assert batch.can_store(4)
    scratch = kvvm.Sequence(host, plan)
    scratch.ensure(8)
    scratch.write_tokens(0, np.arange(8 * 2 * 2 * HEADS * DIM, dtype=np.float16).tobytes())
    # Slot i's source is the scratch's tokens 4i..4i+4 of layer 0, [H, 4, D] per slot, which
    # seq-major keeps as one run ordered [token][head][dim]: give it as [2, H, 4, D].
    full = np.from_dlpack(scratch.view(0, "key", end=8))  # [H, 8, D], strides (D, H*D, 1)
    src = np.lib.stride_tricks.as_strided(
        full, shape=(2, HEADS, 4, DIM), strides=(4 * full.strides[1], full.strides[0], full.strides[1], full.strides[2])
    )
    batch.store(0, 3, src, src)
    for slot in range(2):
        for t in range(4):
            tok = token_of(batch[slot].read_tokens(3 + t, 1))
            np.testing.assert_array_equal(tok[0, 0], src[slot, :, t])
            np.testing.assert_array_equal(tok[0, 1], src[slot, :, t])
    del full, src
    scratch.release()
    batch.release()


@needs_host
def test_store_refuses_what_it_cannot_write_and_writes_nothing(host: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "token-major", host.granule)
    batch = kvvm.SequenceBatch(host, plan, 3, max_tokens=256)
    batch.ensure(4)
    scratch, k, v = source(host, plan, 3, seed=2)
    with pytest.raises(kvvm.NotCommittedError):
        batch.store(0, 4, k, v)
    with pytest.raises(kvvm.InvalidArgumentError, match="shape"):
        batch.store(0, 1, k[:2], v[:2])
    with pytest.raises(kvvm.InvalidArgumentError, match="layer"):
        batch.store(2, 1, k, v)
    with pytest.raises(kvvm.InvalidArgumentError, match="dtype"):
        batch.store(0, 1, k.astype(np.float32), v.astype(np.float32))
    with pytest.raises(kvvm.InvalidArgumentError, match="numpy"):
        batch.store(0, 1, [1, 2, 3], v)
    with pytest.raises(kvvm.InvalidArgumentError, match="strides"):
        batch.store(0, 1, k[:, ::-1], v)
    # Two tokens per row do not make one run in token-major.
    assert not batch.can_store(2)
    two = np.zeros((3, 2, HEADS, DIM), dtype=np.float16).transpose(0, 2, 1, 3)
    with pytest.raises(kvvm.InvalidArgumentError, match="layout"):
        batch.store(0, 1, two, two)
    with pytest.raises(kvvm.InvalidArgumentError, match="stream"):
        batch.store(0, 1, k, v, stream=object())
    for slot in range(3):
        assert not any(batch[slot].read_tokens(0, 4))
    del k, v
    scratch.release()
    batch.release()
    with pytest.raises(kvvm.NotCommittedError):
        batch.store(0, 0, np.zeros((3, HEADS, 1, DIM), dtype=np.float16), np.zeros((3, HEADS, 1, DIM), dtype=np.float16))


@needs_host
def test_head_major_cannot_store_a_row_per_slot(host: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "head-major", host.granule)
    batch = kvvm.SequenceBatch(host, plan, 2, max_tokens=256)
    assert not batch.can_store(1)
    batch.release()


@needs_host
def test_store_into_a_read_only_prefix_is_refused() -> None:
    mgr = kvvm.Manager("host", budget_bytes=64 << 20)
    plan = kvvm.LayoutPlan(tiny_geometry(16384), "token-major", mgr.granule)
    batch = kvvm.SequenceBatch(mgr, plan, 2)
    prefix = batch[0].own_prefix(4096)
    prefix.seal()
    prefix.attach(batch[1])
    batch.ensure(4100)
    scratch, k, v = source(mgr, plan, 2, seed=3)
    with pytest.raises(kvvm.WriteIntoSharedPrefixError):
        batch.store(0, 10, k, v)
    batch.store(0, 4096, k, v)
    np.testing.assert_array_equal(token_of(batch[1].read_tokens(4096, 1))[0, 0], k[1, :, 0])


def test_store_on_the_simulator_is_unavailable(sim: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "token-major", sim.granule)
    batch = kvvm.SequenceBatch(sim, plan, 2, max_tokens=256)
    batch.ensure(2)
    stray = np.zeros((2, HEADS, 1, DIM), dtype=np.float16)
    with pytest.raises(kvvm.UnavailableError):
        batch.store(0, 0, stray, stray)


@needs_host
@pytest.mark.parametrize("layout", ["seq-major", "token-major"])
def test_store_takes_ordinary_numpy_arrays(host: kvvm.Manager, layout: str) -> None:
    """A step's K and V in plain host memory (not kvvm's): copied row by row into the slots."""
    plan = kvvm.LayoutPlan(tiny_geometry(), layout, host.granule)
    batch = kvvm.SequenceBatch(host, plan, 3, max_tokens=256)
    batch.ensure(8)
    rng = np.random.default_rng(7)
    k = rng.standard_normal((3, HEADS, 1, DIM)).astype(np.float16)
    v = rng.standard_normal((3, HEADS, 1, DIM)).astype(np.float16)
    batch.store(0, 2, k, v)
    for slot in range(3):
        tok = token_of(batch[slot].read_tokens(2, 1))
        np.testing.assert_array_equal(tok[0, 0], k[slot, :, 0])
        np.testing.assert_array_equal(tok[0, 1], v[slot, :, 0])
        assert not tok[1].any()
    # A source that is not one run per slot is still refused before anything is written.
    wide = np.zeros((3, HEADS, 1, 2 * DIM), dtype=np.float16)[..., ::2]
    with pytest.raises(kvvm.InvalidArgumentError):
        batch.store(1, 3, wide, wide)
    assert not token_of(batch[0].read_tokens(3, 1)).any()
    assert batch.release() > 0


@needs_host
def test_an_fp8_store_takes_e4m3_and_refuses_e5m2(host: kvvm.Manager) -> None:
    """An FP8 cache holds e4m3 codes: a torch float8_e4m3fn source is stored byte for byte,
    a float8_e5m2 one (the same size, another format) is refused and nothing is written."""
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    plan = kvvm.LayoutPlan(tiny_geometry(dtype="fp8"), "token-major", host.granule)
    batch = kvvm.SequenceBatch(host, plan, 3, max_tokens=256)
    batch.ensure(2)
    k = (torch.arange(3 * HEADS * DIM) % 200 - 100).float().reshape(3, HEADS, 1, DIM) / 8
    v = -k
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    with pytest.raises(kvvm.InvalidArgumentError, match="dtype"):
        batch.store(0, 1, k.to(e5m2), v.to(e5m2))
    assert not any(batch[s].read_tokens(1, 1).strip(b"\0") for s in range(3)), "nothing written"
    batch.store(0, 1, k.to(e4m3), v.to(e4m3))
    for s in range(3):
        token = batch[s].read_tokens(1, 1)  # [layer][K, V][head][dim], one byte an element
        layer0 = token[: 2 * HEADS * DIM]
        assert layer0[: HEADS * DIM] == k[s, :, 0].to(e4m3).view(torch.uint8).numpy().tobytes()
        assert layer0[HEADS * DIM :] == v[s, :, 0].to(e4m3).view(torch.uint8).numpy().tobytes()
