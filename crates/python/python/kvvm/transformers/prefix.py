"""Prompt prefixes prefilled once into shared kvvm memory and given to new requests:
:class:`KvvmPrefix`.

A prefix is laid out like the cache it feeds: one shared prefix per layer group of the model
(:mod:`kvvm.transformers.cache_groups`). A full-attention group's prefix is given to a request as kvvm gives
any shared prefix: its whole windows mapped read-only (billed once), its bytes past them copied
into the request's own windows, so that the request never writes into read-only memory,
whatever the model's bytes per token. A sliding-window group reads only the last ``window - 1``
tokens before a step: a request takes only those, by copy, and forgets the tokens before them
from the start (its sliding layers then give their oldest windows back as they decode, as they
do for any request). Across processes each group's prefix is published under its own key
(:func:`group_key`).

Requires torch and transformers.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ..bindings import (
    PREFIX_META_BYTES, LayoutPlan, Manager, SequenceBatch, SharedPrefix, decoder_config, geometry_from_config,
)
from ..errors import InvalidArgumentError
from ..kernels.fp8 import kv_storage
from .architectures import check_servable
from .cache import KvvmCache, cache_argument
from .cache_groups import LayerGroup, group_plan, layer_groups
from .prefix_meta import Published, describe

__all__ = ["KvvmPrefix", "group_key"]


def group_key(key: str, group: int) -> str:
    """The broker key of layer group ``group``'s prefix published under ``key``: ``key`` for
    the first group, ``key:1`` for the second (a model has at most a full-attention and a
    sliding-window group)."""
    return key if group == 0 else f"{key}:{group}"


def _plans(model: Any, manager: Manager, max_cache_len: int, layout: str, dtype: Any) -> tuple[Any, list[LayerGroup], list[LayoutPlan]]:
    """The decoder config, the layer groups and each group's plan of a prefix of ``model``
    (the model's dtype unless ``dtype`` is given): one for the process that builds it and
    those that open it."""
    check_servable(model)
    cfg = decoder_config(model.config)
    if dtype is None and isinstance(getattr(model, "dtype", None), torch.dtype):
        dtype = model.dtype
    geometry = geometry_from_config(cfg, max_cache_len, dtype)
    specs = layer_groups(cfg, max_cache_len)
    return cfg, specs, [group_plan(spec, geometry, layout, manager.granule) for spec in specs]


class KvvmPrefix:
    """A prompt prefix prefilled once into shared kvvm memory, to be given to new requests
    with :meth:`KvvmCache.from_prefix <kvvm.transformers.KvvmCache.from_prefix>`.

    Build it with :meth:`build` (keep it alive while caches made from it live: it holds the
    owner's sequences) or :meth:`open` one another process published.

    An FP8 prefix (``kv_dtype="fp8_e4m3"``, :mod:`kvvm.kernels.fp8`) keeps the scales its
    tokens were written with (:attr:`kv_scales`) and gives them to every cache made from it;
    it publishes them with its KV dtype and geometry, and a process that opens it reads them
    from there (:mod:`kvvm.transformers.prefix_meta`).
    """

    def __init__(
        self,
        config: Any,
        manager: Manager,
        specs: list[LayerGroup],
        plans: list[LayoutPlan],
        cache: KvvmCache | None,
        shares: list[SharedPrefix],
        kv_scales: Any = None,
    ) -> None:
        self.config = config
        #: An FP8 prefix's scales (what :meth:`KvvmCache.from_prefix
        #: <kvvm.transformers.KvvmCache.from_prefix>` reads its tokens with); None otherwise
        #: (or the default scales of an FP8 prefix opened without any).
        self.kv_scales = kv_scales
        self.manager = manager
        #: The model's layer groups and each one's plan and shared prefix, in the cache's order.
        self.specs = specs
        self.plans = plans
        self.shares = shares
        #: The owner's cache (None for a prefix opened from another process).
        self.cache = cache
        #: The prefill's logits at the prefix's last token (``[1, vocab]``), set by :meth:`build`.
        self.last_logits: torch.Tensor | None = None

    @property
    def plan(self) -> LayoutPlan:
        """The first layer group's plan (the only one of a full-attention model)."""
        return self.plans[0]

    @property
    def shared(self) -> SharedPrefix:
        """The first layer group's shared prefix (the only one of a full-attention model)."""
        return self.shares[0]

    @property
    def tokens(self) -> int:
        """The prefix's length in tokens."""
        return self.shares[0].tokens

    @property
    def bytes(self) -> int:
        """Physical bytes of the prefix in every layer group, read-only windows and tails
        (billed once)."""
        return sum(s.bytes for s in self.shares)

    def publish(self, key: str) -> int:
        """Publishes the prefix to the node's memory broker under ``key`` (its manager leases
        from one: ``Manager(broker=...)``), each layer group's under :func:`group_key`: other
        processes of the tenant :meth:`open` it and take the same memory, billed once to the
        tenant. With each group's handles go its KV dtype, geometry and layout and an FP8
        prefix's scales (:func:`~kvvm.transformers.prefix_meta.describe`): what an opener
        reads it with. Returns the bytes published. Let go of it with :meth:`close`."""
        return sum(
            s.publish(self.manager, group_key(key, g), describe(p, self.kv_scales, PREFIX_META_BYTES))
            for g, (s, p) in enumerate(zip(self.shares, self.plans, strict=True))
        )

    def close(self, key: str) -> int:
        """Lets go of the prefix published or opened under ``key`` once in this process (every
        layer group's); returns the users the first group's prefix has left (0: the broker
        freed it)."""
        left = [self.manager.close_prefix(group_key(key, g)) for g in range(len(self.shares))]
        return left[0]

    @classmethod
    def open(
        cls,
        model: Any,
        key: str,
        *,
        manager: Manager,
        max_cache_len: int,
        layout: str = "token-major",
        dtype: Any = None,
        kv_dtype: Any = None,
        kv_scales: Any = None,
    ) -> KvvmPrefix:
        """The prefix another process published under ``key`` (:meth:`publish`), through
        ``manager`` (leasing from the same broker, as the same tenant). ``max_cache_len`` and
        ``layout`` must be the publisher's. The KV dtype and an FP8 prefix's scales are the
        published ones: ``dtype``/``kv_dtype`` and ``kv_scales`` may be left out (None), and
        given ones that differ from them are refused, as are a geometry, maximum length or
        layout that differ (``InvalidArgumentError``; nothing stays opened). A prefix whose
        FP8 scales were too many to publish carries their digest: pass ``kv_scales`` then. A
        prefix published without them (an older kvvm) is read as ``dtype`` (None: the
        model's) and refused as FP8 (its scales cannot be checked). Its :attr:`tokens` are
        the publisher's prompt: prefill the rest of each prompt from there. Not billed here (a
        request pays for the windows it copies into); :attr:`last_logits` is None."""
        opening = _Opening(model, manager, max_cache_len, layout, dtype, kv_dtype, kv_scales, key)
        shares: list[SharedPrefix] = []
        try:
            for g in range(opening.groups):
                shares.append(SharedPrefix.open(manager, group_key(key, g), partial(opening.plan, g)))
        except Exception:
            for g in range(len(shares)):
                manager.close_prefix(group_key(key, g))
            raise
        if len({s.tokens for s in shares}) != 1:
            raise InvalidArgumentError(f"the layer groups of the prefix {key!r} hold different token counts")
        return cls(opening.cfg, manager, opening.specs, opening.plans, None, shares, opening.kv_scales)

    @classmethod
    @torch.no_grad()
    def build(
        cls,
        model: Any,
        input_ids: torch.Tensor,
        *,
        manager: Manager,
        max_cache_len: int,
        layout: str = "token-major",
        dtype: Any = None,
        kv_dtype: Any = None,
        kv_scales: Any = None,
    ) -> KvvmPrefix:
        """Prefills ``input_ids`` (``[1, P]``) with ``model`` into a new shared prefix: in each
        layer group, the owner sequence commits the prefix's windows as shared memory and the
        model writes its K/V there; then each is sealed read-only (its tail copied). Returns
        the prefix, with the owner's logits in :attr:`last_logits`. ``kv_dtype``,
        ``kv_scales``: as :class:`~kvvm.transformers.KvvmCache`'s (an FP8 prefix is prefilled
        with the kvvm attention: :func:`~kvvm.transformers.use_kvvm_attention` first)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InvalidArgumentError("input_ids must be [1, prefix_tokens]")
        prompt = int(input_ids.shape[1])
        cfg, specs, plans = _plans(model, manager, max_cache_len, layout, kv_storage(kv_dtype, dtype))
        batches = [SequenceBatch(manager, plan, 2, max_cache_len) for plan in plans]
        shares = [b[0].own_prefix(prompt) for b in batches]
        cache = KvvmCache(
            cfg, 1, max_cache_len, manager=manager, layout=layout, dtype=plans[0].geometry.dtype, batch=batches,
            kv_scales=kv_scales,
        )
        pos = torch.arange(prompt, device=input_ids.device)[None]
        out = model(input_ids=input_ids, use_cache=True, position_ids=pos, **{cache_argument(model): cache})
        if input_ids.device.type == "cuda":
            torch.cuda.synchronize(input_ids.device)
        for s in shares:
            s.seal()
        prefix = cls(cfg, manager, specs, plans, cache, shares, cache.kv_scales)
        prefix.last_logits = out.logits[:, -1]
        return prefix

    def batches_for(self, batch_size: int, max_cache_len: int, precommit: bool) -> tuple[list[SequenceBatch], list[int]]:
        """Each layer group's batch of ``batch_size`` requests (and the scratch slot) that all
        start with the prefix, and the first token each group keeps: a full group's requests
        map its whole windows and copy the rest (0), a sliding group's take its last tokens by
        copy (what the first step after it reads)."""
        if max_cache_len < self.tokens:
            raise InvalidArgumentError("max_cache_len is shorter than the prefix")
        batches: list[SequenceBatch] = []
        firsts: list[int] = []
        for spec, plan, share in zip(self.specs, self.plans, self.shares, strict=True):
            batch = SequenceBatch(
                self.manager, plan, batch_size + 1, max_cache_len,
                precommit=precommit and self.manager.precommit, window_handles=spec.sliding,
            )
            first = spec.kept_from(self.tokens)
            for i in range(batch_size):
                if spec.sliding:
                    share.attach(batch[i], first=first)
                else:
                    share.attach(batch[i])
            batches.append(batch)
            firsts.append(first)
        return batches, firsts


class _Opening:
    """The plans :meth:`KvvmPrefix.open` maps a published prefix's layer groups with: chosen
    when the first group's reader words arrive (the published KV dtype unless the opener
    named one), each group's words checked against its plan."""

    def __init__(
        self, model: Any, manager: Manager, max_cache_len: int, layout: str, dtype: Any, kv_dtype: Any, kv_scales: Any,
        key: str,
    ) -> None:
        self.args = (model, manager, max_cache_len, layout)
        self.asked = kv_storage(kv_dtype, dtype)
        self.passed_scales = kv_scales
        self.key = key
        self.cfg: Any = None
        self.specs: list[LayerGroup] = []
        self.plans: list[LayoutPlan] = []
        self.kv_scales: Any = None
        self.words = False
        check_servable(model)
        self.groups = len(layer_groups(decoder_config(model.config), max_cache_len))

    def plan(self, group: int, words: str) -> LayoutPlan:
        """Group ``group``'s plan, given the reader words it was published with (the first
        group's choose the plans; every other group's must say the same scales)."""
        published = Published(self.key, words)
        if not self.plans:
            self._choose(published)
            self.words = bool(words)
            return self.plans[0]
        plan = self.plans[group]
        if bool(words) != self.words:
            raise InvalidArgumentError(
                f"the layer groups of the prefix {self.key!r} were published by different kvvm versions"
            )
        published.check(plan)
        scales = published.scales(plan, self.passed_scales) if words else None
        if scales is not None and not torch.equal(scales, self.kv_scales):
            raise InvalidArgumentError(
                f"the layer groups of the prefix {self.key!r} were published with different scales"
            )
        return plan

    def _choose(self, published: Published) -> None:
        """The plans and scales: the published dtype unless one was asked for."""
        storage = self.asked
        if storage is None and published.dtype is not None:
            storage = published.dtype
        self.cfg, self.specs, self.plans = _plans(*self.args, storage)
        plan = self.plans[0]
        if published.dtype is None:
            if plan.geometry.dtype == "fp8":
                raise InvalidArgumentError(
                    f"the prefix {self.key!r} was published without its KV dtype and scales (an older kvvm): "
                    "its bytes cannot be checked as FP8; publish it again"
                )
            if self.passed_scales is not None:
                raise InvalidArgumentError(f"kv_scales are an FP8 prefix's; this one holds {plan.geometry.dtype}")
            return
        published.check(plan)
        self.kv_scales = published.scales(plan, self.passed_scales)
