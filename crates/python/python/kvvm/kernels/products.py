"""A decode step's skinny matrix products, tuned per shape against cuBLAS.

A decode step multiplies a few rows of activations (one a request) by every weight matrix of
the model: ``y = x @ W.T`` with ``x`` of 1 to 64 rows and ``W`` of thousands. The product
reads each weight once and does little else, so its time is the weights' bytes over the rate
they stream at. :func:`linear` runs it either through PyTorch (cuBLAS) or through a Triton
kernel written for that shape: the weight is the tensor-core product's tall operand (64 or
128 of its rows a program) and the few activation rows its narrow one, so a program streams
a block of weight rows along the reduction with several loads in flight, and the products
of a narrow ``N`` can split the reduction over programs (``split``), their partial sums
added in fp32.

Which of them runs is measured, not assumed: the first time :func:`linear` meets a shape
(rows rounded up to a power of two, the weight's size and dtype) it times cuBLAS and the
kernel's candidate configurations, each replayed in a captured graph as a decode step runs
them (each repeat reading its own copy of the weight from memory, never from the L2 cache,
as a step reads it: :func:`~kvvm.kernels.tuning.cold_copies`), and keeps the fastest
(:func:`tuned_product`); cuBLAS is a candidate, so tuning never picks a slower product than
PyTorch's. Untimed (:mod:`kvvm.kernels.tuning`'s rules: a
capture, a compiler's trace, :func:`~kvvm.kernels.tuning.untuned`,
``KVVM_TRITON_AUTOTUNE=0``) a shape not tuned before runs through PyTorch.

:func:`linear` is the ``kvvm::linear`` operator: ``torch.compile`` treats it as one opaque
call. :func:`gated_linear` (``kvvm::gated_linear``) is a gated MLP's down projection over its
gate and up projections side by side: the kernel computes ``silu(gate) * up`` as it loads
them, so the activation runs in no kernel of its own, where that is measured faster than the
activation in one kernel (:func:`gate_activation`) and the plain product as tuned. Each
program of the kernel computes the activation of every row it reads: worth it for a few rows
(on an H100, 16 rows of the Llama-3.1-8B shape's down projection, 46.9 us against 52.0 for
PyTorch's activation, product and cuBLAS), not for 64 (165 us against 55.7).
:func:`kvvm.transformers.tuned_products` puts them in a model's linear layers and gated MLPs.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check the kernel).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import triton_decode
from .device import launch_options, programmatic
from .triton_decode import _INTERPRETED
from .triton_kernels import let_dependents_launch, wait_for_inputs
from .tuning import cold_copies, graph_time

__all__ = [
    "MAX_ROWS", "ProductConfig", "candidates", "gate_activation", "gated_input", "gated_linear", "linear", "product",
    "torch_product", "tuned_product", "tuned_product_choices",
]

#: Rows of ``x`` the kernel takes at most (a decode step's requests); more go to PyTorch.
MAX_ROWS = 64


@dataclass(frozen=True)
class ProductConfig:
    """How the Triton kernel runs a product: weight rows a program (``block_n``), the
    reduction's elements per iteration (``block_k``), warps, pipeline stages, and programs
    along the reduction (``split``: their partial sums added in fp32)."""

    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 4
    split: int = 1


#: The kernel's configurations :func:`tuned_product` times beside cuBLAS: each fits the
#: H100's shared memory at 64 rows with its stages in flight (64 KiB or more of weight a
#: program); the splits give a narrow weight (4096 rows: 64 programs of 64) a program per
#: multiprocessor or more.
_CANDIDATES = (
    ProductConfig(64, 128), ProductConfig(128, 128), ProductConfig(64, 256, stages=3), ProductConfig(32, 256),
    ProductConfig(128, 128, warps=8, stages=3), ProductConfig(64, 128, split=2), ProductConfig(64, 128, split=4),
    ProductConfig(32, 256, split=2),
)

#: The choice per shape (None: PyTorch's product).
_Shape = tuple[int, tuple[int, ...], int, torch.dtype, bool, bool, torch.device]
_TUNED: dict[_Shape, ProductConfig | None] = {}


def candidates() -> tuple[ProductConfig, ...]:
    """The kernel's configurations the tuner times (beside PyTorch's product)."""
    return _CANDIDATES


@triton.jit
def _product_kernel(
    X, W, Bias, Y, Acc, M, N, K, k_per, stride_xm, stride_wn, stride_ym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, LOOP_WHILE: tl.constexpr, PDL: tl.constexpr,
):
    # Program (n, s) takes weight rows [n * BN, n * BN + BN) over the reduction's s-th part
    # of k_per elements: acc[BN, BM] = W[rows, part] @ x[:, part]^T, the weight the tall side.
    # The loop's bounds are run-time values: Triton pipelines such a loop's loads (its
    # stages in flight), not one of a compile-time trip count.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    wait_for_inputs(PDL)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if LOOP_WHILE:
        # Triton's interpreter (CPU) takes a loop bound only as a Python int.
        k0 = k_lo
        while k0 < k_hi:
            acc = _product_block(w_rows, x_rows, k0, k_hi, K, n_mask, m_mask, acc, BK, GATED)
            k0 += BK
    else:
        for k0 in range(k_lo, k_hi, BK):
            acc = _product_block(w_rows, x_rows, k0, k_hi, K, n_mask, m_mask, acc, BK, GATED)
    let_dependents_launch(PDL)
    mask = n_mask[:, None] & m_mask[None, :]
    if HAS_BIAS:
        # Added once: by the only program of a row block, or by its first split (the
        # others read nothing: their load is masked off).
        acc += tl.load(Bias + offs_n, mask=n_mask & (pid_k == 0), other=0.0).to(tl.float32)[:, None]
    if SPLIT == 1:
        y_ptr = Y + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mask)
    else:
        a_ptr = Acc + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        tl.atomic_add(a_ptr, acc, mask=mask, sem="relaxed")


@triton.jit
def _product_block(w_rows, x_rows, k0, k_hi, K, n_mask, m_mask, acc, BK: tl.constexpr, GATED: tl.constexpr):
    """One block of the reduction, ``[k0, k0 + BK)`` (nothing past ``k_hi``), added to ``acc``.
    ``GATED``: each row of ``x`` is a gate and an up projection side by side (``K`` elements
    each), and the product's input is ``silu(gate) * up``, rounded as PyTorch rounds it (the
    activation to ``x``'s dtype, then the product of the two)."""
    offs_k = k0 + tl.arange(0, BK)
    k_mask = offs_k < k_hi
    x_mask = m_mask[:, None] & k_mask[None, :]
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    x = tl.load(x_rows + offs_k[None, :], mask=x_mask, other=0.0)
    if GATED:
        x = _silu_times(x, tl.load(x_rows + K + offs_k[None, :], mask=x_mask, other=0.0))
    return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _silu_times(gate, up):
    """``silu(gate) * up`` in their dtype, rounded as PyTorch rounds it: the activation to
    that dtype, then the product of the two."""
    g = gate.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _gate_kernel(X, A, K, stride_xm, stride_am, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # Program (m, b): row m's elements [b * BLOCK, b * BLOCK + BLOCK) of silu(gate) * up.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    wait_for_inputs(PDL)
    gate = tl.load(X + row * stride_xm + offs, mask=mask, other=0.0)
    up = tl.load(X + row * stride_xm + K + offs, mask=mask, other=0.0)
    let_dependents_launch(PDL)
    tl.store(A + row * stride_am + offs, _silu_times(gate, up), mask=mask)


def _rows_pow2(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


def gated_input(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate, up]`` (its last dimension two halves): a gated
    MLP's input to its down projection, as PyTorch computes it."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gate_activation(x: torch.Tensor) -> torch.Tensor:
    """:func:`gated_input` of ``x`` in one kernel (Triton's, on CUDA and in its interpreter,
    rounded as PyTorch rounds it) where PyTorch runs two (the activation, the product);
    PyTorch's elsewhere."""
    flat = x.reshape(-1, x.shape[-1])
    if not (x.is_cuda or _INTERPRETED) or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or (
        flat.stride(1) != 1 or x.shape[-1] % 2
    ):
        return gated_input(x)
    m, k = flat.shape[0], flat.shape[1] // 2
    out = torch.empty((m, k), device=x.device, dtype=x.dtype)
    if m:
        pdl = programmatic(x.device)
        _gate_kernel[(m, triton.cdiv(k, _GATE_BLOCK))](
            flat, out, k, flat.stride(0), out.stride(0), BLOCK=_GATE_BLOCK, PDL=pdl, **launch_options(pdl),
        )
    return out.reshape(*x.shape[:-1], k)


#: Elements of a row one program of :func:`gate_activation` computes.
_GATE_BLOCK = 1024


def torch_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    """The product as PyTorch runs it (cuBLAS on a GPU): ``x @ weight.T (+ bias)``, of
    :func:`gated_input` of ``x`` where ``gated``."""
    return torch.nn.functional.linear(gated_input(x) if gated else x, weight, bias)


def product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: ProductConfig, *, gated: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` by the Triton kernel in ``config``: ``x`` of at most
    :data:`MAX_ROWS` rows ``[m, k]``, ``weight`` ``[n, k]`` (unit last strides), the result
    ``[m, n]`` in ``x``'s dtype. ``gated``: ``x`` is ``[m, 2k]``, a gate and an up
    projection side by side, and the product's input is :func:`gated_input` of it, computed
    as the kernel loads ``x`` (no kernel of its own, nothing written)."""
    m, width = x.shape
    n, k = weight.shape
    if m > MAX_ROWS or width != (2 * k if gated else k) or x.stride(1) != 1 or weight.stride(1) != 1 or (
        bias is not None and bias.stride(0) != 1
    ):
        what = "gated product" if gated else "product"
        raise ValueError(f"a {what} of {tuple(x.shape)} by {tuple(weight.shape)}^T is not the kernel's")
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    acc = y
    if config.split > 1:
        acc = torch.zeros((m, n), device=x.device, dtype=torch.float32)
    k_per = triton.cdiv(triton.cdiv(k, config.split), config.block_k) * config.block_k
    pdl = programmatic(x.device)
    _product_kernel[(triton.cdiv(n, config.block_n), config.split)](
        x, weight, bias if bias is not None else weight, y, acc, m, n, k, k_per, x.stride(0), weight.stride(0),
        y.stride(0), BM=_rows_pow2(m), BN=config.block_n, BK=config.block_k, SPLIT=config.split,
        HAS_BIAS=bias is not None, GATED=gated, LOOP_WHILE=_INTERPRETED, PDL=pdl, num_warps=config.warps,
        num_stages=config.stages, **launch_options(pdl),
    )
    if config.split > 1:
        y.copy_(acc)
    return y


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> bool:
    """Whether the kernel can run this product at all (else PyTorch's runs)."""
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if _INTERPRETED else ())
    return (
        (x.is_cuda or _INTERPRETED)
        and x.shape[0] <= MAX_ROWS
        and x.shape[1] == weight.shape[1] * (2 if gated else 1)
        and x.dtype in dtypes
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and (bias is None or (bias.dtype == x.dtype and bias.stride(0) == 1))
    )


def tuned_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False,
) -> ProductConfig | None:
    """The fastest way to run this product, measured once per shape (rows rounded up to a
    power of two, the weight's shape, dtype and row stride, a bias or not, gated or not) and
    remembered: a configuration of the kernel, or None: PyTorch's product (cuBLAS), or for a
    gated one the activation in a kernel of its own (:func:`gate_activation`) and then the
    plain product as tuned for its shape (tuned first). Untimed (see the module's text), a
    shape tuned before keeps its choice and any other gets None, remembering nothing; in
    Triton's interpreter, the kernel's first candidate."""
    if not _kernel_takes(x, weight, bias, gated):
        return None
    shape: _Shape = (
        _rows_pow2(x.shape[0]), tuple(weight.shape), weight.stride(0), x.dtype, bias is not None, gated, x.device,
    )
    if shape in _TUNED:
        return _TUNED[shape]
    if _INTERPRETED:
        return _CANDIDATES[0]
    if not triton_decode.may_tune():
        return None

    if gated:
        tuned_product(gate_activation(x), weight, bias)  # the separate way's product, tuned first

    # Each repeat reads its own copy of the weight from memory, as a step reads it.
    weights = itertools.cycle(cold_copies(weight))

    def run(c: ProductConfig | None) -> torch.Tensor:
        w = next(weights)
        if c is None:
            return _separate(x, w, bias) if gated else torch.nn.functional.linear(x, w, bias)
        return product(x, w, bias, c, gated=gated)

    timings: list[tuple[float, int, ProductConfig | None]] = [(graph_time(run, None), 0, None)]
    for i, c in enumerate(_CANDIDATES, start=1):
        try:
            timings.append((graph_time(run, c), i, c))
        except triton_decode.TOO_BIG:
            continue  # more shared memory or registers than the device has
    chosen = min(timings, key=lambda t: (t[0], t[1]))[2]
    _TUNED[shape] = chosen
    return chosen


def tuned_product_choices() -> dict[str, str]:
    """The choices :func:`tuned_product` measured so far, each under a description of its
    shape (rows rounded up, the weight's shape, dtype, a bias, gated): a configuration or
    ``"torch"``."""
    return {
        f"rows <= {k[0]}, weight {k[1][0]} x {k[1][1]}, {k[3]}" + (", bias" if k[4] else "")
        + (", gated" if k[5] else ""): ("torch" if v is None else str(v))
        for k, v in _TUNED.items()
    }


def _run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    """The product of ``x`` (leading dimensions flattened) the way :func:`tuned_product`
    chose for its shape."""
    flat = x.reshape(-1, x.shape[-1])
    config = tuned_product(flat, weight, bias, gated) if flat.shape[0] else None
    if config is None:
        return _separate(x, weight, bias) if gated else torch.nn.functional.linear(x, weight, bias)
    return product(flat, weight, bias, config, gated=gated).reshape(*x.shape[:-1], weight.shape[0])


def _separate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A gated product in two kernels: the activation (:func:`gate_activation`), then the
    plain product the way tuned for its shape."""
    return _run(gate_activation(x), weight, bias, False)


@torch.library.custom_op("kvvm::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)``, run the fastest way measured for its
    shape (:func:`tuned_product`): a few rows of ``x`` (at most :data:`MAX_ROWS` of them,
    leading dimensions flattened) through the Triton kernel where it beat cuBLAS."""
    return _run(x, weight, bias, False)


@torch.library.custom_op("kvvm::gated_linear", mutates_args=())
def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A gated MLP's down projection, ``linear(silu(gate) * up, weight, bias)`` of ``x =
    [gate, up]`` (:func:`gated_input`), run the fastest way measured for its shape: through
    the Triton kernel, the activation computed as it loads ``x`` (no kernel of its own),
    where that beat the activation in one kernel of its own followed by the plain product
    as tuned (what a compiler's fusion of the model's code runs at best)."""
    return _run(x, weight, bias, True)


@gated_linear.register_fake
def _gated_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@linear.register_fake
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
