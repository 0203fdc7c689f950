"""When the decode kernel's autotuner measures (``kvvm.kernels.tuning``): inside ``untuned()``
it measures nothing on that thread, other threads tune as before, and the serving engine's
prefill forwards run untuned; a call of its own (the cascade's) is timed and remembered apart. CPU only: the measurement is replaced by a recording fake."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pytest

from conftest import tuner_on

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")


def _inputs() -> tuple[Any, Any, Any]:
    q = torch.zeros(3, 8, 1, 64)
    kv = torch.zeros(4, 2, 700, 64)
    return q, kv, torch.zeros(3, 3, dtype=torch.int32)


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The tuner on, outside the interpreter, its measurement a fake that records each
    configuration timed (one split the fastest)."""
    td = tuner_on(monkeypatch)
    calls: list[Any] = []

    def fake_time(call: Any, config: Any, *, cold: bool = False) -> float:
        assert cold, "attention is timed with its K/V out of the L2 cache"
        calls.append(config)
        return float(config.splits)

    monkeypatch.setattr(td, "graph_time", fake_time)
    return calls


def test_untuned_measures_nothing_and_remembers_nothing(timed: list[Any]) -> None:
    import kvvm.kernels.triton_decode as td
    from kvvm.kernels.tuning import tuning_allowed, untuned

    q, kv, bounds = _inputs()
    heuristic = td.Config(td.choose_splits(3, 2, 700, 132))
    with untuned():
        assert not tuning_allowed()
        with untuned():
            pass
        assert not tuning_allowed(), "a nested block leaves the switch as it found it"
        assert td.tuned_config(q, kv, kv, bounds, 0.125, 132) == heuristic
    assert tuning_allowed()
    assert timed == [] and td._TUNED == {}
    tuned = td.tuned_config(q, kv, kv, bounds, 0.125, 132)
    assert timed and tuned.splits == 1, "outside the block the tuner measures and keeps the fastest"
    (described, best), = td.tuned_timings(top=3).items()
    assert described == next(iter(td.tuned_configs())) and len(best) == 3
    assert best[0] == (tuned, 1.0) and [ms for _, ms in best] == sorted(ms for _, ms in best)
    with untuned():
        assert td.tuned_config(q, kv, kv, bounds, 0.125, 132) == tuned, "a shape tuned before keeps its configuration"


def test_another_threads_untuned_block_leaves_this_thread_tuning(timed: list[Any]) -> None:
    """A thread inside ``untuned()`` (held there until this thread has tuned) does not stop
    this thread's tuner: the switch is per thread (a process-wide one fails this)."""
    import kvvm.kernels.triton_decode as td
    from kvvm.kernels.tuning import untuned

    q, kv, bounds = _inputs()
    inside, done = threading.Event(), threading.Event()
    seen: list[Any] = []

    def other() -> None:
        with untuned():
            inside.set()
            done.wait(30)
            seen.append(td.tuned_config(q, kv, kv, bounds, 0.125, 80))

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(30)
    try:
        assert td.tuned_config(q, kv, kv, bounds, 0.125, 132).splits == 1
        assert timed, "this thread measured while the other was untuned"
    finally:
        done.set()
        t.join()
    measured = len(timed)
    assert seen == [td.Config(td.choose_splits(3, 2, 700, 80))] and len(timed) == measured


