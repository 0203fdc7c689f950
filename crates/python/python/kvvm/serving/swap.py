"""Preemption by swap: a preempted request's KV copied to page-locked host memory (a
:class:`~kvvm.HostTier`, under the manager's host budget) and back into a free slot when it is
admitted again, instead of being computed again from its context, when that is cheaper.

The decision (:class:`SwapCosts`) compares measured costs: swapping ``b`` bytes costs
``b / bandwidth_out + b / bandwidth_in`` (both measured once at start, by a round trip of a
scratch sequence of the cache's plan: copies, release and commit included); computing ``n``
tokens again costs ``n`` times the prefill seconds per token (measured as the engine runs:
each step's time less a decode step's, over the tokens it prefilled, from steps that
prefilled enough tokens for their fixed costs not to dominate; the median of the last ones).
Until both are known the engine recomputes. ``mode="always"`` swaps whatever the costs,
``"never"`` never does.

Every failure falls back to recomputing: a host budget spent, a failed copy, a refused
commit on the way back (the swap is dropped, the slot freed, the request admitted as a
recomputed one). A swap refused for device memory on the way back (BackpressureError) stays
on the host and is tried again at the next admission.

A swapped request holds no slot: its memory was released once its copies were done, so no
step can read or write it; on the way back it is committed again, copied (waited for), and
its slot suspended (device limit 0) until its prefill resumes it, like any admission.

Limits: copies are waited for on the host (the decode of the others is not launched
meanwhile); a model with sliding-window layers is refused (their forgotten tokens and device
floors are not carried over).
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from ..bindings import HostTier, Sequence, SwappedKv
from ..errors import BackpressureError, InvalidArgumentError, KvvmError
from .request import Request
from .scheduler import Admission, Scheduler

if TYPE_CHECKING:
    from .kv_manager import KvManager

__all__ = ["MIN_PREFILL_SAMPLE_TOKENS", "SWAP_MODES", "SwapCosts", "SwapScheduler", "Swapper"]

#: The preemption policies: by measured costs, always swap, never swap.
SWAP_MODES = ("auto", "always", "never")

#: Prefill samples kept.
_SAMPLES = 64

#: Prompt tokens a step must prefill to be a prefill sample: a step of fewer (a request
#: resumed one token short, a chunk's last few) is timed by its fixed costs, the forward's
#: launches and the host's work, and its time over its tokens would price a long recompute
#: at many times its cost.
MIN_PREFILL_SAMPLE_TOKENS = 16


class SwapCosts:
    """The measured costs a swap is decided by (see the module's text). ``bandwidth_out``,
    ``bandwidth_in`` (bytes/s) and ``prefill_s_per_token`` may be given (tests, a known
    device) instead of measured."""

    def __init__(
        self,
        bandwidth_out: float | None = None,
        bandwidth_in: float | None = None,
        prefill_s_per_token: float | None = None,
    ) -> None:
        self.bandwidth_out = bandwidth_out
        self.bandwidth_in = bandwidth_in
        self._fixed_prefill = prefill_s_per_token
        self._prefill: collections.deque[float] = collections.deque(maxlen=_SAMPLES)
        self._decode: collections.deque[float] = collections.deque(maxlen=_SAMPLES)

    @property
    def prefill_s_per_token(self) -> float | None:
        """Seconds to prefill one token (given, or the median of the samples; None: none)."""
        if self._fixed_prefill is not None:
            return self._fixed_prefill
        return statistics.median(self._prefill) if self._prefill else None

    def record_step(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """Takes one engine step's wall time: a decode-only step is a decode sample; a step
        that prefilled :data:`MIN_PREFILL_SAMPLE_TOKENS` tokens or more gives ``(seconds - a
        decode step) / prefill_tokens``; a step that prefilled fewer is no sample."""
        if prefill_tokens <= 0:
            if decode_rows > 0:
                self._decode.append(seconds)
            return
        if prefill_tokens < MIN_PREFILL_SAMPLE_TOKENS:
            return
        if decode_rows > 0:
            if not self._decode:
                return
            seconds -= statistics.median(self._decode)
        if seconds > 0:
            self._prefill.append(seconds / prefill_tokens)

    def swap_seconds(self, nbytes: int) -> float | None:
        """Seconds to copy ``nbytes`` out and back (None: the bandwidth is not known)."""
        if not self.bandwidth_out or not self.bandwidth_in:
            return None
        return nbytes / self.bandwidth_out + nbytes / self.bandwidth_in

    def recompute_seconds(self, tokens: int) -> float | None:
        """Seconds to prefill ``tokens`` again (None: not measured yet)."""
        rate = self.prefill_s_per_token
        return None if rate is None else tokens * rate

    def host_hit_is_cheaper(self, tokens: int, nbytes: int) -> bool:
        """Whether copying back ``tokens`` tokens of ``nbytes`` bytes from the prefix cache's
        host level (``nbytes / bandwidth_in``) beats prefilling them (False while either cost
        is unknown: prefilling is the fallback)."""
        again = self.recompute_seconds(tokens)
        if not self.bandwidth_in or again is None:
            return False
        return nbytes / self.bandwidth_in < again

    def swap_is_cheaper(self, tokens: int, nbytes: int) -> bool:
        """Whether swapping ``tokens`` tokens of ``nbytes`` bytes beats computing them again
        (False while either cost is unknown: recomputing is the fallback)."""
        swap, again = self.swap_seconds(nbytes), self.recompute_seconds(tokens)
        return swap is not None and again is not None and swap < again

    def as_dict(self) -> dict[str, float | None]:
        """The costs as measured now."""
        return {
            "bandwidth_out": self.bandwidth_out,
            "bandwidth_in": self.bandwidth_in,
            "prefill_s_per_token": self.prefill_s_per_token,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(tier: HostTier, plan: Any, windows: int = 8) -> tuple[float, float]:
    """Bytes/s of a swap out and of a swap back of a scratch sequence of ``plan`` of at most
    ``windows`` windows (its copies, its release and its commit). Raises what a swap raises
    (the budget, the host budget). At most the windows the budget has free now are used."""
    free = tier.manager.snapshot().free
    if free is not None:
        windows = max(1, min(windows, free // tier.manager.granule))
    tokens = min(plan.geometry.max_tokens, plan.mapped_tokens(1) * windows)
    seq = Sequence(tier.manager, plan, tokens)
    try:
        seq.ensure(tokens)
        began = time.perf_counter()
        swap = seq.swap_out(tier, tokens)
        seq.finish_swap_out(swap)
        out = time.perf_counter() - began
        nbytes = swap.bytes
        began = time.perf_counter()
        seq.swap_in(swap)
        seq.finish_swap_in(swap)
        back = time.perf_counter() - began
    finally:
        seq.release()
    return nbytes / max(out, 1e-9), nbytes / max(back, 1e-9)


class Swapper:
    """The engine's host tier (see the module's text): swaps a preempted request's slot out,
    and back into a free slot at its admission.

    Args:
        kv: the engine's KV manager.
        host_bytes: page-locked bytes allocated at start (the most a swap may hold; the
            manager's host budget bounds them too).
        mode: ``"auto"`` (by measured costs), ``"always"`` or ``"never"``.
        costs: the costs (measured when omitted).
    """

    def __init__(self, kv: KvManager, host_bytes: int, mode: str = "auto", costs: SwapCosts | None = None) -> None:
        if mode not in SWAP_MODES:
            raise InvalidArgumentError(f"swap must be one of {SWAP_MODES}, not {mode!r}")
        if any(g.spec.sliding for g in kv.cache.groups):
            raise InvalidArgumentError("preemption by swap needs a model without sliding-window layers")
        self.kv = kv
        self.mode = mode
        self.tier = HostTier(kv.manager, slab_windows=max(1, host_bytes // kv.manager.granule))
        self.tier.prewarm(host_bytes)
        self.costs = costs or SwapCosts()
        if mode == "auto" and self.costs.bandwidth_out is None:
            with kv.cache.unbound():
                self.costs.bandwidth_out, self.costs.bandwidth_in = measure_bandwidth(
                    self.tier, kv.cache.groups[0].plan
                )
        #: Swaps on the host, by request id.
        self.swaps: dict[int, list[SwappedKv]] = {}
        #: What each swapped request's slot shared (:meth:`KvManager.unshare`), by id.
        self._shared: dict[int, Any] = {}
        self._host_key: tuple[float | None, float | None] = (None, None)
        self._host_min: int | None = None

    def host_min_tokens(self) -> int | None:
        """The fewest tokens a hit on the prefix cache's host level must bring beyond the
        device's hit to be copied back rather than prefilled: with ``"auto"`` the shortest
        length (in the cache's hit units) at which :meth:`SwapCosts.host_hit_is_cheaper`
        (None: none, or a cost not measured yet); 1 with ``"always"``; None with
        ``"never"``."""
        if self.mode != "auto":
            return 1 if self.mode == "always" else None
        key = (self.costs.bandwidth_in, self.costs.prefill_s_per_token)
        if key != self._host_key:
            # A copy moves whole windows: when a whole window's copy beats its prefill, so
            # does every multiple's, and the shortest length that wins lies within the first
            # two windows (the hit units need not fill a window); when none does, no length
            # wins.
            unit = max(1, self.kv.hit_unit)
            window = max(unit, self.kv.cache.plan.mapped_tokens(1))
            self._host_key, self._host_min = key, next(
                (n for n in range(unit, min(2 * window, self.kv.max_len) + 1, unit)
                 if self.costs.host_hit_is_cheaper(n, self.kv.cache.bytes_for_tokens(n))),
                None,
            )
        return self._host_min

    def holds(self, r: Request) -> bool:
        """Whether ``r``'s KV is on the host."""
        return r.id in self.swaps

    def _wanted(self, tokens: int) -> bool:
        if self.mode != "auto":
            return self.mode == "always"
        nbytes = self.kv.cache.bytes_for_tokens(tokens)
        return self.costs.swap_is_cheaper(tokens, nbytes)

    def swap_out(self, slot: int, r: Request) -> bool:
        """Moves the tokens ``slot`` holds to the host when that is wanted and works; the
        slot is then free (its memory released). False: nothing moved (the caller frees the
        slot; the request is computed again)."""
        cache = self.kv.cache
        tokens = min(cache.state.host_lengths[slot], len(r.prompt) + len(r.tokens) - 1)
        if tokens <= 0 or not self._wanted(tokens):
            return False
        # Its windows are unmapped before the slot is freed: no group reads through it. The
        # same bytes come back with the swap: shared again then.
        shared = self.kv.unshare(slot)
        stream = torch.cuda.current_stream(self.kv.device) if self.kv.device.type == "cuda" else None
        swaps: list[SwappedKv] = []
        try:
            with cache.unbound():
                for g in cache.groups:
                    swaps.append(g.batch[slot].swap_out(self.tier, tokens, after=stream))
                for g, s in zip(cache.groups, swaps, strict=True):
                    g.batch[slot].finish_swap_out(s)
        except KvvmError:
            return False
        cache.free(slot)
        self.swaps[r.id] = swaps
        self._shared[r.id] = shared
        return True

    def swap_in(self, slot: int, r: Request) -> Admission | None:
        """Brings ``r``'s swap back into the free ``slot``: an admission of the tokens it
        held (the rest of its context, at least the last token, committed and prefilled).
        None: it failed and was dropped (admit the request to compute it again). Raises
        BackpressureError when the budget has not the bytes of its context free now (the
        swap stays on the host)."""
        swaps = self.swaps[r.id]
        cache = self.kv.cache
        began = time.perf_counter()
        budget = self.kv.manager.budget_bytes
        if budget is not None and cache.bytes_for_tokens(len(r._context)) > budget:
            # Its context can never be held (the admission that recomputes it says so).
            del self.swaps[r.id]
            self._shared.pop(r.id, None)
            return None
        self._check_room(len(r._context))
        done: list[Sequence] = []
        try:
            with cache.unbound():
                for g, s in zip(cache.groups, swaps, strict=True):
                    g.batch[slot].swap_in(s)
                    done.append(g.batch[slot])
                for seq, s in zip(done, swaps, strict=True):
                    seq.finish_swap_in(s)
        except BackpressureError:
            if not done:
                raise
            self._drop(slot, r)
            return None
        except KvvmError:
            self._drop(slot, r)
            return None
        tokens = swaps[0].tokens
        del self.swaps[r.id]
        shared = self._shared.pop(r.id, None)
        try:
            # The rest of its context (at least the token whose logits come next), as an
            # admission commits it: no prefill forward asks for memory.
            with cache.unbound():
                cache.ensure_slot(slot, len(r._context))
        except KvvmError:
            self.kv.free(slot)
            return None
        cache.state.set_lengths({slot: tokens}, {slot: 0})
        cache.state.suspend(slot)
        self.kv.reshare(slot, shared)
        return Admission(tokens, (time.perf_counter() - began) * 1000, swapped=True)

    def _check_room(self, tokens: int) -> None:
        """BackpressureError when the budget has not the bytes of a context of ``tokens``
        tokens available now (the swap then stays on the host: nothing is tried). Available
        is what a commit could be granted: the free bytes and what the grant reclaims first
        (the pool's handles, the pre-committer's windows ahead, idle cached prefixes), as a
        recomputed request's admission would get them."""
        available = self.kv.manager.available_bytes()
        needed = self.kv.cache.bytes_for_tokens(tokens)
        if available is not None and available < needed:
            raise BackpressureError(
                f"a swapped context of {tokens} tokens needs {needed} bytes; {available} are available",
                needed_bytes=needed,
                available_bytes=available,
            )

    def _drop(self, slot: int, r: Request) -> None:
        """Gives up ``r``'s swap (its host memory goes back) and frees the slot."""
        self.swaps.pop(r.id, None)
        self._shared.pop(r.id, None)
        self.kv.free(slot)

    def close(self) -> None:
        """Drops every swap (their host memory goes back) and frees idle page-locked memory."""
        self.swaps.clear()
        self._shared.clear()
        self.tier.trim()


class SwapScheduler(Scheduler):
    """The scheduler with preemption by swap: a preempted request is swapped out when its
    :class:`Swapper` wants it (else its slot is freed and it is computed again), and admitted
    again by swapping it back in (falling back to an admission that recomputes it)."""

    def __init__(self, kv: Any, swapper: Swapper, **kwargs: Any) -> None:
        super().__init__(kv, **kwargs)
        self.swapper = swapper

    def _vacate(self, slot: int, r: Request) -> None:
        began = time.perf_counter()
        swapped = self.swapper.swap_out(slot, r)
        if swapped:
            self.stats.swapped_out += 1
            self.stats.swap_out_ms += (time.perf_counter() - began) * 1000
        else:
            super()._vacate(slot, r)

    def _admit_one(self, slot: int, r: Request) -> Admission:
        if self.swapper.holds(r):
            admission = self.swapper.swap_in(slot, r)
            if admission is not None:
                self.stats.swap_in_ms += admission.ms
                self.stats.swapped_in += 1
                return admission
            self.stats.swap_fallbacks += 1
        return super()._admit_one(slot, r)

    def _waits_for_prefill(self, r: Request) -> bool:
        return not self.swapper.holds(r) and super()._waits_for_prefill(r)
