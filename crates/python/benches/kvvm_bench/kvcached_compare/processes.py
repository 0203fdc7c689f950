"""The run's children: started in sessions of their own, their output watched for the
markers, a crash recorded with its signal, last step and output tails."""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

from .common import CTOR_DONE, RESULT, TAIL, _parse


#: The sessions of the children alive now (each child leads its own): killed if the run is.
_live: set[int] = set()


def _kill_session(pid: int, sig: signal.Signals = signal.SIGKILL) -> bool:
    """Signals a child's whole session; False once it is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


class _Child:
    """A child process in its own session: its stdout lines queued (the markers are found
    among what a library prints there), the tails of its output and the last step it
    announced kept."""

    def __init__(self, label: str, spec: dict[str, Any], env: dict[str, str], cwd: str) -> None:
        self.label = label
        self.began = time.monotonic()
        cmd = [sys.executable, "-X", "faulthandler", "-m", "kvvm_bench", "kvcached-worker", "--spec", json.dumps(spec)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, cwd=cwd, start_new_session=True,
        )
        _live.add(self.proc.pid)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.out: deque[str] = deque(maxlen=TAIL)
        self.err: deque[str] = deque(maxlen=TAIL)
        self.last_step: str | None = None
        self.ctor_done = False
        #: A result reported while another line was awaited (a failure before ``READY``).
        self.early_result: str | None = None
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True),
        ]
        for t in self.readers:
            t.start()

    def _read(self, stream: IO[str], is_stdout: bool) -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            if is_stdout:
                self.ctor_done |= line.startswith(CTOR_DONE)
                if not line.startswith(RESULT):
                    self.out.append(line)
                self.lines.put(line)
            else:
                if line.startswith("step: "):
                    self.last_step = line[len("step: "):]
                self.err.append(line)
        if is_stdout:
            self.lines.put(None)

    def send(self, line: str) -> None:
        """A line on the child's stdin (ignored once it is gone)."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def wait_for(self, prefix: str, timeout: float) -> str | None:
        """The rest of the first stdout line starting with ``prefix``; None if the child
        closed its stdout, reported its result instead (kept in :attr:`early_result`) or
        ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                self.lines.put(None)
                return None
            if line.startswith(prefix):
                return line[len(prefix):]
            if line.startswith(RESULT):
                self.early_result = line[len(RESULT):]
                return None

    def finish(self, timeout: float) -> dict[str, Any]:
        """Waits for the exit (the session killed after ``timeout``); what it left."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        killed = False
        try:
            self.proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            killed = True
            # SIGABRT first: the fault handler prints every thread's stack (where it hung).
            for sig, grace in ((signal.SIGABRT, 5.0), (signal.SIGKILL, None)):
                if not _kill_session(self.proc.pid, sig):
                    break
                try:
                    self.proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        _live.discard(self.proc.pid)
        for t in self.readers:
            t.join(timeout=5)
        rc = self.proc.returncode
        out: dict[str, Any] = {
            "exit_code": rc, "wall_s": round(time.monotonic() - self.began, 2), "last_step": self.last_step,
            "page_allocator_constructed": self.ctor_done, "stderr_tail": list(self.err), "stdout_tail": list(self.out),
        }
        if rc is not None and rc < 0:
            out["signal"] = _signal_name(-rc)
        if killed:
            out["timed_out_after_s"] = timeout
        return out


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _verdict(result: dict[str, Any] | None, end: dict[str, Any]) -> dict[str, Any]:
    """A child's record: its result when it reported one, how it ended, and why it counts as
    failed when it does."""
    ok = result is not None and "error" not in result
    record: dict[str, Any] = {"ok": ok, "result": result, **end}
    if result is None:
        record["failure"] = f"no result (exit {end['exit_code']}{', ' + end['signal'] if 'signal' in end else ''}, last step: {end['last_step']})"
    elif "error" in result:
        record["failure"] = f"{result['error']} (step: {result.get('step')})"
    if ok and end["exit_code"] != 0:
        record["note"] = f"reported its result, then ended with exit {end['exit_code']} {end.get('signal', '')} in step {end['last_step']!r}"
    return record


