"""KvvmCache with a real (small, random-weight) Llama model from transformers: the same logits
as DynamicCache, `generate` unchanged, growth in place, the shared-prefix flow. On the host
backend on a CPU; the same tests run on CUDA in test_cuda.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import pytest

import kvvm
from conftest import host_available

if TYPE_CHECKING:
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    transformers = pytest.importorskip("transformers", reason="skipped: no transformers")

from kvvm.transformers import KvvmCache  # noqa: E402
from kvvm.transformers.cache_layer import KvvmLayer  # noqa: E402
from kvvm.prefix import KvvmPrefix  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

LAYOUTS = ["seq-major", "token-major", "head-major"]


def kvvm_layers(cache: KvvmCache) -> list[KvvmLayer]:
    """The cache's layers: kvvm's own (transformers types ``Cache.layers`` with its base layers,
    whose K/V may be None)."""
    return cast("list[KvvmLayer]", cache.layers)


@pytest.fixture(scope="module")
def model() -> Any:
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
    model: Any = transformers.LlamaForCausalLM(cfg)
    return model.to(torch.float32).eval()


@pytest.fixture
def mgr() -> kvvm.Manager:
    return kvvm.Manager("host", precommit=True, headroom_tokens=16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decoding_matches_dynamic_cache_and_grows_in_place(model, mgr, layout) -> None:
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (3, 50))
    dc = transformers.DynamicCache(config=cfg)
    kc = KvvmCache(cfg, 3, 300, manager=mgr, layout=layout, dtype="fp32")
    ptrs = [t.data_ptr() for layer in range(2) for t in kc._kv(layer)]
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
    assert kvvm_layers(kc)[0].keys.shape == (3, 2, 70, 32)
    assert [t.data_ptr() for layer in range(2) for t in kc._kv(layer)] == ptrs, "the pointer never changes"
    # Only the windows holding live tokens are committed (plus pre-commit headroom).
    plan = kc.plan
    assert kc.committed_bytes <= 3 * plan.committed_bytes_for_tokens(70 + 16)
    del a, b
    assert kc.release() > 0
    with pytest.raises(kvvm.ReleasedError):
        kc.prepare(1)


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
    # Billed once: the whole window, and the prefix's tail (its 52 tokens past it).
    assert snap.shared == prefix.bytes == 2 * mgr.granule
    # Each request holds only its tail window privately (the tail copied there).
    assert cache.owned_bytes == 4 * mgr.granule
    with pytest.raises(kvvm.InvalidArgumentError):
        KvvmCache.from_prefix(prefix, 2, 2300, dtype="fp16")
    del out
    cache.release()
    assert prefix.cache is not None
    prefix.cache.release()


def test_views_held_by_the_caller_block_release(model, mgr) -> None:
    kc = KvvmCache(model.config, 1, 64, manager=mgr, dtype="fp32")
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=kc, use_cache=True)
    held = kvvm_layers(kc)[0].keys
    with pytest.raises(kvvm.ViewsAliveError):
        kc.release()
    del held
    assert kc.release() > 0


@pytest.mark.parametrize("unmap", ["free", "shrink", "release"])
def test_a_view_only_a_reference_cycle_keeps_does_not_block_an_unmap(model, mgr, unmap: str) -> None:
    """A view reachable from nothing but a cycle (here a list holding itself; in a serving
    loop, a frame kept by an exception's traceback) is garbage: an unmap succeeds whether or
    not the collector has run, while a view the caller still holds keeps blocking it."""
    import gc

    kc = KvvmCache(model.config, 2, 64, manager=mgr, dtype="fp32")
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=kc, use_cache=True)
    kc.crop(4)
    gc.disable()
    try:
        cycle: list[object] = [kvvm_layers(kc)[0].keys]
        cycle.append(cycle)
        del cycle
        held = kvvm_layers(kc)[1].values
        with pytest.raises(kvvm.ViewsAliveError):
            kc.free(0) if unmap == "free" else kc.shrink() if unmap == "shrink" else kc.release()
        del held
        freed = kc.free(0) if unmap == "free" else kc.shrink() if unmap == "shrink" else kc.release()
        # A shrink to 4 of 8 tokens gives back no whole window: it only must not be refused.
        assert freed > 0 or unmap == "shrink"
    finally:
        gc.enable()
    if unmap != "release":
        kc.release()


def test_unsupported_configs_and_backends_are_refused(model) -> None:
    with pytest.raises(kvvm.InvalidArgumentError, match="not hold torch tensors"):
        KvvmCache(model.config, 1, 10, backend="sim")
    # Sliding windows are served (test_sliding.py); bidirectional attention is not.
    cfg = transformers.Gemma3TextConfig(use_bidirectional_attention=True)
    with pytest.raises(kvvm.InvalidArgumentError, match="causal"):
        KvvmCache(cfg, 1, 10, backend="host")


def test_kvvm_attention_sets_the_kernels_once_per_forward_and_unwraps(model, mgr, monkeypatch) -> None:
    import torch.nn.attention as attention

    from kvvm.transformers import attention as kt

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


@pytest.mark.parametrize("attention", ["sdpa", "kvvm"])
def test_layers_and_iteration_give_every_cached_token_as_dynamic_cache_does(model, mgr, attention: str) -> None:
    """``cache.layers[i].keys``/``.values`` and ``iter(cache)`` are every token each layer
    holds, as a DynamicCache's are, with the kvvm attention too (where attention reads the
    cache's memory itself): views of the cache's memory, no copy."""
    from kvvm.transformers import use_kvvm_attention

    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    if attention == "kvvm":
        use_kvvm_attention(model)
    try:
        dc = transformers.DynamicCache(config=cfg)
        kc = KvvmCache(cfg, 2, 64, manager=mgr, dtype="fp32")
        with torch.no_grad():
            a = model(input_ids=ids, past_key_values=dc, use_cache=True)
            b = model(input_ids=ids, past_key_values=kc, use_cache=True)
            for _ in range(3):
                tok = a.logits[:, -1:].argmax(-1)
                a = model(input_ids=tok, past_key_values=dc, use_cache=True)
                b = model(input_ids=tok, past_key_values=kc, use_cache=True)
        assert len(kc.layers) == len(dc.layers) == cfg.num_hidden_layers
        for mine, theirs in zip(kvvm_layers(kc), dc.layers, strict=True):
            assert isinstance(theirs, transformers.DynamicLayer) and theirs.keys is not None and theirs.values is not None
            assert mine.keys.shape == theirs.keys.shape == (2, 2, 15, 32)
            assert torch.allclose(mine.keys, theirs.keys, atol=1e-5)
            assert torch.allclose(mine.values, theirs.values, atol=1e-5)
        for (k, v), (dk, dv, *_) in zip(kc, dc, strict=True):
            assert torch.allclose(k, dk, atol=1e-5) and torch.allclose(v, dv, atol=1e-5)
        # Views of the cache's own memory: no copy.
        assert kvvm_layers(kc)[1].keys.untyped_storage().data_ptr() == kc._kv(1)[0].untyped_storage().data_ptr()
        if attention == "kvvm":
            # A ragged batch is read one request at a time.
            with torch.no_grad(), kc.select(0):
                model(input_ids=tok[:1], past_key_values=kc, use_cache=True)
            with pytest.raises(kvvm.InvalidArgumentError, match="select"):
                kvvm_layers(kc)[0].keys
            with kc.select(0):
                assert kvvm_layers(kc)[0].keys.shape == (1, 2, 16, 32)
        del a, b, k, v
        assert kc.release() > 0
    finally:
        use_kvvm_attention(model, enable=False)
