"""The captured decode step on a CUDA GPU: ragged requests across window boundaries,
transformers' own compile of ``generate`` (CUDA graphs), the attention kernels against each
other, and what a graph may never do (touch an unmapped window, outlive the cache's memory).
Skipped without CUDA."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

import kvvm
from conftest import cuda_available

if TYPE_CHECKING:
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="skipped: no CUDA (torch is not installed)")
    transformers = pytest.importorskip("transformers", reason="skipped: no CUDA (no transformers)")


pytestmark = pytest.mark.skipif(not cuda_available(), reason="skipped: no CUDA driver")

from kvvm.kernels.attend import attend  # noqa: E402
from kvvm.graph import DecodeGraph  # noqa: E402
from kvvm.transformers.projections import fuse_projections  # noqa: E402
from kvvm.transformers import KvvmCache, use_kvvm_attention  # noqa: E402

VOCAB = 4096


def _model(kvvm_attention: bool) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=8192,
    )
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model: Any = transformers.LlamaForCausalLM(cfg)
        model = model.to(torch.bfloat16).eval()
    if kvvm_attention:
        use_kvvm_attention(model)
    return model


@pytest.fixture(scope="module")
def model() -> Any:
    return _model(True)


@pytest.fixture(scope="module")
def reference() -> Any:
    return _model(False)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 agreement: small logit differences, and the same argmax wherever the top two
    reference logits are further apart than bf16 resolves."""
    got, want = got.float(), want.float()
    assert (got - want).abs().max().item() < 0.15
    top2 = want.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 ** -6 * top2[..., 0].abs().clamp_min(1)
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize(("compile", "fuse"), [(False, False), (True, False), (True, True)])
def test_a_captured_step_decodes_ragged_requests_across_window_boundaries(model, reference, compile, fuse) -> None:
    # 4 layers x 2 x 2 KV heads x 64 x bf16 = 2 KiB per token: a 2 MiB window holds 1024.
    fused = fuse_projections(model) if fuse else None
    try:
        _decode_ragged(model, reference, compile)
    finally:
        if fused is not None:
            fused.restore()


def _decode_ragged(model: Any, reference: Any, compile: bool) -> None:
    lengths = [1015, 37, 1022, 500]
    prompts = [torch.randint(0, VOCAB, (1, n), device="cuda") for n in lengths]
    mgr = kvvm.Manager("cuda", precommit=True, headroom_tokens=4)
    cache = KvvmCache(model.config, 4, 2048, manager=mgr)
    refs = [transformers.DynamicCache(config=reference.config) for _ in lengths]
    firsts: list[torch.Tensor] = []
    with torch.no_grad():
        for slot, (p, dc) in enumerate(zip(prompts, refs, strict=True)):
            with cache.select(slot):
                model(input_ids=p, past_key_values=cache, use_cache=True)
            firsts.append(reference(input_ids=p, past_key_values=dc, use_cache=True).logits[:, -1])
        step = DecodeGraph(model, cache, compile=compile)
        tok = torch.cat(firsts).argmax(-1)
        for _ in range(24):  # slots 0 and 2 cross into their second window
            got = step(tok).clone()
            want = torch.cat(
                [reference(input_ids=tok[i : i + 1, None], past_key_values=dc, use_cache=True).logits[:, -1] for i, dc in enumerate(refs)]
            )
            _close(got, want)
            tok = want.argmax(-1)
    torch.cuda.synchronize()
    cache.check()
    assert cache.state.lengths.tolist() == [n + 24 for n in lengths]
    with pytest.raises(kvvm.GraphsAliveError):
        cache.release()
    step.close()
    assert cache.release() > 0


def test_a_replay_that_was_not_prepared_is_refused_on_the_device(model) -> None:
    """Replayed without its preparation, a step's write lies in a window never committed:
    the device sends it to the scratch slot (a write there would be an illegal address and
    poison the context), the requests stay where they were, and the check says so."""
    mgr = kvvm.Manager("cuda")  # no pre-committer: past the limit nothing is mapped
    cache = KvvmCache(model.config, 2, 4096, manager=mgr)
    ids = torch.randint(0, VOCAB, (2, 1024), device="cuda")
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        step = DecodeGraph(model, cache, compile=False)
    assert cache.state.host_limits == [1024, 1024]
    assert step.graph is not None
    step.graph.replay()  # no cache.prepare(): the window of token 1024 is not mapped
    torch.cuda.synchronize()  # an illegal address would raise here
    assert cache.state.lengths.tolist() == [1024, 1024]
    with pytest.raises(kvvm.InvalidArgumentError, match="refused"):
        cache.check()
    step(ids[:, -1])  # prepared: it writes and advances
    torch.cuda.synchronize()
    assert cache.state.lengths.tolist() == [1025, 1025]
    step.close()
    cache.release()


def test_a_capture_the_cache_does_not_know_of_is_refused(model) -> None:
    cache = KvvmCache(model.config, 1, 256, backend="cuda")
    ids = torch.randint(0, VOCAB, (1, 8), device="cuda")
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        g = torch.cuda.CUDAGraph()
        with pytest.raises(Exception, match="capture"):
            with torch.cuda.graph(g):
                model(input_ids=ids[:, -1:], position_ids=cache.state.positions(1), past_key_values=cache, use_cache=True)
    del g
    cache.release()


