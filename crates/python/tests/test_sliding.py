"""Sliding-window and hybrid models on KvvmCache: Mistral-, Gemma-2- and Gemma-3-shaped tiny
random models (the real models' per-layer shapes: KV heads, head dim, GQA ratio, Gemma 2's
logit soft cap, Gemma 3's 5 local to 1 global layers and two RoPE bases), fp32 on the host
backend. ``generate`` and the engine give DynamicCache's greedy tokens with prompts and
generations longer than the window; the sliding layers' memory is bounded by their window
(computed from the plan) while the full layers keep everything; a shared prefix gives the
sliding layers only its last tokens; nothing is held afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable
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

from kvvm.transformers.cache_groups import SLIDING_PREFIX_CACHE_REFUSAL, CacheGroup, LayerGroup, layer_groups  # noqa: E402
from kvvm.engine import Engine  # noqa: E402
from kvvm.transformers import KvvmCache, use_kvvm_attention  # noqa: E402
from kvvm.prefix import KvvmPrefix  # noqa: E402

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

VOCAB = 256


def mistral_config(window: int = 48) -> transformers.MistralConfig:
    """Mistral 7B's layer: 32 query heads, 8 KV heads of 128 (16 KiB a token in fp32 over 2
    layers: 128 tokens a 2 MiB window), every layer sliding."""
    return transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=VOCAB, sliding_window=window,
        max_position_embeddings=8192,
    )


def gemma2_config(window: int = 48) -> transformers.Gemma2Config:
    """Gemma 2 2B's layer: 8 query heads, 4 KV heads of 256, query_pre_attn_scalar 256, logit
    soft caps (50 on attention, 30 on the output); sliding and global layers alternate (2 of
    each)."""
    return transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=VOCAB, sliding_window=window,
        max_position_embeddings=8192, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )


def gemma3_config(window: int = 48) -> transformers.Gemma3TextConfig:
    """Gemma 3 1B's layer: 4 query heads, 1 KV head of 256, query_pre_attn_scalar 256; 5 local
    layers to 1 global, local RoPE base 10k and global 1M."""
    return transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=VOCAB, sliding_window=window,
        max_position_embeddings=8192, query_pre_attn_scalar=256,
    )


MODELS: dict[str, tuple[Callable[[int], transformers.PreTrainedConfig], type[transformers.PreTrainedModel]]] = {
    "mistral": (mistral_config, transformers.MistralForCausalLM),
    "gemma2": (gemma2_config, transformers.Gemma2ForCausalLM),
    "gemma3": (gemma3_config, transformers.Gemma3ForCausalLM),
}


def build(kind: str, attention: str = "eager", window: int = 48) -> Any:
    """A tiny random model of ``kind`` attending with ``attention`` (``"kvvm"``: the kvvm
    attention); the same weights for every call."""
    make, cls = MODELS[kind]
    cfg = make(window)
    cfg._attn_implementation = "eager" if attention == "kvvm" else attention
    torch.manual_seed(0)
    model: Any = cls(cfg)
    model = model.to(torch.float32).eval()
    if kind == "gemma2":
        # Sharp attention: logits of tens, where the cap of 50 acts (random weights' are
        # about 0.03, which no cap changes: a kernel ignoring it would pass).
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(30)
                layer.self_attn.k_proj.weight.mul_(30)
    if attention == "kvvm":
        use_kvvm_attention(model)
    return model


def sliding_group(cache: KvvmCache) -> CacheGroup:
    (group,) = [g for g in cache.groups if g.spec.sliding]
    return group


def window_bound(group: CacheGroup, step_tokens: int, ahead: int = 0) -> int:
    """The most a request holds in a sliding group, from its plan: the windows of the
    ``window - 1`` tokens a step after them reads, the step's and ``ahead`` committed in
    advance, plus one window each fragment may start before them (a window goes only once
    every token in it lies behind)."""
    plan = group.plan
    return plan.committed_bytes_for_tokens(group.window - 1 + step_tokens + ahead) + plan.fragments * plan.granule


# ---- which layers slide ----


def test_layers_are_grouped_as_the_configs_say() -> None:
    assert layer_groups(mistral_config(), 1024) == [LayerGroup((0, 1), 48)]
    assert layer_groups(gemma2_config(), 1024) == [LayerGroup((1, 3), None), LayerGroup((0, 2), 48)]
    assert layer_groups(gemma3_config(), 1024) == [LayerGroup((5,), None), LayerGroup((0, 1, 2, 3, 4), 48)]
    qwen = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert layer_groups(qwen, 1024) == [LayerGroup((0, 1), None), LayerGroup((2, 3), 64)]
    assert layer_groups(transformers.Qwen2Config(num_hidden_layers=4), 1024) == [LayerGroup((0, 1, 2, 3), None)]
    # A window the cache never outgrows never slides: one group, as for full attention.
    assert layer_groups(gemma2_config(window=4096), 4096) == [LayerGroup((0, 1, 2, 3), None)]
    assert LayerGroup((0,), 48).kept_from(100) == 53 and LayerGroup((0,), 48).kept_from(20) == 0


def test_what_cannot_be_laid_out_is_refused_with_the_reason() -> None:
    chunked = types.SimpleNamespace(num_hidden_layers=2, attention_chunk_size=128)
    with pytest.raises(kvvm.InvalidArgumentError, match="chunked_attention"):
        layer_groups(chunked, 1024)
    shared = types.SimpleNamespace(num_hidden_layers=2, num_kv_shared_layers=1)
    with pytest.raises(kvvm.InvalidArgumentError, match="share"):
        layer_groups(shared, 1024)
    no_window = types.SimpleNamespace(num_hidden_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=None)
    with pytest.raises(kvvm.InvalidArgumentError, match="sliding_window"):
        layer_groups(no_window, 1024)
    with pytest.raises(kvvm.InvalidArgumentError, match="causal"):
        KvvmCache(transformers.Gemma3TextConfig(use_bidirectional_attention=True), 1, 64, backend="host")


# ---- generate: DynamicCache's tokens, bounded memory ----

#: Prompts (3 requests, one left-padded) past several windows of every shape's sliding group.
PROMPT = {"mistral": 200, "gemma2": 200, "gemma3": 260}


@pytest.mark.parametrize("attention", ["eager", "kvvm"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_generate_gives_dynamic_cache_tokens_and_the_window_bounds_the_memory(kind: str, attention: str) -> None:
    reference = build(kind, "eager")
    model = build(kind, attention)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, PROMPT[kind]))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    new = 16
    mgr = kvvm.Manager("host")
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        cache = KvvmCache(model, 3, 512, manager=mgr)
        got = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False)
    assert torch.equal(got, want)
    group = sliding_group(cache)
    length = PROMPT[kind] + new - 1
    for slot in range(3):
        seq = group.batch[slot]
        # The windows behind the window went back: what is left is the window's (a decode
        # step reads window - 1 tokens and its own) and a full layer's memory is untouched.
        assert seq.forgotten_tokens == group.host_floors[slot] > 0
        assert seq.owned_bytes <= window_bound(group, 1)
        assert seq.owned_bytes < group.plan.committed_bytes_for_tokens(length)
        for g in cache.groups:
            if not g.spec.sliding:
                assert g.batch[slot].owned_bytes == g.plan.committed_bytes_for_tokens(length)
    cache.release()
    assert mgr.snapshot().committed == 0


def test_a_4096_token_request_holds_only_its_512_token_window_on_the_sliding_layers() -> None:
    """Gemma 3's real window (512) and layer mix: a 4096-token prompt prefilled in chunks of
    512, then decoded. After every step the sliding layers hold the windows of their window
    (bounded from the plan: about a tenth of the request's length there), the global layer
    every token, the pointers never change, and the logits and greedy tokens are
    DynamicCache's."""
    reference = build("gemma3", "sdpa", window=512)
    model = build("gemma3", "kvvm", window=512)
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (1, 4096))
    mgr = kvvm.Manager("host")
    cache = KvvmCache(model, 1, 4200, manager=mgr)
    group = sliding_group(cache)
    (full,) = [g for g in cache.groups if not g.spec.sliding]
    pointers = [t.data_ptr() for layer in range(6) for t in cache._kv(layer)]
    dc = transformers.DynamicCache(config=reference.config)
    chunk = 512
    with torch.no_grad():
        for start in range(0, 4096, chunk):
            part = ids[:, start : start + chunk]
            want = reference(input_ids=part, past_key_values=dc, use_cache=True).logits
            got = model(input_ids=part, past_key_values=cache, use_cache=True).logits
            assert torch.allclose(got, want, atol=1e-4), (start, (got - want).abs().max())
            assert group.batch[0].owned_bytes <= window_bound(group, chunk)
        tokens = []
        token = want[:, -1:].argmax(-1)
        for _ in range(8):
            want = reference(input_ids=token, past_key_values=dc, use_cache=True).logits
            got = model(input_ids=token, past_key_values=cache, use_cache=True).logits
            assert torch.allclose(got, want, atol=1e-4)
            assert group.batch[0].owned_bytes <= window_bound(group, 1)
            token = want[:, -1:].argmax(-1)
            tokens.append(int(token))
    assert got[:, -1].argmax(-1).tolist() == [tokens[-1]]
    held = group.batch[0].owned_bytes
    # 5 layers x 1 KV head of 256 x K, V x fp32: 10 KiB a token, 204.8 tokens a window.
    assert group.plan.strides()["token"] == 10240
    assert held <= 4 * mgr.granule, f"{held} B: the window's 512 tokens touch 4 windows at most"
    assert full.batch[0].owned_bytes == full.plan.committed_bytes_for_tokens(4104)
    assert held * 4 < group.plan.committed_bytes_for_tokens(4104), "far below what every token would hold"
    assert [t.data_ptr() for layer in range(6) for t in cache._kv(layer)] == pointers
    cache.release()
    assert mgr.snapshot().committed == 0