class _Run:
    """One run's settings and scratch directory: starts the children of either side."""

    def __init__(self, args: argparse.Namespace, tmp: str, geometry: dict[str, Any]) -> None:
        self.args = args
        self.tmp = tmp
        self.geometry = geometry
        self.tokens = [int(t) for t in args.tokens.split(",") if t]
        self.kvcached_skip = self._kvcached_skip()
        self.recipe: str | None = None

    def _kvcached_skip(self) -> str | None:
        if self.args.device != "cuda":
            return "skipped: kvcached needs a CUDA GPU"
        if not self.args.kvcached_dir:
            return "skipped: no --kvcached-dir"
        return None

    def spec(self, side: str, part: str, **extra: Any) -> dict[str, Any]:
        a = self.args
        return {
            "side": side, "part": part, "device": a.device, "backend": a.backend, "model": a.model,
            "layout": a.layout, "geometry": self.geometry, "tokens": self.tokens, "reps": a.reps,
            "settle_ms": a.settle_ms, "pool_cap_bytes": a.kvvm_pool_cap_bytes, "seed": a.seed, **extra,
        }

    def env(self, side: str, label: str, log_level: str = "WARNING") -> tuple[dict[str, str], str | None]:
        """A child's environment; for kvcached also the segment name it gets."""
        path = [p for p in sys.path if p]
        if side == "kvvm":
            return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}, None
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_") and k != "ENABLE_KVCACHED"}
        ipc = _ipc_name(label)
        env = {
            **base, "PYTHONPATH": os.pathsep.join([str(Path(self.args.kvcached_dir).resolve()), *path]),
            "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "KVCACHED_IPC_NAME": ipc,
            "KVCACHED_LOG_LEVEL": os.environ.get("KVCACHED_LOG_LEVEL", log_level), "KVCACHED_LOG_COLOR": "false",
            "ENABLE_KVCACHED": "false", "KVCACHED_AUTOPATCH": "0",
        }
        return env, ipc

    def start(self, side: str, label: str, spec: dict[str, Any], log_level: str = "WARNING") -> tuple[_Child, str | None]:
        if side == "kvcached":
            spec = {**spec, "recipe": spec.get("recipe", self.recipe)}
            extra = _recipe_env(spec["recipe"])
        else:
            extra = {}
        env, ipc = self.env(side, label, log_level)
        env.update(extra)
        return _Child(label, spec, env, self.tmp), ipc

    def run(
        self, side: str, label: str, spec: dict[str, Any], log_level: str = "WARNING", timeout: float | None = None
    ) -> dict[str, Any]:
        """One child to its end (killed after ``timeout``, default ``--worker-timeout``): its
        record."""
        child, ipc = self.start(side, label, spec, log_level)
        timeout = timeout or self.args.worker_timeout
        result = _parse(child.wait_for(RESULT, timeout))
        left = timeout - (time.monotonic() - child.began)
        record = _verdict(result, child.finish(left))
        if ipc:
            record["ipc_name"] = ipc
            _clean_ipc(ipc)
        return record


def _recipe_env(recipe: str) -> dict[str, str]:
    """The environment a recipe sets (every other KVCACHED_ variable is left unset)."""
    env = {"KVCACHED_CONTIGUOUS_LAYOUT": "true"}
    if recipe == "engine-libstdcxx":
        env["LD_PRELOAD"] = "libstdc++.so.6"
    if recipe == "engine-per-layer":
        env["KVCACHED_CONTIGUOUS_LAYOUT"] = "false"
    elif recipe == "engine-no-prealloc":
        env["KVCACHED_PAGE_PREALLOC_ENABLED"] = "false"
    return env


def _ipc_name(label: str) -> str:
    """A segment name of this run alone (kvcached keeps names to 64 safe characters)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", f"kvvmbench-{os.getpid()}-{label}")[:64]


def _clean_ipc(ipc: str) -> None:
    """Removes what a child of this run may have left under its own segment name: the
    segment (a crashed child does not unlink it) and kvcached's socket directory."""
    for path in [Path("/dev/shm") / ipc, *Path("/dev/shm").glob(f"{ipc}_g*")]:
        path.unlink(missing_ok=True)
    for path in Path("/tmp").glob(f"kvcached-tp-{ipc}-*"):
        shutil.rmtree(path, ignore_errors=True)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

