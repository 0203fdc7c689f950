"""Zero-copy numpy views of kvvm memory on the host backend: layouts, batches, read-only
prefixes enforced by the MMU, and the lifetime rules."""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
import textwrap
from collections.abc import Callable

import numpy as np
import pytest

import kvvm
from conftest import needs_host, tiny_geometry

LAYOUTS = ["head-major", "seq-major", "token-major"]


def host_token(raw: bytes, layers: int = 2, heads: int = 2, dim: int = 32) -> np.ndarray:
    """One token in the host layout [layer][K, V][head][dim] (fp16)."""
    return np.frombuffer(raw, dtype=np.float16).reshape(layers, 2, heads, dim)


@needs_host
@pytest.mark.parametrize("layout", LAYOUTS)
def test_numpy_writes_through_a_view_are_seen_by_read_tokens(host: kvvm.Manager, layout: str) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), layout, host.granule)
    s = kvvm.Sequence(host, plan)
    s.ensure(40)
    v = s.view(1, "value", end=40)
    assert v.shape == [2, 40, 32] and v.dtype == "fp16" and not v.readonly
    a = np.from_dlpack(v)
    assert a.shape == (2, 40, 32) and a.dtype == np.float16 and a.flags.writeable
    a[1, 7, :] = np.arange(32, dtype=np.float16)
    tok = host_token(s.read_tokens(7, 1))
    np.testing.assert_array_equal(tok[1, 1, 1], np.arange(32, dtype=np.float16))
    assert not tok[1, 0].any() and not tok[0].any()
    # And the other way: bytes written by the driver copy appear in the view.
    raw = np.full((1, 2, 2, 2, 32), 3.0, dtype=np.float16).tobytes()
    s.write_tokens(9, raw)
    assert (a[:, 9, :] == 3.0).all()
    assert a.__array_interface__["data"][0] == v.data_ptr
    del a, v


@needs_host
@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_strided_array_per_layer_over_a_batch(host: kvvm.Manager, layout: str) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), layout, host.granule)
    batch = kvvm.SequenceBatch(host, plan, 3, max_tokens=512)
    batch.ensure(16)
    k = np.from_dlpack(batch.view(0, "key"))
    assert k.shape == (3, 2, 16, 32)
    assert k.strides[0] == batch.slot_stride
    for slot in range(3):
        k[slot, :, 5, :] = slot + 1
    for slot in range(3):
        tok = host_token(batch[slot].read_tokens(5, 1))
        assert (tok[0, 0] == slot + 1).all() and not tok[0, 1].any()
    sub = np.from_dlpack(batch.view(0, "key", first=1, count=2, start=5, end=6))
    assert sub.shape == (2, 2, 1, 32) and (sub[:, :, 0] == np.array([2, 3])[:, None, None]).all()
    del k, sub
    assert batch.release() > 0


@needs_host
@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_array_of_every_layer_aliases_the_per_layer_views(host: kvvm.Manager, layout: str) -> None:
    geo = tiny_geometry()
    plan = kvvm.LayoutPlan(geo, layout, host.granule)
    batch = kvvm.SequenceBatch(host, plan, 3, max_tokens=512)
    batch.ensure(16)
    every = np.from_dlpack(batch.view_all())
    assert every.shape == (geo.layers, 2, 3, geo.kv_heads, 16, geo.head_dim)
    for layer in range(geo.layers):
        for kv, kind in enumerate(("key", "value")):
            every[layer, kv, :, :, 7, :] = 10 * layer + kv + 1
    for layer in range(geo.layers):
        for kv, kind in enumerate(("key", "value")):
            one = np.from_dlpack(batch.view(layer, kind, start=7, end=8))
            assert (one == 10 * layer + kv + 1).all(), (layer, kind)
            del one
    part = np.from_dlpack(batch.view_all(start=7, end=8, first=1, count=2))
    assert part.shape == (geo.layers, 2, 2, geo.kv_heads, 1, geo.head_dim)
    with pytest.raises(kvvm.NotCommittedError):
        batch.view_all(end=17)
    del every, part
    assert batch.release() > 0


@needs_host
def test_views_are_refused_past_the_committed_tokens_unless_asked(host: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "seq-major", host.granule)
    s = kvvm.Sequence(host, plan)
    s.ensure(10)
    with pytest.raises(kvvm.NotCommittedError):
        s.view(0, end=11)
    with pytest.raises(kvvm.TooManyTokensError):
        s.view(0, end=1025, allow_uncommitted=True)
    with pytest.raises(kvvm.InvalidArgumentError):
        s.view(2)
    with pytest.raises(kvvm.InvalidArgumentError):
        s.view(0, kind="query")
    full = s.view(0, end=1024, allow_uncommitted=True)
    assert full.shape == [2, 1024, 32]
    del full


