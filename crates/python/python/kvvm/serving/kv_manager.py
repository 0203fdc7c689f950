"""The KV manager of the serving engine: the one owner of the engine's kvvm memory.

It holds the :class:`~kvvm.transformers.KvvmCache` (one slot per running request and the
scratch slot) and the :class:`~kvvm.PrefixCache`, and it is the only code of the engine that
calls into kvvm: admissions (a cached prefix mapped, the rest of the context committed),
reservations of the next tokens' windows, the device-side token counts around each forward
(a slot is resumed for its prefill chunk and suspended after it, so that a decode step
neither writes nor reads it), publication of a prefilled prompt, and releases.

Towards the scheduler it answers about memory (:class:`~kvvm.serving.scheduler.KvSpace`);
towards the runner it opens each forward over the cache (:meth:`KvManager.prefill` and
:meth:`KvManager.prepare_decode`). Every prefix-cache call is in one small method here
(:meth:`KvManager._lookup_prefix`, :meth:`KvManager._publish`,
:meth:`KvManager.add_prefix`, :meth:`KvManager.shareable`).

Requires torch and transformers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import HostTier, Manager, PrefixCache, SharedPrefix
from ..bindings import decoder_config
from ..errors import InvalidArgumentError, KvvmError, NeverFitsError
from ..kernels.fp8 import make_scales
from ..transformers.cache import KvvmCache
from ..transformers.cache_groups import refuse_sliding_prefix_cache
from ..transformers.prefix import KvvmPrefix
from .scheduler import Admission, PrefillRun

__all__ = ["KvManager", "shared_units"]


def shared_units(a: list[int], b: list[int], unit: int) -> int:
    """Tokens of the longest common prefix of ``a`` and ``b`` in whole units of ``unit``.

    Galloping over the units: a run of equal slices doubles the next slice compared, a
    difference halves it, down to one unit; a few slice comparisons for a prefix of
    thousands of tokens (the scheduler asks for every waiting request each step)."""
    if unit < 1:
        return 0
    most = min(len(a), len(b)) // unit * unit
    n, step = 0, unit
    while step >= unit:
        if n + step <= most and a[n : n + step] == b[n : n + step]:
            n += step
            step *= 2
        else:
            step //= 2
    return n


class KvManager:
    """The engine's cache slots and prefix cache (see the module's text).

    Args:
        model: the model (its config and dtype lay the cache out).
        slots: requests held at once.
        max_len: the most tokens a request may reach (reserved as address space only).
        manager: the :class:`~kvvm.Manager` every byte comes from.
        prefix_cache_bytes: the prefix cache's cap (0: no prefix cache).
        prefix_handle_tokens: tokens per handle of a published prefix (rounded down to
            whole windows, at least one).
        kv_dtype, kv_scales: what the cache stores K/V as (None: the model's dtype;
            ``"fp8_e4m3"``: FP8 KV) and an FP8 cache's scales, as
            :class:`~kvvm.transformers.KvvmCache`'s. The prefix cache and the host tier hold
            the cache's bytes as they are, under the same scales.
        cascade: make the cache with the cascade decode's tables and mark each slot a
            prefix-cache hit fills as sharing it (:meth:`admit`): the decode step reads each
            shared prefix once per group of requests (a model whose layers slide has no
            tables: nothing is shared, nothing changes).
    """

    def __init__(
        self,
        model: Any,
        *,
        slots: int,
        max_len: int,
        manager: Manager,
        prefix_cache_bytes: int = 0,
        prefix_handle_tokens: int = 256,
        kv_dtype: Any = None,
        kv_scales: Any = None,
        cascade: bool = False,
    ) -> None:
        if not isinstance(cascade, bool):
            raise InvalidArgumentError(f"cascade must be a bool, not {cascade!r}")
        self.manager = manager
        #: The most tokens a request may reach.
        self.max_len = max_len
        if prefix_cache_bytes > 0:
            refuse_sliding_prefix_cache(decoder_config(model.config), max_len)
        # K/V in the model's own dtype, unless stored as FP8.
        self.cache = KvvmCache(
            model.config, slots, max_len, manager=manager, dtype=model.dtype, kv_dtype=kv_dtype, kv_scales=kv_scales,
            cascade=cascade,
        )
        plan = self.cache.plan
        handle_windows = max(1, prefix_handle_tokens // plan.mapped_tokens(1))
        self.prefix_cache = (
            PrefixCache(manager, plan, max_cached_bytes=prefix_cache_bytes, handle_windows=handle_windows)
            if prefix_cache_bytes > 0
            else None
        )
        #: The prefix cache's hit granularity in tokens (whole blocks).
        self.hit_unit = self.prefix_cache.block_tokens if self.prefix_cache is not None else 1
        #: With a host level: the fewest tokens a host hit must bring to be copied back.
        self._host_min_tokens: Callable[[], int | None] | None = None
        #: What the scratch slot holds for good, in every layer group: no request can have it.
        scratch = self.cache.batch_size
        self._scratch_bytes = sum(g.batch[scratch].committed_bytes for g in self.cache.groups)
        self.device: torch.device = self.cache.state.device

    # ---- what the scheduler asks ----

    @property
    def slots(self) -> int:
        """Requests held at once."""
        return self.cache.batch_size

    def admit(self, slot: int, context: list[int]) -> Admission:
        """Commits ``context`` in ``slot`` (mapping a cached prefix of it when there is one);
        the slot stays suspended until its prefill is done. Raises NeverFitsError, before
        anything is committed, for a context the budget can never hold beside the scratch
        window; on any refusal the slot is left free. With the cascade, a slot given a hit
        shares it with every slot given the same bytes (:meth:`_share`)."""
        self._check_fits(len(context))
        seq = self.cache.batch[slot]
        hit, host, ms, origin = 0, 0, 0.0, 0
        try:
            with self.cache.unbound():
                if self.prefix_cache is not None:
                    hit, host, ms, origin = self._lookup_prefix(seq, context)
                self.cache.ensure_slot(slot, len(context))
        except KvvmError:
            self.cache.free(slot)
            raise
        self.cache.state.set_lengths({slot: hit}, {slot: 0})
        self.cache.state.suspend(slot)
        self._share(slot, hit, origin)
        return Admission(hit, ms, host_tokens=host)

    def _share(self, slot: int, hit: int, origin: int) -> None:
        """Marks ``slot``'s first ``hit`` tokens as the prefix of origin ``origin`` (the
        cascade reads a group's prefix through any member's slot: slots share only when the
        prefix cache says their bytes are the same, one prefill's, mapped or copied; the same
        token ids prefilled again are another prefix). Nothing without the cascade's tables
        or a hit."""
        if self.cache.cascade and hit > 0 and origin:
            self.cache.share_prefix([slot], ("prefix-cache", origin), hit)

    def unshare(self, slot: int) -> tuple[Any, int] | None:
        """Ends ``slot``'s share before its windows change other than by a free (a swap to
        the host): no step reads another slot's prefix through it any more. Returns what it
        shared (key, tokens; None: nothing), for :meth:`reshare` once the same bytes are
        back."""
        shared = self.cache.shared_prefix(slot)
        if shared is not None:
            self.cache.share_prefix([slot], None, 0)
        return shared

    def reshare(self, slot: int, shared: tuple[Any, int] | None) -> None:
        """Marks ``slot`` as sharing what :meth:`unshare` returned, its bytes copied back
        as they were (a swap back from the host)."""
        if shared is not None and self.cache.cascade:
            self.cache.share_prefix([slot], *shared)

    def _check_fits(self, tokens: int) -> None:
        """NeverFitsError when one request of ``tokens`` tokens, alone with the scratch window,
        is over the budget less its quarantine: no freeing can ever admit it. (The governor
        counts the request alone; the scratch window it does not know about would leave the
        request refused for memory now, and first in line, for ever.)"""
        budget = self.manager.budget_bytes
        if budget is None:
            return
        limit = budget - self.manager.snapshot().quarantined
        needed = self.cache.bytes_for_tokens(tokens)
        if needed + self._scratch_bytes > limit:
            raise NeverFitsError(
                f"a context of {tokens} tokens needs {needed} bytes; with the cache's scratch window "
                f"({self._scratch_bytes} bytes) that is over the budget of {limit} bytes",
                needed_bytes=needed + self._scratch_bytes,
                limit_bytes=limit,
            )

    def shareable(self, published: list[int], context: list[int]) -> int:
        """Tokens of ``context`` a request could map from the prefix cache once ``published``
        is published: their common prefix in whole hit units (0 without a prefix cache)."""
        if self.prefix_cache is None:
            return 0
        return shared_units(published, context, self.hit_unit)

    def reserve(self, tokens: dict[int, int]) -> None:
        """Commits the windows each slot needs to hold ``tokens[slot]`` tokens (a decode
        step's next token): the step's own preparation then needs no grant. Raises
        BackpressureError when the budget cannot grant them now."""
        self.cache.reserve_tokens(tokens)

    def free(self, slot: int) -> None:
        """Releases the slot's memory (once the device is done with it)."""
        self.cache.free(slot)

    # ---- the prefix cache ----

    def _lookup_prefix(self, seq: Any, context: list[int]) -> tuple[int, int, float, int]:
        """Maps the longest cached prefix of ``context`` into ``seq`` (or copies it back from
        the host level when that is wanted); returns the tokens hit, those of them copied back
        from the host, the host time of the lookup in ms and the origin of the hit's bytes
        (``hit_origin``: 0 without a hit). The last token is always
        computed (its logits give the first new token), so it is left out: it never lies in
        read-only memory."""
        assert self.prefix_cache is not None
        began = time.perf_counter()
        host_min = self._host_min_tokens() if self._host_min_tokens is not None else None
        info = self.prefix_cache.admit(seq, context[:-1], host_min_tokens=host_min)
        ms = (time.perf_counter() - began) * 1000
        return int(info["hit_tokens"]), int(info["host_hit_tokens"]), ms, int(info["hit_origin"])

    @property
    def host_level(self) -> bool:
        """Whether the prefix cache has a host level (:meth:`attach_host_level`)."""
        return self._host_min_tokens is not None

    def attach_host_level(self, tier: HostTier, min_tokens: Callable[[], int | None]) -> None:
        """Gives the prefix cache a host level over ``tier``: an evicted prefix is copied
        there, and ``min_tokens()`` says at each admission the fewest tokens a hit there must
        bring beyond the device's to be copied back (None: prefill them)."""
        assert self.prefix_cache is not None
        self.prefix_cache.attach_host_tier(tier)
        self._host_min_tokens = min_tokens

    def _publish(self, slot: int) -> None:
        """Publishes the prompt the slot just prefilled (the model wrote it on the device,
        on the stream every later reader uses)."""
        assert self.prefix_cache is not None
        seq = self.cache.batch[slot]
        seq.mark_written(self.cache.state.host_lengths[slot])
        with self.cache.unbound():
            self.prefix_cache.publish(seq)

    def add_prefix(self, token_ids: list[int], prefix: KvvmPrefix | SharedPrefix) -> int:
        """Inserts a prefix made outside the engine's requests into the prefix cache (see
        :meth:`~kvvm.serving.engine.Engine.add_prefix`); returns the tokens inserted."""
        if self.prefix_cache is None:
            raise InvalidArgumentError("the engine has no prefix cache (prefix_cache_bytes=0)")
        if isinstance(prefix, KvvmPrefix):
            self._check_scales(prefix)
        shared = prefix.shared if isinstance(prefix, KvvmPrefix) else prefix
        n = shared.tokens
        if len(token_ids) < n:
            raise InvalidArgumentError(f"{len(token_ids)} token ids for a prefix of {n} shared tokens")
        self.prefix_cache.insert(list(token_ids[:n]), [shared])
        return n

    def _check_scales(self, prefix: KvvmPrefix) -> None:
        """An FP8 prefix's tokens are read with the engine's scales: they must be the ones
        they were written with (a ``SharedPrefix`` carries none: the caller answers for it)."""
        mine = self.cache.kv_scales
        if mine is None or prefix.plan.geometry.dtype != "fp8":
            return
        g = self.cache.geometry
        theirs = make_scales(g.layers, g.kv_heads, prefix.kv_scales, mine.device)
        if not torch.equal(theirs, mine):
            raise InvalidArgumentError(
                "the FP8 prefix was written with other kv_scales than this engine's: its tokens would be "
                "read with the wrong scales (make the engine with the opened prefix's kv_scales)"
            )

    def clear_prefixes(self) -> None:
        """Empties the prefix cache (its published prefixes' memory goes back)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    # ---- what the runner asks ----

    @contextlib.contextmanager
    def prefill(self, run: PrefillRun) -> Iterator[KvvmCache]:
        """Opens the forward of one prefill run (consecutive slots, their windows committed
        at admission): the slots are resumed and selected, the forward runs on the cache
        yielded, then each slot whose context is not complete yet is suspended again and
        each complete one is published to the prefix cache. A forward that raises leaves
        every slot of the run suspended."""
        slots, completing = run.slots, run.completing
        state = self.cache.state
        for s in slots:
            state.resume(s)
        try:
            with self.cache.select(slots[0], len(slots)):
                yield self.cache
        except BaseException:
            for s in slots:
                state.suspend(s)
            raise
        for s, done in zip(slots, completing, strict=True):
            if not done:
                state.suspend(s)
            elif self.prefix_cache is not None:
                self._publish(s)

    def prepare_decode(self, slots: list[int]) -> None:
        """The host's side of a decode step of ``slots`` (their counts move past the step's
        token; the other slots are free or suspended). Its windows were reserved by
        :meth:`reserve`."""
        self.cache.prepare(1, slots)

    def decode_positions(self) -> torch.Tensor:
        """``[slots, 1]``: each slot's position of a decode step's token."""
        return self.cache.state.positions(1)

    # ---- the engine's ----

    def check(self) -> None:
        """Raises if a step wrote past what was prepared (:meth:`KvvmCache.check`)."""
        self.cache.check()

    def close(self) -> None:
        """Releases every slot and empties the prefix cache (close the runner's captured
        graph first)."""
        self.cache.release()
        self.clear_prefixes()
