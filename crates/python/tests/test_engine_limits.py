"""The engine's limits, each held by a test that failed on the engine of one class: a prompt
that can never fit (the cache's scratch window counted) finishes as ``"memory"`` at once and
holds up no one; ``run()`` goes on admitting in the step the last running request ran out of
memory; a prefilling request is preempted before a decoding one runs out (``"memory"`` only
alone); every argument of a request is checked at ``submit`` (a refused request is never
queued, and the others still run); a temperature so small that its probabilities overflow
fails no step; ``close()`` gives the model back as it found it. Host backend, tiny random
fp32 models, greedy tokens against a one-request-at-a-time DynamicCache reference."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest

import kvvm
from conftest import host_available

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    transformers = pytest.importorskip("transformers", reason="skipped: no transformers")

from kvvm.engine import Engine  # noqa: E402
from test_engine import VOCAB, _budgeted, prompts, reference, tiny  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")


def test_a_prompt_needing_the_whole_budget_never_fits_and_holds_up_no_one() -> None:
    """A budget of two windows: the scratch window takes one, so a prompt of two windows can
    never be admitted (it finishes as "memory" in the first step, without running), while a
    prompt of exactly one window fits; the request behind them runs."""
    model, ref, mgr, per_window = _budgeted(2)
    engine = Engine(model, slots=1, max_len=8 * per_window, manager=mgr, prefill_chunk=64)
    whole = engine.submit(prompts([2 * per_window - 3])[0], 2)
    exact = engine.submit(prompts([per_window], seed=2)[0], 1)
    small = engine.submit(prompts([5], seed=3)[0], 3)
    engine.step()
    assert whole.finish_reason == "memory" and whole.tokens == [], "refused at once, not first in line for ever"
    engine.run()
    assert exact.finish_reason == "length" and exact.tokens == reference(ref, exact.prompt, 1)
    assert small.finish_reason == "length" and small.tokens == reference(ref, small.prompt, 3)
    engine.close()
    assert mgr.snapshot().committed == 0


def test_run_admits_the_next_request_in_the_step_the_last_one_ran_out_of_memory() -> None:
    """Three windows: the scratch, then a request alone grows to the other two and runs out
    (``"memory"``, its tokens so far the reference's); the request waiting behind it (two
    windows) is admitted in the same step and served by the same ``run()``."""
    model, ref, mgr, per_window = _budgeted(3)
    engine = Engine(model, slots=2, max_len=8 * per_window, manager=mgr, prefill_chunk=64)
    alone = engine.submit(prompts([per_window - 4])[0], 3 * per_window)
    after = engine.submit(prompts([per_window + 5], seed=2)[0], 4)
    engine.run()
    assert alone.finish_reason == "memory"
    # Two windows hold 2 x per_window tokens: the prompt, and every generated token but the last.
    assert len(alone.tokens) == 2 * per_window - len(alone.prompt) + 1
    assert alone.tokens == reference(ref, alone.prompt, len(alone.tokens))
    assert after.finish_reason == "length" and after.tokens == reference(ref, after.prompt, 4)
    engine.close()


def test_a_prefilling_request_is_preempted_before_a_decoding_one_runs_out() -> None:
    """Four windows: the scratch, an older request of one window and a younger one of two,
    prefilled in chunks of 16. The older starts decoding and needs a second window while the
    younger still prefills: the younger (the youngest running, though prefilling) gives way
    and is recomputed later; the older is not truncated."""
    model, ref, mgr, per_window = _budgeted(4)
    engine = Engine(model, slots=2, max_len=4 * per_window, manager=mgr, prefill_chunk=16)
    older = engine.submit(prompts([per_window - 2])[0], 20)
    younger = engine.submit(prompts([2 * per_window - 10], seed=2)[0], 5)
    engine.run()
    assert older.finish_reason == "length" and older.preemptions == 0
    assert younger.preemptions >= 1 and younger.finish_reason == "length"
    assert older.tokens == reference(ref, older.prompt, 20)
    assert younger.tokens == reference(ref, younger.prompt, 5)
    engine.close()


BAD_REQUESTS = [
    ("a string", ("hello", 3), {}, "list of ints"),
    ("bytes", (b"\x01\x02", 3), {}, "list of ints"),
    ("an iterator", (iter([1, 2]), 3), {}, "list of ints"),
    ("an id at the vocabulary's size", ([1, VOCAB], 3), {}, "outside the vocabulary"),
    ("a negative id", ([-1, 2], 3), {}, "outside the vocabulary"),
    ("a float id", ([1.0, 2], 3), {}, "not an int"),
    ("a bool id", ([True, 2], 3), {}, "not an int"),
    ("a 2-D tensor", (None, 3), {}, "one dimension"),
    ("a float tensor", ("float-tensor", 3), {}, "integers"),
    ("a fractional max_new_tokens", ([1, 2], 2.5), {}, "max_new_tokens must be an int"),
    ("a bool max_new_tokens", ([1, 2], True), {}, "max_new_tokens must be an int"),
    ("no new tokens", ([1, 2], 0), {}, "max_new_tokens must be at least 1"),
    ("a NaN temperature", ([1, 2], 3), {"temperature": math.nan}, "finite"),
    ("an infinite temperature", ([1, 2], 3), {"temperature": math.inf}, "finite"),
    ("a negative temperature", ([1, 2], 3), {"temperature": -0.5}, "non-negative"),
    ("a string temperature", ([1, 2], 3), {"temperature": "1"}, "number"),
    ("a string end token", ([1, 2], 3), {"eos_token_ids": "7"}, "eos_token_ids"),
    ("a float end token", ([1, 2], 3), {"eos_token_ids": [1.5]}, "not an int"),
    ("an end token out of the vocabulary", ([1, 2], 3), {"eos_token_ids": VOCAB}, "outside the vocabulary"),
]


def _prompt_arg(value: object) -> object:
    if value is None:
        return torch.tensor([[1, 2, 3]])
    if value == "float-tensor":
        return torch.tensor([1.5, 2.0])
    return value


def test_every_bad_request_is_refused_at_submit_and_the_engine_still_serves() -> None:
    model, ref = tiny()
    engine = Engine(model, slots=2, max_len=64, backend="host")
    for what, (ids, new), kwargs, message in BAD_REQUESTS:
        with pytest.raises(kvvm.InvalidArgumentError, match=message):
            engine.submit(_prompt_arg(ids), new, **kwargs)  # type: ignore[arg-type]
        assert engine.idle, f"{what} was queued"
    # What is accepted: a tuple, a 1-D integer tensor (copied into a list), an int end token.
    good = [
        engine.submit(tuple(prompts([7])[0]), 4),
        engine.submit(torch.tensor(prompts([9], seed=2)[0]), 3, eos_token_ids=VOCAB - 1),
    ]
    assert good[1].prompt == prompts([9], seed=2)[0] and good[1].eos == frozenset([VOCAB - 1])
    with pytest.raises(kvvm.InvalidArgumentError, match="max_steps"):
        engine.run(max_steps=-1)
    with pytest.raises(kvvm.InvalidArgumentError, match="max_steps"):
        engine.run(max_steps=1.5)  # type: ignore[arg-type]
    engine.run()
    for r in good:
        assert r.tokens == reference(ref, r.prompt, r.max_new_tokens)
    engine.close()
    engine.close()  # idempotent
    for call in (lambda: engine.submit([1, 2], 3), engine.step, engine.run):
        with pytest.raises(kvvm.InvalidArgumentError, match="closed"):
            call()


def test_the_engines_own_arguments_are_checked() -> None:
    model, _ = tiny()
    engine = Engine(model, slots=1, max_len=32, backend="host", eos_token_ids=7)
    assert engine.eos == frozenset([7])
    assert engine.submit([1, 2], 1).eos == frozenset([7])
    engine.close()
    refused: list[tuple[dict[str, object], str]] = [
        ({"eos_token_ids": "7"}, "eos_token_ids"),
        ({"eos_token_ids": [7.0]}, "not an int"),
        ({"slots": 2.5}, "slots must be an int"),
        ({"max_len": True}, "max_len must be an int"),
        ({"prefill_chunk": 0}, "prefill_chunk must be at least 1"),
    ]
    for kwargs, message in refused:
        args = {"slots": 1, "max_len": 32, "backend": "host", **kwargs}
        with pytest.raises(kvvm.InvalidArgumentError, match=message):
            Engine(model, **args)  # type: ignore[arg-type]
        assert model.config._attn_implementation == "sdpa", "a refused engine leaves the model as it was"


def test_a_temperature_whose_probabilities_overflow_samples_the_greedy_token() -> None:
    """A temperature of 1e-40 divides the logits past float32's range: its probabilities are
    not finite. The request samples its greedy token (the limit of a vanishing temperature)
    and the requests beside it, sampled or greedy, are not failed."""
    model, ref = tiny()
    engine = Engine(model, slots=3, max_len=64, backend="host", seed=1)
    tiny_t = engine.submit(prompts([6])[0], 5, temperature=1e-40)
    hot = engine.submit(prompts([8], seed=2)[0], 5, temperature=1.0)
    greedy = engine.submit(prompts([4], seed=3)[0], 5)
    engine.run()
    assert tiny_t.tokens == reference(ref, tiny_t.prompt, 5)
    assert greedy.tokens == reference(ref, greedy.prompt, 5)
    assert hot.finish_reason == "length" and len(hot.tokens) == 5
    assert all(0 <= t < VOCAB for t in hot.tokens)
    engine.close()


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_close_gives_the_model_back_as_it_found_it(implementation: str) -> None:
    """After the engine, the model attends as before (its implementation, forward and
    projection and linear modules, fused and tuned for its life), generates the same tokens,
    and transformers' continuous batching can switch it to its paged attention again
    (``generate_batch``'s first step, which failed on ``paged|kvvm``)."""
    model, ref = tiny()
    model.set_attn_implementation(implementation)
    prompt = prompts([12])[0]
    want = reference(model, prompt, 5)
    engine = Engine(model, slots=1, max_len=64, backend="host", fuse_projections=True, tuned_products=True)
    assert type(model.model.layers[0].self_attn.o_proj).__name__ == "TunedLinear"
    r = engine.submit(prompt, 5)
    engine.run()
    assert r.tokens == want
    engine.close()
    assert type(model.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    assert type(model.lm_head) is torch.nn.Linear
    assert model.config._attn_implementation == implementation
    assert "forward" not in model.__dict__ and "_kvvm_original_forward" not in model.__dict__
    assert not hasattr(model.config, "kvvm_kernel")
    assert type(model.model.layers[0].self_attn.k_proj) is torch.nn.Linear
    assert not any("forward" in vars(layer.mlp) for layer in model.model.layers), "the MLPs' own forward"
    assert reference(model, prompt, 5) == want
    model.set_attn_implementation(f"paged|{model.config._attn_implementation}")
    assert model.config._attn_implementation == f"paged|{implementation}"


def test_an_engine_whose_runner_cannot_be_made_gives_everything_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The products cannot be tuned (say triton is missing): the engine is refused with that
    error, and the model's fusion, attention and the KV manager's memory are given back."""
    import kvvm.serving.runner as runner

    def no_triton(model: object) -> None:
        raise ImportError("no triton")

    monkeypatch.setattr(runner, "tune_products", no_triton)
    model, _ = tiny()
    attention = model.config._attn_implementation
    manager = kvvm.Manager("host")
    with pytest.raises(ImportError, match="no triton"):
        Engine(model, slots=2, max_len=64, manager=manager, fuse_projections=True, tuned_products=True)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear, "the fusion undone"
    assert not any(name.startswith("_kvvm_fused") for name, _ in model.named_modules())
    assert model.config._attn_implementation == attention
    assert manager.snapshot().committed == 0, "the KV manager closed: nothing held"
