"""kvcached's side, run in a child: its allocator initialised by one recipe, then the same
parts as kvvm's, through its ``KVCacheManager``."""

from __future__ import annotations

import fcntl
import importlib
import os
import struct
import sys
import time
from typing import Any, Callable

from .common import (
    BLOCK_TOKENS,
    CTOR_ONLY,
    READY,
    RESULT,
    SHM_FIELDS,
    SHM_LAYOUT,
    _driver_free,
    _emit,
    _step,
    _time_give_take,
)


def _torch_dtype(name: str, size: int) -> Any:
    import torch

    named = {"bf16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16, "fp32": torch.float32, "f32": torch.float32}
    return named.get(name) or {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}[size]


def _kvcached_open(spec: dict[str, Any]) -> tuple[Any, Callable[[], Any], dict[str, Any]]:
    """Initialises kvcached as ``spec["recipe"]`` says; returns its ``KVCacheManager``, the call
    that shuts it down, and what the initialisation saw."""
    import torch

    recipe = spec["recipe"]
    g = spec["geometry"]
    layers, cell = g["layers"], g["kv_heads"] * g["head_dim"] * g["dtype_bytes"]
    block_bytes = BLOCK_TOKENS * cell
    device = "cuda:0"
    _step("torch.cuda.set_device(0)")
    torch.cuda.set_device(0)
    _step("torch.zeros(1, device='cuda:0'): the primary context current on this thread")
    torch.zeros(1, device=device)
    torch.cuda.synchronize()
    free, total = (int(x) for x in torch.cuda.mem_get_info())
    info: dict[str, Any] = {"recipe": recipe, "device_free_before_init": free, "device_total": total}
    began = time.perf_counter()
    _step("import kvcached")
    kvu: Any = importlib.import_module("kvcached.utils")
    info.update(page_size=kvu.PAGE_SIZE, contiguous_layout=kvu.CONTIGUOUS_LAYOUT,
                prealloc=kvu.PAGE_PREALLOC_ENABLED, ipc_name=kvu.DEFAULT_IPC_NAME,
                min_reserved_pages=kvu.MIN_RESERVED_PAGES, max_reserved_pages=kvu.MAX_RESERVED_PAGES,
                kvcached_file=importlib.import_module("kvcached").__file__)
    mgr: Any
    close: Callable[[], Any]
    if recipe.startswith("engine"):
        kvi: Any = importlib.import_module("kvcached.integration.vllm.interfaces")
        _step("interfaces.init_kvcached(tp_rank=0, world_size=1, is_worker=True, device='cuda:0')")
        kvi.init_kvcached(tp_rank=0, world_size=1, pp_rank=0, is_worker=True, device=device, async_sched=False)
        requested = max(1, total // (block_bytes * layers * 2))
        shape = (2, requested, BLOCK_TOKENS, g["kv_heads"], g["head_dim"])
        _step(f"interfaces.alloc_kv_cache({shape}, {BLOCK_TOKENS}, ..., num_layers={layers})")
        kvi.alloc_kv_cache(shape, BLOCK_TOKENS, _torch_dtype(g["dtype"], g["dtype_bytes"]), device, layers,
                           attention_type="MHA", return_meta=True)
        _kvcached_wait_tensors()
        _step("interfaces.get_kv_cache_manager(num_blocks=None)")
        mgr = kvi.get_kv_cache_manager(None, BLOCK_TOKENS, cell, layers, num_kv_buffers=2, group_id=0,
                                       pool_name="kvvm-bench")
        close = kvi.shutdown_kvcached
    elif recipe == "direct":
        vmm_ops: Any = importlib.import_module("kvcached.vmm_ops")
        kcm: Any = importlib.import_module("kvcached.kv_cache_manager")
        _step(f"vmm_ops.init_kvcached('cuda:0', {kvu.PAGE_SIZE}, {kvu.CONTIGUOUS_LAYOUT})")
        vmm_ops.init_kvcached(device, kvu.PAGE_SIZE, kvu.CONTIGUOUS_LAYOUT)
        per_buffer = total // layers // 2 // kvu.PAGE_SIZE * kvu.PAGE_SIZE
        _step(f"vmm_ops.create_kv_tensors({2 * per_buffer}, {g['dtype_bytes']}, 'cuda:0', {layers}, 2, 0, False)")
        vmm_ops.create_kv_tensors(2 * per_buffer, g["dtype_bytes"], device, layers, 2, 0, False)
        _kvcached_wait_tensors()
        _step("KVCacheManager(...)")
        direct = kcm.KVCacheManager(per_buffer // block_bytes, BLOCK_TOKENS, cell, layers, world_size=1,
                                    reserve_null_block=True, pool_name="kvvm-bench")

        def close_direct() -> None:
            direct.shutdown()
            vmm_ops.shutdown_kvcached()

        mgr, close = direct, close_direct
    else:
        raise ValueError(f"unknown recipe {recipe!r}")
    _step("the manager's background initialisation (null block, prealloc thread)")
    done = getattr(mgr, "_post_init_done", None)
    if done is not None and not done.wait(60):
        raise TimeoutError("KVCacheManager's background initialisation did not finish in 60 s")
    info.update(init_s=round(time.perf_counter() - began, 3), num_blocks=mgr.num_blocks,
                block_bytes=mgr.block_mem_size, manager_ipc_name=mgr.ipc_name,
                device_free_after_init=int(torch.cuda.mem_get_info()[0]))
    return mgr, close, info


def _kvcached_wait_tensors() -> None:
    vmm_ops: Any = importlib.import_module("kvcached.vmm_ops")
    _step("vmm_ops.kv_tensors_created()")
    deadline = time.monotonic() + 10
    while not vmm_ops.kv_tensors_created(0):
        if time.monotonic() > deadline:
            raise TimeoutError("kvcached's KV tensors were not created within 10 s")
        time.sleep(0.01)


def _shm_path(ipc_name: str) -> str:
    return ipc_name if ipc_name.startswith("/") else os.path.join("/dev/shm", ipc_name)


def _shm_read(ipc_name: str) -> dict[str, int] | None:
    """kvcached's segment for ``ipc_name``: its limit, used and mapped-ahead bytes."""
    try:
        with open(_shm_path(ipc_name), "rb") as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            data = f.read(struct.calcsize(SHM_LAYOUT))
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return None
    if len(data) < struct.calcsize(SHM_LAYOUT):
        return None
    return dict(zip(SHM_FIELDS, struct.unpack(SHM_LAYOUT, data), strict=True))


def _shm_set_limit(ipc_name: str, limit_bytes: int) -> bool:
    """Writes a new limit into kvcached's segment, under its lock (as ``kvctl limit`` does)."""
    try:
        with open(_shm_path(ipc_name), "r+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            f.write(struct.pack("=q", limit_bytes))
            f.flush()
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return False
    return True


def _kvcached_books(mgr: Any) -> dict[str, Any]:
    state = mgr.page_allocator.get_page_state()
    bundle = mgr.page_size * mgr.num_layers * mgr.num_kv_buffers
    inuse, reserved = int(state["inuse_pages"]), int(state["reserved_pages"])
    return {
        "total_pages": int(state["total_pages"]), "inuse_pages": inuse, "reserved_pages": reserved,
        "page_bundle_bytes": bundle, "held": (inuse + reserved) * bundle, "segment": _shm_read(mgr.ipc_name),
    }


def _kvcached_child(spec: dict[str, Any]) -> int:
    if spec["recipe"] == CTOR_ONLY:
        _emit(RESULT, _kvcached_ctor_only(spec))
        return 0
    mgr, close, info = _kvcached_open(spec)
    part = spec["part"]
    if part == "probe":
        _step("alloc(1)")
        ids = mgr.alloc(1)
        if ids is None:
            raise RuntimeError("alloc(1) returned None right after initialisation")
        _step("free")
        mgr.free(ids)
        out: dict[str, Any] = {"init": info, "books": _kvcached_books(mgr)}
    elif part == "a":
        out = {"init": info, "rows": _kvcached_give_take(mgr, spec)}
    elif part == "b":
        out = {"init": info, **_kvcached_burst(mgr, spec)}
    elif part == "c":
        _kvcached_pressure(mgr, spec, info)
        out = {}
    else:
        raise ValueError(f"unknown part {part!r}")
    if out:
        _emit(RESULT, out)
    _step("shutdown")
    close()
    _step("exit")
    return 0


def _kvcached_ctor_only(spec: dict[str, Any]) -> dict[str, Any]:
    """The C++ ``PageAllocator`` alone: built, read, its segment released; no CUDA call."""
    vmm_ops: Any = importlib.import_module("kvcached.vmm_ops")
    g = spec["geometry"]
    page = 2 << 20
    _step("vmm_ops.PageAllocator(...) with no CUDA initialised")
    alloc = vmm_ops.PageAllocator(g["layers"], 64 * page, page, world_size=1, pp_rank=0, async_sched=False,
                                  contiguous_layout=True, enable_page_prealloc=False, num_kv_buffers=2,
                                  group_id=0, ipc_name=os.environ["KVCACHED_IPC_NAME"])
    _step("get_page_state")
    state = dict(alloc.get_page_state())
    segment = _shm_read(os.environ["KVCACHED_IPC_NAME"])
    _step("release_shared_segment")
    return {"page_state": state, "segment": segment, "released": bool(alloc.release_shared_segment())}


def _kvcached_give_take(mgr: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Part a on kvcached: per ``N`` and mode, ``alloc`` and ``free`` of its blocks."""
    rows: list[dict[str, Any]] = []
    bundle = mgr.page_size * mgr.num_layers * mgr.num_kv_buffers
    for n in spec["tokens"]:
        blocks = -(-n // BLOCK_TOKENS)
        for mode in ("cold", "warm"):
            _step(f"{mode} alloc({blocks}) / free")
            held: list[Any] = []

            def give(blocks: int = blocks, held: list[Any] = held) -> str | None:
                ids = mgr.alloc(blocks)
                if ids is None:
                    return f"alloc({blocks}) returned None (available {mgr.available_size()} blocks)"
                held.append(ids)
                return None

            def take(held: list[Any] = held) -> None:
                mgr.free(held.pop())

            timed = _time_give_take(
                spec, mode, cold=mgr.trim, before=lambda: int(mgr.page_allocator.get_num_reserved_pages()),
                give=give, take=take,
            )
            rows.append({
                "tokens": n, "mode": mode, "blocks": blocks,
                "bytes": -(-blocks * mgr.block_mem_size // mgr.page_size) * bundle,
                "give_us": timed["give_us"], "take_us": timed["take_us"],
                "reserved_pages_before": timed["before"], "refused": timed["refused"],
            })
    return rows


def _kvcached_burst(mgr: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Part b on kvcached: the burst, then the four readings."""
    lengths: list[int] = spec["lengths"]
    _kvcached_quiesce(mgr)
    base = _driver_free("cuda")

    def reading() -> dict[str, Any]:
        free = _driver_free("cuda")
        return {"driver_held": None if base is None or free is None else base - free, **_kvcached_books(mgr)}

    start = reading()
    _step(f"burst of {len(lengths)} requests")
    held: list[Any] = []
    refused = 0
    for n in lengths:
        ids = mgr.alloc(-(-n // BLOCK_TOKENS))
        if ids is None:
            refused += 1
        held.append(ids)
    readings = {"start": start, "peak": reading()}
    _step("every request finishes")
    for i in spec["order"]:
        if held[i] is not None:
            mgr.free(held[i])
    readings["after_burst"] = reading()
    _step(f"idle {spec['idle_s']} s")
    time.sleep(spec["idle_s"])
    readings["after_idle"] = reading()
    _step("trim()")
    mgr.trim()
    readings["after_trim"] = reading()
    bundle = mgr.num_layers * mgr.num_kv_buffers
    return {"refused": refused, "readings": readings,
            "granted_bytes": sum(-(-n // BLOCK_TOKENS) for n in lengths) * mgr.block_mem_size * bundle}


def _kvcached_quiesce(mgr: Any) -> None:
    """Waits (3 s at most) until the pages kvcached maps ahead stop changing for 0.2 s: its
    background thread done with what the initialisation asked of it."""
    deadline = time.monotonic() + 3
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = int(mgr.page_allocator.get_num_reserved_pages())
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.2:
            return
        time.sleep(0.02)


def _kvcached_limit(mgr: Any, limit_bytes: int) -> dict[str, Any]:
    """Applies an instance limit the way an operator does: written into the instance's
    segment, seen by its resize watcher, applied by its next allocation (an empty one here).
    Without a watcher (no prealloc thread) ``KVCacheManager.set_memory_limit`` applies it."""
    per_buffer = limit_bytes // mgr.num_layers // mgr.num_kv_buffers
    pages = per_buffer // mgr.page_size
    out: dict[str, Any] = {"limit_bytes": limit_bytes, "target_pages": pages}
    _step(f"limit {limit_bytes} bytes written into /dev/shm/{mgr.ipc_name}")
    if _shm_set_limit(mgr.ipc_name, limit_bytes):
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and mgr.page_allocator.get_resize_target() != per_buffer:
            time.sleep(0.02)
        mgr.alloc(0)
        if int(mgr.page_allocator.get_num_total_pages()) == pages:
            out["applied_via"] = "segment"
            return out
    _step("KVCacheManager.set_memory_limit")
    out["applied_via"] = "set_memory_limit"
    out["state"] = mgr.set_memory_limit(limit_bytes, revision=1)
    out["total_pages"] = int(mgr.page_allocator.get_num_total_pages())
    return out


def _kvcached_pressure(mgr: Any, spec: dict[str, Any], info: dict[str, Any]) -> None:
    """Part c on kvcached: the limit applied, then requests until refused."""
    limit = _kvcached_limit(mgr, spec["limit_bytes"]) if spec["limit_bytes"] > 0 else None
    _emit(READY)
    sys.stdin.readline()
    blocks = -(-spec["request_tokens"] // BLOCK_TOKENS)
    _step(f"requests of {blocks} blocks until refused")
    held: list[Any] = []
    refusal: dict[str, Any] | None = None
    began = time.perf_counter()
    while len(held) < spec["max_requests"]:
        try:
            ids = mgr.alloc(blocks)
        except Exception as e:  # recorded as the refusal: what a caller would have to handle
            refusal = {"type": type(e).__name__, "message": str(e)[:400]}
            break
        if ids is None:
            refusal = {"type": "None", "available_blocks": int(mgr.available_size()),
                       "physical_pages_available": int(mgr.page_allocator.get_avail_physical_pages())}
            break
        held.append(ids)
    _emit(RESULT, {
        "init": info, "limit": limit, "requests": len(held), "tokens": spec["request_tokens"],
        "seconds": round(time.perf_counter() - began, 3), "refusal": refusal, "books": _kvcached_books(mgr),
        "device_free": _driver_free("cuda"),
    })
    sys.stdin.readline()
    _step("every request finishes")
    for ids in held:
        mgr.free(ids)

