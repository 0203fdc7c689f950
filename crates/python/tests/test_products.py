"""A decode step's skinny products (``kvvm.kernels.products``, ``kvvm.transformers.tuned_products``):
the Triton kernel against PyTorch's product in Triton's interpreter (every split, rows, a
weight whose rows and columns are no multiple of a block, a bias), the tuner's choice (PyTorch
a candidate, remembered, nothing timed while untuned), and the model-level swap (the same
logits, every module back after ``restore``). CPU only; the GPU run is the benchmark's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest

from conftest import tuner_on

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")


def test_the_kernel_computes_the_product_in_the_interpreter() -> None:
    """Every candidate configuration and every split, rows from 1 to 64, weights of rows and
    columns no multiple of a block, with and without a bias, leading dimensions flattened,
    against ``torch.nn.functional.linear`` (fp32, Triton's interpreter in a process of its
    own: Triton reads ``TRITON_INTERPRET`` once)."""
    pytest.importorskip("triton", reason="skipped: no triton")
    code = textwrap.dedent(
        """
        import torch
        from kvvm.kernels import products as P
        from kvvm.kernels.products import (
            ProductConfig, candidates, gate_activation, gated_input, gated_linear, linear, product, torch_product,
            tuned_product,
        )
        torch.manual_seed(3)
        configs = [ProductConfig(32, 32), ProductConfig(64, 32, split=2), ProductConfig(32, 64, split=4)]
        for m, n, k in ((1, 40, 96), (5, 97, 200), (16, 64, 64), (33, 130, 150), (64, 33, 260)):
            x, w, b = torch.randn(m, k), torch.randn(n, k) * 0.1, torch.randn(n)
            # Gated: the input a gate and an up projection side by side, silu(gate) * up.
            xg = torch.randn(m, 2 * k) * 3
            for c in configs:
                for bias in (None, b):
                    want = torch.nn.functional.linear(x, w, bias)
                    got = product(x, w, bias, c)
                    assert got.shape == want.shape and got.dtype == x.dtype
                    assert (got - want).abs().max().item() < 1e-4, (m, n, k, c, bias is not None)
                    want = torch.nn.functional.linear(torch.nn.functional.silu(xg[:, :k]) * xg[:, k:], w, bias)
                    got = product(xg, w, bias, c, gated=True)
                    assert torch.equal(torch_product(xg, w, bias, True), want)
                    assert (got - want).abs().max().item() < 1e-4, ("gated", m, n, k, c, bias is not None)
        # The gated operator: leading dimensions flattened; a width that is not two halves of
        # the weight's columns goes to PyTorch (which refuses it as its product would).
        xg, w = torch.randn(2, 3, 128), torch.randn(40, 64)
        assert tuned_product(xg.reshape(6, 128), w, None, True) == candidates()[0]
        assert (gated_linear(xg, w) - gated_input(xg) @ w.T).abs().max().item() < 1e-4
        assert tuned_product(torch.randn(4, 64), w, None, True) is None
        # The activation in a kernel of its own (rows of several blocks), and a gated shape
        # tuned to the separate way: that kernel, then the plain product.
        for shape in ((5, 2, 160), (3, 3000)):
            xa = torch.randn(*shape) * 3
            assert (gate_activation(xa) - gated_input(xa)).abs().max().item() < 1e-5, shape
        xs, w2 = torch.randn(5, 2, 160), torch.randn(30, 80)
        P._TUNED[(16, (30, 80), 80, torch.float32, False, True, xs.device)] = None
        assert tuned_product(xs.reshape(10, 160), w2, None, True) is None
        assert (gated_linear(xs, w2) - gated_input(xs) @ w2.T).abs().max().item() < 1e-4
        try:
            product(torch.randn(4, 64), w, None, configs[0], gated=True)
        except ValueError as e:
            assert "gated product" in str(e)
        else:
            raise AssertionError("a gated product of one half ran in the kernel")
        assert len({c.split for c in candidates()}) > 1
        # The operator: leading dimensions flattened, the interpreter's choice the kernel's.
        x, w = torch.randn(2, 3, 64), torch.randn(40, 64)
        assert tuned_product(x.reshape(6, 64), w, None) == candidates()[0]
        assert (linear(x, w) - x @ w.T).abs().max().item() < 1e-4
        # More rows than the kernel takes: PyTorch's product.
        big = torch.randn(65, 64)
        assert tuned_product(big, w, None) is None
        assert torch.equal(linear(big, w), torch.nn.functional.linear(big, w))
        # A weight read across its rows (not a unit last stride), a bias of another dtype or
        # read with a stride: PyTorch's product.
        assert tuned_product(torch.randn(4, 40), w.t(), None) is None
        assert tuned_product(torch.randn(4, 64), w, torch.zeros(40, dtype=torch.float64)) is None
        strided = torch.zeros(80)[::2]
        assert tuned_product(torch.randn(4, 64), w, strided) is None
        assert torch.equal(linear(torch.ones(4, 64), w, strided), torch.nn.functional.linear(torch.ones(4, 64), w, strided))
        try:
            product(big, w, None, configs[0])
        except ValueError as e:
            assert "not the kernel's" in str(e)
        else:
            raise AssertionError("a product of 65 rows ran in the kernel")
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.fixture
def products(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The products module with its tuner on, outside the interpreter, every product the
    kernel's to take, and its measurement a fake: each candidate's time from ``times`` (by
    position, PyTorch's first), each timed configuration recorded in ``timed``."""
    tuner_on(monkeypatch)
    import kvvm.kernels.products

    p: Any = kvvm.kernels.products

    monkeypatch.setattr(p, "_INTERPRETED", False)
    monkeypatch.setattr(p, "_TUNED", {})
    monkeypatch.setattr(p, "_kernel_takes", lambda x, w, b, gated: True)
    monkeypatch.setattr(p, "timed", [], raising=False)
    monkeypatch.setattr(p, "times", [1.0] + [2.0] * len(p.candidates()), raising=False)

    def fake_time(call: Any, config: Any) -> float:
        p.timed.append(config)
        order = [None, *p.candidates()]
        return float(p.times[order.index(config)])

    monkeypatch.setattr(p, "graph_time", fake_time)
    return p


def test_the_tuner_keeps_pytorch_where_it_is_fastest_and_remembers(products: Any) -> None:
    x, w = torch.zeros(16, 64), torch.zeros(40, 64)
    assert products.tuned_product(x, w, None) is None, "PyTorch's product was the fastest"
    assert products.timed == [None, *products.candidates()], "PyTorch and every candidate timed, once each"
    products.timed.clear()
    assert products.tuned_product(torch.zeros(9, 64), w, None) is None, "9 rows round up to the 16 tuned"
    assert products.timed == [], "a shape tuned before is not timed again"
    assert products.tuned_product_choices() == {"rows <= 16, weight 40 x 64, torch.float32": "torch"}


def test_the_tuner_picks_the_fastest_candidate_ties_to_the_earliest(products: Any) -> None:
    products.times = [5.0, 4.0, 3.0, 3.0] + [9.0] * (len(products.candidates()) - 3)
    x, w = torch.zeros(64, 64), torch.zeros(40, 64)
    assert products.tuned_product(x, w, None) == products.candidates()[1]
    # Another row count, another bias, another weight: tuned apart.
    products.times = [1.0] + [2.0] * len(products.candidates())
    assert products.tuned_product(torch.zeros(4, 64), w, None) is None
    assert products.tuned_product(x, w, torch.zeros(40)) is None
    assert products.tuned_product(x, w, None) == products.candidates()[1], "the first choice is kept"
    assert len(products.tuned_product_choices()) == 3


def test_untuned_times_nothing_and_remembers_nothing(products: Any) -> None:
    from kvvm.kernels.tuning import untuned

    x, w = torch.zeros(16, 64), torch.zeros(40, 64)
    with untuned():
        assert products.tuned_product(x, w, None) is None
    assert products.timed == [] and products.tuned_product_choices() == {}
    products.times = [3.0, 1.0] + [2.0] * (len(products.candidates()) - 1)
    assert products.tuned_product(x, w, None) == products.candidates()[0]
    with untuned():
        assert products.tuned_product(x, w, None) == products.candidates()[0], "a tuned shape keeps its choice"


def test_each_timed_call_reads_the_next_copy_of_the_weight(products: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner's repeats read the weight's copies (:func:`~kvvm.kernels.tuning.cold_copies`)
    in turn, every candidate PyTorch's and the kernel's alike, so none is timed from the L2
    cache; the result of each is the same product."""
    x, w = torch.randn(16, 64), torch.randn(40, 64)
    copies = [w, w.clone(), w.clone()]
    monkeypatch.setattr(products, "cold_copies", lambda t: copies if t is w else [t])
    read: list[int] = []
    real_linear = torch.nn.functional.linear

    def kernel(x: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        read.append(id(weight))
        return x @ weight.T  # the kernel's result (no device here to launch it on)

    def pytorch(x: torch.Tensor, weight: torch.Tensor, *args: Any) -> torch.Tensor:
        read.append(id(weight))
        return real_linear(x, weight, *args)

    monkeypatch.setattr(products, "product", kernel)
    monkeypatch.setattr(torch.nn.functional, "linear", pytorch)
    outs: list[torch.Tensor] = []

    def time_three(call: Any, config: Any) -> float:
        outs.extend(call(config) for _ in range(3))
        return 1.0 if config is None else 2.0

    monkeypatch.setattr(products, "graph_time", time_three)
    assert products.tuned_product(x, w, None) is None
    ids = [id(c) for c in copies]
    assert read == ids * (1 + len(products.candidates())), "each call the next copy, cycling"
    assert all(torch.allclose(o, x @ w.T, atol=1e-4) for o in outs)


def test_cold_copies_of_a_host_tensor_is_the_tensor_alone() -> None:
    from kvvm.kernels.tuning import cold_copies

    t = torch.zeros(3)
    assert len(cold_copies(t)) == 1 and cold_copies(t)[0] is t


def test_a_configuration_the_device_cannot_run_is_skipped(products: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvvm.kernels.triton_decode as td

    if not td.TOO_BIG:
        pytest.skip("skipped: this triton names no OutOfResources error")
    first = products.candidates()[0]
    record = products.graph_time

    def too_big_first(call: Any, config: Any) -> float:
        if config == first:
            raise td.TOO_BIG[0]("shared memory", 1, "shared memory")
        return float(record(call, config))

    monkeypatch.setattr(products, "graph_time", too_big_first)
    products.times = [9.0, 0.5] + [1.0] * (len(products.candidates()) - 1)
    assert products.tuned_product(torch.zeros(16, 64), torch.zeros(40, 64), None) == products.candidates()[1]


def test_tuned_products_swaps_plain_linears_and_fused_groups_and_restores_them() -> None:
    pytest.importorskip("triton", reason="skipped: no triton")
    from torch import nn

    from kvvm.serving.load import random_model
    from kvvm.transformers import TunedProducts, fuse_projections, tuned_products
    from kvvm.transformers.products import TunedLinear
    from kvvm.transformers.projections import Group

    model = random_model("tiny", "cpu", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 5))

    class Scaled(nn.Linear):
        """A subclass computes something else: left alone."""

    model.extra = Scaled(4, 4)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        fused = fuse_projections(model)
        tuned = tuned_products(model)
        assert isinstance(tuned, TunedProducts)
        layers = model.config.num_hidden_layers
        assert len(tuned.groups) == 2 * layers, "every fused group"
        assert len(tuned.layers) == 2 * layers + 1, "O, down and the output head"
        assert tuned.mlps == [f"model.layers.{i}.mlp" for i in range(layers)], "every gated MLP"
        assert all("forward" in vars(layer.mlp) for layer in model.model.layers)
        assert type(model.extra) is Scaled and "extra" not in tuned.layers
        assert isinstance(model.lm_head, TunedLinear) and model.lm_head.weight is not None
        groups = [m for m in model.modules() if isinstance(m, Group)]
        assert all(g.linear is torch.ops.kvvm.linear for g in groups)
        # Off CUDA and outside the interpreter the products are PyTorch's: the same logits.
        assert torch.equal(model(input_ids=ids).logits, want)
        tuned.restore()
        assert tuned.layers == [] and tuned.groups == []
        assert not any(isinstance(m, TunedLinear) for m in model.modules())
        assert tuned.mlps == [] and not any("forward" in vars(layer.mlp) for layer in model.model.layers)
        assert all(g.linear is nn.functional.linear for g in groups)
        fused.restore()
        assert type(model.lm_head) is nn.Linear
        assert torch.equal(model(input_ids=ids).logits, want)


def test_only_gated_silu_mlps_with_fused_halves_run_the_gated_product() -> None:
    """The gated product replaces an MLP's forward only where it computes the same thing:
    transformers' gated MLP code, a SiLU, gate and up fused side by side; any other MLP keeps
    its own forward, and a gated MLP whose fusion was undone first falls back to its own."""
    pytest.importorskip("triton", reason="skipped: no triton")
    from torch import nn

    from kvvm.serving.load import random_model
    from kvvm.transformers import fuse_projections, tuned_products

    model = random_model("tiny", "cpu", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    mlps = [layer.mlp for layer in model.model.layers]

    class Scaled(type(mlps[0])):  # type: ignore[misc]
        """Other code: twice the MLP's output."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)  # type: ignore[no-any-return]

    mlps[1].__class__ = Scaled
    mlps[2].act_fn = nn.GELU()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        unfused = tuned_products(model)
        assert unfused.mlps == [] and unfused.layers, "unfused: nothing to run gated"
        unfused.restore()
        fused = fuse_projections(model)
        tuned = tuned_products(model)
        assert tuned.mlps == ["model.layers.0.mlp", "model.layers.3.mlp"], "other code and another activation left alone"
        # The same products (a fused product may sum in another order than two apart).
        assert (model(input_ids=ids).logits - want).abs().max().item() < 1e-5
        fused.restore()
        got = model(input_ids=ids).logits
        assert (got - want).abs().max().item() < 1e-5, "the fusion undone first: the MLPs' own forward"
        tuned.restore()
        assert not any("forward" in vars(m) for m in mlps)
