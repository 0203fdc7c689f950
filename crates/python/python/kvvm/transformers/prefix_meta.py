"""What a published :class:`~kvvm.transformers.KvvmPrefix` tells its readers besides where
its handles lie: the words its publisher passes as the prefix's ``meta``
(:meth:`kvvm.SharedPrefix.publish`) and an opener checks before it maps anything.

One line per layer group, ``kvvm-kv/1 dtype=<d> layers=<n> kv_heads=<n> head_dim=<n>
max_tokens=<n> layout=<l>`` and, for FP8, ``scales=<s>``: the group's geometry (its plan must be
the opener's) and the fp32 ``[layers, 2, kv_heads]`` scales the tokens were written with, as
``all:<hex float>`` (every scale equal), ``f32:<base64 of the little-endian fp32 bytes>`` (when
that fits the broker's room for a meta: 80 layers x 2 x 8 KV heads take 6828 characters), or
``sha256:<hex digest of those bytes>`` (more scales than fit: the opener must pass them, and
they must be the ones digested).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import numpy as np
import torch

from ..bindings import LayoutPlan
from ..errors import InvalidArgumentError
from ..kernels.fp8 import make_scales

__all__ = ["TAG", "describe", "Published"]

#: The first word of a prefix's reader words, with their version.
TAG = "kvvm-kv/1"

#: Characters of a meta kept for the KV layer's descriptor (at most 64 handles' offsets and
#: windows); the reader words have the rest of the broker's room.
DESCRIPTOR_ROOM = 2048

#: The geometry fields an opener's plan must agree with, as the plan reports them.
_GEOMETRY = ("dtype", "layers", "kv_heads", "head_dim", "max_tokens")


def _scale_bytes(scales: torch.Tensor) -> bytes:
    return bytes(scales.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes())


def _encode_scales(scales: torch.Tensor, room: int) -> str:
    """``scales`` as the value of ``scales=``: one value, every value, or a digest."""
    flat = scales.detach().to("cpu", torch.float32).flatten()
    if bool((flat == flat[0]).all()):
        return f"all:{float(flat[0]).hex()}"
    raw = _scale_bytes(scales)
    inline = "f32:" + base64.b64encode(raw).decode("ascii")
    if len(inline) <= room:
        return inline
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def describe(plan: LayoutPlan, kv_scales: Any, meta_bytes: int) -> str:
    """The reader words of a prefix laid out by ``plan`` (one layer group's) whose FP8 tokens
    were written with ``kv_scales`` (the ``[layers, 2, kv_heads]`` tensor; None unless FP8),
    within ``meta_bytes`` (the broker's room for a meta) less the descriptor's."""
    g = plan.geometry
    words = [TAG] + [f"{f}={getattr(g, f)}" for f in _GEOMETRY] + [f"layout={plan.layout}"]
    if g.dtype == "fp8":
        if kv_scales is None:
            raise InvalidArgumentError("an FP8 prefix is published with its kv_scales")
        head = " ".join(words) + " scales="
        words.append("scales=" + _encode_scales(kv_scales, meta_bytes - DESCRIPTOR_ROOM - len(head)))
    return " ".join(words)


class Published:
    """A prefix's reader words as its publisher wrote them (``""``: a publisher that wrote
    none, before them)."""

    def __init__(self, key: str, words: str) -> None:
        self.key = key
        self.fields: dict[str, str] = {}
        if not words:
            return
        parts = words.split()
        if parts[0] != TAG or not all("=" in p for p in parts[1:]):
            raise InvalidArgumentError(f"the prefix {key!r} carries reader words of another kind: {words[:120]!r}")
        self.fields = dict(p.split("=", 1) for p in parts[1:])

    @property
    def dtype(self) -> str | None:
        """The KV dtype the prefix holds, as a geometry names it (None: not said)."""
        return self.fields.get("dtype")

    def check(self, plan: LayoutPlan) -> None:
        """Refuses (``InvalidArgumentError``) a plan whose geometry or layout is not the
        publisher's: its bytes would be read as another shape."""
        g = plan.geometry
        for f in _GEOMETRY:
            if f in self.fields and self.fields[f] != str(getattr(g, f)):
                raise InvalidArgumentError(
                    f"the prefix {self.key!r} was published with {f}={self.fields[f]}; this opener's is "
                    f"{getattr(g, f)}" + (" (pass kv_dtype/dtype as published, or none)" if f == "dtype" else "")
                )
        if "layout" in self.fields and self.fields["layout"] != plan.layout:
            raise InvalidArgumentError(
                f"the prefix {self.key!r} was published with layout={self.fields['layout']}; "
                f"this opener's is {plan.layout}"
            )

    def scales(self, plan: LayoutPlan, passed: Any) -> torch.Tensor | None:
        """The scales to read an FP8 prefix with: the published ones; ``passed`` (the opener's
        ``kv_scales``, None: the published ones) must equal them, else
        ``InvalidArgumentError``. None for a prefix that is not FP8."""
        g = plan.geometry
        if g.dtype != "fp8":
            if passed is not None:
                raise InvalidArgumentError(f"kv_scales are an FP8 prefix's; this one holds {g.dtype}")
            return None
        value = self.fields.get("scales", "")
        kind, _, data = value.partition(":")
        mine = None if passed is None else make_scales(g.layers, g.kv_heads, passed, torch.device("cpu"))
        theirs: torch.Tensor | None
        if kind == "all":
            theirs = torch.full((g.layers, 2, g.kv_heads), float.fromhex(data), dtype=torch.float32)
        elif kind == "f32":
            raw = np.frombuffer(base64.b64decode(data, validate=True), dtype="<f4")
            if raw.size != g.layers * 2 * g.kv_heads:
                raise InvalidArgumentError(
                    f"the prefix {self.key!r} carries {raw.size} scales for {g.layers} x 2 x {g.kv_heads}"
                )
            theirs = torch.from_numpy(raw.astype(np.float32)).view(g.layers, 2, g.kv_heads)
        elif kind == "sha256":
            if mine is None:
                raise InvalidArgumentError(
                    f"the FP8 prefix {self.key!r} carries only a digest of its scales (too many to ride with it): "
                    "pass the publisher's kv_scales"
                )
            if hashlib.sha256(_scale_bytes(mine)).hexdigest() != data:
                raise InvalidArgumentError(f"kv_scales are not the ones the FP8 prefix {self.key!r} was written with")
            return mine
        else:
            raise InvalidArgumentError(
                f"the FP8 prefix {self.key!r} carries no scales it can be read with: {value[:60]!r}"
            )
        theirs = make_scales(g.layers, g.kv_heads, theirs, torch.device("cpu"))  # finite and positive
        if mine is not None and not torch.equal(mine, theirs):
            raise InvalidArgumentError(f"kv_scales are not the ones the FP8 prefix {self.key!r} was written with")
        return theirs
