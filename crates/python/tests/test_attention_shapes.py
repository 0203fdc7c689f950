"""The Triton decode kernel and the decode step over a KvvmCache on every attention shape the
models people load have: head dims 64, 96 (not a power of two: the kernel pads its block and
masks), 128 and 256, 1, 4, 8 and 16 query heads per KV head (16 with one KV head), bf16 and
fp16, against SDPA over each request's exact tokens.

On the CPU in Triton's interpreter, each test in a process of its own (Triton reads
``TRITON_INTERPRET`` once), at small sizes: the kernel's logic, not its speed (the GPU run
of ``python -m kvvm_bench shapes`` measures that). On a CUDA GPU the kernel compiled, at
every shape (skipped without CUDA).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest

from conftest import cuda_available, host_available

if TYPE_CHECKING:
    import torch

pytest.importorskip("torch", reason="skipped: no torch")
pytest.importorskip("triton", reason="skipped: no triton")

#: Shared by the scripts: every shape, and SDPA over a request's exact tokens in fp32.
_COMMON = """
import itertools, math, torch
import torch.nn.functional as F

DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 96, 128, 256)
GQA = (1, 4, 8, 16)
#: Largest |difference| to fp32 SDPA of a kernel whose products are rounded to the dtype.
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}

def shapes():
    for dtype, dim, gqa in itertools.product(DTYPES, HEAD_DIMS, GQA):
        # Two KV heads where a query head must find its own among them, else one (the
        # interpreter's time grows with the heads).
        kv_heads = 2 if gqa <= 4 else 1
        yield dtype, dim, gqa, kv_heads

def sdpa(q, k, v, bounds):
    out = torch.zeros(q.shape[0], 1, q.shape[1], q.shape[3])
    for b, (slot, start, end) in enumerate(bounds.tolist()):
        if end > start:
            o = F.scaled_dot_product_attention(
                q[b : b + 1].float(), k[slot : slot + 1, :, start:end].float(),
                v[slot : slot + 1, :, start:end].float(), enable_gqa=True)
            out[b] = o[0].transpose(0, 1)
    return out