def test_generate_compiles_the_kvvm_step_and_gives_the_eager_tokens(model) -> None:
    """transformers' own auto-compile (CUDA graphs) of a ragged, left-padded batch: the same
    greedy tokens as the same cache decoding eagerly."""
    ids = torch.randint(0, VOCAB, (3, 300), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :120] = 0
    with torch.no_grad():
        eager_cache = KvvmCache(model.config, 3, 512, backend="cuda")
        eager = model.generate(ids, attention_mask=mask, past_key_values=eager_cache, max_new_tokens=16,
                               do_sample=False, disable_compile=True)
        cache = KvvmCache(model.config, 3, 512, backend="cuda")
        assert model._valid_auto_compile_criteria({"past_key_values": cache}, model.generation_config)
        got = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=16, do_sample=False)
    assert (got == eager).float().mean().item() > 0.95
    cache.check()
    eager_cache.release()
    cache.release()


@pytest.mark.parametrize("kernel", ["triton", "flash"])
def test_the_kernels_read_each_request_range_and_replay_at_new_lengths(kernel) -> None:
    torch.manual_seed(3)
    slots, heads, kv_heads, dim, tokens = 5, 32, 8, 128, 3000
    slab = torch.randn(slots, tokens, 2, 2, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    k, v = slab[:, :, 1, 0].transpose(1, 2), slab[:, :, 1, 1].transpose(1, 2)
    q = torch.randn(4, 1, heads, dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    bounds = torch.tensor([[3, 0, 2999], [0, 100, 1701], [4, 5, 6], [1, 0, 64]], dtype=torch.int32, device="cuda")
    ref = attend(q.cpu().float(), k.cpu().float(), v.cpu().float(), bounds.cpu())
    got = attend(q, k, v, bounds, kernel=kernel)
    assert (got.float().cpu() - ref).abs().max().item() < 2e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = attend(q, k, v, bounds, kernel=kernel)
    bounds[:, 2] = torch.tensor([17, 1900, 700, 3000], dtype=torch.int32, device="cuda")
    g.replay()
    torch.cuda.synchronize()
    ref = attend(q.cpu().float(), k.cpu().float(), v.cpu().float(), bounds.cpu())
    assert (out.float().cpu() - ref).abs().max().item() < 2e-2


def test_every_tuned_configuration_of_the_triton_kernel_agrees_with_sdpa() -> None:
    """Each configuration the autotuner may choose (one split, whose program writes the
    output itself, and several, merged by a second kernel; every block, warp and stage
    shape) gives SDPA's result on ragged requests in bf16, with the step's token written by
    the kernel and attended from registers."""
    pytest.importorskip("triton", reason="skipped: no triton")
    import math

    from kvvm.kernels.triton_decode import _SHAPES, Config, decode_attention

    torch.manual_seed(3)
    dev = torch.device("cuda")
    batch, heads, kv_heads, tokens, dim = 5, 32, 8, 1200, 128
    base = torch.randn(batch + 1, tokens, 2, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    k, v = base[:, :, 0].transpose(1, 2), base[:, :, 1].transpose(1, 2)
    q = torch.randn(batch, 1, heads, dim, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    kn = torch.randn(batch, 1, kv_heads, dim, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    vn = torch.randn(batch, 1, kv_heads, dim, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    ends = [1200, 1, 640, 77, 0]
    ws = torch.tensor([[4], [3], [2], [1], [batch]], device=dev)
    wt = torch.tensor([[e - 1 if e else 0] for e in ends], device=dev)
    bounds = torch.tensor([[4 - i, 3 if e > 3 else 0, e] for i, e in enumerate(ends)], dtype=torch.int32, device=dev)
    bounds[4] = torch.tensor([batch, 0, 0])
    k2, v2 = k.clone(), v.clone()
    k2[ws, :, wt] = kn.transpose(1, 2)
    v2[ws, :, wt] = vn.transpose(1, 2)
    want = attend(q, k2, v2, bounds, kernel="sdpa").float()
    tried = 0
    for splits in (1, 2, 4, 8, 16):
        for block, warps, stages in _SHAPES:
            kk, vv = k.clone(), v.clone()
            got = decode_attention(q, kk, vv, bounds, 1 / math.sqrt(dim), Config(splits, block, warps, stages), (kn, vn, ws, wt))
            err = (got.float() - want).abs().max().item()
            assert err < 3e-2, (splits, block, warps, stages, err)
            assert torch.equal(kk, k2) and torch.equal(vv, v2)
            tried += 1
    assert tried == 5 * len(_SHAPES)


def test_a_step_whose_first_slot_holds_nothing_decodes_the_others(model, reference) -> None:
    """The Triton kernel reaches every slot from the last (the scratch slot, always mapped):
    Triton refuses a pointer argument into unmapped memory, and the first slot's first
    window is not mapped while it holds no request (nor once a sliding layer gave it back)."""
    mgr = kvvm.Manager("cuda", precommit=True, headroom_tokens=4)
    cache = KvvmCache(model, 3, 512, manager=mgr)
    torch.manual_seed(3)
    prompts = {1: torch.randint(0, VOCAB, (1, 40), device="cuda"), 2: torch.randint(0, VOCAB, (1, 70), device="cuda")}
    refs, tok = {}, torch.zeros(3, dtype=torch.long, device="cuda")
    with torch.no_grad():
        for slot, p in prompts.items():
            with cache.select(slot):
                model(input_ids=p, past_key_values=cache, use_cache=True)
            refs[slot] = transformers.DynamicCache(config=reference.config)
            tok[slot] = reference(input_ids=p, past_key_values=refs[slot], use_cache=True).logits[0, -1].argmax()
        step = DecodeGraph(model, cache, slots=[1, 2])
        try:
            for _ in range(4):
                got = step(tok, slots=[1, 2])
                for slot in prompts:
                    want = reference(input_ids=tok[slot].view(1, 1), past_key_values=refs[slot], use_cache=True).logits[0, -1]
                    _close(got[slot], want)
                tok = got.argmax(-1)
        finally:
            step.close()
            cache.release()
