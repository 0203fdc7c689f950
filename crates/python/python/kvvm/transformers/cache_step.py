"""One step of a :class:`~kvvm.transformers.KvvmCache`: what each layer's update writes and
hands attention, the kvvm mask of a forward, the checks of a step's batch and padding, and
the views of every cached token (``cache.layers[i].keys``).

:class:`CacheStep` adds these to :class:`~kvvm.transformers.cache_cascade.CacheCascade`; the
transformers ``Cache`` on top is ``KvvmCache``. Requires torch.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidArgumentError, ReleasedError
from ..kernels.fp8 import dequantize
from .attention import ATTENTION, KvvmMask
from .cache_layer import host_work
from .cache_cascade import CacheCascade

__all__ = ["CacheStep"]


class CacheStep(CacheCascade):
    """The per-step half of a KvvmCache (see the module)."""

    @property
    def device_lengths(self) -> bool:
        """Whether attention gets full-length views and device token ranges (the model
        attends with the kvvm attention) rather than exact-length views."""
        return getattr(self._config, "_attn_implementation", None) == ATTENTION

    def layer_update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s part of a forward (what its :class:`KvvmLayer` runs): writes the
        step's new ``keys``/``values`` (``[batch, kv_heads, q, head_dim]``) after each selected
        request's live tokens and returns what attention reads (exact-length views, or the
        full-length tensors when lengths live on the device)."""
        st = self.state
        if self.kv_scales is not None:
            self._check_fp8_step(keys)
        elif keys.dtype != self._torch_dtype:
            raise InvalidArgumentError(
                f"the model's K/V are {keys.dtype} and this KvvmCache holds {self._torch_dtype}: "
                f"make the cache with dtype={keys.dtype} (or pass the model itself, "
                "KvvmCache(model, ...), to take its dtype)"
            )
        self._check_batch(keys.shape[0])
        q = keys.shape[2]
        last = layer == len(self._where) - 1
        if host_work():
            self._check_step(layer, q)
        elif layer == 0 and not torch.compiler.is_compiling() and self._capturing is None:
            # ``_capturing`` is read outside a trace only: a guard on it would recompile there.
            raise InvalidArgumentError(
                "a CUDA graph is being captured over a KvvmCache without its knowledge: capture "
                "inside `with cache.capture(graph):` (or use kvvm.transformers.DecodeGraph)"
            )
        if self.device_lengths:
            # Written by the kvvm attention, with the step the kvvm mask computed (once or,
            # a mask per attention type, twice: the last layer moves the counts on).
            if last:
                st.advance(st.index(q))
                if host_work():
                    st.prepared = False
            return keys, values
        index = st.index(q)
        k_all, v_all = self._kv(layer)
        k_all[index.slot, :, index.token] = keys.transpose(1, 2)
        v_all[index.slot, :, index.token] = values.transpose(1, 2)
        if last:
            st.advance(index)
            st.prepared = False
        return self._views(layer, self._uniform_length())

    def _check_fp8_step(self, keys: torch.Tensor) -> None:
        """An FP8 cache takes K/V of a floating dtype (quantized as written) and is read by the
        kvvm attention only: any other attention would read its 8-bit bytes as they are."""
        if keys.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise InvalidArgumentError(f"an FP8 KvvmCache takes bf16, fp16 or fp32 K/V, not {keys.dtype}")
        if not self.device_lengths:
            raise InvalidArgumentError(
                "an FP8 KvvmCache is read by the kvvm attention only (it dequantizes inside its "
                "kernels): call use_kvvm_attention(model) first"
            )

    def _views(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V of the selected requests, ``length`` tokens each, from
        the first token every one of them still holds there: views, no copy."""
        st = self.state
        lo = self._exact_floor(self._where[layer][1])
        k_all, v_all = self._kv(layer)
        k_sel, v_sel = k_all.narrow(0, st.first, st.count), v_all.narrow(0, st.first, st.count)
        return k_sel.narrow(2, lo, length - lo), v_sel.narrow(2, lo, length - lo)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token layer ``layer`` holds of the selected requests (all of them, or those
        of :meth:`select`), whatever the attention: K and V ``[requests, kv_heads, tokens,
        head_dim]``, views of the cache's memory (no copy), what ``cache.layers[layer].keys``
        and ``.values`` and ``iter(cache)`` give, as a ``DynamicCache``'s do. A full-attention
        layer's start at token 0; a sliding-window layer's at the first token it still holds
        (its group gives windows back whole, so at least its window's last tokens). The
        requests must be at one length: take a ragged batch's one request at a time, inside
        ``cache.select(slot)``. The views count as views of the cache's memory: drop them
        before :meth:`release`. An FP8 cache gives copies instead, dequantized to fp32 with
        its scales (a view would be the 8-bit codes)."""
        if self._released:
            raise ReleasedError("the KvvmCache was released")
        st = self.state
        lengths = sorted({st.host_lengths[i] for i in st.selected})
        if len(lengths) != 1:
            raise InvalidArgumentError(
                f"the selected requests hold {lengths[0]} to {lengths[-1]} tokens: take each "
                "request's K/V inside `with cache.select(slot):`"
            )
        k, v = self._views(layer, lengths[0])
        if self.kv_scales is not None:
            scales = self.kv_scales[layer]
            return dequantize(k, scales[0], torch.float32), dequantize(v, scales[1], torch.float32)
        return k, v

    def _exact_floor(self, group: int, q: int = 0) -> int:
        """Where exact-length views of ``group`` start: the first token every selected request
        keeps there once the step is prepared (0 for full attention). ``q``: the step's
        tokens, when it is not prepared yet (what its preparation will forget is known)."""
        g = self.groups[group]
        if not g.spec.sliding:
            return 0
        st = self.state
        if q:
            return max(g.next_floor(i, st.host_lengths[i]) for i in st.selected)
        return max(g.host_floors[i] for i in st.selected)

    def _check_batch(self, batch: int) -> None:
        """A forward of ``batch`` sequences over the selected slots: one each."""
        count = self.state.count
        if batch != count:
            raise InvalidArgumentError(
                f"a batch of {batch} sequences for {count} KvvmCache slot(s): make the "
                "cache with one slot per sequence (requests x num_return_sequences). Beam search "
                "(num_beams > 1) is not supported: KvvmCache does not reorder its slots"
            )

    def _check_step(self, layer: int, q: int) -> None:
        """Eagerly, at the first layer: the step is prepared (with exact-length views the
        update prepares it; with the kvvm attention the kvvm mask must have)."""
        if layer != 0:
            return
        if self._released:
            raise ReleasedError("the KvvmCache was released")
        if self.state.prepared:
            return
        if self.device_lengths:
            raise InvalidArgumentError(
                "the step has no kvvm mask: with the kvvm attention, pass no attention mask of "
                "your own (or a 2-D padding mask) so that the cache's mask is built"
            )
        self.state.prepare(q)

    def _uniform_length(self) -> int:
        lengths = {self.state.host_lengths[i] for i in self.state.selected}
        if len(lengths) != 1:
            raise InvalidArgumentError(
                "requests of different lengths need the kvvm attention (use_kvvm_attention(model))"
            )
        return lengths.pop()

    def step_mask(self, q: int, padding_mask: Any, batch: Any = None) -> KvvmMask:
        """The kvvm mask of the next forward of ``batch`` sequences: the step's device work
        (where each request's new tokens go, each request's tokens after them, the counts
        moved on), after its host work when Python runs eagerly (the forward's batch checked
        against the selected slots, then the step's tokens committed and claimed; from a 2-D
        padding mask, a new batch's left padding recorded). A mask already made for this
        forward (``generate`` makes it before the forward) is handed back as it is."""
        if isinstance(padding_mask, KvvmMask):
            return padding_mask
        st = self.state
        if host_work():
            if self._released:
                raise ReleasedError("the KvvmCache was released")
            if isinstance(batch, int):
                self._check_batch(batch)
            if isinstance(padding_mask, torch.Tensor) and padding_mask.dim() == 2:
                self._check_batch(int(padding_mask.shape[0]))
                self._prepare_from_padding(q, padding_mask)
            elif not st.prepared:
                st.prepare(q)
        index, bounds = st.bounds(q)
        assert self._slab is not None
        mask = KvvmMask(
            bounds=bounds, slot=index.slot, token=index.token, slab=self._slab, layouts=self._layouts,
            cascade=self.cascade_tables() if q == 1 else None,
            layer_scales=self._layer_scales,
        )
        if self._layer_slabs is not None:
            group_bounds = [g.bounds(bounds, st.first, st.count) for g in self.groups]
            mask.layer_slabs = self._layer_slabs
            mask.layer_bounds = [group_bounds[g] for _, g, _ in self._where]
            mask.windows = [self.groups[g].window for _, g, _ in self._where]
        return mask

    def _prepare_from_padding(self, q: int, mask: torch.Tensor) -> None:
        """``generate``'s step: ``mask`` covers every request's tokens so far and the step's.
        Prepared once per step (``generate`` may build the mask, then the forward again)."""
        st = self.state
        length = self._uniform_length()
        if st.prepared and length == mask.shape[-1]:
            return
        self._check_padding(q, mask)
        st.prepare(q)

    def _check_padding(self, q: int, mask: torch.Tensor) -> None:
        """A 2-D mask of ``generate``: every request's tokens so far plus the step's, padded
        on the left. A new batch's padding is recorded (never read); afterwards the mask must
        match the cache's length."""
        st = self.state
        length = self._uniform_length()
        if mask.shape[-1] != length + q:
            raise InvalidArgumentError(
                f"the attention mask covers {mask.shape[-1]} tokens; the cache holds {length} "
                f"and the step adds {q}"
            )
        if length:
            return
        m = mask.to(torch.bool)
        starts = (~m).to(torch.int32).cumprod(-1).sum(-1)
        live = m.sum(-1)
        if not bool(torch.equal(live + starts, torch.full_like(live, m.shape[-1]))):
            raise InvalidArgumentError("KvvmCache takes left padding only (ones after the first one)")
        sel = st.selected
        st.set_lengths({i: 0 for i in sel}, {i: int(s) for i, s in zip(sel, starts.tolist(), strict=True)})

    def layer_mask_sizes(self, q: int, layer: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of a step of ``q`` tokens at ``layer`` (its
        ``get_mask_sizes``): the reservation's length with device lengths, else the exact
        one, from the first token the layer's group keeps."""
        if self.device_lengths:
            return self._max_len, 0
        end = max(self.state.host_lengths[i] for i in self.state.selected) + q
        lo = self._exact_floor(self._where[layer][1], q)
        return end - lo, lo
