"""KvvmCache with a real (small, random-weight) Llama model from transformers: the same logits
as DynamicCache, `generate` unchanged, growth in place, the shared-prefix flow. On the host
backend on a CPU; the same tests run on CUDA in test_cuda.py."""

from __future__ import annotations

import pytest

import kvvm
from conftest import host_available

torch = pytest.importorskip("torch", reason="skipped: no torch")
transformers = pytest.importorskip("transformers", reason="skipped: no transformers")

from kvvm.transformers import KvvmCache, KvvmPrefix  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

LAYOUTS = ["seq-major", "token-major", "head-major"]


@pytest.fixture(scope="module")
def model() -> object:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=8192,
    )
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()


@pytest.fixture
def mgr() -> kvvm.Manager:
    return kvvm.Manager("host", precommit=True, headroom_tokens=16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decoding_matches_dynamic_cache_and_grows_in_place(model, mgr, layout) -> None:
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (3, 50))
    dc = transformers.DynamicCache(config=cfg)
    kc = KvvmCache(cfg, 3, 300, manager=mgr, layout=layout, dtype="fp32")
    ptrs = [layer._k_full.data_ptr() for layer in kc.layers]
    with torch.no_grad():
        a = model(input_ids=ids, past_key_values=dc, use_cache=True)
        b = model(input_ids=ids, past_key_values=kc, use_cache=True)
        assert torch.allclose(a.logits, b.logits, atol=1e-5)
        tok = a.logits[:, -1:].argmax(-1)
        for _ in range(20):
            a = model(input_ids=tok, past_key_values=dc, use_cache=True)
            b = model(input_ids=tok, past_key_values=kc, use_cache=True)
            assert torch.allclose(a.logits, b.logits, atol=1e-5)
            tok = a.logits[:, -1:].argmax(-1)
    assert kc.get_seq_length() == 70
    assert kc.layers[0].keys.shape == (3, 2, 70, 32)
    assert [layer._k_full.data_ptr() for layer in kc.layers] == ptrs, "the pointer never changes"
    # Only the windows holding live tokens are committed (plus pre-commit headroom).
    plan = kc.plan
    assert kc.committed_bytes <= 3 * plan.committed_bytes_for_tokens(70 + 16)
    del a, b
    assert kc.release() > 0
    with pytest.raises(kvvm.ReleasedError):
        kc._ensure(1000)


def test_the_default_layout_is_token_major(model, mgr) -> None:
    """One fragment per request: at most one granule per request beyond the live tokens."""
    kc = KvvmCache(model.config, 2, 100, manager=mgr, dtype="fp32")
    assert kc.plan.layout == "token-major"
    kc.release()
    import inspect

    assert inspect.signature(KvvmPrefix.build).parameters["layout"].default == "token-major"


def test_generate_runs_on_kvvm_memory_with_the_same_tokens(model, mgr) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 30))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        cache = KvvmCache(model.config, 2, 100, manager=mgr, dtype="fp32")
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() >= 39
    cache.release()
    assert mgr.snapshot().committed == 0


def test_a_shared_prompt_is_prefilled_once_and_attached_read_only(model, mgr) -> None:
    cfg = model.config
    # fp32, 2 layers x {K, V} x 2 KV heads x 32: 1 KiB per token token-major, 2048 tokens a window.
    system = torch.randint(0, cfg.vocab_size, (1, 2100))
    suffix = torch.randint(0, cfg.vocab_size, (4, 12))
    with torch.no_grad():
        prefix = KvvmPrefix.build(model, system, manager=mgr, max_cache_len=2300, layout="token-major", dtype="fp32")
        assert prefix.tokens == 2100 and prefix.shared.shared_tokens == 2048
        cache = KvvmCache.from_prefix(prefix, 4, 2300)
        assert cache.get_seq_length() == 2100
        pos = torch.arange(2100, 2112)
        out = model(input_ids=suffix, past_key_values=cache, use_cache=True, cache_position=pos)
        ref = model(input_ids=torch.cat([system.expand(4, -1), suffix], 1), use_cache=False)
    assert torch.allclose(out.logits[:, -1], ref.logits[:, -1], atol=1e-4)
    snap = mgr.snapshot()
    assert snap.shared == prefix.bytes == mgr.granule
    # Each request holds only its tail window privately.
    assert cache.owned_bytes == 4 * mgr.granule
    with pytest.raises(kvvm.InvalidArgumentError):
        KvvmCache.from_prefix(prefix, 2, 2300, dtype="fp16")
    del out
    cache.release()
    prefix.cache.release()


def test_views_held_by_the_caller_block_release(model, mgr) -> None:
    kc = KvvmCache(model.config, 1, 64, manager=mgr, dtype="fp32")
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=kc, use_cache=True)
    held = kc.layers[0].keys
    kc._unbind()
    with pytest.raises(kvvm.ViewsAliveError):
        kc.batch.release()
    del held
    assert kc.release() > 0


def test_unsupported_configs_and_backends_are_refused(model) -> None:
    with pytest.raises(kvvm.InvalidArgumentError, match="not hold torch tensors"):
        KvvmCache(model.config, 1, 10, backend="sim")
    cfg = transformers.MistralConfig(sliding_window=16)
    with pytest.raises(kvvm.InvalidArgumentError):
        KvvmCache(cfg, 1, 10, backend="host")


