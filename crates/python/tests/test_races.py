"""Calls made without the GIL, raced from threads.

Every method that unmaps (``release``, ``shrink``) runs without the GIL, so another thread
may make a view, store or release at any point of it. The bindings count a view (or a store)
before they check what it covers, and an unmap starts only when no view is counted: these
tests hold that whatever the schedule. Each loops long enough that the old order (check
first, count second) was caught within the loop (measured: see each test), and each asserts
only what must hold on every schedule, so that it cannot fail by timing on correct code.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

import kvvm
from conftest import needs_host, tiny_geometry

#: Rounds of each race. On the old order the view race was caught within the first few
#: hundred rounds in every one of 20 runs on a 2-core machine.
ROUNDS = 3000


def _race(left: Callable[[int], None], right: Callable[[int], None], rounds: int = ROUNDS) -> None:
    """Runs ``left(i)`` and ``right(i)`` for ``i`` in ``range(rounds)`` on two threads that
    meet at a barrier before every round, so that every round overlaps by construction, the
    left one delayed by a few microseconds more each round (so that its call lands at every
    point of the right one's); re-raises the first assertion or error of either thread."""
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(body: Callable[[int], None], delayed: bool) -> None:
        try:
            for i in range(rounds):
                barrier.wait()
                if errors:
                    return
                for _ in range(i % 97 if delayed else 0):
                    pass
                body(i)
        except threading.BrokenBarrierError:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(left, True)), threading.Thread(target=run, args=(right, False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@needs_host
def test_a_view_never_outlives_the_tokens_it_covers_against_release_and_shrink(
    host: kvvm.Manager,
) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "token-major", host.granule)
    seq = kvvm.Sequence(host, plan, precommit=False)
    tokens = 64
    seq.ensure(tokens)

    def viewer(_: int) -> None:
        try:
            view = seq.view(0, "key", end=tokens)
        except (kvvm.NotCommittedError, kvvm.ViewsAliveError):
            return
        # While the view lives nothing may unmap its tokens: the count is the truth.
        assert seq.committed_tokens >= tokens, (seq.committed_tokens, tokens)
        assert np.from_dlpack(view).shape == (2, tokens, 32)
        del view

    def unmapper(i: int) -> None:
        try:
            if i % 2:
                seq.release()
            else:
                seq.shrink(0)
        except kvvm.ViewsAliveError:
            pass
        seq.ensure(tokens)

    _race(viewer, unmapper)
    assert seq.views == 0
    seq.release()


@needs_host
def test_a_batch_release_is_all_or_nothing_against_a_racing_view(host: kvvm.Manager) -> None:
    plan = kvvm.LayoutPlan(tiny_geometry(), "token-major", host.granule)
    batch = kvvm.SequenceBatch(host, plan, 4, max_tokens=256, precommit=False)
    tokens = 32
    batch.ensure(tokens)

    def viewer(_: int) -> None:
        try:
            view = batch.view(1, "value", end=tokens, first=3, count=1)
        except (kvvm.NotCommittedError, kvvm.ViewsAliveError):
            return
        assert batch[3].committed_tokens >= tokens
        del view

    def releaser(_: int) -> None:
        try:
            batch.release()
        except kvvm.ViewsAliveError:
            # Refused as a whole: no slot was released.
            assert all(batch[i].committed_tokens >= tokens for i in range(4))
        batch.ensure(tokens)

    _race(viewer, releaser)
    batch.release()


def test_a_view_of_a_pre_committed_sequence_covers_only_claimed_tokens() -> None:
    """The pre-committer maps windows ahead of the claimed tokens and gives them back under
    memory pressure without waiting for anyone: a view's default end stops at the claims."""
    mgr = kvvm.Manager("host", budget_bytes=64 << 20, precommit=True, headroom_tokens=512)
    plan = kvvm.LayoutPlan(tiny_geometry(), "token-major", mgr.granule)
    seq = kvvm.Sequence(mgr, plan, precommit=True)
    seq.ensure(16)
    mgr.wait_precommit_idle()
    assert seq.committed_tokens > 16, "the pre-committer maps ahead of the claims"
    view = seq.view(0, "key")
    assert view.shape == [2, 16, 32]
    try:
        seq.view(0, "key", end=seq.committed_tokens)
    except kvvm.NotCommittedError:
        pass
    else:
        raise AssertionError("a view past the claimed tokens was handed out")
    del view
    seq.release()


@needs_host
def test_an_admission_is_refused_while_a_view_lives_and_unmaps_nothing(host: kvvm.Manager) -> None:
    """An admission may release windows a pre-committer mapped ahead: never under a view."""
    # 512 B per token: a 2 MiB window holds 4096 tokens.
    plan = kvvm.LayoutPlan(tiny_geometry(8192), "token-major", host.granule)
    owner = kvvm.Sequence(host, plan)
    prefix = owner.own_prefix(4096)
    prefix.seal()
    seq = kvvm.Sequence(host, plan)
    view = seq.view(0, "key", end=8, allow_uncommitted=True)
    try:
        prefix.attach(seq)
    except kvvm.ViewsAliveError:
        pass
    else:
        raise AssertionError("an admission ran under a live view")
    assert seq.is_empty
    del view
    assert prefix.attach(seq) > 0
    assert seq.shared_tokens > 0
    seq.release()
    owner.release()


@needs_host
def test_a_prefix_inserted_and_cleared_while_admissions_race_is_hit_whole_or_not_at_all(host: kvvm.Manager) -> None:
    """``PrefixCache.insert`` and ``clear`` (without the GIL) race admissions (without the
    GIL): an admission finds the inserted prefix whole, with its bytes, or misses it; it
    never maps part of it, and every insert reports what it did."""
    geometry = tiny_geometry(3 * 4096)
    plan = kvvm.LayoutPlan(geometry, "token-major", host.granule)
    cache = kvvm.PrefixCache(host, plan)
    n = cache.block_tokens
    ids = list(range(n + 1))
    owner = kvvm.Sequence(host, plan, 3 * 4096)
    shared = owner.own_prefix(n)
    data = np.arange(n * geometry.bytes_per_token, dtype=np.uint8).tobytes()
    owner.write_tokens(0, data)
    shared.seal()
    reader = kvvm.Sequence(host, plan, 3 * 4096)
    outcomes: set[str] = set()
    hits = [0, 0]

    def left(i: int) -> None:
        if i % 3 == 2:
            cache.clear()
        else:
            outcomes.add(cache.insert(ids[:n], [shared]))

    def right(i: int) -> None:
        got = cache.admit(reader, ids)["hit_tokens"]
        assert got in (0, n), got
        hits[got == n] += 1
        if got == n:
            assert reader.read_tokens(0, 16) == data[: 16 * geometry.bytes_per_token]
        reader.release()

    _race(left, right, rounds=ROUNDS // 5)
    assert outcomes <= {"published", "already_cached"} and "published" in outcomes
    assert sum(hits) == ROUNDS // 5
    # After the race (whatever it did): inserted, the prefix is hit whole.
    cache.insert(ids[:n], [shared])
    assert cache.admit(reader, ids)["hit_tokens"] == n
    reader.release()


def test_available_bytes_read_while_the_pre_committer_grows_and_gives_back() -> None:
    """``Manager.available_bytes`` (without the GIL: it asks the pre-committer what it could
    give back, trying each sequence's lock, never waiting) raced against a pre-committed
    sequence's growth and a commit that reclaims the windows it holds ahead. Every schedule
    must answer without a deadlock or an error; the figure is a momentary estimate (a commit
    between its reads may count a window twice), so only the quiet state after the race is
    checked exactly: the whole budget available."""
    budget = 16 << 20
    mgr = kvvm.Manager("sim", budget_bytes=budget, precommit=True, headroom_tokens=8)
    plan = kvvm.LayoutPlan(tiny_geometry(32768), "token-major", mgr.granule)
    seq = kvvm.Sequence(mgr, plan, precommit=True)
    other = kvvm.Sequence(mgr, plan)

    def read(i: int) -> None:
        available = mgr.available_bytes()
        assert isinstance(available, int) and available >= 0, available

    def grow_and_reclaim(i: int) -> None:
        seq.ensure(4096 * (1 + i % 3))  # whole windows live: the worker maps the next ahead
        try:
            other.ensure(4096 * (4 + i % 3))  # may take the window ahead back
        except kvvm.BackpressureError:
            pass
        other.release()
        seq.release()

    _race(read, grow_and_reclaim, rounds=1000)
    mgr.stop_precommit()
    seq.release()
    other.release()
    mgr.trim_pool(0)
    assert mgr.available_bytes() == budget