def test_a_call_of_its_own_is_timed_and_kept_apart_from_the_plain_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cascade's call is what is timed for it (its private pass reads each request's own
    tokens, not a plain decode's whole range), and its configuration is remembered under its
    variant: the plain kernel at the same shape is tuned on its own."""
    td = tuner_on(monkeypatch)
    ran: list[tuple[str, Any]] = []

    def fake_time(call: Any, config: Any, *, cold: bool = False) -> float:
        assert cold, "attention is timed with its K/V out of the L2 cache"
        call(config)
        # The cascade's call is fastest at 2 splits, the plain kernel at 1.
        return abs(config.splits - (2 if ran[-1][0] == "cascade" else 1)) + config.block / 1000

    monkeypatch.setattr(td, "graph_time", fake_time)
    monkeypatch.setattr(td, "decode_attention", lambda *a, **k: ran.append(("plain", a[5])))
    q, kv, bounds = _inputs()

    def cascade(c: Any) -> Any:
        ran.append(("cascade", c))
        return None

    tuned = td.tuned_config(q, kv, kv, bounds, 0.125, 132, timed=cascade, variant=("cascade", 4))
    assert tuned.splits == 2 and {name for name, _ in ran} == {"cascade"}
    # Timed in the order of splits (1 first), listed fastest first.
    (described, best), = td.tuned_timings(top=100).items()
    assert "cascade" in described and best[0][0] == tuned and len(best) == len(ran)
    assert [ms for _, ms in best] == sorted(ms for _, ms in best) and best[-1][0].splits != 2
    ran.clear()
    plain = td.tuned_config(q, kv, kv, bounds, 0.125, 132)
    assert plain.splits == 1 and {name for name, _ in ran} == {"plain"}, "the plain kernel is tuned apart"
    ran.clear()
    assert td.tuned_config(q, kv, kv, bounds, 0.125, 132, timed=cascade, variant=("cascade", 4)) == tuned
    assert ran == [], "remembered"
    assert any(name.endswith("('cascade', 4)") for name in td.tuned_configs())


def test_the_prefix_pass_is_tuned_beside_the_private_pass_and_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cascade's prefix pass takes the fastest of its candidates and the private pass's
    own configuration, timed on the cascade's call, remembered per shape and private
    configuration; while untuned, none (the private pass's own)."""
    td = tuner_on(monkeypatch)
    import kvvm.kernels.cascade_tuning as cc
    from kvvm.kernels.tuning import untuned

    monkeypatch.setattr(cc, "_TUNED_PREFIX", {})
    monkeypatch.setattr(cc, "_PREFIX_TIMINGS", {})
    timed: list[Any] = []
    fastest = cc.PrefixConfig(64, 4, 3)

    def fake_time(call: Any, config: Any, *, cold: bool = False) -> float:
        assert cold, "the cascade is timed with its K/V out of the L2 cache"
        call(config)
        return 1.0 if config == fastest else 2.0

    monkeypatch.setattr(cc, "graph_time", fake_time)
    private = td.Config(4, 128, 8, 2)
    with untuned():
        assert cc.tuned_prefix_config("shape", private, timed.append) is None
    assert timed == []
    assert cc.tuned_prefix_config("shape", private, timed.append) == fastest
    assert timed[0] == cc.PrefixConfig(128, 8, 2), "the private pass's own configuration is a candidate, first"
    assert len(timed) == len(set(timed)) > 2
    (described, best), = cc.tuned_prefix_timings(top=2).items()
    assert "shape" in described and best == [(fastest, 1.0), (timed[0], 2.0)], "the fastest first, then in timing order"
    timed.clear()
    assert cc.tuned_prefix_config("shape", private, timed.append) == fastest and timed == [], "remembered"
    with untuned():
        assert cc.tuned_prefix_config("shape", private, timed.append) == fastest, "a tuned shape keeps its choice"
    assert cc.tuned_prefix_config("shape", td.Config(2), timed.append) == fastest and timed, "another private config: tuned apart"


