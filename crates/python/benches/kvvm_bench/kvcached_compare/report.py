"""The report as text: one table per part."""

from __future__ import annotations

from typing import Any


def _gib(x: Any) -> str:
    return f"{x / 2**30:.3f}" if isinstance(x, int | float) else "-"


def _pq(d: Any, key: str) -> str:
    v = d.get(key) if isinstance(d, dict) else None
    return f"{v:.1f}" if isinstance(v, int | float) else "-"


def _why(side: Any) -> str:
    """Why a side has no figures: skipped or failed."""
    if not isinstance(side, dict):
        return "-"
    return str(side.get("skipped") or side.get("failure") or "")


def table(report: dict[str, Any]) -> str:
    """The report as text: one table per part measured."""
    out: list[str] = []
    init = report.get("kvcached_init") or {}
    if init.get("attempts"):
        out.append("kvcached initialisation:")
        for at in init["attempts"]:
            out.append(f"  {at['recipe']:>20}: " + ("ok" if at.get("ok") else at.get("failure", "")))
    gt = report.get("give_take")
    if gt:
        out.append("a: give N tokens and take them back, us (p50 / p99)")
        out.append(f"  {'tokens':>7} {'side':>9} {'mode':>5} {'give p50':>10} {'give p99':>10} {'take p50':>10} {'take p99':>10}  held GiB")
        for side in ("kvvm", "kvcached"):
            rec = gt.get(side) or {}
            res = rec.get("result") or {}
            rows = res.get("rows") or []
            if not rows:
                out.append(f"  {'':>7} {side:>9}: {_why(rec)}")
            for r in rows:
                line = (f"  {r['tokens']:>7} {side:>9} {r['mode']:>5} {_pq(r['give_us'], 'p50'):>10} {_pq(r['give_us'], 'p99'):>10} "
                        f"{_pq(r['take_us'], 'p50'):>10} {_pq(r['take_us'], 'p99'):>10}  {_gib(r.get('bytes'))}")
                out.append(line + (f"  refused: {r['refused']}" if r.get("refused") else ""))
    fp = report.get("footprint")
    if fp:
        out.append(f"b: bytes held around a burst of {fp['requests']} requests (live at the peak {_gib(fp['live_bytes'])} GiB), GiB")
        out.append(f"  {'side':>9} {'reading':>12} {'driver':>9} {'library':>9}")
        for side in ("kvvm", "kvcached"):
            rec = fp.get(side) or {}
            readings = (rec.get("result") or {}).get("readings") or {}
            if not readings:
                out.append(f"  {side:>9}: {_why(rec)}")
            for name, r in readings.items():
                out.append(f"  {side:>9} {name:>12} {_gib(r.get('driver_held')):>9} {_gib(r.get('held')):>9}")
    pr = report.get("pressure")
    if pr:
        out.append(f"c: two instances, requests of {pr['tokens_per_request']} tokens until refused (budget {_gib(pr['budget_bytes'])} GiB)")
        for side in ("kvvm", "kvcached"):
            rec = pr.get(side) or {}
            if "instances" not in rec:
                out.append(f"  {side:>9}: {_why(rec)}")
                continue
            for i, inst in enumerate(rec["instances"]):
                res = inst.get("result") or {}
                refusal = res.get("refusal") or {}
                out.append(
                    f"  {side:>9} #{i}: {res.get('requests', '-')} requests, held {_gib((res.get('books') or {}).get('held'))} GiB, "
                    f"refused by {refusal.get('type', '-')}, exit {inst.get('exit_code')} {inst.get('signal', '')}"
                    + (f"; {inst['failure']}" if inst.get("failure") else "")
                )
            out.append(f"  {side:>9}: held in all {_gib(rec.get('library_held_total'))} GiB by the books; "
                       f"device free while both hold {_gib((rec.get('held_while_both_hold') or {}).get('device_free'))} GiB")
    for t in report.get("kvcached_tests") or []:
        out.append(f"kvcached {t['file']}: exit {t.get('exit_code')} {t.get('summary', t.get('failure', ''))}")
    return "\n".join(out)


