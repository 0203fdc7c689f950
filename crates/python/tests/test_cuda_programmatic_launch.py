"""Programmatic dependent launches on a CUDA GPU (compute capability 9 or more): kvvm's
decode-step kernels, each reading what the kernel just before it wrote, give in a captured
graph the results they give launched the usual way. A kernel that read before its wait would
read the previous kernel's output unfinished. Skipped without CUDA or on an older GPU."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest

from conftest import cuda_available

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch", reason="skipped: no CUDA (torch is not installed)")
    pytest.importorskip("triton", reason="skipped: no CUDA (no triton)")

pytestmark = pytest.mark.skipif(not cuda_available(), reason="skipped: no CUDA driver")

from kvvm.kernels import device  # noqa: E402
from kvvm.kernels.products import ProductConfig, product  # noqa: E402
from kvvm.kernels.triton_decode import Config, decode_attention  # noqa: E402


def _chain(x: torch.Tensor, weights: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor
           ) -> torch.Tensor:
    """Products one after the other, each over the last one's output (one of them gated),
    then the decode attention over a query made of it and the merge of its splits."""
    y = x
    for i, w in enumerate(weights):
        y = product(y * 1.5, w, None, ProductConfig(64, 128), gated=i == 1)
    q = y[:, : 8 * 128].reshape(y.shape[0], 8, 1, 128)
    return decode_attention(q, k, v, bounds, 1 / math.sqrt(128), Config(4))


def test_a_chain_of_kvvm_kernels_launched_as_programmatic_dependents_in_a_graph() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("skipped: programmatic launches need compute capability 9 (Hopper) or more")
    torch.manual_seed(4)
    d = torch.device("cuda")
    weights = [torch.randn(8192, 4096, device=d, dtype=torch.bfloat16) / 64,
               torch.randn(4096, 4096, device=d, dtype=torch.bfloat16) / 64,
               torch.randn(4096, 4096, device=d, dtype=torch.bfloat16) / 64]
    x = torch.randn(16, 4096, device=d, dtype=torch.bfloat16)
    k = torch.randn(17, 2, 4096, 128, device=d, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    bounds = torch.tensor([[i, 0, 1000 + 150 * i] for i in range(16)], dtype=torch.int32, device=d)
    want = _chain(x, weights, k, v, bounds)
    before = device.set_programmatic_launch(True)
    try:
        assert device.programmatic(d)
        _chain(x, weights, k, v, bounds)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(x, weights, k, v, bounds)
    finally:
        device.set_programmatic_launch(before)
    for _ in range(20):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), "the same results as launched the usual way"
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _chain(x, weights, k, v, bounds)), "over new inputs too"