# ---- the engine ----


def test_the_engine_gives_each_request_its_own_tokens_and_holds_nothing_after() -> None:
    """Gemma 2 (alternating layers, soft caps): more requests than slots, prompts of
    different lengths past the window, prefilled in chunks between the others' decode
    steps; each request's tokens are its own greedy generation, alone."""
    model = build("gemma2", "eager", window=40)
    reference = build("gemma2", "eager", window=40)
    torch.manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (150, 61, 190, 97)]
    new = [12, 30, 6, 20]
    want = []
    with torch.no_grad():
        for p, n in zip(prompts, new, strict=True):
            ids = torch.tensor([p])
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
            want.append(out[0, len(p) :].tolist())
    mgr = kvvm.Manager("host", precommit=True, headroom_tokens=8)
    engine = Engine(model, slots=3, max_len=256, manager=mgr, prefill_chunk=64, eos_token_ids=[])
    requests = [engine.submit(p, n) for p, n in zip(prompts, new, strict=True)]
    peak = 0
    group = sliding_group(engine.cache)
    while not engine.idle:
        engine.step()
        peak = max(peak, max(group.batch[i].owned_bytes for i in range(3)))
    assert [r.tokens for r in requests] == want
    assert peak <= window_bound(group, 64, ahead=2 * 8)
    engine.close()
    assert mgr.snapshot().committed == 0


