"""What a published prefix tells its readers (``kvvm.transformers.prefix_meta``): its KV dtype,
geometry, layout and an FP8 prefix's scales ride with it, so an opener reads it with them
without passing them, and is refused when what it passes differs; a prefix published before
them is read as the model's dtype or refused as FP8. The words on their own (every scale
encoding, the digest of scales too many to carry), then through the broker: another process
opening an FP8 prefix without its scales, openers of this process passing the wrong ones."""

from __future__ import annotations

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

from kvvm.transformers import KvvmCache, KvvmPrefix, use_kvvm_attention  # noqa: E402
from kvvm.transformers.prefix_meta import Published, describe  # noqa: E402

needs_host = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

MiB = 1 << 20


def _plan(layers: int, kv_heads: int, dtype: str = "fp8") -> kvvm.LayoutPlan:
    geometry = kvvm.KvGeometry(layers=layers, kv_heads=kv_heads, head_dim=64, max_tokens=4096, dtype=dtype)
    return kvvm.LayoutPlan(geometry, "token-major", 1 << 21)


def _scales(read: Published, plan: kvvm.LayoutPlan, passed: Any) -> torch.Tensor:
    """The scales ``read`` gives an FP8 prefix (None only for a prefix that is not FP8)."""
    got = read.scales(plan, passed)
    assert got is not None
    return got


# ---- the words ----


def test_the_words_carry_every_scale_exactly_or_their_digest() -> None:
    """Equal scales ride as one value, others as their fp32 bytes (a 70B model's 80 x 2 x 8
    fit the broker's room), more than fit as a digest that then needs the scales passed."""
    plan = _plan(80, 8)
    scales = torch.rand(80, 2, 8, generator=torch.Generator().manual_seed(0)) + 0.01
    words = describe(plan, scales, kvvm.PREFIX_META_BYTES)
    assert "scales=f32:" in words and len(words) < kvvm.PREFIX_META_BYTES - 2048
    read = Published("k", words)
    assert torch.equal(_scales(read, plan, None), scales)
    assert torch.equal(_scales(read, plan, scales), scales)
    with pytest.raises(kvvm.InvalidArgumentError, match="not the ones"):
        read.scales(plan, scales * 1.5)
    one = Published("k", describe(plan, torch.full((80, 2, 8), 0.05), kvvm.PREFIX_META_BYTES))
    assert "scales=all:" in " ".join(f"{k}={v}" for k, v in one.fields.items())
    assert torch.equal(_scales(one, plan, (0.05, 0.05)), torch.full((80, 2, 8), 0.05))
    with pytest.raises(kvvm.InvalidArgumentError, match="not the ones"):
        one.scales(plan, (0.05, 0.04))
    # Too many to carry (a room of 2600 characters here): the digest.
    digest = Published("k", describe(plan, scales, 2600 + 2048))
    assert digest.fields["scales"].startswith("sha256:")
    with pytest.raises(kvvm.InvalidArgumentError, match="pass the publisher's kv_scales"):
        digest.scales(plan, None)
    with pytest.raises(kvvm.InvalidArgumentError, match="not the ones"):
        digest.scales(plan, scales.flip(0))
    assert torch.equal(_scales(digest, plan, scales), scales)


def test_the_words_refuse_another_geometry_dtype_or_bad_scales() -> None:
    plan = _plan(2, 2)
    read = Published("k", describe(plan, torch.ones(2, 2, 2), kvvm.PREFIX_META_BYTES))
    read.check(plan)
    for other, field in ((_plan(2, 2, "bf16"), "dtype"), (_plan(4, 1), "layers")):
        with pytest.raises(kvvm.InvalidArgumentError, match=field):
            read.check(other)
    with pytest.raises(kvvm.InvalidArgumentError, match="kv_scales are an FP8"):
        Published("k", describe(_plan(2, 2, "bf16"), None, kvvm.PREFIX_META_BYTES)).scales(_plan(2, 2, "bf16"), (1.0, 1.0))
    with pytest.raises(kvvm.InvalidArgumentError, match="finite and positive"):
        Published("k", "kvvm-kv/1 dtype=fp8 scales=all:" + (-1.0).hex()).scales(plan, None)
    with pytest.raises(kvvm.InvalidArgumentError, match="another kind"):
        Published("k", "something else")
    with pytest.raises(kvvm.InvalidArgumentError, match="published with its kv_scales"):
        describe(plan, None, kvvm.PREFIX_META_BYTES)


# ---- through the broker ----


