"""Continuous batching (``kvvm.engine.Engine``) on a CUDA GPU with a small random fp32 model:
the captured decode step, chunked and batched prefill, slot reuse, a prefix-cache hit and
preemption under a tight budget, each request's greedy tokens against a one-request-at-a-time
DynamicCache reference, and nothing held once the engine closes; the engine with the cascade
decode (two prefixes grouped in the captured step, requests joining and leaving, one
preempted) giving the tokens of the engine without it. Skipped without CUDA."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pytest

import kvvm
from conftest import cuda_available

if TYPE_CHECKING:
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="skipped: no CUDA (torch is not installed)")
    transformers = pytest.importorskip("transformers", reason="skipped: no CUDA (no transformers)")


pytestmark = pytest.mark.skipif(not cuda_available(), reason="skipped: no CUDA driver")

from kvvm.engine import Engine  # noqa: E402

VOCAB = 2048


def _models() -> tuple[Any, Any]:
    """The same random fp32 weights twice on the GPU: the engine's and the reference's. fp32
    with TF32 off: the engine and the reference differ by float rounding only, far below the
    gaps between a random model's top logits at this size."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=8192, eos_token_id=None,
    )
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        ref = transformers.LlamaForCausalLM(cfg).eval()
        model = transformers.LlamaForCausalLM(cfg).eval()
    model.load_state_dict(ref.state_dict())
    return model, ref


