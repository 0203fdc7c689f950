"""Sliding-window and hybrid models on a CUDA GPU: the captured decode step (the Triton kernel
reading each request's window, Gemma 2's soft cap) on ragged requests longer than the window,
teacher-forced against DynamicCache, with the windows behind given back between replays; the
engine's tokens against one request at a time. fp32 (the kernels' products in IEEE fp32), the
Gemma-2 and Gemma-3 shapes of test_sliding.py. Skipped without CUDA."""

from __future__ import annotations

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

from kvvm.engine import Engine  # noqa: E402
from kvvm.graph import DecodeGraph  # noqa: E402
from kvvm.transformers import KvvmCache  # noqa: E402
from test_sliding import VOCAB, build, sliding_group, window_bound  # noqa: E402


def _on_gpu(kind: str, attention: str) -> Any:
    return build(kind, attention).to("cuda")


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_a_captured_step_decodes_ragged_requests_within_their_windows(kind: str, compile: bool) -> None:
    model = _on_gpu(kind, "kvvm")
    reference = _on_gpu(kind, "eager")
    lengths = [300, 61, 250]
    torch.manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (1, n), device="cuda") for n in lengths]
    mgr = kvvm.Manager("cuda", precommit=True, headroom_tokens=4)
    cache = KvvmCache(model, 3, 1024, manager=mgr)
    refs = [transformers.DynamicCache(config=reference.config) for _ in lengths]
    firsts = []
    with torch.no_grad():
        for slot, (p, dc) in enumerate(zip(prompts, refs, strict=True)):
            with cache.select(slot):
                got = model(input_ids=p, past_key_values=cache, use_cache=True).logits[:, -1]
            want = reference(input_ids=p, past_key_values=dc, use_cache=True).logits[:, -1]
            assert torch.allclose(got, want, atol=1e-3), (slot, (got - want).abs().max())
            firsts.append(want.argmax(-1))
        step = DecodeGraph(model, cache, compile=compile)
        tok = torch.cat(firsts)
        for i in range(40):
            got = step(tok)
            want = torch.cat(
                [reference(input_ids=tok[j : j + 1, None], past_key_values=dc, use_cache=True).logits[:, -1] for j, dc in enumerate(refs)]
            )
            assert torch.allclose(got, want, atol=1e-3), (i, (got - want).abs().max())
            tok = want.argmax(-1)
    cache.check()
    assert cache.state.host_lengths == [n + 40 for n in lengths]
    group = sliding_group(cache)
    assert group.host_floors[0] > 0 and group.host_floors[2] > 0, "windows went back between replays"
    for slot in range(3):
        assert group.batch[slot].owned_bytes <= window_bound(group, 1, ahead=2 * 4)
    step.close()
    cache.release()
    assert mgr.snapshot().committed == 0


def test_the_engine_on_the_gpu_gives_each_request_its_own_tokens() -> None:
    model = _on_gpu("gemma2", "eager")
    reference = _on_gpu("gemma2", "eager")
    torch.manual_seed(8)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (150, 61, 190, 97)]
    new = [12, 30, 6, 20]
    want = []
    with torch.no_grad():
        for p, n in zip(prompts, new, strict=True):
            ids = torch.tensor([p], device="cuda")
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
            want.append(out[0, len(p) :].tolist())
    mgr = kvvm.Manager("cuda", precommit=True, headroom_tokens=4)
    engine = Engine(model, slots=3, max_len=256, manager=mgr, prefill_chunk=64, compile=False, eos_token_ids=[])
    requests = [engine.submit(p, n) for p, n in zip(prompts, new, strict=True)]
    engine.run()
    assert [r.tokens for r in requests] == want
    engine.close()
    assert mgr.snapshot().committed == 0


@pytest.mark.parametrize("q_len", [1, 7])
def test_the_flash_kernel_reads_the_window_as_sdpa_does(q_len: int) -> None:
    """bf16, ragged requests in any slot order: FlashAttention with ``window_size_left`` over
    the packed slots against the per-request SDPA kernel, tokens before each earliest window
    poisoned (NaN: a read of one would show)."""
    from kvvm.kernels.attend import attend

    torch.manual_seed(9)
    heads, kv_heads, dim, window, tokens = 8, 2, 128, 40, 300
    k = torch.randn(3, kv_heads, tokens, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(3, kv_heads, tokens, dim, device="cuda", dtype=torch.bfloat16)
    bounds = torch.tensor([[2, 0, 300], [0, 20, 150], [1, 5, 30]], dtype=torch.int32, device="cuda")
    q = torch.randn(3, heads, q_len, dim, device="cuda", dtype=torch.bfloat16)
    want = attend(q, k, v, bounds, kernel="sdpa", window=window)
    for slot, _, end in bounds.tolist():
        k[slot, :, : max(0, end - q_len - window + 1)] = float("nan")
        v[slot, :, : max(0, end - q_len - window + 1)] = float("nan")
    got = attend(q, k, v, bounds, kernel="flash", window=window)
    assert (got.float() - want.float()).abs().max().item() < 2e-2


def test_a_slot_stride_of_no_whole_tokens_prefills_with_flash_per_class_of_slots() -> None:
    """Gemma 3's sliding layers in bf16 (5 KiB a token here) do not divide a 2 MiB window:
    the slots are not a whole number of tokens apart, and ``"auto"``'s FlashAttention prefill
    makes one call per class of slots (by their offset from a token boundary): the
    reference's logits."""
    model = build("gemma3", "kvvm").to("cuda", torch.bfloat16)
    reference = build("gemma3", "eager").to("cuda", torch.bfloat16)
    torch.manual_seed(10)
    ids = torch.randint(0, VOCAB, (2, 300), device="cuda")
    mgr = kvvm.Manager("cuda")
    cache = KvvmCache(model, 2, 512, manager=mgr)
    group = sliding_group(cache)
    assert group.batch.slot_stride % group.plan.strides()["token"] != 0
    dc = transformers.DynamicCache(config=reference.config)
    with torch.no_grad():
        for start in range(0, 300, 100):
            got = model(input_ids=ids[:, start : start + 100], past_key_values=cache, use_cache=True).logits[:, -1]
            want = reference(input_ids=ids[:, start : start + 100], past_key_values=dc, use_cache=True).logits[:, -1]
            assert (got.float() - want.float()).abs().max().item() < 0.15
    cache.release()
