"""The model runner of the serving engine: everything that runs on the device.

It turns a :class:`~kvvm.serving.scheduler.SchedulerOutput` into forwards (one per prefill
run, then one decode step of every decoding slot: captured once as a CUDA graph on a GPU,
eager on a CPU) and samples their tokens (greedy at temperature 0, else at each request's
temperature). It holds each slot's last token on the device (the decode step's input) and
the captured graph. It never calls into kvvm itself: each forward is opened over the cache by
the :class:`~kvvm.serving.kv_manager.KvManager`.

Requires torch and transformers.
"""

from __future__ import annotations

from typing import Any

import torch

from .kv_manager import KvManager
from .request import Request
from .scheduler import PrefillRun, RunnerOutput, SchedulerOutput

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs the scheduled forwards of ``model`` over the KV manager's cache.

    Args:
        model: the causal LM (attending with the kvvm attention).
        slots: the cache's slots.
        device: where the model and the cache are.
        compile: compile the captured decode step (CUDA only).
        seed: the sampler's seed.
    """

    def __init__(self, model: Any, *, slots: int, device: torch.device, compile: bool = True, seed: int = 0) -> None:
        self.model = model
        self.device = device
        self.compile = compile
        self.generator = torch.Generator(device=device).manual_seed(seed)
        #: Each slot's last token: the input of its next decode step.
        self._last = torch.zeros(slots, dtype=torch.long, device=device)
        self._graph: Any = None

    def execute(self, out: SchedulerOutput, kv: KvManager) -> RunnerOutput:
        """The step's prefill runs, then its decode step; the tokens sampled."""
        result = RunnerOutput()
        for run in out.prefill:
            logits = self._prefill_forward(run, kv)
            for row, (slot, r, done) in enumerate(zip(run.slots, run.requests, run.completing, strict=True)):
                if done:
                    token = self._sample(logits[row : row + 1], [r])
                    self._last[slot] = token[0]
                    result.first_tokens[slot] = int(token[0])
        if out.decode:
            result.decode_tokens = self._decode(out.decode, out.decode_requests, kv)
        return result

    def _prefill_forward(self, run: PrefillRun, kv: KvManager) -> torch.Tensor:
        """The next ``run.tokens`` tokens of the run's requests in one forward; returns each
        row's logits at its last token."""
        n = run.tokens
        ids = torch.tensor([r._context[r._filled : r._filled + n] for r in run.requests], dtype=torch.long, device=self.device)
        first = torch.tensor([r._filled for r in run.requests], device=self.device)
        pos = first[:, None] + torch.arange(n, device=self.device)[None]
        with kv.prefill(run) as cache:
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _decode(self, slots: list[int], reqs: list[Request], kv: KvManager) -> list[int]:
        """One decode step of ``slots``; their sampled tokens."""
        logits = self._decode_step(slots, kv)
        index = torch.tensor(slots, device=self.device)
        sampled = self._sample(logits.index_select(0, index), reqs)
        self._last.index_copy_(0, index, sampled)
        return [int(t) for t in sampled.tolist()]

    def _decode_step(self, slots: list[int], kv: KvManager) -> torch.Tensor:
        """The logits of one decode step of ``slots`` (the other slots are free or suspended)."""
        if self.device.type == "cuda":
            if self._graph is None:
                from ..graph import DecodeGraph

                self._graph = DecodeGraph(self.model, kv.cache, compile=self.compile, slots=slots)
            kv.prepare_decode(slots)
            return self._graph.replay(self._last)
        kv.prepare_decode(slots)
        pos = kv.decode_positions()
        out = self.model(input_ids=self._last[:, None], position_ids=pos, past_key_values=kv.cache, use_cache=True)
        return out.logits[:, -1]

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Greedy for a temperature of 0, else sampled at each request's temperature. A row
        whose probabilities are not finite (logits that are not, or a temperature so small
        that they overflow) takes its greedy token: one request's numbers never fail the
        step of the others."""
        greedy = logits.argmax(-1)
        temps = [r.temperature for r in reqs]
        if not any(temps):
            return greedy
        x = logits.float()
        t = torch.tensor([v or 1.0 for v in temps], device=logits.device, dtype=torch.float32)[:, None]
        probs = torch.softmax((x - x.amax(-1, keepdim=True)) / t, dim=-1)
        finite = torch.isfinite(probs).all(-1, keepdim=True)
        probs = torch.where(finite, probs, torch.zeros_like(probs).scatter_(1, greedy[:, None], 1.0))
        sampled = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
        hot = torch.tensor([v > 0 for v in temps], device=logits.device)
        return torch.where(hot, sampled, greedy)

    def close(self) -> None:
        """Drops the captured step (the cache can be released afterwards)."""
        if self._graph is not None:
            self._graph.close()
            self._graph = None
