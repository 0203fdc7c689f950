"""The checks the model matrix runs on every architecture, written once for the matrix, the
shared-prefix acceptance test, the real-weights test and the peer process of the broker
tests: greedy references on transformers' own DynamicCache, greedy decoding after a shared
prefix on a :class:`~kvvm.transformers.KvvmCache`, the engine, a manager that holds
nothing, and the second process a prefix is published to (:class:`Peer`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kvvm

MiB = 1 << 20
HERE = Path(__file__).resolve().parent


def reference_greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt alone (one request at a time) through ``generate`` on transformers'
    DynamicCache: the greedy tokens after it (up to an end token of the model's, if it
    names one, included)."""
    import torch
    from transformers import DynamicCache

    out = []
    device = next(model.parameters()).device
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            got = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=DynamicCache(config=model.config),
                max_new_tokens=new_tokens,
                do_sample=False,
            )
        out.append(got[0, len(p) :].tolist())
    return out


def greedy_after_prefix(model: Any, cache: Any, suffixes: list[list[int]], start: int, new_tokens: int) -> list[list[int]]:
    """Every request of ``cache`` (one per suffix, all at ``start`` live tokens: a cache made
    by ``KvvmCache.from_prefix``) prefills its own ``suffix`` (all of one length), then
    decodes ``new_tokens`` greedy tokens, in one batch."""
    import torch

    if len({len(s) for s in suffixes}) != 1:
        raise ValueError("the suffixes must have one length")
    device = next(model.parameters()).device
    ids = torch.tensor(suffixes, device=device)
    n = ids.shape[1]
    pos = torch.arange(start, start + n, device=device)[None].expand(len(suffixes), -1)
    generated: list[list[int]] = [[] for _ in suffixes]
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
        for step in range(new_tokens):
            tok = logits.argmax(-1)
            for row, t in zip(generated, tok.tolist(), strict=True):
                row.append(int(t))
            if step == new_tokens - 1:
                break
            at = torch.full((len(suffixes), 1), start + n + step, device=device)
            logits = model(input_ids=tok[:, None], position_ids=at, past_key_values=cache, use_cache=True).logits[:, -1]
    return generated


def holds_nothing(mgr: kvvm.Manager) -> kvvm.MemorySnapshot:
    """Asserts ``mgr`` maps, shares and quarantines nothing, gives its pool back, and then
    holds nothing at all (``used == 0``); returns the last snapshot."""
    snap = mgr.snapshot()
    assert (snap.committed, snap.shared, snap.quarantined) == (0, 0, 0), snap
    mgr.trim_pool(0)
    snap = mgr.snapshot()
    assert snap.used == 0, snap
    return snap


def snapshot_dict(snap: kvvm.MemorySnapshot) -> dict[str, int]:
    """A snapshot's counts (for a reply of the peer)."""
    return {k: int(getattr(snap, k)) for k in ("used", "committed", "pooled", "shared", "quarantined")}


def run_broker(socket: Path, *flags: str) -> Iterator[Path]:
    """``kvvm broker`` on ``socket`` until the generator is closed (SIGTERM, exit 0 expected)."""
    import pytest
    from conftest import kvvm_binary

    binary = kvvm_binary()
    if binary is None:
        pytest.skip("skipped: no kvvm binary (cargo build --release -p kvvm-cli, or set KVVM_BIN)")
    daemon = subprocess.Popen(
        [binary, "broker", "--socket", str(socket), *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert daemon.stdout is not None
    line = daemon.stdout.readline()
    assert "listening on" in line, (line, daemon.stderr.read() if daemon.poll() is not None and daemon.stderr else "")
    try:
        yield socket
    finally:
        daemon.terminate()
        assert daemon.wait(timeout=20) == 0


class PeerDied(AssertionError):
    """The peer process died while it served a request (a signal: ``SIGSEGV`` is a write
    into read-only memory on the host backend)."""


class Peer:
    """A second Python process (``model_peer.py``) that opens prefixes this process
    published through the broker and decodes after them: one JSON request a line on its
    stdin, one JSON reply a line on its stdout. Started on first use, and again after it
    died (a test that kills it fails; the next one gets a new process)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.stderr: Any = None

    def _start(self) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
        # Its stderr goes to a file, read when it dies: a pipe nobody drains would block the
        # peer once its warnings filled it.
        if self.stderr is not None:
            self.stderr.close()
        self.stderr = tempfile.TemporaryFile(mode="w+")
        return subprocess.Popen(
            [sys.executable, str(HERE / "model_peer.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
        )

    def request(self, command: dict[str, Any]) -> dict[str, Any]:
        """Sends ``command``; returns the reply (raises :class:`PeerDied` with the signal and
        the peer's stderr when it died, AssertionError with its traceback when it failed)."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait(timeout=30)
            self.stderr.seek(0)
            err = self.stderr.read()
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
            self.proc = None
            raise PeerDied(f"the peer process died ({how}) serving {command.get('arch')}: {err[-2000:]}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise AssertionError(f"the peer failed: {reply['error']}")
        return reply

    def close(self) -> None:
        """Ends the peer (EOF on its stdin) and waits for it."""
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.proc = None
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None