# ---- prefixes ----


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_prefix_is_shared_across_sliding_layers_by_its_last_tokens(kind: str) -> None:
    """A system prompt of several windows built once and given to 3 requests: on the full
    layers its whole windows mapped read-only, on the sliding layers only the tokens the next
    step reads, copied (the rest forgotten from the start: each slot holds about its window
    there); each request prefills its own tail and decodes, and the greedy tokens are
    DynamicCache's over the whole prompt. The engine's automatic prefix cache is refused for
    such models, with the reason."""
    reference = build(kind, "eager")
    model = build(kind, "kvvm")
    mgr = kvvm.Manager("host")
    torch.manual_seed(5)
    system = torch.randint(0, VOCAB, (1, 300))
    tails = torch.randint(0, VOCAB, (3, 9))
    with torch.no_grad():
        prefix = KvvmPrefix.build(model, system, manager=mgr, max_cache_len=512)
        assert len(prefix.shares) == len(layer_groups(model.config, 512))
        cache = KvvmCache.from_prefix(prefix, 3, 512)
        group = sliding_group(cache)
        first = group.spec.kept_from(300)
        for slot in range(3):
            assert group.batch[slot].forgotten_tokens == group.host_floors[slot] == first
            assert group.batch[slot].owned_bytes <= window_bound(group, 1)
        full = torch.cat([system.expand(3, -1), tails], 1)
        want = reference.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=8, do_sample=False)
        got = model.generate(
            full, attention_mask=torch.ones_like(full), past_key_values=cache, max_new_tokens=8, do_sample=False
        )
    assert torch.equal(got, want)
    cache.release()
    with pytest.raises(kvvm.InvalidArgumentError) as e:
        Engine(model, slots=1, max_len=512, manager=mgr, prefix_cache_bytes=1 << 24)
    assert str(e.value) == SLIDING_PREFIX_CACHE_REFUSAL
    assert prefix.cache is not None
    prefix.cache.release()
    del prefix
    assert mgr.snapshot().committed == mgr.snapshot().shared == 0


