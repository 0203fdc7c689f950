"""A system prompt shared by eight requests on the Qwen2.5-0.5B shape, on the host backend
and on CUDA (skipped without a GPU): a 300-token prefix built once, attached to 8 requests
that each prefill their own 40-token tail and decode 16 tokens; the same 8 prompts through
the engine's prefix cache (the prefix published by the first request, or added to it); and
the prefix published through the broker and served by a second process. Every request gets
DynamicCache's greedy tokens over its whole prompt (fp32), and every manager holds nothing
afterwards.

The shape is the real model's K/V per token: Qwen2.5-0.5B has 24 layers x 2 KV heads x 64
x {K, V}, 12288 bytes a token in bf16; this test model has 12 of those layers in fp32, the
same 12288 bytes, so a 2 MiB window holds 170.67 tokens as the real model's does: token 170
straddles the first window boundary, and the prompt's 301st token lies in the prefix's last,
partly filled window."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from conftest import cuda_available, host_available

import kvvm

if TYPE_CHECKING:
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    transformers = pytest.importorskip("transformers", reason="skipped: no transformers")

import model_matrix as mm  # noqa: E402
from kvvm.engine import Engine  # noqa: E402
from kvvm.transformers import KvvmCache  # noqa: E402
from kvvm.prefix import KvvmPrefix  # noqa: E402
from model_checks import MiB, Peer, greedy_after_prefix, holds_nothing, run_broker  # noqa: E402

ARCH = mm.BY_NAME["qwen2.5-0.5b"]
SYSTEM, TAIL, REQUESTS, NEW = 300, 40, 8, 16
MAX_LEN = 512

BACKENDS = [
    pytest.param("host", marks=pytest.mark.skipif(not host_available(), reason="skipped: no host backend")),
    pytest.param("cuda", marks=pytest.mark.skipif(not cuda_available(), reason="skipped: no CUDA driver or GPU")),
]


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One CPU thread (a small model: faster than two, and robust on a shared machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest, one_thread: None) -> str:
    """The backend, its device the model's."""
    return request.param  # type: ignore[no-any-return]


