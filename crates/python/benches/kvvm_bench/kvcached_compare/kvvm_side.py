"""kvvm's side, run in a child: give and take times (part a), bytes held around a burst
(part b), one instance growing until refused under a broker (part c)."""

from __future__ import annotations

import sys
import time
from typing import Any

from kvvm_bench.numerics import percentiles

from .common import READY, RESULT, _driver_free, _emit, _step, _time_give_take


def _kvvm_child(spec: dict[str, Any]) -> int:
    part = spec["part"]
    if spec["device"] == "cuda":
        import torch

        _step("torch.cuda.set_device(0), a CUDA tensor")
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")
    if part == "a":
        _emit(RESULT, _kvvm_give_take(spec))
    elif part == "b":
        _emit(RESULT, _kvvm_burst(spec))
    elif part == "c":
        _kvvm_pressure(spec)
    else:
        raise ValueError(f"unknown part {part!r}")
    return 0


def _kvvm_manager(spec: dict[str, Any], **kwargs: Any) -> Any:
    import kvvm

    if spec.get("pool_cap_bytes"):
        kwargs["pool_cap_bytes"] = spec["pool_cap_bytes"]
    _step(f"kvvm.Manager({spec['backend']!r})")
    return kvvm.Manager(spec["backend"], **kwargs)


def _kvvm_plan(spec: dict[str, Any], mgr: Any, max_tokens: int) -> Any:
    import kvvm

    geometry = kvvm.KvGeometry.preset(spec["model"], max_tokens)
    return kvvm.LayoutPlan(geometry, spec["layout"], mgr.granule)


def _kvvm_books(mgr: Any) -> dict[str, int]:
    s = mgr.snapshot()
    books = {"committed": s.committed, "pooled": s.pooled, "shared": s.shared, "quarantined": s.quarantined}
    books["held"] = sum(books.values())
    return books


def _kvvm_give_take(spec: dict[str, Any]) -> dict[str, Any]:
    """Part a on kvvm: per ``N`` and mode, ``ensure(N)`` and ``release()`` on one sequence."""
    import kvvm

    mgr = _kvvm_manager(spec)
    plan = _kvvm_plan(spec, mgr, max(spec["tokens"]))
    max_tokens = plan.geometry.max_tokens
    rows: list[dict[str, Any]] = []
    for n in spec["tokens"]:
        _step(f"reservations of {max_tokens} tokens")
        reserve = []
        for _ in range(spec["reps"]):
            began = time.perf_counter()
            seq = kvvm.Sequence(mgr, plan, max_tokens)
            reserve.append((time.perf_counter() - began) * 1e6)
            del seq
        for mode in ("cold", "warm"):
            _step(f"{mode} ensure({n}) / release()")
            seq = kvvm.Sequence(mgr, plan, max_tokens)

            def give(seq: Any = seq) -> str | None:
                try:
                    seq.ensure(n)
                except kvvm.KvvmError as e:
                    return f"{type(e).__name__}: {e}"
                return None

            timed = _time_give_take(
                spec, mode, cold=lambda: mgr.trim_pool(0), before=lambda: mgr.snapshot().pooled, give=give,
                take=seq.release,
            )
            del seq
            rows.append({
                "tokens": n, "mode": mode, "bytes": plan.committed_bytes_for_tokens(n),
                "give_us": timed["give_us"], "take_us": timed["take_us"], "reserve_us": percentiles(reserve),
                "pooled_bytes_before": timed["before"], "refused": timed["refused"],
            })
    mgr.trim_pool(0)
    return {"backend": mgr.backend, "granule": mgr.granule, "layout": plan.layout,
            "window_tokens": plan.mapped_tokens(1), "rows": rows}


def _kvvm_burst(spec: dict[str, Any]) -> dict[str, Any]:
    """Part b on kvvm: the burst, then the four readings."""
    import kvvm

    lengths: list[int] = spec["lengths"]
    mgr = _kvvm_manager(spec)
    plan = _kvvm_plan(spec, mgr, max(lengths))
    base = _driver_free(spec["device"])

    def reading() -> dict[str, Any]:
        free = _driver_free(spec["device"])
        return {"driver_held": None if base is None or free is None else base - free, **_kvvm_books(mgr)}

    _step(f"burst of {len(lengths)} requests")
    seqs = [kvvm.Sequence(mgr, plan, plan.geometry.max_tokens) for _ in lengths]
    refused = 0
    for seq, n in zip(seqs, lengths, strict=True):
        try:
            seq.ensure(n)
        except kvvm.KvvmError:
            refused += 1
    readings = {"peak": reading()}
    _step("every request finishes")
    for i in spec["order"]:
        seqs[i].release()
    readings["after_burst"] = reading()
    _step(f"idle {spec['idle_s']} s")
    time.sleep(spec["idle_s"])
    readings["after_idle"] = reading()
    _step("trim_pool(0)")
    mgr.trim_pool(0)
    readings["after_trim"] = reading()
    return {
        "backend": mgr.backend, "refused": refused, "readings": readings,
        "granted_bytes": sum(plan.committed_bytes_for_tokens(n) for n in lengths),
    }


def _kvvm_pressure(spec: dict[str, Any]) -> None:
    """Part c on kvvm: a manager leasing from the broker, then requests until refused."""
    import kvvm

    mgr = _kvvm_manager(spec, broker=spec["socket"], tenant=spec["tenant"], lease_batch_bytes=spec["lease_batch_bytes"])
    tokens = spec["request_tokens"]
    plan = _kvvm_plan(spec, mgr, tokens)
    _emit(READY)
    sys.stdin.readline()
    _step("requests until refused")
    seqs: list[Any] = []
    refusal: dict[str, Any] | None = None
    began = time.perf_counter()
    while len(seqs) < spec["max_requests"]:
        seq = kvvm.Sequence(mgr, plan, tokens)
        try:
            seq.ensure(tokens)
        except kvvm.KvvmError as e:
            refusal = {"type": type(e).__name__, "message": str(e)[:400],
                       "retry_after": getattr(e, "retry_after", None)}
            break
        seqs.append(seq)
    out = {
        "requests": len(seqs), "tokens": tokens, "seconds": round(time.perf_counter() - began, 3),
        "refusal": refusal, "books": _kvvm_books(mgr), "leased": mgr.leased_bytes, "lease": mgr.lease_stats,
    }
    _emit(RESULT, out)
    sys.stdin.readline()
    for seq in seqs:
        seq.release()


