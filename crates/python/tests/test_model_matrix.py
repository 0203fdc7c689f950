"""The model matrix (``model_matrix.py``): for every architecture, on the host backend in
fp32, with the real model's bytes per token (half its layers in fp32: see the matrix's
module doc):

- the test shape keeps the real model's K/V shapes and how a token falls on a 2 MiB window;
- ``generate()`` with a ``KvvmCache`` gives DynamicCache's greedy tokens;
- the engine, several requests of different lengths at once (more than its slots), gives the
  tokens of each request run alone on DynamicCache;
- a prefix built with ``KvvmPrefix.build`` and attached with ``KvvmCache.from_prefix`` to
  new requests, each prefilling its own tail, gives DynamicCache's tokens over the whole
  prompt;
- the engine's prefix cache is hit by requests sharing a system prompt, with the same tokens;
- a prefix published through the broker is opened by another process, attached and served by
  that process's engine, with the same tokens;

and every manager holds nothing afterwards. Tests are grouped by architecture (one model
built per architecture)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from conftest import host_available

import kvvm

if TYPE_CHECKING:
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    transformers = pytest.importorskip("transformers", reason="skipped: no transformers")

import model_matrix as mm  # noqa: E402
from kvvm.transformers.cache_groups import SLIDING_PREFIX_CACHE_REFUSAL  # noqa: E402
from kvvm.engine import Engine  # noqa: E402
from kvvm.transformers import KvvmCache  # noqa: E402
from kvvm.prefix import KvvmPrefix  # noqa: E402
from model_checks import MiB, Peer, greedy_after_prefix, holds_nothing, reference_greedy, run_broker  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The matrix's models are small: one thread runs them faster than two, and does not
    collapse when the machine's cores are busy with other work (two threads spinning for
    each other made a step 10 to 20 times slower on a shared 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=mm.ARCHS, ids=lambda a: a.name)
def arch(request: pytest.FixtureRequest) -> mm.Arch:
    """One architecture; pytest runs every test of one before the next."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def model(arch: mm.Arch) -> Any:
    """The architecture's test model (fp32, random weights of seed 0)."""
    return mm.build_model(arch)


@pytest.fixture(scope="module")
def engine_model(model: Any) -> Any:
    """A copy of the model for the engines (which switch it to the kvvm attention)."""
    return copy.deepcopy(model)


class References:
    """Greedy tokens on DynamicCache, one request at a time, computed once per prompt."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.done: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        missing = [p for p in prompts if (tuple(p), new_tokens) not in self.done]
        for p, toks in zip(missing, reference_greedy(self.model, missing, new_tokens), strict=True):
            self.done[(tuple(p), new_tokens)] = toks
        return [self.done[(tuple(p), new_tokens)] for p in prompts]


@pytest.fixture(scope="module")
def reference(model: Any) -> References:
    """The architecture's references."""
    return References(model)


