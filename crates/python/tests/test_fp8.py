"""FP8 KV (``kv_dtype="fp8_e4m3"``) on the CPU: the quantize/dequantize round trip against
e4m3's bounds, a KvvmCache in FP8 on the host backend whose logits stay near an fp32 cache's
(and leave that bound when a scale is wrong), a shared prefix read with its writer's scales,
the budget holding twice the tokens, the engine decoding in FP8, the refusals, a prefix shared
across processes (the Triton kernels' FP8 logic: test_fp8_triton.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
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

from kvvm.kernels.attend import attend, kernel_for  # noqa: E402
from kvvm.kernels.fp8 import E4M3, E4M3_MAX, dequantize, kv_storage, make_scales, quantize  # noqa: E402
from kvvm.transformers import KvvmCache, KvvmPrefix, use_kvvm_attention  # noqa: E402

needs_host = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

#: Logits of the tiny model below with an FP8 cache stay within these of an fp32 cache's (max,
#: mean absolute difference; its logits are about 0.2 apart, 1 at most): a wrong scale or a
#: wrong layout moves them by ten times as much (see the tests).
MAX_DIFF, MEAN_DIFF = 0.06, 0.012


# ---- the format ----


def test_round_trip_keeps_three_mantissa_bits_saturates_and_keeps_zeros() -> None:
    torch.manual_seed(0)
    scale = torch.tensor([0.5, 4.0])
    # Normal values of every binade e4m3 has, in units of each head's scale.
    mags = torch.exp2(torch.empty(2, 4000).uniform_(-6, 8.8))
    x = mags * torch.where(torch.rand(2, 4000) < 0.5, -1.0, 1.0) * scale[:, None]
    back = dequantize(quantize(x, scale, head_dim=0), scale, torch.float32, head_dim=0)
    rel = ((back - x).abs() / x.abs()).max().item()
    assert rel <= 2.0**-4 + 1e-7, rel  # half a unit in the last of 3 mantissa bits
    assert rel > 2.0**-5, "values are rounded to 3 bits, not kept"
    # Subnormals (below 2**-6 in scale units): an absolute error of half the least step, 2**-10.
    tiny = torch.empty(2, 1000).uniform_(-(2.0**-6), 2.0**-6) * scale[:, None]
    err = (dequantize(quantize(tiny, scale, 0), scale, torch.float32, 0) - tiny).abs() / scale[:, None]
    assert err.max().item() <= 2.0**-10 + 1e-9
    # Saturation at 448 scales, whatever the size (no inf, no NaN), and exact zeros.
    big = torch.tensor([[1e9, -1e9, 449.0, 0.0], [5e4, -2e3, 0.0, -0.0]]) * scale[:, None]
    q = quantize(big, scale, 0)
    assert q.dtype == E4M3
    want = torch.tensor([[E4M3_MAX, -E4M3_MAX, E4M3_MAX, 0.0], [E4M3_MAX, -E4M3_MAX, 0.0, 0.0]])
    assert torch.equal(q.to(torch.float32), want)
    # Values e4m3 holds come back exactly.
    exact = torch.tensor([1.0, 1.125, -3.5, 448.0, 2.0**-9])
    assert torch.equal(dequantize(quantize(exact, torch.ones(5), 0), torch.ones(5), torch.float32, 0), exact)


def test_scales_and_formats_are_checked() -> None:
    s = make_scales(3, 2, (0.5, 2.0), torch.device("cpu"))
    assert s.shape == (3, 2, 2) and s.dtype == torch.float32
    assert torch.equal(s[:, 0], torch.full((3, 2), 0.5)) and torch.equal(s[:, 1], torch.full((3, 2), 2.0))
    assert torch.equal(make_scales(1, 1, None, torch.device("cpu")), torch.ones(1, 2, 1))
    for bad in [(0.0, 1.0), (1.0, float("nan")), (-1.0, 1.0), (1.0,)]:
        with pytest.raises(kvvm.InvalidArgumentError):
            make_scales(3, 2, bad, torch.device("cpu"))
    with pytest.raises(kvvm.InvalidArgumentError, match="layers, 2, kv_heads"):
        make_scales(3, 2, torch.ones(3, 2, 4), torch.device("cpu"))
    assert kv_storage("fp8_e4m3", torch.bfloat16) == "fp8" and kv_storage(None, "bf16") == "bf16"
    for e5m2 in ("fp8_e5m2", torch.float8_e5m2):
        with pytest.raises(kvvm.InvalidArgumentError, match="e5m2"):
            kv_storage(e5m2, None)
    with pytest.raises(ValueError, match="FP8"):
        kernel_for(torch.device("cpu"), 4, "flash", fp8=True)
    if importlib.util.find_spec("triton") is not None:
        # On CUDA an FP8 prefill runs the Triton prefill kernel, a bf16 one FlashAttention.
        assert kernel_for(torch.device("cuda"), 4, fp8=True) == "triton"
        assert kernel_for(torch.device("cuda"), 4) == "flash"


def test_attention_over_fp8_kv_reads_the_scales() -> None:
    """The per-request SDPA path over FP8 K/V equals attention over their dequantized values,
    and K/V of FP8 without scales (or scales without FP8) are refused."""
    torch.manual_seed(1)
    k, v = torch.randn(3, 2, 40, 16) * 3, torch.randn(3, 2, 40, 16)
    scales = torch.tensor([[0.5, 2.0], [0.25, 1.0]])
    kq, vq = quantize(k, scales[0]), quantize(v, scales[1])
    q = torch.randn(2, 4, 3, 16)
    bounds = torch.tensor([[2, 0, 40], [0, 5, 23]], dtype=torch.int32)
    want = attend(q, dequantize(kq, scales[0], torch.float32), dequantize(vq, scales[1], torch.float32), bounds)
    got = attend(q, kq, vq, bounds, kv_scales=scales)
    assert torch.allclose(got, want, atol=1e-6)
    wrong = attend(q, kq, vq, bounds, kv_scales=scales.flip(1))
    assert not torch.allclose(wrong, want, atol=1e-2)
    with pytest.raises(ValueError, match="scales"):
        attend(q, kq, vq, bounds)
    with pytest.raises(ValueError, match="scales"):
        attend(q, k, v, bounds, kv_scales=scales)


# ---- KvvmCache ----


def _llama(sliding: int | None = None) -> Any:
    torch.manual_seed(0)
    common: dict[str, Any] = dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=8192,
    )
    model: Any
    if sliding is None:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=sliding, **common))
    model = model.to(torch.float32).eval()
    use_kvvm_attention(model)
    return model


def _logits(model, mgr, batch: int = 3, prompt: int = 40, steps: int = 12, corrupt=None, **kw) -> torch.Tensor:
    """The last-token logits of a prefill and ``steps`` decode steps (fixed tokens), with
    ``corrupt(cache)`` applied between the prefill and the decode."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 1000, (batch, prompt), generator=g)
    cache = KvvmCache(model, batch, 300, manager=mgr, **kw)
    outs = []
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        outs.append(out.logits[:, -1])
        if corrupt is not None:
            corrupt(cache)
        for _ in range(steps):
            tok = torch.randint(0, 1000, (batch, 1), generator=g)
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            outs.append(out.logits[:, -1])
    del out
    cache.release()
    return torch.stack(outs)


