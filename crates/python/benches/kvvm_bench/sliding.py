"""A Gemma-3-shaped model decoding to 32k tokens: what its sliding-window layers hold and what a
step costs, KvvmCache against DynamicCache (``python -m kvvm_bench sliding``).

The model is built from a config with random weights (no download): Gemma 3 1B's layers by
default (26 layers, 5 local to 1 global, 4 query heads and 1 KV head of 256, a 512-token
window; ``--model gemma-3-4b``: 34 layers, 8 and 4 heads, a 1024-token window), bf16, all its
layers unless ``--layers`` says fewer. Every cache serves the same ``--batch`` requests of the
same random tokens, grown to each of ``--lengths`` in turn: prefilled (teacher-forced, in
chunks of ``--chunk``) to the length, then ``--steps`` greedy decode steps, timed one by one
on the GPU (an event before each), and the bytes held read after them. The caches:

- ``dynamic``: transformers' ``DynamicCache`` (its sliding layers keep their last
  ``window - 1`` tokens in tensors concatenated at every step), the model's SDPA attention,
  eager;
- ``kvvm-eager``: :class:`~kvvm.transformers.KvvmCache` with the kvvm attention, eager: the
  same model-level work as ``dynamic`` (no compilation), the cache and attention changed;
- ``kvvm-graph``: the same cache, its decode step compiled and captured once
  (:class:`~kvvm.graph.DecodeGraph`) and replayed at every length.

At each length, for each cache: decode step p50/p99 (ms), the KV bytes held (DynamicCache:
its tensors; KvvmCache: the physical bytes it holds, by layer group), the bytes every token of
every layer would take (what a cache keeping all of them holds), torch's peak allocation over
the steps above what was allocated before them (DynamicCache's concatenations live there),
and the greedy tokens' agreement with ``dynamic`` (up to the first difference; bf16 random
weights make near-ties common, so this is a sanity check, not a verdict).

``--tiny`` runs a small model of the same layer mix on any device (``--device cpu --backend
host``: what the tests do).
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

import kvvm
from kvvm_bench.numerics import percentiles
from kvvm_bench.report_file import write_report

__all__ = ["CACHES", "add_args", "run_sliding_bench"]

#: The caches the benchmark compares.
CACHES = ("dynamic", "kvvm-eager", "kvvm-graph")

#: Gemma 3's text decoders (the layers' shapes of the released configs).
MODELS: dict[str, dict[str, Any]] = {
    "gemma-3-1b": dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, vocab_size=262144,
        query_pre_attn_scalar=256, max_position_embeddings=32768,
    ),
    "gemma-3-4b": dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, sliding_window=1024, vocab_size=262208,
        query_pre_attn_scalar=256, max_position_embeddings=131072,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
}

#: ``--tiny``: Gemma 3 1B's layer (4 heads, 1 KV head of 256) and layer mix, small elsewhere.
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
    head_dim=256, sliding_window=64, vocab_size=256, query_pre_attn_scalar=256, max_position_embeddings=4096,
)


def add_args(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("--model", default="gemma-3-1b", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's; the 5:1 mix kept)")
    p.add_argument("--batch", type=int, default=4, help="requests decoded together")
    p.add_argument("--lengths", default="1024,4096,8192,16384,32768", help="context lengths measured, ascending")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed at each length")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens a forward)")
    p.add_argument("--caches", default=",".join(CACHES), help=f"comma-separated, of {CACHES}")
    p.add_argument("--headroom", type=int, default=4, help="the pre-committer's headroom tokens")
    p.add_argument("--tiny", action="store_true", help="a small model (CPU smoke run)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default="auto", help="kvvm backend (host on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")


def _config(args: argparse.Namespace) -> Any:
    from transformers import Gemma3TextConfig

    values = dict(TINY if args.tiny else MODELS[args.model])
    if args.layers:
        values["num_hidden_layers"] = args.layers
    cfg = Gemma3TextConfig(**values)
    cfg._attn_implementation = "sdpa"
    return cfg


def _build_model(args: argparse.Namespace) -> Any:
    from transformers import Gemma3ForCausalLM

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(args.seed)
        with torch.device(args.device):
            model: Any = Gemma3ForCausalLM(_config(args))
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).eval()


class _Clock:
    """Step times: an event (CUDA) or the host's clock (CPU, where a step is done when it
    returns) before each step and after the last."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def steps_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [round(a.elapsed_time(b), 4) for a, b in zip(self.marks, self.marks[1:])]
        return [round((b - a) * 1000, 4) for a, b in zip(self.marks, self.marks[1:])]


