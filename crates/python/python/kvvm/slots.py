"""Per-request token counts of a batch of kvvm slots, on the device and on the host.

A :class:`SlotState` is what lets one captured step serve requests of different lengths: each
slot's live tokens are ``[start, length)`` in device tensors (never in a tensor's shape), a
step writes each request's new tokens at its own ``length``, and attention reads each
request's own range. The host keeps the same counts (it drives the steps and never reads them
back) and, before every step, makes the tokens the step will write committed and claimed
(:meth:`SlotState.prepare`): a growth the budget cannot grant is raised there, as
:class:`~kvvm.errors.BackpressureError`, before anything is launched.

What a step may touch is also enforced on the device, so that a step launched without its
preparation (a graph replayed by hand) can never reach an unmapped window: ``limits`` holds,
per slot, the tokens that lie in windows the host has committed and claimed; a write at or
past its slot's limit goes to a scratch slot (the batch's last, one window committed) and is
counted in ``overruns``, and attention reads no further than the limit. A free slot has a
limit of 0: nothing of it is written or read. The lower bound is held too: a write at a
negative token (a count on the device that went wrong) is refused the same way, and a read
starts at token 0 at the earliest.

A cache whose layers form several groups, each in memory of its own (full and sliding
attention), gives the others as ``more``: every step commits the same tokens in each, and a
slot's limit is what all of them have mapped. ``before_growth``, when set, is called with the
slots a step prepares, before their tokens are committed (a sliding group gives back the
windows behind its window there).

Requires torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import LayoutPlan, SequenceBatch
from .errors import InvalidArgumentError

__all__ = ["SlotState", "StepIndex"]


@dataclass(frozen=True)
class StepIndex:
    """Where one step's new tokens go: ``slot[i, j], token[i, j]`` for query token ``j`` of
    the ``i``-th selected slot (the scratch slot when the write is refused), and which writes
    were accepted."""

    slot: torch.Tensor
    token: torch.Tensor
    accepted: torch.Tensor


class SlotState:
    """Token counts of ``slots`` requests in ``batch`` (which has one more slot: the scratch).

    Args:
        batch: the slots, the last one reserved as scratch.
        plan: the batch's layout plan.
        device: where the counts live (the K/V's device).
        more: other batches of the same slots (other layer groups' memory) and their plans.
    """

    def __init__(
        self, batch: SequenceBatch, plan: LayoutPlan, device: torch.device,
        more: Sequence[tuple[SequenceBatch, LayoutPlan]] = (),
    ) -> None:
        self.batch = batch
        self.plan = plan
        self._groups = [(batch, plan), *more]
        #: Called with the slots a step prepares, before their tokens are committed.
        self.before_growth: Callable[[list[int]], None] | None = None
        #: Between :meth:`snapshot` and :meth:`restore`.
        self.rewinding = False
        self.slots = len(batch) - 1
        if self.slots < 1:
            raise InvalidArgumentError("a slot state needs a batch of at least one slot and the scratch")
        self.max_tokens = batch[0].max_tokens
        n = self.slots
        self.device = device
        i32 = torch.int32
        #: Live tokens per slot (the next token is written there).
        self.lengths = torch.zeros(n, dtype=i32, device=device)
        #: First live token per slot (left padding before it is never read).
        self.starts = torch.zeros(n, dtype=i32, device=device)
        #: Tokens a write or a read may reach per slot (0: a free slot).
        self.limits = torch.zeros(n, dtype=i32, device=device)
        #: Writes refused at a limit since the last :meth:`check`.
        self.overruns = torch.zeros(1, dtype=i32, device=device)
        self._ids = torch.arange(n, dtype=torch.int64, device=device)
        self.host_lengths = [0] * n
        self.host_starts = [0] * n
        self.host_limits = [0] * n
        #: Slots left out of every step (:meth:`suspend`).
        self.suspended: set[int] = set()
        self.first, self.count = 0, n
        self.prepared = False
        self._index: tuple[int, StepIndex] | None = None
        self._steps = 0
        self._staging = _Staging(n, device)
        for b, _ in self._groups:
            b.ensure(1, first=self.slots, count=1)
        for t in (self.lengths, self.starts, self.limits, self.overruns):
            if not _compiling():
                torch._dynamo.mark_static_address(t)

    # ---- the selected slots: what the next forward computes ----

    @contextlib.contextmanager
    def select(self, first: int, count: int) -> Iterator[None]:
        """Runs the forwards inside on slots ``first..first+count`` only (their batch
        dimension is ``count``): a request's prefill into its own slot."""
        if first < 0 or count < 1 or first + count > self.slots:
            raise InvalidArgumentError(f"slots {first}..{first}+{count} are not inside the {self.slots} slots")
        saved = (self.first, self.count)
        self.first, self.count = first, count
        self._index = None
        try:
            yield
        finally:
            self.first, self.count = saved
            self._index = None

    @property
    def selected(self) -> range:
        """The slots the next forward computes."""
        return range(self.first, self.first + self.count)

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.count == self.slots else t.narrow(0, self.first, self.count)

    # ---- the host's side of a step ----

    def prepare(self, q: int, slots: list[int] | None = None) -> None:
        """Makes the next forward's ``q`` tokens of ``slots`` (default: every selected slot)
        committed and claimed, and raises their device limits to what is then mapped; the
        host counts move to after the step. Slots not named are left as they are (a free or
        suspended slot is neither written nor read by the step). Raises what
        :meth:`SequenceBatch.ensure_each` raises (BackpressureError: nothing was launched,
        no count moved)."""
        sel = self.selected
        chosen = set(sel if slots is None else slots)
        if not chosen <= set(sel):
            raise InvalidArgumentError(f"slots {sorted(chosen - set(sel))} are not selected")
        targets = [self.host_lengths[i] + q if i in chosen else 0 for i in sel]
        if any(t > self.max_tokens for t in targets):
            raise InvalidArgumentError(
                f"a step to {max(targets)} tokens is past the cache's {self.max_tokens} tokens"
            )
        if self.before_growth is not None and not self.rewinding:
            self.before_growth(sorted(chosen))
        for b, _ in self._groups:
            b.ensure_each(targets, first=self.first)
        changed = False
        for i in chosen:
            self.host_lengths[i] += q
            if self.host_lengths[i] > self.host_limits[i]:
                self.host_limits[i] = self.mapped_tokens(self.host_lengths[i])
                changed = True
        if changed:
            self._upload_limits()
        # A step advanced inside a compiled or captured forward left its index behind.
        self._index = None
        self.prepared = True

    def suspend(self, slot: int) -> None:
        """Leaves ``slot`` out of every step until :meth:`resume` (its device limit is 0: a
        step neither writes nor reads it; its memory and counts stay): a request between the
        chunks of its prefill while the others decode."""
        self.suspended.add(slot)
        self._upload_limits()

    def resume(self, slot: int) -> None:
        """Takes ``slot`` back into the steps (its device limit is what its windows hold)."""
        self.suspended.discard(slot)
        self._upload_limits()

    def mapped_tokens(self, n: int) -> int:
        """The most tokens every group has mapped once ``n`` are committed in each."""
        return min(plan.mapped_tokens(n) for _, plan in self._groups)

    def _upload_limits(self) -> None:
        self._upload(self.limits, [0 if i in self.suspended else n for i, n in enumerate(self.host_limits)])

    def _upload(self, dst: torch.Tensor, values: list[int]) -> None:
        self._staging.upload(dst, values)

    def upload(self, dst: torch.Tensor, values: list[int]) -> None:
        """Copies ``values`` into the int32 device tensor ``dst`` (of their length), ordered on
        the current stream before whatever is launched next, without waiting for the device."""
        self._staging.upload(dst, values)

    def set_lengths(self, lengths: dict[int, int], starts: dict[int, int] | None = None) -> None:
        """Sets slots' live token counts (and first live tokens) on both sides: a prefix
        attached, a crop, a slot freed (length 0). Their limits follow: what the windows of
        their live tokens hold (the caller has made those committed and claimed), 0 for a
        freed slot."""
        for i, n in lengths.items():
            if not 0 <= n <= self.max_tokens:
                raise InvalidArgumentError(f"slot {i}: {n} tokens is not inside 0..{self.max_tokens}")
            self.host_lengths[i] = n
            self.host_limits[i] = self.mapped_tokens(n) if n else 0
        for i, s in (starts or {}).items():
            self.host_starts[i] = s
        self._upload(self.lengths, self.host_lengths)
        self._upload(self.starts, self.host_starts)
        self._upload_limits()
        self._index = None

    def check(self) -> None:
        """Raises if a step wrote past a limit since the last check (a step launched without
        :meth:`prepare`: its tokens went to the scratch slot, the requests did not advance).
        Reads one count from the device."""
        n = int(self.overruns.item())
        if n:
            self.overruns.zero_()
            raise InvalidArgumentError(
                f"{n} token write(s) past the committed windows were refused (a step ran "
                "without being prepared); the requests they belonged to did not advance"
            )

    def snapshot(self) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
        """The counts, to be put back by :meth:`restore` (around warm-up steps). Until then
        :attr:`before_growth` is not called: the counts will go back, and what a step after
        the restore reads must still be there."""
        self.rewinding = True
        return self.lengths.clone(), list(self.host_lengths), list(self.host_limits), list(self.host_starts)

    def restore(self, snap: tuple[torch.Tensor, list[int], list[int], list[int]]) -> None:
        """Puts back what :meth:`snapshot` returned."""
        lengths, self.host_lengths, self.host_limits, self.host_starts = (
            snap[0], list(snap[1]), list(snap[2]), list(snap[3])
        )
        self.lengths.copy_(lengths)
        self._upload_limits()
        self._upload(self.starts, self.host_starts)
        self.overruns.zero_()
        self._index = None
        self.rewinding = False

    # ---- the device's side of a step ----

    def step(self, q: int) -> tuple[StepIndex, torch.Tensor]:
        """The next forward's device work, once for every layer: where each selected slot's
        ``q`` new tokens go (:class:`StepIndex`), each slot's index and tokens ``[start, end)``
        once they are written (``[count, 3]`` int32, no further than its limit), and the
        counts moved past the accepted tokens (refused writes of active slots counted as
        overruns)."""
        index, bounds = self.bounds(q)
        self.advance(index)
        return index, bounds

    def bounds(self, q: int) -> tuple[StepIndex, torch.Tensor]:
        """What :meth:`step` computes, without moving the counts (the same every time until
        :meth:`advance`): a forward that asks twice (a mask per attention type) gets the same
        step, and its last layer advances."""
        lengths, limits = self._view(self.lengths), self._view(self.limits)
        index = self.index(q)
        # Never outside [0, limit): a count on the device is not trusted to be non-negative.
        end = torch.minimum(lengths + q, limits).clamp_min(0)
        start = torch.minimum(self._view(self.starts), end).clamp_min(0)
        bounds = torch.stack([self._view(self._ids).to(torch.int32), start, end], dim=1)
        return index, bounds

    def index(self, q: int) -> StepIndex:
        """Where the next ``q`` tokens of each selected slot go (computed once per step, or
        once per use while torch.compile traces: it fuses them)."""
        if not _compiling() and self._index is not None and self._index[0] == (self._steps << 16 | q):
            return self._index[1]
        lengths, limits = self._view(self.lengths), self._view(self.limits)
        tokens = lengths[:, None].to(torch.int64) + torch.arange(q, device=self.device)
        # Inside the slot's mapped tokens only: a negative count (a corrupted or hand-set
        # device tensor) would otherwise index before the slot, or before the reservation.
        accepted = (tokens >= 0) & (tokens < limits[:, None])
        ids = self._view(self._ids)[:, None]
        index = StepIndex(
            slot=torch.where(accepted, ids, self.slots),
            token=torch.where(accepted, tokens, 0),
            accepted=accepted,
        )
        if not _compiling():
            self._index = (self._steps << 16 | q, index)
        return index

    def positions(self, q: int) -> torch.Tensor:
        """``[count, q]`` int64: each selected slot's positions of the step's tokens (its
        live tokens before them, left padding excluded)."""
        live = (self._view(self.lengths) - self._view(self.starts)).to(torch.int64)
        return live[:, None] + torch.arange(q, device=self.device)

    def advance(self, index: StepIndex) -> None:
        """Each selected slot counts its accepted tokens; refused writes of active slots are
        counted as overruns."""
        lengths = self._view(self.lengths)
        lengths.add_(index.accepted.sum(dim=1, dtype=torch.int32))
        active = self._view(self.limits) > 0
        refused = (~index.accepted) & active[:, None]
        self.overruns.add_(refused.sum(dtype=torch.int32))
        if not _compiling():
            self._steps += 1
            self._index = None


class _Staging:
    """Host-to-device copies of the counts that never wait for the device's queued work.

    A copy from pageable memory waits for everything queued before it: with a step replayed
    while the previous one still runs, each change of a limit would stall the host until the
    device is idle, and the device would then idle while the host prepares the next step. On
    CUDA the values go through a ring of pinned buffers instead, each copied asynchronously
    (ordered on the stream before the next step) and reused only once its copy is done;
    elsewhere they are copied directly.
    """

    #: Pinned buffers in the ring: a buffer is reused after this many more uploads.
    DEPTH = 8

    def __init__(self, n: int, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self.buffers = [torch.empty(n, dtype=torch.int32, pin_memory=True) for _ in range(self.DEPTH)] if self.pinned else []
        self.done: list[torch.cuda.Event | None] = [None] * len(self.buffers)
        self.next = 0

    def upload(self, dst: torch.Tensor, values: list[int]) -> None:
        """Copies ``values`` into ``dst`` (an int32 device tensor of their length), ordered
        on the current stream before whatever is launched next."""
        src = torch.tensor(values, dtype=torch.int32)
        if not self.pinned:
            dst.copy_(src)
            return
        i = self.next
        self.next = (i + 1) % self.DEPTH
        done = self.done[i]
        if done is not None:
            done.synchronize()
        buf = self.buffers[i][: len(values)]
        buf.copy_(src)
        dst.copy_(buf, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.done[i] = event


def _compiling() -> bool:
    return bool(torch.compiler.is_compiling())


def _capturing() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
