"""The prefix cache's host level in the serving engine, on the host backend with a tiny random
fp32 model: a prefix evicted from the device cache goes to the host tier, and a later request
whose prompt starts with it copies it back instead of prefilling it (when the costs say so),
its greedy tokens those of a run without any cache; the hit counted by level."""

from __future__ import annotations

from collections import Counter

import pytest

import kvvm
from conftest import host_available

torch = pytest.importorskip("torch", reason="skipped: no torch")
transformers = pytest.importorskip("transformers", reason="skipped: no transformers")

from kvvm.engine import Engine  # noqa: E402
from kvvm.serving.swap import SwapCosts  # noqa: E402
from test_engine import prompts, reference, tiny  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

WINDOW = 2 << 20


def _engine(
    swap: str = "always", costs: SwapCosts | None = None, prefix_host: bool = True, budget_windows: int | None = None
) -> tuple[Engine, object, int]:
    """A model of 32 KiB per token (64 tokens a window); a prefix cache holding 3 windows: a
    second prompt of 2 windows published evicts the first (idle) one. With ``budget_windows``
    the cache is uncapped and the device budget evicts it instead (the governor's reclaim)."""
    model, ref = tiny(layers=4, kv_heads=8, head_dim=128, hidden=64, heads=8)
    budget = budget_windows * WINDOW if budget_windows is not None else None
    mgr = kvvm.Manager("host", budget_bytes=budget, precommit=False, host_budget_bytes=8 * WINDOW)
    per_window = mgr.granule // (4 * 2 * 8 * 128 * 4)
    engine = Engine(
        model, slots=2, max_len=8 * per_window, manager=mgr, prefill_chunk=64,
        prefix_cache_bytes=(64 if budget is not None else 3) * WINDOW, host_tier_bytes=8 * WINDOW, swap=swap,
        swap_costs=costs, prefix_host=prefix_host,
    )
    return engine, ref, per_window


def _run(engine: Engine, prompt: list[int], new: int = 4) -> object:
    r = engine.submit(prompt, new)
    engine.run()
    return r


def _evicted_then_hit(engine: Engine, ref: object, per_window: int) -> object:
    """Prompt A (2 windows and a token) served, then B (as long) evicting A's prefix, then
    A's prefix and a suffix: every request's tokens those of the reference."""
    a, b, suffix = prompts([2 * per_window + 1, 2 * per_window + 1, 5], seed=11)
    for p in (a, b):
        r = _run(engine, p)
        assert r.tokens == reference(ref, p, 4)  # type: ignore[attr-defined]
    c = a[: 2 * per_window] + suffix
    r = _run(engine, c)
    assert r.tokens == reference(ref, c, 4), "tokens differ from a run without a cache"  # type: ignore[attr-defined]
    return r


def test_a_prefix_evicted_to_the_host_is_copied_back_and_gives_the_reference_tokens() -> None:
    engine, ref, per_window = _engine()
    with engine:
        r = _evicted_then_hit(engine, ref, per_window)
        cache = engine.prefix_cache.stats()
        assert cache["evicted_to_host"] >= 1 and cache["host_hits"] == 1, cache
        assert r.prefix_hit_tokens == 2 * per_window  # type: ignore[attr-defined]
        s = engine.stats
        assert (s.prefix_host_hits, s.prefix_host_hit_tokens) == (1, 2 * per_window)
        assert s.prefix_hits >= s.prefix_host_hits
        # Billed to the host's budget while there.
        assert engine.manager.host_snapshot().committed == cache["host_bytes"] > 0
    assert engine.manager.host_snapshot().committed == 0


def test_the_server_metrics_count_prefix_hits_by_level() -> None:
    metrics = pytest.importorskip("kvvm.serving.http.metrics", reason="skipped: no HTTP server packages")
    render_metrics = metrics.render_metrics

    engine, ref, per_window = _engine()
    with engine:
        _evicted_then_hit(engine, ref, per_window)
        text = render_metrics(engine, Counter())
        s = engine.stats
        assert 'kvvm_engine_prefix_hits_total{level="host"} 1' in text
        assert f'kvvm_engine_prefix_hits_total{{level="device"}} {s.prefix_hits - 1}' in text
        assert f'kvvm_engine_prefix_hit_tokens_total{{level="host"}} {2 * per_window}' in text


def test_a_prefix_the_device_budget_evicts_goes_to_the_host_and_comes_back() -> None:
    engine, ref, per_window = _engine(budget_windows=5)
    with engine:
        _evicted_then_hit(engine, ref, per_window)
        cache = engine.prefix_cache.stats()
        assert cache["evicted_to_host"] >= 1 and cache["host_hits"] == 1, cache
        assert engine.stats.prefix_host_hits == 1 and engine.stats.preempted == 0
    assert engine.manager.host_snapshot().committed == 0


def test_the_costs_decide_a_host_hit_against_a_prefill() -> None:
    # A prefill far cheaper than the copy: the prefix is prefilled again.
    cheap = SwapCosts(bandwidth_out=1e9, bandwidth_in=1e9, prefill_s_per_token=1e-15)
    engine, ref, per_window = _engine("auto", cheap)
    with engine:
        r = _evicted_then_hit(engine, ref, per_window)
        assert engine.prefix_cache.stats()["host_entries"] >= 1
        assert r.prefix_hit_tokens == 0 and engine.stats.prefix_host_hits == 0  # type: ignore[attr-defined]
    # A prefill far dearer: copied back.
    dear = SwapCosts(bandwidth_out=1e9, bandwidth_in=1e9, prefill_s_per_token=1.0)
    engine, ref, per_window = _engine("auto", dear)
    with engine:
        _evicted_then_hit(engine, ref, per_window)
        assert engine.stats.prefix_host_hits == 1
        assert engine.swapper is not None and engine.swapper.host_min_tokens() == engine.kv.hit_unit


def test_without_the_host_level_an_evicted_prefix_is_forgotten() -> None:
    engine, ref, per_window = _engine(prefix_host=False)
    with engine:
        r = _evicted_then_hit(engine, ref, per_window)
        cache = engine.prefix_cache.stats()
        assert cache["evicted_to_host"] == 0 and cache["host_entries"] == 0
        assert r.prefix_hit_tokens == 0 and engine.stats.prefix_host_hits == 0  # type: ignore[attr-defined]


def test_a_host_hit_is_cheaper_only_when_both_costs_are_known_and_say_so() -> None:
    assert not SwapCosts().host_hit_is_cheaper(100, 1 << 20)
    assert not SwapCosts(bandwidth_in=1e9).host_hit_is_cheaper(100, 1 << 20), "prefill not measured"
    costs = SwapCosts(bandwidth_in=1e9, prefill_s_per_token=1e-5)
    # 1 MiB back in about 1 ms, against 100 tokens' prefill of 1 ms, then 10 ms.
    assert not costs.host_hit_is_cheaper(100, 1 << 20)
    assert costs.host_hit_is_cheaper(1000, 1 << 20)
