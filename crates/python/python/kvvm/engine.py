"""Continuous batching over kvvm slots: requests arrive, join the running batch, finish at
their own lengths and leave, on one :class:`~kvvm.transformers.KvvmCache`.

A request takes a free slot when the budget grants its prompt (its windows are committed at
admission; a refusal leaves it waiting, first in line); with a prefix cache, the longest cached
prefix of its prompt is mapped read-only into the slot (no prefill of those tokens, billed
once) and only the rest is prefilled; a request whose prefix another request is still
prefilling waits for that prefill to be published rather than prefilling it again. Its
prefill runs in chunks of ``prefill_chunk`` tokens, one chunk per request per step, between
the decode steps of the others (the slot is suspended in between: a decode step neither
writes nor reads it); requests in consecutive slots whose chunks have one length are
prefilled in one forward. Every decoding request advances by one
token per step in one step of the whole batch (captured once as a CUDA graph on a GPU, eager on
a CPU); requests of different lengths need no padding. A finished request's slot is released
(its memory goes back to the pool) and taken by the next request, without recapturing.

A decode step whose growth the budget cannot grant is never launched: the youngest decoding
request is preempted (its slot released, the request put back first in line with the tokens
it generated appended to its prompt, to be recomputed) until the step fits.

::

    engine = Engine(model, slots=16, max_len=8192, backend="cuda", prefix_cache_bytes=8 << 30)
    a = engine.submit(prompt_ids, max_new_tokens=128)
    engine.run()                      # or engine.step() in a serving loop
    print(a.tokens, a.finish_reason)
    engine.close()

Requires torch and transformers.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import Manager, PrefixCache, SharedPrefix
from .attention import decoder_config, use_kvvm_attention
from .cache_groups import refuse_sliding_prefix_cache
from .errors import BackpressureError, InvalidArgumentError, KvvmError, NeverFitsError
from .projections import fuse_projections as fuse
from .transformers import KvvmCache
from .prefix import KvvmPrefix

__all__ = ["Engine", "Request"]

#: Prefix-hit timings :class:`EngineStats` keeps.
HIT_TIMES_KEPT = 4096


@dataclass(eq=False)
class Request:
    """One request and what became of it. ``tokens`` grows as the engine generates;
    ``finish_reason`` is ``"stop"`` (an end token), ``"length"`` (``max_new_tokens`` or the
    cache's length) or ``"memory"`` (alone in the batch, it still could not grow)."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    eos: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    #: Prompt tokens found in the prefix cache at the last admission.
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    slot: int | None = None
    #: The tokens to prefill (the prompt, then after a preemption the prompt and the tokens
    #: generated so far) and how many of them are in the cache.
    _context: list[int] = field(default_factory=list)
    _filled: int = 0
    _admitted: int = -1

    @property
    def done(self) -> bool:
        """Whether the request finished."""
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """What the engine did so far."""

    steps: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    #: Forwards those chunks took (requests in consecutive slots whose chunks have one length
    #: share one).
    prefill_forwards: int = 0
    generated_tokens: int = 0
    admitted: int = 0
    finished: int = 0
    preempted: int = 0
    admission_refusals: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    #: Admissions put off because the request's prefix was being prefilled by another.
    prefix_waits: int = 0
    #: The last :data:`HIT_TIMES_KEPT` prefix-cache lookups that hit: (tokens hit, ms the
    #: admission's lookup and mapping took on the host, the rest of the prompt's commit
    #: included). Bounded: an engine that serves for days keeps the recent ones only.
    prefix_hit_ms: collections.deque[tuple[int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=HIT_TIMES_KEPT)
    )


def _shared_units(a: list[int], b: list[int], unit: int) -> int:
    """Tokens of the longest common prefix of ``a`` and ``b`` in whole units of ``unit``
    (each unit compared as one slice)."""
    n = 0
    while n + unit <= min(len(a), len(b)) and a[n : n + unit] == b[n : n + unit]:
        n += unit
    return n


class Engine:
    """Continuous batching of a transformers causal LM over ``slots`` kvvm slots.

    Args:
        model: a decoder of full and sliding-window attention layers (Llama, Mistral, Qwen2,
            Gemma 2 and 3, ...); it is switched to the kvvm attention. A prefix cache is
            refused for a model with sliding-window layers.
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
        fuse_projections: run the model's sibling projections (Q, K and V; gate and up) as
            one matrix multiply each (:func:`kvvm.projections.fuse_projections`; the model's
            modules are given back by :meth:`close`).
        eos_token_ids: the tokens that end a request (default: the model's).
        seed: the sampler's seed (temperature > 0).
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
        eos_token_ids: list[int] | None = None,
        seed: int = 0,
    ) -> None:
        if slots < 1 or max_len < 2 or prefill_chunk < 1 or prefill_batch_tokens < 1:
            raise InvalidArgumentError("slots, max_len, prefill_chunk and prefill_batch_tokens must be positive")
        if prefix_cache_bytes > 0:
            refuse_sliding_prefix_cache(decoder_config(model.config), max_len)
        if manager is None:
            manager = Manager(backend, budget_bytes=budget_bytes, precommit=True, headroom_tokens=headroom_tokens)
        use_kvvm_attention(model)
        self.model = model
        self.manager = manager
        # K/V in the model's own dtype.
        self.cache = KvvmCache(model.config, slots, max_len, manager=manager, dtype=model.dtype)
        self._fused = fuse(model) if fuse_projections else None
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.prefill_batch_tokens = prefill_batch_tokens
        self.compile = compile
        plan = self.cache.plan
        handle_windows = max(1, prefix_handle_tokens // plan.mapped_tokens(1))
        self.prefix_cache = (
            PrefixCache(manager, plan, max_cached_bytes=prefix_cache_bytes, handle_windows=handle_windows)
            if prefix_cache_bytes > 0
            else None
        )
        #: The prefix cache's hit granularity in tokens (whole blocks).
        self._hit_unit = self.prefix_cache.block_tokens if self.prefix_cache is not None else 1
        eos = eos_token_ids if eos_token_ids is not None else getattr(model.generation_config, "eos_token_id", None)
        self.eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.device = self.cache.state.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._order = itertools.count()
        self._last = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._graph: Any = None

    # ---- requests ----

    def submit(
        self,
        token_ids: list[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        eos_token_ids: list[int] | None = None,
    ) -> Request:
        """Queues a request; returns its handle (``tokens`` grows as it is generated)."""
        if not token_ids:
            raise InvalidArgumentError("a request needs at least one prompt token")
        if max_new_tokens < 1:
            raise InvalidArgumentError("max_new_tokens must be positive")
        if len(token_ids) >= self.max_len:
            raise InvalidArgumentError(f"a prompt of {len(token_ids)} tokens leaves no room in {self.max_len}")
        if temperature < 0:
            raise InvalidArgumentError("temperature must not be negative")
        eos = frozenset(eos_token_ids) if eos_token_ids is not None else self.eos
        r = Request(next(self._ids), list(token_ids), max_new_tokens, temperature, eos)
        r._context = list(r.prompt)
        self.waiting.append(r)
        return r

    @property
    def idle(self) -> bool:
        """Whether nothing waits and nothing runs."""
        return not self.waiting and not self.running

    # ---- the loop ----

    @torch.no_grad()
    def step(self) -> int:
        """One iteration: admissions, a prefill chunk of each request still prefilling, one
        decode step of every decoding request, retirements. Returns the tokens generated."""
        self.stats.steps += 1
        self._admit()
        produced = self._prefill()
        produced += self._decode()
        return produced

    def run(self, max_steps: int | None = None) -> None:
        """Steps until every request finished (or ``max_steps`` steps)."""
        for n in itertools.count():
            if self.idle or (max_steps is not None and n >= max_steps):
                return
            if self.step() == 0 and not self.running and self.waiting:
                raise BackpressureError(
                    "nothing runs and the first waiting request cannot be admitted: the budget "
                    "is too small for its prompt"
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
        if self.prefix_cache is None:
            raise InvalidArgumentError("the engine has no prefix cache (prefix_cache_bytes=0)")
        shared = prefix.shared if isinstance(prefix, KvvmPrefix) else prefix
        n = shared.tokens
        if len(token_ids) < n:
            raise InvalidArgumentError(f"{len(token_ids)} token ids for a prefix of {n} shared tokens")
        self.prefix_cache.insert(list(token_ids[:n]), [shared])
        return n

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
        vocab = int(getattr(self.model.config, "vocab_size", 2))
        for i in range(self.cache.batch_size):
            ids = [(7 + 13 * (i * prompt_tokens + t)) % vocab for t in range(prompt_tokens)]
            self.submit(ids, new_tokens, eos_token_ids=[])
        self.run()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.stats = EngineStats()

    def close(self) -> None:
        """Drops the captured step, releases every slot, empties the prefix cache (its
        published prefixes' memory goes back) and gives the model its own projection
        modules back."""
        if self._graph is not None:
            self._graph.close()
            self._graph = None
        self.cache.release()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self._fused is not None:
            self._fused.restore()
            self._fused = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- admission ----

    def _free_slots(self) -> list[int]:
        return [i for i in range(self.cache.batch_size) if i not in self.running]

    def _admit(self) -> None:
        """Admits waiting requests in order into free slots, until the budget refuses one. A
        request whose prompt opens with a prefix another request is still prefilling waits
        for it to be published (and is passed over meanwhile), so that requests arriving
        together with one system prompt prefill it once."""
        free = self._free_slots()
        for r in list(self.waiting):
            if not free:
                return
            if self._waits_for_prefill(r):
                self.stats.prefix_waits += 1
                continue
            slot = free[0]
            try:
                hit = self._admit_into(slot, r)
            except BackpressureError:
                self.stats.admission_refusals += 1
                return
            except NeverFitsError:
                # Its context can never fit, whatever is freed.
                self.waiting.remove(r)
                r.finish_reason = "memory"
                self.stats.finished += 1
                continue
            self.waiting.remove(r)
            free.pop(0)
            r.slot, r._filled, r._admitted = slot, hit, next(self._order)
            r.prefix_hit_tokens = hit
            self.running[slot] = r
            self.stats.admitted += 1
            if hit:
                self.stats.prefix_hits += 1
                self.stats.prefix_hit_tokens += hit

    def _waits_for_prefill(self, r: Request) -> bool:
        """Whether a request still prefilling will publish at least one more hit unit of
        ``r``'s prompt than it found cached itself (what ``r`` could map once it is
        published, and cannot map now)."""
        if self.prefix_cache is None:
            return False
        mine = r._context[:-1]  # the last token is always computed
        return any(
            _shared_units(other._context, mine, self._hit_unit) > other.prefix_hit_tokens
            for other in self.running.values()
            if other._filled < len(other._context)
        )

    def _admit_into(self, slot: int, r: Request) -> int:
        """Commits the request's context in ``slot`` (mapping a cached prefix of it when
        there is one); returns the tokens found cached. The slot stays suspended until its
        prefill is done."""
        seq = self.cache.batch[slot]
        hit = 0
        try:
            with self.cache.unbound():
                if self.prefix_cache is not None:
                    # The last token is always computed (its logits give the first new token),
                    # so it is left out of the lookup: it never lies in read-only memory.
                    began = time.perf_counter()
                    hit = int(self.prefix_cache.admit(seq, r._context[:-1])["hit_tokens"])
                    if hit:
                        self.stats.prefix_hit_ms.append((hit, (time.perf_counter() - began) * 1000))
                self.cache.ensure_slot(slot, len(r._context))
        except KvvmError:
            self.cache.free(slot)
            raise
        self.cache.state.set_lengths({slot: hit}, {slot: 0})
        self.cache.state.suspend(slot)
        return hit

    # ---- prefill ----

    def _prefill(self) -> int:
        """A chunk of every request still prefilling, requests in consecutive slots whose
        chunks have one length in one forward; a request whose prompt is then complete is
        published and gets its first token."""
        produced = 0
        for slots, n in self._prefill_runs():
            logits = self._prefill_forward(slots, n)
            for row, slot in enumerate(slots):
                r = self.running[slot]
                r._filled += n
                if r._filled < len(r._context):
                    self.cache.state.suspend(slot)
                    continue
                if self.prefix_cache is not None:
                    self._publish(slot)
                token = self._sample(logits[row : row + 1], [r])
                self._last[slot] = token[0]
                produced += self._accept(slot, r, int(token[0]))
        return produced

    def _prefill_runs(self) -> list[tuple[list[int], int]]:
        """The slots still prefilling as runs of consecutive slots whose next chunk has the
        same length ``n``, each of at most ``prefill_batch_tokens`` tokens (one row at least)."""
        chunks = sorted(
            (slot, min(len(r._context) - r._filled, self.prefill_chunk))
            for slot, r in self.running.items()
            if r._filled < len(r._context)
        )
        runs: list[tuple[list[int], int]] = []
        for slot, n in chunks:
            last = runs[-1] if runs else None
            if last and last[1] == n and last[0][-1] == slot - 1 and (len(last[0]) + 1) * n <= self.prefill_batch_tokens:
                last[0].append(slot)
            else:
                runs.append(([slot], n))
        return runs

    def _prefill_forward(self, slots: list[int], n: int) -> torch.Tensor:
        """The next ``n`` tokens of the requests in ``slots`` (consecutive) in one forward;
        returns each row's logits at its last token."""
        rows = [self.running[s] for s in slots]
        ids = torch.tensor([r._context[r._filled : r._filled + n] for r in rows], dtype=torch.long, device=self.device)
        first = torch.tensor([r._filled for r in rows], device=self.device)
        pos = first[:, None] + torch.arange(n, device=self.device)[None]
        for s in slots:
            self.cache.state.resume(s)
        with self.cache.select(slots[0], len(slots)):
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.stats.prefill_chunks += len(slots)
        self.stats.prefill_forwards += 1
        return out.logits[:, -1]

    def _publish(self, slot: int) -> None:
        """Publishes the prompt the slot just prefilled (the model wrote it on the device,
        on the stream every later reader uses)."""
        seq = self.cache.batch[slot]
        seq.mark_written(self.cache.state.host_lengths[slot])
        with self.cache.unbound():
            assert self.prefix_cache is not None
            self.prefix_cache.publish(seq)

    # ---- decode ----

    def _decoding(self) -> list[int]:
        return [s for s, r in self.running.items() if r._filled >= len(r._context) and not r.done]

    def _decode(self) -> int:
        slots = self._decoding()
        if not slots:
            return 0
        while True:
            try:
                logits = self._decode_step(slots)
                break
            except BackpressureError:
                if not self._preempt_youngest(slots):
                    raise
                slots = self._decoding()
                if not slots:
                    return 0
        self.stats.decode_steps += 1
        reqs = [self.running[s] for s in slots]
        index = torch.tensor(slots, device=self.device)
        sampled = self._sample(logits.index_select(0, index), reqs)
        self._last.index_copy_(0, index, sampled)
        tokens = sampled.tolist()
        produced = 0
        for s, r, t in zip(slots, reqs, tokens, strict=True):
            produced += self._accept(s, r, int(t))
        return produced

    def _decode_step(self, slots: list[int]) -> torch.Tensor:
        """One decode step of ``slots`` (the other slots are free or suspended)."""
        if self.device.type == "cuda":
            if self._graph is None:
                from .graph import DecodeGraph

                self._graph = DecodeGraph(self.model, self.cache, compile=self.compile, slots=slots)
            return self._graph(self._last, slots)
        self.cache.prepare(1, slots)
        pos = self.cache.state.positions(1)
        out = self.model(input_ids=self._last[:, None], position_ids=pos, past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1]

    def _preempt_youngest(self, slots: list[int]) -> bool:
        """Frees the most recently admitted decoding request's slot and puts it back first in
        line, its generated tokens appended to its prompt (recomputed when it is admitted
        again). False when there is no other request to make room for."""
        if len(slots) <= 1:
            r = self.running[slots[0]]
            self._finish(slots[0], r, "memory")
            return True
        slot = max(slots, key=lambda s: self.running[s]._admitted)
        r = self.running.pop(slot)
        self.cache.free(slot)
        r.slot, r._filled, r.preemptions = None, 0, r.preemptions + 1
        r._context = r.prompt + r.tokens
        self.waiting.appendleft(r)
        self.stats.preempted += 1
        return True

    # ---- tokens ----

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Greedy for a temperature of 0, else sampled at each request's temperature."""
        greedy = logits.argmax(-1)
        temps = [r.temperature for r in reqs]
        if not any(temps):
            return greedy
        t = torch.tensor([x or 1.0 for x in temps], device=logits.device, dtype=torch.float32)[:, None]
        probs = torch.softmax(logits.float() / t, dim=-1)
        sampled = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
        hot = torch.tensor([x > 0 for x in temps], device=logits.device)
        return torch.where(hot, sampled, greedy)

    def _accept(self, slot: int, r: Request, token: int) -> int:
        """Appends ``token`` to the request; finishes it on an end token, at its limit or at
        the cache's length."""
        r.tokens.append(token)
        self.stats.generated_tokens += 1
        if token in r.eos:
            self._finish(slot, r, "stop")
        elif len(r.tokens) >= r.max_new_tokens or len(r.prompt) + len(r.tokens) >= self.max_len:
            self._finish(slot, r, "length")
        return 1

    def _finish(self, slot: int, r: Request, reason: str) -> None:
        r.finish_reason = reason
        r.slot = None
        self.running.pop(slot, None)
        self.cache.free(slot)
        self.stats.finished += 1
