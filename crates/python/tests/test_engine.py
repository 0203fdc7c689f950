"""Continuous batching over kvvm slots (``kvvm.engine.Engine``) on the host backend with tiny
random fp32 models: every request's greedy tokens equal a one-request-at-a-time DynamicCache
reference, whatever joins or leaves around it; slots are reused; prefix hits skip their
prefill; a prompt the budget cannot grant waits; a decode step the budget cannot grant
preempts the youngest request, which is recomputed later."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

import kvvm
from conftest import host_available

if TYPE_CHECKING:
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    transformers = pytest.importorskip("transformers", reason="skipped: no transformers")

from kvvm.engine import Engine, EngineStats  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

VOCAB = 1000


def tiny(
    layers: int = 2, kv_heads: int = 2, head_dim: int = 32, hidden: int = 128, heads: int = 4
) -> tuple[Any, Any]:
    """The same random weights twice: one for the engine (switched to the kvvm attention),
    one as the reference."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        eos_token_id=None,
    )
    cfg._attn_implementation = "sdpa"
    ref: Any = transformers.LlamaForCausalLM(cfg)
    ref = ref.to(torch.float32).eval()
    model: Any = transformers.LlamaForCausalLM(cfg)
    model = model.to(torch.float32).eval()
    model.load_state_dict(ref.state_dict())
    return model, ref


