"""The cascade's two passes in one launch, or in two beside each other on two streams, on a
CUDA GPU: replayed in a captured graph many times over at the step's shape (64 requests in 4
groups, the one launch measured fastest alone), every replay's output the same bits (each
row's merge reads its columns in one order whichever program merges it, so a merge that read
a column before its writer's stores showed would change them) and every arrival count back at
zero; and against the plain decode kernel at every GQA ratio and head dim tried, both program
orders. Skipped without CUDA."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest

from conftest import cuda_available

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch", reason="skipped: no CUDA (torch is not installed)")

pytestmark = pytest.mark.skipif(not cuda_available(), reason="skipped: no CUDA driver")

from kvvm.kernels.cascade import CascadeTables, PrefixConfig, Share, cascade_attention  # noqa: E402
from kvvm.kernels.triton_decode import Config, decode_attention  # noqa: E402


def _step(
    batch: int, heads: int, kv_heads: int, dim: int, prefix: int, own: int, groups: int, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[Share | None]]:
    """K/V of ``batch`` requests in ``groups`` groups (each group's prefix the same bytes in
    its members' slots; the last request in no group), their queries and bounds."""
    tokens = prefix + own + 16
    k = torch.randn(batch + 1, kv_heads, tokens, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    per = max(2, batch // groups)
    shares: list[Share | None] = []
    for s in range(batch):
        first = (s // per) * per
        k[s, :, :prefix], v[s, :, :prefix] = k[first, :, :prefix], v[first, :, :prefix]
        shares.append(Share(first, s, 0, prefix) if s < batch - 1 else None)
    q = torch.randn(batch, 1, heads, dim, device="cuda", dtype=dtype).transpose(1, 2)
    ends = [prefix + 1 + (s * 37) % own for s in range(batch)]
    bounds = torch.tensor([[s, 0, e] for s, e in enumerate(ends)], dtype=torch.int32, device="cuda")
    return k, v, q, bounds, shares


@pytest.mark.parametrize("how", ["together", "concurrent"])
def test_replayed_many_times_each_merge_sees_every_column(how: str) -> None:
    torch.manual_seed(7)
    batch, heads, kv_heads, dim = 64, 32, 8, 128
    k, v, q, bounds, shares = _step(batch, heads, kv_heads, dim, 2048, 256, 4, torch.bfloat16)
    tables = CascadeTables(batch, "cuda", prefix_splits=2, heads_per_kv=heads // kv_heads, kv_heads=kv_heads, rows=32)
    tables.update(shares)
    scale = 1 / math.sqrt(dim)
    want = decode_attention(q, k, v, bounds, scale, Config(1)).float()
    for first in (True, False):
        pc = PrefixConfig(64, 4, 2, prefix_first=first, **{how: True})

        def run() -> torch.Tensor:
            return cascade_attention(q, k, v, bounds, scale, Config(1, 64, 4, 2), tables.tables, prefix_config=pc)

        out = run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        graph.replay()
        torch.cuda.synchronize()
        first_bits = out.clone()
        torch.testing.assert_close(first_bits.float(), want, atol=2e-2, rtol=2e-2)
        differing = 0
        for _ in range(400):
            graph.replay()
            torch.cuda.synchronize()
            differing += int(not torch.equal(out, first_bits))
        assert differing == 0, f"{differing} of 400 replays differ"
        assert not tables.arrivals.any()


#: (query heads, KV heads, head dim, dtype, prefix programs first): every GQA ratio tried in
#: bf16 and one in fp32, the program orders alternating (each kernel variant compiles apart).
_SHAPES = [
    (32, 8, 128, "bfloat16", True), (8, 8, 64, "bfloat16", False), (16, 2, 128, "bfloat16", True),
    (32, 4, 96, "bfloat16", False), (32, 8, 128, "float32", False),
]


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "dtype", "first"), _SHAPES)
def test_both_passes_in_one_launch_or_beside_match_the_plain_kernel(
    heads: int, kv_heads: int, dim: int, dtype: str, first: bool,
) -> None:
    torch.manual_seed(heads + dim)
    batch = 24
    k, v, q, bounds, shares = _step(batch, heads, kv_heads, dim, 700, 200, 3, getattr(torch, dtype))
    tables = CascadeTables(
        batch, "cuda", prefix_splits=2, heads_per_kv=heads // kv_heads, kv_heads=kv_heads, rows=16,
    )
    tables.update(shares)
    scale = 1 / math.sqrt(dim)
    want = decode_attention(q, k, v, bounds, scale, Config(1)).float()
    # bf16 outputs summed in another order: a unit or two in the last place.
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    for how in ("together", "concurrent"):
        pc = PrefixConfig(32, 4, 2, prefix_first=first, **{how: True})
        got = cascade_attention(q, k, v, bounds, scale, Config(1, 64, 4, 2), tables.tables, prefix_config=pc).float()
        torch.cuda.synchronize()
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=how)
        assert not tables.arrivals.any(), how
