"""What a :class:`~kvvm.transformers.KvvmCache` knows of the prefixes its requests share, for
the cascade decode (:mod:`kvvm.kernels.cascade`): requests whose first tokens are one prefix's,
byte for byte, have that prefix read once per step for all of them.

A cache made by ``KvvmCache.from_prefix`` shares its prefix in every slot; an engine marks the
slots its prefix cache hit (:meth:`CacheCascade.share_prefix`). The groups live in device
tables the captured step reads (allocated when the cache is made with ``cascade=True`` or by
``from_prefix``, rewritten in place before each step whose grouping changed), so a graph
replays correctly as requests join and leave. A slot freed, cropped below its prefix or reset
shares nothing any more.

:class:`CacheCascade` sits between :class:`~kvvm.transformers.cache_memory.CacheMemory` and
:class:`~kvvm.transformers.cache_step.CacheStep`. Requires torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError
from .cache_layer import host_work
from .cache_memory import CacheMemory

if TYPE_CHECKING:
    from ..kernels.cascade import CascadeTables, Share, Tables

__all__ = ["CacheCascade"]


class CacheCascade(CacheMemory):
    """The shared prefixes of a cache's slots and the device tables of their groups (see the
    module). ``cascade``: whether the tables exist from the start (a captured step reads
    them only if they existed when it was captured)."""

    def __init__(self, *args: Any, cascade: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shares: list[Share | None] = [None] * self.batch_size
        self._tables: CascadeTables | None = None
        self._tables_stale = False
        if cascade:
            self._make_tables()

    @property
    def cascade(self) -> bool:
        """Whether decode steps read shared prefixes once per group (tables exist, and every
        layer attends to every token: a sliding window shares nothing once it moved on)."""
        return self._tables is not None

    @property
    def prefix_splits(self) -> int:
        """The splits of each prefix work item along its prefix's tokens
        (:func:`~kvvm.kernels.cascade.choose_prefix_splits`; 0: no tables)."""
        return 0 if self._tables is None else self._tables.prefix_splits

    @property
    def prefix_rows(self) -> int:
        """The most query rows a prefix work item takes (:class:`~kvvm.kernels.cascade.CascadeTables`;
        0: no tables)."""
        return 0 if self._tables is None else self._tables.rows

    def share_prefix(self, slots: Iterable[int], key: Hashable, tokens: int) -> None:
        """Records that the first ``tokens`` tokens of each slot in ``slots`` are prefix
        ``key``'s, the same bytes in every slot that shares ``key`` with the same ``tokens``
        (a prefix mapped or copied from one source: ``from_prefix``, a prefix-cache hit).
        The record ends when the slot is freed, reset or cropped below ``tokens``, or with
        ``tokens=0``; a step may read a group's prefix through any member's slot, so a slot
        whose windows are to be unmapped otherwise (a swap to the host) is unshared first."""
        slots = list(slots)
        if tokens < 0:
            raise InvalidArgumentError(f"a prefix of {tokens} tokens")
        for slot in slots:
            if not 0 <= slot < self.batch_size:
                raise InvalidArgumentError(f"slot {slot} is not one of the {self.batch_size} slots")
        from ..kernels.cascade import Share

        for slot in slots:
            self._shares[slot] = Share(key, slot, self.state.host_starts[slot], tokens) if tokens else None
        self._tables_stale = True

    def shared_tokens(self, slot: int) -> int:
        """The tokens of ``slot`` recorded as a shared prefix's (0: none)."""
        share = self._shares[slot]
        return 0 if share is None else share.tokens

    def shared_prefix(self, slot: int) -> tuple[Hashable, int] | None:
        """The prefix ``slot`` shares, as given to :meth:`share_prefix`: its key and tokens
        (None: none)."""
        share = self._shares[slot]
        return None if share is None else (share.key, share.tokens)

    def cascade_tables(self) -> Tables | None:
        """The tables a step of the selected slots reads (None: no cascade): rewritten first
        when the grouping changed, outside a captured or compiled step."""
        if self._tables is None or self.state.count != self.batch_size:
            return None
        if self._tables_stale and host_work():
            self._refresh()
        return self._tables.tables

    def prepare(self, q: int = 1, slots: list[int] | None = None) -> None:
        """As :meth:`CacheMemory.prepare`, the groups' tables brought up to date first."""
        if self._tables is not None and self._tables_stale:
            self._refresh()
        super().prepare(q, slots)

    def free(self, slot: int) -> int:
        """As :meth:`CacheMemory.free`; the slot shares nothing any more."""
        freed = super().free(slot)
        self._drop([slot])
        return freed

    def crop_tokens(self, tokens: int) -> None:
        """As :meth:`CacheMemory.crop_tokens`; a slot left shorter than its shared prefix
        shares nothing any more."""
        super().crop_tokens(tokens)
        lengths = self.state.host_lengths
        self._drop([i for i, s in enumerate(self._shares) if s is not None and lengths[i] < s.tokens])

    def reset_counts(self) -> None:
        """As :meth:`CacheMemory.reset_counts`; no slot shares anything any more."""
        super().reset_counts()
        self._drop(range(self.batch_size))

    def _drop(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if self._shares[slot] is not None:
                self._shares[slot] = None
                self._tables_stale = True
        if self._tables is not None and self._tables_stale:
            self._refresh()

    def _make_tables(self) -> None:
        """The tables, sized for a step of every slot (a cache whose layers slide has none)."""
        if any(g.spec.sliding for g in self.groups):
            return
        from ..kernels.device import multiprocessors
        from ..kernels.cascade import CascadeTables, choose_prefix_splits

        device = self.state.device
        heads = int(self._config.num_attention_heads)
        splits = choose_prefix_splits(
            self.batch_size, heads, self.geometry.kv_heads, self._max_len, multiprocessors(device),
        )
        self._tables = CascadeTables(
            self.batch_size, device, prefix_splits=splits, heads_per_kv=heads // self.geometry.kv_heads,
            kv_heads=self.geometry.kv_heads,
        )
        self._tables_stale = True

    def _refresh(self) -> None:
        """The groups written in place (on the device's stream, before the next step)."""
        assert self._tables is not None
        self._tables.update(self._shares)
        self._tables_stale = False