def reference(ref: Any, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("fuse", [False, True])
def test_a_stream_of_requests_each_gets_its_reference_tokens_and_slots_are_reused(fuse: bool) -> None:
    model, ref = tiny()
    mgr = kvvm.Manager("host", precommit=True, headroom_tokens=4)
    engine = Engine(model, slots=3, max_len=256, manager=mgr, prefill_chunk=16, fuse_projections=fuse)
    assert (type(model.model.layers[0].self_attn.k_proj) is torch.nn.Linear) != fuse
    lengths = [5, 60, 17, 33, 2, 48, 9]
    news = [3, 12, 7, 1, 9, 4, 11]
    reqs = [engine.submit(p, n) for p, n in zip(prompts(lengths), news, strict=True)]
    steps = 0
    while not engine.idle:
        engine.step()
        steps += 1
        # Never more requests in the batch than slots.
        assert len(engine.running) <= 3
        if steps == 3:
            # One arrives while others run.
            reqs.append(engine.submit(prompts([21], seed=9)[0], 6))
    for r in reqs:
        assert r.done and r.finish_reason == "length"
        assert r.tokens == reference(ref, r.prompt, r.max_new_tokens), r.id
    assert engine.stats.admitted == len(reqs) > 3, "slots were reused"
    assert engine.stats.prefill_chunks > len(reqs), "long prompts were prefilled in chunks"
    engine.cache.check()
    # What is left: the scratch slot's window (and nothing of any request).
    assert engine.cache.committed_bytes == 0
    engine.close()
    assert mgr.snapshot().committed == 0
    assert type(model.model.layers[0].self_attn.k_proj) is torch.nn.Linear  # given back


def test_a_cached_prompt_prefix_is_mapped_not_prefilled() -> None:
    model, ref = tiny()
    mgr = kvvm.Manager("host", precommit=True)
    # fp32, 2 layers x {K, V} x 2 KV heads x 32: 1 KiB per token, 2048 tokens per window.
    engine = Engine(model, slots=2, max_len=2400, manager=mgr, prefill_chunk=512, prefix_cache_bytes=64 << 20)
    system = prompts([2100], seed=3)[0]
    tails = prompts([5, 12, 7], seed=4)
    first = engine.submit(system + tails[0], 4)
    engine.run()
    assert first.prefix_hit_tokens == 0
    later = [engine.submit(system + t, 4) for t in tails[1:]]
    engine.run()
    for r in later:
        # The system prompt's whole blocks of 16: its first window mapped, the rest copied.
        assert r.prefix_hit_tokens == 2096, "the prompt's whole blocks come from the cache"
    chunks_per_miss = -(-2105 // 512)
    assert engine.stats.prefill_chunks < chunks_per_miss * 3
    assert engine.stats.prefix_hits == 2
    assert [tokens for tokens, _ in engine.stats.prefix_hit_ms] == [2096, 2096]
    assert all(ms > 0 for _, ms in engine.stats.prefix_hit_ms)
    for r in [first, *later]:
        assert r.tokens == reference(ref, r.prompt, r.max_new_tokens)
    engine.close()


def test_requests_arriving_together_with_one_prefix_prefill_it_once() -> None:
    """Three requests opening with one system prompt arrive at once: the first prefills it,
    the other two wait for its publication and map it (while a request with another prompt,
    behind them in line, is admitted meanwhile)."""
    model, ref = tiny()
    mgr = kvvm.Manager("host", precommit=True)
    engine = Engine(model, slots=4, max_len=2400, manager=mgr, prefill_chunk=512, prefix_cache_bytes=64 << 20)
    system = prompts([2100], seed=3)[0]
    together = [engine.submit(system + t, 4) for t in prompts([5, 12, 7], seed=4)]
    other = engine.submit(prompts([30], seed=8)[0], 4)
    engine.run()
    assert [r.prefix_hit_tokens for r in together] == [0, 2096, 2096]
    assert engine.stats.prefix_hits == 2 and engine.stats.prefix_waits > 0
    assert other._admitted < together[1]._admitted, "the request with another prompt was not held up"
    for r in [*together, other]:
        assert r.tokens == reference(ref, r.prompt, r.max_new_tokens)
    assert mgr.snapshot().shared > 0, "the published prompt is cached"
    engine.close()
    snap = mgr.snapshot()
    assert snap.committed == snap.shared == 0, "close gives the prefix cache's memory back too"


@pytest.mark.parametrize(("batch_tokens", "forwards"), [(8192, 4), (40, 7)])
def test_requests_in_consecutive_slots_prefill_together(batch_tokens: int, forwards: int) -> None:
    """Four prompts of 40 tokens admitted together into slots 0..3 are prefilled in chunks of
    16 (16 + 16 + 8), requests in consecutive slots with chunks of one length in one forward;
    a fifth prompt of 23 tokens arrives after the first step and joins them at another
    position. Every request still gets its reference tokens.

    Forwards, without a cap: [0-3] x 16; [0-4] x 16 (the late one's first chunk beside the
    others' second); [0-3] x 8 and [4] x 7: 4. Under a cap of 40 tokens a forward: [0-1],
    [2-3]; [0-1], [2-3], [4]; [0-3] x 8, [4] x 7: 7."""
    model, ref = tiny()
    mgr = kvvm.Manager("host", precommit=True, headroom_tokens=4)
    engine = Engine(model, slots=5, max_len=256, manager=mgr, prefill_chunk=16, prefill_batch_tokens=batch_tokens)
    same = [engine.submit(p, 5) for p in prompts([40, 40, 40, 40], seed=11)]
    engine.step()  # admits the four and prefills their first chunks
    late = engine.submit(prompts([23], seed=12)[0], 6)
    engine.run()
    assert engine.stats.prefill_chunks == 4 * 3 + 2
    assert engine.stats.prefill_forwards == forwards
    for r in [*same, late]:
        assert r.tokens == reference(ref, r.prompt, r.max_new_tokens)
    engine.close()


@pytest.mark.parametrize(("handle_tokens", "mapped_windows"), [(2048, 3), (4096, 2)])
def test_a_hit_maps_whole_handles_and_copies_the_rest(handle_tokens: int, mapped_windows: int) -> None:
    """A published prompt of four windows (2048 tokens each on the host) in handles of one
    window: a request sharing three and a bit of them hits all the shared whole blocks, maps
    three windows and copies the rest; in handles of two windows it maps two (the third is
    only half of a handle) and copies the rest."""
    model, ref = tiny()
    mgr = kvvm.Manager("host", precommit=True)
    engine = Engine(
        model, slots=1, max_len=8400, manager=mgr, prefill_chunk=4096, prefix_cache_bytes=64 << 20,
        prefix_handle_tokens=handle_tokens,
    )
    system = prompts([8200], seed=5)[0]
    engine.submit(system, 1)
    engine.run()
    r = engine.submit(system[:6200] + prompts([3], seed=6)[0], 2)
    engine.run()
    assert r.prefix_hit_tokens == 6192
    assert engine.stats.prefix_hit_ms[-1][0] == 6192
    assert engine.prefix_cache is not None
    assert engine.prefix_cache.stats()["bytes_saved"] == mapped_windows * mgr.granule
    assert r.tokens == reference(ref, r.prompt, r.max_new_tokens)
    engine.close()


def _budgeted(windows: int) -> tuple[Any, Any, kvvm.Manager, int]:
    """A model of 32 KiB per token (64 tokens per 2 MiB window: wide KV heads, little else)
    and a budget of ``windows``."""
    model, ref = tiny(layers=4, kv_heads=8, head_dim=128, hidden=64, heads=8)
    mgr = kvvm.Manager("host", budget_bytes=windows * (2 << 20), precommit=False)
    return model, ref, mgr, mgr.granule // (4 * 2 * 8 * 128 * 4)


def test_a_prompt_the_budget_cannot_grant_waits_for_memory() -> None:
    model, ref, mgr, per_window = _budgeted(3)
    engine = Engine(model, slots=2, max_len=4 * per_window, manager=mgr, prefill_chunk=32)
    # The scratch slot takes one window; each prompt needs one: the second waits.
    big = prompts([per_window + 10, per_window + 5], seed=5)
    a = engine.submit(big[0], 6)
    b = engine.submit(big[1], 6)
    engine.run()
    assert engine.stats.admission_refusals > 0
    assert a.tokens == reference(ref, a.prompt, 6)
    assert b.tokens == reference(ref, b.prompt, 6)
    engine.close()


def test_a_step_the_budget_cannot_grant_preempts_the_youngest_and_recomputes_it() -> None:
    model, ref, mgr, per_window = _budgeted(4)
    engine = Engine(model, slots=2, max_len=4 * per_window, manager=mgr, prefill_chunk=64)
    # Both fit with their prompts (the scratch, one window each); crossing into a second
    # window each needs two more: only one is there.
    a, b = (engine.submit(p, per_window) for p in prompts([per_window - 8, per_window - 6], seed=6))
    engine.run()
    assert engine.stats.preempted >= 1
    assert b.preemptions >= 1 and a.preemptions == 0, "the youngest gives way"
    assert a.tokens == reference(ref, a.prompt, per_window)
    assert b.tokens == reference(ref, b.prompt, per_window)
    engine.close()


def test_a_prompt_that_can_never_fit_finishes_without_running() -> None:
    model, _, mgr, per_window = _budgeted(2)
    engine = Engine(model, slots=1, max_len=8 * per_window, manager=mgr)
    r = engine.submit(prompts([3 * per_window])[0], 2)
    engine.run()
    assert r.finish_reason == "memory" and r.tokens == []
    engine.close()


def test_bad_requests_are_refused() -> None:
    model, _ = tiny()
    engine = Engine(model, slots=1, max_len=64, backend="host")
    assert not engine.runner.programmatic_launches, "off by default"
    with pytest.raises(kvvm.InvalidArgumentError):
        engine.submit([], 3)
    with pytest.raises(kvvm.InvalidArgumentError):
        engine.submit([1, 2], 0)
    with pytest.raises(kvvm.InvalidArgumentError):
        engine.submit(list(range(64)), 1)
    engine.close()


def test_the_serve_benchmark_runs_on_the_cpu(tmp_path) -> None:
    """``python -m kvvm_bench serve`` end to end on a tiny model: the engine and padded
    DynamicCache batches replay a synthetic trace with a shared system prompt; both agree
    with the reference and the engine hits its prefix cache."""
    import json

    import kvvm_bench

    out = tmp_path / "serve.json"
    rc = kvvm_bench.main(
        [
            "serve", "--tiny", "--device", "cpu", "--backend", "host", "--requests", "4", "--prompt-lo", "8",
            "--prompt-hi", "24", "--output", "4", "--shared-prefix", "2100", "--slots", "2",
            "--prefill-chunk", "1024", "--prefix-cache-bytes", str(64 << 20), "--runners", "kvvm-engine,padded",
            "--padded-batch", "2", "--reference", "--json", str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 4
    rows = {r["runner"]: r for r in report["results"]}
    assert set(rows) == {"kvvm-engine", "padded-dynamic"}
    for r in rows.values():
        assert r["generated_tokens"] == 16 and r["agreement"] == 1.0
        assert r["reference"]["argmax_equal"] == 1.0 and r["reference"]["tokens"] == 16
        assert r["ttft_ms"]["p50"] > 0 and r["tokens_per_s"] > 0
    engine = rows["kvvm-engine"]
    # Every request but the first maps the system prompt (the others wait for its prefill).
    assert engine["prefix_hits"] == 3 and engine["prefix_waits"] > 0 and engine["floor_s"] > 0
    assert engine["kv_bytes_over_time"], "KV bytes held are sampled at every step"
    after = engine["after"]
    assert after["committed"] == after["shared"] == after["quarantined"] == 0, after
    assert after["pooled_after_trim"] == 0, after


def test_the_reference_check_counts_a_token_the_reference_does_not_rank_first() -> None:
    """The teacher-forced check finds the reference's own greedy tokens in agreement and a
    changed token not (the model's logits are far from ties in fp32)."""
    from kvvm_bench.serve import TraceRequest, reference_check

    model, ref = tiny()
    prompt = list(range(3, 19))
    want = reference(ref, prompt, 5)
    trace = [TraceRequest(0.0, prompt, 5)]
    good = reference_check(ref, trace, [want])
    assert good["agreement"] == good["argmax_equal"] == 1.0 and good["tokens"] == 5
    wrong = list(want)
    wrong[-1] = (wrong[-1] + 1) % ref.config.vocab_size
    bad = reference_check(ref, trace, [wrong])
    assert bad["argmax_equal"] == 0.8 and bad["clear_equal"] == bad["clear_checked"] - 1


def test_warmup_leaves_an_idle_engine_with_fresh_counters() -> None:
    model, ref = tiny()
    mgr = kvvm.Manager("host", precommit=True)
    engine = Engine(model, slots=2, max_len=256, manager=mgr, prefix_cache_bytes=16 << 20, programmatic_launches=True)
    assert engine.runner.programmatic_launches, "the runner captures its step so (a CPU runs no captured step)"
    engine.warmup(prompt_tokens=20, new_tokens=2)
    assert engine.idle and engine.stats == EngineStats()
    assert engine.prefix_cache is not None and engine.prefix_cache.stats()["cached_entries"] == 0
    r = engine.submit(prompts([9], seed=8)[0], 3)
    engine.run()
    assert r.tokens == reference(ref, r.prompt, 3)
    assert engine.stats.admitted == 1 and engine.stats.prefix_hits == 0
    engine.submit([1, 2], 1)
    with pytest.raises(kvvm.InvalidArgumentError, match="idle"):
        engine.warmup()
    with pytest.raises(kvvm.InvalidArgumentError, match="does not fit"):
        Engine(model, slots=1, max_len=16, manager=mgr).warmup(prompt_tokens=16)
    engine.close()
