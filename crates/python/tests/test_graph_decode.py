"""KvvmCache with the kvvm attention: per-request lengths on the device, ragged batches,
torch.compile, and the device-side guard that keeps a step that was not prepared out of
unmapped memory. On the host backend on a CPU (the compile tests force transformers'
auto-compile onto the CPU); the CUDA graph tests are in test_cuda_graph.py.

Modelled on transformers' generation tests for compileable caches
(``test_generate_compile_model_forward``, ``test_generate_with_static_cache``,
``test_generate_continue_from_past_key_values``): the same properties, on tiny random
models built from configs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest

import kvvm
from conftest import host_available

if TYPE_CHECKING:
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="skipped: no torch")
    transformers = pytest.importorskip("transformers", reason="skipped: no transformers")

from kvvm.kernels.attend import attend  # noqa: E402
from kvvm.transformers import KvvmCache, use_kvvm_attention  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

VOCAB = 1000


def tiny_model(kvvm_attention: bool = True) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
    )
    cfg._attn_implementation = "sdpa"
    model: Any = transformers.LlamaForCausalLM(cfg)
    model = model.to(torch.float32).eval()
    if kvvm_attention:
        use_kvvm_attention(model)
    return model


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model()


@pytest.fixture(scope="module")
def reference() -> Any:
    """The same weights attending with plain SDPA (the reference)."""
    return tiny_model(kvvm_attention=False)


@pytest.fixture
def mgr() -> kvvm.Manager:
    return kvvm.Manager("host", precommit=True, headroom_tokens=16)


def compile_everywhere() -> transformers.CompileConfig:
    cc = transformers.CompileConfig(fullgraph=True, mode="default")
    # transformers compiles on accelerators only unless told otherwise.
    cc._compile_all_devices = True  # type: ignore[assignment]  # transformers declares it None alone
    return cc


def test_a_kvvm_cache_with_the_kvvm_attention_is_compileable(model, reference, mgr) -> None:
    kc = KvvmCache(model.config, 2, 64, manager=mgr, dtype="fp32")
    assert kc.is_compileable and kc.device_lengths
    kc.release()
    plain = KvvmCache(reference.config, 2, 64, manager=mgr, dtype="fp32")
    assert not plain.is_compileable, "exact-length views change shape at every step"
    plain.release()


def test_a_ragged_batch_decodes_as_each_request_alone(model, reference, mgr) -> None:
    """Requests of different lengths in one batch, no padding: every step's logits equal a
    DynamicCache run of each request on its own."""
    lengths = [37, 5, 70]
    prompts = [torch.randint(0, VOCAB, (1, n)) for n in lengths]
    kc = KvvmCache(model.config, 3, 200, manager=mgr, dtype="fp32")
    refs = [transformers.DynamicCache(config=reference.config) for _ in lengths]
    with torch.no_grad():
        tokens = []
        for slot, (ids, dc) in enumerate(zip(prompts, refs, strict=True)):
            with kc.select(slot):
                got = model(input_ids=ids, past_key_values=kc, use_cache=True).logits
            want = reference(input_ids=ids, past_key_values=dc, use_cache=True).logits
            assert torch.allclose(got, want, atol=1e-5)
            tokens.append(want[:, -1:].argmax(-1))
        assert kc.state.host_lengths == lengths
        tok = torch.cat(tokens)
        for step in range(12):
            pos = kc.state.positions(1)
            got = model(input_ids=tok, position_ids=pos, past_key_values=kc, use_cache=True).logits
            want = torch.cat(
                [reference(input_ids=tok[i : i + 1], past_key_values=dc, use_cache=True).logits for i, dc in enumerate(refs)]
            )
            assert torch.allclose(got, want, atol=1e-5), (step, (got - want).abs().max())
            tok = want[:, -1:].argmax(-1)
    assert kc.state.lengths.tolist() == [n + 12 for n in lengths]
    kc.check()
    # Each request holds the windows of its own tokens, not of the longest.
    plan = kc.plan
    assert kc.committed_bytes <= sum(plan.committed_bytes_for_tokens(n + 12 + 16) for n in lengths)
    kc.release()


def test_generate_with_left_padding_gives_the_reference_tokens(model, reference, mgr) -> None:
    ids = torch.randint(0, VOCAB, (3, 40))
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    mask[2, :25] = 0
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        kc = KvvmCache(model.config, 3, 128, manager=mgr, dtype="fp32")
        got = model.generate(ids, attention_mask=mask, past_key_values=kc, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    assert kc.state.host_starts == [9, 0, 25], "the padding is recorded and never read"
    kc.release()


def test_generate_compiled_on_the_cpu_gives_the_eager_tokens(model, reference, mgr) -> None:
    """transformers' own auto-compile of the decode step (forced onto the CPU), with a
    ragged (left-padded) batch: the same tokens as the eager reference."""
    ids = torch.randint(0, VOCAB, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        kc = KvvmCache(model.config, 2, 96, manager=mgr, dtype="fp32")
        got = model.generate(
            ids, attention_mask=mask, past_key_values=kc, max_new_tokens=6, do_sample=False,
            compile_config=compile_everywhere(),
        )
    assert torch.equal(got, want)
    assert model._compiled_call is not None, "generate compiled the decode step"
    kc.check()
    kc.release()


def test_generate_continues_from_a_returned_cache(model, reference, mgr) -> None:
    """Generate, then generate again from the returned cache with the outputs plus new
    tokens: the same as one generate over everything."""
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        kc = KvvmCache(model.config, 2, 128, manager=mgr, dtype="fp32")
        first = model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=kc, max_new_tokens=5,
            do_sample=False, return_dict_in_generate=True,
        )
        assert first.past_key_values is kc
        more = torch.cat([first.sequences, torch.randint(0, VOCAB, (2, 3))], dim=1)
        got = model.generate(
            more, attention_mask=torch.ones_like(more), past_key_values=kc, max_new_tokens=4, do_sample=False
        )
        want = reference.generate(more, attention_mask=torch.ones_like(more), max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)
    kc.release()


def test_a_step_that_was_not_prepared_never_reaches_an_unmapped_window(model) -> None:
    """A compiled step runs no Python on the host: without the host's preparation its
    write lies past the committed windows. On the device it goes to the scratch slot (on
    the host backend a write into an unmapped window kills the process), the requests do
    not advance, and the next check raises."""
    mgr = kvvm.Manager("host")  # no pre-committer: past the limit nothing is mapped
    kc = KvvmCache(model.config, 2, 4096, manager=mgr, dtype="fp32")
    # fp32, 2 layers, 2 KV heads of 32: 1 KiB per token, 2048 tokens per 2 MiB window.
    window = mgr.granule // kc.geometry.bytes_per_token
    ids = torch.randint(0, VOCAB, (2, window))
    step = torch.compile(model.forward, fullgraph=True, dynamic=False)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=kc, use_cache=True)
        assert kc.state.host_limits == [window, window], "the prefill fills its windows exactly"
        pos = kc.state.positions(1)
        tok = ids[:, -1:]
        # The traced step prepares nothing; the guard refuses the write at the limit.
        kc.state.prepared = True
        step(input_ids=tok, position_ids=pos, past_key_values=kc, use_cache=True)
    assert kc.state.lengths.tolist() == [window, window]
    with pytest.raises(kvvm.InvalidArgumentError, match="refused"):
        kc.check()
    kc.check()  # counted once
    # Prepared, the same compiled step writes there and advances.
    with torch.no_grad():
        kc.prepare(1)
        step(input_ids=tok, position_ids=pos, past_key_values=kc, use_cache=True)
    assert kc.state.lengths.tolist() == [window + 1, window + 1]
    kc.check()
    kc.release()


def test_growth_the_budget_cannot_grant_is_backpressure_before_the_step(model) -> None:
    mgr = kvvm.Manager("host", budget_bytes=6 << 20)
    kc = KvvmCache(model.config, 2, 8192, manager=mgr, dtype="fp32")
    window = mgr.granule // kc.geometry.bytes_per_token
    ids = torch.randint(0, VOCAB, (2, window))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=kc, use_cache=True)
        before = kc.state.lengths.clone()
        with pytest.raises(kvvm.BackpressureError):
            model(input_ids=ids[:, -1:], past_key_values=kc, use_cache=True)
    assert torch.equal(kc.state.lengths, before), "nothing ran"
    assert kc.state.host_lengths == [window, window]
    kc.release()


def test_release_is_refused_while_a_graph_is_alive_and_shrink_lowers_the_limits(model, mgr) -> None:
    kc = KvvmCache(model.config, 1, 4096, manager=mgr, dtype="fp32")

    class Graph:
        """Stands for a captured graph (the cache holds it weakly)."""

    g = Graph()
    with kc.capture(g):
        pass
    with pytest.raises(kvvm.GraphsAliveError):
        kc.release()
    # 1 KiB per token: 2040 tokens and the pre-committer's headroom reach a second window.
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 2040)), past_key_values=kc, use_cache=True)
    mgr.wait_precommit_idle()
    assert kc.committed_bytes == 2 * mgr.granule
    assert kc.shrink() == mgr.granule, "shrink runs with a graph alive"
    assert kc.committed_bytes == mgr.granule
    assert kc.state.host_limits == [2048] and kc.state.limits.tolist() == [2048]
    del g
    assert kc.release() > 0


def test_attend_reads_each_request_range_as_sdpa_would() -> None:
    torch.manual_seed(1)
    batch, heads, kv_heads, dim, tokens = 3, 8, 2, 32, 90
    base = torch.randn(batch, tokens, 2, kv_heads, dim)  # token-major: [B, T, K/V, H, D]
    k, v = base[:, :, 0].transpose(1, 2), base[:, :, 1].transpose(1, 2)
    # Requests in slots 2, 0 and 1 (any order), ragged and one empty.
    bounds = torch.tensor([[2, 0, 90], [0, 10, 41], [1, 3, 3]], dtype=torch.int32)
    for q_len in (1, 4):
        q = torch.randn(batch, heads, q_len, dim)
        got = attend(q, k, v, bounds)
        for b, (slot, s, e) in enumerate(bounds.tolist()):
            if e == s:
                assert not got[b].any()
                continue
            n = e - s
            mask = torch.arange(n)[None, :] <= torch.arange(q_len)[:, None] + (n - q_len)
            want = torch.nn.functional.scaled_dot_product_attention(
                q[b : b + 1], k[slot : slot + 1, :, s:e], v[slot : slot + 1, :, s:e], attn_mask=mask, enable_gqa=True
            )[0].transpose(0, 1)
            assert torch.allclose(got[b], want, atol=1e-5)


def test_the_triton_decode_kernel_matches_the_reference_in_the_interpreter() -> None:
    """The CUDA kernel's logic, run by Triton's interpreter on CPU tensors (in a process of
    its own: Triton reads ``TRITON_INTERPRET`` once): every split count, ragged ranges in
    any slot order, an empty one, a head dim that is not a power of two."""
    pytest.importorskip("triton", reason="skipped: no triton")
    code = textwrap.dedent(
        """
        import math, torch
        from kvvm.kernels.attend import attend
        from kvvm.kernels.triton_decode import decode_attention
        torch.manual_seed(2)
        batch, heads, kv_heads, tokens = 3, 8, 2, 150
        for dim in (32, 48):
            base = torch.randn(batch, tokens, 3, 2, kv_heads, dim)
            k, v = base[:, :, 1, 0].transpose(1, 2), base[:, :, 1, 1].transpose(1, 2)
            q = torch.randn(batch, 1, heads, dim).transpose(1, 2)
            bounds = torch.tensor([[1, 0, 150], [0, 7, 70], [2, 9, 9]], dtype=torch.int32)
            # The reference is SDPA (under the interpreter "auto" is this kernel itself).
            want = attend(q, k, v, bounds, kernel="sdpa")
            for splits in (1, 2, 8):
                got = decode_attention(q, k, v, bounds, 1 / math.sqrt(dim), splits)
                err = (got - want).abs().max().item()
                assert err < 1e-4, (dim, splits, err)
        # Fused: the kernel writes the step's token and attends to it from registers; a
        # refused write (to the scratch slot, the last) is not attended to.
        B, H, Hk, T, D = 3, 8, 2, 160, 32
        base = torch.randn(B + 1, T, 2, 2, Hk, D)
        k, v = base[:, :, 1, 0].transpose(1, 2), base[:, :, 1, 1].transpose(1, 2)
        q = torch.randn(B, 1, H, D).transpose(1, 2)
        kn = torch.randn(B, 1, Hk, D).transpose(1, 2)
        # V as a fused projection gives it: a slice of a wider row (other strides than K's).
        vn = torch.randn(B, 1, 3 * Hk * D)[..., 2 * Hk * D :].view(B, 1, Hk, D).transpose(1, 2)
        assert kn.stride() != vn.stride()
        ws, wt = torch.tensor([[0], [1], [B]]), torch.tensor([[100], [7], [0]])
        bounds = torch.tensor([[0, 0, 101], [1, 2, 8], [2, 0, 0]], dtype=torch.int32)
        for splits in (1, 2, 4):
            k2, v2 = k.clone(), v.clone()
            k2[ws, :, wt] = kn.transpose(1, 2)
            v2[ws, :, wt] = vn.transpose(1, 2)
            want = attend(q, k2, v2, bounds, kernel="sdpa")
            kk, vv = k.clone(), v.clone()
            got = decode_attention(q, kk, vv, bounds, 1 / math.sqrt(D), splits, (kn, vn, ws, wt))
            assert (got - want).abs().max().item() < 1e-4, splits
            assert torch.equal(kk, k2) and torch.equal(vv, v2)
        print("kernel ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "kernel ok" in r.stdout, r.stderr[-3000:]
