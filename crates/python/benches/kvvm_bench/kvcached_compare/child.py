"""A child's entry point (``python -m kvvm_bench kvcached-worker``)."""

from __future__ import annotations

import argparse
import json
import traceback
from typing import Any

from .common import RESULT, _emit, _steps
from .kvcached_side import _kvcached_child
from .kvvm_side import _kvvm_child


def worker(args: argparse.Namespace) -> int:
    """One child: the part and side ``--spec`` names. Prints its result as one ``RESULT`` line,
    then shuts the library down (a crash in the shutdown leaves the result reported)."""
    spec: dict[str, Any] = json.loads(args.spec)
    try:
        if spec["side"] == "kvvm":
            return _kvvm_child(spec)
        return _kvcached_child(spec)
    except BaseException as e:  # every failure is reported, with the step it happened in
        _emit(RESULT, {"error": f"{type(e).__name__}: {e}", "step": _steps[-1] if _steps else None,
                       "traceback": traceback.format_exc().splitlines()[-12:]})
        return 1

