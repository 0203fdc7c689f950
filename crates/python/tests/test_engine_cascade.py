"""The engine with the cascade decode (``Engine(..., cascade=True)``) on the host backend, the
Triton kernels in the interpreter, fp32 greedy: exactly the tokens of ``cascade=False`` on a
trace where several requests hit one cached prefix, others another or none, requests join and
leave, one is preempted (recomputed, or swapped to the host and back); requests whose hits are
the same token ids but other bytes (a prefix forgotten while a request still holds its old
copy, then prefilled again) are never grouped; a slot freed, preempted or swapped shares
nothing; an FP8 cache groups its hits too; a model without the cascade's tables (sliding
windows) runs unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import host_available

torch = pytest.importorskip("torch", reason="skipped: no torch")
pytest.importorskip("transformers", reason="skipped: no transformers")

pytestmark = pytest.mark.skipif(not host_available(), reason="skipped: no host backend")

#: A tiny fp32 Llama (2 layers, 4 heads over 2 KV heads), the engine and its tokens by trace.
_COMMON = """
import torch, kvvm
import kvvm.kernels.cascade as kc
from transformers import LlamaConfig, LlamaForCausalLM
from kvvm.engine import Engine
from kvvm.serving.scheduler import SchedulerOutput

torch.set_num_threads(1)
calls = [0]
plain = kc.cascade_attention

def counted(*args, **kwargs):
    calls[0] += 1
    return plain(*args, **kwargs)

kc.cascade_attention = counted
VOCAB = 97

def llama(seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512,
                      eos_token_id=None)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).to(torch.float32).eval()

def ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()

def preempt_youngest(engine):
    with engine._lock:
        engine.scheduler._make_room(SchedulerOutput())

def step(engine, n=1):
    # A view of the cache the first kernel call leaves in a reference cycle (a traceback's
    # frames) is collected by kvvm before an admission or unmap would refuse it.
    for _ in range(n):
        engine.step()

def groups(engine):
    # The groups the prefix pass's work items name (row 0 starts with the items' count).
    t = engine.cache.cascade_tables()
    if t is None:
        return 0
    items = t[2]
    return len(set(items[1:1 + int(items[0, 0]), 0].tolist()))
