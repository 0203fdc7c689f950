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
    CPU; attending with SDPA (:func:`kvvm.serving.load.random_model`)."""
    from kvvm.serving.load import random_model

    device = getattr(args, "device", "cuda")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return random_model("tiny" if args.tiny else "llama-3.1-8b", device, dtype)
