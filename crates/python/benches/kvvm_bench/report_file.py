"""Where a benchmark's report goes: the ``--json`` file, rewritten whole each time (after each
part or run of the longer benchmarks, so that one cut short keeps what it measured)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_report"]


def write_report(path: str | None, report: dict[str, Any]) -> None:
    """Writes ``report`` as JSON to ``path``; nothing without one."""
    if path:
        Path(path).write_text(json.dumps(report, indent=1))