@pytest.fixture
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A broker of 1 GiB, tenant ``t`` (a short socket path: a Unix socket's is bounded)."""
    from model_checks import run_broker

    yield from run_broker(tmp_path_factory.mktemp("meta") / "broker.sock", "--budget-bytes", "1GiB", "--tenant", "t")


def _model(dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000,
    )
    model: Any = transformers.LlamaForCausalLM(cfg)
    model = model.to(dtype).eval()
    use_kvvm_attention(model)
    return model


def _logits(model: Any, prefix: KvvmPrefix, rest: torch.Tensor) -> torch.Tensor:
    cache = KvvmCache.from_prefix(prefix, 1, 256)
    pos = torch.arange(prefix.tokens, prefix.tokens + rest.shape[1])[None]
    with torch.no_grad():
        out = model(input_ids=rest, position_ids=pos, past_key_values=cache, use_cache=True)
    logits = out.logits[:, -1].clone()
    del out
    cache.release()
    return logits


@needs_host
def test_an_opener_takes_the_published_dtype_and_scales_and_is_refused_other_ones(broker: Path) -> None:
    """An FP8 prefix opened with nothing passed reads as its publisher reads it; opened with
    other scales, as bf16 or as fp32 it is refused and nothing stays opened; a bf16 prefix
    opened as FP8 is refused."""
    model = _model()
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(1))
    scales = torch.rand(2, 2, 2, generator=torch.Generator().manual_seed(2)) * 0.1 + 0.02
    publisher = kvvm.Manager("host", broker=str(broker), tenant="t", lease_batch_bytes=4 * MiB)
    reader = kvvm.Manager("host", broker=str(broker), tenant="t", lease_batch_bytes=4 * MiB)
    common: dict[str, Any] = {"manager": publisher, "max_cache_len": 256}
    built = KvvmPrefix.build(model, ids[:, :32], kv_dtype="fp8_e4m3", kv_scales=scales, **common)
    built.publish("fp8")
    opened = KvvmPrefix.open(model, "fp8", manager=reader, max_cache_len=256)
    assert opened.plan.geometry.dtype == "fp8" and torch.equal(opened.kv_scales, scales)
    assert torch.equal(_logits(model, opened, ids[:, 32:]), _logits(model, built, ids[:, 32:]))
    again = KvvmPrefix.open(model, "fp8", manager=reader, max_cache_len=256, kv_dtype="fp8_e4m3", kv_scales=scales)
    assert torch.equal(again.kv_scales, scales)
    refused: tuple[tuple[dict[str, Any], str], ...] = (
        ({"kv_dtype": "fp8_e4m3", "kv_scales": scales * 1.5}, "not the ones"),
        ({"kv_scales": (1.0, 1.0)}, "not the ones"),
        ({"dtype": torch.bfloat16}, "dtype=fp8"),
        ({"dtype": torch.float32}, "dtype=fp8"),
        ({"max_cache_len": 512}, "max_tokens"),
    )
    for kwargs, why in refused:
        with pytest.raises(kvvm.InvalidArgumentError, match=why):
            KvvmPrefix.open(model, "fp8", **{"manager": reader, "max_cache_len": 256, **kwargs})
    # Two opens stand: every refused one let go (the publisher's close then frees nothing).
    assert reader.close_prefix("fp8") == 2 and reader.close_prefix("fp8") == 1
    assert built.close("fp8") == 0

    bf16 = _model(torch.bfloat16)
    plain = KvvmPrefix.build(bf16, ids[:, :32], **common)
    plain.publish("bf16")
    with pytest.raises(kvvm.InvalidArgumentError, match="dtype=bf16"):
        KvvmPrefix.open(bf16, "bf16", manager=reader, max_cache_len=256, kv_dtype="fp8_e4m3")
    with pytest.raises(kvvm.InvalidArgumentError, match="kv_scales are an FP8"):
        KvvmPrefix.open(bf16, "bf16", manager=reader, max_cache_len=256, kv_scales=(1.0, 1.0))
    as_published = KvvmPrefix.open(bf16, "bf16", manager=reader, max_cache_len=256)
    assert as_published.plan.geometry.dtype == "bf16" and as_published.kv_scales is None
    assert as_published.close("bf16") == 1 and plain.close("bf16") == 0


@needs_host
def test_a_prefix_published_without_reader_words_is_read_as_the_model_dtype_or_refused_as_fp8(broker: Path) -> None:
    """An older publisher's meta (the descriptor alone): read as the model's dtype as before;
    as FP8 it is refused (its scales cannot be checked)."""
    model = _model()
    ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(1))
    publisher = kvvm.Manager("host", broker=str(broker), tenant="t", lease_batch_bytes=4 * MiB)
    reader = kvvm.Manager("host", broker=str(broker), tenant="t", lease_batch_bytes=4 * MiB)
    for kv_dtype in (None, "fp8_e4m3"):
        built = KvvmPrefix.build(model, ids, manager=publisher, max_cache_len=256, kv_dtype=kv_dtype)
        built.shares[0].publish(publisher, "old")  # no meta: what an older kvvm published
        if kv_dtype is None:
            opened = KvvmPrefix.open(model, "old", manager=reader, max_cache_len=256)
            assert opened.plan.geometry.dtype == "fp32" and opened.tokens == 32
            assert opened.close("old") == 1
        else:
            for passed in ({"kv_dtype": kv_dtype}, {"kv_dtype": kv_dtype, "kv_scales": (1.0, 1.0)}):
                with pytest.raises(kvvm.InvalidArgumentError, match="older kvvm"):
                    KvvmPrefix.open(model, "old", manager=reader, max_cache_len=256, **passed)
        assert built.close("old") == 0
        assert built.cache is not None
        built.cache.release()


