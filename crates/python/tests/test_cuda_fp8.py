"""FP8 KV on a CUDA GPU: the Triton decode kernel and the cascade's prefix pass over e4m3 K/V
against the per-request SDPA reference (every split count, bf16 and fp32 queries), the fused
write storing exactly the bytes the reference quantization makes, V widened by the kernel's own
conversion as by the compiler's (a GPU rounds to nearest
even), and a KvvmCache in FP8 decoding through a captured step as it does eagerly, near the
bf16 cache. Skipped without CUDA."""

from __future__ import annotations

import contextlib
import math
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

from kvvm.kernels.attend import attend  # noqa: E402
from kvvm.kernels.fp8 import quantize  # noqa: E402
from kvvm.transformers import KvvmCache, use_kvvm_attention  # noqa: E402


def _fp8_kv(slots: int, kv_heads: int, tokens: int, dim: int, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = quantize(torch.randn(slots, kv_heads, tokens, dim, device="cuda") * 3, scales[0])
    v = quantize(torch.randn(slots, kv_heads, tokens, dim, device="cuda"), scales[1])
    return k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [64, 128])
def test_the_decode_kernel_over_fp8_matches_the_reference(dtype: torch.dtype, dim: int) -> None:
    from kvvm.kernels.triton_decode import decode_attention

    torch.manual_seed(0)
    B, H, Hk, T = 5, 32, 8, 1500
    scales = torch.rand(2, Hk, device="cuda") + 0.25
    k, v = _fp8_kv(B + 1, Hk, T, dim, scales)
    q = torch.randn(B, 1, H, dim, device="cuda", dtype=dtype).transpose(1, 2)
    bounds = torch.tensor([[1, 0, 1500], [0, 7, 700], [2, 9, 9], [4, 0, 1], [3, 100, 1333]], dtype=torch.int32, device="cuda")
    want = attend(q, k, v, bounds, kernel="sdpa", kv_scales=scales).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for splits in (1, 2, 8, 32):
        got = decode_attention(q, k, v, bounds, 1 / math.sqrt(dim), splits, kv_scales=scales).float()
        assert (got - want).abs().max().item() < tol, splits
    # The tuner's FP8 shapes, V widened by the kernel's own conversion and not: the same
    # values (every e4m3 code is exact in fp16), through other layouts.
    from kvvm.kernels.triton_decode import _SHAPES_FP8, Config

    for block, warps, stages in _SHAPES_FP8:
        for splits in (1, 2):
            plain = Config(splits, block, warps, stages)
            widened = Config(splits, block, warps, stages, widen=True)
            a = decode_attention(q, k, v, bounds, 1 / math.sqrt(dim), plain, kv_scales=scales).float()
            b = decode_attention(q, k, v, bounds, 1 / math.sqrt(dim), widened, kv_scales=scales).float()
            assert (a - want).abs().max().item() < tol and (b - want).abs().max().item() < tol, widened
            # Within a bf16 output's last place (the products may sum in another order).
            assert torch.allclose(a, b, rtol=2**-7, atol=1e-3), widened
    # The dispatcher as a step calls it, tuned for a 16-bit query (the FP8 shapes among its
    # candidates, V widened and not); an fp32 query's tuner would compile some 70 candidates
    # of fp32 products (3 to 6 s each for sm_90a), so there it runs the heuristic's.
    from kvvm.kernels.tuning import untuned

    with untuned() if dtype == torch.float32 else contextlib.nullcontext():
        got = attend(q, k, v, bounds, kernel="triton", kv_scales=scales).float()
    assert (got - want).abs().max().item() < tol


def test_the_fused_write_stores_the_reference_quantization_and_attends_it() -> None:
    from kvvm.kernels.triton_decode import decode_attention

    torch.manual_seed(1)
    B, H, Hk, T, D = 4, 16, 4, 600, 128
    scales = torch.rand(2, Hk, device="cuda") + 0.25
    k, v = _fp8_kv(B + 1, Hk, T, D, scales)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kn = (torch.randn(B, 1, Hk, D, device="cuda") * 3).to(torch.bfloat16).transpose(1, 2)
    vn = torch.randn(B, 1, Hk, D, device="cuda").to(torch.bfloat16).transpose(1, 2)
    kn[0, 0, 0, 0] = 1e4  # saturates at 448 scales
    slot = torch.tensor([[0], [1], [2], [4]], device="cuda")  # the last: the scratch slot (refused)
    token = torch.tensor([[500], [70], [9], [0]], device="cuda")
    bounds = torch.tensor([[0, 0, 501], [1, 7, 71], [2, 9, 10], [3, 0, 40]], dtype=torch.int32, device="cuda")
    for splits in (1, 4):
        kk, vv = k.clone(), v.clone()
        got = decode_attention(
            q, kk, vv, bounds, 1 / math.sqrt(D), splits, (kn, vn, slot, token), kv_scales=scales
        ).float()
        k2, v2 = k.clone(), v.clone()
        k2[slot, :, token] = quantize(kn, scales[0]).transpose(1, 2)
        v2[slot, :, token] = quantize(vn, scales[1]).transpose(1, 2)
        assert torch.equal(kk.view(torch.uint8), k2.view(torch.uint8)), splits
        assert torch.equal(vv.view(torch.uint8), v2.view(torch.uint8)), splits
        want = attend(q, k2, v2, bounds, kernel="sdpa", kv_scales=scales).float()
        assert (got - want).abs().max().item() < 2e-2, splits