@torch.no_grad()
def _reference(ref: Any, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _other_test_processes() -> bool:
    """Whether other test processes may be using the GPU (pytest-xdist's workers): the
    device's free memory is then not this process's alone to account for."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1


@pytest.fixture(scope="module")
def stream() -> dict[str, Any]:
    """A stream through the engine (a shared system prompt, slots reused), the engine closed
    and the pool trimmed after it: its requests, the reference's tokens, the engine's stats,
    the manager's books after, and the device's free memory before and after (torch's own
    cache counted as free: it holds the captured graph's pool, not kvvm's memory)."""
    model, ref = _models()
    mgr = kvvm.Manager("cuda", precommit=True, headroom_tokens=4)
    engine = Engine(model, slots=3, max_len=3000, manager=mgr, prefill_chunk=256, prefix_cache_bytes=256 << 20)
    # Compiled, captured and tuned first: the kernels the process loads stay loaded.
    engine.warmup(prompt_tokens=64)
    mgr.trim_pool(0)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
    system = _prompts([2100], seed=3)[0]
    tails = _prompts([5, 40, 300, 9, 77, 1], seed=4)
    news = [6, 20, 3, 11, 8, 15]
    reqs = [engine.submit(system + t, n) for t, n in zip(tails, news, strict=True)]
    reqs += [engine.submit(p, n) for p, n in zip(_prompts([600, 33], seed=5), [9, 12], strict=True)]
    engine.run()
    engine.cache.check()
    engine.close()
    after_close = mgr.snapshot()
    mgr.trim_pool(0)
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
    return {
        "reqs": reqs, "tails": len(tails), "stats": engine.stats, "after_close": after_close,
        "after_trim": mgr.snapshot(), "references": [_reference(ref, r.prompt, r.max_new_tokens) for r in reqs],
        "free_before": free_before, "free_after": free_after,
    }


def test_a_stream_on_cuda_gets_the_reference_tokens_and_gives_every_byte_back(stream: dict[str, Any]) -> None:
    for r, want in zip(stream["reqs"], stream["references"], strict=True):
        assert r.done and r.finish_reason == "length"
        assert r.tokens == want, r.id
    assert stream["stats"].admitted == len(stream["reqs"]) > 3, "slots were reused"
    assert stream["stats"].prefix_hits >= stream["tails"] - 1, "the system prompt was mapped, not prefilled again"
    assert stream["after_close"].committed == stream["after_close"].shared == 0
    assert stream["after_trim"].pooled == 0


@pytest.mark.skipif(
    _other_test_processes(),
    reason="skipped: other test processes (pytest-xdist workers) share the GPU, so its free memory is not this process's",
)
def test_after_a_stream_the_driver_has_every_byte_back(stream: dict[str, Any]) -> None:
    """The device's free memory is back to what it was before the stream: kvvm's books are
    not the only evidence that every handle went back to the driver."""
    assert stream["free_after"] >= stream["free_before"]


def test_a_budget_too_small_for_every_request_preempts_and_still_gets_the_reference_tokens() -> None:
    model, ref = _models()
    # 2 layers x {K, V} x 2 KV heads x 64 x 4 bytes = 2 KiB a token: a 2 MiB granule holds
    # 1024 tokens, and a budget of three granules cannot hold three growing 700-token requests.
    mgr = kvvm.Manager("cuda", budget_bytes=3 << 21, precommit=False)
    engine = Engine(model, slots=3, max_len=2048, manager=mgr, prefill_chunk=512)
    reqs = [engine.submit(p, 400) for p in _prompts([700, 700, 700], seed=6)]
    engine.run()
    assert engine.stats.preempted > 0
    for r in reqs:
        assert r.tokens == _reference(ref, r.prompt, r.max_new_tokens), r.id
    engine.close()
    assert mgr.snapshot().committed == 0


def _cascade_trace(model: Any, cascade: bool) -> tuple[list[list[int]], int, int]:
    """A trace with two cached prefixes (one of 2100 tokens: a window mapped read-only, the
    rest copied; one of 300: copied), requests hitting neither, joins, leaves and one
    preemption; returns every request's tokens, the most groups a step had and the cascade
    kernel's calls (at capture)."""
    import kvvm.kernels.cascade as kc

    calls, plain = [0], kc.cascade_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return plain(*args, **kwargs)

    kc.cascade_attention = counted
    try:
        mgr = kvvm.Manager("cuda", precommit=True, headroom_tokens=4)
        engine = Engine(model, slots=8, max_len=3000, manager=mgr, prefill_chunk=512, prefix_cache_bytes=256 << 20,
                        cascade=cascade)
        assert engine.cache.cascade == cascade
        a, b = _prompts([2100, 300], seed=7)
        reqs = [engine.submit(a + [1, 2, 3], 20), engine.submit(b + [4, 5], 20)]
        engine.run(max_steps=8)
        tails = _prompts([5, 40, 9, 77, 12, 3], seed=8)
        reqs += [engine.submit((a if i % 2 else b) + t, 10 + 5 * i) for i, t in enumerate(tails)]
        reqs.append(engine.submit(_prompts([50], seed=9)[0], 12))
        most, steps = 0, 0
        while not engine.idle:
            engine.step()
            steps += 1
            tables = engine.cache.cascade_tables()
            if tables is not None:
                most = max(most, int((tables[2][:, 0] >= 0).sum().item()))
            if steps == 12:
                from kvvm.serving.scheduler import SchedulerOutput

                with engine._lock:
                    engine.scheduler._make_room(SchedulerOutput())
            if steps == 20:
                reqs.append(engine.submit(a + [9, 9], 6))
        assert engine.stats.preempted == 1
        engine.close()
        return [r.tokens for r in reqs], most, calls[0]
    finally:
        kc.cascade_attention = plain


def test_the_cascade_decode_gives_the_engines_tokens_in_fp32() -> None:
    model, _ = _models()
    want, most, calls = _cascade_trace(model, False)
    assert most == 0 and calls == 0
    got, most, calls = _cascade_trace(model, True)
    assert calls > 0, "the captured step runs the cascade"
    assert most == 2, "both prefixes grouped in one step"
    same = sum(x == y for g, w in zip(got, want, strict=True) for x, y in zip(g, w, strict=True))
    total = sum(len(w) for w in want)
    print(f"cascade tokens equal to the plain step's: {same} of {total}")
    assert got == want
