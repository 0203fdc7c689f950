"""FP8 KV: K and V held as 8-bit floats (OCP e4m3, ``torch.float8_e4m3fn``), one byte an
element instead of two.

A value ``x`` of K (or V) of KV head ``h`` in layer ``l`` is stored as ``quantize(x) =
round_e4m3(clamp(x / s[l, h], -448, 448))`` and read back as ``q * s[l, h]``: the scales
(``s``, fp32, one for K and one for V per layer and KV head) are fixed for a cache's life, as
vLLM's ``k_scale``/``v_scale`` are. e4m3 keeps 3 mantissa bits: a value within its normal
range (``2**-6 * s`` to ``448 * s``) comes back within a relative ``2**-4`` (half a unit in
the last place), a smaller one within an absolute ``2**-10 * s`` (its subnormals), a larger
one saturates at ``448 * s``; 0 stays 0.

Fixed scales cost no byte per token (a cache holds ``layers x 2 x kv_heads`` of them, fp32,
beside its memory, not in it) and leave the kernels one multiply of the softmax scale and one
of the output per KV head; they make every copy of the bytes exact: a prefix shared read-only,
one opened from another process, the engine's prefix cache and the host tier all hold bytes
that mean the same under the same scales. The writer's and every reader's scales must then be
the same: they are a property of the cache (``kv_scales``; 1 by default, vLLM's too), given
to a prefix's builder and to whoever opens it.

Attention reads an FP8 cache through :func:`kvvm.kernels.attend.write_attend`: the Triton
decode and cascade kernels widen each block of K/V as they load it; the per-request SDPA path
(CPU, and prefills on CUDA: FlashAttention takes no FP8) widens one request's tokens at a time.
No kernel makes a dequantized copy of the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InvalidArgumentError

__all__ = [
    "E4M3",
    "E4M3_MAX",
    "KV_DTYPES",
    "dequantize",
    "kv_storage",
    "make_scales",
    "quantize",
]

#: The element type of an FP8 cache.
E4M3 = torch.float8_e4m3fn

#: e4m3's largest finite value: what quantization saturates at (in units of the scale).
E4M3_MAX = 448.0

#: The ``kv_dtype`` names a cache takes for FP8 KV.
KV_DTYPES = ("fp8_e4m3",)

#: Names of 8-bit formats kvvm refuses, and why.
_REFUSED = {
    "fp8_e5m2": (
        "fp8_e5m2 KV is not supported: kvvm's geometry records one 8-bit format (e4m3, the one "
        "its memory is exported as), so an e5m2 prefix could be read as e4m3; use fp8_e4m3"
    ),
}


def kv_storage(kv_dtype: Any, dtype: Any) -> Any:
    """The dtype a cache stores K/V in: ``"fp8"`` for ``kv_dtype="fp8_e4m3"``, ``dtype`` (the
    model's) for ``kv_dtype=None``, else ``kv_dtype`` itself (any dtype a cache takes).
    Raises InvalidArgumentError for an 8-bit format kvvm does not hold."""
    if kv_dtype is None:
        return dtype
    if isinstance(kv_dtype, str):
        name = kv_dtype.lower()
        if name in KV_DTYPES:
            return "fp8"
        if name in _REFUSED:
            raise InvalidArgumentError(_REFUSED[name])
    if kv_dtype == torch.float8_e5m2:
        raise InvalidArgumentError(_REFUSED["fp8_e5m2"])
    if kv_dtype == E4M3:
        return "fp8"
    return kv_dtype


def make_scales(
    layers: int, kv_heads: int, kv_scales: Sequence[float] | torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """The fp32 ``[layers, 2, kv_heads]`` scales of an FP8 cache (``[l, 0]``: layer ``l``'s K,
    ``[l, 1]``: its V) from ``kv_scales``: None (all 1), a ``(k_scale, v_scale)`` pair, or a
    tensor of that shape. Raises InvalidArgumentError for a scale that is not finite and
    positive."""
    if kv_scales is None:
        kv_scales = (1.0, 1.0)
    if isinstance(kv_scales, torch.Tensor):
        scales = kv_scales.detach().to(device=device, dtype=torch.float32).clone().contiguous()
        if tuple(scales.shape) != (layers, 2, kv_heads):
            raise InvalidArgumentError(
                f"kv_scales of shape {tuple(scales.shape)}; the cache needs [layers, 2, kv_heads] = "
                f"[{layers}, 2, {kv_heads}]"
            )
    else:
        pair = [float(x) for x in kv_scales]
        if len(pair) != 2:
            raise InvalidArgumentError(f"kv_scales is (k_scale, v_scale), not {len(pair)} value(s)")
        scales = torch.tensor(pair, dtype=torch.float32).view(1, 2, 1).repeat(layers, 1, kv_heads).to(device)
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise InvalidArgumentError("every FP8 KV scale must be finite and positive")
    return scales


def _per_head(scale: torch.Tensor, like: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``scale`` (``[kv_heads]``) shaped to broadcast over ``like``, whose dimension
    ``head_dim`` is the KV heads."""
    shape = [1] * like.dim()
    shape[head_dim] = -1
    return scale.view(shape)


def quantize(x: torch.Tensor, scale: torch.Tensor, head_dim: int = 1) -> torch.Tensor:
    """``x`` as an FP8 cache stores it (see the module): divided by its KV head's ``scale``
    (``[kv_heads]``, broadcast along ``x``'s dimension ``head_dim``), saturated at
    :data:`E4M3_MAX` and rounded to the nearest e4m3 (ties to even)."""
    s = _per_head(scale.to(torch.float32), x, head_dim)
    return (x.to(torch.float32) / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, head_dim: int = 1) -> torch.Tensor:
    """The values FP8 ``q`` holds, in ``dtype``: each times its KV head's ``scale``."""
    return (q.to(torch.float32) * _per_head(scale.to(torch.float32), q, head_dim)).to(dtype)