def _device(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


@pytest.fixture(scope="module")
def model(backend: str) -> Any:
    """The Qwen2.5-0.5B-shaped model (fp32, seed 0) on the backend's device."""
    return mm.build_model(ARCH).to(_device(backend))


@pytest.fixture(scope="module")
def prompts() -> tuple[list[int], list[list[int]]]:
    """The 300-token system prompt and the 8 requests' 40-token tails."""
    return mm.tokens(SYSTEM, 300), [mm.tokens(TAIL, 301 + i) for i in range(REQUESTS)]


@pytest.fixture(scope="module")
def reference(model: Any, prompts: tuple[list[int], list[list[int]]]) -> list[list[int]]:
    """DynamicCache's greedy tokens for the 8 whole prompts (one batch: they have one length)."""
    system, tails = prompts
    ids = torch.tensor([system + t for t in tails], device=next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=transformers.DynamicCache(config=model.config),
            max_new_tokens=NEW, do_sample=False,
        )
    return out[:, SYSTEM + TAIL :].tolist()  # type: ignore[no-any-return]


def test_the_shape_has_the_real_window_structure(backend: str, model: Any) -> None:
    mgr = kvvm.Manager(backend)
    geometry = kvvm.geometry_from_config(model.config, MAX_LEN, "fp32")
    assert geometry.bytes_per_token == 12288 == ARCH.bytes_per_token()
    plan = kvvm.LayoutPlan(geometry, "token-major", mgr.granule)
    assert mgr.granule == 2 * MiB, "the windows of the real model's 2 MiB granule"
    assert plan.mapped_tokens(1) == 170 and 170 * 12288 < 2 * MiB < 171 * 12288


def test_a_prefix_attached_to_eight_requests_gives_dynamic_caches_tokens(
    backend: str, model: Any, prompts: tuple[list[int], list[list[int]]], reference: list[list[int]]
) -> None:
    system, tails = prompts
    mgr = kvvm.Manager(backend, precommit=True, headroom_tokens=16)
    device = next(model.parameters()).device
    built = KvvmPrefix.build(model, torch.tensor([system], device=device), manager=mgr, max_cache_len=MAX_LEN)
    cache = KvvmCache.from_prefix(built, REQUESTS, MAX_LEN)
    assert cache.get_seq_length() == SYSTEM
    assert mgr.snapshot().shared == built.bytes > 0, "the prefix's windows are billed once"
    assert greedy_after_prefix(model, cache, tails, SYSTEM, NEW) == reference
    cache.release()
    assert built.cache is not None
    built.cache.release()
    del built
    holds_nothing(mgr)


@pytest.mark.parametrize("how", ["published-by-the-first-request", "added"])
def test_the_engines_prefix_cache_serves_eight_requests_dynamic_caches_tokens(
    backend: str, model: Any, prompts: tuple[list[int], list[list[int]]], reference: list[list[int]], how: str
) -> None:
    """The engine's defaults (a prefix cache of 256-token handles, rounded to whole windows):
    either the first request prefills the system prompt and the others find it, or a prefix
    built beforehand is added and every request finds it."""
    import copy

    system, tails = prompts
    mgr = kvvm.Manager(backend, precommit=True, headroom_tokens=16)
    engine = Engine(copy.deepcopy(model), slots=REQUESTS, max_len=MAX_LEN, manager=mgr, prefix_cache_bytes=256 * MiB)
    built = None
    if how == "added":
        device = next(model.parameters()).device
        built = KvvmPrefix.build(model, torch.tensor([system], device=device), manager=mgr, max_cache_len=MAX_LEN)
        assert engine.add_prefix(system, built) > 0
    reqs = [engine.submit(system + t, NEW, eos_token_ids=[]) for t in tails]
    engine.run()
    hit = reqs if how == "added" else reqs[1:]
    assert engine.stats.prefix_hits == len(hit), engine.stats
    assert all(0 < r.prefix_hit_tokens <= SYSTEM for r in hit), [r.prefix_hit_tokens for r in reqs]
    assert [r.tokens for r in reqs] == reference
    engine.close()
    if built is not None:
        assert built.cache is not None
        built.cache.release()
        del built
    holds_nothing(mgr)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A broker of 1 GiB, tenant ``t``."""
    yield from run_broker(tmp_path_factory.mktemp("acceptance") / "broker.sock", "--budget-bytes", "1GiB", "--tenant", "t")


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    """The second process."""
    p = Peer()
    yield p
    p.close()


def test_a_prefix_published_through_the_broker_serves_eight_requests_of_another_process(
    backend: str, model: Any, prompts: tuple[list[int], list[list[int]]], reference: list[list[int]],
    broker: Path, peer: Peer,
) -> None:
    """This process builds and publishes the system prompt; the other opens it, attaches it
    to 8 requests that prefill the rest of their prompts (from the opened prefix's last
    whole window) and decode, then serves the 8 prompts with an engine whose prefix cache
    holds it."""
    system, tails = prompts
    publisher = kvvm.Manager(backend, broker=broker, tenant="t", lease_batch_bytes=4 * MiB)
    device = next(model.parameters()).device
    built = KvvmPrefix.build(model, torch.tensor([system], device=device), manager=publisher, max_cache_len=MAX_LEN)
    key = f"qwen2.5-0.5b-system-{backend}"
    assert built.publish(key) == built.bytes > 0
    reply = peer.request(
        {
            "arch": ARCH.name, "seed": 0, "socket": str(broker), "tenant": "t", "key": key, "max_len": MAX_LEN,
            "backend": backend, "device": _device(backend), "prefix": system, "tails": tails,
            "engine_tails": tails, "new_tokens": NEW,
        }
    )
    assert reply["digest"] == mm.weights_digest(model)
    assert 0 < reply["opened_tokens"] <= SYSTEM and reply["billed_shared"] == 0
    assert reply["attach"] == reference
    assert all(h > 0 for h in reply["hits"]) and reply["engine"] == reference
    assert reply["remaining_users"] == 1
    after = reply["after_close"]
    assert (after["committed"], after["shared"], after["quarantined"]) == (0, 0, 0) and reply["after_trim"]["used"] == 0
    assert built.cache is not None
    built.cache.release()
    del built
    assert publisher.close_prefix(key) == 0
    holds_nothing(publisher)
