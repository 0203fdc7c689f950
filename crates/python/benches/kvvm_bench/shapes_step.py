"""The step part of ``python -m kvvm_bench shapes`` (:mod:`kvvm_bench.shapes`): a Llama-shaped
model of one attention shape decoding over a KvvmCache, its step captured as a
:class:`~kvvm.graph.DecodeGraph` (run eagerly without CUDA), its logits checked against
DynamicCache and, on CUDA, its replays timed against the HBM floor."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

import kvvm
from kvvm_bench.numerics import tie, timed_greedy_steps

__all__ = ["DTYPES", "EagerStep", "Shape", "StepResult", "run_step", "step_tokens"]

#: The dtypes a shape may have.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Shape:
    """One attention shape: ``heads`` query heads of ``head_dim``, ``gqa`` per KV head."""

    head_dim: int
    gqa: int
    dtype: str
    heads: int

    @property
    def kv_heads(self) -> int:
        return self.heads // self.gqa

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def step_tokens(sizes: dict[str, int]) -> int:
    """Tokens reserved per request by the step's cache (``max_cache_len``)."""
    return sizes["tokens"] + sizes["check_steps"] + sizes["steps"] + 64


@dataclass
class StepResult:
    """The decode step of one shape's model: its logits against the reference and its time."""

    layers: int
    hidden: int
    weight_bytes: int = 0
    live_kv_bytes: int | None = None
    max_abs_logit_diff: float | None = None
    argmax_agree: int | None = None
    argmax_checked: int | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    floor_ms: float | None = None
    over_floor: float | None = None
    floor_measured_ms: float | None = None
    over_measured_floor: float | None = None
    note: str = ""


class EagerStep:
    """What a :class:`~kvvm.graph.DecodeGraph` replays, run eagerly (a CUDA graph needs CUDA):
    the step prepared on the host, the forward, the step marked done."""

    def __init__(self, model: Any, cache: Any) -> None:
        self.model, self.cache = model, cache

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.cache.prepare(1)
        out = self.model(
            input_ids=tokens.view(-1, 1), position_ids=self.cache.state.positions(1), past_key_values=self.cache,
            use_cache=True, logits_to_keep=1,
        ).logits[:, -1]
        self.cache.step_done()
        return out

    def close(self) -> None:
        """Nothing to drop (no graph)."""


def _model(shape: Shape, sizes: dict[str, int], args: argparse.Namespace, device: torch.device) -> Any:
    """A Llama of the shape with random weights, built in its dtype on its device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvvm.transformers import use_kvvm_attention

    hidden = sizes["hidden"] or shape.heads * shape.head_dim
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=int(round(hidden * args.intermediate_ratio / 64)) * 64,
        num_hidden_layers=sizes["layers"], num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, vocab_size=sizes["vocab"], max_position_embeddings=sizes["tokens"] + 1024,
    )
    cfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(shape.torch_dtype)
    try:
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    # With a KvvmCache the kvvm attention; with a DynamicCache (the reference) it is SDPA.
    use_kvvm_attention(model)
    return model


def run_step(
    shape: Shape, sizes: dict[str, int], args: argparse.Namespace, device: torch.device, manager: kvvm.Manager,
    bandwidth: float, measured: float | None,
) -> StepResult:
    """The step of the shape's model at the point: checked, then timed (CUDA only). A
    failure (out of memory, a kernel that does not compile) is the result's note."""
    from kvvm.transformers import KvvmCache

    model = _model(shape, sizes, args, device)
    r = StepResult(sizes["layers"], model.config.hidden_size, sum(p.numel() * p.element_size() for p in model.parameters()))
    batch, tokens = sizes["batch"], sizes["tokens"]
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, sizes["vocab"], (1, tokens), generator=gen).to(device) for _ in range(batch)]
    cache = KvvmCache(model, batch, step_tokens(sizes), manager=manager)
    step: Any = None
    try:
        refs, ref = _prefill(model, cache, prompts)
        if device.type == "cuda":
            from kvvm.graph import DecodeGraph

            step = DecodeGraph(model, cache, compile=args.compile)
        else:
            step = EagerStep(model, cache)
        tok = _check(r, step, model, refs, ref, sizes["check_steps"], shape.torch_dtype)
        del refs
        if device.type == "cuda":
            _time(r, step, cache, tok, sizes["steps"], shape, bandwidth, measured)
        else:
            # The floor of one more step at the lengths reached.
            _floor(r, shape, sum(cache.state.host_lengths[:batch]) + batch, bandwidth, measured)
            r.note = "no CUDA: the step ran eagerly (no graph), not timed"
        cache.check()
    except (torch.OutOfMemoryError, kvvm.KvvmError, RuntimeError) as e:
        r.note = f"{type(e).__name__}: {e}"[:300]
    finally:
        if step is not None:
            step.close()
        cache.release()
    return r


