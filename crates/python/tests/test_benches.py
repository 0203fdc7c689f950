"""The benchmarks that run without a GPU (``crates/python/benches``): ``python -m kvvm_bench
prefix`` on the simulator."""

from __future__ import annotations

import json
from pathlib import Path


def test_prefix_hits_map_one_handle_per_mapping(tmp_path: Path) -> None:
    """A 4096-token prefix (token-major llama-3-8b: 16 tokens a window) hit in full at every
    handle size, with one mapping per handle: 256 at one window a handle, 16 at sixteen."""
    import kvvm_bench

    out = tmp_path / "prefix.json"
    assert kvvm_bench.main(["prefix", "--backend", "sim", "--hits", "2", "--handle-blocks", "1,16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["handle_blocks"]: r for r in report["rows"]}
    assert report["meta"]["window_tokens"] == 16
    assert rows[1]["hit_tokens"] == rows[16]["hit_tokens"] == 4096
    assert (rows[1]["tokens_per_handle"], rows[1]["mappings"]) == (16, 256)
    assert (rows[16]["tokens_per_handle"], rows[16]["mappings"]) == (256, 16)
    assert all(r["p50_us"] > 0 for r in rows.values())
