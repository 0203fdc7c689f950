"""What both sides' children and the run share: the markers a child prints, kvcached's
initialisation recipes and ``/dev/shm`` layout, the steps a child announces."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

from kvvm_bench.numerics import percentiles

BLOCK_TOKENS = 16
#: How a child's result line starts on its stdout (kvcached prints there too).
RESULT = "RESULT "
#: The line a child of part ``c`` prints once set up, before it waits for ``go``.
READY = "READY"
#: The line kvcached's C++ ``PageAllocator`` constructor prints as its last statement
#: (``csrc/page_allocator.cpp``): seen, the constructor returned.
CTOR_DONE = "Init C++ PageAllocator"
#: kvcached's initialisation recipes, in the order they are tried by default:
#:
#: * ``engine``: what its vLLM worker does: ``torch.cuda.set_device``, a CUDA tensor (the
#:   primary context current on this thread), ``interfaces.init_kvcached(is_worker=True)``,
#:   ``interfaces.alloc_kv_cache`` (the KV tensors: a reservation of the whole device),
#:   ``interfaces.get_kv_cache_manager(num_blocks=None)`` (the capacity of those tensors, a
#:   null block reserved), then its background initialisation awaited. Contiguous layout.
#: * ``engine-libstdcxx``: ``engine`` with the process's shared ``libstdc++.so.6`` preloaded
#:   (``LD_PRELOAD``). Built with the GPU machine's torch 2.11 and g++ 13, kvcached's ``_C``
#:   extension lists no ``libstdc++`` among its dependencies and carries copies of the
#:   library's stream code; the first number its ``PageAllocator`` constructor writes to
#:   ``std::cout`` goes through its own copy of ``ostream::_M_insert<long>`` with the locale the
#:   shared library built, and faults (SIGSEGV; seen on the H200, 2026-12-02, with a backtrace).
#:   Preloaded, the shared library comes first in the global scope and the extension's calls
#:   bind to it.
#: * ``engine-per-layer``: the same with ``KVCACHED_CONTIGUOUS_LAYOUT=false``.
#: * ``engine-no-prealloc``: the same with ``KVCACHED_PAGE_PREALLOC_ENABLED=false`` (no
#:   background thread mapping pages ahead, no resize watcher).
#: * ``direct``: no vLLM module: ``vmm_ops.init_kvcached``, ``vmm_ops.create_kv_tensors``
#:   sized as ``alloc_kv_cache`` sizes them, a ``KVCacheManager`` built directly.
RECIPES = ("engine", "engine-libstdcxx", "engine-per-layer", "engine-no-prealloc", "direct")
#: A recipe that builds the C++ ``PageAllocator`` alone, with no CUDA initialised (what
#: kvcached's own ``test_page_allocator_snapshot.py`` does): tried by ``--kvcached-diagnose``.
CTOR_ONLY = "ctor-only"
#: kvcached's tests that drive its allocator on a GPU without an engine.
DEFAULT_TESTS = (
    "tests/test_vmm_transaction.py",
    "tests/test_contiguous_layout_default.py",
    "tests/test_page_allocator_snapshot.py",
    "tests/test_prealloc_gil_deadlock.py",
    "tests/test_page_allocator_resize.py",
    "tests/test_kvcache_manager.py",
    "tests/test_vmm_failure_policy.py",
)
#: Lines of a child's stdout and stderr kept for the report (a fault handler's stacks fit).
TAIL = 60
#: The three int64 fields of kvcached's ``/dev/shm`` segment (``csrc/inc/mem_info_tracker.hpp``):
#: the limit, the bytes in use, the bytes mapped ahead.
SHM_FIELDS = ("total_size", "used_size", "prealloc_size")
SHM_LAYOUT = "=3q"

_steps: list[str] = []


def _step(name: str) -> None:
    """Announces a step on stderr before taking it: the last one announced before a crash
    says where it happened."""
    _steps.append(name)
    print(f"step: {name}", file=sys.stderr, flush=True)


def _emit(prefix: str, payload: dict[str, Any] | None = None) -> None:
    line = prefix if payload is None else prefix + json.dumps(payload, default=str)
    print(line, flush=True)


def _settle(spec: dict[str, Any]) -> None:
    if spec["settle_ms"] > 0:
        time.sleep(spec["settle_ms"] / 1000)


def _driver_free(device: str) -> int | None:
    """The device's free bytes as the driver reports them (this process's view), or None on
    a CPU."""
    if device != "cuda":
        return None
    import torch

    return int(torch.cuda.mem_get_info()[0])


def _parse(payload: str | None) -> dict[str, Any] | None:
    if payload is None:
        return None
    try:
        parsed = json.loads(payload)
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _median_int(xs: list[int]) -> int | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def _time_give_take(
    spec: dict[str, Any], mode: str, cold: Callable[[], object], before: Callable[[], int],
    give: Callable[[], str | None], take: Callable[[], object],
) -> dict[str, Any]:
    """One point of part a, the same on both sides: ``spec["reps"]`` timed repetitions, after
    one warm-up, of ``give`` then ``take``, each after the settle pause and, in mode
    ``cold``, ``cold()`` (the library's pool emptied). ``give`` returns why it was refused, or
    None; the first refusal stops the repetitions. Returns the p50/p99 of each (us), the
    median of ``before()`` read before each give, and the refusal."""
    gives: list[float] = []
    takes: list[float] = []
    readings: list[int] = []
    refused = None
    for rep in range(spec["reps"] + 1):
        _settle(spec)
        if mode == "cold":
            cold()
        reading = before()
        began = time.perf_counter()
        refused = give()
        if refused is not None:
            break
        mid = time.perf_counter()
        take()
        end = time.perf_counter()
        if rep:
            gives.append((mid - began) * 1e6)
            takes.append((end - mid) * 1e6)
            readings.append(reading)
    return {"give_us": percentiles(gives), "take_us": percentiles(takes), "before": _median_int(readings),
            "refused": refused}