@torch.no_grad()
def _prefill(model: Any, cache: Any, prompts: list[torch.Tensor]) -> tuple[list[Any], torch.Tensor]:
    """Every prompt into its own slot of ``cache`` and into a DynamicCache of its own;
    returns those and the reference's logits of each prompt's last token."""
    from transformers import DynamicCache

    refs, want = [], []
    for slot, prompt in enumerate(prompts):
        with cache.select(slot):
            model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        dc = DynamicCache(config=model.config)
        want.append(model(input_ids=prompt, past_key_values=dc, use_cache=True, logits_to_keep=1).logits[:, -1])
        refs.append(dc)
    return refs, torch.cat(want)


@torch.no_grad()
def _check(r: StepResult, step: Any, model: Any, refs: list[Any], ref: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Teacher-forced steps: each request's next token is the reference's argmax, the step's
    logits against the reference's. Returns the last step's tokens."""
    worst, agree, checked = 0.0, 0, 0
    tok = ref.argmax(-1)
    for _ in range(steps):
        out = step(tok).float()
        ref = torch.cat([
            model(input_ids=tok[j : j + 1, None], past_key_values=dc, use_cache=True).logits[:, -1] for j, dc in enumerate(refs)
        ]).float()
        worst = max(worst, (out - ref).abs().max().item())
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > tie(top2[:, 0], dtype)
        agree += int(((out.argmax(-1) == ref.argmax(-1)) & clear).sum())
        checked += int(clear.sum())
        tok = ref.argmax(-1)
    r.max_abs_logit_diff, r.argmax_agree, r.argmax_checked = round(worst, 4), agree, checked
    return tok


def _time(
    r: StepResult, step: Any, cache: Any, tok: torch.Tensor, steps: int, shape: Shape, bandwidth: float,
    measured: float | None,
) -> None:
    """``steps`` greedy replays, an event before each and after the last; the floor at the
    mean length the timed steps read."""
    before = sum(cache.state.host_lengths[: cache.batch_size])
    p = timed_greedy_steps(step, tok, steps)
    r.p50_ms, r.p99_ms = p.get("p50"), p.get("p99")
    # Step i (from 1) reads every request's tokens before it and its own new one.
    _floor(r, shape, before + cache.batch_size * (steps + 1) / 2, bandwidth, measured)


def _floor(r: StepResult, shape: Shape, tokens: float, bandwidth: float, measured: float | None) -> None:
    """The HBM floor of a step that reads every weight and ``tokens`` tokens' K/V, and the
    step's p50 over it."""
    per_token = 2 * r.layers * shape.kv_heads * shape.head_dim * torch.empty((), dtype=shape.torch_dtype).element_size()
    r.live_kv_bytes = round(per_token * tokens)
    step_bytes = r.weight_bytes + r.live_kv_bytes
    r.floor_ms = round(step_bytes / bandwidth * 1000, 4)
    r.over_floor = round(r.p50_ms / r.floor_ms, 2) if r.p50_ms else None
    if measured:
        r.floor_measured_ms = round(step_bytes / measured * 1000, 4)
        r.over_measured_floor = round(r.p50_ms / r.floor_measured_ms, 2) if r.p50_ms else None
