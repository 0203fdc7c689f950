"""KvvmCache on a CUDA GPU: DLPack CUDA tensors over kvvm memory, decoding identical to
DynamicCache, read-only prefixes enforced by the GPU. Skipped without CUDA (and torch)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
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

from kvvm.transformers import KvvmCache  # noqa: E402
from kvvm.prefix import KvvmPrefix  # noqa: E402


def test_views_are_cuda_tensors_over_kvvm_memory() -> None:
    mgr = kvvm.Manager("cuda")
    plan = kvvm.LayoutPlan(kvvm.KvGeometry(2, 8, 128, 4096, dtype="bf16"), "seq-major", mgr.granule)
    batch = kvvm.SequenceBatch(mgr, plan, 4)
    batch.ensure(100)
    k = torch.from_dlpack(batch.view(1, "key"))
    assert k.is_cuda and k.shape == (4, 8, 100, 128) and k.dtype == torch.bfloat16
    assert k.data_ptr() == batch.view(1, "key").data_ptr
    k[2, 3, 50].fill_(1.5)
    torch.cuda.synchronize()
    host = batch[2].read_tokens(50, 1)
    t = torch.frombuffer(bytearray(host), dtype=torch.bfloat16).view(2, 2, 8, 128)
    assert (t[1, 0, 3] == 1.5).all() and not t[0].any()
    with pytest.raises(kvvm.ViewsAliveError):
        batch.release()
    del k
    assert batch.release() > 0


def _model() -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=4096, max_position_embeddings=8192,
    )
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model: Any = transformers.LlamaForCausalLM(cfg)
        return model.to(torch.bfloat16).eval()


@pytest.mark.parametrize("layout", ["seq-major", "token-major"])
def test_decoding_on_the_gpu_matches_dynamic_cache(layout: str) -> None:
    model = _model()
    ids = torch.randint(0, 4096, (4, 300), device="cuda")
    mgr = kvvm.Manager("cuda", precommit=True, headroom_tokens=16)
    dc = transformers.DynamicCache(config=model.config)
    kc = KvvmCache(model.config, 4, 1024, manager=mgr, layout=layout)
    with torch.no_grad():
        a = model(input_ids=ids, past_key_values=dc, use_cache=True)
        b = model(input_ids=ids, past_key_values=kc, use_cache=True)
        tok = a.logits[:, -1:].argmax(-1)
        worst = (a.logits - b.logits).abs().max().item()
        for _ in range(16):
            a = model(input_ids=tok, past_key_values=dc, use_cache=True)
            b = model(input_ids=tok, past_key_values=kc, use_cache=True)
            worst = max(worst, (a.logits - b.logits).abs().max().item())
            tok = a.logits[:, -1:].argmax(-1)
    assert worst < 0.1, worst
    del a, b
    kc.release()


@pytest.mark.parametrize("layout", ["seq-major", "token-major"])
def test_store_writes_a_decode_token_into_every_slot_on_a_stream(layout: str) -> None:
    mgr = kvvm.Manager("cuda")
    plan = kvvm.LayoutPlan(kvvm.KvGeometry(2, 8, 128, 4096, dtype="bf16"), layout, mgr.granule)
    batch = kvvm.SequenceBatch(mgr, plan, 5)
    batch.ensure(40)
    # A model's projected K of a decode step: [B, 1, H, D] made contiguous, seen as [B, H, 1, D].
    k = torch.randn(5, 1, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(5, 1, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        batch.store(1, 33, k, v, side)
    side.synchronize()
    keys = torch.from_dlpack(batch.view(1, "key"))
    values = torch.from_dlpack(batch.view(1, "value"))
    assert torch.equal(keys[:, :, 33], k[:, :, 0]) and torch.equal(values[:, :, 33], v[:, :, 0])
    assert not keys[:, :, 32].any() and not keys[:, :, 34].any()
    assert not torch.from_dlpack(batch.view(0, "key")).any()
    with pytest.raises(kvvm.InvalidArgumentError, match="memory of the manager"):
        batch.store(1, 34, k.cpu(), v.cpu())
    with pytest.raises(kvvm.InvalidArgumentError, match="dtype"):
        batch.store(1, 34, k.half(), v.half())
    del keys, values
    batch.release()


def test_the_gpu_refuses_stores_into_a_read_only_prefix() -> None:
    code = textwrap.dedent(
        """
        import torch, kvvm
        mgr = kvvm.Manager("cuda")
        plan = kvvm.LayoutPlan(kvvm.KvGeometry(2, 8, 128, 8192, dtype="bf16"), "token-major", mgr.granule)
        b = kvvm.SequenceBatch(mgr, plan, 2)
        p = b[0].own_prefix(1024)
        torch.from_dlpack(b[0].view(0, end=1024)).fill_(2.0)
        torch.cuda.synchronize()
        p.seal(); p.attach(b[1])
        ro = torch.from_dlpack(b[1].view(0, end=1024))
        assert (ro == 2.0).all().item()
        print("read ok", flush=True)
        ro.fill_(0.0)
        torch.cuda.synchronize()
        print("store did not fault", flush=True)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "read ok" in r.stdout, r.stderr
    assert "store did not fault" not in r.stdout, r.stdout
    assert r.returncode != 0


def test_generate_on_the_gpu() -> None:
    model = _model()
    ids = torch.randint(0, 4096, (2, 64), device="cuda")
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        cache = KvvmCache(model.config, 2, 256, backend="cuda")
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False)
    assert (out == ref).float().mean().item() > 0.9
    cache.release()
