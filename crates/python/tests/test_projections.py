"""Fused sibling projections (:mod:`kvvm.transformers.projections`): the same outputs as the separate
projections, the same parameters, one matrix multiply per group in a compiled step, and the
model given back by ``restore``. On CPU."""

from __future__ import annotations

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

from kvvm.transformers.projections import fuse_projections  # noqa: E402
from kvvm.transformers import KvvmCache, use_kvvm_attention  # noqa: E402

VOCAB = 512


def tiny(bias: bool = False) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024, attention_bias=bias,
    )
    cfg._attn_implementation = "sdpa"
    model: Any = transformers.LlamaForCausalLM(cfg)
    return model.to(torch.float32).eval()


def linear_calls(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """``linear`` calls in the graph Dynamo traces of one forward (no graph break allowed)."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    return sum(1 for g in explained.graphs for n in g.graph.nodes if "linear" in str(n.target))


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_give_the_same_logits_and_keep_the_parameters(bias: bool) -> None:
    model = tiny(bias)
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
        params = {n: p.shape for n, p in model.named_parameters()}
        keys = set(model.state_dict())
        fused = fuse_projections(model)
        got = model(ids).logits
    assert len(fused.groups) == 4, fused.groups  # attention and MLP of both layers
    assert torch.equal(got, want)
    assert {n: p.shape for n, p in model.named_parameters()} == params
    assert set(model.state_dict()) == keys
    attn = model.model.layers[0].self_attn
    # The members' weights are rows of one tensor: no second copy.
    assert attn.k_proj.weight.data_ptr() == attn.q_proj.weight.data_ptr() + attn.q_proj.weight.numel() * 4
    fused.restore()
    assert type(attn.q_proj) is torch.nn.Linear
    assert not any("_kvvm_fused_" in n for n, _ in model.named_modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


def test_a_compiled_forward_runs_one_matrix_multiply_per_group() -> None:
    model = tiny()
    ids = torch.randint(0, VOCAB, (1, 5))
    plain = linear_calls(model, ids)
    fused = fuse_projections(model)
    try:
        # 7 projections a layer become 4 (QKV, o, gate+up, down); lm_head stays.
        assert (plain, linear_calls(model, ids)) == (2 * 7 + 1, 2 * 4 + 1)
        compiled = torch.compile(model, fullgraph=True, dynamic=False)
        with torch.no_grad():
            got = compiled(ids).logits
        fused.restore()
        with torch.no_grad():
            want = model(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        fused.restore()
        torch._dynamo.reset()


def test_a_part_called_again_or_with_another_input_computes_afresh() -> None:
    model = tiny()
    attn = model.model.layers[0].self_attn
    x1, x2 = torch.randn(3, 128), torch.randn(3, 128)
    with torch.no_grad():
        want = {n: (getattr(attn, n)(x1), getattr(attn, n)(x2)) for n in ("q_proj", "k_proj", "v_proj")}
        fuse_projections(model)
        # Out of order, twice for one input, interleaved inputs: every call is its own product.
        for name, x, i in (("v_proj", x1, 0), ("v_proj", x1, 0), ("q_proj", x2, 1), ("k_proj", x1, 0),
                           ("k_proj", x2, 1), ("q_proj", x1, 0), ("v_proj", x2, 1)):
            assert torch.equal(getattr(attn, name)(x), want[name][i]), (name, i)


def test_siblings_that_cannot_be_fused_are_left_alone() -> None:
    model = tiny()
    mlp = model.model.layers[0].mlp
    mlp.up_proj.to(torch.float64)  # another dtype than its sibling
    attn = model.model.layers[1].self_attn

    class Quantized(torch.nn.Linear):
        """A Linear subclass: its forward may not be a plain product."""

    q = attn.q_proj
    attn.q_proj = Quantized(q.in_features, q.out_features, bias=False)
    fused = fuse_projections(model)
    assert fused.groups == ["model.layers.0.self_attn: q_proj+k_proj+v_proj", "model.layers.1.mlp: gate_proj+up_proj"]
    assert type(mlp.up_proj) is torch.nn.Linear and type(attn.q_proj) is Quantized


def test_a_group_of_one_is_refused() -> None:
    with pytest.raises(kvvm.InvalidArgumentError, match="at least two"):
        fuse_projections(tiny(), groups=(("q_proj",),))


@pytest.mark.skipif(not host_available(), reason="skipped: no host backend")
def test_greedy_decoding_over_a_kvvm_cache_is_unchanged_by_fusing() -> None:
    model = tiny()
    use_kvvm_attention(model)
    ids = torch.randint(0, VOCAB, (2, 7))
    mgr = kvvm.Manager("host", precommit=False)

    def generate() -> torch.Tensor:
        with KvvmCache(model.config, 2, 64, manager=mgr, dtype="fp32") as cache:
            out = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False, disable_compile=True)
        return out

    want = generate()
    fused = fuse_projections(model)
    assert torch.equal(generate(), want)
    fused.restore()