def test_a_pinned_prefix_config_is_answered_untimed_and_unpinned_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside pinned_prefix_config every shape gets the pinned configuration and nothing is
    timed (a counted one as a launch of its own beside a split private pass); after it the
    tuner answers as before; a configuration both together and beside is refused."""
    td = tuner_on(monkeypatch)
    import kvvm.kernels.cascade_tuning as cc

    monkeypatch.setattr(cc, "_TUNED_PREFIX", {})
    monkeypatch.setattr(cc, "_PREFIX_TIMINGS", {})
    monkeypatch.setattr(cc, "graph_time", lambda call, config, *, cold=False: 1.0 if config.block == 32 else 2.0)

    def never(pc: Any) -> None:
        raise AssertionError(f"timed {pc} while pinned")

    beside = cc.PrefixConfig(64, 4, 2, concurrent=True)
    with cc.pinned_prefix_config(beside):
        assert cc.tuned_prefix_config("shape", td.Config(1, 64, 4, 2), never) == beside
        assert cc.tuned_prefix_config("other", td.Config(2, 64, 4, 2), never) == cc.PrefixConfig(64, 4, 2)
        with cc.pinned_prefix_config(None):
            assert cc.tuned_prefix_config("shape", td.Config(1, 64, 4, 2), lambda pc: None) == cc.PrefixConfig(32, 4, 3), "tuned"
        assert cc.tuned_prefix_config("shape", td.Config(1, 64, 4, 2), never) == beside, "pinned again"
    assert cc._PINNED[0] is None
    assert cc.tuned_prefix_config("shape", td.Config(1, 64, 4, 2), never) == cc.PrefixConfig(32, 4, 3), "remembered"
    with pytest.raises(ValueError, match="not both"):
        with cc.pinned_prefix_config(cc.PrefixConfig(64, 4, 2, together=True, concurrent=True)):
            pass
    assert cc._PINNED[0] is None


def test_the_prefix_pass_is_timed_in_the_private_pass_launch_over_small_items_only() -> None:
    """One launch for both passes is a candidate beside a private pass of one split over
    tables of at most 32 rows an item (at 64 its programs spill), each prefix block in both
    program orders; never beside a split private pass."""
    import kvvm.kernels.cascade as cc
    from kvvm.kernels.cascade_tuning import prefix_candidates
    from kvvm.kernels.triton_decode import Config

    def together(config: Config, rows: int) -> set[tuple[int, bool]]:
        return {(pc.block, pc.prefix_first) for pc in prefix_candidates(config, rows) if pc.together}

    both = {(b, first) for b in (32, 64) for first in (True, False)}
    assert together(Config(1, 64, 4, 2), 16) == both
    assert together(Config(1, 64, 4, 2), 32) == both
    assert together(Config(1, 64, 4, 2), 64) == set()
    assert together(Config(2, 64, 4, 2), 16) == set()
    assert all(pc.warps == 8 and pc.stages == 3 for pc in prefix_candidates(Config(1, 64, 8, 3), 16) if pc.together)
    tables = cc.CascadeTables(64, "cpu", heads_per_kv=4, kv_heads=8, rows=16).tables
    assert cc.item_rows(tables, 4) == 16
    assert cc.item_rows(cc.CascadeTables(64, "cpu", heads_per_kv=4, kv_heads=8).tables, 4) == 64


class _Kv:
    """The KV manager's prefill context, as the runner uses it."""

    @contextmanager
    def prefill(self, run: Any) -> Iterator[None]:
        yield None


class _Model:
    """Records whether the tuner could measure during each forward."""

    def __init__(self) -> None:
        self.allowed: list[bool] = []

    def __call__(self, *, input_ids: Any, **kwargs: Any) -> Any:
        from kvvm.kernels.tuning import tuning_allowed

        self.allowed.append(tuning_allowed())

        class Out:
            logits = torch.zeros(input_ids.shape[0], 1, 11)

        return Out()


def test_the_engines_prefill_forwards_run_untuned() -> None:
    """A prefill forward (one token a row after a swap back in, or a whole chunk) never
    stops the engine to time decode-kernel configurations for a new batch size."""
    from kvvm.serving.request import Request
    from kvvm.serving.runner import ModelRunner
    from kvvm.serving.scheduler import PrefillRun
    from kvvm.kernels.tuning import tuning_allowed

    model = _Model()
    runner = ModelRunner(model, slots=2, device=torch.device("cpu"), compile=False)
    r = Request.__new__(Request)
    r._context, r._filled = [1, 2, 3], 2
    logits = runner._prefill_forward(PrefillRun([0], 1, [r], [True]), _Kv())  # type: ignore[arg-type]
    assert logits.shape == (1, 11)
    assert model.allowed == [False] and tuning_allowed()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_an_fp8_cache_is_tuned_over_its_blocks_with_v_widened_both_ways(timed: list[Any], dtype: str) -> None:
    """Over an FP8 cache the tuner times each of its FP8 shapes at each split count with V
    widened by the kernel's own conversion and without, for a 16-bit query; an fp32 query's
    kernel widens nothing (such a configuration would run as the one without: timed twice);
    over a bf16 cache, neither."""
    import kvvm.kernels.triton_decode as td

    q, kv, bounds = _inputs()
    kv8 = kv.to(torch.float8_e4m3fn)
    q = q.to(getattr(torch, dtype))
    td.tuned_config(q, kv8, kv8, bounds, 0.125, 132, kv_scales=torch.ones(2, 2))
    splits = {c.splits for c in timed}
    widened = dtype != "float32"
    for block, warps, stages in td._SHAPES_FP8:
        for s in splits:
            assert td.Config(s, block, warps, stages) in timed
            assert (td.Config(s, block, warps, stages, widen=True) in timed) == widened
    assert len(timed) == len(set(timed)), "no configuration timed twice"
    timed.clear()
    td.tuned_config(q, kv.to(q.dtype), kv.to(q.dtype), bounds, 0.125, 132)
    assert timed and not any(c.widen for c in timed)
    assert not any((c.block, c.warps, c.stages) in td._SHAPES_FP8 for c in timed)
