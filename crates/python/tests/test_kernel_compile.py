"""Every Triton kernel of the package compiled for a Hopper GPU (sm_90a) without one: the
compiler's whole NVIDIA pipeline (tensor-core layouts, the pipelined loads, the inline PTX of
the FP8 widening and of programmatic launches) down to ptxas's machine code, on the CPU.

The tests in Triton's interpreter check what the kernels compute; they do not compile them,
so a kernel that only the GPU's compiler refuses would pass them. Here each kernel is
compiled in the configurations the decode step runs (the tuners' choices measured on an H100:
``docs/cascade.md``), with every pointer argument 16-byte aligned and every stride a multiple
of 16, as Triton specializes the real launches. A kernel argument this module does not know
the type of fails the test: its type belongs in :data:`_POINTERS` or :data:`_FLOATS`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

triton = pytest.importorskip("triton", reason="skipped: no triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvvm.kernels import products, triton_cascade, triton_decode, triton_kernels, triton_prefill  # noqa: E402

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not os.access(_PTXAS, os.X_OK), reason="skipped: no ptxas in Triton's wheel")

#: The compiled-for target: an H100 or H200 (compute capability 9.0, 32-thread warps).
_HOPPER = GPUTarget("cuda", 90, 32)

#: Pointer arguments by name: ``"model"`` (the query's and the output's dtype), ``"kv"`` (the
#: cache's), or a fixed Triton type.
_POINTERS = {
    "Q": "model", "Out": "model", "KN": "model", "VN": "model", "X": "model", "W": "model", "Bias": "model",
    "Y": "model", "A": "model", "K": "kv", "V": "kv", "Acc": "*fp32", "Lse": "*fp32", "Scales": "*fp32",
    "Bounds": "*i32", "Shared": "*i32", "Groups": "*i32", "Items": "*i32", "Arrivals": "*i32",
    "WS": "*i64", "WT": "*i64",
}

#: Scalar arguments that are floats (every other scalar is an int32).
_FLOATS = {"sm_scale", "softcap"}



@dataclass(frozen=True)
class _Case:
    """A kernel in one configuration: its constants (those it takes of them), warps, stages,
    the query's and the cache's pointer types, the capitalized scalars it takes (the
    products' sizes ``M``, ``N``, ``K``, where the decode kernels' ``K`` is the cache), and
    the scalars besides the strides that a launch at the model's shapes finds multiples of 16
    (Triton specializes those: a product's loads are only vectorized, and then pipelined,
    where its reduction's length is known to be one)."""

    fn: Any
    const: dict[str, Any]
    warps: int
    stages: int
    model: str = "*bf16"
    kv: str = "*bf16"
    ints: frozenset[str] = field(default_factory=frozenset)
    aligned: frozenset[str] = field(default_factory=frozenset)


def _signature(fn: Any, const: dict[str, Any], model: str, kv: str, ints: frozenset[str] = frozenset(),
               aligned: frozenset[str] = frozenset()) -> tuple[dict[str, str], dict[Any, Any]]:
    """The kernel's argument types and the alignment Triton would find at a launch: every
    pointer and stride a multiple of 16, and the scalars named ``aligned``."""
    sig: dict[str, str] = {}
    attrs: dict[Any, Any] = {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
            continue
        pointer = name not in ints and name[0].isupper()
        if pointer and name not in _POINTERS:
            raise AssertionError(f"{fn.__name__}: the pointer argument {name} has no type here (_POINTERS)")
        if pointer:
            kind = _POINTERS[name]
            sig[name] = {"model": model, "kv": kv}.get(kind, kind)
        else:
            sig[name] = "fp32" if name in _FLOATS else "i32"
        if pointer or name.startswith("stride_") or name in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _compile(case: _Case) -> Any:
    """The case's kernel compiled for :data:`_HOPPER`."""
    fn = case.fn
    const = {k: v for k, v in case.const.items() if k in fn.arg_names}
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in const]
    assert not missing, f"{fn.__name__}: constants not given: {missing}"
    sig, attrs = _signature(fn, const, case.model, case.kv, case.ints, case.aligned)
    return triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=_HOPPER,
                          options={"num_warps": case.warps, "num_stages": case.stages})


#: A Llama-3.1-8B layer's attention (32 query heads on 8 KV heads of 128) as the decode step
#: and the cascade launch it.
_DECODE = dict(
    GROUP=4, GROUP_PAD=16, GROUP_POW2=4, HEAD_DIM=128, DIM_PAD=128, BLOCK=64, SPLITS=1, LOOP_WHILE=False,
    PRECISION="tf32", UPCAST=False, FUSED=True, CAPPED=False, SLIDING=False, CASCADE=False, PSPLITS=1,
    PSPLITS_PAD=1, DIRECT=True, FP8=False, MERGE=False, PDL=True, WIDEN=False, MASK_EVERY=False, ARRIVE=False,
)
_PREFIX = dict(_DECODE, TILE=16, KV_HEADS=8, PROGRAMS=264, LAPS=1, BLOCK=128, SPLITS=1, PSPLITS=4)

_SIZES = frozenset({"M", "N", "K"})
#: A product's sizes at the model's shapes: its weight's rows and reduction, and the
#: reduction's part a program takes, multiples of 16 (the activations' rows need not be).
_ALIGNED = frozenset({"N", "K", "k_per"})

