"""The model matrix: the architectures transformers users load most, each as its real
configuration (the shapes of the published checkpoint) and as a small test configuration
that keeps the real model's per-layer shapes and its bytes per token.

What the tests keep from the real model, and why
-------------------------------------------------

kvvm maps K/V memory in windows of one granule. The host backend's granule is 2 MiB (its
recommended granularity, a huge page; the minimum is the 4 KiB page, ``Manager(...,
granularity="minimum")``, and nothing in between can be chosen from Python), the same as a
GPU's. How a token's bytes fall on those windows (whether a token ends on a window boundary,
which tokens straddle one, how many tokens a window holds) depends only on the bytes per
token, token-major: ``2 (K, V) x layers x KV heads x head dim x dtype bytes``.

The tests run in fp32 (4 bytes; greedy tokens compared exactly) with **half the real
layers**: ``2 x L/2 x H x D x 4 = 2 x L x H x D x 2``, the real model's bytes per token in
bf16, exactly. So on the host's 2 MiB windows a test model holds exactly as many tokens per
window as the real model does in bf16 on a GPU's 2 MiB granule: Qwen2.5-0.5B 12288 bytes a
token, 170.67 tokens a window (token 170 straddles the first window boundary), SmolLM2-135M
23040 bytes, 91.02, Llama 3 8B 131072 bytes, exactly 16. :func:`tokens_per_window` and the
tests check it for every entry.

Kept as in the real model: KV heads, head dim, query heads (so the GQA ratio), tied
embeddings, the rope variant (llama3 scaling, partial rotary, local/global bases), qk-norm,
biases, activations, norms, Gemma's scalings and softcapping, layer types. Shrunk: the
number of layers (halved, see above), the hidden and MLP sizes (they do not change the K/V
shapes: every architecture here takes its head dim from the config), the vocabulary (512),
and the sliding windows, shortened to a few dozen tokens so that the test prompts cross
them (the real window is in :attr:`Arch.real`, and in the docs table).

``REAL_GRANULE`` is the window the real model is measured against (the docs table).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

GRANULE = 2 << 20
#: The granule the docs table measures real models against (a GPU's, and the host's).
REAL_GRANULE = GRANULE
#: The test models' vocabulary.
VOCAB = 512
#: The test models' hidden size, where the architecture lets it differ from heads x head dim.
HIDDEN = 128


@dataclass(frozen=True)
class Arch:
    """One architecture of the matrix."""

    #: Short name, used as the test id.
    name: str
    #: The published checkpoint whose configuration :attr:`real` is.
    checkpoint: str
    #: transformers' ``model_type``.
    model_type: str
    #: The checkpoint's configuration (what matters for K/V and attention).
    real: dict[str, Any]
    #: What this architecture exercises (the docs table's notes).
    features: str
    #: The test configuration's hidden size (``None``: :data:`HIDDEN`): GPT-NeoX ties its
    #: head dim to ``hidden_size // heads`` and keeps the real one; Llama wants a multiple
    #: of the query heads.
    hidden: int | None = None
    #: The test configuration's sliding window (shortened; ``None``: no window).
    window: int | None = None
    #: Overrides of the test configuration beyond the shrunk sizes.
    extra: dict[str, Any] = field(default_factory=dict)
    #: The attention implementation the references run (None: transformers' default, SDPA).
    #: Gemma 2 runs eager: SDPA drops its attention logit softcapping.
    attention: str | None = None

    @property
    def layers(self) -> int:
        """The real model's layers."""
        return int(self.real["num_hidden_layers"])

    @property
    def kv_heads(self) -> int:
        """The real model's KV heads."""
        return int(self.real.get("num_key_value_heads") or self.real["num_attention_heads"])

    @property
    def head_dim(self) -> int:
        """The real model's head dim."""
        return int(self.real.get("head_dim") or self.real["hidden_size"] // self.real["num_attention_heads"])

    @property
    def gqa(self) -> int:
        """Query heads per KV head."""
        return int(self.real["num_attention_heads"]) // self.kv_heads

    def bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """The real model's K/V bytes per token, token-major (bf16 by default)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    @property
    def real_window(self) -> int | None:
        """The real model's sliding window, if it has one."""
        w = self.real.get("sliding_window")
        return int(w) if w is not None and self.real.get("use_sliding_window", True) else None


def tokens_per_window(bytes_per_token: int, granule: int = GRANULE) -> float:
    """Tokens a window of ``granule`` bytes holds (a fraction when a token straddles)."""
    return granule / bytes_per_token


_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

ARCHS: list[Arch] = [
    Arch(
        "llama3-8b", "meta-llama/Llama-3.1-8B", "llama",
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
             rope_parameters=_LLAMA31_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=False),
        "GQA 4, llama3 rope scaling",
    ),
    Arch(
        "qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", "qwen2",
        dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
             tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768, max_window_layers=21),
        "GQA 7, QKV bias, tied embeddings",
        extra={"head_dim": 64},
    ),
    Arch(
        "qwen2.5-7b", "Qwen/Qwen2.5-7B", "qwen2",
        dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
             num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
             tie_word_embeddings=False, use_sliding_window=False, sliding_window=131072, max_window_layers=28),
        "GQA 7, QKV bias",
        extra={"head_dim": 128},
    ),
    Arch(
        "qwen3-0.6b", "Qwen/Qwen3-0.6B", "qwen3",
        dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
             tie_word_embeddings=True, attention_bias=False),
        "GQA 2, qk-norm, heads x head dim != hidden, tied embeddings",
    ),
    Arch(
        "mistral-7b", "mistralai/Mistral-7B-v0.3", "mistral",
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, vocab_size=32768, max_position_embeddings=32768,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-5,
             tie_word_embeddings=False, sliding_window=None),
        "GQA 4, no sliding window (v0.1's 4096-token window: tests/test_sliding.py)",
    ),
    Arch(
        "gemma2-2b", "google/gemma-2-2b", "gemma2",
        dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
             num_key_value_heads=4, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
             tie_word_embeddings=True, sliding_window=4096, attn_logit_softcapping=50.0,
             final_logit_softcapping=30.0, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh"),
        "GQA 2, head dim 256, local/global layers alternating, attention and final logit softcapping",
        window=24,
        attention="eager",
    ),
    Arch(
        "gemma3-1b", "google/gemma-3-1b-pt", "gemma3_text",
        dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
             num_key_value_heads=1, head_dim=256, vocab_size=262144, max_position_embeddings=32768,
             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
             rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=512, sliding_window_pattern=6,
             query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh"),
        "one KV head (GQA 4), head dim 256, 5 local : 1 global layers, local/global rope bases, qk-norm",
        window=64,
    ),
    Arch(
        "phi3-mini", "microsoft/Phi-3-mini-4k-instruct", "phi3",
        dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096,
             original_max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=2047),
        "no GQA (32 KV heads), head dim 96, fused QKV, a 2047-token sliding window (longer than the "
        "matrix's requests: every layer attends to all of them)",
        window=2047,
        extra={"head_dim": 96},
    ),
    Arch(
        "phi2", "microsoft/phi-2", "phi",
        dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=51200, max_position_embeddings=2048,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4},
             layer_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="gelu_new"),
        "no GQA, head dim 80, partial rotary (40%), parallel attention and MLP, biases",
        extra={"head_dim": 80},
    ),
    Arch(
        "smollm2-135m", "HuggingFaceTB/SmolLM2-135M", "llama",
        dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
             rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5,
             tie_word_embeddings=True),
        "GQA 3, 9 query heads, tied embeddings",
        hidden=144,
    ),
    Arch(
        "olmo2-1b", "allenai/OLMo-2-0425-1B", "olmo2",
        dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=100352, max_position_embeddings=4096,
             rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-6,
             tie_word_embeddings=False),
        "no GQA, qk-norm over all heads, post-norm",
        extra={"head_dim": 128},
    ),
    Arch(
        "pythia-160m", "EleutherAI/pythia-160m", "gpt_neox",
        dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
             vocab_size=50304, max_position_embeddings=2048,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
             layer_norm_eps=1e-5, tie_word_embeddings=False, use_parallel_residual=True),
        "no GQA (multi-head), partial rotary (25%), fused QKV with bias, parallel residual",
        hidden=768,
    ),
]

