"""The second process of the matrix's broker tests (:class:`model_checks.Peer` runs it): for
each request on stdin (one JSON object a line) it builds the matrix model, opens the prefix
another process published through the broker, attaches it to new requests that prefill
their own tails and decode greedily, serves the same prompts with an engine whose prefix
cache holds the opened prefix, lets go of everything and answers (one JSON line) with the
tokens, the hits and what its manager holds afterwards.

Request fields: ``arch``, ``seed``, ``socket``, ``tenant``, ``key``, ``max_len``,
``backend``, ``device``, ``prefix`` (the prefix's token ids), ``tails`` (each request's own
tokens after it; one length), ``engine_tails`` (the engine's requests' tails), ``new_tokens``;
optionally ``kv_dtype`` and ``kv_scales`` (passed to ``KvvmPrefix.open``; an FP8 prefix,
with them or without, is decoded and served with the dtype and scales it opened with, the
model attending with the kvvm attention).
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from typing import Any

MiB = 1 << 20


def serve(cmd: dict[str, Any]) -> dict[str, Any]:
    """One request: open, attach, decode, serve with the engine, let go."""
    import torch

    import kvvm
    import model_matrix
    from kvvm.engine import Engine
    from kvvm.transformers import KvvmCache, use_kvvm_attention
    from kvvm.prefix import KvvmPrefix
    from model_checks import greedy_after_prefix, snapshot_dict

    arch = model_matrix.BY_NAME[cmd["arch"]]
    model = model_matrix.build_model(arch, cmd["seed"]).to(cmd["device"])
    max_len = int(cmd["max_len"])
    prefix: list[int] = cmd["prefix"]
    new_tokens = int(cmd["new_tokens"])
    mgr = kvvm.Manager(cmd["backend"], broker=cmd["socket"], tenant=cmd["tenant"], lease_batch_bytes=4 * MiB)
    kv = {k: cmd[k] for k in ("kv_dtype", "kv_scales") if cmd.get(k) is not None}
    # The engine's own copy, made before the kvvm attention is switched on here (it switches
    # its model itself).
    engine_model = copy.deepcopy(model)
    opened = KvvmPrefix.open(model, cmd["key"], manager=mgr, max_cache_len=max_len, **kv)
    if opened.plan.geometry.dtype == "fp8":
        # Read as it opened: the published scales, whether passed here or not.
        use_kvvm_attention(model)
        kv = {"kv_dtype": "fp8_e4m3", "kv_scales": opened.kv_scales}
    n = opened.tokens
    cache = KvvmCache.from_prefix(opened, len(cmd["tails"]), max_len)
    billed = mgr.snapshot().shared
    attach = greedy_after_prefix(model, cache, [prefix[n:] + t for t in cmd["tails"]], n, new_tokens)
    cache.release()
    served: dict[str, Any] = {}
    if kv:
        served["probe_logits"] = probe_logits(model, opened, prefix, cmd["tails"], max_len)
    try:
        engine = Engine(
            engine_model, slots=len(cmd["engine_tails"]), max_len=max_len, manager=mgr,
            prefill_chunk=64, prefix_cache_bytes=64 * MiB, prefix_handle_tokens=1, compile=False, **kv,
        )
    except kvvm.InvalidArgumentError as refused:
        # A sliding model: its engine's prefix cache is refused, with the reason.
        served["engine_refused"] = str(refused)
    else:
        served["added"] = engine.add_prefix(prefix, opened)
        reqs = [engine.submit(prefix + t, new_tokens, eos_token_ids=[]) for t in cmd["engine_tails"]]
        engine.run()
        engine.close()
        served["engine"] = [r.tokens for r in reqs]
        served["hits"] = [r.prefix_hit_tokens for r in reqs]
    remaining = opened.close(cmd["key"])
    del opened, cache
    committed_after = snapshot_dict(mgr.snapshot())
    mgr.trim_pool(0)
    return {
        "digest": model_matrix.weights_digest(model),
        "opened_tokens": n,
        "billed_shared": int(billed),
        "attach": attach,
        **served,
        "remaining_users": remaining,
        "after_close": committed_after,
        "after_trim": snapshot_dict(mgr.snapshot()),
        "device": str(torch.device(cmd["device"])),
    }


def probe_logits(model: Any, opened: Any, prefix: list[int], tails: list[list[int]], max_len: int) -> list[list[float]]:
    """The last logits of each request's prefill after ``opened`` (a cache of its own):
    what an FP8 prefix read with the right scales gives, to the last bits."""
    import torch

    from kvvm.transformers import KvvmCache

    n = opened.tokens
    cache = KvvmCache.from_prefix(opened, len(tails), max_len)
    ids = torch.tensor([prefix[n:] + t for t in tails])
    pos = torch.arange(n, n + ids.shape[1])[None].expand(len(tails), -1)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
    out: list[list[float]] = logits.tolist()
    del logits
    cache.release()
    return out


def main() -> None:
    """Serves requests until stdin closes."""
    import torch

    torch.set_num_threads(1)
    for line in sys.stdin:
        try:
            reply = serve(json.loads(line))
        except Exception:  # reported to the test, which fails with it
            reply = {"error": traceback.format_exc()}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