def test_a_window_the_cache_never_outgrows_shares_its_prefix_as_full_attention() -> None:
    """A window at least as long as the cache never slides: one group, shared as any other
    (Mistral's 16 KiB a token: the prefix ends its shared windows on a token boundary)."""
    mgr = kvvm.Manager("host")
    system = torch.randint(0, VOCAB, (1, 300))
    wide = build("mistral", "eager", window=4096)
    with torch.no_grad():
        prefix = KvvmPrefix.build(wide, system, manager=mgr, max_cache_len=400)
    cache = KvvmCache.from_prefix(prefix, 2, 400)
    assert cache.get_seq_length() == 300 and len(cache.groups) == 1
    cache.release()
    assert prefix.cache is not None
    prefix.cache.release()
    assert mgr.snapshot().committed == 0


# ---- the memory underneath ----


def test_warm_up_steps_taken_back_forget_nothing_and_a_crop_stops_at_the_window() -> None:
    """Steps prepared between a snapshot and its restore (a captured step's warm-up) give no
    window back: the counts go back and the real step reads those tokens. A crop that would
    need forgotten tokens is refused; a reset starts the sliding layers again from token 0."""
    mgr = kvvm.Manager("host")
    cache = KvvmCache(mistral_config(), 2, 512, manager=mgr, dtype="fp32")
    group = sliding_group(cache)
    cache.prepare(250)
    cache.step_done()
    full = group.batch[0].owned_bytes
    snap = cache.state.snapshot()
    for _ in range(3):
        cache.prepare(1)
        cache.step_done()
    assert group.host_floors == [0, 0] and group.batch[0].forgotten_tokens == 0
    cache.state.restore(snap)
    cache.prepare(1)
    # 16 KiB a token: tokens 0..202 leave the window, the first 128 of them fill a window.
    assert group.host_floors == [203, 203] and group.floors is not None and group.floors.tolist() == [203, 203]
    assert group.batch[0].forgotten_tokens == 203 and group.batch[0].owned_bytes == full - mgr.granule
    cache.step_done()
    with pytest.raises(kvvm.InvalidArgumentError, match="gave back"):
        cache.crop_tokens(240)
    assert cache.state.host_lengths == [251, 251]
    cache.crop_tokens(-1)  # a step taken back: its window is all there
    assert cache.state.host_lengths == [250, 250]
    cache.reset_counts()
    assert group.host_floors == [0, 0] and group.batch[0].forgotten_tokens == 0
    cache.release()
    assert mgr.snapshot().committed == 0