BY_NAME = {a.name: a for a in ARCHS}


def real_config(arch: Arch) -> Any:
    """The real model's transformers config (nothing is allocated)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(arch.model_type, **arch.real)


def small_config(arch: Arch) -> Any:
    """The test configuration: the real one with half the layers (fp32 keeps the real bf16
    bytes per token), a small hidden and MLP size and vocabulary, the head dim pinned to the
    real one, a shortened sliding window, and no end token (the tests generate a fixed count)."""
    from transformers import AutoConfig

    if arch.layers % 2:
        raise ValueError(f"{arch.name}: {arch.layers} layers cannot be halved")
    hidden = arch.hidden or HIDDEN
    kw = dict(arch.real)
    kw.update(
        num_hidden_layers=arch.layers // 2,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        vocab_size=VOCAB,
        eos_token_id=None,
        bos_token_id=1,
        pad_token_id=0,
    )
    kw["head_dim"] = arch.head_dim
    if arch.real_window is not None:
        kw["sliding_window"] = arch.window
    kw.update(arch.extra)
    cfg = AutoConfig.for_model(arch.model_type, **kw)
    return cfg


def slides(model: Any, max_len: int) -> bool:
    """Whether ``model`` has layers whose window slides within requests of ``max_len`` tokens
    (the engine's automatic prefix cache is refused for it: :mod:`kvvm.cache_groups`)."""
    from kvvm.attention import decoder_config
    from kvvm.cache_groups import layer_groups

    return any(g.sliding for g in layer_groups(decoder_config(model.config), max_len))


def build_model(arch: Arch, seed: int = 0) -> Any:
    """The test model in fp32, eval mode, its weights drawn from ``seed`` (the same weights
    in every process: CPU initialisation is deterministic)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = small_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=arch.attention)
    return model.eval()


def weights_digest(model: Any) -> str:
    """A digest of every parameter's bytes (two processes hold the same model iff equal)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Prompts:
    """The token counts an architecture's tests use, from its tokens per window."""

    #: A shared prompt prefix: at least a whole window and the start of the next (a token
    #: straddles its end where the window is not a whole number of tokens).
    prefix: int
    #: Each request's own tail after the prefix.
    tails: tuple[int, ...]
    #: Prompt lengths of the engine's requests (no shared prefix).
    lengths: tuple[int, ...]
    #: Tokens generated per request.
    new_tokens: int = 8


def prompts(arch: Arch) -> Prompts:
    """Prompt lengths for ``arch``: the prefix spans 1.6 windows (at least 24 tokens), the
    engine's prompts range from a few tokens to past the prefix's length."""
    per_window = tokens_per_window(arch.bytes_per_token())
    prefix = max(24, math.ceil(1.6 * per_window))
    return Prompts(prefix=prefix, tails=(3, 7, 12), lengths=(5, prefix // 2 + 1, prefix + 3, 9))


def tokens(count: int, seed: int, vocab: int = VOCAB) -> list[int]:
    """``count`` token ids drawn from ``seed`` (ids 3 and up: no special token)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count,), generator=g).tolist()
