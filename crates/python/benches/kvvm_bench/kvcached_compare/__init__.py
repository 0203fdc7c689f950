"""kvvm beside kvcached 0.1.6 on one device (``python -m kvvm_bench kvcached``).

kvcached (ovg-project/kvcached) also maps KV memory on demand through the driver's
virtual-memory API: one reservation the size of the device, cut into pages of 2 MiB per layer
and K/V, that its ``KVCacheManager`` maps as vLLM's blocks need them, with a few pages kept
mapped ahead (a background thread) and after a free. This benchmark drives its allocator
without an engine, initialised in the order its vLLM worker uses, with the KV geometry kvvm
uses (the ``--model`` preset, Llama-3-8B by default: 32 layers, 8 KV heads, head_dim 128,
bf16; kvcached in vLLM's blocks of 16 tokens), and measures, side by side:

* ``a``: the time to give ``N`` tokens of KV to a request and take them back (p50/p99 over
  ``--reps``), cold (the library's pool emptied before each repetition: kvvm
  ``Manager.trim_pool(0)``, kvcached ``KVCacheManager.trim()``) and warm (the pool as the
  previous repetition left it). kvvm: ``Sequence.ensure(N)`` then ``release()`` on an empty
  sequence (the address range is reserved once per sequence; that reservation is timed apart);
  kvcached: ``KVCacheManager.alloc(ceil(N / 16))`` then ``free``.
* ``b``: bytes held against bytes live around a burst of ``--requests`` requests of mixed
  lengths (seeded, the same for both): at the peak, right after every request finished, after
  ``--idle-s`` seconds idle and after an explicit trim; from the driver (free memory, on a GPU)
  and from each library's own books (kvvm ``Manager.snapshot()``; kvcached's page states and
  the used/prealloc bytes it publishes in its ``/dev/shm`` segment).
* ``c``: two instances on one device, each growing requests of ``--pressure-tokens`` until
  refused, started together: kvvm's two processes under one ``kvvm broker`` (a tenant each),
  kvcached's two processes each with its own limit written into its ``/dev/shm`` segment (what
  ``kvctl limit`` writes; kvcached's resize watcher applies it). What each got, how it was
  refused (or how it failed), and what the device held while both held.

kvcached runs only in child processes (``python -m kvvm_bench kvcached-worker``), each with its
own ``/dev/shm`` segment name (``KVCACHED_IPC_NAME``) and session: a crash is recorded (exit
code, signal, the last step the child announced, the tails of its output, Python's fault
handler's stacks) and the rest goes on. Its initialisation is tried in the order of
``--kvcached-recipes`` (see :data:`RECIPES`) until one allocates and frees a block; the parts
then use that recipe. ``--kvcached-diagnose`` tries every recipe, and ``ctor-only`` (the
C++ ``PageAllocator`` built with no CUDA initialised, as kvcached's own tests do), whatever
succeeds. With ``--kvcached-src`` (the unpacked sdist), kvcached's own GPU tests of its
allocator (``--kvcached-tests``) run last, each file in its own process.

kvvm's side runs in child processes too, so that both start from a fresh process. On a CPU
(``--device cpu --backend host``) parts ``a`` and ``b`` run kvvm alone (the tests do);
kvcached's side is recorded as skipped, since it needs a CUDA GPU.
"""

from __future__ import annotations

from .child import worker
from .report import table
from .run import add_args, run_kvcached_bench, worker_args

__all__ = ["add_args", "run_kvcached_bench", "table", "worker", "worker_args"]