def test_forgotten_tokens_are_given_back_and_never_touched_again() -> None:
    mgr = kvvm.Manager("host")
    geometry = kvvm.KvGeometry(layers=2, kv_heads=8, head_dim=128, max_tokens=2048, dtype="fp32")
    plan = kvvm.LayoutPlan(geometry, "token-major", mgr.granule)
    batch = kvvm.SequenceBatch(mgr, plan, 3, 2048, window_handles=True)
    batch.ensure(1000, first=0, count=2)
    per_window = mgr.granule // geometry.bytes_per_token  # 128 tokens
    view = batch.view(0, first=0, count=1)
    with pytest.raises(kvvm.ViewsAliveError):
        batch.forget_each([600, 300])
    assert batch[0].forgotten_tokens == 0 and batch[0].owned_bytes == 8 * mgr.granule
    del view
    freed = batch.forget_each([600, 300])
    assert freed == (600 // per_window + 300 // per_window) * mgr.granule
    assert [batch[i].forgotten_tokens for i in range(3)] == [600, 300, 0]
    assert batch[0].owned_bytes == 8 * mgr.granule - (600 // per_window) * mgr.granule
    with pytest.raises(kvvm.NotCommittedError, match="forgotten"):
        batch.view(0, start=599, end=700, first=0, count=1)
    kept = batch.view(0, start=600, end=700, first=0, count=1)
    assert kept.shape[2] == 100
    del kept
    with pytest.raises(kvvm.NotCommittedError):
        batch[0].read_tokens(10, 1)
    with pytest.raises(kvvm.NotCommittedError):
        batch[1].forget_before(1001)
    batch[0].release()
    assert batch[0].forgotten_tokens == 0 and batch[0].owned_bytes == 0
    batch.release()
    assert mgr.snapshot().committed == 0


# ---- the kernels ----


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, window: int, softcap: float
) -> torch.Tensor:
    """Each query of ``q`` (``[heads, q, dim]``, at ``positions``) over ``k``/``v``
    (``[kv_heads, n, dim]``, tokens 0..n-1) as transformers' eager attention computes it with
    a sliding-window causal mask: the query at ``p`` sees ``p - window < k <= p``."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    logits = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    cols = torch.arange(k.shape[1])[None, :]
    seen = (cols <= positions[:, None]) & (cols > positions[:, None] - window)
    logits = logits.masked_fill(~seen, float("-inf"))
    return (torch.softmax(logits, -1) @ v).transpose(0, 1)


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_attend_reads_the_window_only_and_caps_the_logits(softcap: float) -> None:
    """Ragged requests in any slot order, prefill and decode: each query sees its window,
    and tokens before the earliest query's window are never read (they hold NaN)."""
    from kvvm.kernels.attend import attend

    torch.manual_seed(4)
    heads, kv_heads, dim, window = 8, 2, 32, 20
    k = torch.randn(3, kv_heads, 120, dim) * 3
    v = torch.randn(3, kv_heads, 120, dim)
    bounds = torch.tensor([[2, 0, 120], [0, 30, 70], [1, 5, 17]], dtype=torch.int32)
    for q_len in (1, 6):
        q = torch.randn(3, heads, q_len, dim) * 3
        poisoned_k, poisoned_v = k.clone(), v.clone()
        for slot, _, end in bounds.tolist():
            lo = max(0, end - q_len - window + 1)
            poisoned_k[slot, :, :lo] = float("nan")
            poisoned_v[slot, :, :lo] = float("nan")
        got = attend(q, poisoned_k, poisoned_v, bounds, window=window, softcap=softcap)
        for b, (slot, start, end) in enumerate(bounds.tolist()):
            positions = torch.arange(end - q_len, end)
            ks, vs = k[slot, :, start:end], v[slot, :, start:end]
            want = reference_attention(q[b], ks, vs, positions - start, window, softcap)
            assert torch.allclose(got[b], want, atol=1e-5), (q_len, b)


def test_the_triton_decode_kernel_reads_the_window_and_caps_in_the_interpreter() -> None:
    """The CUDA kernel's window and soft cap, run by Triton's interpreter on CPU tensors (in a
    process of its own: Triton reads ``TRITON_INTERPRET`` once), fused and not, every split
    count: the sdpa kernel's results, with the tokens before the window holding NaN."""
    pytest.importorskip("triton", reason="skipped: no triton")
    code = textwrap.dedent(
        """
        import math, torch
        from kvvm.kernels.attend import attend
        from kvvm.kernels.triton_decode import decode_attention
        torch.manual_seed(5)
        B, H, Hk, T, D, W = 3, 8, 2, 160, 32, 37
        k = torch.randn(B + 1, Hk, T, D) * 3
        v = torch.randn(B + 1, Hk, T, D)
        q = torch.randn(B, 1, H, D).transpose(1, 2) * 3
        bounds = torch.tensor([[0, 0, 150], [1, 2, 30], [2, 0, 0]], dtype=torch.int32)
        for cap in (0.0, 4.0):
            want = attend(q, k, v, bounds, window=W, softcap=cap)
            kk, vv = k.clone(), v.clone()
            kk[0, :, : 150 - W] = float("nan")
            vv[0, :, : 150 - W] = float("nan")
            for splits in (1, 2, 8):
                got = decode_attention(q, kk, vv, bounds, 1 / math.sqrt(D), splits, window=W, softcap=cap)
                assert (got - want).abs().max().item() < 1e-4, (cap, splits)
            # Fused: the step's token written by the kernel and attended from registers.
            kn = torch.randn(B, 1, Hk, D).transpose(1, 2)
            vn = torch.randn(B, 1, Hk, D).transpose(1, 2)
            ws, wt = torch.tensor([[0], [1], [B]]), torch.tensor([[149], [29], [0]])
            k2, v2 = k.clone(), v.clone()
            k2[ws, :, wt] = kn.transpose(1, 2)
            v2[ws, :, wt] = vn.transpose(1, 2)
            want = attend(q, k2, v2, bounds, window=W, softcap=cap)
            for splits in (1, 4):
                got = decode_attention(q, kk.clone(), vv.clone(), bounds, 1 / math.sqrt(D), splits, (kn, vn, ws, wt),
                                       window=W, softcap=cap)
                assert (got - want).abs().max().item() < 1e-4, ("fused", cap, splits)
        print("kernel ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "kernel ok" in r.stdout, r.stderr[-3000:]


def test_generate_compiled_on_the_cpu_gives_the_eager_tokens() -> None:
    """transformers' own auto-compile of the decode step (forced onto the CPU) on the hybrid
    Gemma 3 shape: two masks a forward (full and sliding), the counts moved once, the windows
    behind given back between compiled steps, DynamicCache's tokens."""
    reference = build("gemma3", "eager")
    model = build("gemma3", "kvvm")
    torch.manual_seed(6)
    ids = torch.randint(0, VOCAB, (2, 270))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    compile_config = transformers.CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True  # type: ignore[assignment]  # transformers declares it None alone
    mgr = kvvm.Manager("host")
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        cache = KvvmCache(model, 2, 512, manager=mgr)
        got = model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False,
            compile_config=compile_config,
        )
    assert model._compiled_call is not None, "generate compiled the decode step"
    assert torch.equal(got, want)
    assert cache.state.host_lengths == [281, 281] and cache.state.lengths.tolist() == [281, 281]
    group = sliding_group(cache)
    assert min(group.host_floors) > 0, "windows went back between compiled steps"
    cache.check()
    cache.release()
    assert mgr.snapshot().committed == 0
