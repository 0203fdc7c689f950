"""Continuous batching over kvvm slots: requests arrive, join the running batch, finish at
their own lengths and leave, on one :class:`~kvvm.transformers.KvvmCache`.

:class:`Engine` puts three parts together (``docs/engine.md``): the
:class:`~kvvm.serving.scheduler.Scheduler` decides what each step runs, the
:class:`~kvvm.serving.kv_manager.KvManager` owns the memory (the cache's slots, the prefix
cache, every call into kvvm), the :class:`~kvvm.serving.runner.ModelRunner` runs the forwards
and samples. A step is ``schedule -> run -> update``.

A request takes a free slot when the budget grants its prompt (its windows are committed at
admission; a refusal leaves it waiting, first in line); with a prefix cache, the longest cached
prefix of its prompt is mapped read-only into the slot (no prefill of those tokens, billed
once) and only the rest is prefilled; a request whose prefix another request is still
prefilling waits for that prefill to be published rather than prefilling it again. Its
prefill runs in chunks of ``prefill_chunk`` tokens, one chunk per request per step, between
the decode steps of the others; requests in consecutive slots whose chunks have one length
are prefilled in one forward. Every decoding request advances by one token per step in one
step of the whole batch (captured once as a CUDA graph on a GPU, eager on a CPU); a finished
request's slot is taken by the next request without recapturing.

A step whose growth the budget cannot grant is never launched: the youngest running request
(decoding or prefilling) is preempted (its slot released, the request put back first in line
with the tokens it generated appended to its prompt, to be recomputed) until the step fits; a
request alone that still cannot grow finishes as ``"memory"``, and so does a prompt that can
never fit the budget (without running, and without holding up the requests behind it). With a
host tier (``host_tier_bytes``) a preempted request is swapped to host memory instead, when
that is cheaper than computing it again, and swapped back at its admission
(:mod:`kvvm.serving.swap`).

::

    engine = Engine(model, slots=16, max_len=8192, backend="cuda", prefix_cache_bytes=8 << 30)
    a = engine.submit(prompt_ids, max_new_tokens=128)
    engine.run()                      # or engine.step() in a serving loop
    print(a.tokens, a.finish_reason)
    engine.close()

Served from other threads (``docs/engine.md``, streaming): ``engine.start()`` steps on a
thread of its own; ``submit`` from any thread, read a request with ``engine.stream(r)`` (a
blocking iterator), ``engine.astream(r)`` (an async one) or an ``on_output`` callback, and
``engine.cancel(r)`` gives its slot and memory back at once. Each request samples with its
own :class:`~kvvm.serving.params.SamplingParams`. Requires torch and transformers.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable
import time
from typing import Any

import torch

from .. import Manager, SharedPrefix
from ..errors import BackpressureError, InvalidArgumentError, KvvmError
from ..transformers.attention import switch_attention
from ..transformers.cache import KvvmCache
from ..transformers.prefix import KvvmPrefix
from .control import EngineControl
from .kv_manager import KvManager
from .loop import BackgroundLoop
from .metrics import EngineMetrics
from .output import OutputProcessor, touched
from .params import SamplingParams
from .request import EngineStats, Request, TokenIds, check_eos, check_positive, check_temperature, check_token_ids
from .runner import ModelRunner
from .scheduler import Scheduler
from .stream import Delta
from .swap import SwapCosts, Swapper, SwapScheduler

__all__ = ["Engine"]


def _vocab_size(model: Any) -> int | None:
    """The ids the model embeds: its input embedding's rows, else its config's vocabulary."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    rows = getattr(emb, "num_embeddings", None)
    if isinstance(rows, int):
        return rows
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def _default_eos(model: Any) -> frozenset[int]:
    """The model's own end tokens (its generation config's), as they come."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return frozenset([eos] if isinstance(eos, int) else (eos or []))


class Engine(EngineControl):
    """Continuous batching of a transformers causal LM over ``slots`` kvvm slots.

    Args:
        model: a decoder of full and sliding-window attention layers (Llama, Mistral, Qwen2,
            Gemma 2 and 3, ...); it attends with the kvvm attention until :meth:`close`,
            which gives it back its own. A prefix cache is refused for a model whose layers
            slide within ``max_len`` tokens (share a system prompt with
            :class:`kvvm.prefix.KvvmPrefix` instead).
        slots: requests decoded together at most.
        max_len: the most tokens a request may reach (prompt + generated), reserved as
            address space only.
        manager: a :class:`~kvvm.Manager` (made from ``backend``/``budget_bytes`` with the
            pre-committer when omitted).
        prefill_chunk: prompt tokens prefilled per request and step.
        prefill_batch_tokens: the most tokens one prefill forward takes: requests in
            consecutive slots whose chunks have one length are prefilled together up to it.
        prefix_cache_bytes: the prefix cache's cap (0: no prefix cache).
        prefix_handle_tokens: tokens per handle of a published prefix (rounded down to whole
            windows, at least one): a hit maps one handle per mapping, its read-only part ends
            on a handle boundary and the rest of it is copied, so ``hit / prefix_handle_tokens``
            is its mappings (256 by default: a 4096-token hit maps 16 handles). Hits are
            whole blocks of the prefix cache (``prefix_cache.block_tokens``, 16 tokens).
        compile: compile the captured decode step (CUDA only).
        fuse_projections: run the model's sibling projections (Q, K and V; gate and up) as one
            matrix multiply each (:func:`kvvm.transformers.projections.fuse_projections`).
        tuned_products: run the model's products at a decode step's few rows through
            ``kvvm::linear`` (:func:`kvvm.transformers.tuned_products`: cuBLAS or kvvm's
            Triton kernel, whichever is measured faster per shape; after the fusion). Both
            change the model's modules until :meth:`close` gives them back.
        programmatic_launches: capture the decode step with its kernels launching as
            programmatic dependents (:func:`kvvm.kernels.device.programmatic_launches`).
        eos_token_ids: the tokens that end a request, an int or a list of ints (default: the model's).
        seed: the seed a request without one draws its own from (with its id).
        tokenizer: a transformers tokenizer: requests get their output as text
            (:attr:`Request.text`) and may stop at strings.
        max_waiting: the most requests waiting for a slot (queued, not yet admitted); a
            submission past it raises :class:`~kvvm.errors.BackpressureError` (None: no
            limit).
        host_tier_bytes: page-locked host memory for preemption by swap (0: none, preempted
            requests are computed again): allocated at start, and the host budget of a
            manager made here (:mod:`kvvm.serving.swap`).
        swap: with a host tier, when a preempted request is swapped rather than computed
            again: ``"auto"`` (by measured costs), ``"always"`` or ``"never"``.
        swap_costs: the costs ``"auto"`` decides by (:class:`~kvvm.serving.swap.SwapCosts`;
            measured when omitted).
        prefix_host: with a host tier and a prefix cache, a prefix evicted from the device
            goes to the host tier and a later hit there is copied back instead of prefilled,
            when that is cheaper by the same costs (``swap`` decides it too;
            ``docs/host-tier.md``). False: evicted prefixes are forgotten.
        kv_dtype, kv_scales: the cache's K/V as FP8 (``"fp8_e4m3"``; None: the model's dtype)
            and its scales, as :class:`~kvvm.transformers.KvvmCache`'s (``docs/fp8-kv.md``).
        cascade: with a prefix cache, the decode step reads a prefix shared by several
            requests once per group of them (the cascade decode, ``docs/cascade.md``):
            requests whose hits hold the same bytes (one prefill's, mapped or copied) are
            grouped, on the device, inside the captured step. The Triton kernel runs it (one
            query token per request, CUDA); tokens are those of ``cascade=False`` up to the
            order of summation. A model whose layers slide has no cascade (nothing changes).

    Raises:
        InvalidArgumentError: an argument of the wrong type or out of range.
    """

    def __init__(
        self,
        model: Any,
        *,
        slots: int,
        max_len: int,
        manager: Manager | None = None,
        backend: str = "auto",
        budget_bytes: int | None = None,
        headroom_tokens: int = 4,
        prefill_chunk: int = 512,
        prefill_batch_tokens: int = 8192,
        prefix_cache_bytes: int = 0,
        prefix_handle_tokens: int = 256,
        compile: bool = True,
        fuse_projections: bool = False,
        tuned_products: bool = False,
        programmatic_launches: bool = False,
        eos_token_ids: int | list[int] | None = None,
        seed: int = 0,
        tokenizer: Any = None,
        max_waiting: int | None = None,
        host_tier_bytes: int = 0,
        swap: str = "auto",
        swap_costs: SwapCosts | None = None,
        prefix_host: bool = True,
        kv_dtype: Any = None,
        kv_scales: Any = None,
        cascade: bool = False,
    ) -> None:
        for value, name, least in (
            (slots, "slots", 1), (max_len, "max_len", 2), (prefill_chunk, "prefill_chunk", 1),
            (prefill_batch_tokens, "prefill_batch_tokens", 1), (prefix_cache_bytes, "prefix_cache_bytes", 0),
            (prefix_handle_tokens, "prefix_handle_tokens", 1), (host_tier_bytes, "host_tier_bytes", 0),
        ) + (() if max_waiting is None else ((max_waiting, "max_waiting", 1),)):
            check_positive(value, name, least)
        self.vocab_size = _vocab_size(model)
        self.eos = check_eos(eos_token_ids, self.vocab_size) if eos_token_ids is not None else _default_eos(model)
        if manager is None:
            manager = Manager(
                backend, budget_bytes=budget_bytes, precommit=True, headroom_tokens=headroom_tokens,
                host_budget_bytes=host_tier_bytes or None,
            )
        self._attention, kv = switch_attention(model), None
        try:  # what was made is given back if the rest cannot be
            kv = KvManager(
                model, slots=slots, max_len=max_len, manager=manager, prefix_cache_bytes=prefix_cache_bytes,
                prefix_handle_tokens=prefix_handle_tokens, kv_dtype=kv_dtype, kv_scales=kv_scales, cascade=cascade,
            )
            self.runner = ModelRunner(
                model, slots=slots, device=kv.device, compile=compile, fuse_projections=fuse_projections,
                tuned_products=tuned_products, programmatic_launches=programmatic_launches,
            )
        except BaseException:
            if kv is not None:
                kv.close()
            self._attention.restore()
            raise
        self.kv, self.model, self.manager, self.max_len, self.device = kv, model, manager, max_len, kv.device
        sizes = {"max_len": max_len, "prefill_chunk": prefill_chunk, "prefill_batch_tokens": prefill_batch_tokens}
        #: The host tier's swapper (None without one).
        self.swapper: Swapper | None = self._make_swapper(host_tier_bytes, swap, swap_costs)
        if self.swapper is not None and prefix_host and swap != "never" and self.kv.prefix_cache is not None:
            self.kv.attach_host_level(self.swapper.tier, self.swapper.host_min_tokens)
        self.scheduler = (
            SwapScheduler(self.kv, self.swapper, **sizes) if self.swapper else Scheduler(self.kv, **sizes)
        )
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.seed = seed
        self.metrics = EngineMetrics()
        self._outputs = OutputProcessor(tokenizer, self.metrics)
        self._ids = itertools.count()
        self._closed = False
        #: Held by a step and by whatever must happen between steps (cancel, the inbox's
        #: drain); submissions only queue into the inbox.
        self._lock = threading.RLock()
        self._inbox: collections.deque[Request] = collections.deque()
        self._inbox_lock = threading.Lock()
        self._loop = BackgroundLoop(self)

    def _make_swapper(self, host_tier_bytes: int, swap: str, swap_costs: SwapCosts | None) -> Swapper | None:
        """The host tier's swapper (None without a host tier); if it cannot be made, the KV
        manager is closed and the model's attention and modules given back before the error is
        raised."""
        if not host_tier_bytes:
            return None
        try:
            return Swapper(self.kv, host_tier_bytes, swap, swap_costs)
        except BaseException:
            self.runner.close()
            self.kv.close()
            self._attention.restore()
            raise

    # ---- the parts' state, as the engine's ----

    @property
    def cache(self) -> KvvmCache:
        """The KV manager's cache."""
        return self.kv.cache

    @property
    def prefix_cache(self) -> Any:
        """The KV manager's prefix cache (None without one)."""
        return self.kv.prefix_cache

    @property
    def waiting(self) -> collections.deque[Request]:
        """Requests waiting for a slot, first in line first."""
        return self.scheduler.waiting

    @property
    def running(self) -> dict[int, Request]:
        """Requests holding a slot (prefilling or decoding), by slot."""
        return self.scheduler.running

    @property
    def stats(self) -> EngineStats:
        """What the engine did so far."""
        return self.scheduler.stats

    @stats.setter
    def stats(self, value: EngineStats) -> None:
        self.scheduler.stats = value

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens a request prefills at most in one step (the scheduler's)."""
        return self.scheduler.prefill_chunk

    @property
    def prefill_batch_tokens(self) -> int:
        """Prompt tokens one step prefills at most over all its requests (the scheduler's)."""
        return self.scheduler.prefill_batch_tokens

    @property
    def idle(self) -> bool:
        """Whether nothing waits (submitted from another thread included) and nothing runs."""
        return self.scheduler.idle and not self._inbox

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot, those submitted since the last step included."""
        return len(self.scheduler.waiting) + len(self._inbox)

    # ---- requests ----

    def submit(
        self,
        token_ids: TokenIds,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        eos_token_ids: int | list[int] | None = None,
        sampling: SamplingParams | None = None,
        detokenize: bool | None = None,
        on_output: Callable[[Request, Delta], None] | None = None,
    ) -> Request:
        """Queues a request; returns its handle (``tokens`` grows as it is generated). Safe
        from any thread.

        ``token_ids``: a list or tuple of ints, each in the model's vocabulary, or a 1-D
        integer tensor or array (copied into a list); ``max_new_tokens``: a positive int;
        ``temperature``: finite, at least 0 (0: greedy); ``eos_token_ids``: an int or a list
        of ints (default: the engine's); ``sampling``: the request's
        :class:`~kvvm.serving.params.SamplingParams` (its temperature wins over
        ``temperature``); ``detokenize``: produce :attr:`Request.text` (default: when the
        engine has a tokenizer; stop strings need it); ``on_output``: called from the engine's
        loop with each :class:`~kvvm.serving.stream.Delta` of the request. Everything is
        checked here: a request refused (:class:`~kvvm.errors.InvalidArgumentError`, saying
        what is wrong) is not queued and cannot fail a later step; so is every request once
        the engine is closed. :class:`~kvvm.errors.BackpressureError` when ``max_waiting``
        requests wait already."""
        return self.submit_n(
            token_ids, max_new_tokens, 1, temperature=temperature, eos_token_ids=eos_token_ids, sampling=sampling,
            detokenize=detokenize, on_output=on_output,
        )[0]

    def submit_n(
        self,
        token_ids: TokenIds,
        max_new_tokens: int,
        n: int,
        *,
        temperature: float = 0.0,
        eos_token_ids: int | list[int] | None = None,
        sampling: SamplingParams | None = None,
        detokenize: bool | None = None,
        on_output: Callable[[Request, Delta], None] | None = None,
    ) -> list[Request]:
        """``n`` sequences of one prompt (OpenAI's ``n``), as :meth:`submit` queues one: the
        ``i``-th samples with the seed ``seed + i`` (a seed drawn from the engine's when none
        is given). With a prefix cache they share the prompt's KV: the first prefills it and
        publishes it, the others wait for that publication and map it read-only (billed once),
        prefilling only what lies past its last whole block of the cache (``docs/engine.md``).
        All are queued or none."""
        self._check_open()
        prompt = check_token_ids(token_ids, self.vocab_size, "token_ids")
        if not prompt:
            raise InvalidArgumentError("a request needs at least one prompt token")
        new = check_positive(max_new_tokens, "max_new_tokens")
        count = check_positive(n, "n")
        if len(prompt) >= self.max_len:
            raise InvalidArgumentError(f"a prompt of {len(prompt)} tokens leaves no room in {self.max_len}")
        params = (sampling or SamplingParams(temperature=check_temperature(temperature))).checked(self.vocab_size)
        eos = check_eos(eos_token_ids, self.vocab_size) if eos_token_ids is not None else self.eos
        eos = (frozenset() if params.ignore_eos else eos) | frozenset(params.stop_token_ids)
        text = self.tokenizer is not None if detokenize is None else bool(detokenize)
        if params.stop and (not text or self.tokenizer is None):
            raise InvalidArgumentError("stop strings need the engine's tokenizer (and detokenize)")
        with self._inbox_lock:
            if self.max_waiting is not None and self.queue_depth + count > self.max_waiting:
                raise BackpressureError(
                    f"{self.queue_depth} requests wait for a slot already (max_waiting={self.max_waiting})",
                    retry_after=1.0,
                )
            reqs = []
            for i in range(count):
                rid = next(self._ids)
                base = params.seed if params.seed is not None else (self.seed * 0x9E3779B1 + count * rid) & ((1 << 62) - 1)
                r = Request(rid, list(prompt), new, params.temperature, eos, sampling=params, seed=base + i,
                            detokenize=text, on_output=on_output)
                self._outputs.register(r)
                reqs.append(r)
            self._inbox.extend(reqs)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()
        self._loop.wake()
        return reqs

    def _drain(self) -> None:
        """Moves the submitted requests into the scheduler's line, in order (holding the lock)."""
        with self._inbox_lock:
            while self._inbox:
                self.scheduler.add(self._inbox.popleft())

    # ---- the loop ----

    @torch.no_grad()
    def step(self) -> int:
        """One iteration: the scheduler decides (growth and preemptions, admissions, prefill
        chunks, decode slots), the runner runs it, the scheduler takes the tokens, and each
        request changed is published to its readers (its text and stop strings first).
        Returns the tokens generated."""
        with self._lock:
            self._check_open()
            self._drain()
            out = self.scheduler.schedule()
            began = time.perf_counter()
            result = self.runner.execute(out, self.kv)
            if self.swapper is not None:
                prefilled = sum(run.tokens * len(run.slots) for run in out.prefill)
                self.swapper.costs.record_step(prefilled, len(out.decode), time.perf_counter() - began)
            produced = self.scheduler.update(out, result)
            self._outputs.after_step(touched(out), self.scheduler)
            return produced

    def run(self, max_steps: int | None = None) -> None:
        """Steps until every request finished (or ``max_steps`` steps, a non-negative int).
        Raises BackpressureError when a step changed nothing: no request runs, none was
        admitted or finished, and the first waiting one cannot be admitted (memory held
        outside this engine's requests)."""
        if max_steps is not None:
            check_positive(max_steps, "max_steps", 0)
        self._check_open()
        for n in itertools.count():
            if self.idle or (max_steps is not None and n >= max_steps):
                return
            before = (self.stats.admitted, self.stats.finished)
            produced = self.step()
            if produced == 0 and not self.running and self.waiting and before == (self.stats.admitted, self.stats.finished):
                raise BackpressureError(
                    "nothing runs and the first waiting request cannot be admitted: memory this "
                    "engine's requests do not hold is keeping its prompt out"
                )

    def add_prefix(self, token_ids: list[int], prefix: KvvmPrefix | SharedPrefix) -> int:
        """Makes a prefix made outside this engine's requests one its prefix cache finds: a
        ``KvvmPrefix`` built on this engine's manager, or one another process published and
        this one opened (``KvvmPrefix.open(model, key, manager=engine.manager,
        max_cache_len=engine.max_len)``: mapped read-only, billed to its publisher).
        ``token_ids`` are the prefix's tokens (at least its :attr:`tokens`); a request that
        opens with them receives them in whole blocks of the cache (whole windows mapped
        read-only, the rest copied) instead of prefilling them. Returns the count inserted.
        ``InvalidArgumentError`` without a prefix cache, or when the prefix is not laid out as
        this engine's cache or is shorter than one block."""
        self._check_open()
        ids = check_token_ids(token_ids, self.vocab_size, "token_ids")
        return self.kv.add_prefix(ids, prefix)

    def warmup(self, prompt_tokens: int = 512, new_tokens: int = 3) -> None:
        """Compiles and captures the decode step before the first request arrives (a
        serving engine's start-up), so that no request's first token waits for it: a
        throwaway request per slot of ``prompt_tokens`` tokens decodes ``new_tokens`` tokens
        and is retired. The attention kernel's configuration is chosen then, on these
        lengths (pick them like the expected prompts). Needs an idle engine and a budget for
        ``slots x prompt_tokens`` tokens; the engine's counters start again from zero."""
        if not self.idle:
            raise InvalidArgumentError("warmup needs an idle engine")
        if not 0 < prompt_tokens < self.max_len - new_tokens:
            raise InvalidArgumentError(f"a warm-up prompt of {prompt_tokens} tokens does not fit in {self.max_len}")
        vocab = self.vocab_size or 2
        for i in range(self.kv.slots):
            ids = [(7 + 13 * (i * prompt_tokens + t)) % vocab for t in range(prompt_tokens)]
            self.submit(ids, new_tokens, eos_token_ids=[], detokenize=False)
        self.run()
        self.kv.clear_prefixes()
        self.stats = EngineStats()
        self.metrics = self._outputs.metrics = EngineMetrics()

    def close(self) -> None:
        """Drops the captured step, releases every slot, empties the prefix cache (its
        published prefixes' memory goes back) and gives the model back as it found it: its
        own attention implementation and projection modules. Idempotent; the engine takes
        no request afterwards."""
        if self._closed:
            return
        self._loop.stop()
        with self._lock:
            self._drain()
            for r in [*self.scheduler.waiting, *self.scheduler.running.values()]:
                self.scheduler.finish(r, "cancelled")
                self._outputs.publish(r, self.scheduler)
            self.runner.close()
            if self.swapper is not None:
                self.swapper.close()
            self.kv.close()
            self._closed = True
        self._attention.restore()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("the engine is closed")
        if self._loop.error is not None:
            raise KvvmError(f"the engine's loop failed: {self._loop.error!r}") from self._loop.error

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