def test_the_benchmark_runs_end_to_end_on_the_cpu(capsys, tmp_path) -> None:
    import json

    from kvvm import bench

    out_json = tmp_path / "bench.json"
    rc = bench.main(
        [
            "generate", "--tiny", "--device", "cpu", "--backend", "host", "--dtype", "float32",
            "--points", "2x40", "--new", "6", "--warmup", "2", "--shared-requests", "2",
            "--shared-prompt", "1100", "--shared-suffix", "8", "--shared-layouts", "token-major",
            "--repeat", "2", "--static-repeat", "1", "--interleaved-steps", "4", "--json", str(out_json),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "kvvm:seq-major" in out and "kvvm:token-major" in out and "shared prompt" in out
    assert "median of 2 rounds' ratios" in out and "step-interleaved:" in out
    assert "paired per step" in out
    results = json.loads(out_json.read_text())["results"]
    for r in results:
        # Two rounds each (the second seeded from the reference's prefill), StaticCache one;
        # the best is kept.
        assert len(r["rounds_p50_ms"]) == (1 if r["cache"] == "static" else 2)
        assert r["step_p50_ms"] == min(r["rounds_p50_ms"])
        # Then every cache alive at once, a step of each in turn.
        assert r["interleaved_p50_ms"] > 0 and r["interleaved_tokens_per_s"] > 0
        assert len(r["interleaved_steps_ms"]) == 4
        assert r["prefill_ms"] > 0 and r["kv_bytes_held"] > 0
    kvvm_rows = [r for r in results if r["cache"].startswith("kvvm")]
    # Correctness comes from the first round, where kvvm is compared with the reference.
    assert kvvm_rows and all(r["argmax_checked"] is not None for r in kvvm_rows)
    assert all(r["max_abs_logit_diff"] < 1e-3 for r in kvvm_rows)


def test_the_paired_ratio_is_the_median_of_per_step_ratios() -> None:
    from kvvm import bench_caches

    # Steps 0-1 are warm-up; then 2/1, 4/2, 9/3: the median is 2.
    fast = [50.0, 50.0, 1.0, 2.0, 3.0]
    slow = [1.0, 1.0, 2.0, 4.0, 9.0]
    assert bench_caches.paired_ratio(fast, slow, 2) == 2.0
    # Only the common steps count; none left after the warm-up gives None.
    assert bench_caches.paired_ratio(fast[:3], slow, 2) == 2.0
    assert bench_caches.paired_ratio(fast, slow[:2], 2) is None


def test_a_seeded_cache_decodes_as_the_prefilled_one(model) -> None:
    """The benchmark's later rounds write the prompt's K/V with each cache's own ``update``
    instead of running the prefill: the decode that follows must be the same."""
    from transformers import DynamicCache

    from kvvm import bench_caches

    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=ref, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        seed = bench_caches.snapshot(ref, 20)
        want = model(input_ids=tok, past_key_values=ref, use_cache=True, cache_position=torch.tensor([20])).logits
        for cache in (DynamicCache(config=model.config), KvvmCache(model.config, 2, 64, backend="host", dtype="fp32")):
            bench_caches.seed_cache(cache, seed)
            assert cache.get_seq_length() == 20
            got = model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=torch.tensor([20])).logits
            assert torch.allclose(got, want, atol=1e-5)
            if isinstance(cache, KvvmCache):
                cache.release()


def test_kvvm_attention_sets_the_kernels_once_per_forward_and_unwraps(model, mgr, monkeypatch) -> None:
    import torch.nn.attention as attention

    from kvvm import attention as kt

    entered: list[int] = []
    real = attention.sdpa_kernel

    def counting(*args, **kwargs):
        entered.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_kernel", counting)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        kt.use_kvvm_attention(model)
        assert "_kvvm_original_forward" in model.__dict__
        kt.use_kvvm_attention(model)  # idempotent: wrapped once
        cache = KvvmCache(model.config, 2, 64, manager=mgr, dtype="fp32")
        out = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        # Two layers, one forward: the kernel scope was entered once, not once per layer.
        assert len(entered) == 1
        assert not getattr(kt._SCOPE, "active", False), "the scope ends with the forward"
        kt.use_kvvm_attention(model, enable=False)
        assert "forward" not in model.__dict__ and "_kvvm_original_forward" not in model.__dict__
        again = model(input_ids=ids).logits
    assert torch.allclose(out, ref, atol=1e-5) and torch.equal(again, ref)
    cache.release()


def test_the_interleaved_phase_drops_a_cache_that_runs_out_of_memory(model, monkeypatch) -> None:
    """With every cache alive at once, one that runs out of memory leaves the phase (named in
    the notes) and the others are still measured."""
    import argparse

    from transformers import DynamicCache

    from kvvm import bench_caches, bench_decode

    class Starving(DynamicCache):
        calls = 0

        def update(self, *a, **k):  # type: ignore[no-untyped-def]
            Starving.calls += 1
            if Starving.calls > 2 * model.config.num_hidden_layers:
                raise torch.OutOfMemoryError("no more memory")
            return super().update(*a, **k)

    real = bench_caches.make_cache

    def make(kind, cfg, args, batch, total):  # type: ignore[no-untyped-def]
        return Starving(config=cfg) if kind == "static" else real(kind, cfg, args, batch, total)

    monkeypatch.setattr(bench_caches, "make_cache", make)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        ref = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=ref, use_cache=True)
        tokens = [out.logits[:, -1:].argmax(-1)] * 4
        seed = bench_caches.snapshot(ref, 12)
    args = argparse.Namespace(
        device="cpu", interleaved_steps=4, backend="host", dtype="float32", headroom=16
    )
    times, notes = bench_decode.run_interleaved(
        model, model.config, args, ["dynamic", "static", "kvvm:token-major"], ids, {"tokens": tokens}, [seed]
    )
    assert set(times) == {"dynamic", "kvvm:token-major"}
    assert all(len(t) == 4 for t in times.values())
    assert any("static left the interleaved phase" in n for n in notes), notes
