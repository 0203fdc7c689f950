"""The cascade's prefix pass tuned beside its private pass (:func:`tuned_prefix_config`):
its configurations (:class:`~kvvm.kernels.cascade.PrefixConfig`) timed on the cascade's own
call, in a launch of its own or in the private pass's, and the fastest remembered per shape
and private configuration."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator

from . import triton_decode
from .cascade import _ROWS, PrefixConfig
from .triton_decode import TOO_BIG, Config
from .tuning import graph_time

__all__ = [
    "pinned_prefix_config", "prefix_candidates", "tuned_prefix_config", "tuned_prefix_configs", "tuned_prefix_timings",
]

#: The prefix pass's configurations :func:`tuned_prefix_config` times beside the private
#: pass's own.
_PREFIX_SHAPES = (PrefixConfig(64, 4, 2), PrefixConfig(64, 4, 3), PrefixConfig(64, 8, 3), PrefixConfig(32, 4, 3),
                  PrefixConfig(128, 8, 3), PrefixConfig(64, 16, 2), PrefixConfig(64, 16, 3))

#: The prefix pass's blocks :func:`tuned_prefix_config` times as well in the private pass's
#: launch (a private pass of one split, tables of at most :data:`_TOGETHER_ROWS` rows an item).
_TOGETHER_BLOCKS = (32, 64)

#: The most query rows an item may take for the prefix pass to be timed in the private pass's
#: launch: at 64 its programs spill (:data:`_ROWS`).
_TOGETHER_ROWS = 32

#: The prefix pass's configuration measured fastest per shape and private configuration.
_TUNED_PREFIX: dict[tuple[object, ...], PrefixConfig] = {}

#: The configuration :func:`pinned_prefix_config` holds (None: tuned).
_PINNED: list[PrefixConfig | None] = [None]

#: Every prefix configuration's time per key of :data:`_TUNED_PREFIX`, the fastest first.
_PREFIX_TIMINGS: dict[tuple[object, ...], list[tuple[float, PrefixConfig]]] = {}


def tuned_prefix_config(
    key: Hashable, config: Config, timed: Callable[[PrefixConfig], object], rows: int = _ROWS,
) -> PrefixConfig | None:
    """The prefix pass's fastest configuration beside the private pass's ``config``, measured
    once by ``timed`` (the cascade's whole call in a configuration, replayed in a captured
    graph) per ``key`` (the call's shape) and ``config``, and remembered; None (the private
    pass's own) where nothing may be timed (:mod:`kvvm.kernels.tuning`'s rules, Triton's
    interpreter, ``KVVM_TRITON_AUTOTUNE=0``) and the shape was not tuned before; inside
    :func:`pinned_prefix_config`, the pinned configuration. ``rows``: the
    query rows of the tables' items (:func:`prefix_candidates`)."""
    pinned = _PINNED[0]
    if pinned is not None:
        return PrefixConfig(pinned.block, pinned.warps, pinned.stages) if pinned.counted and config.splits != 1 else pinned
    found = _TUNED_PREFIX.get((key, config))
    if found is not None:
        return found
    if not triton_decode.may_tune():
        return None
    timings: list[tuple[float, int, PrefixConfig]] = []
    for i, pc in enumerate(prefix_candidates(config, rows)):
        try:
            timings.append((graph_time(timed, pc, cold=True), i, pc))
        except TOO_BIG:
            continue  # more shared memory or registers than the device has
    chosen = min(timings, key=lambda t: (t[0], t[1]))[2]
    _TUNED_PREFIX[(key, config)] = chosen
    _PREFIX_TIMINGS[(key, config)] = [(ms, pc) for ms, _, pc in sorted(timings, key=lambda t: (t[0], t[1]))]
    return chosen


@contextlib.contextmanager
def pinned_prefix_config(pc: PrefixConfig | None) -> Iterator[None]:
    """Within the block, :func:`tuned_prefix_config` answers ``pc`` at every shape, timing
    nothing (None: tuned, as outside it): what a benchmark pins to measure one configuration
    in the captured step rather than in the tuner's call alone. A ``together`` or
    ``concurrent`` ``pc`` runs as a launch of its own in its block, warps and stages beside a
    private pass of more than one split (neither runs with one). A step captured in the block
    keeps the configuration after it. Process-wide; the pin as it was after the block."""
    before = _PINNED[0]
    _PINNED[0] = pc
    try:
        yield
    finally:
        _PINNED[0] = before


def prefix_candidates(config: Config, rows: int = _ROWS) -> list[PrefixConfig]:
    """The prefix pass's configurations :func:`tuned_prefix_config` times beside the private
    pass's ``config`` over tables of items of ``rows`` query rows: a launch of its own in the
    private pass's block, warps and stages and in each of :data:`_PREFIX_SHAPES`, and (a
    private pass of one split, at most :data:`_TOGETHER_ROWS` rows) in the private pass's
    launch at each of :data:`_TOGETHER_BLOCKS`, its programs first and last."""
    own = PrefixConfig(config.block, config.warps, config.stages)
    together = [
        PrefixConfig(b, config.warps, config.stages, True, first)
        for b in _TOGETHER_BLOCKS for first in (True, False) if config.splits == 1 and rows <= _TOGETHER_ROWS
    ]
    return list(dict.fromkeys((own, *_PREFIX_SHAPES, *together)))


def tuned_prefix_configs() -> dict[str, PrefixConfig]:
    """The prefix pass's configurations :func:`tuned_prefix_config` chose so far, each under
    its shape and the private pass's configuration."""
    return {f"{key}, private {config}": chosen for (key, config), chosen in _TUNED_PREFIX.items()}


def tuned_prefix_timings(top: int = 5) -> dict[str, list[tuple[PrefixConfig, float]]]:
    """The ``top`` fastest prefix configurations :func:`tuned_prefix_config` measured per key
    of :func:`tuned_prefix_configs`, each with the cascade call's time (ms), fastest first."""
    return {f"{key}, private {config}": [(pc, ms) for ms, pc in t[:top]] for (key, config), t in _PREFIX_TIMINGS.items()}