@needs_host
@pytest.mark.parametrize("sliding", [None, 16])
def test_an_fp8_cache_gives_logits_near_fp32_and_a_wrong_scale_does_not(sliding: int | None) -> None:
    model = _llama(sliding)
    mgr = kvvm.Manager("host", precommit=True, headroom_tokens=16)
    ref = _logits(model, mgr)
    fp8 = _logits(model, mgr, kv_dtype="fp8_e4m3")
    diff = (fp8 - ref).abs()
    assert diff.max().item() < MAX_DIFF and diff.mean().item() < MEAN_DIFF, (diff.max(), diff.mean())
    assert diff.max().item() > 0, "the cache holds 8-bit values, not the model's"
    # Scales that are not the ones the prefill wrote with: far outside the bound.
    def rescale(cache: KvvmCache) -> None:
        assert cache.kv_scales is not None
        cache.kv_scales.mul_(1.5)

    broken = (_logits(model, mgr, kv_dtype="fp8_e4m3", corrupt=rescale) - ref).abs()
    assert broken.max().item() > 2 * MAX_DIFF and broken.mean().item() > 2 * MEAN_DIFF
    # Other scales of its own: as close (the format is relative).
    scaled = (_logits(model, mgr, kv_dtype="fp8_e4m3", kv_scales=(0.03, 0.02)) - ref).abs()
    assert scaled.max().item() < MAX_DIFF and scaled.mean().item() < MEAN_DIFF