def _tensor_bytes(cache: Any) -> int:
    """What a DynamicCache's tensors hold."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class _Runner:
    """One cache growing ``batch`` requests: ``prefill`` to a length, ``decode`` greedy steps,
    ``held`` bytes."""

    def __init__(self, kind: str, model: Any, args: argparse.Namespace, max_len: int, manager: kvvm.Manager | None) -> None:
        from transformers import DynamicCache

        from kvvm.attention import use_kvvm_attention
        from kvvm.transformers import KvvmCache

        self.kind, self.model, self.device = kind, model, args.device
        use_kvvm_attention(model, enable=kind != "dynamic")
        self.cache: Any = (
            DynamicCache(config=model.config) if kind == "dynamic" else KvvmCache(model, args.batch, max_len, manager=manager)
        )
        self.length = 0
        self.graph: Any = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(self.length, self.length + ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.length += ids.shape[1]
        return out.logits[:, -1]

    def prefill(self, ids: torch.Tensor, chunk: int) -> torch.Tensor:
        logits = None
        for start in range(0, ids.shape[1], chunk):
            logits = self.forward(ids[:, start : start + chunk])
        assert logits is not None
        return logits

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        if self.kind == "kvvm-graph":
            if self.graph is None:
                from kvvm.graph import DecodeGraph

                self.graph = DecodeGraph(self.model, self.cache)
            self.length += 1
            return self.graph(tok)
        return self.forward(tok[:, None])

    def held(self) -> dict[str, Any]:
        if self.kind == "dynamic":
            return {"kv_bytes": _tensor_bytes(self.cache)}
        requests = range(self.cache.batch_size)
        groups = {
            ("sliding" if g.spec.sliding else "full"): sum(g.batch[i].owned_bytes for i in requests)
            for g in self.cache.groups
        }
        # The requests' bytes by layer group; the scratch slot's (a window a group) aside.
        return {"kv_bytes": self.cache.held_bytes, "by_group": groups}

    def close(self) -> None:
        from kvvm.attention import use_kvvm_attention

        if self.graph is not None:
            self.graph.close()
        if self.kind != "dynamic":
            self.cache.release()
        use_kvvm_attention(self.model, enable=False)


@torch.no_grad()
def _run_cache(kind: str, model: Any, args: argparse.Namespace, ids: torch.Tensor, lengths: list[int],
               manager: kvvm.Manager | None) -> dict[str, Any]:
    """One cache grown through every length (the decoded tokens stay in the context, the
    next prefill goes on from them); its rows, one per length."""
    cuda = args.device == "cuda"
    runner = _Runner(kind, model, args, lengths[-1] + args.steps + 16, manager)
    rows: list[dict[str, Any]] = []
    try:
        for length in lengths:
            tok = runner.prefill(ids[:, runner.length : length], args.chunk).argmax(-1)
            tokens = [tok]
            clock = _Clock(cuda)
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            for _ in range(args.steps):
                clock.mark()
                tok = runner.step(tok).argmax(-1)
                tokens.append(tok)
            clock.mark()
            row: dict[str, Any] = {"length": length, "step_ms": percentiles(clock.steps_ms()), **runner.held()}
            if cuda:
                row["torch_peak_over_before"] = torch.cuda.max_memory_allocated() - before
            row["tokens"] = torch.stack(tokens, dim=1).tolist()
            rows.append(row)
    except (torch.OutOfMemoryError, kvvm.KvvmError, RuntimeError) as e:
        rows.append({"note": f"{type(e).__name__}: {e}"[:300]})
    finally:
        runner.close()
        del runner
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if manager is not None:
            manager.trim_pool(0)
    return {"cache": kind, "rows": rows}


def _agreement(rows: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    """Each row's greedy tokens against the reference's at the same length, up to the first
    difference of each request."""
    for row, ref in zip(rows, reference, strict=False):
        if "tokens" not in row or "tokens" not in ref:
            continue
        same = total = 0
        for a, b in zip(row["tokens"], ref["tokens"], strict=True):
            for x, y in zip(a, b, strict=True):
                total += 1
                if x != y:
                    break
                same += 1
        row["greedy_agree_with_dynamic"] = round(same / max(total, 1), 4)


def run_sliding_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every cache through every length; returns the report (written after each cache)."""
    caches = [c for c in args.caches.split(",") if c]
    unknown = set(caches) - set(CACHES)
    if unknown:
        raise SystemExit(f"unknown caches {sorted(unknown)}; choose from {CACHES}")
    if "kvvm-graph" in caches and args.device != "cuda":
        caches.remove("kvvm-graph")  # a captured step needs CUDA
    lengths = sorted(int(x) for x in args.lengths.split(",") if x)
    model = _build_model(args)
    cfg = model.config
    manager = kvvm.Manager(args.backend, precommit=True, headroom_tokens=args.headroom)
    gen = torch.Generator().manual_seed(args.seed)
    base = torch.randint(0, cfg.vocab_size, (args.batch, lengths[-1] + args.steps + 1), generator=gen)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * (4 if args.device == "cpu" else 2)
    report: dict[str, Any] = {"meta": _meta(args, model, per_token), "runs": []}
    reference: list[dict[str, Any]] | None = None
    for kind in caches:
        run = _run_cache(kind, model, args, base.clone().to(args.device), lengths, None if kind == "dynamic" else manager)
        for row in run["rows"]:
            if "length" in row:
                row["every_token_bytes"] = per_token * args.batch * (row["length"] + args.steps)
        if kind == "dynamic":
            reference = run["rows"]
        elif reference is not None:
            _agreement(run["rows"], reference)
        report["runs"].append(run)
        write_report(args.json, report)
    for run in report["runs"]:
        for row in run["rows"]:
            row.pop("tokens", None)
    write_report(args.json, report)
    return report


def _meta(args: argparse.Namespace, model: Any, per_token: int) -> dict[str, Any]:
    import transformers

    cfg = model.config
    return {
        "model": "tiny" if args.tiny else args.model,
        "layers": cfg.num_hidden_layers,
        "sliding_layers": sum(t == "sliding_attention" for t in cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "batch": args.batch,
        "steps": args.steps,
        "chunk": args.chunk,
        "kv_bytes_per_token_every_layer": per_token,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvvm": kvvm.__version__,
    }