_CASES = {
    "decode": _Case(triton_kernels._partial_kernel, _DECODE, 4, 2),
    "decode split, capped, sliding": _Case(
        triton_kernels._partial_kernel, dict(_DECODE, SPLITS=4, DIRECT=False, CAPPED=True, SLIDING=True), 4, 2,
    ),
    "decode fp32": _Case(triton_kernels._partial_kernel, dict(_DECODE, PRECISION="ieee", BLOCK=32), 4, 2, "*fp32", "*fp32"),
    "decode fp8, V widened": _Case(
        triton_kernels._partial_kernel, dict(_DECODE, FP8=True, WIDEN=True, MASK_EVERY=True), 4, 3, "*fp16", "*fp8e4nv",
    ),
    "cascade's private pass": _Case(
        triton_kernels._partial_kernel,
        dict(_DECODE, CASCADE=True, PSPLITS=4, PSPLITS_PAD=4, MASK_EVERY=True, ARRIVE=True, DIRECT=False), 4, 2,
    ),
    "cascade's prefix pass": _Case(triton_cascade._prefix_kernel, _PREFIX, 8, 3),
    "cascade's prefix pass, fp8, counted": _Case(
        triton_cascade._prefix_kernel, dict(_PREFIX, FP8=True, ARRIVE=True, BLOCK=64), 4, 2, "*bf16", "*fp8e4nv",
    ),
    "cascade in one launch": _Case(
        triton_cascade._together_kernel,
        dict(_PREFIX, TILE=8, BLOCK=64, PREFIX_BLOCK=32, PREFIX_FIRST=True, MASK_EVERY=True), 4, 2,
    ),
    "merge": _Case(triton_kernels._merge_kernel, dict(HEAD_DIM=128, DIM_PAD=128, SPLITS=4, SPLITS_PAD=4, PDL=True), 4, 1),
    "prefill": _Case(
        triton_prefill._prefill_kernel, dict(_DECODE, BLOCK_M=triton_prefill.BLOCK_M, BLOCK_N=triton_prefill.BLOCK_N), 4, 2,
    ),
    "prefill fp8, capped, sliding": _Case(
        triton_prefill._prefill_kernel,
        dict(_DECODE, BLOCK_M=triton_prefill.BLOCK_M, BLOCK_N=triton_prefill.BLOCK_N, FP8=True, CAPPED=True,
             SLIDING=True), 4, 2, "*bf16", "*fp8e4nv",
    ),
    "product": _Case(
        products._product_kernel,
        dict(BM=64, BN=64, BK=128, SPLIT=1, HAS_BIAS=False, GATED=False, LOOP_WHILE=False, PDL=True), 4, 4,
        ints=_SIZES, aligned=_ALIGNED,
    ),
    "gated product, split": _Case(
        products._product_kernel,
        dict(BM=16, BN=64, BK=128, SPLIT=2, HAS_BIAS=True, GATED=True, LOOP_WHILE=False, PDL=True), 4, 4, ints=_SIZES,
        aligned=_ALIGNED,
    ),
    "gate": _Case(products._gate_kernel, dict(BLOCK=1024, PDL=True), 4, 1, ints=_SIZES, aligned=_ALIGNED),
}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton cache of the test's own: each kernel is compiled here, not found."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))


@pytest.mark.parametrize("case", sorted(_CASES))
def test_the_kernel_compiles_for_hopper(case: str) -> None:
    """The kernel goes through Triton's and ptxas's compilers for sm_90a, its pipelined
    loops' loads asynchronous copies and its shared memory within the GPU's 227 KiB."""
    c = _CASES[case]
    kernel = _compile(c)
    assert kernel.asm["cubin"], "ptxas made machine code"
    assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
    if c.stages > 1:
        assert "async_copy_global_to_local" in kernel.asm["ttgir"], "the token loop's loads are pipelined"


#: Head dims and query heads per KV head of the architectures people load: Llama-3.2-1B
#: (64, 4), Pythia (80, 1), Phi-3-mini (96, 1), Qwen2-7B (128, 7), Llama-3-70B (128, 8),
#: Gemma 2 (256, 2); dims that are no power of two, ratios from 1 to 8.
_SHAPES = ((64, 4), (80, 1), (96, 1), (128, 7), (128, 8), (256, 2))


@pytest.mark.parametrize(("dim", "group"), _SHAPES)
def test_the_decode_and_prefill_kernels_compile_at_every_head_dim_and_group(dim: int, group: int) -> None:
    """The decode kernel in its default configuration (as untuned) and the prefill kernel
    compile for sm_90a at each shape, their rows and dims padded as the launches pad them."""
    shape = dict(_DECODE, GROUP=group, GROUP_PAD=max(16, triton_decode._pow2_at_least(group)),
                 HEAD_DIM=dim, DIM_PAD=max(16, triton_decode._pow2_at_least(dim)), BLOCK=triton_decode.BLOCK_N)
    default = triton_decode.Config(1)
    for case in (
        _Case(triton_kernels._partial_kernel, shape, default.warps, default.stages),
        _Case(triton_prefill._prefill_kernel, dict(shape, BLOCK_M=triton_prefill.BLOCK_M, BLOCK_N=triton_prefill.BLOCK_N),
              4, 2),
    ):
        kernel = _compile(case)
        assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024, (case.fn.__name__, kernel.metadata.shared)


def test_an_unknown_pointer_argument_is_refused() -> None:
    """The signature is not guessed: a pointer argument of no known type fails the test."""

    class _Fn:
        __name__ = "_made_up"
        arg_names = ["Q", "Mystery", "stride_q"]

    with pytest.raises(AssertionError, match="Mystery"):
        _signature(_Fn(), {}, "*bf16", "*bf16")
