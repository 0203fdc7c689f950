"""The device-side guard of a KvvmCache step (``SlotState.index``/``step``): a write lands
only at tokens ``0 <= token < limit`` of its own slot, whatever the counts on the device say.
A negative length cannot be reached through the API; it is set here by hand on the device, as
a corrupted count would be, and the step must write nothing outside the slot's live tokens
(refused writes go to the scratch slot and are counted as overruns)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

import kvvm
from conftest import cuda_available, host_available

if TYPE_CHECKING:
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    transformers = pytest.importorskip("transformers", reason="skipped: no transformers")

from kvvm.transformers import use_kvvm_attention  # noqa: E402
from kvvm.transformers import KvvmCache  # noqa: E402


def _backends() -> list[object]:
    host = pytest.param("host", marks=pytest.mark.skipif(not host_available(), reason="skipped: no host backend"))
    cuda = pytest.param("cuda", marks=pytest.mark.skipif(not cuda_available(), reason="skipped: no CUDA driver"))
    return [host, cuda]


def _model(device: str) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=1000, eos_token_id=None,
    )
    cfg._attn_implementation = "sdpa"
    model: Any = transformers.LlamaForCausalLM(cfg)
    model = model.to(device=device, dtype=torch.float32).eval()
    use_kvvm_attention(model)
    return model


def _slots(cache: KvvmCache) -> list[torch.Tensor]:
    """Every request slot's K and V of every layer, all tokens (one mapped window each here)."""
    out = []
    for layer in range(cache.geometry.layers):
        for t in cache._kv(layer):
            out.append(t[: cache.batch_size].clone())
    return out


@pytest.mark.parametrize("backend", _backends())
@torch.no_grad()
def test_a_negative_length_on_the_device_writes_nothing_outside_the_slot(backend: str) -> None:
    device = "cuda" if backend == "cuda" else "cpu"
    model = _model(device)
    # fp32, 2 layers x {K, V} x 2 heads x 32: 1 KiB a token; 64 tokens lie in one window of
    # each slot, so every token of both slots is mapped and can be read back.
    cache = KvvmCache(model, 2, 64, manager=kvvm.Manager(backend))
    ids = torch.randint(0, 1000, (2, 8), device=device, generator=torch.Generator(device).manual_seed(3))
    model(input_ids=ids, position_ids=torch.arange(8, device=device).expand(2, 8), past_key_values=cache, use_cache=True)
    before = _slots(cache)
    # Slot 1's count goes wrong on the device (the host still counts 8).
    cache.state.lengths[1] = -3
    step = torch.randint(0, 1000, (2, 1), device=device, generator=torch.Generator(device).manual_seed(4))
    model(input_ids=step, position_ids=torch.full((2, 1), 8, device=device), past_key_values=cache, use_cache=True)
    after = _slots(cache)
    for b, a in zip(before, after, strict=True):
        # Slot 0 gained its token 8, and nothing else of it changed.
        assert not torch.equal(b[0, :, 8], a[0, :, 8])
        a[0, :, 8] = b[0, :, 8]
        assert torch.equal(b, a), "a write landed outside a slot's live tokens"
    with pytest.raises(kvvm.InvalidArgumentError, match="refused"):
        cache.check()
    cache.release()