@pytest.fixture
def mgr() -> kvvm.Manager:
    """A host manager with the pre-committer."""
    return kvvm.Manager("host", precommit=True, headroom_tokens=16)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A broker of 1 GiB, tenant ``t`` (one for the whole matrix)."""
    yield from run_broker(tmp_path_factory.mktemp("matrix") / "broker.sock", "--budget-bytes", "1GiB", "--tenant", "t")


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    """The second process (one for the whole matrix, restarted if it dies)."""
    p = Peer()
    yield p
    p.close()


def _max_len(p: mm.Prompts) -> int:
    need = max(p.prefix + max(p.tails), *p.lengths) + p.new_tokens + 16
    return 64 * math.ceil(need / 64)


def _prefix_and_tails(arch: mm.Arch, lengths: tuple[int, ...], seed: int) -> tuple[list[int], list[list[int]]]:
    p = mm.prompts(arch)
    return mm.tokens(p.prefix, seed), [mm.tokens(n, seed + 1 + i) for i, n in enumerate(lengths)]


def test_the_test_shape_keeps_the_real_kv_shape_and_window_fit(arch: mm.Arch, model: Any, mgr: kvvm.Manager) -> None:
    real = mm.real_config(arch)
    small = model.config
    for key in ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings"):
        assert getattr(small, key, None) == getattr(real, key, None), key
    test = kvvm.geometry_from_config(small, 1024, "fp32")
    want = kvvm.geometry_from_config(real, 1024, "bf16")
    assert (test.kv_heads, test.head_dim) == (arch.kv_heads, arch.head_dim) == (want.kv_heads, want.head_dim)
    assert 2 * test.layers == want.layers == arch.layers
    assert test.bytes_per_token == want.bytes_per_token == arch.bytes_per_token()
    # The window holds as many tokens as the real model's, and a token straddles a window
    # boundary exactly where the real model's does.
    plan = kvvm.LayoutPlan(test, "token-major", mgr.granule)
    assert mgr.granule == mm.REAL_GRANULE
    assert plan.mapped_tokens(1) == mgr.granule // want.bytes_per_token
    assert (mgr.granule % test.bytes_per_token == 0) == mm.tokens_per_window(want.bytes_per_token).is_integer()


def test_generate_with_a_kvvm_cache_gives_dynamic_caches_tokens(
    arch: mm.Arch, model: Any, mgr: kvvm.Manager
) -> None:
    p = mm.prompts(arch)
    n = p.prefix + 3
    ids = torch.tensor([mm.tokens(n, 11), mm.tokens(n, 12)])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = model.generate(
            ids, attention_mask=mask, past_key_values=transformers.DynamicCache(config=model.config),
            max_new_tokens=p.new_tokens, do_sample=False,
        )
        cache = KvvmCache(model, 2, _max_len(p), manager=mgr)
        got = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=p.new_tokens, do_sample=False)
    assert got.tolist() == want.tolist()
    assert cache.geometry.dtype == "fp32"
    del got
    cache.release()
    holds_nothing(mgr)


def test_the_engine_gives_each_request_its_tokens_alone(
    arch: mm.Arch, engine_model: Any, reference: References, mgr: kvvm.Manager
) -> None:
    p = mm.prompts(arch)
    prompts = [mm.tokens(n, 20 + i) for i, n in enumerate(p.lengths)]
    engine = Engine(engine_model, slots=3, max_len=_max_len(p), manager=mgr, prefill_chunk=64, compile=False)
    reqs = [engine.submit(q, p.new_tokens, eos_token_ids=[]) for q in prompts]
    engine.run()
    assert engine.stats.admitted == len(prompts) and engine.stats.finished == len(prompts)
    assert [r.tokens for r in reqs] == reference(prompts, p.new_tokens)
    engine.close()
    holds_nothing(mgr)


def test_a_prefix_attached_to_new_requests_gives_dynamic_caches_tokens(
    arch: mm.Arch, model: Any, reference: References, mgr: kvvm.Manager
) -> None:
    p = mm.prompts(arch)
    prefix, tails = _prefix_and_tails(arch, (5, 5, 5), seed=30)
    built = KvvmPrefix.build(model, torch.tensor([prefix]), manager=mgr, max_cache_len=_max_len(p))
    cache = KvvmCache.from_prefix(built, len(tails), _max_len(p))
    start = cache.get_seq_length()
    assert 0 < start == built.tokens <= p.prefix
    assert mgr.snapshot().shared == built.bytes > 0, "the prefix's windows are billed once"
    # Each request prefills the rest of its prompt: its own tail (and whatever of the prefix
    # the cache does not start with).
    got = greedy_after_prefix(model, cache, [prefix[start:] + t for t in tails], start, p.new_tokens)
    assert got == reference([prefix + t for t in tails], p.new_tokens)
    cache.release()
    assert built.cache is not None
    built.cache.release()
    del built
    holds_nothing(mgr)


def test_the_engines_prefix_cache_is_hit_by_requests_sharing_a_system_prompt(
    arch: mm.Arch, engine_model: Any, reference: References, mgr: kvvm.Manager
) -> None:
    p = mm.prompts(arch)
    system, tails = _prefix_and_tails(arch, p.tails, seed=40)
    prompts = [system + t for t in tails]
    if mm.slides(engine_model, _max_len(p)):
        # Refused with the reason (a KvvmPrefix is shared across sliding layers instead).
        with pytest.raises(kvvm.InvalidArgumentError) as refused:
            Engine(engine_model, slots=1, max_len=_max_len(p), manager=mgr, prefix_cache_bytes=64 * MiB)
        assert str(refused.value) == SLIDING_PREFIX_CACHE_REFUSAL
        holds_nothing(mgr)
        return
    engine = Engine(
        engine_model, slots=len(prompts), max_len=_max_len(p), manager=mgr, prefill_chunk=64,
        prefix_cache_bytes=64 * MiB, prefix_handle_tokens=1, compile=False,
    )
    reqs = [engine.submit(q, p.new_tokens, eos_token_ids=[]) for q in prompts]
    engine.run()
    # The first request prefills the system prompt and publishes it; the others map it.
    assert engine.stats.prefix_hits == len(prompts) - 1, engine.stats
    assert all(0 < r.prefix_hit_tokens <= len(system) for r in reqs[1:]), [r.prefix_hit_tokens for r in reqs]
    assert [r.tokens for r in reqs] == reference(prompts, p.new_tokens)
    engine.close()
    holds_nothing(mgr)


def test_a_prefix_published_through_the_broker_serves_another_process(
    arch: mm.Arch, model: Any, reference: References, broker: Path, peer: Peer
) -> None:
    """This process builds and publishes the prefix; the peer process opens it, attaches it
    to two requests that prefill their own tails, then serves two more with an engine whose
    prefix cache holds it: every request gets DynamicCache's tokens over its whole prompt,
    and both processes hold nothing once they let go."""
    p = mm.prompts(arch)
    prefix, tails = _prefix_and_tails(arch, (5, 5), seed=50)
    _, engine_tails = _prefix_and_tails(arch, (3, 12), seed=60)
    key = f"{arch.name}-system"
    publisher = kvvm.Manager("host", broker=broker, tenant="t", lease_batch_bytes=4 * MiB)
    built = KvvmPrefix.build(model, torch.tensor([prefix]), manager=publisher, max_cache_len=_max_len(p))
    assert built.publish(key) == built.bytes > 0
    reply = peer.request(
        {
            "arch": arch.name, "seed": 0, "socket": str(broker), "tenant": "t", "key": key,
            "max_len": _max_len(p), "backend": "host", "device": "cpu", "prefix": prefix,
            "tails": tails, "engine_tails": engine_tails, "new_tokens": p.new_tokens,
        }
    )
    assert reply["digest"] == mm.weights_digest(model), "both processes hold the same weights"
    assert 0 < reply["opened_tokens"] <= p.prefix
    assert reply["billed_shared"] == 0, "the prefix is billed to its publisher"
    assert reply["attach"] == reference([prefix + t for t in tails], p.new_tokens)
    if mm.slides(model, _max_len(p)):
        assert reply["engine_refused"] == SLIDING_PREFIX_CACHE_REFUSAL
    else:
        assert 0 < reply["added"] <= p.prefix
        assert all(h > 0 for h in reply["hits"]), reply["hits"]
        assert reply["engine"] == reference([prefix + t for t in engine_tails], p.new_tokens)
    assert reply["remaining_users"] == 1, "the publisher still uses it"
    after = reply["after_close"]
    assert (after["committed"], after["shared"], after["quarantined"]) == (0, 0, 0), after
    assert reply["after_trim"]["used"] == 0, reply["after_trim"]
    assert built.cache is not None
    built.cache.release()
    assert built.close(key) == 0
    del built
    holds_nothing(publisher)