@needs_host
def test_an_fp8_cache_stores_one_byte_an_element_quantized_with_its_scales() -> None:
    model = _llama()
    mgr = kvvm.Manager("host", precommit=True)
    cache = KvvmCache(model, 2, 300, manager=mgr, kv_dtype="fp8_e4m3", kv_scales=(0.25, 0.5))
    full = KvvmCache(model, 2, 300, manager=mgr)
    assert cache.plan.geometry.dtype == "fp8" and full.plan.geometry.dtype == "fp32"
    assert full.plan.geometry.bytes_per_token == 4 * cache.plan.geometry.bytes_per_token
    assert cache.groups[0].slab is not None and cache.groups[0].slab.dtype == E4M3
    ids = torch.randint(0, 1000, (2, 9))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        model(input_ids=ids, past_key_values=full, use_cache=True)
    # The bytes written are the model's K quantized with the cache's scales (layer 0: its K/V
    # do not depend on an attention over FP8).
    k8 = cache._kv(0)[0]
    k32, v32 = full.layer_kv(0)
    assert torch.equal(k8[:2, :, :9].view(torch.uint8), quantize(k32, torch.full((2,), 0.25)).view(torch.uint8))
    # layer_kv gives dequantized copies.
    k, v = cache.layer_kv(0)
    assert k.dtype == torch.float32 and torch.allclose(v, v32, rtol=2.0**-4, atol=0.5 * 2.0**-10)
    del k8, k32, v32, k, v
    cache.release()
    full.release()


@needs_host
def test_fp8_needs_the_kvvm_attention_and_scales_need_fp8() -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=100,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval()
    mgr = kvvm.Manager("host")
    cache = KvvmCache(model, 1, 64, manager=mgr, kv_dtype="fp8_e4m3")
    with torch.no_grad(), pytest.raises(kvvm.InvalidArgumentError, match="kvvm attention"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), past_key_values=cache, use_cache=True)
    cache.release()
    with pytest.raises(kvvm.InvalidArgumentError, match="FP8"):
        KvvmCache(model, 1, 64, manager=mgr, kv_scales=(1.0, 1.0))
    with pytest.raises(kvvm.InvalidArgumentError, match="e5m2"):
        KvvmCache(model, 1, 64, manager=mgr, kv_dtype="fp8_e5m2")


@needs_host
def test_a_shared_fp8_prefix_is_read_with_the_scales_it_was_written_with() -> None:
    """Requests made from an FP8 prefix take its scales, and decode as a cache that prefilled
    the whole prompt itself in FP8 with those scales."""
    model = _llama()
    mgr = kvvm.Manager("host", precommit=True)
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, 1000, (1, 300), generator=g)
    tail = torch.randint(0, 1000, (2, 5), generator=g)
    scales = (0.05, 0.03)
    prefix = KvvmPrefix.build(model, system, manager=mgr, max_cache_len=400, kv_dtype="fp8_e4m3", kv_scales=scales)
    assert prefix.plan.geometry.dtype == "fp8"
    shared = KvvmCache.from_prefix(prefix, 2, 400, cascade=False)
    assert shared.kv_scales is not None and torch.equal(shared.kv_scales, make_scales(2, 2, scales, torch.device("cpu")))
    alone = KvvmCache(model, 2, 400, manager=mgr, kv_dtype="fp8_e4m3", kv_scales=scales)
    with torch.no_grad():
        model(input_ids=system.repeat(2, 1), past_key_values=alone, use_cache=True)
        a = model(input_ids=tail, past_key_values=shared, use_cache=True).logits
        b = model(input_ids=tail, past_key_values=alone, use_cache=True).logits
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    with pytest.raises(kvvm.InvalidArgumentError, match="from the prefix"):
        KvvmCache.from_prefix(prefix, 2, 400, kv_scales=(1.0, 1.0))
    del a, b
    shared.release()
    alone.release()


