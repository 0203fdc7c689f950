"""The model the decode benchmarks run (``generate``, ``serve``, ``engines``): a Llama-architecture
model built from a config with random weights (:func:`build_model`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

__all__ = ["build_model", "product_choices", "unread_weight_bytes", "weight_bytes"]


def build_model(args: argparse.Namespace) -> Any:
    """A Llama-architecture model with random weights (no download): the Llama-3.1-8B shape,
    or a small one with ``args.tiny``; in bf16 on ``args.device`` (default CUDA), fp32 on a
    CPU; attending with SDPA (:func:`kvvm.serving.load.random_model`)."""
    from kvvm.serving.load import random_model

    device = getattr(args, "device", "cuda")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return random_model("tiny" if args.tiny else "llama-3.1-8b", device, dtype)


def weight_bytes(model: Any) -> int:
    """Every parameter's bytes: what the step floors the reports state count as read."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def unread_weight_bytes(model: Any, batch: int) -> int:
    """Bytes of ``weight_bytes`` a decode step of ``batch`` requests does not read: the input
    embedding table's rows but one a request (a step looks up its new tokens' rows only),
    unless the table is also the output head's weight (read whole for the logits). A floor
    counting every parameter is that much higher than one counting the bytes a step reads
    (1.05 GB of the Llama-3.1-8B shape's 16.06 GB)."""
    table = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is not None and head.weight.data_ptr() == table.data_ptr():
        return 0
    rows = max(table.shape[0] - batch, 0)
    return rows * table.shape[1] * table.element_size()


def product_choices() -> dict[str, str]:
    """What kvvm's tuned products chose per shape so far (``--tuned-products``,
    ``kvvm-graph-tuned``): cuBLAS (``"torch"``) or a kernel configuration; empty where no
    tuned product ran in this process."""
    products = sys.modules.get("kvvm.kernels.products")
    return products.tuned_product_choices() if products is not None else {}
