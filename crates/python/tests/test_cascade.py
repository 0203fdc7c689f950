"""The cascade decode (kvvm.kernels.cascade): requests sharing a prefix grouped on the host,
the groups' device tables rewritten in place, the kernels against the plain decode kernel in
Triton's interpreter (every query-head ratio, split counts, members over several programs,
the step's token written by the kernel, the soft cap), and a KvvmCache made from a prefix
decoding the same greedy tokens with the cascade as without it and as DynamicCache (fp32,
host backend, the Triton kernel in the interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from conftest import host_available

torch = pytest.importorskip("torch", reason="skipped: no torch")

from kvvm.kernels.cascade import (  # noqa: E402
    CascadeTables,
    PrefixConfig,
    Share,
    cascade_attention,
    choose_prefix_splits,
    member_tiles,
    most_items,
    plan_groups,
    prefix_items,
)


def test_groups_are_two_or_more_requests_sharing_one_prefix_tokens_and_start() -> None:
    shares = [
        Share("a", 0, 0, 100),
        None,
        Share("a", 2, 0, 100),
        Share("b", 3, 0, 50),  # alone: reads its tokens itself
        Share("a", 4, 0, 64),  # the same prefix, fewer tokens: another group
        Share("a", 5, 0, 64),
        Share("a", 6, 0, 100),
        Share("c", 7, 0, 0),  # no tokens
        Share("c", 8, 0, 0),
        Share("a", 9, 3, 100),  # another start
    ]
    plan = plan_groups(shares, max_groups=5)
    assert plan.groups == [(0, 0, 100), (4, 0, 64)]
    assert plan.members == [[0, 2, 6], [4, 5]]
    assert plan.shared == [100, 0, 100, 0, 64, 64, 100, 0, 0, 0]
    # Past the most groups, the rest read their tokens themselves.
    capped = plan_groups(shares, max_groups=1)
    assert capped.groups == [(0, 0, 100)] and capped.shared == [100, 0, 100, 0, 0, 0, 100, 0, 0, 0]
    assert plan_groups([None, None], 1).groups == []


def test_the_tables_are_rewritten_in_place_and_checked() -> None:
    # 8 query heads per KV head: 4 members an item (32 query rows), 3 items at most.
    t = CascadeTables(4, "cpu", prefix_splits=2, heads_per_kv=8, kv_heads=2)
    assert (t.max_groups, t.tile, t.max_items) == (2, 4, 3)
    pointers = [x.data_ptr() for x in (t.shared, t.groups, t.items)]
    t.update([Share("p", 0, 0, 9), Share("p", 1, 0, 9), None, Share("p", 3, 0, 9)])
    assert t.count == 1
    assert t.shared.tolist() == [9, 9, 0, 9]
    assert t.groups.tolist() == [[0, 0, 9], [0, 0, 0]]
    empty = [0, -1, -1, -1, -1]
    assert t.items.tolist() == [[1, 0, 0, 0, 0], [0, 0, 1, 3, -1], empty, empty]
    t.update([Share("p", 0, 0, 9), Share("p", 1, 0, 9), Share("q", 2, 0, 5), Share("q", 3, 0, 5)])
    assert t.items.tolist() == [[2, 0, 0, 0, 0], [0, 0, 1, -1, -1], [1, 2, 3, -1, -1], empty]
    t.update([None] * 4)
    assert t.count == 0 and t.shared.tolist() == [0] * 4 and t.items.tolist() == [[0] * 5] + [empty] * 3
    assert [x.data_ptr() for x in (t.shared, t.groups, t.items)] == pointers
    assert t.tables[2] is t.items and t.tables[3] == 2
    with pytest.raises(ValueError):
        t.update([None] * 3)
    with pytest.raises(ValueError):
        CascadeTables(4, "cpu", prefix_splits=3, heads_per_kv=1, kv_heads=1)
    with pytest.raises(ValueError):
        CascadeTables(0, "cpu", heads_per_kv=1, kv_heads=1)
    with pytest.raises(ValueError):
        CascadeTables(4, "cpu", heads_per_kv=0, kv_heads=1)


def _groupings(batch: int, least: int = 2) -> Iterator[list[int]]:
    """Every multiset of group sizes (two members or more) whose sum is at most ``batch``,
    largest first."""
    yield []
    for size in range(least, batch + 1):
        for rest in _groupings(batch - size, least=size):
            yield [*rest, size]


def test_every_grouping_fits_the_work_list_and_each_member_is_in_one_item() -> None:
    """Over every grouping of batches of up to 18 requests (sizes of two or more, capped at
    the most groups) at every members-per-item the heads give: the items fit the tables'
    rows, cut each group into whole tiles in order, and hold each member once."""
    checked = 0
    for batch in range(1, 19):
        for heads_per_kv in (1, 2, 3, 8, 16, 64):
            tile = member_tiles(batch, heads_per_kv)[0]
            for max_groups in (max(1, batch // 2), 1, 3):
                bound = most_items(batch, max_groups, tile)
                for sizes in _groupings(batch):
                    rows = iter(range(batch))
                    members = [[next(rows) for _ in range(size)] for size in sizes][:max_groups]
                    items = prefix_items(members, tile)
                    assert len(items) <= bound, (batch, heads_per_kv, sizes)
                    assert all(len(item) == 1 + tile for item in items)
                    for group, rows_of in enumerate(members):
                        mine = [r for item in items if item[0] == group for r in item[1:] if r >= 0]
                        assert mine == rows_of
                        assert sum(item[0] == group for item in items) == -(-len(rows_of) // tile)
                    checked += 1
    assert checked > 10_000, checked


def test_a_prefix_program_takes_at_least_sixteen_query_rows() -> None:
    assert member_tiles(64, 4) == (16, 4)  # 64 rows a program, 4 programs a group
    assert member_tiles(2, 1) == (16, 1)  # 16 rows at least (tensor cores)
    assert member_tiles(20, 1) == (32, 1)
    assert member_tiles(64, 16) == (4, 16)
    assert member_tiles(3, 128) == (1, 3)
    # Tables made for fewer rows an item (the private pass's launch): 16 rows, 4 members.
    assert member_tiles(64, 4, 16) == (4, 16)
    assert member_tiles(64, 4, 32) == (8, 8)
    assert member_tiles(64, 32, 16) == (1, 64)
    assert CascadeTables(64, "cpu", heads_per_kv=4, kv_heads=8, rows=16).tile == 4
    assert member_tiles(64, 4, 128) == (32, 2)
    assert CascadeTables(64, "cpu", heads_per_kv=4, kv_heads=8, rows=128).tile == 32
    with pytest.raises(ValueError, match="16, 32, 64 or 128"):
        CascadeTables(64, "cpu", heads_per_kv=4, kv_heads=8, rows=48)


def test_a_prefix_split_reads_at_least_512_tokens() -> None:
    # 64 requests of 32 heads over 8 KV heads on 132 multiprocessors: 32 splits would fill
    # the device, but a reservation of 2400 tokens gets 4 (and 8192 tokens 16).
    assert choose_prefix_splits(64, 32, 8, 2400, 132) == 4
    assert choose_prefix_splits(64, 32, 8, 8192, 132) == 16
    assert choose_prefix_splits(64, 32, 8, 1 << 20, 132) == 32
    assert choose_prefix_splits(4, 8, 2, 300, 4) == 1


def test_tables_made_for_other_heads_or_no_programs_are_refused() -> None:
    tables = CascadeTables(8, "cpu", heads_per_kv=1, kv_heads=1)  # 16 members an item
    q = torch.zeros(8, 8, 1, 16)  # 8 query heads over 1 KV head: 8 members an item
    kv = torch.zeros(9, 1, 32, 16)
    bounds = torch.zeros(8, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="another heads_per_kv"):
        cascade_attention(q, kv, kv, bounds, 0.25, 1, tables.tables)
    with pytest.raises(ValueError, match="a batch of 8"):
        cascade_attention(q[:4], kv, kv, bounds[:4], 0.25, 1, tables.tables)
    q = torch.zeros(8, 1, 1, 16)
    with pytest.raises(ValueError, match="one program or more"):
        cascade_attention(q, kv, kv, bounds, 0.25, 1, tables.tables, programs=0)
    beside = PrefixConfig(64, 4, 2, concurrent=True)
    with pytest.raises(ValueError, match="one split"):
        cascade_attention(q, kv, kv, bounds, 0.25, 2, tables.tables, prefix_config=beside)
    with pytest.raises(ValueError, match="not both"):
        cascade_attention(q, kv, kv, bounds, 0.25, 1, tables.tables, prefix_config=PrefixConfig(64, 4, 2, True, True, True))
    other = CascadeTables(8, "cpu", heads_per_kv=1, kv_heads=2)  # arrivals of 2 heads a request
    with pytest.raises(ValueError, match="another kv_heads"):
        cascade_attention(q, kv, kv, bounds, 0.25, 1, other.tables, prefix_config=beside)


def _interpreted(code: str) -> str:
    """Runs ``code`` in a process of its own under Triton's interpreter (it reads
    ``TRITON_INTERPRET`` once); returns its output."""
    pytest.importorskip("triton", reason="skipped: no triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def test_the_cascade_gives_the_plain_kernels_attention_in_the_interpreter() -> None:
    out = _interpreted(
        """
        import itertools, math, random, torch
        from kvvm.kernels.cascade import CascadeTables, PrefixConfig, Share, cascade_attention
        from kvvm.kernels.triton_decode import Config, decode_attention
        random.seed(5)
        torch.manual_seed(5)
        cases = several = 0
        # The last: 32 query heads per KV head, 2 members an item, a group over several items.
        for heads, kv_heads, dim, batch in ((8, 8, 32, 20), (8, 2, 48, 6), (8, 1, 64, 5), (16, 2, 32, 7), (32, 1, 16, 12)):
            T = 136
            k = torch.randn(batch + 1, kv_heads, T, dim)
            v = torch.randn_like(k)
            # Groups: prefixes of random lengths copied into their members' slots (the same
            # bytes), a request alone with a prefix, requests with none.
            keys = [random.choice(["a", "b", "c", None]) for _ in range(batch)]
            lengths = {"a": random.randint(1, 100), "b": random.randint(60, 120), "c": 64}
            shares, ends = [], []
            for row, key in enumerate(keys):
                n = lengths[key] if key else 0
                if key:
                    first = keys.index(key)
                    k[row, :, :n], v[row, :, :n] = k[first, :, :n], v[first, :, :n]
                shares.append(Share(key, row, 0, n) if key else None)
                ends.append(random.randint(n + 1, T - 1))
            bounds = torch.tensor([[r, 0, e] for r, e in enumerate(ends)], dtype=torch.int32)
            q = torch.randn(batch, 1, heads, dim).transpose(1, 2)
            # The prefix pass's programs: the default, one walking every unit, three.
            # One private split merges the prefix's columns in its own program; more leave it
            # to the merge kernel.
            for splits, psplits, softcap, programs in (
                (1, 1, 0.0, None), (1, 4, 30.0, 1), (2, 4, 0.0, 1), (4, 2, 30.0, 3),
            ):
                # Tables of 16 rows an item as well (as the private pass's launch takes them),
                # and of 128.
                tables = CascadeTables(
                    batch, "cpu", prefix_splits=psplits, heads_per_kv=heads // kv_heads, kv_heads=kv_heads,
                    rows={4: 16, 2: 128}.get(psplits, 64),
                )
                plan = tables.update(shares)
                items = tables.items[0, 0].item()
                assert items >= len(plan.groups)
                several += items > len(plan.groups)
                want = decode_attention(q, k, v, bounds, dim ** -0.5, splits, softcap=softcap)
                got = cascade_attention(
                    q, k, v, bounds, dim ** -0.5, splits, tables.tables, softcap=softcap, programs=programs,
                )
                err = (got - want).abs().max().item()
                assert err < 1e-5, (heads, kv_heads, dim, splits, psplits, programs, err)
                cases += 1
                if splits == 1:
                    # Both passes in one launch: the last column's writer merges, and every
                    # count is back at zero for the next launch.
                    # In the interpreter the programs run one after another: the prefix
                    # pass's first leaves each merge to a private program, last to a prefix one.
                    # Or beside it (one after the other here): whichever runs last merges.
                    for first, how in itertools.product((True, False), ("together", "concurrent")):
                        counted = PrefixConfig(32, 4, 2, prefix_first=first, **{how: True})
                        got = cascade_attention(
                            q, k, v, bounds, dim ** -0.5, 1, tables.tables, softcap=softcap, programs=programs,
                            prefix_config=counted,
                        )
                        err = (got - want).abs().max().item()
                        assert err < 1e-5, (how, first, heads, kv_heads, dim, psplits, programs, err)
                        assert not tables.arrivals.any()
                        cases += 1
            # The step's token written by the kernel and attended from registers, as the
            # plain kernel does; a refused write (the scratch slot) is not attended to.
            kn = torch.randn(batch, kv_heads, 1, dim)
            vn = torch.randn(batch, kv_heads, 1, dim)
            ws = torch.tensor([[r] for r in range(batch)])
            ws[-1, 0] = batch
            wt = torch.tensor([[e - 1] for e in ends])
            # The private pass's blocks each masked in the one loop as well (Config.masked).
            fused = (
                (1, None), (2, None), (1, PrefixConfig(64, 4, 2, True)), (1, PrefixConfig(64, 4, 2, True, False)),
                (Config(1, masked=True), None), (Config(2, masked=True), None),
                (Config(1, masked=True), PrefixConfig(64, 4, 2, True)),
                (1, PrefixConfig(64, 4, 2, concurrent=True)), (1, PrefixConfig(64, 4, 2, prefix_first=False, concurrent=True)),
            )
            for splits, prefix in fused:
                k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
                want = decode_attention(q, k1, v1, bounds, dim ** -0.5, splits, (kn, vn, ws, wt))
                got = cascade_attention(
                    q, k2, v2, bounds, dim ** -0.5, splits, tables.tables, (kn, vn, ws, wt), prefix_config=prefix,
                )
                assert (got - want).abs().max().item() < 1e-5
                assert torch.equal(k1, k2) and torch.equal(v1, v2)
                cases += 1
        print("cases", cases, "several", several)
        """
    )
    assert "cases 105" in out
    assert int(out.split("several")[1]) > 0, "a group took several items"


@pytest.mark.skipif(not host_available(), reason="skipped: no host backend")
def test_a_cache_from_a_prefix_decodes_the_same_tokens_with_the_cascade() -> None:
    out = _interpreted(
        """
        import torch, kvvm
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
        from kvvm.transformers import KvvmCache, use_kvvm_attention
        from kvvm.prefix import KvvmPrefix
        import kvvm.kernels.cascade as kc
        calls, plain = [0], kc.cascade_attention

        def counted(*args, **kwargs):
            calls[0] += 1
            return plain(*args, **kwargs)

        kc.cascade_attention = counted
        torch.manual_seed(0)
        torch.set_num_threads(1)
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=97, max_position_embeddings=256)
        model = LlamaForCausalLM(cfg).eval()
        use_kvvm_attention(model, kernel="triton")
        system = torch.randint(0, 97, (1, 37))
        tails = torch.randint(0, 97, (3, 5))
        mgr = kvvm.Manager("host")
        prefix = KvvmPrefix.build(model, system, manager=mgr, max_cache_len=128)

        def greedy(cascade):
            cache = KvvmCache.from_prefix(prefix, 3, 128, cascade=cascade)
            assert cache.cascade == cascade and (cache.prefix_splits > 0) == cascade
            assert [cache.shared_tokens(s) for s in range(3)] == [37, 37, 37]
            pos = torch.arange(37, 42)[None].expand(3, -1)
            out = []
            with torch.no_grad():
                logits = model(input_ids=tails, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
                for step in range(6):
                    tok = logits.argmax(-1)
                    out.append(tok.tolist())
                    at = torch.full((3, 1), 42 + step)
                    logits = model(input_ids=tok[:, None], position_ids=at, past_key_values=cache, use_cache=True).logits[:, -1]
            cache.free(1)
            assert cache.shared_tokens(1) == 0 and cache.shared_tokens(0) == 37
            if cascade:
                assert cache.cascade_tables()[0].tolist() == [37, 0, 37]
            cache.release()
            return out

        with_cascade = greedy(True)
        calls = [calls[0]]
        without = greedy(False)
        use_kvvm_attention(model, enable=False)
        ids = torch.cat([system.expand(3, -1), tails], 1)
        want = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=DynamicCache(config=cfg))
        reference = want[:, 42:].T.tolist()
        assert with_cascade == without == reference, (with_cascade, without, reference)
        del prefix
        import gc; gc.collect()
        assert mgr.snapshot().committed == 0 and mgr.snapshot().shared == 0, mgr.snapshot()
        assert calls[0] == 2 * 6, calls  # the cascade ran in each layer of each decode step (2 layers, 6 steps)
        print("tokens", with_cascade)
        """
    )
    assert "tokens" in out