@needs_host
def test_another_process_reads_an_fp8_prefix_with_the_published_scales_without_passing_them(broker: Path) -> None:
    """The peer opens an FP8 prefix with neither its dtype nor its scales: it decodes after it
    what this process decodes, and its logits are this process's read with the same scales."""
    import model_matrix as mm
    from model_checks import Peer, greedy_after_prefix
    from model_peer import probe_logits

    arch = mm.BY_NAME["qwen2.5-0.5b"]
    model = mm.build_model(arch)
    use_kvvm_attention(model)
    system, tails = mm.tokens(300, 300), [mm.tokens(40, 301 + i) for i in range(2)]
    peer = Peer()
    try:
        mgr = kvvm.Manager("host", broker=str(broker), tenant="t", lease_batch_bytes=4 * MiB)
        built = KvvmPrefix.build(
            model, torch.tensor([system]), manager=mgr, max_cache_len=512, kv_dtype="fp8_e4m3", kv_scales=[0.05, 0.04]
        )
        built.publish("fp8-bare")
        cache = KvvmCache.from_prefix(built, len(tails), 512)
        here = greedy_after_prefix(model, cache, [system[built.tokens :] + t for t in tails], built.tokens, 6)
        cache.release()
        mine = torch.tensor(probe_logits(model, built, system, tails, 512))
        reply = peer.request(
            {
                "arch": arch.name, "seed": 0, "socket": str(broker), "tenant": "t", "key": "fp8-bare",
                "max_len": 512, "backend": "host", "device": "cpu", "prefix": system, "tails": tails,
                "engine_tails": tails, "new_tokens": 6,
            }
        )
        assert "error" not in reply, reply.get("error")
        assert reply["attach"] == here
        # Up to the order of a sum the threads take.
        assert (torch.tensor(reply["probe_logits"]) - mine).abs().max().item() < 1e-5
        assert all(h > 0 for h in reply["hits"])
        assert built.close("fp8-bare") == 0
        assert built.cache is not None
        built.cache.release()
    finally:
        peer.close()


@needs_host
def test_scales_too_many_to_carry_ride_as_a_digest_the_opener_must_match(broker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publisher whose scales do not fit the room (made small here) publishes their digest:
    an opener without them is refused, with others too, with them it opens. A meta over the
    broker's room is refused before it is sent (the connection stays)."""
    import kvvm.transformers.prefix as prefix_module

    model = _model()
    ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(1))
    scales = torch.rand(2, 2, 2, generator=torch.Generator().manual_seed(2)) * 0.1 + 0.02
    publisher = kvvm.Manager("host", broker=str(broker), tenant="t", lease_batch_bytes=4 * MiB)
    reader = kvvm.Manager("host", broker=str(broker), tenant="t", lease_batch_bytes=4 * MiB)
    built = KvvmPrefix.build(model, ids, manager=publisher, max_cache_len=256, kv_dtype="fp8_e4m3", kv_scales=scales)
    with pytest.raises(kvvm.InvalidArgumentError, match="at most"):
        built.shared.publish(publisher, "big", "m" * kvvm.PREFIX_META_BYTES)
    monkeypatch.setattr(prefix_module, "PREFIX_META_BYTES", 2048 + 100)
    built.publish("digest")
    with pytest.raises(kvvm.InvalidArgumentError, match="pass the publisher's kv_scales"):
        KvvmPrefix.open(model, "digest", manager=reader, max_cache_len=256)
    with pytest.raises(kvvm.InvalidArgumentError, match="not the ones"):
        KvvmPrefix.open(model, "digest", manager=reader, max_cache_len=256, kv_scales=scales.flip(1))
    opened = KvvmPrefix.open(model, "digest", manager=reader, max_cache_len=256, kv_scales=scales)
    assert torch.equal(opened.kv_scales, scales)
    assert torch.equal(_logits(model, opened, ids[:, 24:]), _logits(model, built, ids[:, 24:]))
    assert opened.close("digest") == 1 and built.close("digest") == 0
    assert built.cache is not None
    built.cache.release()