"""


def _interpreted(code: str) -> str:
    """Runs ``code`` after :data:`_COMMON` in a process of its own under Triton's interpreter
    (it reads ``TRITON_INTERPRET`` once); returns its output."""
    pytest.importorskip("triton", reason="skipped: no triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    source = textwrap.dedent(_COMMON) + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-6000:]
    return r.stdout


def test_the_engine_decodes_the_same_tokens_with_the_cascade() -> None:
    out = _interpreted(
        """
        def trace(cascade, swap):
            model = llama(0)
            mgr = kvvm.Manager("host", precommit=True, host_budget_bytes=(64 << 20) if swap else None)
            extra = dict(host_tier_bytes=16 << 20, swap="always") if swap else {}
            engine = Engine(model, slots=8, max_len=160, manager=mgr, prefill_chunk=32, prefix_cache_bytes=32 << 20,
                            compile=False, cascade=cascade, **extra)
            assert engine.cache.cascade == cascade
            a, b = ids(40, 1), ids(50, 2)
            # The publishers of two prefixes, then requests hitting them (32 and 48 tokens:
            # whole blocks of 16, copied), one hitting nothing; more join as others leave.
            first = [engine.submit(a + ids(5, 10), 12), engine.submit(b + ids(3, 11), 9)]
            step(engine, 4)
            reqs = first + [engine.submit(a + ids(n, 20 + n), m) for n, m in ((4, 10), (7, 14), (2, 6))]
            reqs += [engine.submit(b + ids(n, 30 + n), m) for n, m in ((6, 11), (2, 9), (8, 12))]
            reqs.append(engine.submit(ids(30, 40), 8))
            seen, steps = 0, 0
            while not engine.idle:
                step(engine)
                steps += 1
                seen = max(seen, groups(engine))
                if steps == 6:
                    # The youngest leaves and comes back later.
                    preempt_youngest(engine)
                    assert all(engine.cache.shared_tokens(s) in (0, 32, 48) for s in range(8))
                if steps == 9:
                    reqs += [engine.submit(a + ids(9, 50), 7), engine.submit(b + ids(4, 51), 5)]
            hits = sorted(r.prefix_hit_tokens for r in reqs)
            stats = engine.stats
            assert stats.preempted == 1 and (stats.swapped_out == 1) == swap, stats
            assert all(engine.cache.shared_tokens(s) == 0 for s in range(8)), "freed slots share nothing"
            engine.close()
            return [r.tokens for r in reqs], hits, seen

        for swap in (False, True):
            calls[0] = 0
            want, hits, seen = trace(False, swap)
            assert calls[0] == 0 and seen == 0
            got, hits2, seen2 = trace(True, swap)
            assert got == want, (swap, got, want)
            assert hits == hits2 and hits.count(32) >= 4 and hits.count(48) >= 4, hits
            assert calls[0] > 0 and seen2 == 2, (calls, seen2)  # both prefixes grouped in one step
            print("swap", swap, "tokens", sum(map(len, got)), "cascade calls", calls[0], "groups", seen2)
        """
    )
    assert "swap False" in out and "swap True" in out


def test_an_fp8_engine_decodes_the_same_tokens_with_the_cascade() -> None:
    out = _interpreted(
        """
        def trace(cascade):
            engine = Engine(llama(0), slots=4, max_len=96, manager=kvvm.Manager("host", precommit=True),
                            prefill_chunk=64, prefix_cache_bytes=32 << 20, compile=False, cascade=cascade,
                            kv_dtype="fp8_e4m3", kv_scales=(0.05, 0.05))
            system = ids(40, 3)
            reqs = [engine.submit(system + ids(2, 4), 4)]
            step(engine, 2)
            reqs += [engine.submit(system + ids(n, 5 + n), 6) for n in (1, 3, 5)]
            seen = 0
            while not engine.idle:
                step(engine)
                seen = max(seen, groups(engine))
            assert [r.prefix_hit_tokens for r in reqs] == [0, 32, 32, 32]
            engine.close()
            return [r.tokens for r in reqs], seen

        want, _ = trace(False)
        got, seen = trace(True)
        assert got == want and seen == 1, (got, want, seen)
        print("tokens", got)
        """
    )
    assert "tokens" in out


def test_the_same_token_ids_prefilled_again_are_another_prefix() -> None:
    """A request holds a prefix's copy (made elsewhere: other bytes than this engine's prefill
    would write) when the prefix cache forgets it; the same tokens are prefilled again and
    two more requests hit the new copy. Grouped by token ids, the older request's bytes would
    be read for the newer ones; grouped by the bytes' origin, none of them changes."""
    out = _interpreted(
        """
        from kvvm.prefix import KvvmPrefix

        def trace(cascade):
            model, elsewhere = llama(0), llama(7)
            mgr = kvvm.Manager("host", precommit=True)
            engine = Engine(model, slots=4, max_len=128, manager=mgr, prefill_chunk=64, prefix_cache_bytes=32 << 20,
                            compile=False, cascade=cascade)
            system = ids(40, 3)
            made = KvvmPrefix.build(elsewhere, torch.tensor([system]), manager=mgr, max_cache_len=128)
            engine.add_prefix(system, made)
            old = [engine.submit(system + ids(3, 4), 16), engine.submit(system + ids(5, 5), 16)]
            step(engine, 3)
            assert [r.prefix_hit_tokens for r in old] == [32, 32]
            engine.kv.clear_prefixes()
            del made
            again = engine.submit(system + ids(4, 6), 3)
            step(engine, 2)
            assert again.prefix_hit_tokens == 0
            new = [engine.submit(system + ids(n, 7 + n), 8) for n in (2, 6)]
            shared = 0
            while not engine.idle:
                step(engine)
                shared = max(shared, groups(engine))
            assert [r.prefix_hit_tokens for r in new] == [32, 32]
            if cascade:
                assert shared == 2, "the old copy's holders and the new one's: two groups"
            engine.close()
            return [r.tokens for r in old + [again] + new]

        want = trace(False)
        got = trace(True)
        assert got == want, (got, want)
        print("tokens", got)
        """
    )
    assert "tokens" in out


def test_a_sliding_window_model_runs_unchanged_with_cascade_asked_for() -> None:
    transformers = pytest.importorskip("transformers")
    import kvvm
    from kvvm.engine import Engine

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=512, sliding_window=16, eos_token_id=None,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.MistralForCausalLM(cfg).to(torch.float32).eval()
    outs = []
    for cascade in (False, True):
        engine = Engine(model, slots=2, max_len=64, manager=kvvm.Manager("host"), compile=False, cascade=cascade)
        assert not engine.cache.cascade, "a cache whose layers slide has no tables"
        reqs = [engine.submit(list(range(1, 30)), 6), engine.submit(list(range(5, 12)), 4)]
        engine.run()
        outs.append([r.tokens for r in reqs])
        engine.close()
    assert outs[0] == outs[1]
    with pytest.raises(kvvm.InvalidArgumentError):
        Engine(model, slots=1, max_len=64, manager=kvvm.Manager("host"), cascade="yes")  # type: ignore[arg-type]


