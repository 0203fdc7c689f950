"""What the benchmarks that run several processes read off the node: the device's free memory
as the driver reports it to a process holding no CUDA context (``nvidia-smi``), and a
``kvvm broker``'s metrics file."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["broker_metrics", "smi_free_bytes"]


def smi_free_bytes(device: str = "cuda", gpu: int = 0) -> int | None:
    """GPU ``gpu``'s free bytes from ``nvidia-smi`` (so that the process asking holds no CUDA
    context of its own), or None on a CPU or when ``nvidia-smi`` cannot tell."""
    if device != "cuda":
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", str(gpu)],
            capture_output=True, text=True, check=False, timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = out.stdout.strip()
    return int(text) << 20 if out.returncode == 0 and text.isdigit() else None


def broker_metrics(path: Path, names: tuple[str, ...] = ("kvvm_broker_",)) -> dict[str, float]:
    """The samples of a broker's Prometheus metrics file whose names start with one of
    ``names`` (every broker metric by default), by their full name and labels; empty when
    the file is not there yet."""
    out: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith(names):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
    return out