def test_the_cascade_over_fp8_matches_the_reference() -> None:
    from kvvm.kernels.cascade import CascadeTables, Share, cascade_attention

    torch.manual_seed(2)
    B, H, Hk, T, D, P = 8, 32, 8, 1200, 128, 1024
    scales = torch.rand(2, Hk, device="cuda") + 0.25
    k, v = _fp8_kv(B + 1, Hk, T, D, scales)
    for s in range(1, B):
        k[s, :, :P], v[s, :, :P] = k[0, :, :P], v[0, :, :P]
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    bounds = torch.tensor([[s, 0, P + 20 * s + 5] for s in range(B)], dtype=torch.int32, device="cuda")
    tables = CascadeTables(B, "cuda", heads_per_kv=H // Hk, kv_heads=Hk)
    tables.update([Share("p", s, 0, P) for s in range(B)])
    want = attend(q, k, v, bounds, kernel="sdpa", kv_scales=scales).float()
    from kvvm.kernels.triton_decode import Config

    # Split private passes (merged by a kernel after), and one private program a request and
    # KV head merging the prefix itself, with V widened by the kernel's own conversion.
    # Both passes in one launch as well, V widened there too.
    from kvvm.kernels.cascade import PrefixConfig

    together = PrefixConfig(64, 4, 3, together=True)
    for config, prefix in ((4, None), (Config(1, 128, 4, 3, widen=True), None), (Config(1, 128, 4, 3, widen=True), together)):
        got = cascade_attention(
            q, k, v, bounds, 1 / math.sqrt(D), config, tables.tables, kv_scales=scales, prefix_config=prefix,
        ).float()
        # Outputs in bf16 (8 bits of mantissa) reduced in another order: two units in the last
        # place of the larger values (up to about 4) apart at most.
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2 * 2**-7)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("window", [0, 300])
def test_the_prefill_kernel_matches_the_reference(fp8: bool, window: int) -> None:
    """Several query tokens per request (a prefill chunk at the end of each range), bf16
    queries, K/V in bf16 or FP8: what ``"auto"`` runs for an FP8 cache's prefill on CUDA."""
    from kvvm.kernels.triton_prefill import prefill_attention

    torch.manual_seed(3)
    B, H, Hk, T, D, Q = 4, 32, 8, 2000, 128, 512
    scales = torch.rand(2, Hk, device="cuda") + 0.25
    if fp8:
        k, v = _fp8_kv(B + 1, Hk, T, D, scales)
    else:
        k = torch.randn(B + 1, Hk, T, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B + 1, Hk, T, D, device="cuda", dtype=torch.bfloat16)
    sc = scales if fp8 else None
    q = torch.randn(B, H, Q, D, device="cuda", dtype=torch.bfloat16)
    bounds = torch.tensor([[1, 0, 2000], [0, 0, 512], [3, 100, 1400], [2, 1000, 1600]], dtype=torch.int32, device="cuda")
    want = attend(q.float(), k if fp8 else k.float(), v if fp8 else v.float(), bounds, kernel="sdpa", window=window,
                  kv_scales=sc).float()
    got = prefill_attention(q, k, v, bounds, 1 / math.sqrt(D), window=window, kv_scales=sc).float()
    assert (got - want).abs().max().item() < 3e-2
    if fp8:
        assert (attend(q, k, v, bounds, kv_scales=sc, window=window).float() - got).abs().max().item() == 0.0


def _model() -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=4096, max_position_embeddings=8192,
    )
    with torch.device("cuda"):
        model: Any = transformers.LlamaForCausalLM(cfg)
        model = model.to(torch.bfloat16).eval()
    use_kvvm_attention(model)
    return model


@torch.no_grad()
def _decode(model, cache, ids, steps: int, graph: bool) -> torch.Tensor:
    """Prefill, then ``steps`` teacher-forced steps (a fixed token sequence): their logits."""
    from kvvm.transformers import DecodeGraph

    g = torch.Generator(device="cuda").manual_seed(4)
    feed = torch.randint(0, 4096, (steps, ids.shape[0]), generator=g, device="cuda")
    out = [model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()]
    step = DecodeGraph(model, cache, compile=False) if graph else None
    for i in range(steps):
        if step is not None:
            out.append(step(feed[i]).float().clone())
        else:
            out.append(model(input_ids=feed[i][:, None], past_key_values=cache, use_cache=True).logits[:, -1].float())
    if step is not None:
        step.close()
    return torch.stack(out)


def test_an_fp8_cache_decodes_captured_as_eagerly_and_near_bf16() -> None:
    model = _model()
    mgr = kvvm.Manager("cuda", precommit=True)
    ids = torch.randint(0, 4096, (6, 700), device="cuda")
    logits = {}
    runs: tuple[tuple[str, dict[str, Any], bool], ...] = (
        ("bf16", {}, True), ("fp8", {"kv_dtype": "fp8_e4m3"}, True), ("fp8-eager", {"kv_dtype": "fp8_e4m3"}, False)
    )
    for name, kw, graph in runs:
        cache = KvvmCache(model, 6, 800, manager=mgr, **kw)
        logits[name] = _decode(model, cache, ids, 12, graph)
        cache.release()
    # The captured Triton step against the eager one (the first logits are the prefill's:
    # identical): bf16 rounding apart.
    assert (logits["fp8"] - logits["fp8-eager"]).abs().max().item() < 0.1
    # Near bf16, relative to the logits' own size (e4m3 keeps 3 mantissa bits: a few percent
    # per element, averaged over the heads and tokens attention sums).
    ref = logits["bf16"].abs()
    diff = (logits["fp8"] - logits["bf16"]).abs()
    assert diff.mean().item() < 0.06 * ref.mean().item() and diff.max().item() < 0.3 * ref.max().item(), (
        diff.max(), diff.mean(), ref.mean()
    )
