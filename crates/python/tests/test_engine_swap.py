"""Preemption by swap in the serving engine, on the host backend with tiny random fp32 models:
a preempted request's KV goes to page-locked host memory and comes back at its admission
instead of being computed again (decided by measured costs, or forced), its greedy tokens
those of a one-request-at-a-time reference; every failure falls back to recomputing it;
nothing is held on the host afterwards."""

from __future__ import annotations

import pytest

import kvvm
from conftest import host_available

torch = pytest.importorskip("torch", reason="skipped: no torch")
transformers = pytest.importorskip("transformers", reason="skipped: no transformers")

from kvvm.engine import Engine  # noqa: E402
from kvvm.serving.swap import MIN_PREFILL_SAMPLE_TOKENS, SwapCosts  # noqa: E402
from test_engine import prompts, reference, tiny  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

WINDOW = 2 << 20


def _setup(
    windows: int, host_windows: int | None = None
) -> tuple[object, object, kvvm.Manager, int]:
    """A model of 32 KiB per token (64 tokens a window), a device budget of ``windows`` and a
    host budget of ``host_windows`` (None: unlimited)."""
    model, ref = tiny(layers=4, kv_heads=8, head_dim=128, hidden=64, heads=8)
    host = host_windows * WINDOW if host_windows is not None else None
    mgr = kvvm.Manager("host", budget_bytes=windows * WINDOW, precommit=False, host_budget_bytes=host)
    return model, ref, mgr, mgr.granule // (4 * 2 * 8 * 128 * 4)


def _pressure(swap: str, host_windows: int | None = None, costs: SwapCosts | None = None) -> tuple[Engine, list]:
    """Two requests that fit with their prompts; both crossing into a second window need two
    more, and only one is there: the youngest is preempted (see test_engine)."""
    model, ref, mgr, per_window = _setup(4, host_windows)
    host_bytes = (host_windows or 4) * WINDOW
    engine = Engine(
        model, slots=2, max_len=4 * per_window, manager=mgr, prefill_chunk=64,
        host_tier_bytes=host_bytes, swap=swap, swap_costs=costs,
    )
    a, b = (engine.submit(p, per_window) for p in prompts([per_window - 8, per_window - 6], seed=6))
    engine._ref = ref  # type: ignore[attr-defined]
    return engine, [a, b]


#: Reference tokens by (prompt, new tokens): every test's model has the same seeded weights.
_REFERENCE: dict[tuple[tuple[int, ...], int], list[int]] = {}


def _check_tokens(engine: Engine, reqs: list) -> None:
    for r in reqs:
        key = (tuple(r.prompt), r.max_new_tokens)
        if key not in _REFERENCE:
            _REFERENCE[key] = reference(engine._ref, r.prompt, r.max_new_tokens)  # type: ignore[attr-defined]
        assert r.tokens == _REFERENCE[key], r.id


def _nothing_on_the_host(engine: Engine) -> None:
    assert engine.swapper is not None
    stats = engine.swapper.tier.stats()
    assert stats["held_bytes"] == 0 and stats["quarantined_bytes"] == 0, stats
    assert engine.manager.host_snapshot().committed == 0


def test_a_preempted_request_is_swapped_out_and_back_and_gets_its_reference_tokens() -> None:
    engine, (a, b) = _pressure("always")
    while not engine.idle:
        engine.step()
        assert engine.swapper is not None
        for r in (a, b):
            if engine.swapper.holds(r):
                # A swapped request holds no slot: no step can read or write its KV.
                assert r.slot is None and r not in engine.running.values()
    s = engine.stats
    assert s.preempted >= 1 and s.swapped_out == s.preempted and s.swapped_in == s.swapped_out
    assert s.swap_out_ms > 0 and s.swap_in_ms > 0, "the swaps' host time is counted"
    assert b.preemptions >= 1 and a.preemptions == 0
    assert engine.swapper is not None and engine.swapper.tier.stats()["swaps_in"] == s.swapped_in
    _check_tokens(engine, [a, b])
    _nothing_on_the_host(engine)
    engine.close()
    assert engine.manager.host_snapshot().used == 0


def test_never_swapping_recomputes() -> None:
    engine, reqs = _pressure("never")
    engine.run()
    assert engine.stats.preempted >= 1 and engine.stats.swapped_out == 0
    _check_tokens(engine, reqs)
    engine.close()


@pytest.mark.parametrize(("rate", "swaps"), [(1e-12, False), (1.0, True)])
def test_auto_swaps_only_when_the_measured_costs_say_it_is_cheaper(rate: float, swaps: bool) -> None:
    # A copy of 1 GB/s both ways against a prefill of `rate` seconds a token.
    costs = SwapCosts(bandwidth_out=1e9, bandwidth_in=1e9, prefill_s_per_token=rate)
    engine, reqs = _pressure("auto", costs=costs)
    engine.run()
    assert engine.stats.preempted >= 1
    assert (engine.stats.swapped_out > 0) == swaps
    _check_tokens(engine, reqs)
    engine.close()


def test_auto_measures_the_bandwidth_at_start_and_the_prefill_as_it_runs() -> None:
    engine, reqs = _pressure("auto")
    assert engine.swapper is not None
    costs = engine.swapper.costs
    assert costs.bandwidth_out and costs.bandwidth_in and costs.prefill_s_per_token is None
    engine.run()
    assert costs.prefill_s_per_token is not None and costs.prefill_s_per_token > 0
    _check_tokens(engine, reqs)
    _nothing_on_the_host(engine)
    engine.close()


