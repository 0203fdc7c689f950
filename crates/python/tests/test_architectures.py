"""Architectures kvvm cannot serve are refused when the cache, the prefix or the engine is
made, with the reason (:func:`kvvm.transformers.architectures.check_servable`), and nothing is allocated;
every architecture of the model matrix is not refused for what it is (sliding windows are
decided elsewhere)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from conftest import host_available

import kvvm

if TYPE_CHECKING:
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    transformers = pytest.importorskip("transformers", reason="skipped: no transformers")

import model_matrix as mm  # noqa: E402
from kvvm.transformers.architectures import check_servable, refusal_reason  # noqa: E402
from kvvm.engine import Engine  # noqa: E402
from kvvm.transformers import KvvmCache  # noqa: E402
from kvvm.prefix import KvvmPrefix  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

#: (model type, config overrides, what the refusal says): transformers' default config of
#: each, as a user's checkpoint would name it.
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("t5", {}, "encoder-decoder"),
    ("bart", {}, "encoder-decoder"),
    ("whisper", {}, "encoder-decoder"),
    ("t5gemma", {}, "encoder-decoder"),
    ("mllama", {}, r"cross-attention layers \(layers \[3, 8"),
    ("deepseek_v3", {}, "multi-head latent attention: a token's state is a compressed latent of 512"),
    ("minicpm3", {}, "multi-head latent attention"),
    ("mimo_v2_flash", {}, r"K and V have different head dims \(192 and 128\)"),
    ("qwen3_next", {}, r"layer types \['linear_attention'\]: linear-attention or state-space"),
    ("mamba", {}, "fixed-size recurrent state"),
    ("jamba", {}, "fixed-size recurrent state"),
    ("falcon_h1", {}, r"layer types \['hybrid'\]: hybrid layers keep a recurrent state"),
    ("llama4_text", {}, "chunked attention"),
    ("deepseek_v32", {}, "multi-head latent attention"),
    ("gemma3n_text", {}, "the last 15 layers reuse earlier layers' K/V"),
    ("gemma4_text", {}, "head_dim differs from layer to layer"),
]


def _config(model_type: str, **overrides: Any) -> Any:
    return transformers.AutoConfig.for_model(model_type, **overrides)


@pytest.mark.parametrize(("model_type", "overrides", "reason"), REFUSED, ids=[r[0] for r in REFUSED])
def test_an_architecture_kvvm_cannot_hold_is_refused_at_construction_with_the_reason(
    model_type: str, overrides: dict[str, Any], reason: str
) -> None:
    cfg = _config(model_type, **overrides)
    assert refusal_reason(cfg) is not None
    mgr = kvvm.Manager("host")
    with pytest.raises(kvvm.InvalidArgumentError, match=f"kvvm cannot serve this {model_type}.* model: .*{reason}"):
        KvvmCache(cfg, 1, 64, manager=mgr)
    snap = mgr.snapshot()
    assert (snap.used, snap.committed) == (0, 0), "nothing was allocated"


def _tiny(model_type: str, **kw: Any) -> Any:
    cfg = _config(model_type, vocab_size=256, eos_token_id=None, pad_token_id=0, **kw)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def test_a_latent_attention_model_is_refused_by_the_prefix_and_the_engine() -> None:
    model = _tiny(
        "deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=1, topk_group=1,
    )
    mgr = kvvm.Manager("host")
    with pytest.raises(kvvm.InvalidArgumentError, match="multi-head latent attention"):
        KvvmPrefix.build(model, torch.tensor([[5, 6, 7]]), manager=mgr, max_cache_len=64)
    attn = model.config._attn_implementation
    with pytest.raises(kvvm.InvalidArgumentError, match="deepseek_v3 model: multi-head latent attention"):
        Engine(model, slots=1, max_len=64, manager=mgr, compile=False)
    assert model.config._attn_implementation == attn, "the model is left as it was"
    assert mgr.snapshot().used == 0


def test_a_model_whose_attention_is_its_own_code_is_served_by_generate_but_refused_by_the_engine() -> None:
    """Bloom (ALiBi) attends with its own code: a KvvmCache under its own attention gives
    DynamicCache's tokens, while the engine, which attends with kvvm's attention (no bias
    term), is refused (it failed inside the first forward before)."""
    model = _tiny("bloom", hidden_size=64, n_layer=2, n_head=4)
    ids = torch.tensor([mm.tokens(20, 1, vocab=256)])
    mgr = kvvm.Manager("host")
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        cache = KvvmCache(model, 1, 64, manager=mgr)
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, past_key_values=cache)
    assert got.tolist() == want.tolist()
    del got
    cache.release()
    with pytest.raises(kvvm.InvalidArgumentError, match="bloom model: its attention is its own code"):
        Engine(model, slots=1, max_len=64, manager=mgr, compile=False)


@pytest.mark.parametrize(
    ("model_type", "kw", "reason"),
    [
        ("gpt_oss", dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1),
         "learned attention sinks"),
    ],
    ids=["gpt_oss"],
)
def test_what_kvvms_attention_does_not_compute_is_refused_by_the_engine(model_type: str, kw: dict[str, Any], reason: str) -> None:
    model = _tiny(model_type, **kw)
    assert refusal_reason(model.config) is None, "the cache could hold its K/V"
    with pytest.raises(kvvm.InvalidArgumentError, match=reason):
        check_servable(model, attention=True)
    with pytest.raises(kvvm.InvalidArgumentError, match=reason):
        Engine(model, slots=1, max_len=64, manager=kvvm.Manager("host"), compile=False)


@pytest.mark.parametrize("arch", mm.ARCHS, ids=lambda a: a.name)
def test_no_architecture_of_the_matrix_is_refused_for_what_it_is(arch: mm.Arch) -> None:
    """The real configs hold per-token K and V, and kvvm's attention computes what each needs
    (Gemma 2's attention logit softcapping included)."""
    assert refusal_reason(mm.real_config(arch)) is None
    model = mm.build_model(arch)
    assert refusal_reason(model, attention=True) is None


def test_the_docs_table_lists_every_architecture_with_its_real_numbers() -> None:
    """``docs/models.md``'s table: one row per architecture of the matrix, with the real
    model's layers, heads, GQA ratio, head dim, bf16 bytes per token, tokens per 2 MiB
    window and sliding window, as the matrix computes them."""
    from pathlib import Path

    doc = Path(__file__).resolve().parents[3] / "docs" / "models.md"
    rows: dict[str, list[str]] = {}
    for line in doc.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0]:
            rows[cells[0]] = cells
    for arch in mm.ARCHS:
        assert arch.checkpoint in rows, f"{arch.checkpoint} is not in docs/models.md"
        cells = rows[arch.checkpoint]
        heads = f"{arch.real['num_attention_heads']} / {arch.kv_heads}"
        window = str(arch.real_window) if arch.real_window is not None else "-"
        per_window = f"{mm.tokens_per_window(arch.bytes_per_token(), mm.REAL_GRANULE):.2f}"
        want = [arch.model_type, str(arch.layers), heads, str(arch.gqa), str(arch.head_dim),
                str(arch.bytes_per_token()), per_window, window]
        assert cells[1:9] == want, (arch.checkpoint, cells[1:9], want)
