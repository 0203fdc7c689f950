"""kvvm's benchmarks on a transformers model (``python -m kvvm_bench generate|kernels|serve|prefix|sliding|shapes``).

They live beside the package, not in its wheel: run them from a checkout with
``crates/python/benches`` on ``PYTHONPATH`` and kvvm installed (``pip install .``). Each
subcommand is a module: :mod:`kvvm_bench.runs` (decode with every cache side by side),
:mod:`kvvm_bench.kernels` (the attention kernels alone), :mod:`kvvm_bench.serve` (a serving
trace through the continuous-batching engine and its peers), :mod:`kvvm_bench.prefix`
(prefix-cache hits by handle size), :mod:`kvvm_bench.sliding` (a Gemma-3-shaped model's
sliding-window layers to 32k tokens), :mod:`kvvm_bench.shapes` (the decode kernel and step on
every head dim, GQA ratio and dtype); :mod:`kvvm_bench.cli` parses the command line.
"""

from kvvm_bench.cli import main

__all__ = ["main"]