# ---- the budget ----


def _tokens_within(mgr: kvvm.Manager, dtype: str) -> int:
    """The most tokens one request of the Llama-3.1-8B shape commits under ``mgr``'s budget
    (grown 1024 tokens at a time until the governor refuses: now or ever)."""
    plan = kvvm.LayoutPlan(kvvm.KvGeometry.preset("llama-3-8b", 1 << 20, dtype=dtype), "token-major", mgr.granule)
    seq = kvvm.SequenceBatch(mgr, plan, 1)
    tokens = 0
    try:
        while True:
            seq.ensure(tokens + 1024)
            tokens += 1024
    except (kvvm.BackpressureError, kvvm.NeverFitsError):
        pass
    seq.release()
    return tokens


def test_a_budget_holds_twice_the_tokens_in_fp8() -> None:
    """The planner and the governor count FP8's real bytes: a budget holds about twice the
    bf16 tokens (the scales are per layer and KV head, not per token: no byte in kvvm memory)."""
    mgr = kvvm.Manager("sim", budget_bytes=1 << 30)
    bf16, fp8 = _tokens_within(mgr, "bf16"), _tokens_within(mgr, "fp8")
    assert bf16 > 0 and fp8 / bf16 >= 1.9, (bf16, fp8)
    g16 = kvvm.KvGeometry.preset("llama-3-8b", 4096, dtype="bf16")
    g8 = kvvm.KvGeometry.preset("llama-3-8b", 4096, dtype="fp8")
    assert g16.bytes_per_token == 2 * g8.bytes_per_token == 131072


# ---- the engine ----