def test_the_serve_benchmark_runs_the_engine_with_and_without_the_cascade(tmp_path) -> None:
    """``python -m kvvm_bench serve --cascade both``: the engine without, then with the
    cascade, on one trace with a shared system prompt; both agree with the reference (on a CPU
    without the interpreter the step reads every request's tokens: the flag's plumbing)."""
    import json

    import kvvm_bench

    out = tmp_path / "serve.json"
    rc = kvvm_bench.main([
        "serve", "--tiny", "--device", "cpu", "--backend", "host", "--requests", "4", "--prompt-lo", "8",
        "--prompt-hi", "24", "--output", "4", "--shared-prefix", "64", "--slots", "2", "--prefill-chunk", "256",
        "--prefix-cache-bytes", str(64 << 20), "--runners", "kvvm-engine", "--cascade", "both", "--reference",
        "--json", str(out),
    ])
    assert rc == 0
    rows = {r["runner"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"kvvm-engine", "kvvm-engine-cascade"}
    for r in rows.values():
        assert r["generated_tokens"] == 16 and r["agreement"] == 1.0 and r["prefix_hits"] == 3, r


def test_the_serve_benchmark_runs_every_pair_of_the_engine_switches(tmp_path) -> None:
    """``--cascade both --programmatic-launches both --tuned-products``: four engine runs, one
    per pair of switches, each named for its switches and each in agreement with the reference;
    the compiler's launch setting is as it was afterwards."""
    import json

    import kvvm_bench
    from torch._inductor import config

    before = config.triton.enable_pdl
    out = tmp_path / "serve.json"
    rc = kvvm_bench.main([
        "serve", "--tiny", "--device", "cpu", "--backend", "host", "--requests", "3", "--prompt-lo", "8",
        "--prompt-hi", "16", "--output", "3", "--shared-prefix", "32", "--slots", "2", "--prefill-chunk", "256",
        "--prefix-cache-bytes", str(64 << 20), "--runners", "kvvm-engine", "--cascade", "both",
        "--programmatic-launches", "both", "--tuned-products", "--reference", "--json", str(out),
    ])
    assert rc == 0
    runs = [r["runner"] for r in json.loads(out.read_text())["results"]]
    assert runs == ["kvvm-engine", "kvvm-engine-pdl", "kvvm-engine-cascade", "kvvm-engine-cascade-pdl"]
    for r in json.loads(out.read_text())["results"]:
        assert r["generated_tokens"] == 9 and r["agreement"] == 1.0, r
    assert config.triton.enable_pdl == before


def test_a_swapped_request_stops_sharing_and_shares_again_once_back() -> None:
    """Its slot unshared before the swap unmaps its windows; back (the same bytes copied into
    another slot), it shares its prefix again with the requests that hit the same bytes."""
    import kvvm
    from kvvm.engine import Engine
    from kvvm.serving.scheduler import SchedulerOutput
    from kvvm.serving.swap import SwapCosts

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=512, eos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    mgr = kvvm.Manager("host", precommit=True, host_budget_bytes=64 << 20)
    engine = Engine(
        model, slots=4, max_len=128, manager=mgr, prefill_chunk=64, prefix_cache_bytes=32 << 20, compile=False,
        cascade=True, host_tier_bytes=16 << 20, swap="always", swap_costs=SwapCosts(1e9, 1e9, 1e-3),
    )
    system = list(range(3, 43))
    engine.submit(system + [1, 2], 20)
    engine.run(max_steps=2)
    hitters = [engine.submit(system + [5 + i], 30) for i in range(2)]
    engine.run(max_steps=2)
    first, second = (r.slot for r in hitters)
    assert first is not None and second is not None
    shared = engine.cache.shared_prefix(first)
    assert shared is not None and shared[1] == 32
    assert engine.cache.shared_prefix(second) == shared
    with engine._lock:
        engine.scheduler._make_room(SchedulerOutput())  # the youngest: the second hitter
    assert engine.stats.swapped_out == 1 and hitters[1].slot is None
    assert engine.cache.shared_prefix(second) is None
    while hitters[1].slot is None:
        engine.step()
    assert engine.stats.swapped_in == 1
    assert engine.cache.shared_prefix(hitters[1].slot) == shared
    engine.run()
    assert all(engine.cache.shared_prefix(s) is None for s in range(4))
    engine.close()