def test_a_prefill_sample_is_a_step_of_enough_tokens_less_a_decode_step() -> None:
    costs = SwapCosts()
    costs.record_step(0, 4, 0.010)  # a decode step of 10 ms
    costs.record_step(MIN_PREFILL_SAMPLE_TOKENS - 1, 4, 1.0)  # its fixed costs: no sample
    costs.record_step(1, 0, 1.0)
    assert costs.prefill_s_per_token is None and costs.recompute_seconds(100) is None
    costs.record_step(MIN_PREFILL_SAMPLE_TOKENS, 0, MIN_PREFILL_SAMPLE_TOKENS * 1e-3)
    assert costs.prefill_s_per_token == pytest.approx(1e-3)
    costs.record_step(100, 4, 0.010 + 100 * 2e-3)  # beside decoding rows: the decode step less
    costs.record_step(100, 4, 0.010 + 100 * 3e-3)
    assert costs.prefill_s_per_token == pytest.approx(2e-3)  # the median of 1, 2 and 3 ms
    assert costs.recompute_seconds(1000) == pytest.approx(2.0)


def test_a_host_budget_too_small_for_the_request_falls_back_to_recompute() -> None:
    # One window of host memory: the preempted request holds two.
    engine, reqs = _pressure("always", host_windows=1)
    engine.run()
    assert engine.stats.preempted >= 1 and engine.stats.swapped_out == 0
    _check_tokens(engine, reqs)
    _nothing_on_the_host(engine)
    engine.close()


def test_a_swap_that_fails_on_the_way_back_is_recomputed() -> None:
    engine, (a, b) = _pressure("always")
    assert engine.swapper is not None
    while engine.stats.swapped_out == 0:
        engine.step()
    # The swap is replaced by one of another manager: bringing it back is refused.
    other = kvvm.Manager("host", budget_bytes=64 << 20)
    plan = engine.cache.groups[0].plan
    seq = kvvm.Sequence(other, plan)
    seq.ensure(8)
    tier = kvvm.HostTier(other)
    foreign = seq.swap_out(tier, 8)
    seq.finish_swap_out(foreign)
    swapped = next(r for r in (a, b) if engine.swapper.holds(r))
    engine.swapper.swaps[swapped.id] = [foreign]
    engine.run()
    assert engine.stats.swap_fallbacks == 1 and not engine.swapper.holds(swapped)
    _check_tokens(engine, [a, b])
    _nothing_on_the_host(engine)
    engine.close()


def test_bad_swap_arguments_are_refused() -> None:
    """Refused, and the model is given back as it was: its attention and its modules (fused
    and tuned before the swapper was made)."""
    model, _ = tiny()
    attention = model.config._attn_implementation
    with pytest.raises(kvvm.InvalidArgumentError):
        Engine(model, slots=1, max_len=64, backend="host", host_tier_bytes=WINDOW, swap="sometimes",
               fuse_projections=True, tuned_products=True)
    assert model.config._attn_implementation == attention
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert type(model.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    with pytest.raises(kvvm.InvalidArgumentError):
        Engine(model, slots=1, max_len=64, backend="host", host_tier_bytes=-1)


def test_a_swap_back_waits_only_when_its_context_is_not_available() -> None:
    """A swap comes back when its context's bytes are available as a grant would find them
    (``Manager.available_bytes``: free, or reclaimed from the pool, the pre-committer's
    windows ahead and idle prefixes), not only when they are free; without a budget it never
    waits."""
    from types import SimpleNamespace

    from kvvm.serving.swap import Swapper

    def swapper(available: int | None) -> Swapper:
        s = Swapper.__new__(Swapper)
        s.kv = SimpleNamespace(  # type: ignore[assignment]
            manager=SimpleNamespace(available_bytes=lambda: available),
            cache=SimpleNamespace(bytes_for_tokens=lambda n: n * 1024),
        )
        return s

    swapper(64 * 1024)._check_room(64)
    swapper(None)._check_room(1 << 20)
    with pytest.raises(kvvm.BackpressureError) as e:
        swapper(64 * 1024 - 1)._check_room(64)
    assert (e.value.needed_bytes, e.value.available_bytes) == (64 * 1024, 64 * 1024 - 1)


def test_a_swap_round_trip_of_a_shape_whose_tokens_straddle_windows_gets_its_reference_tokens() -> None:
    """3 layers, 3 query heads a KV head, head dim 96 (4608 bytes a token in fp32: a 2 MiB
    window holds 455.1 tokens, so tokens straddle windows): the preempted request is swapped
    out and back, and both requests get the tokens of the one-request reference."""
    model, ref = tiny(layers=3, kv_heads=2, head_dim=96, hidden=96, heads=6)
    mgr = kvvm.Manager("host", budget_bytes=4 * WINDOW, precommit=False)
    per_window = mgr.granule // (3 * 2 * 2 * 96 * 4)
    engine = Engine(
        model, slots=2, max_len=4 * per_window, manager=mgr, prefill_chunk=64, host_tier_bytes=4 * WINDOW,
        swap="always",
    )
    reqs = [engine.submit(p, per_window) for p in prompts([per_window - 8, per_window - 6], seed=6)]
    engine._ref = ref  # type: ignore[attr-defined]
    engine.run()
    s = engine.stats
    assert s.preempted >= 1 and s.swapped_out >= 1 and s.swapped_in == s.swapped_out and s.swap_fallbacks == 0
    _check_tokens(engine, reqs)
    _nothing_on_the_host(engine)
    engine.close()
