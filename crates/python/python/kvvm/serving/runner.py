"""The model runner of the serving engine: everything that runs on the device.

It turns a :class:`~kvvm.serving.scheduler.SchedulerOutput` into forwards (one per prefill
run, then one decode step of every decoding slot: captured once as a CUDA graph on a GPU,
eager on a CPU) and samples their tokens with each request's own sampling parameters
(:class:`~kvvm.serving.sampling.Sampler`: every request of the step in one pass, on the
device). It holds each slot's last token on the device (the decode step's input) and the
captured graph. The first tokens of the requests whose prefill ended and the decode's tokens
are read back together, in one copy: the step's one sync. It never calls into kvvm itself: each forward is opened over the cache by
the :class:`~kvvm.serving.kv_manager.KvManager`.

Requires torch and transformers.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..kernels.device import programmatic_launches
from ..kernels.tuning import untuned
from ..transformers.products import TunedProducts, tuned_products as tune_products
from ..transformers.projections import FusedProjections, fuse_projections as fuse
from .kv_manager import KvManager
from .request import Request
from .sampling import Sampled, Sampler, to_host
from .scheduler import PrefillRun, RunnerOutput, SchedulerOutput

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs the scheduled forwards of ``model`` over the KV manager's cache.

    Args:
        model: the causal LM (attending with the kvvm attention).
        slots: the cache's slots.
        device: where the model and the cache are.
        compile: compile the captured decode step (CUDA only).
        fuse_projections: fuse the model's sibling projections until :meth:`close`
            (:func:`kvvm.transformers.fuse_projections`).
        tuned_products: run the model's products through ``kvvm::linear`` until
            :meth:`close` (:func:`kvvm.transformers.tuned_products`, after the fusion).
        programmatic_launches: capture the decode step with its kernels launching as
            programmatic dependents (:func:`kvvm.kernels.device.programmatic_launches`;
            on Hopper and later GPUs; both switches as they were after the capture).
    """

    def __init__(
        self, model: Any, *, slots: int, device: torch.device, compile: bool = True, fuse_projections: bool = False,
        tuned_products: bool = False, programmatic_launches: bool = False,
    ) -> None:
        self.model = model
        self.programmatic_launches = programmatic_launches
        self._fused: FusedProjections | None = fuse(model) if fuse_projections else None
        try:
            self._tuned: TunedProducts | None = tune_products(model) if tuned_products else None
        except BaseException:
            # The model as it came: the fusion undone.
            if self._fused is not None:
                self._fused.restore()
            raise
        self.device = device
        self.compile = compile
        self.sampler = Sampler(slots, device)
        #: Each slot's last token: the input of its next decode step.
        self._last = torch.zeros(slots, dtype=torch.long, device=device)
        self._graph: Any = None

    def execute(self, out: SchedulerOutput, kv: KvManager) -> RunnerOutput:
        """The step's prefill runs, then its decode step; the tokens sampled (read back once)."""
        result = RunnerOutput()
        rows: list[tuple[torch.Tensor, int, Request]] = []
        for run in out.prefill:
            logits = self._prefill_forward(run, kv)
            for row, (slot, r, done) in enumerate(zip(run.slots, run.requests, run.completing, strict=True)):
                if done:
                    rows.append((logits[row], slot, r))
        parts: list[Sampled] = []
        if rows:
            parts.append(self._sample_first(rows))
        if out.decode:
            parts.append(self._decode(out.decode, out.decode_requests, {r.id for _, _, r in rows}, kv))
        host = to_host(parts)
        if rows:
            tokens, lps = host[0]
            for (_, slot, _), token, lp in zip(rows, tokens, lps, strict=True):
                result.first_tokens[slot] = token
                if lp is not None:
                    result.first_logprobs[slot] = lp
        if out.decode:
            result.decode_tokens, decode_lps = host[-1]
            if parts[-1].logprobs is not None:
                result.decode_logprobs = decode_lps
        return result

    def _sample_first(self, rows: list[tuple[torch.Tensor, int, Request]]) -> Sampled:
        """The first token of each request whose prefill ended (their slots' last tokens)."""
        logits = torch.stack([row for row, _, _ in rows])
        slots = [s for _, s, _ in rows]
        reqs = [r for _, _, r in rows]
        for s, r in zip(slots, reqs, strict=True):
            self.sampler.start(s, r, logits.shape[-1])
        sampled = self.sampler.sample(logits, slots, reqs, [len(r.tokens) for r in reqs])
        self._last.index_copy_(0, torch.tensor(slots, device=self.device), sampled.tokens)
        return sampled

    def _prefill_forward(self, run: PrefillRun, kv: KvManager) -> torch.Tensor:
        """The next ``run.tokens`` tokens of the run's requests in one forward; returns each
        row's logits at its last token."""
        n = run.tokens
        ids = torch.tensor([r._context[r._filled : r._filled + n] for r in run.requests], dtype=torch.long, device=self.device)
        first = torch.tensor([r._filled for r in run.requests], device=self.device)
        pos = first[:, None] + torch.arange(n, device=self.device)[None]
        # A forward that runs once: a one-token run (a request swapped back in) times no
        # decode-kernel configurations for its batch size while every request waits.
        with untuned(), kv.prefill(run) as cache:
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _decode(self, slots: list[int], reqs: list[Request], first: set[int], kv: KvManager) -> Sampled:
        """One decode step of ``slots``; their sampled tokens (on the device). A request in
        ``first`` had its first token sampled this step: this one is its next."""
        logits = self._decode_step(slots, kv)
        index = torch.tensor(slots, device=self.device)
        indices = [len(r.tokens) + (r.id in first) for r in reqs]
        sampled = self.sampler.sample(logits.index_select(0, index), slots, reqs, indices)
        self._last.index_copy_(0, index, sampled.tokens)
        return sampled

    def _capture(self, slots: list[int], kv: KvManager) -> Any:
        """The decode step captured (:class:`~kvvm.transformers.DecodeGraph`), its kernels
        launching as programmatic dependents where asked (the step's kernels keep it in every
        replay; a step the compiler compiled before with the same code and guards may be
        reused as it was)."""
        from ..transformers.graph import DecodeGraph

        with programmatic_launches() if self.programmatic_launches else contextlib.nullcontext():
            return DecodeGraph(self.model, kv.cache, compile=self.compile, slots=slots)

    def _decode_step(self, slots: list[int], kv: KvManager) -> torch.Tensor:
        """The logits of one decode step of ``slots`` (the other slots are free or suspended)."""
        if self.device.type == "cuda":
            if self._graph is None:
                self._graph = self._capture(slots, kv)
            kv.prepare_decode(slots)
            return self._graph.replay(self._last)
        kv.prepare_decode(slots)
        pos = kv.decode_positions()
        out = self.model(input_ids=self._last[:, None], position_ids=pos, past_key_values=kv.cache, use_cache=True)
        return out.logits[:, -1]

    def close(self) -> None:
        """Drops the captured step (the cache can be released afterwards) and gives the
        model back its own modules (the fused and tuned ones undone, last made first)."""
        if self._graph is not None:
            self._graph.close()
            self._graph = None
        for change in (self._tuned, self._fused):
            if change is not None:
                change.restore()
        self._tuned = self._fused = None
