"""A decode step's skinny products on a CUDA GPU: the Triton kernel in every candidate
configuration against cuBLAS's product (bf16 and fp16, rows from 1 to 64, the Llama-3.1-8B
shape's weights and ragged ones, a bias; a gated MLP's down projection over its gate and up
halves), the tuned operator's choice giving the same product inside a captured graph, and a model's logits through ``tuned_products`` against its own.
Skipped without CUDA."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from conftest import cuda_available

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch", reason="skipped: no CUDA (torch is not installed)")
    pytest.importorskip("triton", reason="skipped: no CUDA (no triton)")

pytestmark = pytest.mark.skipif(not cuda_available(), reason="skipped: no CUDA driver")

from kvvm.kernels import products  # noqa: E402


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within a few units of the output dtype's resolution at the products' magnitude: both
    sum in fp32, in different orders (split or not), then round once."""
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max().item()
    eps = torch.finfo(want.dtype).eps
    bound = 4 * eps * max(1.0, want.float().abs().max().item())
    assert err <= bound, f"max |diff| {err} over the bound {bound}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (300, 520)])
def test_every_candidate_matches_cublas(dtype: torch.dtype, n: int, k: int) -> None:
    torch.manual_seed(0)
    weight = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    for m in (1, 7, 16, 33, 64):
        x = torch.randn(m, k, device="cuda").to(dtype)
        for b in (None, bias):
            want = torch.nn.functional.linear(x, weight, b)
            for config in products.candidates():
                try:
                    got = products.product(x, weight, b, config)
                except products.triton_decode.TOO_BIG:
                    continue  # more shared memory than this card has: the tuner skips it too
                _close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4096, 14336), (300, 520)])
def test_every_candidate_computes_the_gated_product(dtype: torch.dtype, n: int, k: int) -> None:
    """The down projection of a gated MLP, its input ``silu(gate) * up`` computed as the
    kernel loads the gate and up halves, against PyTorch's activation and cuBLAS."""
    torch.manual_seed(3)
    weight = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    for m in (1, 16, 33, 64):
        x = (torch.randn(m, 2 * k, device="cuda") * 3).to(dtype)
        want = products.torch_product(x, weight, None, True)
        for config in products.candidates():
            try:
                got = products.product(x, weight, None, config, gated=True)
            except products.triton_decode.TOO_BIG:
                continue
            _close(got, want)


def test_the_activation_kernel_rounds_as_pytorch() -> None:
    """The separate way's activation (one kernel) against PyTorch's two: within one unit of
    bf16's resolution (the sigmoid's last fp32 bit may round the other way)."""
    torch.manual_seed(5)
    x = (torch.randn(33, 2 * 14336, device="cuda") * 3).to(torch.bfloat16)
    got, want = products.gate_activation(x), products.gated_input(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    rel = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max().item()
    assert rel <= torch.finfo(torch.bfloat16).eps, rel


def test_the_tuned_operator_replays_its_choice_in_a_graph() -> None:
    """``kvvm::linear`` tunes a shape the first time it meets it outside a capture, then a
    captured graph replays the chosen product over new inputs with cuBLAS's result."""
    torch.manual_seed(1)
    weight = (torch.randn(4096, 4096, device="cuda") / 64).to(torch.bfloat16)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    _tuned_then_replayed(products.linear, x, weight, False)
    assert any("4096 x 4096" in shape for shape in products.tuned_product_choices())
    # The gated operator the same way, over a gate and an up projection side by side.
    down = (torch.randn(4096, 14336, device="cuda") / 120).to(torch.bfloat16)
    gate_up = torch.randn(16, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    _tuned_then_replayed(products.gated_linear, gate_up, down, True)
    assert any("gated" in shape for shape in products.tuned_product_choices())


def _tuned_then_replayed(op: Any, x: torch.Tensor, weight: torch.Tensor, gated: bool) -> None:
    """``op(x, weight)`` tuned by its first call (PyTorch's result), then captured and
    replayed over new values of ``x`` (PyTorch's result for those)."""
    _close(op(x, weight), products.torch_product(x, weight, None, gated))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, weight)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    _close(out, products.torch_product(x, weight, None, gated))


def test_a_model_through_tuned_products_keeps_its_logits() -> None:
    """The tiny Llama's products and gated MLPs through the tuned operators: its logits."""
    from kvvm.serving.load import random_model
    from kvvm.transformers import fuse_projections, tuned_products

    torch.manual_seed(2)
    model = random_model("tiny", "cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (8, 1), device="cuda")
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
        fused = fuse_projections(model)
        tuned = tuned_products(model)
        assert tuned.mlps, "the gated MLPs run the gated product"
        try:
            got = model(input_ids=ids).logits.float()
        finally:
            tuned.restore()
            fused.restore()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 0.05 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.75


def test_cold_copies_hold_twice_the_l2_cache_or_one_a_repeat() -> None:
    """Copies of a weight smaller than the L2 cache: their bytes together at least twice the
    cache (or one a timed repeat), each a copy of its own memory with the same values; a
    weight larger than twice the cache has none."""
    from kvvm.kernels import tuning

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    small = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    copies = tuning.cold_copies(small)
    assert copies[0] is small
    assert sum(c.numel() * c.element_size() for c in copies) >= 2 * l2 or len(copies) == tuning._REPEATS
    assert len({c.data_ptr() for c in copies}) == len(copies)
    assert all(torch.equal(c, small) for c in copies)
    big = torch.empty(2 * l2 // 2 + 1024, device="cuda", dtype=torch.bfloat16)
    assert len(tuning.cold_copies(big)) == 1 and tuning.cold_copies(big)[0] is big


def test_a_cold_timing_replays_the_call_after_reading_twice_the_l2_cache() -> None:
    """``graph_time(..., cold=True)``: the scrub buffer holds twice the L2 cache and is
    zeroed; the call runs once eagerly, then in every captured repeat of the warm-up and the
    two timed replays (the scrub's own graph does not run it); the time is never negative,
    and the scrub's read is taken off (a one-element add times far below the read)."""
    from kvvm.kernels import tuning

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    scrub = tuning.scrub_buffer(0)
    assert scrub.numel() * scrub.element_size() >= 2 * l2 - 4 and not scrub.any()
    count = torch.zeros((), device="cuda", dtype=torch.int64)
    ms = tuning.graph_time(lambda step: count.add_(step), 1, cold=True)
    torch.cuda.synchronize()
    assert count.item() == 1 + 3 * tuning._REPEATS
    scrub_ms = tuning._replayed(scrub.sum)
    assert 0.0 <= ms < scrub_ms / 2, (ms, scrub_ms)