"""


#: The same, in this process (the GPU test).
_SHARED: dict = {}
exec(_COMMON, _SHARED)


def _run(code: str, marker: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = textwrap.dedent(_COMMON) + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and marker in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])
    return r.stdout


def test_the_decode_kernel_matches_sdpa_on_every_shape() -> None:
    """Each shape as the decode step runs it: the step's token written by the kernel itself
    and attended from registers, a write refused to the scratch slot left unattended,
    ragged requests in any slot order and an empty one; one split (its program writes the
    output) or several (merged by a second kernel) on a diagonal of the head dims and
    ratios; on the odd diagonals with every block masked in the one loop
    (``Config.masked``). On another diagonal, the kernel reading the cache only, over
    several splits."""
    out = _run(
        """
        from kvvm.kernels.triton_decode import Config, decode_attention
        torch.set_num_threads(1)
        torch.manual_seed(4)
        B, T = 3, 100
        # Request 0 writes its last token, 1 a token inside its range, 2 is refused (its
        # write goes to the scratch slot, the last) and reads nothing.
        ws, wt = torch.tensor([[0], [1], [B]]), torch.tensor([[99], [69], [0]])
        fused_bounds = torch.tensor([[0, 0, 100], [1, 7, 70], [2, 0, 0]], dtype=torch.int32)
        read_bounds = torch.tensor([[1, 0, 100], [0, 7, 70], [2, 9, 9]], dtype=torch.int32)
        for dtype, dim, gqa, kv_heads in shapes():
            heads = gqa * kv_heads
            # The interpreter takes longest over the merge, one program per query head.
            diagonal = (HEAD_DIMS.index(dim) + GQA.index(gqa)) % 4
            several = 2 if dtype == torch.bfloat16 else 4
            base = torch.randn(B + 1, T, 2, kv_heads, dim).to(dtype)  # token-major, + scratch
            k, v = base[:, :, 0].transpose(1, 2), base[:, :, 1].transpose(1, 2)
            q = torch.randn(B, 1, heads, dim).to(dtype).transpose(1, 2)
            scale = 1 / math.sqrt(dim)
            kn = torch.randn(B, 1, kv_heads, dim).to(dtype).transpose(1, 2)
            # V as a fused projection gives it: a slice of a wider row (other strides than K's).
            vn = torch.randn(B, 1, 3 * kv_heads * dim).to(dtype)[..., kv_heads * dim : 2 * kv_heads * dim]
            vn = vn.view(B, 1, kv_heads, dim).transpose(1, 2)
            want_k, want_v = k.clone(), v.clone()
            want_k[ws, :, wt] = kn.transpose(1, 2)
            want_v[ws, :, wt] = vn.transpose(1, 2)
            kk, vv = k.clone(), v.clone()
            splits = Config(several if diagonal == 2 else 1, masked=diagonal % 2 == 1)
            got = decode_attention(q, kk, vv, fused_bounds, scale, splits, (kn, vn, ws, wt))
            assert got.dtype == dtype and got.shape == (B, 1, heads, dim)
            assert torch.equal(kk, want_k) and torch.equal(vv, want_v), ("write", dtype, dim, gqa)
            err = (got.float() - sdpa(q, want_k, want_v, fused_bounds)).abs().max().item()
            assert err < TOL[dtype], ("fused", dtype, dim, gqa, splits, err)
            assert not got[2].any(), "an empty range gives zeros"
            if diagonal == 0:
                got = decode_attention(q, k, v, read_bounds, scale, several)
                err = (got.float() - sdpa(q, k, v, read_bounds)).abs().max().item()
                assert err < TOL[dtype], ("read", dtype, dim, gqa, several, err)
                assert not got[2].any(), "an empty range gives zeros"
            print(f"{dtype} {dim} {gqa}: ok", flush=True)
        print("shapes ok")
        """,
        "shapes ok",
    )
    assert sum(line.endswith(": ok") for line in out.splitlines()) == 32, out


@pytest.mark.skipif(not host_available(), reason="skipped: no host backend")
def test_the_decode_step_over_a_kvvm_cache_matches_dynamic_cache_on_every_shape() -> None:
    """A one-layer Llama of each shape (its head dim set apart from the hidden size) decodes
    two ragged requests over a KvvmCache on the host backend, each step as a captured graph
    runs it (prepared, then the forward through the kvvm attention: the Triton kernel writes
    the step's K/V into the cache and attends, here in the interpreter; the second step reads
    the first's token from memory), against the same weights over a DynamicCache per request
    (SDPA). Every head dim with two ratios and every ratio with two head dims, in both
    dtypes (two diagonals of the shapes; the kernel alone runs all of them above): one split
    on one diagonal, several on the other (a longer reservation)."""
    out = _run(
        """
        import gc
        import transformers, kvvm
        import kvvm.kernels.triton_decode as td
        from kvvm.kernels.attend import kernel_for
        from kvvm.transformers import KvvmCache, use_kvvm_attention
        torch.set_num_threads(1)
        assert kernel_for(torch.device("cpu"), 1) == "triton", "the interpreter runs the CUDA kernel"
        launches = []
        kernel = td.decode_attention
        td.decode_attention = lambda *a, **k: launches.append(a[5]) or kernel(*a, **k)
        #: Largest |logit difference| (logits up to about 3 in magnitude).
        LOGIT_TOL = {torch.bfloat16: 8e-2, torch.float16: 1e-2}
        mgr = kvvm.Manager("host", precommit=True, headroom_tokens=4)
        lengths = [37, 9]
        torch.manual_seed(5)
        prompts = [torch.randint(0, 128, (1, n)) for n in lengths]
        gc.freeze()  # a release's collection (views in cycles) skips what the imports made
        for dtype, dim, gqa, kv_heads in shapes():
            diagonal = (HEAD_DIMS.index(dim) + GQA.index(gqa)) % 4
            if diagonal > 1:
                continue
            cfg = transformers.LlamaConfig(
                hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=gqa * kv_heads,
                num_key_value_heads=kv_heads, head_dim=dim, vocab_size=128, max_position_embeddings=512,
                initializer_range=0.1)  # attention moves the logits well above the rounding
            cfg._attn_implementation = "sdpa"
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
            use_kvvm_attention(model)  # with a DynamicCache it is SDPA: the reference
            cache = KvvmCache(model, 2, 160 if diagonal == 1 else 48, manager=mgr)
            refs = [transformers.DynamicCache(config=cfg) for _ in lengths]
            worst, before = 0.0, len(launches)
            with torch.no_grad():
                want = []
                for slot, (p, dc) in enumerate(zip(prompts, refs)):
                    with cache.select(slot):
                        model(input_ids=p, past_key_values=cache, use_cache=True)
                    want.append(model(input_ids=p, past_key_values=dc, use_cache=True).logits[:, -1])
                tok = torch.cat(want).argmax(-1)
                for _ in range(2):
                    cache.prepare(1)
                    got = model(
                        input_ids=tok[:, None], position_ids=cache.state.positions(1), past_key_values=cache,
                        use_cache=True, logits_to_keep=1,
                    ).logits[:, -1]
                    cache.step_done()
                    want = torch.cat([
                        model(input_ids=tok[i : i + 1, None], past_key_values=dc, use_cache=True).logits[:, -1]
                        for i, dc in enumerate(refs)
                    ])
                    worst = max(worst, (got.float() - want.float()).abs().max().item())
                    tok = want.argmax(-1)
            assert worst < LOGIT_TOL[dtype], (dtype, dim, gqa, worst)
            splits = {getattr(c, "splits", c) for c in launches[before:]}
            assert len(launches) - before == 2 and splits == ({4} if diagonal == 1 else {1}), (dtype, dim, gqa, splits)
            cache.check()
            assert cache.state.lengths.tolist()[:2] == [n + 2 for n in lengths]
            del got, want, refs
            cache.release()
            print(f"{dtype} {dim} {gqa}: ok", round(worst, 4), flush=True)
        assert mgr.snapshot().committed == 0
        print("steps ok")
        """,
        "steps ok",
    )
    assert sum(" ok " in line for line in out.splitlines()) == 16, out


@pytest.mark.skipif(not cuda_available(), reason="skipped: no CUDA driver")
def test_the_decode_kernel_matches_sdpa_on_every_shape_on_the_gpu() -> None:
    """Compiled for the GPU: every shape with the step's token written by the kernel, in the
    configuration the decode step takes untuned (:func:`choose_splits` for this device), and
    in one split on a diagonal of the head dims and ratios, with every block masked in the
    one loop on another (``Config.masked``); at head dim 256 (the largest
    tiles) the tuner's own choice, after it measured every configuration the device can hold
    (a tile too big for its shared memory is refused by the compiler and skipped)."""
    import math

    import torch

    from kvvm.kernels.triton_decode import Config, choose_splits, decode_attention, tuned_config

    shapes, sdpa, HEAD_DIMS, GQA = (_SHARED[k] for k in ("shapes", "sdpa", "HEAD_DIMS", "GQA"))
    # Longer ranges than the interpreter's, in compiled code: a little more room than there.
    tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
    dev = torch.device("cuda")
    mp = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(6)
    B, T = 4, 1500
    ends = [1500, 1, 777, 0]
    ws = torch.tensor([[3], [2], [1], [B]], device=dev)  # the last refused: the scratch slot
    wt = torch.tensor([[e - 1 if e else 0] for e in ends], device=dev)
    bounds = torch.tensor([[3, 0, 1500], [2, 0, 1], [1, 40, 777], [B, 0, 0]], dtype=torch.int32, device=dev)
    for dtype, dim, gqa, kv_heads in shapes():
        base = torch.randn(B + 1, T, 2, kv_heads, dim, device=dev, dtype=dtype)
        k, v = base[:, :, 0].transpose(1, 2), base[:, :, 1].transpose(1, 2)
        q = torch.randn(B, 1, gqa * kv_heads, dim, device=dev, dtype=dtype).transpose(1, 2)
        kn = torch.randn(B, 1, kv_heads, dim, device=dev, dtype=dtype).transpose(1, 2)
        vn = torch.randn(B, 1, kv_heads, dim, device=dev, dtype=dtype).transpose(1, 2)
        want_k, want_v = k.clone(), v.clone()
        want_k[ws, :, wt] = kn.transpose(1, 2)
        want_v[ws, :, wt] = vn.transpose(1, 2)
        want = sdpa(q.cpu(), want_k.cpu(), want_v.cpu(), bounds.cpu())
        configs = [Config(choose_splits(B, kv_heads, T, mp))]
        diagonal = (HEAD_DIMS.index(dim) + GQA.index(gqa)) % 4
        if diagonal == 0:
            configs.append(Config(1))  # on a diagonal: each compile takes a while
        if diagonal == 2:
            configs.append(Config(choose_splits(B, kv_heads, T, mp), masked=True))
        if dim == 256 and gqa == 1 and dtype == torch.bfloat16:
            configs.append(tuned_config(q, k.clone(), v.clone(), bounds, 1 / math.sqrt(dim), mp, (kn, vn, ws, wt)))
        for c in configs:
            kk, vv = k.clone(), v.clone()
            got = decode_attention(q, kk, vv, bounds, 1 / math.sqrt(dim), c, (kn, vn, ws, wt))
            err = (got.float().cpu() - want).abs().max().item()
            assert err < tol[dtype], (dtype, dim, gqa, c, err)
            assert torch.equal(kk, want_k) and torch.equal(vv, want_v), (dtype, dim, gqa, c)


def test_the_tuner_off_gives_the_heuristic_configuration_untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``AUTOTUNE`` off (``KVVM_TRITON_AUTOTUNE=0``) the tuner measures nothing (here on
    CPU tensors, outside the interpreter, where a measurement could not even run) and gives
    :func:`choose_splits`' configuration, remembering nothing."""
    import torch

    import kvvm.kernels.triton_decode as td

    monkeypatch.setattr(td, "AUTOTUNE", False)
    q = torch.zeros(3, 8, 1, 64)
    kv = torch.zeros(4, 2, 700, 64)
    bounds = torch.zeros(3, 3, dtype=torch.int32)
    before = dict(td._TUNED)
    assert td.tuned_config(q, kv, kv, bounds, 0.125, 132) == td.Config(td.choose_splits(3, 2, 700, 132))
    assert td._TUNED == before


def test_the_tuned_configurations_are_described_by_their_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`tuned_configs` names each configuration the tuner remembered by its requests,
    query over KV heads, tokens reserved a slot and K/V element type (the tuner's key), and
    the call's variant where it has one (the cascade's), and gives a copy: changing it
    changes nothing the tuner remembers."""
    import torch

    import kvvm.kernels.triton_decode as td

    q, kv = torch.zeros(3, 8, 1, 64), torch.zeros(4, 2, 700, 64, dtype=torch.float8_e4m3fn)
    key = (3, 8, 2, 64, q.dtype, kv.dtype, 700, tuple(kv.stride()), 132, None)
    cascade = key[:-1] + (("cascade", 4),)
    monkeypatch.setattr(td, "_TUNED", {key: td.Config(4, 256, 8, 2), cascade: td.Config(1)})
    described = td.tuned_configs()
    assert described == {
        "batch 3, heads 8/2, 700 tokens reserved, K/V torch.float8_e4m3fn": td.Config(4, 256, 8, 2),
        "batch 3, heads 8/2, 700 tokens reserved, K/V torch.float8_e4m3fn, ('cascade', 4)": td.Config(1),
    }
    described.clear()
    assert len(td._TUNED) == 2


def _misaligned_kv(
    device: str, dtype: torch.dtype, slots: int, kv_heads: int, dim: int, shift: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V strided as the token-major layout (one layer) with a slot stride ``shift``
    elements past a whole number of tokens, as a reservation of whole granules is when the
    bytes of a token do not divide it (head dim 96 at 4 layers: 3072 elements a token, 2730.67
    tokens a slot): slot ``s`` starts ``s * shift`` elements (mod a token) off the rows of
    slot 0."""
    import torch

    token = 2 * kv_heads * dim
    tokens = 10
    slot = tokens * token + shift
    flat = torch.randn(slots * slot, device=device, dtype=dtype)
    size, stride = (slots, kv_heads, tokens, dim), (slot, dim, token, 1)
    return flat.as_strided(size, stride, 0), flat.as_strided(size, stride, kv_heads * dim)


def _emulated_flash(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, used, window=0):  # type: ignore[no-untyped-def]
    """PyTorch's FlashAttention varlen forward as it reads its arguments: request ``b``'s
    queries are rows ``cu_q[b]..cu_q[b+1]``, its keys rows ``cu_k[b]`` on for ``used[b]``
    rows (causal: aligned to the last key; with ``window``, each query its last ``window``
    keys); an empty request's rows are NaN (the caller must drop them)."""
    import torch

    out = torch.full_like(q, float("nan"))
    for b in range(len(cu_q) - 1):
        n, first = int(used[b]), int(cu_k[b])
        if n == 0:
            continue
        assert 0 <= first and first + n <= k.shape[0], "a read outside the packed rows"
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[int(cu_q[b]) : int(cu_q[b + 1])], k[first : first + n], v[first : first + n]))
        ql = qs.shape[2]
        mask = torch.arange(n)[None, :] <= torch.arange(ql)[:, None] + (n - ql) if causal else None
        if window:
            # Each query sees its last `window` keys (FlashAttention's window_size_left + 1).
            seen = torch.arange(n)[None, :] > torch.arange(ql)[:, None] + (n - ql) - window
            mask = seen if mask is None else mask & seen
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[int(cu_q[b]) : int(cu_q[b + 1])] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("shift", [0, 16, 40])
def test_the_flash_path_reads_slots_whose_stride_is_not_whole_tokens(shift: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's kernel sees the slots as one packed sequence of token rows; where a
    slot does not start on a whole token of slot 0's rows, the slots are read in classes by
    their offset (one call each, the other requests reading nothing), no row outside the
    packed tensor is read, and every request gets SDPA's result over its exact tokens (on the
    CPU, FlashAttention's varlen call emulated as it reads its arguments)."""
    import torch

    import kvvm.kernels.attend as attend
    import kvvm.kernels.flash as flash

    monkeypatch.setattr(flash, "_flash_forward", _emulated_flash)
    torch.manual_seed(7)
    k, v = _misaligned_kv("cpu", torch.float32, 6, 2, 16, shift)
    # Slots of every offset class (shift 16: 0, 16, 32, 48 elements into a 64-element token),
    # in any order, ragged, one empty.
    bounds = torch.tensor([[3, 0, 10], [0, 2, 9], [1, 4, 4], [4, 1, 7], [2, 0, 5], [5, 3, 10]], dtype=torch.int32)
    for q_len in (1, 3):
        for window in (0, 4):
            q = torch.randn(6, 8, q_len, 16)
            got = attend._flash(q, k, v, bounds, 0.25, window)
            want = attend.attend(q, k, v, bounds, 0.25, kernel="sdpa", window=window)
            assert not got[2].any(), "an empty range gives zeros"
            assert torch.allclose(got, want, atol=1e-5), (shift, q_len, window, (got - want).abs().max())


def test_a_forwards_flash_plan_is_made_once_and_again_when_its_bounds_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers of one forward share the plan of its token ranges (made by the first);
    bounds changed in place, or another bounds tensor, get their own, and every layer reads
    exactly its request's tokens (on the CPU, FlashAttention emulated)."""
    import torch

    import kvvm.kernels.attend as attend
    import kvvm.kernels.flash as flash

    made = []
    make = flash._make_plan

    def recorded(*a: Any) -> flash.FlashPlan:
        made.append(a)
        return make(*a)

    monkeypatch.setattr(flash, "_flash_forward", _emulated_flash)
    monkeypatch.setattr(flash, "_make_plan", recorded)
    torch.manual_seed(9)
    for shift in (0, 16):
        made.clear()
        k, v = _misaligned_kv("cpu", torch.float32, 6, 2, 16, shift)
        bounds = torch.tensor([[3, 0, 10], [0, 2, 9], [1, 4, 4], [4, 1, 7]], dtype=torch.int32)
        q = torch.randn(4, 8, 3, 16)
        for _ in range(3):  # three layers of one forward
            got = attend._flash(q, k, v, bounds, 0.25)
            assert torch.allclose(got, attend.attend(q, k, v, bounds, 0.25, kernel="sdpa"), atol=1e-5)
        assert len(made) == 1
        bounds[2, 2] = 9  # an empty range now has tokens
        got = attend._flash(q, k, v, bounds, 0.25)
        assert got[2].any() and len(made) == 2
        assert torch.allclose(got, attend.attend(q, k, v, bounds, 0.25, kernel="sdpa"), atol=1e-5)
        attend._flash(q, k, v, bounds.clone(), 0.25)
        assert len(made) == 3


def test_threads_reading_with_the_flash_kernel_each_get_their_own_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads attending at once, each over its own bounds changed in place between its calls,
    each get SDPA's result over exactly their tokens: no thread is handed a plan made for
    another's bounds or for its own before they changed (the plans' memo, raced)."""
    import threading

    import torch

    import kvvm.kernels.attend as attend
    import kvvm.kernels.flash as flash

    monkeypatch.setattr(flash, "_flash_forward", _emulated_flash)
    k, v = _misaligned_kv("cpu", torch.float32, 6, 2, 16, 16)
    errors: list[str] = []
    start = threading.Barrier(4)

    def reader(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        bounds = torch.tensor([[seed % 6, 0, 10], [(seed + 1) % 6, 2, 9]], dtype=torch.int32)
        q = torch.randn(2, 8, 2, 16, generator=gen)
        start.wait()
        for i in range(40):
            bounds[i % 2, 2] = 4 + (seed + i) % 7
            got = attend._flash(q, k, v, bounds, 0.25)
            if not torch.allclose(got, attend.attend(q, k, v, bounds, 0.25, kernel="sdpa"), atol=1e-5):
                errors.append(f"thread {seed}, call {i}")

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.skipif(not cuda_available(), reason="skipped: no CUDA driver")
def test_the_flash_kernel_reads_slots_whose_stride_is_not_whole_tokens_on_the_gpu() -> None:
    """PyTorch's FlashAttention itself over slots whose stride is not a whole number of
    tokens (every offset class), prefill-like (several query tokens, causal) and one."""
    import torch

    from kvvm.kernels.attend import attend

    torch.manual_seed(8)
    k, v = _misaligned_kv("cuda", torch.bfloat16, 6, 2, 96, 64)
    bounds = torch.tensor([[3, 0, 10], [0, 2, 9], [1, 4, 4], [4, 1, 7], [2, 0, 5], [5, 3, 10]], dtype=torch.int32, device="cuda")
    for q_len in (1, 3):
        q = torch.randn(6, 8, q_len, 96, device="cuda", dtype=torch.bfloat16)
        got = attend(q, k, v, bounds, kernel="flash").float().cpu()
        want = attend(q.cpu().float(), k.cpu().float(), v.cpu().float(), bounds.cpu(), kernel="sdpa")
        assert (got - want).abs().max().item() < 2e-2, q_len


@pytest.mark.skipif(not cuda_available(), reason="skipped: no CUDA driver")
def test_a_flash_plan_made_while_a_graph_is_captured_is_not_kept() -> None:
    """The flash kernel captured in a CUDA graph makes its plan inside the capture (its
    tensors filled only when the graph replays); an eager call with the same bounds afterwards
    makes its own, and both the replay and the eager call read exactly each request's tokens."""
    import torch

    from kvvm.kernels.attend import attend

    torch.manual_seed(9)
    k, v = _misaligned_kv("cuda", torch.bfloat16, 6, 2, 96, 0)
    bounds = torch.tensor([[3, 0, 10], [0, 2, 9], [1, 4, 7], [4, 1, 7]], dtype=torch.int32, device="cuda")
    q = torch.randn(4, 8, 3, 96, device="cuda", dtype=torch.bfloat16)
    want = attend(q.cpu().float(), k.cpu().float(), v.cpu().float(), bounds.cpu(), kernel="sdpa")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend(q, k, v, bounds.clone(), kernel="flash")  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attend(q, k, v, bounds, kernel="flash")
    eager = attend(q, k, v, bounds, kernel="flash").float().cpu()
    assert (eager - want).abs().max().item() < 2e-2, "an eager call used the captured plan"
    graph.replay()
    torch.cuda.synchronize()
    assert (captured.float().cpu() - want).abs().max().item() < 2e-2
