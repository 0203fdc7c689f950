"""The model the decode benchmarks run (``generate``, ``serve``, ``engines``): a Llama-architecture
model built from a config with random weights (:func:`build_model`)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

__all__ = ["build_model"]


def build_model(args: argparse.Namespace) -> Any:
    """A Llama-architecture model with random weights (no download): the Llama-3.1-8B shape,
    or a small one with ``args.tiny``; in bf16 on ``args.device`` (default CUDA), fp32 on a
    CPU; attending with SDPA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.tiny:
        cfg = LlamaConfig(
            hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=2048, max_position_embeddings=16384,
        )
    else:
        cfg = LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=16384,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        )
    cfg._attn_implementation = "sdpa"
    device = getattr(args, "device", "cuda")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    # Built in its dtype on its device: an 8B model never passes through fp32 (32 GB), so
    # that several processes can build theirs on one GPU at once.
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model: Any = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).eval()
