"""KvvmCache as a newcomer meets it on a CPU: a model built from a config (fp32, the config
naming no dtype) gets a cache of its own dtype when the cache is given the model, and a clear
kvvm error naming both dtypes and ``dtype=`` when the cache was made for another; beam search
is refused for what it is; a manager without a pre-committer is used as it is; the cache
keyword of newer transformers is found."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

import kvvm
from conftest import host_available

if TYPE_CHECKING:
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    transformers = pytest.importorskip("transformers", reason="skipped: no transformers")

from kvvm.transformers import KvvmCache, cache_argument  # noqa: E402
from kvvm.prefix import KvvmPrefix  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")


@pytest.fixture(scope="module")
def model() -> object:
    """What a newcomer builds: a model straight from a config, on the CPU, in torch's default
    dtype (fp32); the config names no dtype."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=4096,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def test_the_cache_takes_the_models_dtype_and_generates_its_tokens(model) -> None:
    assert model.config.dtype is None and model.dtype == torch.float32
    ids = torch.randint(0, 1000, (2, 20))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        cache = KvvmCache(model, 2, 64, backend="host")
        assert cache.geometry.dtype == "fp32"
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **{cache_argument(model): cache}
        )
    assert torch.equal(out, ref)
    cache.release()


def test_a_cache_of_another_dtype_is_refused_naming_both_and_the_argument(model) -> None:
    ids = torch.randint(0, 1000, (2, 20))
    # The config names no dtype: the cache defaults to bf16, the model makes fp32 K/V.
    cache = KvvmCache(model.config, 2, 64, backend="host")
    assert cache.geometry.dtype == "bf16"
    with torch.no_grad(), pytest.raises(kvvm.InvalidArgumentError) as e:
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=2)
    message = str(e.value)
    for needle in ("torch.float32", "torch.bfloat16", "dtype="):
        assert needle in message, message
    cache.release()


def test_a_prefix_takes_the_models_dtype(model) -> None:
    mgr = kvvm.Manager("host")
    # fp32 token-major: 1 KiB a token, so a 2 MiB window is 2048 tokens, the shortest prefix.
    system = torch.randint(0, 1000, (1, 2100))
    with torch.no_grad():
        prefix = KvvmPrefix.build(model, system, manager=mgr, max_cache_len=2200)
    assert prefix.plan.geometry.dtype == "fp32"
    cache = KvvmCache.from_prefix(prefix, 2, 2200)
    cache.release()
    assert prefix.cache is not None
    prefix.cache.release()


def test_beam_search_is_refused_as_such(model) -> None:
    ids = torch.randint(0, 1000, (2, 10))
    cache = KvvmCache(model, 2, 64, backend="host")
    with torch.no_grad(), pytest.raises(kvvm.InvalidArgumentError, match="num_beams"):
        model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=cache, num_beams=2, max_new_tokens=2
        )
    cache.release()


def test_a_manager_without_a_pre_committer_is_used_as_it_is(model) -> None:
    mgr = kvvm.Manager("host")
    cache = KvvmCache(model, 1, 64, manager=mgr)
    assert not cache.batch[0].precommitted
    cache.release()


def test_the_cache_keyword_follows_the_models_forward(model) -> None:
    assert cache_argument(model) == "past_key_values"  # transformers 5.17

    class Newer:
        def forward(self, input_ids: object = None, cache: object = None) -> None:
            pass

    assert cache_argument(Newer()) == "cache"


@pytest.mark.parametrize("kvvm_attention", [True, False], ids=["kvvm-attention", "sdpa"])
@pytest.mark.parametrize(
    ("rows", "kwargs"),
    [(2, {}), (1, {"num_beams": 2}), (1, {"num_return_sequences": 2, "do_sample": True})],
    ids=["two-rows", "num_beams", "num_return_sequences"],
)
def test_a_batch_other_than_the_caches_is_refused_before_any_work(model, kvvm_attention, rows, kwargs) -> None:
    """``generate`` with more sequences than the cache has slots (two rows, beams, several
    returned sequences) is refused with a clear InvalidArgumentError before the cache commits
    or counts anything; the same cache then generates the reference tokens."""
    from kvvm.transformers import use_kvvm_attention

    use_kvvm_attention(model, enable=kvvm_attention)
    try:
        cache = KvvmCache(model, 1, 64, manager=kvvm.Manager("host"))
        ids = torch.randint(0, 1000, (rows, 10), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), pytest.raises(kvvm.InvalidArgumentError, match="2 sequences for 1 KvvmCache slot"):
            model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=3, **kwargs)
        assert cache.committed_bytes == 0 and cache.get_seq_length() == 0, "nothing was done"
        one = ids[:1]
        with torch.no_grad():
            out = model.generate(one, attention_mask=torch.ones_like(one), past_key_values=cache, max_new_tokens=3, do_sample=False)
        cache.release()
    finally:
        use_kvvm_attention(model, enable=False)
    with torch.no_grad():
        ref = model.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=3, do_sample=False)
    assert torch.equal(out, ref)