@needs_host
def test_release_and_shrink_are_refused_while_a_view_lives(host: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "token-major", host.granule)
    s = kvvm.Sequence(host, plan)
    s.ensure(100)
    a = np.from_dlpack(s.view(0))
    assert s.views == 1
    with pytest.raises(kvvm.ViewsAliveError) as e:
        s.release()
    assert e.value.views == 1
    with pytest.raises(kvvm.ViewsAliveError):
        s.shrink(0)
    a[:] = 1  # still mapped
    del a
    gc.collect()
    assert s.views == 0
    assert s.release() > 0


def _garbage(view: object) -> None:
    """Leaves ``view`` reachable from nothing but a reference cycle (as a frame an exception's
    traceback keeps would)."""
    cycle: list[object] = [view]
    cycle.append(cycle)


#: Operations live views refuse, made ready on a sequence ``s`` of 100 committed tokens, an
#: empty one ``e`` (and the batch of both), a host tier and a prefix cache: each gives the
#: call to make.
_REFUSED_WHILE_VIEWED: dict[str, Callable[..., Callable[[], object]]] = {
    "release": lambda s, e, batch, tier, cache: s.release,
    "shrink": lambda s, e, batch, tier, cache: functools.partial(s.shrink, 0),
    "forget tokens": lambda s, e, batch, tier, cache: functools.partial(s.forget_before, 0),
    "release the batch": lambda s, e, batch, tier, cache: batch.release,
    "admit a request": lambda s, e, batch, tier, cache: functools.partial(cache.admit, e, list(range(40))),
    "finish a swap out": lambda s, e, batch, tier, cache: functools.partial(s.finish_swap_out, s.swap_out(tier, 100)),
}


@needs_host
@pytest.mark.parametrize("op", list(_REFUSED_WHILE_VIEWED))
def test_a_view_only_a_reference_cycle_holds_is_collected_before_a_refusal(host: kvvm.Manager, op: str) -> None:
    """A view that nothing but a cycle holds is garbage: the operation goes ahead with the
    collector off (its refusal does not depend on when the collector last ran), while a view
    something still holds keeps refusing it."""
    plan = kvvm.LayoutPlan(tiny_geometry(), "token-major", host.granule)

    tier, cache = kvvm.HostTier(host), kvvm.PrefixCache(host, plan)
    gc.disable()
    try:
        batch = kvvm.SequenceBatch(host, plan, 2, max_tokens=512)
        s, e = batch[0], batch[1]
        s.ensure(100)
        held = s.view(0) if op != "admit a request" else e.view(0, end=16, allow_uncommitted=True)
        run = _REFUSED_WHILE_VIEWED[op](s, e, batch, tier, cache)
        with pytest.raises(kvvm.ViewsAliveError, match=op):
            run()
        _garbage(held)
        del held
        run()
        assert s.views == e.views == 0
    finally:
        gc.enable()


@needs_host
def test_a_view_keeps_the_memory_of_a_dropped_sequence_alive(host: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "token-major", host.granule)
    s = kvvm.Sequence(host, plan)
    s.ensure(10)
    a = np.from_dlpack(s.view(0))
    a[:] = 5
    del s
    gc.collect()
    assert (a == 5).all()  # still mapped: the export holds the sequence
    assert host.snapshot().committed > 0
    del a
    gc.collect()
    assert host.snapshot().committed == 0


@needs_host
def test_a_shared_prefix_is_billed_once_and_read_only() -> None:
    mgr = kvvm.Manager("host", budget_bytes=64 << 20)
    # 512 B per token, one fragment: 4096 tokens per 2 MiB window.
    plan = kvvm.LayoutPlan(tiny_geometry(16384), "token-major", mgr.granule)
    batch = kvvm.SequenceBatch(mgr, plan, 4)
    owner = batch[0]
    prefix = owner.own_prefix(5000)
    assert prefix.shared_tokens == 4096 and not prefix.sealed
    w = np.from_dlpack(owner.view(0, "key", end=5000))
    w[:, :4096, :] = 7
    w[:, 4096:, :] = 8
    prefix.seal()
    del w
    for i in range(1, 4):
        assert prefix.attach(batch[i]) == mgr.granule
        # Its own: the window the prefix's tail (tokens 4096..5000) was copied into.
        assert batch[i].shared_tokens == 4096 and batch[i].owned_bytes == mgr.granule
    snap = mgr.snapshot()
    assert snap.shared == prefix.bytes == 2 * mgr.granule
    ro = batch[2].view(0, "key", end=4096)
    assert ro.readonly
    r = np.from_dlpack(ro)
    assert not r.flags.writeable and (r == 7).all()
    with pytest.raises(ValueError):
        r[0, 0, 0] = 1
    with pytest.raises(kvvm.WriteIntoSharedPrefixError):
        batch[2].write_tokens(0, bytes(512))
    # The tail tokens are each sharer's own, copied.
    batch[2].ensure(5000)
    assert batch[2].owned_bytes == mgr.granule
    straddling = batch[2].view(0, "key", end=5000)
    assert not straddling.readonly
    tail = np.from_dlpack(batch[2].view(0, "key", start=4096, end=5000))
    assert (tail == 8).all()
    del r, ro, straddling, tail
    with pytest.raises(kvvm.InvalidArgumentError, match="in use"):
        prefix.attach(batch[2])
    with pytest.raises(kvvm.NotShareableError):
        batch[3].release()
        batch[3].own_prefix(0)