@needs_host
def test_the_engine_decodes_in_fp8() -> None:
    """The engine's cache in FP8: every request finishes, its greedy tokens mostly those of an
    fp32 engine (FP8 moves a few near-ties), the prefix cache hits over FP8 bytes, and a
    token takes a quarter of the fp32 engine's bytes."""
    from kvvm.engine import Engine

    def run(**kw) -> tuple[list[list[int]], tuple[int, int, str]]:
        model = _llama()
        mgr = kvvm.Manager("host", precommit=True, headroom_tokens=4)
        engine = Engine(model, slots=3, max_len=600, manager=mgr, prefill_chunk=32, prefix_cache_bytes=16 << 20, **kw)
        g = torch.Generator().manual_seed(7)
        system = torch.randint(0, 1000, (260,), generator=g).tolist()
        prompts = [system + torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
        reqs = [engine.submit(p, 12) for p in prompts[:1]]
        engine.run()
        reqs += [engine.submit(p, 12) for p in prompts[1:]]
        engine.run()
        stats = (engine.stats.prefix_hits, engine.cache.plan.geometry.bytes_per_token, engine.cache.plan.geometry.dtype)
        engine.close()
        assert all(r.done and len(r.tokens) == 12 for r in reqs)
        return [r.tokens for r in reqs], stats

    ref, (_, ref_bytes, ref_dtype) = run()
    got, (hits, fp8_bytes, dtype) = run(kv_dtype="fp8_e4m3")
    assert (ref_dtype, dtype) == ("fp32", "fp8") and hits == 3
    assert ref_bytes == 4 * fp8_bytes  # fp32 against 1 byte an element
    agree = sum(a == b for r, f in zip(ref, got, strict=True) for a, b in zip(r, f, strict=True))
    assert agree >= 0.75 * 12 * len(ref), (agree, ref, got)


# ---- a prefix shared across processes ----


@pytest.fixture
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A broker of 1 GiB, tenant ``t`` (a short socket path: a Unix socket's is bounded)."""
    from model_checks import run_broker

    yield from run_broker(tmp_path_factory.mktemp("fp8") / "broker.sock", "--budget-bytes", "1GiB", "--tenant", "t")


@needs_host
def test_an_fp8_prefix_published_through_the_broker_is_read_with_its_scales_by_another_process(broker: Path) -> None:
    """This process builds an FP8 prefix with scales of its own and publishes it; another
    process opens it with those scales and decodes after it the tokens this process decodes
    after it (the same bytes read with the same scales), and serves the prompts through an
    engine whose prefix cache holds it. An engine of other scales refuses the prefix."""
    import model_matrix as mm
    from kvvm.engine import Engine
    from model_checks import MiB, Peer, greedy_after_prefix
    from model_peer import probe_logits

    arch = mm.BY_NAME["qwen2.5-0.5b"]
    model = mm.build_model(arch)
    use_kvvm_attention(model)
    system, tails = mm.tokens(300, 300), [mm.tokens(40, 301 + i) for i in range(3)]
    scales = [0.05, 0.04]
    socket = broker
    peer = Peer()
    try:
        mgr = kvvm.Manager("host", broker=str(socket), tenant="t", lease_batch_bytes=4 * MiB)
        built = KvvmPrefix.build(
            model, torch.tensor([system]), manager=mgr, max_cache_len=512, kv_dtype="fp8_e4m3", kv_scales=scales
        )
        assert built.publish("fp8-system") == built.bytes > 0
        cache = KvvmCache.from_prefix(built, len(tails), 512)
        here = greedy_after_prefix(model, cache, [system[built.tokens :] + t for t in tails], built.tokens, 8)
        cache.release()
        own = built.kv_scales
        probes = {}
        for name, kv_scales in (("own", own), ("default", None)):
            built.kv_scales = kv_scales  # read with its own scales, then with the default ones
            probes[name] = torch.tensor(probe_logits(model, built, system, tails, 512))
        built.kv_scales = own
        with pytest.raises(kvvm.InvalidArgumentError, match="kv_scales"):
            engine = Engine(
                mm.build_model(arch), slots=2, max_len=512, manager=mgr, prefix_cache_bytes=16 * MiB,
                compile=False, kv_dtype="fp8_e4m3",
            )
            try:
                engine.add_prefix(system, built)
            finally:
                engine.close()
        reply = peer.request(
            {
                "arch": arch.name, "seed": 0, "socket": str(socket), "tenant": "t", "key": "fp8-system",
                "max_len": 512, "backend": "host", "device": "cpu", "prefix": system, "tails": tails,
                "engine_tails": tails, "new_tokens": 8, "kv_dtype": "fp8_e4m3", "kv_scales": scales,
            }
        )
        assert "error" not in reply, reply.get("error")
        assert reply["opened_tokens"] == built.tokens and reply["attach"] == here
        # The other process read the prefix as this one does with its scales (up to the
        # order of a sum its threads take); with the default scales the logits move.
        theirs = torch.tensor(reply["probe_logits"])
        assert (theirs - probes["own"]).abs().max().item() < 1e-5
        assert (theirs - probes["default"]).abs().max().item() > 1e-2
        assert all(h > 0 for h in reply["hits"])
        agree = sum(a == b for x, y in zip(reply["engine"], here, strict=True) for a, b in zip(x, y, strict=True))
        assert agree >= 0.9 * 8 * len(tails), (reply["engine"], here)
        assert built.cache is not None
        built.cache.release()
        del built
        assert mgr.close_prefix("fp8-system") == 0
    finally:
        peer.close()