@needs_host
def test_the_mmu_enforces_a_read_only_prefix_in_a_child_process() -> None:
    code = textwrap.dedent(
        """
        import ctypes, numpy as np, kvvm
        mgr = kvvm.Manager("host")
        plan = kvvm.LayoutPlan(kvvm.KvGeometry(2, 2, 32, 16384, dtype="fp16"), "token-major", mgr.granule)
        b = kvvm.SequenceBatch(mgr, plan, 2)
        p = b[0].own_prefix(4096)
        np.from_dlpack(b[0].view(0, end=4096))[:] = 9
        p.seal()
        p.attach(b[1])
        v = b[1].view(0, end=4096)
        assert (np.from_dlpack(v) == 9).all()
        print("read ok", flush=True)
        ctypes.memset(v.data_ptr, 0, 2)   # a store through the read-only mapping
        print("store did not fault", flush=True)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "read ok" in r.stdout, r.stderr
    assert "store did not fault" not in r.stdout
    assert r.returncode == -11, (r.returncode, r.stderr)  # SIGSEGV


@needs_host
def test_dlpack_protocol_details(host: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(dtype="fp32"), "seq-major", host.granule)
    s = kvvm.Sequence(host, plan)
    s.ensure(3)
    v = s.view(0)
    assert v.__dlpack_device__() == (1, 0)
    with pytest.raises(BufferError):
        v.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        v.__dlpack__(dl_device=(2, 0))
    a = np.from_dlpack(v)
    assert a.dtype == np.float32
    cap = v.__dlpack__()
    assert type(cap).__name__ == "PyCapsule"
    del cap, a, v


@needs_host
def test_prefix_cache_admits_publishes_and_hits(host: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(16384), "token-major", host.granule)
    cache = kvvm.PrefixCache(host, plan)
    assert cache.block_tokens == 16
    batch = kvvm.SequenceBatch(host, plan, 2)
    ids = list(range(5000))
    first = cache.admit(batch[0], ids)
    assert first["hit_tokens"] == 0 and first["owned_prefix_tokens"] == 4992
    with pytest.raises(kvvm.PrefixNotWrittenError):
        cache.publish(batch[0])
    batch[0].write_tokens(0, bytes(range(256)) * (2 * 5000))
    assert cache.publish(batch[0]) == "published"
    # 4496 tokens hit (whole blocks of 16): the first window (4096 tokens) mapped read-only,
    # the other 400 tokens copied.
    second = cache.admit(batch[1], ids[:4500])
    assert second["hit_tokens"] == 4496 and second["shared_bytes"] == host.granule
    assert second["copied_bytes"] == 400 * 512
    assert batch[1].read_tokens(0, 4496) == batch[0].read_tokens(0, 4496)
    stats = cache.stats()
    assert stats["hits"] == 1 and stats["misses"] == 1
    batch.release()
    assert cache.clear() >= 0


@needs_host
def test_prefix_cache_handle_windows_cut_the_read_only_part_to_whole_handles(host: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(16384), "token-major", host.granule)
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.PrefixCache(host, plan, handle_windows=0)
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.PrefixCache(host, plan, handle_windows=-1)
    with pytest.raises(kvvm.InvalidArgumentError):
        kvvm.PrefixCache(host, plan, block_tokens=0)
    # Blocks of one window (4096 tokens of 512 B), handles of two windows.
    cache = kvvm.PrefixCache(host, plan, block_tokens=4096, handle_windows=2)
    block = cache.block_tokens
    batch = kvvm.SequenceBatch(host, plan, 2)
    ids = list(range(4 * block))
    first = cache.admit(batch[0], ids)
    assert first["owned_prefix_tokens"] == 4 * block
    batch[0].write_tokens(0, bytes(512 * len(ids)))
    assert cache.publish(batch[0]) == "published"
    # Three blocks match, in handles of two windows: the first handle is mapped read-only,
    # the third window copied.
    other = ids[: 3 * block] + [7] * 100
    second = cache.admit(batch[1], other)
    assert second["hit_tokens"] == 3 * block
    assert second["shared_bytes"] == 2 * host.granule
    assert second["copied_bytes"] == host.granule
    batch.release()
    assert cache.clear() >= 0
